"""Adapters for TransformerLens: the 4.x ``TransformerBridge`` and the legacy 2.x ``HookedTransformer``.

Place in the seams: *adapters*, the only code that knows TransformerLens.

Both expose every layer's post-softmax attention at ``blocks.{l}.attn.hook_pattern``
(``[batch, head, query, key]``). The hook hands the pattern to the probe's reduction and
keeps nothing. Once the last layer's pattern is reduced, the forward pass is stopped by
raising a private exception from the hook: nothing after it (the last block's MLP, the
final norm, the projection to the vocabulary) is computed. This matters in 4.x, where
neither ``return_type=None`` nor ``stop_at_layer`` skips the unembedding (measured: the
``unembed`` module still runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import AttentionCaptureError, require_extra
from .base import LANGUAGE_MODEL_HEAD, Adapter, AttentionLayout
from .hooked_binder import check_hooked_plan, run_hooked_plan
from .tl_binder import check_bridge_plan, run_bridge_plan
from .components import parse_component_of
from .internals import recompute_tolerance, rotary_modules
from .modules import layer_windows
from .segments import block_difference, hidden_keys, judged_recompute_check, segment_block, segment_spans

PATTERN_HOOK = "blocks.{layer}.attn.hook_pattern"
#: The bridge's pre-softmax scores, ``[batch, head, query, key]``, after soft-capping and its mask (hidden
#: entries hold ``−inf`` or the dtype's minimum): the tensor its softmax turns into ``hook_pattern``.
SCORES_HOOK = "blocks.{layer}.attn.hook_attn_scores"
#: The residual stream after block ``layer``, ``[batch, position, d_model]``.
RESIDUAL_HOOK = "blocks.{layer}.hook_resid_post"
#: The bridge's hooks on the components of the residual stream (:mod:`~equivariance_probe.adapters.components`):
#: block 0's input (the embedding as the model scales it), each attention's and MLP's output, or their post-norms'
#: (Gemma's ``ln1_post`` and ``ln2_post``), and the output projection's input (the heads side by side).
COMPONENT_HOOKS = {"embedding": "blocks.0.hook_resid_pre", "attention": "blocks.{layer}.attn.hook_out",
                   "mlp": "blocks.{layer}.mlp.hook_out", "attention_post": "blocks.{layer}.ln1_post.hook_out",
                   "attention_post_in": "blocks.{layer}.ln1_post.hook_in", "mlp_post": "blocks.{layer}.ln2_post.hook_out",
                   "projection_in": "blocks.{layer}.attn.o.hook_in"}


def scores_hook_carries_weights(attention: Any) -> bool:
    """Whether a TransformerBridge attention component fires ``hook_attn_scores`` with post-softmax weights.

    TransformerLens 4 reimplements attention for most architectures (Gemma 3, Llama, Qwen2, GPT-2:
    ``PositionEmbeddingsAttentionBridge``, ``JointQKVAttentionBridge``, ...), and there ``hook_attn_scores`` fires
    with the pre-softmax scores. Where it keeps the Hugging Face module's own attention (the generic
    ``AttentionBridge.forward``, which architectures such as JetMoE, PhiMoE, Gemma 3n, Llama 4, Jamba or
    OLMo-hybrid use), it fires both ``hook_pattern`` and ``hook_attn_scores`` with the weights the module returns
    (TransformerLens 4.3, ``AttentionBridge.forward``: "Most HF implementations return post-softmax weights")."""
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    return getattr(type(attention), "forward", None) is AttentionBridge.forward


def scores_from_weights(weights: torch.Tensor, start: int, window: int | None, layer: int) -> torch.Tensor:
    """Segment rows ``[head, m, length]`` of post-softmax ``weights`` as scores: ``log a``, which is the score up to
    the row's log-normaliser, so every quantity the shift test reads (scores centred on a row, ``exp(score −
    log Σ exp(score))``) is the same. Hidden keys (weight 0) become ``−inf``, as a masked score.

    Raises:
        AttentionCaptureError: a weight the mask lets the row see underflowed to 0: its score cannot be read back.
    """
    scores = torch.log(weights)
    hidden = hidden_keys(start, weights.shape[-1], window, True, weights.device)
    if bool(torch.isinf(scores).logical_and_(~hidden).any()):
        raise AttentionCaptureError(
            f"layer {layer}'s attention weights underflowed to 0 at a key the mask lets the query see; this "
            "TransformerBridge keeps the model's own attention, whose hook_attn_scores carries post-softmax weights, "
            "so the scores there cannot be read back from them. Load the model in float64, or run the shift test "
            "on the Hugging Face model itself (framework huggingface), which recomputes the scores from queries "
            "and keys")
    return scores


class _TransformerLensAdapter(Adapter):
    """What the bridge and HookedTransformer share: hooks on ``hook_pattern``."""

    framework = "transformer_lens"
    #: TransformerLens models end in the unembedding.
    capabilities = frozenset({LANGUAGE_MODEL_HEAD})
    #: After nnsight, whose envoys hold their module inside, and before the Hugging Face models a bridge wraps.
    detection_order = 1

    def __init__(self, model: Any, tokenizer: Any | None = None) -> None:
        super().__init__(model, tokenizer)
        n_layers = int(model.cfg.n_layers)
        missing = [PATTERN_HOOK.format(layer=i) for i in range(n_layers) if PATTERN_HOOK.format(layer=i) not in model.hook_dict]
        if missing:
            raise AttentionCaptureError(
                f"this {type(model).__name__} has no attention-pattern hook point {missing[0]!r} "
                f"({len(missing)} of {n_layers} layers missing), so attention cannot be captured; "
                "load the model with attn_implementation='eager' (TransformerBridge) or use the Hugging Face model directly"
            )
        self._layout = AttentionLayout(
            n_layers=n_layers,
            n_heads=int(model.cfg.n_heads),
            sliding_windows=self._windows(n_layers),
            max_context=int(model.cfg.n_ctx) if getattr(model.cfg, "n_ctx", None) else None,
            hidden_size=int(model.cfg.d_model),
            rotary=self._rotary(),
        )

    def _rotary(self) -> bool:
        """Whether positions enter as rotations: the wrapped transformers model's rotary modules where there is one
        (a bridge), else the config's ``positional_embedding_type``."""
        original = getattr(self.model, "original_model", None)
        if original is not None:
            return bool(rotary_modules(original))
        return getattr(self.model.cfg, "positional_embedding_type", None) == "rotary"

    def _windows(self, n_layers: int) -> tuple[int | None, ...]:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int | None:
        return int(self.model.cfg.d_vocab)

    @property
    def model_name(self) -> str:
        return str(getattr(self.model.cfg, "model_name", "") or type(self.model).__name__)

    capture_fix = "Check that the model's hook points include blocks.{l}.attn.hook_pattern for every layer."

    @contextlib.contextmanager
    def _eval(self) -> Iterator[None]:
        was_training = self.model.training
        try:
            self.model.eval()
            yield
        finally:
            self.model.train(was_training)


