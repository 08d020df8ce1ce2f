"""The site grammar: named places in a model, spelt the same on every framework.

Place in the seams: *adapters*. A site names a place in a decoder's forward pass; each framework's binder
(:mod:`~equivariance_probe.adapters.hf_binder`, :mod:`~equivariance_probe.adapters.tl_binder`,
:mod:`~equivariance_probe.adapters.nnsight_binder`) finds it among its own hook points, and a
:class:`~equivariance_probe.adapters.plan.Plan` reads or replaces what flows there. The components of the
residual stream (:mod:`~equivariance_probe.adapters.components`) are sites of this grammar.

* ``"embedding"``: the hidden states entering block 0, as the model scales them ``[batch, T, d]``;
* ``"attention.{l}"``, ``"mlp.{l}"``: what block ``l``'s attention and MLP add to the residual stream
  ``[batch, T, d]`` (under a post-norm, the norm's output);
* ``"attention_module.{l}"``: the output of block ``l``'s attention module itself, before any post-norm (the
  same tensor as ``"attention.{l}"`` in a pre-norm block; in Gemma 2/3 and OLMo 2 the norm's input), where a
  weighted average of values shows its variance (docs/methods.md#order);
* ``"head.{l}.{h}"``: query head ``h``'s columns of block ``l``'s output-projection input ``[batch, T, d_head]``;
  ``"head.{l}.*"`` is every head of layer ``l``;
* ``"resid.{l}"``: the residual stream after block ``l`` ``[batch, T, d]``;
* ``"qk.{l}"``: the queries and keys as block ``l``'s attention call receives them, with its scaling, soft cap
  and mask (an :class:`~equivariance_probe.adapters.internals.AttentionCall`);
* ``"scores.{l}"``: block ``l``'s pre-softmax scores as a framework that forms them itself hands them (an
  :class:`~equivariance_probe.adapters.internals.AttentionScores`; a TransformerBridge's ``hook_attn_scores``, the
  scores its own attention formed);
* ``"weights.{l}"``: block ``l``'s post-softmax attention weights ``[batch, head, query, key]``;
* ``"pieces.{l}"``: what block ``l``'s attention writes into the residual stream, split by head (a
  :class:`~equivariance_probe.adapters.components.HeadWrites`: each head's piece formed from its columns of the
  output projection's input and the projection's weights, on the rows a feature keeps);
* ``"final"``: the last hidden state as the language-model head reads it (after the final norm);
* ``"logits"``: the language-model head's output ``[batch, T, vocab]``.

A head has one spelling, ``"head.{l}.{h}"``; the short label ``"L{l}H{h}"`` that tables and figures print
parses to it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import SiteError

__all__ = ["SITE_KINDS", "Site", "parse_site", "parse_sites", "head_site", "every_head", "site_order", "expand"]

#: The kinds of site, in the order a forward pass reaches them within a block.
SITE_KINDS = ("embedding", "qk", "scores", "weights", "head", "pieces", "attention_module", "attention", "mlp", "resid",
              "final", "logits")
#: Kinds that name one block: ``"{kind}.{layer}"``.
LAYER_KINDS = ("qk", "scores", "weights", "pieces", "attention_module", "attention", "mlp", "resid")
_WHOLE = ("embedding", "final", "logits")
_NAME = re.compile(r"^(?:(embedding|final|logits)|(qk|scores|weights|pieces|attention_module|attention|mlp|resid)\.(\d+)|head\.(\d+)\.(\d+|\*)"
                   r"|L(\d+)H(\d+))$")
_SPELLINGS = ("'embedding'", "'attention.<layer>'", "'attention_module.<layer>'", "'mlp.<layer>'", "'head.<layer>.<head>'", "'head.<layer>.*'",
              "'resid.<layer>'", "'qk.<layer>'", "'scores.<layer>'", "'weights.<layer>'", "'pieces.<layer>'", "'final'", "'logits'")


@dataclass(frozen=True)
class Site:
    """One named place: its kind, and the block and head where the kind has them (``None`` where not)."""

    kind: str
    layer: int | None = None
    head: int | None = None

    @property
    def name(self) -> str:
        """The canonical spelling (``"head.4.3"``, ``"resid.0"``, ``"logits"``)."""
        if self.kind in _WHOLE:
            return self.kind
        if self.kind == "head":
            return head_site(self.layer, self.head)
        return f"{self.kind}.{self.layer}"

    def __str__(self) -> str:
        return self.name


def head_site(layer: int, head: int) -> str:
    """``"head.{layer}.{head}"``, the one spelling of a head."""
    return f"head.{int(layer)}.{int(head)}"


def every_head(layer: int) -> str:
    """``"head.{layer}.*"``: every query head of block ``layer``."""
    return f"head.{int(layer)}.*"


def parse_sites(name: str, *, n_layers: int | None = None, n_heads: int | None = None) -> tuple[Site, ...]:
    """The sites ``name`` spells: one, or every head of a layer for ``"head.{l}.*"``.

    Args:
        name: a site name (module docstring); ``"L{l}H{h}"`` is read as ``"head.{l}.{h}"``.
        n_layers: blocks of the model, to refuse a layer it does not have (``None``: not checked).
        n_heads: query heads per block, needed to expand ``"head.{l}.*"`` and to check a head.

    Raises:
        SiteError: not a site name, a block or head the model does not have, or ``"head.{l}.*"`` without
            ``n_heads``.
    """
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise SiteError(f"site {name!r} is not a site name; the sites are {', '.join(_SPELLINGS)}")
    whole, kind, layer, head_layer, head, short_layer, short_head = match.groups()
    if whole:
        return (Site(whole),)
    if kind:
        return (_checked(Site(kind, int(layer)), name, n_layers, n_heads),)
    layer, head = (head_layer, head) if head_layer is not None else (short_layer, short_head)
    if head != "*":
        return (_checked(Site("head", int(layer), int(head)), name, n_layers, n_heads),)
    if n_heads is None:
        raise SiteError(f"site {name!r} means every head of layer {layer}, which needs the model's head count; "
                        "name the heads one by one ('head.<layer>.<head>') or give n_heads")
    return tuple(_checked(Site("head", int(layer), h), name, n_layers, n_heads) for h in range(int(n_heads)))


def parse_site(name: str, *, n_layers: int | None = None, n_heads: int | None = None) -> Site:
    """The one site ``name`` spells (:func:`parse_sites`; ``"head.{l}.*"`` is refused: it names several).

    Raises:
        SiteError: as :func:`parse_sites`, or a name of several sites.
    """
    if isinstance(name, str) and name.endswith(".*"):
        raise SiteError(f"site {name!r} names every head of a layer; name one head ('head.<layer>.<head>') here")
    return parse_sites(name, n_layers=n_layers, n_heads=n_heads)[0]


def _checked(site: Site, name: str, n_layers: int | None, n_heads: int | None) -> Site:
    if n_layers is not None and not 0 <= site.layer < n_layers:
        raise SiteError(f"site {name!r}: the model has layers 0 to {n_layers - 1}")
    if site.head is not None and n_heads is not None and not 0 <= site.head < n_heads:
        raise SiteError(f"site {name!r}: the model has heads 0 to {n_heads - 1} in each layer")
    return site


def site_order(site: Site, n_layers: int) -> tuple[int, int]:
    """Where a forward pass reaches ``site``: ``(block, step)``, the embedding before block 0 and the final
    norm and the head after the last block; within a block, :data:`SITE_KINDS`' order."""
    if site.kind == "embedding":
        return (-1, 0)
    if site.kind in ("final", "logits"):
        return (n_layers, SITE_KINDS.index(site.kind))
    return (site.layer, SITE_KINDS.index(site.kind))


def expand(names: Iterable[str], *, n_layers: int, n_heads: int) -> tuple[Site, ...]:
    """Every site of ``names``, ``"head.{l}.*"`` expanded, checked against the model's blocks and heads."""
    return tuple(site for name in names for site in parse_sites(name, n_layers=n_layers, n_heads=n_heads))
