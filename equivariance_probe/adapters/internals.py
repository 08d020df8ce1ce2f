"""Inside a Hugging Face model's attention: queries, keys, pre-softmax scores, and ablations.

Place in the seams: *adapters*, framework code for ``transformers`` models (like
:mod:`~equivariance_probe.adapters.huggingface`), used by the analyses of where order comes
from (:mod:`~equivariance_probe.analyses.positional`, :mod:`~equivariance_probe.analyses.order`).
TransformerLens bridges and nnsight models are unwrapped to the Hugging Face model inside them
(:func:`~equivariance_probe.adapters.modules.hf_model_of`): the raw weights, never
TransformerLens' processed ones.

Every ``transformers`` 5 attention module (Gemma 3, Llama, Mistral, GPT-2, BERT, ...) calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``
with ``(module, query, key, value, attention_mask, scaling=..., softcap=...)``.
:func:`intercept_attention` puts a function in front of the ``"eager"`` entry for the duration
of a ``with`` block: it sees the queries and keys after rotary embeddings and q/k norms, can
drop the mask, and then calls the module's own eager function, so the model computes exactly
what it computes without it. That function is checked to be the one transformers ships
(:func:`replaced_by`): another library's replacement is read through only while its weights are eager
attention of the queries and keys it was given (:func:`check_read_through`), else refused by name. The
scores are recomputed with the same helper the nnsight adapter
uses (:func:`~equivariance_probe.statistics.engines.in_trace.attention_scores`).

Ablations (each checked to take effect; see :func:`ablate`):

* ``"no_mask"`` — the attention mask is dropped in every layer: every query sees every key
  (causal mask and sliding windows gone).
* ``"no_positions"`` — rotary embeddings return ``cos = 1, sin = 0`` (the identity rotation),
  and learned absolute position embeddings (GPT-2 ``wpe``, BERT ``position_embeddings``,
  OPT ``embed_positions``) return zeros.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AttentionCaptureError, InputError, ReplacedAttentionFunctionError
from ..statistics.engines.in_trace import attention_scores, repeat_kv, visible_from_mask

__all__ = [
    "ABLATIONS",
    "AttentionCall",
    "AttentionScores",
    "intercept_attention",
    "replaced_by",
    "check_read_through",
    "ablate",
    "rotary_modules",
    "position_embedding_modules",
    "visible_from_mask",
]

#: Ablations accepted by :func:`ablate` (combine with ``+``: ``"no_mask+no_positions"``).
ABLATIONS = ("no_mask", "no_positions")

#: Attribute names of learned absolute position-embedding tables.
_POSITION_TABLE_NAMES = ("wpe", "position_embeddings", "embed_positions")


@dataclass
class AttentionCall:
    """What one attention module received in one forward pass.

    Attributes:
        layer: index of the module among the model's attention modules.
        query: ``[batch, head, query, head_dim]`` (after rotary embeddings and q-norm).
        key: ``[batch, kv_head, key, head_dim]``.
        attention_mask: the additive or boolean mask the module received (``None`` if none),
            broadcastable to ``[batch, head, query, key]``.
        scaling: the module's score scale.
        softcap: logit soft-capping, or ``None``.
        weights: ``[batch, head, query, key]`` the post-softmax weights the module computed
            (under the ablation in force, if any).
    """

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float | None
    softcap: float | None
    weights: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def scores(self) -> torch.Tensor:
        """``[batch, head, query, key]`` pre-softmax, pre-mask scores ``softcap(q·kᵀ·scaling)``."""
        return attention_scores(self.query, self.key, self.scaling, self.softcap)


@dataclass(frozen=True)
class AttentionScores:
    """Block ``layer``'s pre-softmax scores as a framework that forms them itself hands them (a TransformerBridge's
    ``hook_attn_scores``): the value of site ``"scores.{l}"``.

    Attributes:
        layer: the block.
        scores: ``[batch, head, query, key]`` what the framework's hook carried.
        rows: ``rows(b, start, length)``: window ``b``'s query rows ``start .. length − 1`` over keys
            ``0 .. length − 1`` as scores ``[head, length − start, length]``, float32 (float64 for a float64 model),
            as the framework defines them (where its hook carries post-softmax weights, their logarithm, which is
            the score up to each row's log-normaliser).
    """

    layer: int
    scores: torch.Tensor
    rows: Callable[[int, int, int], torch.Tensor]


def _eager_function(module: torch.nn.Module) -> Callable:
    """The eager attention function of the module's own modelling file (which the module itself calls)."""
    source = importlib.import_module(type(module).__module__)
    function = getattr(source, "eager_attention_forward", None)
    if function is None:
        raise AttentionCaptureError(
            f"{type(module).__name__} ({type(module).__module__}) has no eager_attention_forward, so its "
            "queries and keys cannot be intercepted; use a transformers 5 model (Gemma, Llama, Mistral, "
            "Qwen, GPT-2, BERT ...) or report the architecture"
        )
    return function


def replaced_by(function: Callable) -> str | None:
    """Where an eager attention function comes from when it is not one that transformers ships, else ``None``.

    transformers defines ``eager_attention_forward`` as a plain function in its modelling files; another
    library that assigns its own function to the modelling module's name (TransformerLens 3.9 does so for
    Gemma 2 and Gemma 3 whenever it builds a bridge with rotary hooks, and never restores it) leaves a function
    whose code lies elsewhere, whose ``__qualname__`` differs, or which wraps another (``__wrapped__``).
    """
    import transformers

    code = getattr(function, "__code__", None)
    package = os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep
    shipped = (code is not None and os.path.abspath(code.co_filename).startswith(package)
               and getattr(function, "__qualname__", "") == "eager_attention_forward"
               and not hasattr(function, "__wrapped__"))
    if shipped:
        return None
    where = str(getattr(function, "__module__", None) or "")
    if where.startswith("transformers") and code is not None:
        where = code.co_filename
    return f"{where or type(function).__name__}.{getattr(function, '__qualname__', '?')}"


def check_read_through(module: torch.nn.Module, function: Callable, query: torch.Tensor, key: torch.Tensor,
                       attention_mask: torch.Tensor | None, kwargs: dict[str, Any], output: Any) -> None:
    """Check that a replaced eager attention function computed eager attention from the queries and keys the
    probe read: its weights ``output[1]`` must equal ``softmax(mask + softcap(q·kᵀ·scaling))`` (a float32
    softmax, as transformers' eager attention) within :func:`recompute_tolerance`, else the probe refuses.

    Raises:
        ReplacedAttentionFunctionError: no weights returned, or weights that differ from eager attention's.
    """
    library = replaced_by(function) or "?"
    weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    fix = (f"transformers' eager_attention_forward in {type(module).__module__} was replaced by {library}. "
           + ("TransformerLens 3.9 does this whenever it builds a bridge with rotary hooks (Gemma, Llama, Qwen, ...), "
              "for the whole process: build TransformerLens bridges in another process, upgrade TransformerLens to "
              "4.3 or later, or run the probe on the TransformerLens model itself"
              if library.startswith("transformer_lens") else
              "Give the module back the function transformers ships (keep a reference to it before patching), or "
              "run the probe in a process without the replacement"))
    if weights is None:
        raise ReplacedAttentionFunctionError(f"{fix}; the replacement returns no attention weights, so the "
                                             "attention it computes cannot be checked", replaced_by=library)
    scores = attention_scores(query, key, kwargs.get("scaling"), kwargs.get("softcap"))
    if attention_mask is not None:
        mask = attention_mask[..., : scores.shape[-2], : scores.shape[-1]]
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask.to(scores.dtype))
    expected = torch.softmax(scores, dim=-1, dtype=torch.float32).to(weights.dtype)
    # A row with every key hidden (padding under a boolean mask) is NaN in both: nothing to compare there.
    delta = (weights.detach() - expected).abs()[~(weights.detach().isnan() & expected.isnan())]
    difference = float(delta.max()) if delta.numel() else 0.0
    if not difference <= recompute_tolerance(weights.dtype):
        raise ReplacedAttentionFunctionError(
            f"{fix}; the replacement's attention weights differ from eager attention of the queries and keys it was "
            f"given by up to {difference:.3g} (allowed {recompute_tolerance(weights.dtype):g})", replaced_by=library)


