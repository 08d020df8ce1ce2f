"""Adapters: the only code that knows a model framework.

:func:`get_adapter` picks one from the model's type, asking the framework registry
(:mod:`~equivariance_probe.adapters.registry`), where each adapter class declares the model types it
takes. A framework is imported only if it is already in ``sys.modules`` (a model of that type cannot
exist otherwise), so ``import equivariance_probe`` stays free of every framework (the einops habit).
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from .base import Adapter, AttentionLayout, ModelInfo, PatternCallback
from .registry import adapter_for, supported_models

__all__ = ["Adapter", "AttentionLayout", "ModelInfo", "PatternCallback", "get_adapter", "adapter_of", "SUPPORTED_MODELS"]


def get_adapter(model: Any, *, tokenizer: Any | None = None, **options: Any) -> Adapter:
    """The adapter for ``model``, chosen by its type.

    Args:
        model: a model of one of :data:`SUPPORTED_MODELS` (the registry's adapter classes), or an :class:`Adapter`.
        tokenizer: a Hugging Face tokenizer for models that do not carry one.
        **options: passed to the adapter (e.g. ``remote=True`` for nnsight).

    Raises:
        UnsupportedModelError: the type is none of the supported ones.
    """
    if isinstance(model, Adapter):
        return model
    return _built(adapter_for(model), model, tokenizer, options)


def adapter_of(model: Any) -> Adapter:
    """The adapter that runs plans on ``model``: an :class:`Adapter` itself, a probe's own adapter (an object
    with ``.model`` beside an adapter at ``.adapter``), or :func:`get_adapter`'s for a framework's model.

    Raises:
        UnsupportedModelError: none of these.
    """
    inner = getattr(model, "adapter", None)
    if isinstance(inner, Adapter) and hasattr(model, "model"):
        return inner
    return get_adapter(model)


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


#: What :func:`get_adapter` accepts, for error messages and docs/guide/models.md: one line per adapter class,
#: read from the classes' declarations (importing the adapter modules, which import torch and no framework).
SUPPORTED_MODELS: tuple[str, ...] = supported_models()
