"""The components that write into a decoder's residual stream, and the modules whose outputs they are.

Place in the seams: *adapters* (the one place that knows a model's insides). A pre-norm decoder block adds
to its input what its attention writes and what its MLP writes, so the residual stream after block ``l`` is
the sum of the embedding (the input of block 0, as the model scales it) and, for every block ``l' ≤ l``, its
attention's and its MLP's outputs. A block with norms on its outputs (Gemma 2 and 3, OLMo 2:
``post_attention_layernorm`` and ``post_feedforward_layernorm``) adds the *normed* outputs; for those the
component is the norm's output. A block whose norm comes after the addition (BERT's post-LN) is not a sum of
components at all, which the run's identity check (the components' sum against the residual stream) reports.

Component names, shared by every framework's adapter and by the statistics:

* ``"embedding"``: the input of the first block;
* ``"attention.{l}"`` and ``"mlp.{l}"``: what block ``l``'s attention and MLP add;
* ``"head.{l}.{h}"``: query head ``h``'s part of ``"attention.{l}"``: its slice of the output projection's input
  times that slice of the projection's weight (and, under a post-norm, the norm's scaling of the whole output,
  taken as it was: ``w ⊙ o_h / rms(o)``). The heads' parts and the projection's bias add up to the attention's.

:func:`block_parts` finds, for each layer of a Hugging Face model, the modules whose outputs are these
components (:class:`BlockParts`); adapters hook them to read (attribution) or to replace (patching).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AttentionCaptureError, InputError
from .modules import find_attention_modules, parent_layer

__all__ = ["EMBEDDING", "COMPONENT_KINDS", "BlockParts", "block_parts", "block_component_names",
           "head_component_names", "parse_component", "component_layer", "components_up_to", "output_tensor",
           "with_output_tensor", "head_columns", "component_site"]

EMBEDDING = "embedding"
#: The kinds of component, in the order :func:`block_component_names` lists a block's.
COMPONENT_KINDS = ("embedding", "attention", "mlp", "head")
#: Names of a block's MLP module, and of the output projection inside an attention module, in the order tried.
MLP_NAMES = ("mlp", "feed_forward", "ffn")
PROJECTION_NAMES = ("o_proj", "c_proj", "out_proj", "dense")
_NAME = re.compile(r"^(?:(embedding)|(attention|mlp)\.(\d+)|head\.(\d+)\.(\d+))$")


@dataclass(frozen=True)
class BlockParts:
    """The modules of one decoder block whose outputs are its components.

    Attributes:
        layer: the decoder block.
        attention: its attention module.
        attention_out: the module whose output is what the attention adds to the residual stream (the attention
            module itself, or its post-norm).
        mlp_out: the module whose output is what the MLP adds (the MLP, or its post-norm).
        projection: the attention's output projection; its input is the heads' outputs side by side.
        post_norms: whether the block norms its outputs before adding them.
    """

    layer: torch.nn.Module
    attention: torch.nn.Module
    attention_out: torch.nn.Module
    mlp_out: torch.nn.Module
    projection: torch.nn.Module
    post_norms: bool


def block_parts(model: Any) -> list[BlockParts]:
    """:class:`BlockParts` of each layer of a Hugging Face decoder ``model``, in layer order.

    Raises:
        AttentionCaptureError: a layer without an MLP or an attention module without an output projection under
            the names tried (:data:`MLP_NAMES`, :data:`PROJECTION_NAMES`).
    """
    parts = []
    for attention in find_attention_modules(model):
        layer = parent_layer(model, attention)
        mlp = next((getattr(layer, name) for name in MLP_NAMES if hasattr(layer, name)), None)
        projection = next((getattr(attention, name) for name in PROJECTION_NAMES if hasattr(attention, name)), None)
        if mlp is None or projection is None:
            raise AttentionCaptureError(
                f"cannot find the MLP ({MLP_NAMES}) or the attention's output projection ({PROJECTION_NAMES}) of "
                f"{type(layer).__name__}, so its residual stream cannot be split into components; report the "
                "architecture")
        # A block with a norm after its MLP norms both outputs before adding them (Gemma 2/3, OLMo 2), and calls
        # the attention's post-norm `post_attention_layernorm` (in Llama that name is the MLP's pre-norm).
        post = isinstance(getattr(layer, "post_feedforward_layernorm", None), torch.nn.Module)
        parts.append(BlockParts(layer, attention, layer.post_attention_layernorm if post else attention,
                                layer.post_feedforward_layernorm if post else mlp, projection, post))
    return parts


def block_component_names(n_layers: int) -> tuple[str, ...]:
    """``("embedding", "attention.0", "mlp.0", ..., "mlp.{L−1}")``: the block-level components, in the order
    they are added to the residual stream."""
    return (EMBEDDING, *(f"{kind}.{layer}" for layer in range(n_layers) for kind in ("attention", "mlp")))


def head_component_names(layers: Sequence[int], n_heads: int) -> tuple[str, ...]:
    """``"head.{l}.{h}"`` for every head of each layer in ``layers``."""
    return tuple(f"head.{layer}.{head}" for layer in layers for head in range(n_heads))


def parse_component(name: str) -> tuple[str, int | None, int | None]:
    """``(kind, layer, head)`` of a component name (``layer``/``head`` ``None`` where the kind has none).

    Raises:
        InputError: not a component name.
    """
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise InputError(f"component {name!r} is not one of 'embedding', 'attention.<layer>', 'mlp.<layer>' or "
                         "'head.<layer>.<head>'")
    if match.group(1):
        return EMBEDDING, None, None
    if match.group(2):
        return match.group(2), int(match.group(3)), None
    return "head", int(match.group(4)), int(match.group(5))


def component_layer(name: str) -> int:
    """The block a component belongs to; the embedding's is ``−1`` (before every block)."""
    layer = parse_component(name)[1]
    return -1 if layer is None else layer


