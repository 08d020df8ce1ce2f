"""Adapters: the only code that knows a model framework.

:func:`get_adapter` picks one from the model's type. A framework is imported only if it
is already in ``sys.modules`` (a model of that type cannot exist otherwise), so
``import equivariance_probe`` stays free of every framework (the einops habit).
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import InputError, UnsupportedModelError
from .base import Adapter, AttentionLayout, ModelInfo, PatternCallback

__all__ = ["Adapter", "AttentionLayout", "ModelInfo", "PatternCallback", "get_adapter", "SUPPORTED_MODELS"]

#: What :func:`get_adapter` accepts, for error messages and docs/guide/models.md.
SUPPORTED_MODELS = (
    "transformer_lens.model_bridge.TransformerBridge (TransformerLens 4.x)",
    "transformer_lens.HookedTransformer (TransformerLens 2.x)",
    "nnsight.LanguageModel / nnsight.TransformersModel / nnsight.NNsight (local or remote=True)",
    "transformers.PreTrainedModel (a Hugging Face causal LM)",
)


def _is_instance(model: Any, module: str, *names: str) -> bool:
    """``isinstance(model, module.name)`` for names importable from an already-imported module."""
    if module.split(".")[0] not in sys.modules:
        return False
    try:
        imported = __import__(module, fromlist=list(names))
    except ImportError:
        return False
    classes = tuple(getattr(imported, n) for n in names if isinstance(getattr(imported, n, None), type))
    return bool(classes) and isinstance(model, classes)


def get_adapter(model: Any, *, tokenizer: Any | None = None, **options: Any) -> Adapter:
    """The adapter for ``model``, chosen by its type.

    Args:
        model: a model of one of :data:`SUPPORTED_MODELS`, or an :class:`Adapter`.
        tokenizer: a Hugging Face tokenizer for models that do not carry one.
        **options: passed to the adapter (e.g. ``remote=True`` for nnsight).

    Raises:
        UnsupportedModelError: the type is none of the supported ones.
    """
    if isinstance(model, Adapter):
        return model
    # nnsight first: its wrappers hold a Hugging Face model inside.
    if _is_instance(model, "nnsight", "NNsight", "LanguageModel", "TransformersModel", "Envoy"):
        from .nnsight import NNsightAdapter

        return _built(NNsightAdapter, model, tokenizer, options)
    if _is_instance(model, "transformer_lens.model_bridge", "TransformerBridge"):
        from .transformer_lens import TransformerBridgeAdapter

        return _built(TransformerBridgeAdapter, model, tokenizer, options)
    if _is_instance(model, "transformer_lens", "HookedTransformer"):
        from .transformer_lens import HookedTransformerAdapter

        return _built(HookedTransformerAdapter, model, tokenizer, options)
    if _is_instance(model, "transformers", "PreTrainedModel"):
        from .huggingface import HuggingFaceAdapter

        return _built(HuggingFaceAdapter, model, tokenizer, options)
    raise UnsupportedModelError(
        f"EquivarianceProbe does not know models of type {type(model).__module__}.{type(model).__qualname__}. "
        "Supported: " + "; ".join(SUPPORTED_MODELS) + ". Wrap a plain torch module with nnsight.NNsight, "
        "or load a Hugging Face model with AutoModelForCausalLM.from_pretrained(..., attn_implementation='eager')."
    )


def _built(adapter: type, model: Any, tokenizer: Any, options: dict[str, Any]) -> Adapter:
    """``adapter(model, tokenizer=tokenizer, **options)``, an option it does not take refused by name (a bare
    TypeError from its constructor would not say which options this model's adapter does take)."""
    import inspect

    accepted = [name for name, parameter in inspect.signature(adapter).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InputError(f"{adapter.__name__} takes no option {', '.join(map(repr, unknown))}; its options are "
                         f"{accepted} (an attention implementation is chosen when the model is loaded: "
                         "from_pretrained(..., attn_implementation='eager'))")
    return adapter(model, tokenizer=tokenizer, **options)
