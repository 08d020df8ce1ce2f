"""The result of a probe run: statistics plus how they were measured.

Place in the seams: above the statistics, the maths and the records. A :class:`ProbeResult`
holds the float64 sums of :class:`~equivariance_probe.statistics.AttentionStatistics` and the
metadata of the run (model, adapter, context length, log floor, excluded keys, library
versions). Every number is computed on demand from the sums by
:mod:`~equivariance_probe.maths`, so results merge exactly (``a + b``), and save and load
without the model (:mod:`~equivariance_probe.records.result_file` holds the file format).

A loaded result is lazy: :meth:`ProbeResult.load` reads the file's header (metadata and the
headline numbers of :meth:`ProbeResult.summary`), and the sums load, each array checked against
the digest stored when it was written, the first time a number needs them (every merge, and
:meth:`ProbeResult.verify`).

Intervals over windows: the statistics keep per-group sums of the windows
(:mod:`~equivariance_probe.statistics.groups`), every number with an interval
(:data:`~equivariance_probe.analyses.intervals.INTERVAL_STATISTICS`) is recomputed on every
window but one group's (:mod:`~equivariance_probe.analyses.intervals`), and the delete-a-group
jackknife turns the replicates into an :class:`~equivariance_probe.maths.intervals.Interval`
(``interval=0.95`` on the methods, :meth:`ProbeResult.interval`, :func:`paired_difference`).
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from .analyses import intervals as resampling
from .analyses.heads import TOP_K, HeadRanking, rank_heads
from .analyses.summary import head_label, result_summary
from .errors import IncompatibleResultsError, InputError, IntervalUnavailableError, NotRunError, UndefinedStatisticError, check_choice, check_integer
from .markup import Markup
from .maths import fitting, metrics, sinks
from .maths.intervals import Interval, check_level, is_undefined, jackknife_interval, windows_for_half_width
from .maths.persistence import PersistenceCurves, lag_curves, persistence_curves
from .records.result_file import FORMAT_VERSION, ResultFile, open_result_file, write_result_file
from .records.sharding import merged_provenance
from .sources.packing import merged_first_token, merged_windows_record
from .sources.registry import display_name
from .statistics import AttentionStatistics
from .statistics.masks import key_bin_edges, lag_values, layer_groups

__all__ = [
    "ProbeResult",
    "PersistenceCurves",
    "Interval",
    "FORMAT_VERSION",
    "paired_difference",
    "paired_differences",
    "DIFFERENCE_STATISTICS",
]

#: Key-position bins of the Figure 1c numbers in :meth:`ProbeResult.summary`.
SUMMARY_KEY_BINS = 16
#: Confidence level of the intervals :meth:`ProbeResult.summary` stores.
SUMMARY_LEVEL = 0.95
#: The ``±`` the study's summary says how many windows would reach, on the log fitted R².
TARGET_HALF_WIDTH = 0.005

#: Why the prior and fitted query-position R² have no value for a bidirectional encoder.
BIDIRECTIONAL_PRIOR = (
    "undefined for a bidirectional encoder: every query of a window sees the same keys, so the uniform prior "
    "1/|V(q)| is the same for every query position and there is no query-position variance for it to explain "
    "(form='eta2', the query position as a categorical factor, is defined)"
)


class ProbeResult:
    """Attention statistics of a model over a corpus, and every metric computed from them.

    Build one with :meth:`EquivarianceProbe.run`; combine with ``a + b`` (or
    :meth:`merge`); save with :meth:`save` and load with :meth:`load`.

    Args:
        statistics: the sums (``None`` with ``file``).
        metadata: how they were measured (model, context, versions, study, ...).
        file: an opened result file (:func:`~equivariance_probe.records.result_file.open_result_file`)
            whose sums load the first time a number needs them, instead of ``statistics``.

    Example:
        >>> result.query_position_r2(scale="log", form="fitted")  # doctest: +SKIP
        0.41
    """

    def __init__(self, statistics: AttentionStatistics | None = None, metadata: dict[str, Any] | None = None, *,
                 file: ResultFile | None = None) -> None:
        if (statistics is None) == (file is None):
            raise InputError("a ProbeResult holds either statistics or an opened result file (file=...), one of the two")
        self._statistics: AttentionStatistics | None = statistics
        self.metadata: dict[str, Any] = {} if metadata is None else metadata
        # A loaded result: the opened file (arrays not read yet) and the summary its header holds.
        self._file: ResultFile | None = file
        self._stored_summary: dict[str, Any] | None = None if file is None else file.summary
        # The last computed summary and the state it describes (statistics object, windows, tokens):
        # a run adds windows to its statistics in place, so a summary of fewer windows is stale.
        self._computed_summary: tuple[tuple[int, int, int], dict[str, Any]] | None = None
        # The jackknife's replicates and the state they describe.
        self._replicates: tuple[tuple[int, int, int], resampling.Replicates] | None = None

    @property
    def statistics(self) -> AttentionStatistics:
        """The sums (a loaded result reads them from its file now, once, checksum verified)."""
        if self._statistics is None:
            assert self._file is not None
            self._statistics = self._file.statistics()
        return self._statistics

    @statistics.setter
    def statistics(self, statistics: AttentionStatistics) -> None:
        self._statistics = statistics
        self._file = None
        self._stored_summary = None  # the stored numbers were those of the file's sums

    def _config(self) -> dict[str, Any]:
        """The statistics' configuration, from the file's header while the sums are not loaded."""
        if self._statistics is None and self._file is not None:
            return self._file.config
        return self.statistics.config()

    # -- basic facts --------------------------------------------------------------------
    @property
    def n_windows(self) -> int:
        return self._file.n_windows if self._statistics is None and self._file else self.statistics.n_windows

    @property
    def n_tokens(self) -> int:
        return self._file.n_tokens if self._statistics is None and self._file else self.statistics.n_tokens

    @property
    def n_layers(self) -> int:
        return int(self._config()["n_layers"])

    @property
    def n_heads(self) -> int:
        return int(self._config()["n_heads"])

    @property
    def log_floor(self) -> float | None:
        """``eps`` of the log scale: ``y = log max(a, eps)``."""
        return self._config()["log_floor"]

    @property
    def excluded_keys(self) -> tuple[int, ...]:
        return tuple(self._config()["excluded_keys"])

    @property
    def model_name(self) -> str:
        """The model as the user named it, for display: the study's ``model`` argument (a packaged
        name such as ``gemma-3-270m``, or the path as given), else the packaged name of a converted
        copy, else the name the model carries. ``metadata["model"]["name"]`` keeps where the
        weights were loaded from (for a packaged model, its converted copy in the cache)."""
        return display_name(self.metadata)

    @property
    def context_length(self) -> int:
        """``T``, the window length the statistics are laid out for (the file's ``statistics.config.n_positions``;
        a window that was shorter fills only its first positions)."""
        return int(self._config()["n_positions"])

    @property
    def causal(self) -> bool:
        """``False`` for a bidirectional encoder's statistics (signed lags, no query-position prior)."""
        return bool(self._config().get("causal", True))

    def undefined(self) -> dict[str, str]:
        """Statistics this result has no value for, each with the reason (``{"query_position_r2.prior": why}``)."""
        if self.causal:
            return {}
        return {f"query_position_r2.{form}": BIDIRECTIONAL_PRIOR for form in ("prior", "fitted")}

    @property
    def complete(self) -> bool:
        """False for the partial result of a run that stopped (``metadata["complete"]``)."""
        return bool(self.metadata.get("complete", True))

    @property
    def integrity(self) -> str | None:
        """How a loaded result's arrays are checked when read (``None`` for a result not loaded from a file):
        ``"digests"`` (each array against its own sha256, stored when the file was written),
        ``"checksum"`` (a file written before per-array digests: one checksum over all arrays, so a
        mismatch names no array) or ``"unverified"`` (format 1: nothing to check against)."""
        return None if self._file is None else self._file.integrity

    def verify(self) -> str | None:
        """Read a loaded result's arrays now and check them (see :attr:`integrity`, which it returns).

        Raises:
            ResultFileError: an array does not match its digest (the message names the file and the array).
        """
        self.statistics
        return self.integrity

    def _require_data(self) -> dict[str, np.ndarray]:
        if self.statistics.n_windows == 0:
            raise NotRunError(
                "this result holds no windows yet: call EquivarianceProbe(model).run(docs) first "
                "(or merge in a result that has data)"
            )
        return self.statistics.numpy()

    # -- query-position R² ------------------------------------------------------------------
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """Layers by the kind of mask the model declares: ``{"all": ...}``, plus ``"sliding"`` and
        ``"global"`` for a model with both kinds (Gemma 2 and 3: sliding-window and global layers).

        The kinds are the model's (``metadata["layout"]["windows"]``), whatever the context length:
        at ``T <= w`` a sliding layer sees what a global one sees, but stays in its group
        (:func:`~equivariance_probe.statistics.masks.layer_groups`).
        """
        declared = self.metadata.get("layout", {}).get("windows")
        if declared is None or len(declared) != self.n_layers:
            declared = self.statistics.sliding_windows
        return layer_groups(declared)

    def query_position_r2(self, scale: str = "log", form: str = "fitted", by: str | None = None,
                          interval: float | None = None) -> Any:
        """How much of the variance of attention the query position alone explains.

        Args:
            scale: ``"log"`` (``y = log max(a, eps)``, ``x = log u(q)``) or ``"raw"`` (``y = a``,
                ``x = u(q)``), with ``u(q) = 1/|V(q)|``.
            form: ``"prior"`` (``1 - Σ(y-x)²/Σ(y-ȳ)²``, no free parameter), ``"fitted"``
                (R² of ``y ≈ α + βx``) or ``"eta2"`` (``1 - Σ(y-ȳ_g)²/Σ(y-ȳ)²``, groups = query
                position and visible key set).
            by: ``None`` for one number over all entries, ``"layer"`` for ``[layer]``,
                ``"head"`` for ``[layer, head]``, ``"layer_group"`` for ``{group: R²}`` over the
                entries of each group of :meth:`layer_groups` (``"all"`` equals ``by=None``).
            interval: a confidence level (``0.95``) to get an :class:`Interval` over windows instead
                of the number (arrays inside for ``"layer"`` and ``"head"``, a dict of them for
                ``"layer_group"``); see :meth:`interval`.
        """
        check_choice("scale", scale, metrics.SCALES)
        check_choice("form", form, metrics.FORMS)
        check_choice("by", by, (None, "total", "layer", "head", "layer_group"))
        if f"query_position_r2.{form}" in self.undefined():
            raise UndefinedStatisticError(f"the {form} query-position R² is {self.undefined()[f'query_position_r2.{form}']}")
        if interval is not None:
            return self.interval(f"{scale}_{form}", None if by == "total" else by, level=interval)
        arrays = self._require_data()
        prefix = "log" if scale == "log" else "raw"
        visible = self.statistics.visible_keys().numpy()
        if by == "layer_group":
            return {
                group: float(metrics.query_position_r2(
                    arrays["query_count"][list(layers)],
                    arrays[f"{prefix}_sum"][list(layers)],
                    arrays[f"{prefix}_sq"][list(layers)],
                    visible[list(layers)],
                    scale=scale,
                )[form])
                for group, layers in self.layer_groups().items()
            }
        values = metrics.query_position_r2(
            arrays["query_count"],
            arrays[f"{prefix}_sum"],
            arrays[f"{prefix}_sq"],
            visible,
            scale=scale,
            by=None if by == "total" else by,
        )
        value = values[form]
        return float(value) if np.ndim(value) == 0 else value

    def query_position_table(self) -> dict[str, dict[str, float | None]]:
        """Every form on every scale over all entries: ``{scale: {form: R²}}`` (``None`` for a form
        :meth:`undefined` names)."""
        undefined = self.undefined()
        return {s: {f: None if f"query_position_r2.{f}" in undefined else self.query_position_r2(scale=s, form=f)
                    for f in metrics.FORMS} for s in metrics.SCALES}

    def floored(self, by: str | None = None) -> Any:
        """Visible entries below ``eps`` (floored on the log scale): total, ``[layer]`` or ``[layer, head]``."""
        check_choice("by", by, (None, "layer", "head"))
        floored = self._require_data()["floored"]
        if by == "head":
            return floored.astype(np.int64)
        if by == "layer":
            return floored.sum(1).astype(np.int64)
        return int(floored.sum())

    def n_entries(self) -> int:
        """Visible entries ``(window, layer, head, q, k)`` behind the query-position R²."""
        return int(self._require_data()["query_count"].sum() * self.n_heads)

    # -- persistence -------------------------------------------------------------------------
    def persistence(self, by: str | None = None, bins: int = 16, interval: float | None = None) -> Any:
        """Mean attention by distance ``P(dt)`` with power, exponential and uniform-prior fits.

        Args:
            by: ``None`` (over all layers and heads), ``"layer"``, ``"head"``,
                ``"key_position"`` (the study's Figure 1c: ``P_t(dt)`` for key positions ``t``
                grouped into ``bins`` equal-width bins), or ``"layer_group"``: a dict
                ``{group: PersistenceCurves}`` over the layers of each group of :meth:`layer_groups`.
            bins: number of key-position bins for ``by="key_position"``.
            interval: a confidence level (``0.95``) to attach each fit's R² interval over windows
                (``curves.r2_interval("prior")``; ``by`` ``None``, ``"layer"`` or ``"layer_group"``).

        Returns:
            :class:`PersistenceCurves` (a dict of them for ``by="layer_group"``).
        """
        check_choice("by", by, (None, "layer", "head", "key_position", "layer_group"))
        arrays = self._require_data()
        if interval is not None:
            resampling.check_statistic("prior_fit", by)
            intervals = {fit: self.interval(f"{fit}_fit", by, level=interval) for fit in fitting.FIT_NAMES}
            curves = self.persistence(by)
            if by == "layer_group":
                for group, group_curves in curves.items():
                    group_curves.intervals = {fit: intervals[fit][group] for fit in fitting.FIT_NAMES}
            else:
                curves.intervals = intervals
            return curves
        if by == "key_position":
            stored = self.statistics.key_bins
            check_integer("bins", bins, message=f"bins={bins!r} must be a positive integer (the statistics keep {stored} key bins)")
            # Coarser bins are sums of the stored ones: stored bin i goes to bin i·bins // stored, so with
            # bins dividing the stored count (16 of 64) the edges are exactly linspace(0, T, bins + 1).
            groups = min(bins, stored)
            which = np.arange(stored) * groups // stored
            stored_edges = key_bin_edges(self.context_length, stored).numpy()
            edges = np.append(stored_edges[np.searchsorted(which, np.arange(groups))], stored_edges[-1])

            def binned(name: str) -> np.ndarray:
                out = np.zeros((groups, arrays[name].shape[-1]))
                np.add.at(out, which, arrays[name])
                return out

            return persistence_curves(binned("key_lag_sum"), binned("key_lag_prior_sum"), binned("key_lag_count"), by, edges,
                                      dt=self._lags())
        return lag_curves(arrays, self.n_heads, by, self.layer_groups(), dt=self._lags())

    def _lags(self) -> np.ndarray:
        """The lag ``dt`` of each column of the lag sums: ``0 .. T-1``, signed ``-(T-1) .. T-1`` for an encoder."""
        return lag_values(self.context_length, self.causal).numpy()

    # -- Toeplitz --------------------------------------------------------------------------------
    def toeplitz_r2(self, by: str = "head", interval: float | None = None) -> Any:
        """Toeplitz R² per head ``[layer, head]`` (TISA appendix B), over visible entries.

        Args:
            by: ``"head"`` on the document-averaged pattern (needs ``keep_pattern``),
                ``"head_per_doc"`` for the mean of per-window scores, ``"per_doc_mean"`` for that
                mean over heads too (one number: the summary's).
            interval: a confidence level (``0.95``) to get an :class:`Interval` over windows
                (``"head_per_doc"`` and ``"per_doc_mean"``; the document-averaged pattern has no
                per-group state, and asking raises :class:`IntervalUnavailableError` saying so).
        """
        check_choice("by", by, ("head", "head_per_doc", "per_doc_mean"))
        split = {"head": "head", "head_per_doc": "head", "per_doc_mean": None}[by]
        if interval is not None:
            return self.interval("toeplitz" if by == "head" else "toeplitz_per_doc", split, level=interval)
        arrays = self._require_data()
        if by != "head":
            value = resampling.toeplitz_per_doc(arrays["doc_toeplitz_sum"], arrays["doc_toeplitz_count"], split)
            return value if split else float(value)
        if "pattern_sum" not in arrays:
            raise NotRunError(
                "the Toeplitz R² of the document-averaged pattern needs the summed pattern, which this run did "
                "not keep; run with keep_pattern=True, or use toeplitz_r2(by='head_per_doc')"
            )
        covering = arrays["windows_covering"]
        if not self.causal:
            return metrics.bidirectional_mean_pattern_toeplitz_r2(arrays["pattern_sum"], covering, self.excluded_keys)
        mean = metrics.mean_pattern_key_lag(metrics.key_lag_layout(arrays["pattern_sum"]), covering)
        out = np.empty((self.n_layers, self.n_heads))
        for layer, window in enumerate(self.statistics.sliding_windows):
            visible = metrics.key_lag_visible(self.context_length, window, covering, self.excluded_keys)
            out[layer] = metrics.toeplitz_r2_key_lag(mean[layer], visible)
        return out

    def entry_sample(self) -> dict[str, np.ndarray]:
        """The uniform sample of visible entries kept during the run (``sample_size``).

        Returns:
            columns ``attention``, ``prior`` (``u(q)``), ``layer``, ``head``, ``query``,
            ``key_position``, each ``[n_sampled]``.
        """
        sample = self.statistics.sample
        if sample is None or len(sample) == 0:
            raise NotRunError("this run kept no entry sample; run with sample_size=20000 (for example)")
        return {c: v for c, v in sample.to_arrays().items() if c != "key"}

    def mean_pattern(self, layer: int, head: int) -> np.ndarray:
        """The document-averaged pattern of one head as a ``[query, key]`` matrix (0 where hidden)."""
        arrays = self._require_data()
        if "pattern_sum" not in arrays:
            raise NotRunError("this run did not keep the summed pattern; run with keep_pattern=True")
        if not self.causal:  # every real key is visible: the upper triangle too
            return metrics.bidirectional_mean_pattern(arrays["pattern_sum"][layer, head], arrays["windows_covering"],
                                                      self.excluded_keys)[0]
        n = self.context_length
        key_lag = metrics.mean_pattern_key_lag(metrics.key_lag_layout(arrays["pattern_sum"][layer, head]), arrays["windows_covering"])
        visible = metrics.key_lag_visible(n, self.statistics.sliding_windows[layer], arrays["windows_covering"], self.excluded_keys)
        out = np.zeros((n, n))
        t, dt = np.nonzero(visible)
        out[t + dt, t] = key_lag[t, dt]
        return out

    # -- attention sinks ---------------------------------------------------------------------------
    @property
    def first_token(self) -> str:
        """What the windows' first token was, in words (``metadata["first_token"]``, recorded by the run: the
        tokenizer's BOS where every window starts with it, else the first text token of each window)."""
        record = self.metadata.get("first_token")
        if isinstance(record, dict) and record.get("text"):
            return str(record["text"])
        return "the first token of each window (not recorded by the run that wrote this result)"

    @property
    def keeps_first_token(self) -> bool:
        """Whether this result has the first token's sums behind :meth:`first_token_weight` and :meth:`sink_rate`
        (results written before them, or run with ``keep_first_key=False``, have not)."""
        return bool(self._config().get("keep_first_key", False))

    def _first_token_sums(self) -> tuple[np.ndarray, float]:
        """``(first_key_sum [L, H], N)``: the first token's weights summed over queries and windows, and the
        real queries behind them.

        Raises:
            NotRunError: the result keeps no first-token sums (written before they existed, or with
                ``keep_first_key=False``), saying to run it again.
        """
        if not self.keeps_first_token:
            raise NotRunError(
                "this result keeps no first-token weights (first_key_sum), so it has no attention-sink numbers: "
                "it was written before the probe kept them, or run with keep_first_key=False; run it again with "
                "this version of equivariance_probe (the first token's weights are kept by default)"
            )
        arrays = self._require_data()
        return arrays["first_key_sum"].sum(-1), float(arrays["windows_covering"].sum())

    def first_token_weight(self, by: str | None = "head", interval: float | None = None) -> Any:
        """``α₁``: each head's mean attention weight on the window's first token (Gu et al., ICLR 2025).

        ``α₁(l, h) = Σ_windows Σ_q a[l, h, q, 0] / Σ_windows (real queries)``, over every real query
        of every window, whatever ``excluded_keys`` says (an excluded key stays in the softmax), a query
        whose mask hides the first token (a sliding window at ``q >= w``) adding 0. With windows of one
        length it equals Gu et al.'s mean over sequences of the per-window means. Which token the first
        one was: :attr:`first_token`.

        Args:
            by: ``"head"`` (``[layer, head]``), ``"layer"`` (the mean over each layer's heads, ``[layer]``)
                or ``None`` (the mean over every head).
            interval: a confidence level (``0.95``) for an :class:`Interval` over windows (the delete-a-group
                jackknife; clipped to ``[0, 1]``).

        Raises:
            NotRunError: a result without the first token's sums (see :meth:`sink_rate`).

        Example:
            >>> result.first_token_weight()[0, 0]  # doctest: +SKIP
            0.62
        """
        check_choice("by", by, sinks.SINK_BY)
        if interval is not None:
            return self._sink_interval(lambda alpha: sinks.split_heads(alpha, by), interval)
        total, count = self._first_token_sums()
        return sinks.split_heads(sinks.first_token_weight(total, count), by)

    def sink_rate(self, epsilon: float = sinks.SINK_EPSILON, by: str | None = None, interval: float | None = None) -> Any:
        """``Sink^ε₁``: the share of heads whose first-token weight ``α₁`` (:meth:`first_token_weight`) is above
        ``epsilon`` (Gu et al., ICLR 2025: ``ε = 0.3``; their Table 1 prints it in percent).

        Args:
            epsilon: the threshold ``ε`` in ``[0, 1)``.
            by: ``None`` (one share over every head of the model) or ``"layer"`` (``[layer]``).
            interval: a confidence level (``0.95``) for an :class:`Interval` over windows: the share is
                recomputed on every window but one group's (a head far from ``ε`` never changes side; the
                interval measures how the windows move the heads near it), clipped to ``[0, 1]``.

        Raises:
            NotRunError: a result written before the first token's sums were kept (or with
                ``keep_first_key=False``): run it again.
            InputError: ``epsilon`` outside ``[0, 1)``.
        """
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0.0 <= float(epsilon) < 1.0:
            raise InputError(f"epsilon={epsilon!r} must be a weight threshold in [0, 1), e.g. 0.3 (Gu et al.)")
        check_choice("by", by, ("layer", None))
        if interval is not None:
            return self._sink_interval(lambda alpha: sinks.sink_rate(alpha, float(epsilon), by), interval)
        return sinks.sink_rate(self.first_token_weight("head"), float(epsilon), by)

    def _sink_interval(self, statistic: Any, level: float) -> Interval:
        """The jackknife interval of ``statistic(α₁ [..., L, H])`` from the groups' first-token sums."""
        level = check_level(level)
        total, count = self._first_token_sums()
        sums = self.replicates().sums()
        replicates = statistic(sinks.first_token_weight(sums["first_key_sum"], sums["real_queries"]))
        return jackknife_interval(statistic(sinks.first_token_weight(total, count)), replicates, level=level,
                                  upper=1.0, lower=0.0)

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
            return self.toeplitz_r2("head_per_doc" if by == "head" else "per_doc_mean")
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

    # -- merging -----------------------------------------------------------------------------------
    def merge(self, other: ProbeResult, *, allow_duplicate_windows: bool = False) -> ProbeResult:
        """The result of both runs' windows together (exact: the sums add).

        Args:
            other: another result of the same model, measured the same way.
            allow_duplicate_windows: merge even if both hold the same windows (the same token
                ids, recognised by the 64-bit fingerprint every result keeps of each window),
                counting them twice. Only for users who weight windows twice on purpose.

        Raises:
            IncompatibleResultsError: the runs differ in model, layout, context, log floor,
                excluded keys or kept pattern; they share windows (the message says how many);
                they are the same run, or overlapping shards.
        """
        if not isinstance(other, ProbeResult):
            raise IncompatibleResultsError(f"can only merge a ProbeResult with another ProbeResult, not a {type(other).__name__}")
        mine, theirs = self.metadata.get("model", {}), other.metadata.get("model", {})
        if mine.get("name") and theirs.get("name") and mine.get("name") != theirs.get("name"):
            raise IncompatibleResultsError(
                f"cannot merge results of different models ({mine.get('name')!r} and {theirs.get('name')!r}): "
                "the sums of one model's attention do not add to another's; merge only results of one model "
                "(compare two models with compare_models, or side by side with equivariance-probe report)"
            )
        provenance = merged_provenance(self.metadata, other.metadata)  # refuses duplicates, other shards' corpora
        weights = (mine.get("weights_sha256"), theirs.get("weights_sha256"))
        if all(weights) and weights[0] != weights[1]:
            raise IncompatibleResultsError(
                f"cannot merge results of model {mine.get('name')!r} with weights sha256 {weights[0][:12]}… and "
                f"of model {theirs.get('name')!r} with weights sha256 {weights[1][:12]}… (metadata['model']"
                "['weights_sha256']): the same model name with other weights (a fine-tune, another checkpoint, a "
                "random_init_like copy, another dtype) measures other attention; merge only results of the same "
                "weights, and run the remaining windows on the weights the first result used"
            )
        statistics = self.statistics.merge(other.statistics, allow_duplicate_windows=allow_duplicate_windows)
        metadata = dict(self.metadata)
        metadata["merged_from"] = [self.metadata.get("run_id"), other.metadata.get("run_id")]
        if "windows" in self.metadata or "windows" in other.metadata:  # the windows of both parts, as measured
            metadata["windows"] = merged_windows_record(self.metadata.get("windows"), other.metadata.get("windows"))
        if "first_token" in self.metadata or "first_token" in other.metadata:  # what the sink numbers weighed, in both
            metadata["first_token"] = merged_first_token(self.metadata.get("first_token"), other.metadata.get("first_token"))
        metadata.update(provenance)
        metadata["complete"] = self.complete and other.complete
        return ProbeResult(statistics, metadata)

    def __add__(self, other: ProbeResult) -> ProbeResult:
        return self.merge(other)

    # -- summary and display -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Headline numbers, as stored in the result file's header.

        Keys: ``n_windows``, ``n_tokens``, ``n_entries``, ``floored_entries``, ``log_floor``,
        ``excluded_keys``; ``query_position_r2`` (``{scale: {form: R²}}``, every form and scale);
        ``persistence_fit_r2`` (``{fit: R²}``) and ``persistence_fits`` (``{fit: {"params", "r2", "status", "note"}}``: status ``ok``, ``at_bound`` or ``failed``)
        of ``P(dt)``; ``fit_r2_by_key_position`` (Figure 1c: ``key_bins`` edges and each fit's R²
        per bin, 16 bins); ``toeplitz_r2_per_doc_mean`` and ``toeplitz_r2_mean_pattern_mean``
        (NaN without ``keep_pattern``); ``most_position_bound_head`` /
        ``least_position_bound_head`` (log η²); ``head_scores`` (every score of
        :data:`~equivariance_probe.analyses.heads.RANKING_SCORES` as ``[layer][head]`` lists);
        ``layer_groups`` (for models with sliding-window and global layers: per group its
        ``layers``, ``query_position_r2`` and ``persistence_fit_r2``; empty otherwise); ``sinks`` (the
        attention-sink rate at ``ε = 0.3`` with its interval, per layer, and the first token's weight
        per head: :func:`~equivariance_probe.analyses.summary.sink_summary`).
        NaN where a number is undefined.

        A loaded result returns the numbers stored in its file without reading any array.
        """
        if self._stored_summary is not None:
            return _undefined_as_nan(self._stored_summary)  # rebuilds every dict and list: a copy already
        if self.n_windows == 0:
            return {"n_windows": 0}
        state = (id(self.statistics), self.statistics.n_windows, self.statistics.n_tokens)
        if self._computed_summary is None or self._computed_summary[0] != state:
            self._computed_summary = (state, result_summary(self, key_bins=SUMMARY_KEY_BINS, level=SUMMARY_LEVEL))
        return copy.deepcopy(self._computed_summary[1])

    def to_rows(self) -> list[dict[str, Any]]:
        """The numbers in long form, one dict per statistic and split (model, layer group, head), with
        their intervals and the run's model, variant, run id and window protocol
        (:mod:`~equivariance_probe.analyses.tidy` lists the columns). Built from :meth:`summary`, so a
        loaded result reads no array; needs no pandas. ``equivariance-probe show --csv`` prints these rows.

        Example:
            >>> rows = result.to_rows()
            >>> next(r for r in rows if r["statistic"] == "log_eta2" and r["split"] == "model")["value"]
            0.0283...
        """
        from .analyses.tidy import probe_identity, probe_rows

        return probe_rows(self.summary(), probe_identity(self.metadata, self.model_name))

    def to_dataframe(self) -> Any:
        """:meth:`to_rows` as a pandas ``DataFrame`` (one row per statistic and split): runs concatenate
        with ``pandas.concat`` for plotting.

        Raises:
            MissingDependencyError: pandas is not installed (the message gives ``pip install pandas``).
        """
        from .analyses.tidy import rows_dataframe

        return rows_dataframe(self.to_rows(), "ProbeResult.to_dataframe()")

    def _headline(self) -> tuple[dict[str, dict[str, float]], str, str]:
        """Query-position R² table and the most/least position-bound heads (from the header when loaded)."""
        if self._stored_summary is not None:
            summary = self.summary()
            return summary["query_position_r2"], summary["most_position_bound_head"], summary["least_position_bound_head"]
        eta2 = self.query_position_r2("log", "eta2", by="head")
        return self.query_position_table(), head_label(eta2, np.nanargmax), head_label(eta2, np.nanargmin)

    def __repr__(self) -> str:
        model = self.model_name
        if self.n_windows == 0:
            return f"ProbeResult(model={model!r}, empty)"
        table, most, least = self._headline()
        cells = ", ".join(
            f"{s}: " + " ".join(f"{f}={_formatted(table[s][f], 3)}" for f in metrics.FORMS) for s in metrics.SCALES
        )
        excluded = f", excluded keys {list(self.excluded_keys)}" if self.excluded_keys else ""
        return (
            f"ProbeResult(model={model!r}, windows={self.n_windows}, tokens={self.n_tokens}{excluded}; "
            f"query-position R² {cells}; most position-bound head {most}, least {least} (log η²))"
        )

    def _repr_html_(self) -> str:
        # Every value below may come from a file's header (someone else's file, opened in a notebook):
        # Markup.format escapes each one; only the ranking's own Markup passes as it is.
        if self.n_windows == 0:
            return Markup("<b>ProbeResult</b> for <code>{}</code>: no data yet").format(self.model_name)
        table, most, least = self._headline()
        cell = Markup("<td>{}</td>")
        rows = Markup("").join(
            Markup("<tr><th>{}</th>{}</tr>").format(s, Markup("").join(cell.format(_formatted(table[s][f], 4)) for f in metrics.FORMS))
            for s in metrics.SCALES
        )
        floored = self.summary()["floored_entries"] if self._stored_summary is not None else self.floored()
        return Markup(
            "<div><b>ProbeResult</b> for <code>{model}</code>: {windows} windows, {tokens} tokens, log floor {floor} "
            "({floored} entries floored), excluded keys {excluded}<table><tr><th>scale</th>{forms}</tr>{rows}</table>"
            "Query-position R² over all visible entries. Most position-bound head {most}, least {least} (log η²)."
            "{ranking}</div>"
        ).format(
            model=self.model_name, windows=self.n_windows, tokens=self.n_tokens, floor=f"{self.log_floor:.3g}",
            floored=floored, excluded=list(self.excluded_keys) or "none",
            forms=Markup("").join(Markup("<th>{}</th>").format(f) for f in metrics.FORMS), rows=rows,
            most=most, least=least, ranking=self.rank_heads().to_html(max_rows=10),
        )

    # -- heads ------------------------------------------------------------------------------------------
    def rank_heads(self, by: str = "log_eta2", scores: Any = None, *, top_k: int | None = TOP_K) -> HeadRanking:
        """Heads from the most to the least position-bound: a
        :class:`~equivariance_probe.analyses.heads.HeadRanking` (``to_dataframe()``, ``to_records()``).

        ``by`` is the ordering key (default ``"log_eta2"``); query-position R² and the prior
        fit sort descending, Toeplitz R² ascending (see :mod:`equivariance_probe.analyses.heads`).
        ``top_k``: also report, per head, in what share of the jackknife's replicates it is among
        the ``top_k`` first (``None``: not).
        """
        known = None
        stability = None
        if self._stored_summary is not None and "head_scores" in self._stored_summary:
            summary = self.summary()
            known = {name: np.asarray(v, dtype=np.float64) for name, v in summary["head_scores"].items()}
            stability = summary.get("head_stability")
        return rank_heads(self, by=by, scores=scores, known_scores=known, top_k=top_k, known_stability=stability)

    # -- files -------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the result file (format 3; any name, ``.safetensors`` by convention), atomically.

        The float64 sums (bitwise), the entry sample and the window fingerprints are safetensors
        tensors; the metadata and :meth:`summary` are JSON in the header, so that the headline
        numbers read back without the arrays. Written to a temporary file, flushed to disk, then
        renamed (:mod:`~equivariance_probe.records.result_file`).
        """
        return write_result_file(path, self.statistics, self.metadata, complete=self.complete, summary=self.summary())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeResult:
        """Read a result file of any version (1, 2: JSON; 3: safetensors), told apart by its first bytes.

        Version 3 is read lazily: the header now (checked field by field, so :meth:`summary`, the
        metadata and the counts cost one header read), the arrays the first time a number needs
        them, when their checksum is verified.

        Raises:
            ResultFileError: the file is truncated, edited, not a result, or from a newer format.
        """
        opened = open_result_file(path)
        return cls(metadata=opened.metadata, file=opened)


