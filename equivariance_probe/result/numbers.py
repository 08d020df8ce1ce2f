"""A probe result's numbers: query-position R², persistence, Toeplitz R² and the attention sinks.

Place in the seams: one part of :class:`~equivariance_probe.result.ProbeResult` (the class mixes it in), the
statistics accessors: each method computes a number from the float64 sums with :mod:`~equivariance_probe.maths`.
``by=`` is the split axis throughout (:func:`~equivariance_probe.analyses.results.split_axis`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..analyses import intervals as resampling
from ..analyses.results import split_axis
from ..errors import (NotRunError, SupersededSumsError, UndefinedStatisticError, check_choice, check_index,
                      check_integer)
from ..maths import fitting, metrics, sinks
from ..maths.intervals import Interval, check_level, jackknife_interval
from ..maths.persistence import lag_curves, persistence_curves
from ..statistics.groups import group_of
from ..statistics.masks import key_bin_edges, lag_values

__all__ = ["ProbeNumbers", "TOEPLITZ_ESTIMATORS"]

#: What ``toeplitz_r2``'s ``by`` once named, as the split axis of ``estimator="per_doc"``.
#: The estimators of :meth:`ProbeNumbers.toeplitz_r2`: on the document-averaged pattern, or the mean of
#: per-window scores.
TOEPLITZ_ESTIMATORS = ("mean_pattern", "per_doc")


class ProbeNumbers:
    """The statistics accessors of :class:`~equivariance_probe.result.ProbeResult` (mixed into it)."""

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
        by = split_axis(by, (None, "layer", "head", "layer_group"))
        if f"query_position_r2.{form}" in self.undefined:
            raise UndefinedStatisticError(f"the {form} query-position R² is {self.undefined[f'query_position_r2.{form}']}")
        if interval is not None:
            return self.interval(f"{scale}_{form}", by, level=interval)
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
            by=by,
        )
        value = values[form]
        return float(value) if np.ndim(value) == 0 else value

    def query_position_table(self) -> dict[str, dict[str, float | None]]:
        """Every form on every scale over all entries: ``{scale: {form: R²}}`` (``None`` for a form
        :meth:`undefined` names)."""
        undefined = self.undefined
        return {s: {f: None if f"query_position_r2.{f}" in undefined else self.query_position_r2(scale=s, form=f)
                    for f in metrics.FORMS} for s in metrics.SCALES}

    def floored(self, by: str | None = None) -> Any:
        """Visible entries below ``eps`` (floored on the log scale): total, ``[layer]`` or ``[layer, head]``."""
        by = split_axis(by, (None, "layer", "head"))
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
        by = split_axis(by, (None, "layer", "head", "key_position", "layer_group"))
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
    def toeplitz_r2(self, by: str | None = "head", interval: float | None = None, *,
                    estimator: str = "mean_pattern") -> Any:
        """Toeplitz R² per head ``[layer, head]`` (TISA appendix B), over visible entries.

        Args:
            by: ``"head"`` (``[layer, head]``) or ``None`` (the mean over heads: one number, the
                summary's; ``estimator="per_doc"`` only).
            interval: a confidence level (``0.95``) to get an :class:`Interval` over windows
                (``estimator="per_doc"``; the document-averaged pattern has no per-group state, and
                asking raises :class:`IntervalUnavailableError` saying so).
            estimator: ``"mean_pattern"``, the R² of the document-averaged pattern (needs
                ``keep_pattern``), or ``"per_doc"``, the mean of per-window scores.
        """
        check_choice("estimator", estimator, TOEPLITZ_ESTIMATORS)
        by = split_axis(by, ("head",) if estimator == "mean_pattern" else ("head", None))
        if interval is not None:
            return self.interval("toeplitz" if estimator == "mean_pattern" else "toeplitz_per_doc", by, level=interval)
        arrays = self._require_data()
        if estimator == "per_doc":
            value = resampling.toeplitz_per_doc(arrays["doc_toeplitz_sum"], arrays["doc_toeplitz_count"], by)
            return value if by else float(value)
        if "pattern_sum" not in arrays:
            raise NotRunError(
                "the Toeplitz R² of the document-averaged pattern needs the summed pattern, which this run did "
                "not keep; run with keep_pattern=True, or use toeplitz_r2(estimator='per_doc')"
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
        layer = check_index("layer", layer, self.n_layers)
        head = check_index("head", head, self.n_heads, what="head")
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
        return bool(self.config.get("keep_first_key", False))

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
        """``α₁``: each head's mean attention weight on the window's first token, pooled over windows (Gu et al.,
        ICLR 2025, average it over sequences).

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
        by = split_axis(by, sinks.SINK_BY)
        if interval is not None:
            return self._sink_interval(lambda alpha: sinks.split_heads(alpha, by), interval)
        total, count = self._first_token_sums()
        return sinks.split_heads(sinks.first_token_weight(total, count), by)

    def sink_rate(self, epsilon: float = sinks.SINK_EPSILON, by: str | None = None, interval: float | None = None) -> Any:
        """Gu et al.'s ``Sink^ε₁`` (ICLR 2025, as their released code computes it): the share of *(window, layer,
        head)* triples whose window's first-token weight ``α₁(w) = (1/T_w)·Σ_q a[q, 0]`` is above ``epsilon``.

        ``rate = mean over w, l, h of 1[α₁(w, l, h) > ε]`` (:func:`~equivariance_probe.maths.sinks.window_sink_rate`),
        from each window's weights, which the run keeps (``[windows, layer, head]``), so any ``ε`` can be asked
        after the run. Thresholding the window-averaged weight once per head instead is
        :meth:`pooled_sink_rate`, another statistic.

        Args:
            epsilon: the threshold ``ε`` in ``[0, 1)`` (Gu et al.: 0.3, :data:`~equivariance_probe.maths.sinks.SINK_EPSILON`).
            by: ``None`` (one share over every window and head), ``"layer"`` (``[layer]``) or ``"head"``
                (``[layer, head]``: the share of windows in which each head is a sink).
            interval: a confidence level (``0.95``) for an :class:`Interval` over windows (the delete-a-group
                jackknife over the interval groups, as every other number), clipped to ``[0, 1]``.

        Raises:
            SupersededSumsError: a result written before each window's weight was kept (its sums give
                :meth:`pooled_sink_rate` alone): run it again.
            NotRunError: a result without the first token's sums at all.
            InputError: ``epsilon`` outside ``[0, 1)``.

        Example:
            >>> result.sink_rate(0.3)  # doctest: +SKIP
            0.81
        """
        epsilon = sinks.check_epsilon(epsilon)
        by = split_axis(by, sinks.SINK_BY)
        kept = self._window_sinks()
        estimate = sinks.window_sink_rate(kept.alpha, epsilon, by)
        if interval is None:
            return estimate
        level = check_level(interval)
        groups = self.replicates().groups
        window_groups = group_of(kept.keys, groups.n_groups)
        replicates = sinks.window_sink_replicates(kept.alpha, window_groups, groups.ids, epsilon, by)
        return jackknife_interval(estimate, replicates, level=level, upper=1.0, lower=0.0)

    def _window_sinks(self) -> Any:
        """The per-window first-token weights (:class:`~equivariance_probe.statistics.window_sinks.WindowSinks`).

        Raises:
            NotRunError: no first-token sums at all (:meth:`_first_token_sums`).
            SupersededSumsError: first-token sums pooled over windows only (a file written before each
                window's weight was kept).
        """
        self._first_token_sums()
        kept = self.statistics.window_sinks
        if kept is None:
            raise SupersededSumsError(
                "this result keeps the first token's weight pooled over windows only, not each window's, so it has "
                "no sink rate as Gu et al. compute it (a per-window threshold): it was written before the probe kept "
                "each window's weight; run it again with this version of equivariance_probe. Its pooled_sink_rate() "
                "(the window-averaged weight thresholded once per head) is still available"
            )
        return kept

    def pooled_sink_rate(self, epsilon: float = sinks.SINK_EPSILON, by: str | None = None,
                         interval: float | None = None) -> Any:
        """The pooled sink rate: the share of heads whose window-averaged first-token weight ``α₁``
        (:meth:`first_token_weight`) is above ``epsilon``, thresholded once per head. Not Gu et al.'s statistic
        (:meth:`sink_rate` thresholds each window): the two differ wherever a head's per-window ``α₁``
        straddles ``ε``. Files written before each window's weight was kept have this one alone.

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
        epsilon = sinks.check_epsilon(epsilon)
        by = split_axis(by, ("layer", None))
        if interval is not None:
            return self._sink_interval(lambda alpha: sinks.sink_rate(alpha, epsilon, by), interval)
        return sinks.sink_rate(self.first_token_weight("head"), epsilon, by)

    def _sink_interval(self, statistic: Any, level: float) -> Interval:
        """The jackknife interval of ``statistic(α₁ [..., L, H])`` from the groups' first-token sums."""
        level = check_level(level)
        total, count = self._first_token_sums()
        sums = self.replicates().sums()
        replicates = statistic(sinks.first_token_weight(sums["first_key_sum"], sums["real_queries"]))
        return jackknife_interval(statistic(sinks.first_token_weight(total, count)), replicates, level=level,
                                  upper=1.0, lower=0.0)
