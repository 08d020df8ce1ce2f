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

from ..errors import AttentionCaptureError
from .base import Adapter, AttentionLayout, PatternCallback
from .modules import layer_windows

PATTERN_HOOK = "blocks.{layer}.attn.hook_pattern"


class _LastPatternSeen(Exception):
    """Raised from the last layer's hook to stop the forward pass early."""


class _TransformerLensAdapter(Adapter):
    """What the bridge and HookedTransformer share: hooks on ``hook_pattern``."""

    framework = "transformer_lens"

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

    def _windows(self, n_layers: int) -> tuple[int | None, ...]:
        original = getattr(self.model, "original_model", None)
        if original is not None and getattr(original, "config", None) is not None:
            return layer_windows(original.config, n_layers)
        return _config_windows(self.model.cfg, n_layers)

    def info(self):  # type: ignore[override]
        info = super().info()
        original = getattr(self.model, "original_model", None)
        if original is not None:
            info.extra["architecture"] = type(original).__name__
            info.extra["attn_implementation"] = getattr(original.config, "_attn_implementation", None)
        return info


class HookedTransformerAdapter(_TransformerLensAdapter):
    """Legacy TransformerLens 2.x ``HookedTransformer`` (local attention from ``cfg.attn_types``)."""

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
