"""The framework registry: every adapter class declares its framework, and this module finds them.

Place in the seams: *adapters*. Each adapter module declares, on its :class:`~.base.Adapter` subclass, the
framework's name (:attr:`~.base.Adapter.framework`), the model classes it takes
(:attr:`~.base.Adapter.model_types`, checked without importing the framework), how to wrap a Hugging Face
model for the framework and unwrap it again (:meth:`~.base.Adapter.wrap`, :meth:`~.base.Adapter.unwrap`) and
what its models can do (:attr:`~.base.Adapter.capabilities`). Nothing else names a framework: the adapter
dispatch (:func:`adapter_for`), the wrappers (:func:`wrap_model`, :func:`unwrap_model`), the command line's
``--framework`` choices (:func:`framework_names`) and the probe read them here, so that adding a framework
is adding one module to this package.

The classes are found as einops finds its backends (``einops._backends.get_backend``): they register
themselves by subclassing :class:`~.base.Adapter`, and a model's type is checked against a framework's
classes only once that framework is in ``sys.modules`` (a model of that type cannot exist otherwise). The
modules of this package are imported once, on the first question, so that each class exists; they import
torch and no framework.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import Any

import torch

from ..errors import InputError, UnsupportedModelError
from .base import Adapter

__all__ = [
    "DEFAULT_FRAMEWORK",
    "adapter_classes",
    "adapter_for",
    "framework_adapter",
    "framework_names",
    "supported_models",
    "wrap_model",
    "unwrap_model",
    "framework_can",
    "frameworks_that",
]

#: The framework :func:`~equivariance_probe.sources.models.load_model` and the command line use when none is named.
DEFAULT_FRAMEWORK = "huggingface"


@cache
def _import_adapter_modules() -> None:
    """Import every module of this package once, so that each adapter class exists to be found."""
    for module in pkgutil.iter_modules(list(importlib.import_module(__package__).__path__)):
        importlib.import_module(f"{__package__}.{module.name}")


def adapter_classes() -> tuple[type[Adapter], ...]:
    """Every adapter class that declares model types in its own body, in the order they are tried
    (:attr:`~.base.Adapter.detection_order`, then name). A subclass defined anywhere else (a user's own
    adapter, imported before the model is probed) registers itself the same way; one that only inherits
    its parent's model types (a variant of an adapter) does not compete with its parent for them."""
    _import_adapter_modules()
    found: list[type[Adapter]] = []
    pending = list(Adapter.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "model_types" in vars(cls) and cls.model_types and cls not in found:
            found.append(cls)
    return tuple(sorted(found, key=lambda cls: (cls.detection_order, cls.framework, cls.__name__)))


def supported_models() -> tuple[str, ...]:
    """What :func:`adapter_for` accepts, one line per adapter class, for error messages and docs."""
    return tuple(cls.supported_models or cls.__name__ for cls in adapter_classes())


def adapter_for(model: Any) -> type[Adapter]:
    """The adapter class whose :attr:`~.base.Adapter.model_types` ``model`` is an instance of.

    Raises:
        UnsupportedModelError: none is; the message lists the supported types.
    """
    for cls in adapter_classes():
        if cls.takes(model):
            return cls
    raise UnsupportedModelError(
        f"EquivarianceProbe does not know models of type {type(model).__module__}.{type(model).__qualname__}. "
        "Supported: " + "; ".join(supported_models()) + ". Wrap a plain torch module with nnsight.NNsight, "
        "or load a Hugging Face model with AutoModelForCausalLM.from_pretrained(..., attn_implementation='eager')."
    )


def _wrappers() -> dict[str, type[Adapter]]:
    """Framework name -> the adapter class that wraps Hugging Face models for it, innermost framework first
    (the default, whose models the others hold inside, then outwards)."""
    wrappers: dict[str, type[Adapter]] = {}
    for cls in sorted(adapter_classes(), key=lambda cls: -cls.detection_order):
        if cls.framework and "wrap" in vars(cls) and cls.framework not in wrappers:
            wrappers[cls.framework] = cls
    return wrappers


def framework_names() -> tuple[str, ...]:
    """The frameworks a Hugging Face model can be wrapped for (``load_model(framework=...)``, ``--framework``)."""
    return tuple(_wrappers())


def framework_adapter(framework: str) -> type[Adapter]:
    """The adapter class that wraps Hugging Face models for ``framework``.

    Raises:
        InputError: an unknown ``framework``; the message lists the known ones.
    """
    wrappers = _wrappers()
    if framework not in wrappers:
        raise InputError(f"Unknown framework {framework!r}; choose one of {', '.join(wrappers)}.")
    return wrappers[framework]


def framework_can(framework: str, capability: str) -> bool:
    """Whether the adapter that wraps models for ``framework`` declares ``capability``
    (:data:`~.base.RUNS_REMOTELY`, :data:`~.base.RUNS_ENCODERS`, :data:`~.base.LANGUAGE_MODEL_HEAD`).

    Raises:
        InputError: an unknown ``framework``.
    """
    return capability in framework_adapter(framework).capabilities


def frameworks_that(capability: str) -> tuple[str, ...]:
    """The frameworks whose adapters declare ``capability``, for error messages."""
    return tuple(name for name in framework_names() if framework_can(name, capability))


def wrap_model(
    model: Any,
    tokenizer: Any,
    *,
    framework: str | None = None,
    source: str,
    dtype: torch.dtype,
    device: str | torch.device,
) -> Any:
    """Wrap a Hugging Face model for ``framework`` (the inverse of :func:`unwrap_model`; it may modify
    ``model`` in place): itself, a TransformerLens ``TransformerBridge`` reusing its weights and config
    (raw weights, no processing), an nnsight ``TransformersModel`` around it, ... (each adapter's
    :meth:`~.base.Adapter.wrap`).

    Raises:
        InputError: an unknown ``framework``.
    """
    wrapper = framework_adapter(DEFAULT_FRAMEWORK if framework is None else framework)
    return wrapper.wrap(model, tokenizer, source=source, dtype=dtype, device=device)


def unwrap_model(model: Any) -> tuple[Any, str]:
    """The ``transformers`` model inside ``model``, and the framework that wrapped it.

    Returns:
        ``(hf_model, framework)`` with ``framework`` one of :func:`framework_names`: ``"huggingface"``
        (``model`` itself), ``"transformer_lens"`` (a bridge's ``original_model``), ``"nnsight"`` (the module
        an nnsight model wraps), ...

    Raises:
        UnsupportedModelError: no ``transformers`` model is inside.
    """
    for cls in adapter_classes():
        inner = cls.unwrap(model)
        if inner is not None:
            return inner, cls.framework
    raise UnsupportedModelError(
        f"cannot find a Hugging Face model inside a {type(model).__module__}.{type(model).__name__}; pass a "
        "transformers PreTrainedModel, a TransformerLens TransformerBridge, or an nnsight "
        "TransformersModel/LanguageModel (as returned by load_model)"
    )