@contextlib.contextmanager
def intercept_attention(
    model: torch.nn.Module,
    on_call: Callable[[AttentionCall], None] | None = None,
    *,
    drop_mask: bool = False,
    keep_weights: bool = False,
    eager: bool = True,
    layers: Sequence[torch.nn.Module] | None = None,
) -> Iterator[list[int]]:
    """Intercept every attention call of ``model`` (a ``transformers`` model) in a ``with`` block.

    Args:
        model: a ``PreTrainedModel``.
        on_call: called once per attention module and forward pass with an
            :class:`AttentionCall`; the tensors are detached. It may raise to stop the forward
            pass (the interception is undone all the same).
        drop_mask: call the attention function with ``attention_mask=None``, so every
            query sees every key (eager only).
        keep_weights: fill ``AttentionCall.weights`` (eager only: fused kernels form none).
        eager: switch the model to eager attention for the block (and back afterwards), as
            ``drop_mask`` and ``keep_weights`` need; ``False`` keeps the model's own
            implementation (``sdpa``, ``flash_attention_2``, ...) and only reads its inputs, so
            the model runs its own kernel.
        layers: the attention modules in layer order (default: numbered in the order they first
            run, which is the layer order of every decoder and encoder stack).

    Yields:
        The list of layer indices called so far (to check that every layer was seen).

    Note:
        The interception is installed on transformers' shared registry entry of the
        implementation (``ALL_ATTENTION_FUNCTIONS[name]``, a local override of its global
        mapping), so it also applies to other models run inside the block in the same thread;
        their calls pass through untouched.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = {id(module) for module in model.modules()}
    layer_of: dict[int, int] = {id(module): index for index, module in enumerate(layers or ())}
    seen: list[int] = []
    original_impl = getattr(model.config, "_attn_implementation", None)
    if not eager and (drop_mask or keep_weights):
        raise InputError("drop_mask and keep_weights need eager attention; pass eager=True")
    name = "eager" if eager else (original_impl or "eager")
    # The function the model would call: its own eager function, or the registry's entry.
    registered = None if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]

    intercepted = _interceptor(own, layer_of, layers is not None, registered, seen, on_call, drop_mask=drop_mask,
                               keep_weights=keep_weights)

    had_local = name in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name)
    switched = installed = False
    try:
        if eager and original_impl != "eager":
            model.set_attn_implementation("eager")
            switched = True
        ALL_ATTENTION_FUNCTIONS[name] = intercepted
        installed = True
        yield seen
        if not seen:
            raise AttentionCaptureError(
                f"no attention call of {type(model).__name__} went through transformers' {name!r} attention "
                "function in this block, so queries and keys could not be read (a TransformerBridge replaces "
                "the attention modules with its own). Pass the Hugging Face model: load_model(name) or "
                "load_model(name, framework='nnsight')"
            )
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[name] = previous
        elif installed:
            del ALL_ATTENTION_FUNCTIONS[name]
        if switched and original_impl is not None:
            _switch_back(model, original_impl)


def _interceptor(own: set[int], layer_of: dict[int, int], numbered: bool, registered: Callable | None, seen: list[int],
                 on_call: Callable[[AttentionCall], None] | None, *, drop_mask: bool, keep_weights: bool) -> Callable:
    """The attention function :func:`intercept_attention` installs: it runs ``registered`` (or the module's own eager
    function), and for the modules of the model (``own``) records the layer in ``seen`` and hands ``on_call`` an
    :class:`AttentionCall`; ``numbered``: ``layer_of`` already numbers the modules (else in the order they run)."""

    def intercepted(module, query, key, value, attention_mask, *args, **kwargs):
        layer = (layer_of.get(id(module)) if numbered else layer_of.setdefault(id(module), len(layer_of))
                 ) if id(module) in own else None
        mask = None if (drop_mask and layer is not None) else attention_mask
        function = _eager_function(module) if registered is None else registered
        output = function(module, query, key, value, mask, *args, **kwargs)
        if registered is None and layer is not None and replaced_by(function) is not None:
            check_read_through(module, function, query.detach(), key.detach(), mask, kwargs, output)
        if layer is not None:
            seen.append(layer)
            if on_call is not None:
                on_call(
                    AttentionCall(
                        layer=layer,
                        query=query.detach(),
                        key=key.detach(),
                        attention_mask=None if mask is None else mask.detach(),
                        scaling=kwargs.get("scaling"),
                        softcap=kwargs.get("softcap"),
                        weights=output[1].detach() if keep_weights and output[1] is not None else None,
                        extra={"sliding_window": kwargs.get("sliding_window")},
                    )
                )
        return output

    return intercepted


def _switch_back(model: torch.nn.Module, implementation: str) -> None:
    """Give ``model`` back the attention ``implementation`` it was found with, after a block under eager attention.

    transformers checks a kernel when it is set: a flash kernel whose package is absent here is refused
    (``ImportError``), although a config may name it (a failed ``from_config`` leaves it in the config it was
    given). Such a model cannot run its own kernel at all, so rather than go on under eager attention while the
    result says otherwise, its config is set back as found and the refusal named.
    """
    try:
        model.set_attn_implementation(implementation)
    except (ImportError, ValueError) as error:
        model.config._attn_implementation = implementation  # as found, on every sub-config too
        raise AttentionCaptureError(
            f"{type(model).__name__} is set to attn_implementation={implementation!r}, which transformers cannot run "
            f"here ({error!s:.200}); load the model with attn_implementation='sdpa' or 'eager' (the probe reads queries "
            "and keys whatever the kernel, so the numbers are the same), or install that kernel's package"
        ) from error


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that compute rotary ``(cos, sin)`` tables (class name ending in ``RotaryEmbedding``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def position_embedding_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Learned absolute position-embedding tables (``nn.Embedding`` named ``wpe``, ``position_embeddings``
    or ``embed_positions``, also inside a TransformerBridge's wrapper)."""
    found = []
    for name, module in model.named_modules():
        # A TransformerBridge wraps each module it replaces as `<name>._original_component`.
        parts = [part for part in name.split(".") if part != "_original_component"]
        if isinstance(module, torch.nn.Embedding) and parts and parts[-1] in _POSITION_TABLE_NAMES:
            found.append(module)
    return found