def components_up_to(names: Sequence[str], layer: int) -> list[int]:
    """Indices of the block-level components of ``names`` (heads excluded: they are parts of their attention) that
    the residual stream after block ``layer`` is the sum of."""
    return [i for i, name in enumerate(names)
            if parse_component(name)[0] != "head" and component_layer(name) <= layer]


def output_tensor(output: Any) -> torch.Tensor:
    """The hidden states of a module's output (an attention module returns ``(hidden, weights, ...)``)."""
    return output[0] if isinstance(output, tuple) else output


def with_output_tensor(output: Any, hidden: torch.Tensor) -> Any:
    """``output`` with its hidden states replaced by ``hidden`` (the tuple's other entries kept)."""
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def head_columns(width: int, n_heads: int, head: int) -> slice:
    """Query head ``head``'s columns of an output projection's input of ``width`` (the heads side by side)."""
    size = width // n_heads
    return slice(head * size, (head + 1) * size)


def component_site(parts: Sequence[BlockParts], name: str) -> tuple[torch.nn.Module, bool, int | None]:
    """``(module, reads its input, head)``: where component ``name`` is found in a Hugging Face model: the
    input of block 0 (the embedding, as the model scales it), the output of :class:`BlockParts`' ``attention_out``
    or ``mlp_out``, or the output projection's input (a head: its :func:`head_columns`).

    Raises:
        InputError: not a component name, or a layer the model does not have.
    """
    kind, layer, head = parse_component(name)
    if layer is not None and not 0 <= layer < len(parts):
        raise InputError(f"component {name!r}: the model has layers 0 to {len(parts) - 1}")
    if kind == EMBEDDING:
        return parts[0].layer, True, None
    if kind == "head":
        return parts[layer].projection, True, head
    return (parts[layer].attention_out if kind == "attention" else parts[layer].mlp_out), False, None
