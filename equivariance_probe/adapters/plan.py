"""Plans: what one forward pass reads and replaces, as a list of ``(site, action)``.

Place in the seams: *adapters*, the contract between a feature and the frameworks. A feature (an analysis
above the adapters) says *what* it needs as a :class:`Plan` of named sites
(:mod:`~equivariance_probe.adapters.sites`) and actions, and hands it with token windows to
:meth:`~equivariance_probe.adapters.base.Adapter.run_plan`; each framework's binder
(:mod:`~equivariance_probe.adapters.hf_binder`, :mod:`~equivariance_probe.adapters.tl_binder`,
:mod:`~equivariance_probe.adapters.nnsight_binder`) finds the sites among its own hook points, once, and runs the
pass. A feature never registers a hook, and runs on every framework whose binder gives its sites.

Actions:

* :class:`Read` calls an accumulator ``fn(value)`` with what flows at the site (a tensor; an
  :class:`~equivariance_probe.adapters.internals.AttentionCall` at ``"qk.{l}"``), detached, while the pass runs;
* :class:`Replace` puts a tensor, or ``fn(value)``, in its place (the rest of the pass sees the replacement);
* :class:`Stop` ends the pass once the site has been reached and its other actions done.

A plan also carries what holds for the whole pass: an ablation of
:func:`~equivariance_probe.adapters.internals.ablate` in force; how many of the last positions the
language-model head projects (``"final"`` and ``"logits"`` are then ``[batch, k, ...]`` on every framework, as
transformers' ``logits_to_keep`` gives them); and whether the attention calls read at ``"qk.{l}"`` run the
model's own kernel (``sdpa``, flash, the Triton engine) rather than eager attention, which ``"weights.{l}"`` and
the ablations need. The inputs of one pass beside its tokens (position ids, an encoder's attention mask) go to
:meth:`~equivariance_probe.adapters.base.Adapter.run_plan`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..errors import InputError
from .internals import _parse_ablation
from .sites import Site, expand, site_order

__all__ = ["Read", "Replace", "Stop", "Action", "Plan"]


@dataclass(frozen=True)
class Read:
    """Call ``fn(value)`` with the value at the site, or ``fn(reduce(value))``.

    ``reduce`` runs where the model runs (on a server, for a remote model), so only what it returns travels: it
    must use nothing but ``torch`` and the values it closes over (a remote request ships it by value).
    """

    fn: Callable[[Any], None]
    reduce: Callable[[torch.Tensor], Any] | None = None


@dataclass(frozen=True)
class Replace:
    """Put ``value`` (a tensor of the site's shape, or a function of the site's value that returns one) in the
    site's place."""

    value: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]

    def applied(self, current: torch.Tensor) -> torch.Tensor:
        """The replacement of ``current``."""
        return self.value(current) if callable(self.value) else self.value


@dataclass(frozen=True)
class Stop:
    """End the forward pass after the site (nothing after it is computed where the framework allows)."""


Action = Union[Read, Replace, Stop]
#: Sites whose value is not one tensor in the model's flow, so they can be read and not replaced.
READ_ONLY = ("qk", "scores", "weights", "pieces")


@dataclass(frozen=True)
class Plan:
    """What one forward pass reads, replaces and where it stops.

    Attributes:
        steps: ``(site, action)`` pairs, sites parsed (``"head.{l}.*"`` expanded), in the order given; at one site
            the actions run in this order.
        ablation: ``()`` or the parsed ablation of :func:`~equivariance_probe.adapters.internals.ablate` in force.
        logits_kept: the language-model head projects the last ``logits_kept`` positions only (0: every position).
        n_layers: blocks of the model the sites were checked against.
        own_kernel: the attention calls read at ``"qk.{l}"`` run the model's own kernel (no ``"weights.{l}"``
            and no ablation then: both need eager attention).
    """

    steps: tuple[tuple[Site, Action], ...]
    ablation: tuple[str, ...] = ()
    logits_kept: int = 0
    n_layers: int = 0
    own_kernel: bool = False

    @property
    def last_position_logits(self) -> bool:
        """Whether the head projects the last position only."""
        return self.logits_kept == 1

    @classmethod
    def of(cls, steps: Sequence[tuple[str, Action]], *, n_layers: int, n_heads: int, ablation: str | None = None,
           last_position_logits: bool = False, logits_kept: int = 0, own_kernel: bool = False) -> Plan:
        """A plan of named sites, checked against a model of ``n_layers`` blocks of ``n_heads`` heads
        (``last_position_logits`` is ``logits_kept=1``).

        Raises:
            SiteError: a name that is not a site, or a block or head the model does not have.
            InputError: an action that is not a :class:`Read`, :class:`Replace` or :class:`Stop`, a replacement of
                a read-only site (``"qk.{l}"``, ``"scores.{l}"``, ``"weights.{l}"``, ``"pieces.{l}"``), an unknown
                ablation, or the model's own kernel asked for beside eager attention's weights or an ablation.
        """
        parsed = []
        for name, action in steps:
            if not isinstance(action, (Read, Replace, Stop)):
                raise InputError(f"the action at site {name!r} is a {type(action).__name__}; give Read(fn), "
                                 "Replace(tensor or fn) or Stop()")
            for site in expand([name], n_layers=n_layers, n_heads=n_heads):
                if isinstance(action, Replace) and site.kind in READ_ONLY:
                    raise InputError(f"site {site.name!r} can be read, not replaced; replace 'head.<l>.<h>', "
                                     "'attention.<l>', 'mlp.<l>', 'resid.<l>', 'embedding', 'final' or 'logits'")
                parsed.append((site, action))
        kept = 1 if last_position_logits else int(logits_kept)
        plan = cls(tuple(parsed), _parse_ablation(ablation), kept, int(n_layers), bool(own_kernel))
        if plan.own_kernel and (plan.ablation or "weights" in plan.kinds()):
            raise InputError("a plan that reads 'weights.<l>' or ablates runs eager attention; ask for the model's "
                             "own kernel (own_kernel=True) only in a plan that does neither")
        return plan

    def sites(self) -> list[Site]:
        """Each site of the plan once, in the order the forward pass reaches them."""
        return sorted(dict.fromkeys(site for site, _ in self.steps), key=lambda s: (*site_order(s, self.n_layers),
                                                                                     s.head or 0))

    def actions(self, site: Site) -> list[Action]:
        """The actions at ``site``, in the plan's order."""
        return [action for at, action in self.steps if at == site]

    def kinds(self) -> set[str]:
        """The kinds of site the plan touches."""
        return {site.kind for site, _ in self.steps}

    def needs_head(self) -> bool:
        """Whether the pass must run the language-model head (``"final"`` or ``"logits"``)."""
        return bool(self.kinds() & {"final", "logits"})


def apply(actions: Sequence[Action], value: Any, *, head_rows: int = 0) -> tuple[Any, bool, bool]:
    """Run ``actions`` on ``value``: ``(value after the replacements, whether one was made, whether to stop)``.
    ``head_rows``: keep the last ``head_rows`` positions only (a plan's :attr:`Plan.logits_kept` at ``"final"``
    or ``"logits"``, on a framework that projected every position; 0: all)."""
    if head_rows and isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-2] != head_rows:
        value = value[..., -head_rows:, :]
    replaced = stop = False
    for action in actions:
        if isinstance(action, Read):
            seen = value.detach() if isinstance(value, torch.Tensor) else value
            action.fn(seen if action.reduce is None else action.reduce(seen))
        elif isinstance(action, Replace):
            value, replaced = action.applied(value), True
        else:
            stop = True
    return value, replaced, stop