def _parse_ablation(ablation: str | Sequence[str] | None) -> tuple[str, ...]:
    if ablation is None or ablation == "none":
        return ()
    parts = ablation.split("+") if isinstance(ablation, str) else list(ablation)
    parts = tuple(p.strip() for p in parts if p.strip() and p.strip() != "none")
    unknown = [p for p in parts if p not in ABLATIONS]
    if unknown:
        raise InputError(
            f"unknown ablation {unknown}; choose from {list(ABLATIONS)} (combine with '+', e.g. "
            "'no_mask+no_positions'), or 'none'"
        )
    return parts


@contextlib.contextmanager
def ablate(
    model: torch.nn.Module,
    ablation: str | Sequence[str] | None,
    on_call: Callable[[AttentionCall], None] | None = None,
    *,
    keep_weights: bool = False,
) -> Iterator[dict[str, Any]]:
    """Run ``model`` inside the block with ablations, intercepting its attention.

    Args:
        model: a ``transformers`` model.
        ablation: ``None``/``"none"``, ``"no_mask"``, ``"no_positions"`` or
            ``"no_mask+no_positions"`` (see the module docstring).
        on_call: passed to :func:`intercept_attention`.
        keep_weights: passed to :func:`intercept_attention`.

    Yields:
        A dict filled during the block: ``"layers_seen"`` (list of layer indices called),
        ``"rotary_calls"`` and ``"position_table_calls"`` (how often an ablated module ran),
        ``"ablation"`` (the parsed tuple).
    """
    parts = _parse_ablation(ablation)
    record: dict[str, Any] = {"ablation": parts, "rotary_calls": 0, "position_table_calls": 0}
    handles = []

    def identity_rotation(module, args, output):
        record["rotary_calls"] += 1
        cos, sin = output
        return torch.ones_like(cos), torch.zeros_like(sin)

    def zero_positions(module, args, output):
        record["position_table_calls"] += 1
        return torch.zeros_like(output)

    try:
        if "no_positions" in parts:
            handles += [m.register_forward_hook(identity_rotation) for m in rotary_modules(model)]
            handles += [m.register_forward_hook(zero_positions) for m in position_embedding_modules(model)]
        with intercept_attention(model, on_call, drop_mask="no_mask" in parts, keep_weights=keep_weights) as seen:
            record["layers_seen"] = seen
            yield record
    finally:
        for handle in handles:
            handle.remove()


