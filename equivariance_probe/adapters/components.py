"""The components that write into a decoder's residual stream, and the modules whose outputs they are.

Place in the seams: *adapters* (the one place that knows a model's insides). A pre-norm decoder block adds
to its input what its attention writes and what its MLP writes, so the residual stream after block ``l`` is
the sum of the embedding (the input of block 0, as the model scales it) and, for every block ``l' ≤ l``, its
attention's and its MLP's outputs. A block with norms on its outputs (Gemma 2 and 3, OLMo 2:
``post_attention_layernorm`` and ``post_feedforward_layernorm``) adds the *normed* outputs; for those the
component is the norm's output. A block whose norm comes after the addition (BERT's post-LN) is not a sum of
components at all, which the run's identity check (the components' sum against the residual stream) reports.

Component names, shared by every framework's adapter and by the statistics, are the sites
(:mod:`~equivariance_probe.adapters.sites`) that add up to the residual stream, in their canonical spelling:

* ``"embedding"``: the input of the first block;
* ``"attention.{l}"`` and ``"mlp.{l}"``: what block ``l``'s attention and MLP add;
* ``"head.{l}.{h}"``: query head ``h``'s part of ``"attention.{l}"``: its slice of the output projection's input
  times that slice of the projection's weight (and, under a post-norm, the norm's scaling of the whole output,
  taken as it was: ``w ⊙ o_h / rms(o)``). The heads' parts and the projection's bias add up to the attention's.

:func:`block_parts` finds, for each layer of a Hugging Face model, the modules whose outputs are these
components (:class:`BlockParts`); adapters hook them to read (attribution) or to replace (patching).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AttentionCaptureError, InputError, SiteError
from .modules import find_attention_modules, parent_layer
from .sites import parse_site

__all__ = ["EMBEDDING", "COMPONENT_KINDS", "BlockParts", "block_parts", "block_component_names",
           "head_component_names", "parse_component", "parse_component_of", "component_layer", "components_up_to", "output_tensor",
           "with_output_tensor", "BIAS_PART", "parse_piece", "ComponentRequest", "head_pieces", "norm_epsilon", "norm_gain",
           "post_norm_scale", "HeadWrites", "post_norms_of",
           "block_input", "unwrapped", "head_columns", "component_site"]

EMBEDDING = "embedding"
#: The kinds of component, in the order :func:`block_component_names` lists a block's.
COMPONENT_KINDS = ("embedding", "attention", "mlp", "head")
#: Names of a block's MLP module, and of the output projection inside an attention module, in the order tried.
MLP_NAMES = ("mlp", "feed_forward", "ffn")
PROJECTION_NAMES = ("o_proj", "c_proj", "out_proj", "dense")


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
        if _norms_after_addition(layer):
            raise AttentionCaptureError(
                f"{type(layer).__name__} norms the residual stream after adding what its attention and its MLP write "
                "(post-LN, as BERT's blocks do: LayerNorm(x + attention(x))), so the stream after a block is not the "
                "sum of the components' outputs, and a component's output patched in is normed again with the rest; "
                "no split into components (attribution, patching) is defined for such a model. Run the shift test "
                "without attribution and patching on it, or use a pre-norm model")
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


def _norms_after_addition(layer: torch.nn.Module) -> bool:
    """Whether a block norms after its residual addition: the BERT family's (BERT, RoBERTa, MiniLM, ELECTRA)
    ``BertOutput`` and ``BertSelfOutput`` compute ``LayerNorm(dense(h) + input)`` in a submodule ``output``."""
    output = getattr(layer, "output", None)
    return isinstance(getattr(output, "LayerNorm", None), torch.nn.Module)


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
    try:
        site = parse_site(name) if isinstance(name, str) else None
    except SiteError:
        site = None
    # Components are the sites that add up to the residual stream, spelt canonically (a name is a key).
    if site is None or site.kind not in COMPONENT_KINDS or site.name != name:
        raise InputError(f"component {name!r} is not one of 'embedding', 'attention.<layer>', 'mlp.<layer>' or "
                         "'head.<layer>.<head>'")
    return site.kind, site.layer, site.head


def parse_component_of(name: str, n_layers: int) -> tuple[str, int | None, int | None]:
    """:func:`parse_component` of a component of a model with ``n_layers`` blocks.

    Raises:
        InputError: not a component name, or a layer the model does not have.
    """
    kind, layer, head = parse_component(name)
    if layer is not None and not 0 <= layer < n_layers:
        raise InputError(f"component {name!r}: the model has layers 0 to {n_layers - 1}")
    return kind, layer, head


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


#: The name under which an adapter hands over the output projection's bias as it reaches the residual stream
#: (``"bias.{l}"``): not a component (it does not move with the offset), but the heads' pieces and it add up to
#: ``"attention.{l}"``, which the capture checks.
BIAS_PART = "bias.{layer}"
_BIAS = re.compile("^" + re.escape(BIAS_PART).replace(re.escape("{layer}"), r"(\d+)") + "$")


def parse_piece(name: str) -> tuple[str, int | None, int | None]:
    """:func:`parse_component` of what an adapter hands over when it reads heads: a component, or a projection's
    bias (:data:`BIAS_PART`), whose kind is ``"bias"``.

    Raises:
        InputError: neither.
    """
    match = _BIAS.match(name) if isinstance(name, str) else None
    return ("bias", int(match.group(1)), None) if match else parse_component(name)


@dataclass(frozen=True)
class ComponentRequest:
    """What an adapter reads for the attribution: which components of which layers.

    Attributes:
        embedding: read the embedding (block 0's input).
        blocks: layers whose attention and MLP outputs are read.
        heads: layers whose heads' pieces are read (with the projection's bias, :data:`BIAS_PART`).
    """

    embedding: bool
    blocks: tuple[int, ...]
    heads: tuple[int, ...]

    @classmethod
    def of(cls, names: Sequence[str]) -> ComponentRequest:
        parsed = [parse_component(name) for name in names]
        return cls(embedding=any(kind == EMBEDDING for kind, _, _ in parsed),
                   blocks=tuple(sorted({layer for kind, layer, _ in parsed if kind in ("attention", "mlp")})),
                   heads=tuple(sorted({layer for kind, layer, _ in parsed if kind == "head"})))

    def __bool__(self) -> bool:
        return self.embedding or bool(self.blocks) or bool(self.heads)


def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder block receives (positionally or as ``hidden_states=``)."""
    return args[0] if args else kwargs["hidden_states"]


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face module itself where a framework wraps it (a TransformerBridge's ``original_component``)."""
    return getattr(module, "original_component", None) or module


def norm_epsilon(norm: torch.nn.Module) -> float:
    """An RMS norm's ``ε`` (its ``eps`` or ``variance_epsilon``)."""
    norm = unwrapped(norm)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if eps is None:
        raise AttentionCaptureError(
            f"the post-norm {type(norm).__name__} has no eps or variance_epsilon, so the heads' pieces under it "
            "cannot be formed; ask for block-level components only (no attribution heads) for this model")
    return float(eps)


def norm_gain(norm: torch.nn.Module) -> torch.Tensor:
    """An RMS post-norm's effective gain ``w_eff`` (``1 + w`` for Gemma's norms, ``w`` for OLMo 2's), float64
    ``[d]``, read by running the norm once on a vector of ones (``norm(1) = w_eff / √(1 + ε)``), so no
    architecture's formula is copied here. Call it outside the forward pass (the norm's own hooks would fire)."""
    norm = unwrapped(norm)
    weight = norm.weight
    ones = torch.ones((1, weight.shape[-1]), dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        return norm(ones)[0].detach().to(torch.float64) * math.sqrt(1.0 + norm_epsilon(norm))


def post_norm_scale(gain: torch.Tensor, eps: float, norm_input: torch.Tensor) -> torch.Tensor:
    """``w_eff / rms(o)`` per token, float64 ``[..., d]``: what an RMS post-norm multiplies its input ``o`` by,
    with ``rms(o) = √(mean(o²) + ε)`` the token's own. A head's piece under the norm is ``w_eff ⊙ piece / rms(o)``:
    linear in the piece, with the whole output's ``rms(o)`` taken as it was, so the heads' pieces still add up to
    the norm's output."""
    o = norm_input.detach().to(torch.float64)
    return gain.to(o.device) / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps)


def head_pieces(z: torch.Tensor, projection: torch.nn.Module, n_heads: int,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each head's piece of the attention output, float64: ``(pieces [..., head, d], bias [..., d] or None)``.

    Args:
        z: ``[..., head·d_head]``: the output projection's input, the heads' outputs side by side.
        projection: ``o_proj`` (a ``Linear``, weight ``[d, head·d_head]``) or GPT-2's ``Conv1D`` (weight
            ``[head·d_head, d]``).
        n_heads: query heads.
        scale: :func:`post_norm_scale` under a post-norm (``None``: none).

    Returns:
        ``piece_h = z_h · W_O[h]`` (times ``scale``) and the bias's part (``b``, times ``scale``), which sum to what
        the attention adds to the residual stream.
    """
    projection = unwrapped(projection)
    weight = projection.weight.detach().to(torch.float64)
    split = z.detach().to(torch.float64).reshape(*z.shape[:-1], n_heads, -1)
    if hasattr(projection, "nf"):  # transformers' Conv1D (GPT-2): y = x·W + b with W [in, out]
        pieces = torch.einsum("...hk,hkd->...hd", split, weight.reshape(n_heads, -1, weight.shape[-1]))
    else:  # a Linear: W [out, in]
        pieces = torch.einsum("...hk,dhk->...hd", split, weight.reshape(weight.shape[0], n_heads, -1))
    bias = getattr(projection, "bias", None)
    bias = None if bias is None else bias.detach().to(torch.float64).expand(pieces.shape[:-2] + bias.shape).clone()
    if scale is not None:
        pieces = pieces * scale.unsqueeze(-2)
        bias = None if bias is None else bias * scale
    return pieces, bias


@dataclass(frozen=True)
class HeadWrites:
    """What block ``layer``'s attention writes into the residual stream, as a forward pass shows it, ready to be split
    by head on the rows a feature keeps: the value of site ``"pieces.{l}"`` on every framework.

    Attributes:
        layer: the block.
        z: ``[batch, T, head·d_head]`` the output projection's input (the heads' outputs side by side).
        norm_input: ``[batch, T, d]`` the post-norm's input under a post-norm, else ``None``.
        projection: the output projection (``o_proj``, or GPT-2's ``Conv1D``).
        norm: ``(w_eff, ε)`` of the post-norm (:func:`norm_gain`, :func:`norm_epsilon`), read before the pass;
            ``None`` without one.
        n_heads: query heads.
    """

    layer: int
    z: torch.Tensor
    norm_input: torch.Tensor | None
    projection: torch.nn.Module
    norm: tuple[torch.Tensor, float] | None
    n_heads: int

    def pieces(self, rows: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`head_pieces` of the rows ``rows(tensor)`` keeps of ``z`` (and of the post-norm's input):
        ``(pieces [..., head, d], bias [..., d] or None)``, float64, which sum to what the attention adds."""
        cut = (lambda tensor: tensor) if rows is None else rows
        scale = None if self.norm is None else post_norm_scale(*self.norm, cut(self.norm_input))
        return head_pieces(cut(self.z), self.projection, self.n_heads, scale)


def post_norms_of(parts: Sequence[BlockParts], layers: Sequence[int]) -> dict[int, tuple[torch.Tensor, float]]:
    """Per layer of ``layers`` under a post-norm, ``(w_eff, ε)`` of the norm after its attention (read by running the
    norm, so before a pass: :attr:`HeadWrites.norm`)."""
    return {layer: (norm_gain(parts[layer].attention_out), norm_epsilon(parts[layer].attention_out))
            for layer in layers if parts[layer].post_norms}


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
    kind, layer, head = parse_component_of(name, len(parts))
    if kind == EMBEDDING:
        return parts[0].layer, True, None
    if kind == "head":
        return parts[layer].projection, True, head
    return (parts[layer].attention_out if kind == "attention" else parts[layer].mlp_out), False, None
