"""A probe result's intervals over windows and its paired differences with another result.

Place in the seams: one part of :class:`~equivariance_probe.result.ProbeResult` (the class mixes it in): the
delete-a-group jackknife over windows (:mod:`~equivariance_probe.analyses.intervals` recomputes every number on
every window but one group's) turned into :class:`~equivariance_probe.maths.intervals.Interval` values, for one
result (:meth:`ProbeIntervals.interval`) and for the difference of two measured on the same windows
(:meth:`ProbeIntervals.paired_difference`; :func:`paired_difference` is the same as a function).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..analyses import intervals as resampling
from ..analyses.results import TOTAL, split_axis
from ..errors import IntervalUnavailableError
from ..maths import fitting, metrics
from ..maths.intervals import Interval, check_level, jackknife_interval, windows_for_half_width

__all__ = ["ProbeIntervals", "paired_difference", "paired_differences", "DIFFERENCE_STATISTICS", "SUMMARY_LEVEL",
           "TARGET_HALF_WIDTH"]

#: Confidence level of the intervals :meth:`ProbeResult.summary` stores.
SUMMARY_LEVEL = 0.95
#: The ``±`` the study's summary says how many windows would reach, on the log fitted R².
TARGET_HALF_WIDTH = 0.005


class ProbeIntervals:
    """The intervals over windows of :class:`~equivariance_probe.result.ProbeResult` (mixed into it)."""

    # -- intervals over windows ------------------------------------------------------------------
    def interval(self, statistic: str, by: str | None = None, level: float = 0.95) -> Any:
        """A number's confidence interval over windows, by the delete-a-group jackknife.

        The sampling unit is the window: each window is in one of ``G`` groups (by its fingerprint,
        or by the keys the run was given), the number is recomputed on every window but one group's,
        and over the ``G'`` non-empty groups ``se² = (G'-1)/G' · Σ_g (θ₍g₎ - θ̄)²``. Every such number is
        an R² (at most 1): the interval ``θ ± t_{G'-1} · se`` is clipped at 1, and ``Interval.method``
        says where it was (:func:`~equivariance_probe.maths.intervals.jackknife_interval`).

        Args:
            statistic: one of :data:`~equivariance_probe.analyses.intervals.INTERVAL_STATISTICS`:
                ``"log_fitted"`` (any ``{scale}_{form}``), ``"prior_fit"`` (``power_fit``,
                ``exponential_fit``) or ``"toeplitz_per_doc"``.
            by: how the number is split, as in its own method (``None``, ``"layer"``, ``"head"``,
                ``"layer_group"``; ``"head"`` or ``None`` for ``toeplitz_per_doc``).
            level: the confidence level.

        Returns:
            An :class:`Interval` (arrays inside for ``"layer"``/``"head"``), or ``{group: Interval}``
            for ``by="layer_group"``.

        Raises:
            IntervalUnavailableError: fewer than two non-empty groups, no per-group sums (a run with
                ``interval_groups=0``, a file written before interval groups, a remote run's batches),
                or a number without per-group state (the mean pattern's Toeplitz R²).

        Example:
            >>> result.interval("log_fitted")  # doctest: +SKIP
            Interval(0.0157 [0.0143, 0.0171], 95% over 14 groups of windows)
        """
        level = check_level(level)
        by = None if by == TOTAL else by
        resampling.check_statistic(statistic, by)  # a name without intervals is named before missing groups
        estimate, replicates = self.replicates().of(statistic, by)
        # Every statistic with an interval is an R², at most 1: an interval past 1 is clipped there.
        if isinstance(estimate, dict):
            return {group: jackknife_interval(estimate[group], replicates[group], level=level, upper=1.0)
                    for group in estimate}
        return jackknife_interval(estimate, replicates, level=level, upper=1.0)

    def windows_needed(self, half_width: float = TARGET_HALF_WIDTH, statistic: str = "log_fitted",
                       level: float = 0.95) -> float:
        """Windows a ``±half_width`` interval of ``statistic`` would need: ``n·(h/half_width)²`` from the
        ``±h`` this result reaches with its ``n`` windows (the standard error falls as ``1/√n``)."""
        found = self.interval(statistic, level=level)
        return windows_for_half_width(self.n_windows, found.half_width, half_width)

    def head_score_replicates(self, name: str) -> np.ndarray:
        """A ranking score of every head in every replicate: ``[G', layer, head]`` (for ranking stability).

        Raises:
            IntervalUnavailableError: no replicates, or a score without per-group state
                (``toeplitz``, ``prior_fit``).
        """
        resampling.check_statistic(name, "head")
        return self.replicates().of(name, "head")[1]

    def interval_groups(self) -> dict[str, Any]:
        """The groups of windows behind the intervals: ``{"interval_groups": G, "occupied": G', "keys": ...}``
        (``keys``: ``window_fingerprint``, ``explicit``, ``ordinal`` or ``mixed``), or ``{"unavailable": why}``."""
        try:
            groups = self.replicates().groups
        except IntervalUnavailableError as error:
            return {"unavailable": str(error)}
        return {"interval_groups": groups.n_groups, "occupied": len(groups.ids), "keys": groups.keys}

    def replicates(self) -> resampling.Replicates:
        """The delete-a-group jackknife's replicates of this result's numbers
        (:class:`~equivariance_probe.analyses.intervals.Replicates`), kept until windows are added.

        Raises:
            IntervalUnavailableError: fewer than two non-empty groups, or no per-group sums (says why).
        """
        self._require_data()
        state = (id(self.statistics), self.statistics.n_windows, self.statistics.n_tokens)
        if self._replicates is None or self._replicates[0] != state:
            self._replicates = (state, resampling.Replicates(self.statistics, self._estimate,
                                                             layer_groups=self.layer_groups(), dt=self._lags()))
        return self._replicates[1]

    def _estimate(self, statistic: str, by: str | None, cache: dict[Any, Any]) -> Any:
        """The number ``statistic`` names, from every window (what its own method returns); the
        persistence curves are fitted once per ``by`` and kept in ``cache`` for the other fits."""
        if statistic == "toeplitz_per_doc":
            return self.toeplitz_r2(by, estimator="per_doc")
        if statistic.endswith("_fit"):
            fit = statistic[: -len("_fit")]
            if ("estimate_curves", by) not in cache:
                cache[("estimate_curves", by)] = self.persistence(by)
            curves = cache[("estimate_curves", by)]
            if by == "layer_group":
                return {group: group_curves.fits[fit].r2 for group, group_curves in curves.items()}
            return curves.r2(fit)
        scale, form = statistic.split("_")
        return self.query_position_r2(scale, form, by)

    def paired_difference(self, baseline: Any, statistic: str = "log_fitted", by: str | None = None,
                          level: float = 0.95) -> Any:
        """``θ_a - θ_b`` with its interval over windows, from paired jackknife replicates.

        Both results must hold the same groups of windows: the same windows grouped by fingerprint
        (a model and its baselines on one corpus), or windows grouped by explicit ``resampling_keys``
        naming the same text regions (a context-length scan over one token stream). The difference is
        recomputed on every window but one group's, in both results at once, so what the two share
        (the same hard documents) cancels: ``se² = (G'-1)/G' · Σ_g (d₍g₎ - d̄)²`` with
        ``d₍g₎ = θ_a₍g₎ - θ_b₍g₎``.

        Args:
            baseline: the result subtracted (``θ_b``), measured on the same windows as this one (``θ_a``).
            statistic: one of :data:`~equivariance_probe.analyses.intervals.INTERVAL_STATISTICS`.
            by: as in :meth:`ProbeResult.interval`.
            level: the confidence level.

        Returns:
            An :class:`Interval` of the difference (``{group: Interval}`` for ``by="layer_group"``).

        Raises:
            IncompatibleResultsError: the results do not hold the same groups of windows (named).
            IntervalUnavailableError: either result has no intervals (says why).

        Example:
            >>> study.trained.paired_difference(study.results["random_init"], "log_fitted")  # doctest: +SKIP
            Interval(-0.1935 [-0.2060, -0.1810], 95% over 14 groups of windows)
        """
        level = check_level(level)
        by = split_axis(by, (None, "layer", "head", "layer_group"))
        mine, theirs = self.replicates(), baseline.replicates()
        mine.paired(theirs)
        (estimate_a, replicates_a), (estimate_b, replicates_b) = mine.of(statistic, by), theirs.of(statistic, by)
        if isinstance(estimate_a, dict):
            return {group: jackknife_interval(estimate_a[group] - estimate_b[group],
                                              replicates_a[group] - replicates_b[group], level=level)
                    for group in estimate_a}
        return jackknife_interval(np.subtract(estimate_a, estimate_b), np.subtract(replicates_a, replicates_b),
                                  level=level)


#: The numbers a study reports the trained-minus-baseline difference of, in its table's order.
DIFFERENCE_STATISTICS = (
    *(f"{scale}_{form}" for scale in metrics.SCALES for form in metrics.FORMS),
    *(f"{fit}_fit" for fit in fitting.FIT_NAMES),
    "toeplitz_per_doc",
)


def paired_difference(a: Any, b: Any, statistic: str = "log_fitted", by: str | None = None,
                      level: float = 0.95) -> Any:
    """``a.paired_difference(b, statistic, by, level)``: ``θ_a - θ_b`` with its interval over windows
    (:meth:`ProbeIntervals.paired_difference`, which says what both results must share).

    Example:
        >>> paired_difference(study.trained, study.results["random_init"], "log_fitted")  # doctest: +SKIP
        Interval(-0.1935 [-0.2060, -0.1810], 95% over 14 groups of windows)
    """
    return a.paired_difference(b, statistic, by, level)


def paired_differences(a: Any, b: Any, level: float = SUMMARY_LEVEL) -> dict[str, Interval]:
    """``a - b`` of every number of :data:`DIFFERENCE_STATISTICS`, each with its interval (:func:`paired_difference`)."""
    return {statistic: paired_difference(a, b, statistic, level=level) for statistic in DIFFERENCE_STATISTICS}
