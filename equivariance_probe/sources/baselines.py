"""Untrained baselines of a model: its own random initialisation, and every weight zero.

Place in the seams: *sources* (docs/methods.md#baselines). :func:`random_init_like` builds the same
architecture at its own random initialisation (the model's own ``_init_weights``, seeded), and
:func:`zero_like` the same architecture with every parameter zero. Both return new models,
wrapped the way the original was (Hugging Face model, TransformerLens bridge or nnsight
model); the original is never touched.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.modules import unwrap_model, wrap_model
from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["random_init_like", "zero_like"]


def _unwrap(model: Any) -> tuple[PreTrainedModel, str]:
    """The Hugging Face model inside ``model`` and the framework it came wrapped in."""
    try:
        return unwrap_model(model)
    except UnsupportedModelError:
        raise UnsupportedModelError(
            f"Cannot build a baseline of a {type(model).__module__}.{type(model).__name__}; pass a "
            "transformers PreTrainedModel, a TransformerLens TransformerBridge, or an nnsight "
            "TransformersModel/LanguageModel (as returned by load_model)."
        ) from None


def _rewrap(original: Any, hf_model: PreTrainedModel, framework: str) -> Any:
    """Wrap a baseline's Hugging Face model the way ``original`` was wrapped (a bare Hugging Face model's
    wrapping is itself)."""
    tokenizer = getattr(original, "tokenizer", None)
    source = getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
    dtype = next(hf_model.parameters()).dtype
    device = next(hf_model.parameters()).device
    return wrap_model(hf_model, tokenizer, framework=framework, source=source, dtype=dtype, device=device)


def _fresh_config(model: PreTrainedModel) -> Any:
    # A deep copy keeps the model's attention implementation: the baseline runs the same kernel.
    return copy.deepcopy(model.config)


def random_init_like(model: Any, seed: int = 0) -> Any:
    """The same architecture at its own random initialisation, seeded.

    Builds ``type(model)`` from a copy of its config, which runs the model's own weight
    initialiser (``_init_weights``: for Gemma 3 and GPT-2, normal(0, ``initializer_range``)
    linear and embedding weights, zero biases, norm weights at their identity values), under
    ``torch.manual_seed(seed)`` inside :func:`torch.random.fork_rng`, so the caller's random
    state is left as it was and the same seed always gives the same weights. The result has
    the original's dtype, device, attention implementation and ``eval()`` mode, and comes wrapped like
    the original (Hugging Face model, TransformerLens bridge or nnsight model).

    Args:
        model: A model as returned by :func:`load_model` (any framework), or any
            ``transformers`` ``PreTrainedModel``.
        seed: The seed of the initialisation.

    Returns:
        A new model; ``model`` is not modified.

    Raises:
        UnsupportedModelError: ``model`` is not a supported model type.
    """
    hf_model, framework = _unwrap(model)
    parameter = next(hf_model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # _from_config is what AutoModel*.from_config calls: __init__ + post_init, which runs
        # _init_weights on every module and ties the embeddings as the config says.
        baseline = type(hf_model)._from_config(_fresh_config(hf_model), dtype=parameter.dtype)
    baseline = baseline.to(parameter.device).eval()
    return _rewrap(model, baseline, framework)


def zero_like(model: Any) -> Any:
    """The same architecture with every parameter set to zero.

    "Zero" means exactly that: every ``nn.Parameter`` (embeddings, projections, biases and
    norm weights) is zero; buffers (rotary frequencies, causal-mask and position-id buffers)
    are kept, since they are not weights. The query and key projections being zero makes every
    score zero, so every head attends uniformly over the keys it may see: ``1/(q+1)`` under
    full causal attention and ``1/|V(q)|`` in a sliding-window layer. Norm layers do not change
    that, whatever zero means for them: Gemma's RMSNorm scales by ``1 + weight`` (so it becomes
    the identity scale), LayerNorm by ``weight`` (so it outputs zero, plus its zero bias).
    Hidden states and logits are then zero or constant, which is fine: only attention is probed.

    Args:
        model: A model as returned by :func:`load_model` (any framework), or any
            ``transformers`` ``PreTrainedModel``.

    Returns:
        A new model (a deep copy, then zeroed), wrapped like the original, in ``eval()`` mode;
        ``model`` is not modified.

    Raises:
        UnsupportedModelError: ``model`` is not a supported model type.
    """
    hf_model, framework = _unwrap(model)
    baseline = copy.deepcopy(hf_model)
    with torch.no_grad():
        for parameter in baseline.parameters():  # tied parameters are visited once; zeroed once
            parameter.zero_()
    return _rewrap(model, baseline.eval(), framework)
