"""Finding things inside a Hugging Face model, whatever wraps it: the one heuristic the package uses.

Place in the seams: *adapters*, the only code that knows frameworks. Every other part of the
package that needs the Hugging Face model inside a wrapper, its attention modules, its layers
or its masks asks here:

* :func:`hf_model_of` — the ``transformers`` model inside a TransformerLens ``TransformerBridge``,
  an nnsight model (:func:`~equivariance_probe.adapters.registry.unwrap_model`, re-exported here), or
  anything that holds its model as ``.model`` next to one of the package's adapters as ``.adapter`` (an
  :class:`~equivariance_probe.EquivarianceProbe`); duck-typed, so this module imports no class
  from above it.
* :func:`find_attention_modules` and :func:`parent_layer` — each layer's attention module and
  the decoder layer that holds it.
* :func:`~equivariance_probe.adapters.registry.wrap_model` (re-exported here) — the inverse: a Hugging Face
  model wrapped for TransformerLens or nnsight.
* :func:`text_config` and :func:`layer_windows` — the text config and each layer's sliding window.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AttentionCaptureError, UnsupportedModelError
from .registry import unwrap_model, wrap_model

__all__ = [
    "LAYER_LISTS",
    "ATTENTION_NAMES",
    "text_config",
    "config_max_context",
    "layer_windows",
    "find_attention_modules",
    "parent_layer",
    "inner_module",
    "unwrap_model",
    "hf_model_of",
    "residual_width",
    "CAUSAL_LM_SUFFIXES",
    "is_causal_lm",
    "is_bidirectional",
    "wrap_model",
]


#: Attribute names under which layer stacks (``LAYER_LISTS``) and, inside each layer, attention
#: modules (``ATTENTION_NAMES``) are found, in the order they are tried. BERT-style encoders keep
#: their layers in ``encoder.layer`` and wrap the module that calls the attention function in
#: ``attention.self`` (``BertAttention`` adds the output projection around ``BertSelfAttention``).
LAYER_LISTS = ("layers", "h", "blocks", "decoder.layers", "encoder.layer")
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def text_config(config: Any) -> Any:
    """The text part of a (possibly multimodal) config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def config_max_context(config: Any) -> int | None:
    """The longest context a (text) config declares (``max_position_embeddings``, GPT-2's
    ``n_positions`` or ``n_ctx``), ``None`` if it declares none. A model whose learned position
    table starts after an offset (RoBERTa) reads fewer; the Hugging Face adapter corrects for it."""
    value = (getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
             or getattr(config, "n_ctx", None))
    return int(value) if value else None


def layer_windows(config: Any, n_layers: int) -> tuple[int | None, ...]:
    """Per layer, ``None`` (full causal) or the sliding window width, from a HF config.

    Understands ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``, Gemma 2/3,
    Qwen 2 in recent transformers) and the older Mistral style, where ``sliding_window``
    applies to every layer unless ``use_sliding_window`` is false.
    """
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(
            int(window) if (kind in ("sliding_attention", "chunked_attention") and window) else None
            for kind in list(layer_types)[:n_layers]
        )
    if window and getattr(config, "use_sliding_window", True):
        return (int(window),) * n_layers
    return (None,) * n_layers


def parent_layer(model: torch.nn.Module, attention: torch.nn.Module) -> torch.nn.Module:
    """The layer that holds an attention module (its output is the residual stream): the element
    of the model's layer list (:data:`LAYER_LISTS`) that contains it, else its direct parent.

    Raises:
        AttentionCaptureError: no module of ``model`` holds ``attention``.
    """
    base = getattr(model, "base_model", model)
    for path in LAYER_LISTS:
        layers = _get_path(base, path)
        if isinstance(layers, torch.nn.ModuleList):
            for layer in layers:
                if any(module is attention for module in layer.modules()):
                    return layer
    for module in model.modules():
        if any(child is attention for child in module.children()):
            return module
    raise AttentionCaptureError(f"cannot find the layer that holds {type(attention).__name__}")


def find_attention_modules(model: Any) -> list[torch.nn.Module]:
    """Each layer's attention module of a ``transformers`` model, in layer order.

    Looks in ``model.base_model`` for a layer list named one of :data:`LAYER_LISTS` whose layers
    all hold a module named one of :data:`ATTENTION_NAMES`.

    Raises:
        UnsupportedModelError: an encoder-decoder model (T5, BART, ...): its decoder's cross-attention
            reads encoder positions, not its own, so a query-by-key pattern over one window is not defined.
        AttentionCaptureError: no such layer list.
    """
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model, which equivariance_probe does not support "
            "(wrapping it in TransformerLens or nnsight does not change that); probe a decoder-only causal LM "
            "(GPT-2, Llama, Gemma, ...) or an encoder (BERT-like)"
        )
    base = getattr(model, "base_model", model)
    for path in LAYER_LISTS:
        layers = _get_path(base, path)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            modules = []
            for layer in layers:
                attention = next((getattr(layer, n) for n in ATTENTION_NAMES if hasattr(layer, n)), None)
                if attention is None:
                    break
                inner = getattr(attention, "self", None)  # BERT: the module that calls the attention function
                modules.append(inner if isinstance(inner, torch.nn.Module) else attention)
            else:
                return modules
    raise AttentionCaptureError(
        f"cannot find the attention modules of {type(model).__name__}: looked for a layer list "
        f"named one of {LAYER_LISTS} whose layers have one of {ATTENTION_NAMES}. Wrap the model with "
        "TransformerLens (TransformerBridge.boot_transformers) or nnsight, or report the architecture"
    )


def inner_module(model: Any) -> Any:
    """The ``torch.nn.Module`` an nnsight envoy wraps (``_module`` in nnsight 0.8, ``_model`` before)."""
    inner = getattr(model, "_module", None)
    if inner is None:
        inner = getattr(model, "_model", None)
    return inner


def hf_model_of(model: Any) -> Any:
    """The Hugging Face model inside ``model`` (its raw weights, no TransformerLens processing).

    ``model`` is a ``transformers`` model, a TransformerBridge, an nnsight model, or an object
    that holds one of these as ``.model`` beside an ``.adapter`` (an ``EquivarianceProbe``).

    Raises:
        UnsupportedModelError: there is no Hugging Face model inside.
    """
    # An EquivarianceProbe, recognised by its adapter's method rather than by its class, so that
    # this module needs no import from above it (a TransformerBridge also has an `adapter`).
    if hasattr(getattr(model, "adapter", None), "run_statistics") and hasattr(model, "model"):
        model = model.model
    return unwrap_model(model)[0]


def residual_width(model: Any) -> int:
    """``d``, the width of the residual stream of the Hugging Face model inside ``model``
    (:func:`hf_model_of`): its text configuration's ``hidden_size`` (GPT-2's ``n_embd`` under that name)."""
    config = hf_model_of(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


#: Class-name endings of causal language models (GPT-2's is ``GPT2LMHeadModel``).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_bidirectional(attention_modules: list[torch.nn.Module]) -> bool:
    """Whether the attention modules attend both ways (an encoder: BERT, or Gemma 3 with
    ``use_bidirectional_attention``): transformers 5 attention modules say so in ``is_causal``."""
    return bool(attention_modules) and not any(getattr(module, "is_causal", True) for module in attention_modules)


def is_causal_lm(model: Any) -> bool:
    """A decoder with a language-model head (``...ForCausalLM``, GPT-2's ``...LMHeadModel``)."""
    return type(model).__name__.endswith(CAUSAL_LM_SUFFIXES)

