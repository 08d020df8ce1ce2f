"""What streams and merges: float64 sums of a model's activity over documents.

Every class here follows one protocol, :class:`Mergeable`: state is counts and float64 sums
(or, for the entry sample, a bottom-k sample) that two runs over disjoint documents combine
exactly with ``a.merge(b)`` or ``a + b``, whatever their batch sizes, processes or machines.

* :class:`AttentionStatistics` — sums of attention weights (docs/methods.md sections 1-3).
* :class:`EntrySample` — a bounded uniform sample of attention entries (scatter plots).
* :class:`RepresentationSums` — sums of attention outputs and residual streams (docs/methods.md#order).
* :mod:`~equivariance_probe.statistics.engines` — the engines that reduce one layer of one batch,
  ``f(query, key, spec) -> sums`` with a :class:`~equivariance_probe.statistics.engines.spec.ReductionSpec`
  (torch query blocks, a fused Triton kernel on CUDA, and the reduction that runs inside remote
  nnsight traces), under one dispatcher.

How the attention statistics are put together, one job per module: :mod:`.config` (what must agree
for a merge, and every array with its shape and merge rule), :mod:`.options` (how a run measures), :mod:`.batch` (one batch on its way
in, added whole or not at all), :mod:`.engines` (the reductions), :mod:`.mask_check` (the first
batch's check of the adapter's mask), :mod:`.elsewhere` (batches reduced in a remote trace),
:mod:`.window_sinks` (each window's first-token weight, kept per window because Gu et al.'s sink rate
thresholds each one: merged by putting windows together, not by adding), :mod:`.attention` (the streaming
object that ties them together and merges).

Adding a family of sums (a new measurement that streams and merges):

1. Declare its arrays once, in a table ``{name: Sum(shape, meaning, merge="add", kept_if=None)}``
   (:class:`~equivariance_probe.statistics.sums.Sum`), shapes in letters of the family's sizes
   (``"L H T"``), as :data:`STATISTICS` does (:mod:`.sums`). Counts and sums merge by ``"add"``
   (:data:`~equivariance_probe.statistics.config.MERGE_RULES`); an optional array names the
   configuration flag that keeps it. A sum of the attention statistics also says what the machinery
   needs of it: the shape an engine returns per batch (``window``), whether the first batch's check
   compares it (``checked``) and its shape per interval group (``group``); the engines' allocation, the
   staging of a batch, the check, the groups and the size of a remote reply read these, not lists of names.
2. Declare how it is measured in one frozen dataclass, as
   :class:`~equivariance_probe.statistics.config.StatisticsConfig` does: the fields that must agree
   for a merge, ``sizes()`` (the letters' values), ``to_dict``/``from_dict`` (what files store) and
   ``differences`` (what a refused merge names).
3. Allocate with :func:`~equivariance_probe.statistics.config.shapes_of` and merge, copy and move
   with one loop over the table (:func:`~equivariance_probe.statistics.config.merge_arrays`); nothing
   is written per array name.
4. Compute a batch's sums with engines of the form ``f(tensors, spec) -> sums`` (a new option of
   the reduction is a field of the spec), stage them per batch and add them only when the batch is
   complete (:class:`~equivariance_probe.statistics.batch.BatchTransaction`).
5. Files (:mod:`equivariance_probe.records`) store the arrays under the table's names and the
   configuration's ``to_dict``; an older layout is translated there, never here.

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