def recompute_tolerance(dtype: torch.dtype) -> float:
    """Largest difference between the model's eager weights and ``softmax(mask(softcap(q·kᵀ·scaling)))``
    computed the way eager attention computes it (scores in the model's dtype, a float32 softmax
    rounded back), for a model whose attention is that and nothing else.

    1e-4 for float32 and float64 models (measured: 0 to 1e-7), 1e-2 for bf16/fp16 (a few units in
    the last place of the rounded weights). ALiBi biases or sink logits that the recomputation
    leaves out change weights by far more.
    """
    return 1e-4 if dtype in (torch.float32, torch.float64) else 1e-2


def eager_weights(call: AttentionCall, window: int | None, causal: bool = True) -> torch.Tensor:
    """``softmax(mask(softcap(q·kᵀ·scaling)))`` as transformers' eager attention computes it: scores in
    the model's dtype, a float32 softmax, the weights rounded back to the model's dtype. The mask is
    causal (and the sliding window), or nothing for a bidirectional encoder's unpadded window.

    The first-batch check compares the model's own weights with this, so that it tests what the
    attention *is* (no biases, no sinks), not the precision of half-precision scores, which the
    statistics recompute in float32 (:meth:`~equivariance_probe.statistics.AttentionStatistics.update_from_scores`).
    """
    query, key = call.query, repeat_kv(call.key, call.query.shape[1])
    scaling = call.scaling if call.scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    if causal:
        n_query, n_key = scores.shape[-2:]
        position = torch.arange(n_query, device=scores.device).view(-1, 1)
        other = torch.arange(n_key, device=scores.device).view(1, -1)
        hidden = other > position
        if window is not None:
            hidden |= position - other >= window
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
