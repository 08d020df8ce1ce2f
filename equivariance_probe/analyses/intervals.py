"""The jackknife replicates of a result's numbers: which statistics have intervals, and how each
is recomputed on "every window but group ``g``".

Place in the seams: *analyses*, pure functions from the replicates' sums
(:meth:`~equivariance_probe.statistics.groups.WindowGroups.replicates`: ``[R, ...]`` arrays, one
row per non-empty group) to each statistic's replicate values ``θ₍g₎``, and :class:`Replicates`,
which pairs them with a result's estimates (``ProbeResult.replicates()``);
:func:`~equivariance_probe.maths.intervals.jackknife_interval` turns both into intervals, and
``paired_difference`` subtracts two results' replicates group by group.

Statistics with intervals (:data:`INTERVAL_STATISTICS`; names as the head ranking's scores):

* ``{scale}_{form}`` — query-position R², ``by`` ``None``, ``"layer"``, ``"head"``, ``"layer_group"``;
* ``{fit}_fit`` — R² of the power, exponential or uniform-prior fit to ``P(dt)``, ``by`` ``None``,
  ``"layer"``, ``"layer_group"`` (the groups keep lag sums per layer, not per head or key position);
* ``toeplitz_per_doc`` — the per-window Toeplitz R², ``by="head"`` (the mean over windows) or
  ``None`` (also averaged over heads).

The Toeplitz R² of the document-averaged pattern has none: its per-group state would be the
summed pattern per group, ``G·L·H·T²`` numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import IncompatibleResultsError, InputError, IntervalUnavailableError
from ..maths.fitting import FIT_NAMES
from ..maths.metrics import FORMS, SCALES, query_position_r2_from_totals
from ..maths.persistence import lag_curves

__all__ = [
    "INTERVAL_STATISTICS",
    "BY_CHOICES",
    "check_statistic",
    "Replicates",
    "occupied_groups",
    "replicate_values",
    "toeplitz_per_doc",
    "check_paired",
    "top_k_share",
    "NO_MEAN_PATTERN_INTERVAL",
]

#: Every statistic with an interval, and what it is.
INTERVAL_STATISTICS: dict[str, str] = {
    **{f"{scale}_{form}": f"query-position R² ({scale} scale, {form})" for scale in SCALES for form in FORMS},
    **{f"{fit}_fit": f"R² of the {fit} fit to the persistence curve P(dt)" for fit in FIT_NAMES},
    "toeplitz_per_doc": "per-window Toeplitz R² (mean over windows; by=None also over heads)",
}

#: The ``by`` each statistic takes with an interval.
BY_CHOICES: dict[str, tuple[str | None, ...]] = {
    **{f"{scale}_{form}": (None, "layer", "head", "layer_group") for scale in SCALES for form in FORMS},
    **{f"{fit}_fit": (None, "layer", "layer_group") for fit in FIT_NAMES},
    "toeplitz_per_doc": (None, "head"),
}

#: Why the document-averaged pattern's Toeplitz R² has no interval.
NO_MEAN_PATTERN_INTERVAL = (
    "the Toeplitz R² of the document-averaged pattern has no interval: its replicates would need the summed "
    "pattern of every group (G·L·H·T² sums), which no run keeps; the per-window Toeplitz R² has one "
    "(toeplitz_r2(estimator='per_doc', interval=0.95))"
)


def check_statistic(statistic: str, by: str | None) -> None:
    """Raise unless ``statistic`` has intervals ``by`` that split.

    Raises:
        IntervalUnavailableError: a known number without per-group state (the mean pattern's
            Toeplitz R², a fit's R² per head or per key position).
        InputError: an unknown name or ``by``.
    """
    if statistic == "toeplitz":
        raise IntervalUnavailableError(NO_MEAN_PATTERN_INTERVAL)
    if statistic not in INTERVAL_STATISTICS:
        raise InputError(f"statistic={statistic!r} has no interval; choose one of {list(INTERVAL_STATISTICS)}")
    if by not in BY_CHOICES[statistic]:
        if statistic.endswith("_fit") and by in ("head", "key_position"):
            raise IntervalUnavailableError(
                f"the R² of a fit to P(dt) by={by!r} has no interval: the interval groups keep lag sums per layer, "
                "not per head or key position; use by=None, 'layer' or 'layer_group'"
            )
        raise InputError(f"by={by!r} is not one of {list(BY_CHOICES[statistic])} for the interval of {statistic!r}")


def toeplitz_per_doc(total: np.ndarray, count: np.ndarray, by: str | None) -> Any:
    """Mean per-window Toeplitz R² per head (``by="head"``, ``[..., L, H]``), or that mean over heads
    (``by=None``, ``[...]``, NaN heads left out): ``doc_toeplitz_sum / doc_toeplitz_count``."""
    with np.errstate(invalid="ignore", divide="ignore"):
        per_head = np.where(count > 0, total / np.where(count > 0, count, 1), np.nan)
    if by == "head":
        return per_head
    flat = per_head.reshape(*per_head.shape[:-2], -1)
    finite = np.isfinite(flat)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite, flat, 0.0).sum(-1) / finite.sum(-1)


def replicate_values(
    replicates: dict[str, np.ndarray],
    statistic: str,
    by: str | None,
    *,
    n_heads: int,
    visible_keys: np.ndarray,
    layer_groups: dict[str, tuple[int, ...]],
    cache: dict[Any, Any] | None = None,
    dt: np.ndarray | None = None,
) -> np.ndarray | dict[str, np.ndarray]:
    """``θ₍g₎`` of ``statistic`` for every replicate: ``[R, ...]``, or ``{group: [R]}`` for ``by="layer_group"``.

    Args:
        replicates: the replicates' sums (:meth:`~equivariance_probe.statistics.groups.WindowGroups.replicates`).
        statistic: a name of :data:`INTERVAL_STATISTICS`.
        by: as the statistic's own call splits it (:data:`BY_CHOICES`).
        n_heads: ``H``.
        visible_keys: ``[L, T]`` ``|V(q)|`` of each layer.
        layer_groups: ``{group: layers}`` of the result.
        cache: where the replicates' persistence curves are kept between calls (each fit's R²
            reads the same curves).
        dt: the lag of each column of the lag sums (signed for encoders; default ``0 .. N-1``).
    """
    check_statistic(statistic, by)
    if statistic == "toeplitz_per_doc":
        return toeplitz_per_doc(replicates["doc_toeplitz_sum"], replicates["doc_toeplitz_count"], by)
    if statistic.endswith("_fit"):
        fit = statistic[: -len("_fit")]
        cache = {} if cache is None else cache
        if ("curves", by) not in cache:
            cache[("curves", by)] = [
                lag_curves({name: replicates[name][row] for name in ("lag_sum", "lag_count", "lag_prior_sum")},
                           n_heads, by, layer_groups, dt=dt)
                for row in range(len(replicates["group"]))
            ]
        curves = cache[("curves", by)]
        if by == "layer_group":
            return {group: np.array([c[group].fits[fit].r2 for c in curves]) for group in layer_groups}
        return np.stack([np.asarray(c.r2(fit), dtype=np.float64) for c in curves])
    scale, form = statistic.split("_")

    def values(layers: list[int] | slice, split: str | None) -> np.ndarray:
        return query_position_r2_from_totals(
            replicates["query_count"][:, layers], replicates[f"{scale}_sum"][:, layers], replicates[f"{scale}_sq"][:, layers],
            visible_keys[layers], scale=scale, by=split,
        )[form]

    if by == "layer_group":
        return {group: values(list(layers), None) for group, layers in layer_groups.items()}
    return values(slice(None), by)


def check_paired(a: Any, b: Any) -> None:
    """Refuse to pair the replicates of two statistics' groups unless they are the same groups of windows.

    ``a`` and ``b`` are :class:`~equivariance_probe.statistics.AttentionStatistics`. Groups chosen by
    window fingerprint pair when both hold exactly the same windows (a model and its baselines on one
    corpus); groups chosen by explicit keys pair when the same groups are occupied (the keys name the
    same text regions: the caller's promise, e.g. a context-length scan over one token stream).

    Raises:
        IncompatibleResultsError: other groupings, other windows or other occupied groups (named).
    """
    mine, theirs = a.groups, b.groups
    if mine.n_groups != theirs.n_groups:
        raise IncompatibleResultsError(
            f"the results have {mine.n_groups} and {theirs.n_groups} interval groups; a paired difference needs the "
            "same groups: run both with the same interval_groups"
        )
    if mine.keys != theirs.keys or mine.keys not in ("window_fingerprint", "explicit"):
        raise IncompatibleResultsError(
            f"the results' windows were grouped by {mine.keys!r} and {theirs.keys!r} keys; a paired difference needs "
            "both grouped by window fingerprint (the same windows) or both by explicit resampling_keys"
        )
    if mine.keys == "window_fingerprint" and not np.array_equal(a.window_fingerprints, b.window_fingerprints):
        shared = int(np.isin(a.window_fingerprints, b.window_fingerprints).sum())
        raise IncompatibleResultsError(
            f"the results hold different windows ({len(a.window_fingerprints)} and {len(b.window_fingerprints)}, "
            f"{shared} shared); a paired difference needs the same windows in both (run both on the same documents and "
            "context length, or give both runs resampling_keys that name the same text regions)"
        )
    if not np.array_equal(mine.ids, theirs.ids):
        raise IncompatibleResultsError(
            f"the results occupy different interval groups ({len(mine.ids)} and {len(theirs.ids)}, "
            f"{len(np.intersect1d(mine.ids, theirs.ids))} shared): their resampling keys do not name the same text regions"
        )


def top_k_share(replicate_scores: np.ndarray, k: int, order: Any) -> np.ndarray:
    """How often each head is among the ``k`` first in the replicates' rankings: ``[L, H]`` in ``[0, 1]``.

    Args:
        replicate_scores: ``[R, L, H]`` the ranking key's score in every replicate.
        k: how many heads count as the top.
        order: ``order(scores [L, H]) -> flat head indices``, most position-bound first (the
            ranking's own rule, NaN last).
    """
    count = np.zeros(replicate_scores.shape[1:]).ravel()
    for scores in replicate_scores:
        count[np.asarray(order(scores))[:k]] += 1
    return (count / len(replicate_scores)).reshape(replicate_scores.shape[1:])


def occupied_groups(statistics: Any) -> Any:
    """The interval groups of ``statistics`` (:class:`~equivariance_probe.statistics.AttentionStatistics`
    holding windows), or the error that says why there are no intervals.

    Raises:
        IntervalUnavailableError: no per-group sums (a run with ``interval_groups=0``, a file saved
            before interval groups, a remote run's batches), or fewer than two occupied groups.
    """
    groups = statistics.groups
    if groups is None:
        raise IntervalUnavailableError(
            "this result keeps no per-group sums of its windows (run with interval_groups=0, or saved before "
            "interval groups existed); run it again with interval_groups=20 (the default) for intervals"
        )
    if groups.unavailable is not None:
        raise IntervalUnavailableError(f"this result has no interval groups: {groups.unavailable}")
    if len(groups.ids) < 2:
        n_windows = statistics.n_windows
        raise IntervalUnavailableError(
            f"the result's {n_windows} window{'s' if n_windows != 1 else ''} fall into {len(groups.ids)} "
            "non-empty interval group; a jackknife interval needs windows in at least 2 groups: run more windows"
        )
    return groups


class Replicates:
    """The delete-a-group jackknife's replicates of one result's numbers, with the estimates they go with.

    For a statistic of :data:`INTERVAL_STATISTICS`, :meth:`of` gives ``(θ, θ₍g₎)``: the number from every
    window (what the result's own method returns) and the number recomputed on every window but group
    ``g``'s, ``[G', ...]`` (dicts of both for ``by="layer_group"``). The replicates' sums are formed once
    and each statistic's values are kept, so the many intervals of a summary cost one pass.

    Args:
        statistics: the result's :class:`~equivariance_probe.statistics.AttentionStatistics`, with at
            least two occupied interval groups (:func:`occupied_groups`).
        estimate: ``estimate(statistic, by, cache) -> θ``, the result's own number (``cache`` is shared
            with the replicates, so the persistence curves are fitted once per ``by``).
        layer_groups: ``{group: layers}`` of the result.
        dt: ``[N]`` the lag of each column of the lag sums.

    Example:
        >>> estimate, replicates = result.replicates().of("log_fitted", None)  # doctest: +SKIP
        >>> replicates.shape  # one value per occupied group
        (14,)
    """

    def __init__(self, statistics: Any, estimate: Callable[[str, str | None, dict[Any, Any]], Any], *,
                 layer_groups: dict[str, tuple[int, ...]], dt: np.ndarray) -> None:
        self.statistics = statistics
        self.groups = occupied_groups(statistics)
        self._estimate = estimate
        self._layer_groups = layer_groups
        self._dt = dt
        self._cache: dict[Any, Any] = {}

    @property
    def n_groups(self) -> int:
        """``G'``, the occupied groups (one replicate each)."""
        return len(self.groups.ids)

    def sums(self) -> dict[str, np.ndarray]:
        """The replicates' sums (:meth:`~equivariance_probe.statistics.groups.WindowGroups.replicates`), formed once."""
        if "sums" not in self._cache:
            statistics = self.statistics
            self._cache["sums"] = self.groups.replicates(sliding_windows=statistics.sliding_windows,
                                                         excluded_keys=statistics.excluded_keys, causal=statistics.causal)
        return self._cache["sums"]

    def of(self, statistic: str, by: str | None = None) -> tuple[Any, Any]:
        """``(θ, θ₍g₎)`` of ``statistic`` split ``by`` (:data:`BY_CHOICES`).

        Raises:
            IntervalUnavailableError, InputError: as :func:`check_statistic`.
        """
        check_statistic(statistic, by)
        if (statistic, by) not in self._cache:
            values = replicate_values(
                self.sums(), statistic, by, n_heads=self.statistics.n_heads,
                visible_keys=self.statistics.visible_keys().numpy(), layer_groups=self._layer_groups,
                cache=self._cache, dt=self._dt,
            )
            self._cache[(statistic, by)] = (self._estimate(statistic, by, self._cache), values)
        return self._cache[(statistic, by)]

    def paired(self, other: Replicates) -> None:
        """Refuse unless ``other`` holds the same groups of windows (:func:`check_paired`)."""
        check_paired(self.statistics, other.statistics)