#: The numbers a study reports the trained-minus-baseline difference of, in its table's order.
DIFFERENCE_STATISTICS = (
    *(f"{scale}_{form}" for scale in metrics.SCALES for form in metrics.FORMS),
    *(f"{fit}_fit" for fit in fitting.FIT_NAMES),
    "toeplitz_per_doc",
)


def paired_difference(a: ProbeResult, b: ProbeResult, statistic: str = "log_fitted", by: str | None = None,
                      level: float = 0.95) -> Any:
    """``θ_a - θ_b`` with its interval over windows, from paired jackknife replicates.

    Both results must hold the same groups of windows: the same windows grouped by fingerprint
    (a model and its baselines on one corpus), or windows grouped by explicit ``resampling_keys``
    naming the same text regions (a context-length scan over one token stream). The difference is
    recomputed on every window but one group's, in both results at once, so what the two share
    (the same hard documents) cancels: ``se² = (G'-1)/G' · Σ_g (d₍g₎ - d̄)²`` with
    ``d₍g₎ = θ_a₍g₎ - θ_b₍g₎``.

    Args:
        a: the first result.
        b: the second, measured on the same windows.
        statistic: one of :data:`~equivariance_probe.analyses.intervals.INTERVAL_STATISTICS`.
        by: as in :meth:`ProbeResult.interval`.
        level: the confidence level.

    Returns:
        An :class:`Interval` of the difference (``{group: Interval}`` for ``by="layer_group"``).

    Raises:
        IncompatibleResultsError: the results do not hold the same groups of windows (named).
        IntervalUnavailableError: either result has no intervals (says why).

    Example:
        >>> paired_difference(study.trained, study.results["random_init"], "log_fitted")  # doctest: +SKIP
        Interval(-0.1935 [-0.2060, -0.1810], 95% over 14 groups of windows)
    """
    level = check_level(level)
    mine, theirs = a.replicates(), b.replicates()
    mine.paired(theirs)
    (estimate_a, replicates_a), (estimate_b, replicates_b) = mine.of(statistic, by), theirs.of(statistic, by)
    if isinstance(estimate_a, dict):
        return {group: jackknife_interval(estimate_a[group] - estimate_b[group], replicates_a[group] - replicates_b[group],
                                          level=level) for group in estimate_a}
    return jackknife_interval(np.subtract(estimate_a, estimate_b), np.subtract(replicates_a, replicates_b), level=level)


def paired_differences(a: ProbeResult, b: ProbeResult, level: float = SUMMARY_LEVEL) -> dict[str, Interval]:
    """``a - b`` of every number of :data:`DIFFERENCE_STATISTICS`, each with its interval (:func:`paired_difference`)."""
    return {statistic: paired_difference(a, b, statistic, level=level) for statistic in DIFFERENCE_STATISTICS}


def _formatted(value: Any, digits: int) -> str:
    """A headline number, or ``undefined`` (a form the result names in :meth:`ProbeResult.undefined`)."""
    return "undefined" if is_undefined(value) else f"{value:.{digits}f}"


def _undefined_as_nan(value: Any) -> Any:
    """A stored summary with ``null`` (how JSON holds NaN) back as NaN, like a computed one."""
    if isinstance(value, dict):
        return {key: _undefined_as_nan(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_undefined_as_nan(v) for v in value]
    return math.nan if value is None else value
