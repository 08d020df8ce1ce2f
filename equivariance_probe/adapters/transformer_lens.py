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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import AttentionCaptureError, require_extra
from .base import LANGUAGE_MODEL_HEAD, Adapter, AttentionLayout, PatternCallback, SegmentAttentionCallback, SegmentResidualCallback
from .base import ComponentCallback, SegmentComponentCallback
from .tl_binder import check_bridge_plan, run_bridge_plan
from .components import ComponentRequest, HeadPieces, block_parts, head_columns, parse_component_of
from .internals import recompute_tolerance
from .modules import layer_windows
from .segments import (
    block_difference,
    check_predicts,
    hidden_keys,
    judged_recompute_check,
    kept_positions,
    segment_block,
    segment_blocks,
    segment_log_probs,
    segment_rows,
    segment_spans,
    shifted_position_ids,
    component_toucher,
)

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


class _LastPatternSeen(Exception):
    """Raised from the last layer's hook to stop the forward pass early."""


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
        )

    def _windows(self, n_layers: int) -> tuple[int | None, ...]:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int | None:
        return int(self.model.cfg.d_vocab)

    def model_name(self) -> str:
        return str(getattr(self.model.cfg, "model_name", "") or type(self.model).__name__)

    def capture_hint(self) -> str:
        return "Check that the model's hook points include blocks.{l}.attn.hook_pattern for every layer."

    @contextlib.contextmanager
    def _eval(self) -> Iterator[None]:
        was_training = self.model.training
        try:
            self.model.eval()
            yield
        finally:
            self.model.train(was_training)

    def run_patterns(self, tokens: torch.Tensor, on_pattern: PatternCallback) -> None:
        seen: list[int] = []
        last = self._layout.n_layers - 1

        def hook(pattern: torch.Tensor, hook: Any) -> None:
            layer = int(hook.name.split(".")[1])
            seen.append(layer)
            on_pattern(layer, pattern.detach())
            if layer == last:
                raise _LastPatternSeen

        names = [PATTERN_HOOK.format(layer=i) for i in range(self._layout.n_layers)]
        with self._eval(), torch.no_grad():
            try:
                self.model.run_with_hooks(
                    tokens.to(self.device), return_type=None, fwd_hooks=[(name, hook) for name in names]
                )
            except _LastPatternSeen:
                pass
        self.check_layers_seen(seen)


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

    def run_segment(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        segment_length: int,
        *,
        on_attention: SegmentAttentionCallback | None = None,
        on_residual: SegmentResidualCallback | None = None,
        position_start: torch.Tensor | None = None,
        predictions: bool = False,
        components: Sequence[str] = (),
        on_component: SegmentComponentCallback | None = None,
        capture: Sequence[str] = (),
        on_capture: ComponentCallback | None = None,
        patch: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """:meth:`Adapter.run_segment` through the bridge's own hooks, in one ``run_with_hooks`` pass.

        The numbers are the bridge's: its attention components compute the scores themselves (they do not call
        transformers' attention function), and ``hook_attn_scores`` hands over the very scores their softmax
        turns into ``hook_pattern``, the pattern the main probe reads. Where the bridge keeps the model's own
        attention (:attr:`weights_as_scores`), the hook carries the module's post-softmax weights instead, and their
        logarithm stands for the scores (:func:`scores_from_weights`: equal up to each row's log-normaliser, which
        nothing the shift test reads depends on). The segment block, its row normalisers and the rows' weights on
        the text before the segment are cut from them as every adapter cuts them (:func:`~equivariance_probe.adapters.segments.segment_block`),
        in float32 (float64 for a float64 model); in half precision the scores carry the model dtype's rounding,
        where the Hugging Face adapter recomputes them in float32 from half-precision queries and keys. The
        residual stream is ``hook_resid_post``; the attribution's components are the bridge's hooks of
        :data:`COMPONENT_HOOKS` (the heads' pieces formed from ``attn.o.hook_in`` with the projection's weights, as
        every adapter forms them); the predictions are the bridge's logits for the last
        :func:`~equivariance_probe.adapters.segments.kept_positions` positions (``logits_to_keep`` and
        ``position_ids`` go through the bridge to the Hugging Face model it runs). Components are captured and
        patched at the bridge's hook points (:data:`COMPONENT_HOOKS`, :meth:`component_hook`).

        Raises:
            AttentionCaptureError: ``predictions`` on a bridge around a model without a language-model head.
        """
        if predictions:
            check_predicts(self.model.original_model)
        spans = segment_spans(lengths, segment_length)
        width = int(tokens.shape[1])
        windows = self._layout.sliding_windows
        last = self._layout.n_layers - 1
        seen: list[int] = []

        def on_scores(scores: torch.Tensor, hook: Any) -> None:
            layer = int(hook.name.split(".")[1])
            rows = [self._segment_rows(scores, layer, b, start, length) for b, (start, length) in enumerate(spans)]
            on_attention(layer, *segment_blocks(rows, spans, windows[layer], causal=True))
            seen.append(layer)

        def on_block(hidden: torch.Tensor, hook: Any) -> None:
            layer = int(hook.name.split(".")[1])
            if on_residual is not None:
                on_residual(layer, segment_rows(hidden, spans))
            if layer == last and not predictions:
                raise _LastPatternSeen  # nothing after the last block is read

        hooks = [(SCORES_HOOK.format(layer=i), on_scores) for i in range(self._layout.n_layers)] \
            if on_attention is not None else []
        hooks += [(RESIDUAL_HOOK.format(layer=i), on_block) for i in range(self._layout.n_layers)]
        hooks += self._component_hooks(components, spans, on_component) if components and on_component else []
        hooks += self._touch_hooks(spans, capture, on_capture, patch or {})
        options: dict[str, Any] = {"use_cache": False}
        if position_start is not None:
            options["position_ids"] = shifted_position_ids(position_start, width).to(self.device)
        if predictions:
            options["logits_to_keep"] = kept_positions(spans, width)
        log_probs = None
        with self._eval(), torch.no_grad():
            try:
                logits = self.model.run_with_hooks(tokens.to(self.device), return_type="logits" if predictions else None,
                                                   fwd_hooks=hooks, **options)
                if predictions:
                    log_probs = segment_log_probs(logits, spans, width)
            except _LastPatternSeen:
                pass
        if on_attention is not None:
            self.check_layers_seen(seen)
        return log_probs

    def _touch_hooks(self, spans: Any, capture: Sequence[str], on_capture: ComponentCallback | None,
                     patch: Mapping[str, torch.Tensor]) -> list[tuple[str, Any]]:
        """``(hook name, function)`` pairs that capture and patch components at the segment, at the bridge's hook
        points (:meth:`component_hook`; a head is its columns of the output projection's input)."""
        touch = component_toucher(spans, capture, on_capture, patch)
        hooks = []
        for name in dict.fromkeys([*capture, *patch]):
            hook_name, head = self.component_hook(name)

            def on_patched(hidden: torch.Tensor, hook: Any, name: str = name, head: int | None = head) -> torch.Tensor:
                if head is not None and hidden.dim() == 4:  # [batch, position, head, head_dim] (Gemma 3's bridge)
                    touch(name, hidden[:, :, head])  # a view: replaced in place
                    return hidden
                return touch(name, hidden, None if head is None else head_columns(hidden.shape[-1],
                                                                                  self._layout.n_heads, head))

            hooks.append((hook_name, on_patched))
        return hooks

    def _component_hooks(self, components: Sequence[str], spans: Any, on_component: SegmentComponentCallback
                         ) -> list[tuple[str, Any]]:
        """``(hook name, function)`` pairs that hand ``on_component`` the attribution's components at the segment."""
        request = ComponentRequest.of(components)
        parts = block_parts(self.model.original_model)
        heads = HeadPieces(parts, self._layout.n_heads, request.heads, on_component)
        hooks: list[tuple[str, Any]] = []
        if request.embedding:
            hooks.append((COMPONENT_HOOKS["embedding"],
                          lambda hidden, hook: on_component("embedding", segment_rows(hidden, spans))))

        def reader(name: str):
            return lambda hidden, hook: on_component(name, segment_rows(hidden, spans))

        def projection_input(layer: int):  # some bridges hand the heads unflattened, [batch, T, head, d_head]
            return lambda z, hook: heads.projection_input(layer, segment_rows(z.flatten(2) if z.dim() == 4 else z, spans))

        def attention(layer: int, post: bool, with_heads: bool):
            def hook(hidden: torch.Tensor, hook: Any) -> None:
                if with_heads and not post:
                    heads.attention_output(layer)
                on_component(f"attention.{layer}", segment_rows(hidden, spans))
            return hook

        def post_norm_input(layer: int):
            return lambda hidden, hook: heads.attention_output(layer, segment_rows(hidden, spans))

        for layer in sorted(set(request.blocks) | set(request.heads)):
            post = parts[layer].post_norms
            hooks.append((COMPONENT_HOOKS["attention_post" if post else "attention"].format(layer=layer),
                          attention(layer, post, layer in request.heads)))
            hooks.append((COMPONENT_HOOKS["mlp_post" if post else "mlp"].format(layer=layer), reader(f"mlp.{layer}")))
            if layer in request.heads:
                hooks.append((COMPONENT_HOOKS["projection_in"].format(layer=layer), projection_input(layer)))
                if post:
                    hooks.append((COMPONENT_HOOKS["attention_post_in"].format(layer=layer), post_norm_input(layer)))
        return hooks

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

    def run_plan(self, tokens: torch.Tensor, plan: Any) -> dict[str, Any]:
        """:meth:`Adapter.run_plan` through the bridge's hook points
        (:func:`~equivariance_probe.adapters.tl_binder.run_bridge_plan`)."""
        return run_bridge_plan(self, tokens, plan)

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
