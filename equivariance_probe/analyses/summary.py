"""A result's summary: the headline numbers a result file stores in its header.

Place in the seams: *analyses*, assembling numbers the result already computes (query-position R²
in every form and scale, the persistence fits, the Toeplitz R², the heads' scores and their
ranking's stability, and each number's interval over windows) into the plain dict that
:meth:`~equivariance_probe.result.ProbeResult.summary` returns and the result file keeps, so that a
loaded result shows them without reading its arrays. It computes nothing of its own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import IntervalUnavailableError, NotRunError, SupersededSumsError, UndefinedStatisticError
from ..maths import fitting, metrics
from ..maths.sinks import SINK_EPSILON
from .heads import TOP_K, head_scores, ranking_stability

__all__ = ["result_summary", "head_label", "sink_summary", "stored_sink_summary"]


def head_label(values: np.ndarray, pick: Any) -> str:
    """``"L{layer}H{head} (value)"`` of the head ``pick`` (``np.nanargmax``/``np.nanargmin``) chooses from
    ``values [layer, head]``, or ``"n/a"`` where every value is NaN."""
    if np.all(np.isnan(values)):
        return "n/a"
    layer, head = np.unravel_index(pick(values), values.shape)
    return f"L{layer}H{head} ({values[layer, head]:.3f})"


def result_summary(result: Any, *, key_bins: int, level: float, epsilon: float = SINK_EPSILON) -> dict[str, Any]:
    """The headline numbers of a result, as :meth:`ProbeResult.summary` returns them and its file stores them.

    Args:
        result: a :class:`~equivariance_probe.result.ProbeResult` holding windows.
        key_bins: key-position bins of the Figure 1c numbers (fewer if the window is shorter).
        level: confidence level of the stored intervals.
        epsilon: the sink rates' threshold ``ε``.

    Returns:
        The keys :meth:`ProbeResult.summary` lists.
    """
    scores = head_scores(result)
    persistence = result.persistence()
    bins = min(key_bins, result.context_length)
    by_key = result.persistence(by="key_position", bins=bins)
    mean_pattern = scores["toeplitz"]
    return {
        "n_windows": result.n_windows,
        "n_tokens": result.n_tokens,
        "n_entries": result.n_entries(),
        "floored_entries": result.floored(),
        "log_floor": result.log_floor,
        "excluded_keys": list(result.excluded_keys),
        "query_position_r2": result.query_position_table(),
        "persistence_fit_r2": {name: persistence.fits[name].r2 for name in fitting.FIT_NAMES},
        "persistence_fits": {name: {"params": dict(persistence.fits[name].params), "r2": persistence.fits[name].r2,
                                    "status": persistence.fits[name].status, "note": persistence.fits[name].note}
                             for name in fitting.FIT_NAMES},
        "fit_r2_by_key_position": {"key_bins": by_key.key_bins.tolist(),
                                   **{name: np.asarray(by_key.r2(name)).tolist() for name in fitting.FIT_NAMES}},
        # The same function as its interval's estimate: one code path for the number and its centre.
        "toeplitz_r2_per_doc_mean": result.toeplitz_r2(None, estimator="per_doc"),
        "toeplitz_r2_mean_pattern_mean": math.nan if np.all(np.isnan(mean_pattern)) else float(np.nanmean(mean_pattern)),
        "most_position_bound_head": head_label(scores["log_eta2"], np.nanargmax),
        "least_position_bound_head": head_label(scores["log_eta2"], np.nanargmin),
        "head_scores": {name: values.tolist() for name, values in scores.items()},
        "layer_groups": _layer_group_summary(result),
        "causal": result.causal,
        "undefined": dict(result.undefined),
        "intervals": _interval_summary(result, level),
        "head_stability": ranking_stability(result, "log_eta2", TOP_K),
        "sinks": sink_summary(result, level, epsilon),
    }


def sink_summary(result: Any, level: float, epsilon: float = SINK_EPSILON) -> dict[str, Any]:
    """The attention-sink numbers (Gu et al., ICLR 2025) at ``epsilon``.

    Keys: ``epsilon``; ``rate`` (Gu et al.'s per-window sink rate, :meth:`ProbeResult.sink_rate`) with its
    ``rate_interval`` (``[low, high]``, or ``None`` without intervals) and ``rate_by_layer``; ``pooled_rate``,
    ``pooled_rate_interval`` and ``pooled_rate_by_layer`` (the window-averaged weight thresholded once per
    head, :meth:`ProbeResult.pooled_sink_rate`); the ``mean_weight`` of the first token over every head,
    ``weight_by_head`` (pooled ``α₁`` as ``[layer][head]``) and the ``first_token`` in words. A result whose
    file predates the per-window weights has ``rate`` ``None`` and ``rate_unavailable`` (why); one that keeps
    no first-token sums is ``{"unavailable": why}``.
    """
    try:
        alpha = result.first_token_weight("head")
    except NotRunError as error:
        return {"unavailable": str(error)}
    out: dict[str, Any] = {"epsilon": epsilon}
    try:
        out.update(_rates(result, level, epsilon, result.sink_rate, "rate"))
    except SupersededSumsError as error:
        out.update(rate=None, rate_interval=None, rate_by_layer=None, rate_unavailable=str(error))
    out.update(_rates(result, level, epsilon, result.pooled_sink_rate, "pooled_rate"))
    out.update(mean_weight=float(np.mean(alpha)), weight_by_head=alpha.tolist(), first_token=result.first_token)
    return out


def _rates(result: Any, level: float, epsilon: float, rate: Any, name: str) -> dict[str, Any]:
    """``{name, name_interval, name_by_layer}`` of one sink rate (``rate(epsilon, by, interval)``)."""
    try:
        found = rate(epsilon, interval=level)
        bounds: list[float] | None = [found.low, found.high]
    except IntervalUnavailableError:
        bounds = None
    return {name: float(rate(epsilon)), f"{name}_interval": bounds,
            f"{name}_by_layer": np.asarray(rate(epsilon, by="layer")).tolist()}


def stored_sink_summary(sinks: dict[str, Any]) -> dict[str, Any]:
    """A stored summary's sink block in today's keys: a file written before the per-window weights stored the
    pooled rate as ``rate``, which reads as ``pooled_rate`` (``rate`` is ``None``, ``rate_unavailable`` says why)."""
    if not sinks or "unavailable" in sinks or "pooled_rate" in sinks:
        return sinks
    pooled = {f"pooled_{name}": sinks.get(name) for name in ("rate", "rate_interval", "rate_by_layer")}
    return {**sinks, **pooled, "rate": None, "rate_interval": None, "rate_by_layer": None,
            "rate_unavailable": "this file was written before the probe kept each window's first-token weight, so "
                                "it has no sink rate as Gu et al. compute it (a per-window threshold), only the "
                                "pooled one; run it again with this version of equivariance_probe"}


def _interval_summary(result: Any, level: float) -> dict[str, Any]:
    """``[low, high]`` at ``level`` of every headline number (and of each layer group's),
    with the groups behind them; or ``{"level", "unavailable": why}``."""
    try:
        groups = result.replicates().groups
    except IntervalUnavailableError as error:
        return {"level": level, "unavailable": str(error)}

    def bounds(statistic: str, by: str | None = None) -> Any:
        try:
            found = result.interval(statistic, by, level)
        except UndefinedStatisticError:
            return None  # a number without a value (an encoder's prior forms) has no interval either
        if isinstance(found, dict):
            return {group: [value.low, value.high] for group, value in found.items() if group != "all"}
        return [found.low, found.high]

    qpve = {scale: {form: bounds(f"{scale}_{form}") for form in metrics.FORMS} for scale in metrics.SCALES}
    fits = {fit: bounds(f"{fit}_fit") for fit in fitting.FIT_NAMES}
    block = {
        "level": level,
        "method": "delete-a-group jackknife, windows as the sampling unit; t intervals of R², clipped at 1 "
                  "where they would pass it",
        "interval_groups": groups.n_groups,
        "groups": len(groups.ids),
        "keys": groups.keys,
        "query_position_r2": qpve,
        "persistence_fit_r2": fits,
        "toeplitz_r2_per_doc_mean": bounds("toeplitz_per_doc"),
    }
    if len(result.layer_groups()) > 1:
        by_group = {scale: {form: bounds(f"{scale}_{form}", "layer_group") for form in metrics.FORMS}
                    for scale in metrics.SCALES}
        fit_groups = {fit: bounds(f"{fit}_fit", "layer_group") for fit in fitting.FIT_NAMES}
        block["layer_groups"] = {
            group: {"query_position_r2": {scale: {form: by_group[scale][form][group] for form in metrics.FORMS}
                                          for scale in metrics.SCALES},
                    "persistence_fit_r2": {fit: fit_groups[fit][group] for fit in fitting.FIT_NAMES}}
            for group in result.layer_groups() if group != "all"
        }
    return block


def _layer_group_summary(result: Any) -> dict[str, Any]:
    """Per layer group (only for models with more than one kind of layer): its layers, every
    query-position R² form and scale over its entries, and the R² of each fit to its ``P(dt)``."""
    groups = result.layer_groups()
    if len(groups) == 1:
        return {}
    tables = {scale: {form: result.query_position_r2(scale, form, by="layer_group") for form in metrics.FORMS}
              for scale in metrics.SCALES}
    curves = result.persistence(by="layer_group")
    return {
        group: {
            "layers": list(layers),
            "query_position_r2": {scale: {form: tables[scale][form][group] for form in metrics.FORMS}
                                  for scale in metrics.SCALES},
            "persistence_fit_r2": {name: curves[group].fits[name].r2 for name in fitting.FIT_NAMES},
            "persistence_fit_status": {name: curves[group].fits[name].status for name in fitting.FIT_NAMES},
        }
        for group, layers in groups.items()
        if group != "all"
    }
