"""Adapter for plain Hugging Face causal LMs (``transformers.PreTrainedModel``).

Place in the seams: *adapters*, the only code that knows transformers' modules.

Attention is captured with a forward hook on every layer's attention module, whose
output is ``(attn_output, attn_weights)``; ``attn_weights: [batch, head, query, key]``
exists only under eager attention, so a model loaded with ``sdpa`` or flash attention is
switched to eager for the duration of a run and switched back afterwards. The base model
(``model.base_model``) is called instead of the causal LM, which skips the projection to
the vocabulary: at context 1024 that is about half of a Gemma 3 270M forward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import AttentionCaptureError
from .base import Adapter, AttentionLayout, PatternCallback
from .modules import find_attention_modules, layer_windows, text_config


class _LastPatternSeen(Exception):
    """Raised from the last layer's hook to stop the forward pass early."""


class HuggingFaceAdapter(Adapter):
    """Streams post-softmax attention out of a ``transformers`` causal LM.

    Args:
        model: a ``PreTrainedModel`` (e.g. ``AutoModelForCausalLM``), any attention
            implementation.
        tokenizer: its tokenizer, if strings are to be run.
    """

    framework = "huggingface"

    def __init__(self, model: Any, tokenizer: Any | None = None) -> None:
        super().__init__(model, tokenizer)
        self.attention_modules = find_attention_modules(model)
        config = text_config(model.config)
        n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
        if n_heads is None:
            raise AttentionCaptureError(
                f"cannot tell the number of attention heads of {type(model).__name__}: its config has "
                "neither num_attention_heads nor n_head"
            )
        max_context = (
            getattr(config, "max_position_embeddings", None)
            or getattr(config, "n_positions", None)
            or getattr(config, "n_ctx", None)
        )
        self._layout = AttentionLayout(
            n_layers=len(self.attention_modules),
            n_heads=int(n_heads),
            sliding_windows=layer_windows(model.config, len(self.attention_modules)),
            max_context=int(max_context) if max_context else None,
        )

    @property
    def vocab_size(self) -> int | None:
        embeddings = self.model.get_input_embeddings()
        return int(embeddings.num_embeddings) if embeddings is not None else None

    def model_name(self) -> str:
        return str(getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__)

    def info(self):  # type: ignore[override]
        info = super().info()
        info.extra["architecture"] = type(self.model).__name__
        info.extra["attn_implementation"] = self._attn_implementation()
        return info

    def _attn_implementation(self) -> str | None:
        return getattr(self.model.config, "_attn_implementation", None)

    def capture_hint(self) -> str:
        return (
            "Load the model with attn_implementation='eager' "
            "(AutoModelForCausalLM.from_pretrained(..., attn_implementation='eager'))."
        )

    @contextlib.contextmanager
    def _eager_eval(self) -> Iterator[None]:
        """Eager attention and eval mode for the run; the user's settings come back after."""
        original = self._attn_implementation()
        was_training = self.model.training
        switched = False
        try:
            if original != "eager":
                try:
                    self.model.set_attn_implementation("eager")
                    switched = True
                except Exception as error:  # noqa: BLE001 - any refusal means the same thing to the user
                    raise AttentionCaptureError(
                        f"this model runs attention {original!r}, which does not expose attention weights, "
                        f"and could not be switched to eager ({error}). " + self.capture_hint()
                    ) from error
            self.model.eval()
            yield
        finally:
            if switched and original is not None:
                try:
                    self.model.set_attn_implementation(original)
                except Exception as error:  # noqa: BLE001 - e.g. flash_attention_2 flagged where flash-attn is absent
                    # The statistics are complete; failing here would throw them away.
                    warnings.warn(
                        f"could not switch the model back to attn_implementation={original!r} after the probe "
                        f"({error!s:.200}); it stays 'eager'", stacklevel=3,
                    )
            self.model.train(was_training)

    def run_patterns(self, tokens: torch.Tensor, on_pattern: PatternCallback) -> None:
        seen: list[int] = []
        last = len(self.attention_modules) - 1

        def make_hook(layer: int):
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                if weights is None:
                    raise AttentionCaptureError(
                        f"layer {layer}'s attention module ({type(module).__name__}) returned no attention "
                        f"weights under attn_implementation={self._attn_implementation()!r}. "
                        + self.capture_hint()
                    )
                seen.append(layer)
                on_pattern(layer, weights.detach())
                if layer == last:
                    # Nothing after the last pattern is read: stop the forward pass here.
                    raise _LastPatternSeen

            return hook

        with self._eager_eval(), torch.no_grad():
            handles = [m.register_forward_hook(make_hook(i)) for i, m in enumerate(self.attention_modules)]
            try:
                self.model.base_model(input_ids=tokens.to(self.device), use_cache=False)
            except _LastPatternSeen:
                pass
            finally:
                for handle in handles:
                    handle.remove()
        self.check_layers_seen(seen)