class TransformerBridgeAdapter(_TransformerLensAdapter):
    """TransformerLens 4.x ``TransformerBridge`` (wraps a Hugging Face model).

    The mask comes from the wrapped model's config (Gemma 3 ``layer_types`` and
    ``sliding_window``, Mistral-style ``sliding_window``).
    """

    model_types = (("transformer_lens.model_bridge", ("TransformerBridge",)),)
    supported_models = "transformer_lens.model_bridge.TransformerBridge (TransformerLens 4.x)"
    load_attention = "eager"  # the bridge replaces the attention modules with its own

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, *, source: str, dtype: torch.dtype, device: str | torch.device) -> Any:
        """A ``TransformerBridge`` reusing ``model``'s weights and config (raw weights, no processing)."""
        require_extra("transformer_lens", "transformer-lens", "framework='transformer_lens'")
        from transformer_lens.model_bridge import TransformerBridge

        # hf_model= makes the bridge reuse these weights and this config instead of
        # loading anything; tokenizer= keeps it from looking one up by name.
        return TransformerBridge.boot_transformers(source, hf_model=model, tokenizer=tokenizer, device=device, dtype=dtype)

    @classmethod
    def unwrap(cls, model: Any) -> Any | None:
        """The bridge's ``original_model``."""
        if type(model).__module__.split(".")[0] != "transformer_lens":
            return None
        from transformers import PreTrainedModel

        inner = getattr(model, "original_model", None)
        return inner if isinstance(inner, PreTrainedModel) else None

    def _windows(self, n_layers: int) -> tuple[int | None, ...]:
        original = getattr(self.model, "original_model", None)
        if original is not None and getattr(original, "config", None) is not None:
            return layer_windows(original.config, n_layers)
        return _config_windows(self.model.cfg, n_layers)

    # -- the shift test ----------------------------------------------------------------------
    score_site = "scores"
    segment_capture = ("segment-block scores from the bridge's hook_attn_scores (the pre-softmax scores its own "
                       "attention computes; log-weights where it keeps the model's own attention, whose "
                       "hook_attn_scores carries the weights); row normalisers over every visible key of the window")

    @property
    def weights_as_scores(self) -> tuple[bool, ...]:
        """Per layer, whether ``hook_attn_scores`` carries post-softmax weights (:func:`scores_hook_carries_weights`)."""
        if not hasattr(self, "_weights_as_scores"):
            self._weights_as_scores = tuple(scores_hook_carries_weights(self.model.blocks[layer].attn)
                                            for layer in range(self._layout.n_layers))
        return self._weights_as_scores

    def _segment_rows(self, scores: torch.Tensor, layer: int, b: int, start: int, length: int) -> torch.Tensor:
        """Window ``b``'s segment rows ``[head, m, length]`` of the tensor ``hook_attn_scores`` fired, as scores."""
        dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
        rows = scores[b, :, start:length, :length].detach().to(dtype)
        if self.weights_as_scores[layer]:
            return scores_from_weights(rows, start, self._layout.sliding_windows[layer], layer)
        return rows

    def component_hook(self, name: str) -> tuple[str, int | None]:
        """``(hook point, head)`` where the bridge exposes component ``name`` (:data:`COMPONENT_HOOKS`; a head is
        its columns of the output projection's input).

        Raises:
            InputError: not a component name, or a layer the model does not have.
            AttentionCaptureError: the bridge has no such hook point.
        """
        kind, layer, head = parse_component_of(name, self._layout.n_layers)
        if kind in ("attention", "mlp") and COMPONENT_HOOKS[f"{kind}_post"].format(layer=layer) in self.model.hook_dict:
            kind = f"{kind}_post"
        hook_name = COMPONENT_HOOKS["projection_in" if kind == "head" else kind].format(layer=layer)
        if hook_name not in self.model.hook_dict:
            raise AttentionCaptureError(f"this TransformerBridge has no hook point {hook_name!r} for component "
                                        f"{name!r}; run the Hugging Face model itself (framework huggingface)")
        return hook_name, head

    def check_plan(self, plan: Any) -> None:
        """:meth:`Adapter.check_plan` (:func:`~equivariance_probe.adapters.tl_binder.check_bridge_plan`)."""
        check_bridge_plan(self, plan)

    def run_plan(self, tokens: torch.Tensor, plan: Any, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        """:meth:`Adapter.run_plan` through the bridge's hook points
        (:func:`~equivariance_probe.adapters.tl_binder.run_bridge_plan`)."""
        return run_bridge_plan(self, tokens, plan, position_ids=position_ids, attention_mask=attention_mask)

    def check_segment_recompute(self, tokens: torch.Tensor, segment_length: int) -> dict[str, Any]:
        """:meth:`Adapter.check_segment_recompute`: on one window ``tokens: [1, T]``, the weights
        ``exp(score − log_normaliser)`` of the segment block cut from ``hook_attn_scores`` against the bridge's own
        ``hook_pattern``. They differ where the softmax sees more than the scores (attention sinks, which the
        bridge appends after ``hook_attn_scores``), which the shift test cannot read.

        Raises:
            AttentionCaptureError: they differ by more than
                :func:`~equivariance_probe.adapters.internals.recompute_tolerance`.
        """
        spans = segment_spans(torch.tensor([tokens.shape[1]]), segment_length)
        start = spans[0][0]
        windows = self._layout.sliding_windows
        blocks: dict[int, torch.Tensor] = {}
        patterns: dict[int, torch.Tensor] = {}

        def on_scores(scores: torch.Tensor, hook: Any) -> None:
            layer = int(hook.name.split(".")[1])
            rows = self._segment_rows(scores, layer, 0, start, int(tokens.shape[1]))
            block, normaliser, _ = segment_block(rows, start, windows[layer], causal=True)
            blocks[layer] = torch.exp(block - normaliser.unsqueeze(-1))

        def on_pattern(pattern: torch.Tensor, hook: Any) -> None:
            # A bridge that keeps the model's own attention fires hook_pattern before hook_attn_scores.
            patterns[int(hook.name.split(".")[1])] = pattern[0, :, start:, start:].detach()

        hooks = [(SCORES_HOOK.format(layer=i), on_scores) for i in range(self._layout.n_layers)]
        hooks += [(PATTERN_HOOK.format(layer=i), on_pattern) for i in range(self._layout.n_layers)]
        with self._eval(), torch.no_grad():
            self.model.run_with_hooks(tokens.to(self.device), return_type=None, fwd_hooks=hooks)
        differences = [block_difference(blocks[layer], patterns[layer], windows[layer], causal=True) for layer in blocks]
        return judged_recompute_check(max(differences, default=0.0), recompute_tolerance(self.dtype),
                                      int(tokens.shape[1]), "the segment block's weights from the bridge's "
                                      "hook_attn_scores against its hook_pattern")

    def info(self):  # type: ignore[override]
        info = super().info()
        original = getattr(self.model, "original_model", None)
        if original is not None:
            info.extra["architecture"] = type(original).__name__
            info.extra["attn_implementation"] = getattr(original.config, "_attn_implementation", None)
        return info


class HookedTransformerAdapter(_TransformerLensAdapter):
    """Legacy TransformerLens 2.x ``HookedTransformer`` (local attention from ``cfg.attn_types``)."""

    model_types = (("transformer_lens", ("HookedTransformer",)),)
    supported_models = "transformer_lens.HookedTransformer (TransformerLens 2.x)"

    score_site = "scores"

    def check_plan(self, plan: Any) -> None:
        """:meth:`Adapter.check_plan` (:func:`~equivariance_probe.adapters.hooked_binder.check_hooked_plan`)."""
        check_hooked_plan(self, plan)

    def run_plan(self, tokens: torch.Tensor, plan: Any, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        """:meth:`Adapter.run_plan` through the model's hook points
        (:func:`~equivariance_probe.adapters.hooked_binder.run_hooked_plan`)."""
        return run_hooked_plan(self, tokens, plan, position_ids=position_ids, attention_mask=attention_mask)

    def _windows(self, n_layers: int) -> tuple[int | None, ...]:
        windows = []
        for layer in range(n_layers):
            attention = self.model.blocks[layer].attn
            kind = getattr(attention, "attn_type", "global")
            windows.append(int(self.model.cfg.window_size) if kind == "local" else None)
        return tuple(windows)


def _config_windows(cfg: Any, n_layers: int) -> tuple[int | None, ...]:
    """Windows from a TransformerLens config (``attn_types`` of ``"local"``/``"global"``)."""
    kinds = getattr(cfg, "attn_types", None)
    window = getattr(cfg, "window_size", None)
    if not kinds or not window:
        return (None,) * n_layers
    return tuple(int(window) if kind == "local" else None for kind in list(kinds)[:n_layers])
