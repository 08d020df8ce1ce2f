"""What streams and merges: float64 sums of a model's activity over documents.

Every class here follows one protocol, :class:`Mergeable`: state is counts and float64 sums
(or, for the entry sample, a bottom-k sample) that two runs over disjoint documents combine
exactly with ``a.merge(b)`` or ``a + b``, whatever their batch sizes, processes or machines.

* :class:`AttentionStatistics` — sums of attention weights (METHODS.md sections 1-3).
* :class:`EntrySample` — a bounded uniform sample of attention entries (scatter plots).
* :class:`RepresentationSums` — sums of attention outputs and residual streams (section 4).
* :mod:`~equivariance_probe.statistics.engines.in_trace` — the torch-only reductions behind them, which
  also run inside remote nnsight traces.

Nothing here imports a model framework: only torch, numpy and the package's errors.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from .attention import AttentionStatistics
from .config import STATISTICS, StatisticsConfig
from .representation import RepresentationSums
from .sample import EntrySample

__all__ = ["Mergeable", "AttentionStatistics", "EntrySample", "RepresentationSums", "STATISTICS", "StatisticsConfig"]

_Self = TypeVar("_Self", bound="Mergeable")


@runtime_checkable
class Mergeable(Protocol):
    """State that merges exactly by adding: ``a.merge(b)`` (also ``a + b``) is the state of both runs."""

    def merge(self: _Self, other: _Self) -> _Self: ...

    def __add__(self: _Self, other: _Self) -> _Self: ...
