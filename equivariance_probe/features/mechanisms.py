"""Mechanisms of one's own, read by offset in the shift test: a site, a measure of each window's segment rows, and
the sums of that measure at every offset.

Place in the seams: *features*. A :class:`SegmentMechanism` is the smallest feature: it names a site of the grammar
(:mod:`~equivariance_probe.adapters.sites`) and a torch-only ``measure`` of one window's segment rows there
(``[m, width] → tensor``); :class:`MechanismSums` adds the read to every segment pass of a shift run
(:func:`~equivariance_probe.features.segments.segment_pass`'s ``more``) and sums the measure per offset. On a
remote model the measure runs on the server (a :class:`~equivariance_probe.adapters.plan.Read`'s ``reduce``),
so only ``[batch, ...]`` values travel; the measure's module must be importable there, or be shipped by value
(``cloudpickle.register_pickle_by_value``).

Nothing here names a framework, and adding a mechanism touches no adapter: the adapters give the sites.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..adapters.plan import Read
from ..adapters.segments import Spans, segment_measure
from ..errors import InputError

__all__ = ["SegmentMechanism", "MechanismSums", "mechanism_by_offset"]


@dataclass(frozen=True)
class SegmentMechanism:
    """One quantity read at a site, at each window's segment, and averaged by offset.

    Attributes:
        name: what the run's ``metadata["mechanisms"]`` calls it.
        site: a site name (``"mlp.3"``, ``"resid.0"``, ``"head.2.1"``, ...): one tensor ``[batch, T, width]``.
        measure: ``measure(rows [m, width]) → tensor`` of one window's segment rows (float64 is kept; torch only,
            so that it can run where the model runs).
    """

    name: str
    site: str
    measure: Callable[[torch.Tensor], torch.Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InputError(f"a mechanism's name must be a non-empty string, got {self.name!r}")
        if not callable(self.measure):
            raise InputError(f"mechanism {self.name!r}: measure must be a function of the segment rows, got "
                             f"{type(self.measure).__name__}")


class MechanismSums:
    """The running sums of some :class:`SegmentMechanism` s at each of ``n_offsets`` offsets (float64)."""

    def __init__(self, mechanisms: Sequence[SegmentMechanism], offsets: Sequence[int]) -> None:
        names = [mechanism.name for mechanism in mechanisms]
        if len(set(names)) != len(names):
            raise InputError(f"mechanism names must differ, got {names}")
        self.mechanisms, self.offsets = tuple(mechanisms), tuple(int(offset) for offset in offsets)
        self.sums: dict[str, Any] = {name: None for name in names}
        self.counts: dict[str, np.ndarray] = {name: np.zeros(len(self.offsets), dtype=np.int64) for name in names}

    def steps(self, offset_indices: Sequence[int]) -> Callable[[Spans], list[tuple[str, Any]]]:
        """``more(spans)`` for a segment pass whose window ``b`` sits at offset ``offset_indices[b]``."""
        def more(spans: Spans) -> list[tuple[str, Any]]:
            return [(mechanism.site, Read(self._adder(mechanism.name, offset_indices),
                                          reduce=segment_measure(mechanism.measure, spans)))
                    for mechanism in self.mechanisms]
        return more

    def _adder(self, name: str, offset_indices: Sequence[int]) -> Callable[[torch.Tensor], None]:
        def add(values: torch.Tensor) -> None:
            values = values.detach().to(torch.float64).cpu().numpy()
            if self.sums[name] is None:
                self.sums[name] = np.zeros((len(self.offsets), *values.shape[1:]))
            for b, index in enumerate(offset_indices):
                self.sums[name][index] += values[b]
                self.counts[name][index] += 1
        return add

    def to_dict(self) -> dict[str, Any]:
        """``{name: {"site", "offsets", "sum", "count"}}``, plain lists (a run's metadata, saved with it)."""
        return {mechanism.name: {"site": mechanism.site, "offsets": list(self.offsets),
                                 "sum": None if self.sums[mechanism.name] is None else self.sums[mechanism.name].tolist(),
                                 "count": self.counts[mechanism.name].tolist()} for mechanism in self.mechanisms}


def mechanism_by_offset(metadata: dict[str, Any], name: str) -> dict[str, np.ndarray]:
    """``{"offsets", "mean", "count"}`` of mechanism ``name`` in a shift run's ``metadata``: the measure's mean over
    every window at each offset.

    Raises:
        InputError: the run read no mechanism of that name.
    """
    recorded = metadata.get("mechanisms", {})
    if name not in recorded:
        raise InputError(f"this shift run read no mechanism {name!r}; it read {sorted(recorded) or 'none'}")
    entry = recorded[name]
    count = np.asarray(entry["count"], dtype=np.int64)
    total = np.asarray(entry["sum"], dtype=np.float64)
    shape = (-1,) + (1,) * (total.ndim - 1)
    return {"offsets": np.asarray(entry["offsets"]), "mean": total / count.reshape(shape), "count": count}
