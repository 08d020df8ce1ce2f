"""Confidence intervals from delete-a-group jackknife replicates.

Place in the seams: *maths*, pure functions of numpy arrays (scipy for the t quantile, imported
when used). The replicates come from per-group sums
(:meth:`~equivariance_probe.statistics.groups.WindowGroups.replicates`): windows fall into ``G``
groups, and ``θ₍g₎`` is the statistic recomputed on every window but those of group ``g``.

Over the ``G'`` non-empty groups (Kott's delete-a-group jackknife, "JK1"):

* ``v = (G' - 1)/G' · Σ_g (θ₍g₎ - θ̄)²``, ``θ̄`` the mean of the replicates, ``se = √v``;
* the interval ``θ ± t_{G'-1, (1+level)/2} · se`` around the full-data estimate ``θ``.

An R² is at most 1, and near 1 the symmetric interval runs past it (``0.9908 [0.9377, 1.0439]``).
For a statistic bounded above by ``b`` (``upper=1`` for every R²) the interval is *clipped* at ``b``:
``[min(θ - t·se, b), min(θ + t·se, b)]``, and ``Interval.method`` says so (:data:`CLIPPED`) whenever
an end was clipped. Clipping keeps the interval's coverage (the true value is at most ``b``) and its
lower end; an interval on ``log(b - θ)`` was tried and rejected: where a replicate comes close to
``b`` its log spread explodes and the lower end runs to absurd values (-5e4 for replicates within
1e-4 of 1). ``standard_error`` is always the plain jackknife ``se`` of ``θ``.

With fewer than two non-empty groups there is no spread to measure: the interval is undefined and
:func:`jackknife_interval` says so by raising :class:`~equivariance_probe.errors.IntervalUnavailableError`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, IntervalUnavailableError

__all__ = ["Interval", "jackknife_interval", "check_level", "windows_for_half_width", "format_interval",
           "PLAIN", "CLIPPED", "CLIPPED_RANGE", "UNAVAILABLE", "estimate_alone"]

#: ``Interval.method`` of the plain interval ``θ ± t·se``.
PLAIN = "jackknife t"
#: ``Interval.method`` of an interval of a bounded statistic (an R² ≤ 1) with an end clipped at the bound.
CLIPPED = "jackknife t, clipped at the bound (R² ≤ 1)"
#: ``Interval.method`` of an estimate whose interval cannot be formed (its values fall into fewer than 2 groups):
#: ``low``, ``high`` and ``standard_error`` are NaN, and it prints as the estimate alone.
UNAVAILABLE = "no interval: fewer than 2 groups"

#: ``Interval.method`` of an interval of a statistic with both bounds (a weight or a share of heads, in
#: ``[0, 1]``) with an end clipped at one of them.
CLIPPED_RANGE = "jackknife t, clipped to the statistic's range [0, 1]"


def check_level(level: Any, name: str = "interval") -> float:
    """``level`` as a float in ``(0, 1)``, or :class:`InputError` naming it as the argument ``name``."""
    # Any real number type (numpy's float32 too), never a bool; ``nan`` fails both comparisons.
    if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0.0 < float(level) < 1.0:
        raise InputError(f"{name}={level!r} must be a confidence level between 0 and 1, e.g. {name}=0.95")
    return float(level)


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval over windows.

    Attributes:
        estimate: ``θ``, from every window (a float, or an array: ``[layer]``, ``[layer, head]``).
        low, high: ``θ ∓ t·se``, shaped like ``estimate``.
        level: the confidence level (0.95).
        n_groups: ``G'``, the non-empty groups of windows behind the replicates.
        standard_error: ``se``, the jackknife standard error, shaped like ``estimate``.
        method: how the interval was formed: :data:`PLAIN`, or :data:`CLIPPED` where an end was clipped at
            the statistic's bound (an R²'s 1).

    Example:
        >>> interval = Interval(0.017, 0.015, 0.019, 0.95, 20, 0.001)
        >>> str(interval)
        '0.0170 [0.0150, 0.0190]'
    """

    estimate: Any
    low: Any
    high: Any
    level: float
    n_groups: int
    standard_error: Any
    method: str = PLAIN

    @property
    def width(self) -> Any:
        """``high - low``."""
        return np.subtract(self.high, self.low)

    @property
    def half_width(self) -> Any:
        """``t·se``, the ``±`` of the unclipped interval (``(high - low) / 2`` where nothing was clipped)."""
        if self.method == PLAIN:
            return np.subtract(self.high, self.low) / 2
        if self.method == CLIPPED_RANGE:
            return np.maximum(np.subtract(self.estimate, self.low), np.subtract(self.high, self.estimate))
        return np.subtract(self.estimate, self.low)

    def __str__(self) -> str:
        if np.ndim(self.estimate):
            return f"{self._heading()}:\n{self._table()}"
        if self.method == UNAVAILABLE:
            return f"{_number(self.estimate, 4)} (no interval)"
        return format_interval(self.estimate, self.low, self.high)

    def __repr__(self) -> str:
        if np.ndim(self.estimate):
            return f"Interval({self._heading()}:\n{self._table()})"
        return f"Interval({self}, {self._about()})"

    def _about(self) -> str:
        """The level, the groups and the method, as the repr says them."""
        if self.method == UNAVAILABLE:
            return f"{self.n_groups} group{'s' if self.n_groups != 1 else ''}: an interval needs at least 2"
        clipped = {PLAIN: "", CLIPPED: ", clipped at R² = 1"}.get(self.method, ", clipped to [0, 1]")
        return f"{self.level:.0%} over {self.n_groups} groups of windows{clipped}"

    def _heading(self) -> str:
        return f"of shape {np.shape(self.estimate)}, {self._about()}"

    def _table(self, limit: int = 12) -> str:
        """One line per entry, ``[index] estimate [low, high]``; past ``limit`` entries, the first and last
        ``limit / 2`` with the count of those left out between them."""
        estimate, low, high = (np.asarray(value, dtype=np.float64) for value in (self.estimate, self.low, self.high))
        indices = list(np.ndindex(estimate.shape))
        lines = [f"  [{', '.join(map(str, index))}] {format_interval(estimate[index], low[index], high[index])}"
                 for index in indices]
        if len(lines) > limit:
            lines = [*lines[:limit // 2], f"  ... {len(lines) - limit} more ...", *lines[-(limit // 2):]]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """``estimate, low, high, level, n_groups, standard_error, method`` (arrays as lists)."""
        return {name: np.asarray(value).tolist() if np.ndim(value) else value
                for name, value in (("estimate", self.estimate), ("low", self.low), ("high", self.high),
                                    ("level", self.level), ("n_groups", self.n_groups),
                                    ("standard_error", self.standard_error), ("method", self.method))}


def is_undefined(value: Any) -> bool:
    """A missing number: ``None`` (how JSON holds NaN) or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def estimate_alone(estimate: Any, *, level: float, n_groups: int) -> Interval:
    """``estimate`` as an :class:`Interval` without ends (:data:`UNAVAILABLE`): what a paired difference gives where
    the values fall into fewer than 2 groups, so that it prints and tabulates as the estimate alone."""
    missing = np.full(np.shape(estimate), np.nan) if np.ndim(estimate) else math.nan
    return Interval(estimate, missing, missing, level, n_groups, missing, UNAVAILABLE)


def _number(value: Any, digits: int) -> str:
    return "n/a" if value is None or not math.isfinite(float(value)) else f"{float(value):.{digits}f}"


def format_interval(estimate: Any, low: Any, high: Any, digits: int = 4) -> str:
    """``"0.0170 [0.0150, 0.0190]"``; ``n/a`` for an undefined estimate."""
    return f"{_number(estimate, digits)} [{_number(low, digits)}, {_number(high, digits)}]"


def jackknife_interval(estimate: Any, replicates: Any, *, level: float = 0.95, upper: float | None = None,
                       lower: float | None = None) -> Interval:
    """The delete-a-group jackknife interval of ``estimate`` (see the module docstring).

    Args:
        estimate: ``θ`` from every window: a float or an array ``[...]``.
        replicates: ``θ₍g₎``, ``[G', ...]``: one per non-empty group.
        level: confidence level in ``(0, 1)``.
        upper: the statistic's upper bound ``b`` (1 for an R²): ends above it are clipped to it;
            ``None`` for the plain interval.
        lower: the statistic's lower bound (0 for a weight or a share, with ``upper=1``): ends below it
            are clipped to it (the method is then :data:`CLIPPED_RANGE`).

    Returns:
        An :class:`Interval` (arrays where ``estimate`` is one; NaN where an element's estimate or
        replicates are).

    Raises:
        IntervalUnavailableError: fewer than two replicates (the interval is undefined).
    """
    level = check_level(level)
    replicates = np.asarray(replicates, dtype=np.float64)
    count = replicates.shape[0] if replicates.ndim else 0
    if count < 2:
        raise IntervalUnavailableError(
            f"the windows fall into {count} non-empty interval group{'s' if count != 1 else ''}; a jackknife interval "
            "needs windows in at least 2 groups: run more windows"
        )
    from scipy.stats import t

    spread = replicates - replicates.mean(0)
    standard_error = np.sqrt((count - 1) / count * np.sum(spread * spread, axis=0))
    estimate_array = np.asarray(estimate, dtype=np.float64)
    quantile = float(t.ppf((1.0 + level) / 2.0, count - 1))
    low, high = estimate_array - quantile * standard_error, estimate_array + quantile * standard_error
    method = PLAIN
    if upper is not None and bool(np.any(high > upper)):
        low, high = np.minimum(low, upper), np.minimum(high, upper)
        method = CLIPPED if lower is None else CLIPPED_RANGE
    if lower is not None and bool(np.any(low < lower)):
        low, high = np.maximum(low, lower), np.maximum(high, lower)
        method = CLIPPED_RANGE
    if estimate_array.ndim == 0:
        return Interval(float(estimate_array), float(low), float(high), level, count, float(standard_error), method)
    return Interval(estimate_array, low, high, level, count, standard_error, method)


def windows_for_half_width(n_windows: int, half_width: float, target: float) -> float:
    """Windows a ``±target`` interval would need, from ``±half_width`` measured on ``n_windows``.

    The standard error falls as ``1/√n``: ``n_needed = n·(half_width/target)²``.
    """
    if not target > 0:
        raise InputError(f"target={target!r} must be a positive half-width, e.g. 0.005")
    return float(n_windows) * (float(half_width) / float(target)) ** 2
