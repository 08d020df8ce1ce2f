"""Tidy tables: every result's numbers in long form, one row per statistic and split.

Place in the seams: *analyses*, reading the summaries the results already keep (a
:class:`~equivariance_probe.result.ProbeResult`'s and a
:class:`~equivariance_probe.shift_result.ShiftResult`'s are stored in their files' headers, so a
file's rows need no array) and the run's identifying metadata. The rows are plain dicts, so
building them needs no pandas: ``to_dataframe()`` of each result and ``equivariance-probe show
--csv / --json`` are the same rows, the first as a pandas ``DataFrame``. Rows of several runs
concatenate (``pandas.concat``) because each carries its model, variant and run id.

Columns (:data:`COLUMNS`), ``None`` where a column does not apply:

* ``kind`` (``probe``, ``shift``, ``positional``, ``position_probe``), ``model``, ``variant`` (``trained``, a baseline's
  name, or ``None``), ``run_id``, ``mode`` (how the windows were made, or the shift test's mode),
  ``dtype`` — the run;
* ``statistic`` — the number's name (``log_eta2``, ``persistence_power_r2``, ``offset_eta2``...);
  ``representation`` — the shift test's (``centred_logits``, ``weights``, ``residual``);
* ``split`` — ``model``, ``layer_group``, ``layer``, ``head`` or ``component``, with ``layer_group``,
  ``layer``, ``head`` (zero-based), ``offset`` (the shift test's loss and sink mass by offset) and
  ``component`` (a residual-stream component such as ``mlp.5``, or a patched item) where they apply;
* ``value``, ``low``, ``high``, ``level`` — the number and its confidence interval over windows
  (or segments), where the result has one; ``unit`` — what the value is measured in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import IntervalUnavailableError, MissingDependencyError

__all__ = ["COLUMNS", "probe_rows", "sink_rows", "position_probe_rows", "shift_rows", "positional_rows", "rows_dataframe", "require_pandas"]

COLUMNS = ("kind", "model", "variant", "run_id", "mode", "dtype", "statistic", "representation", "split",
           "layer_group", "layer", "head", "offset", "component", "value", "low", "high", "level", "unit")


def require_pandas(what: str) -> Any:
    """``pandas``, imported; or a :class:`~equivariance_probe.errors.MissingDependencyError` naming ``what``
    needs it and the command that installs it."""
    try:
        import pandas
    except ImportError:
        raise MissingDependencyError(
            f"{what} needs pandas, which is not installed in this Python; install it with `pip install pandas` "
            "(the rows themselves need no pandas: to_rows(), or equivariance-probe show --csv)"
        ) from None
    return pandas


def rows_dataframe(rows: Sequence[Mapping[str, Any]], what: str) -> Any:
    """``rows`` as a pandas ``DataFrame`` with the columns :data:`COLUMNS`, in that order (pandas imported here)."""
    pandas = require_pandas(what)
    return pandas.DataFrame(list(rows), columns=list(COLUMNS))


def _number(value: Any) -> float | None:
    """A float, or ``None`` for a missing or undefined one (JSON holds NaN as ``None``)."""
    if value is None or isinstance(value, (dict, list, str)):
        return None
    value = float(value)
    return None if value != value or value in (float("inf"), float("-inf")) else value


def _row(identity: Mapping[str, Any], statistic: str, value: Any, *, split: str = "model", low: Any = None,
         high: Any = None, level: Any = None, **where: Any) -> dict[str, Any]:
    row = dict.fromkeys(COLUMNS)
    row.update(identity)
    row.update(where)
    row.update(statistic=statistic, split=split, value=_number(value), low=_number(low), high=_number(high),
               level=_number(level) if low is not None or high is not None else None)
    return row


def probe_identity(metadata: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The identifying columns of a :class:`~equivariance_probe.result.ProbeResult`'s rows."""
    run_ids = metadata.get("run_ids") or ([metadata["run_id"]] if metadata.get("run_id") else [])
    windows = metadata.get("windows") if isinstance(metadata.get("windows"), Mapping) else {}
    return {"kind": "probe", "model": model, "variant": metadata.get("label"), "run_id": ",".join(map(str, run_ids))
            or None, "mode": windows.get("protocol"), "dtype": (metadata.get("model") or {}).get("dtype")
            if isinstance(metadata.get("model"), Mapping) else None}


def probe_rows(summary: Mapping[str, Any], identity: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The long-form rows of a probe result's :meth:`~equivariance_probe.result.ProbeResult.summary`.

    Statistics: ``{scale}_{form}`` (query-position R², e.g. ``log_eta2``) for the model, each layer
    group and each head; ``persistence_{fit}_r2`` for the model and each layer group;
    ``toeplitz_r2_per_doc_mean`` and ``toeplitz_r2_mean_pattern_mean`` (means over heads) for the
    model; every other head score (``toeplitz``, ``toeplitz_per_doc``, ``prior_fit``) per head.
    Intervals where the summary keeps them.
    """
    if not summary.get("n_windows"):
        return []
    intervals = summary.get("intervals") or {}
    level = intervals.get("level")

    def bounds(*path: str) -> dict[str, Any]:
        found: Any = intervals
        for key in path:
            found = found.get(key) if isinstance(found, Mapping) else None
        if isinstance(found, Sequence) and len(found) == 2:
            return {"low": found[0], "high": found[1], "level": level}
        return {}

    rows = []
    for scale, forms in summary.get("query_position_r2", {}).items():
        for form, value in forms.items():
            rows.append(_row(identity, f"{scale}_{form}", value, **bounds("query_position_r2", scale, form)))
    for fit, value in summary.get("persistence_fit_r2", {}).items():
        rows.append(_row(identity, f"persistence_{fit}_r2", value, **bounds("persistence_fit_r2", fit)))
    for name in ("toeplitz_r2_per_doc_mean", "toeplitz_r2_mean_pattern_mean"):
        if name in summary:
            rows.append(_row(identity, name, summary[name], **bounds(name)))
    for group, numbers in (summary.get("layer_groups") or {}).items():
        for scale, forms in numbers.get("query_position_r2", {}).items():
            for form, value in forms.items():
                rows.append(_row(identity, f"{scale}_{form}", value, split="layer_group", layer_group=group,
                                 **bounds("layer_groups", group, "query_position_r2", scale, form)))
        for fit, value in numbers.get("persistence_fit_r2", {}).items():
            rows.append(_row(identity, f"persistence_{fit}_r2", value, split="layer_group", layer_group=group,
                             **bounds("layer_groups", group, "persistence_fit_r2", fit)))
    for score, by_layer in (summary.get("head_scores") or {}).items():
        for layer, heads in enumerate(by_layer):
            for head, value in enumerate(heads):
                rows.append(_row(identity, score, value, split="head", layer=layer, head=head))
    return rows


def sink_rows(sinks: Mapping[str, Any] | None, identity: Mapping[str, Any], level: float | None) -> list[dict[str, Any]]:
    """A probe result's attention-sink rows (Gu et al., ICLR 2025), from the ``sinks`` block of its
    :meth:`~equivariance_probe.result.ProbeResult.summary` (a loaded result reads no array for it): ``sink_rate``
    (Gu et al.'s per-window rate: the share of (window, layer, head) triples whose first-token weight is above the
    summary's ``epsilon``) for the model, with its interval at ``level`` where the result has one, and per layer;
    ``pooled_sink_rate`` (the share of heads whose window-averaged weight is above it) in the same splits, the only
    rate of a file written before each window's weight was kept; ``first_token_weight`` (``α₁``) for the model and
    per head. None for a result that keeps no first-token sums."""
    if not sinks or "unavailable" in sinks:
        return []
    rows = []
    for name, key in (("sink_rate", "rate"), ("pooled_sink_rate", "pooled_rate")):
        if sinks.get(key) is None:  # a file written before each window's first-token weight was kept
            continue
        bounds = sinks.get(f"{key}_interval")
        interval = ({"low": bounds[0], "high": bounds[1], "level": level} if bounds is not None else {})
        rows.append(_row(identity, name, sinks[key], **interval, unit="share of heads"))
        rows += [_row(identity, name, value, split="layer", layer=layer, unit="share of heads")
                 for layer, value in enumerate(sinks.get(f"{key}_by_layer") or [])]
    rows.append(_row(identity, "first_token_weight", sinks["mean_weight"], unit="attention weight"))
    rows += [_row(identity, "first_token_weight", value, split="head", layer=layer, head=head, unit="attention weight")
             for layer, heads in enumerate(sinks.get("weight_by_head") or []) for head, value in enumerate(heads)]
    return rows


def position_probe_rows(probe: Any, identity: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A :class:`~equivariance_probe.PositionProbe`'s rows, from its own intervals
    (:meth:`~equivariance_probe.PositionProbe.interval`): ``probe_r2_{target}`` (held-out R²) and
    ``probe_mae_{target}`` (held-out mean absolute distance, in tokens) per layer (layer 0 the embeddings), each
    pooled over the held-out rows with its jackknife interval over groups of documents; a probe written before
    those intervals existed gives its scores without bounds."""
    rows = []
    for target in probe.r2:  # the probe's targets, in its order (PROBE_TARGETS)
        for score, unit in (("r2", "R²"), ("mae", "tokens")):
            try:
                interval = probe.interval(target, score)
            except IntervalUnavailableError:
                estimate = np.asarray(probe.score(target, score), dtype=np.float64)
                rows += [_row(identity, f"probe_{score}_{target}", value, split="layer", layer=layer, unit=unit)
                         for layer, value in enumerate(estimate)]
                continue
            bounds = [np.asarray(getattr(interval, key), dtype=np.float64) for key in ("estimate", "low", "high")]
            for layer, (value, low, high) in enumerate(zip(*bounds)):
                rows.append(_row(identity, f"probe_{score}_{target}", value, split="layer", layer=layer, low=low,
                                 high=high, level=interval.level, unit=unit))
    return rows


def shift_identity(metadata: Mapping[str, Any], summary: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The identifying columns of a :class:`~equivariance_probe.shift_result.ShiftResult`'s rows."""
    study = metadata.get("study") if isinstance(metadata.get("study"), Mapping) else {}
    run_ids = metadata.get("run_ids") or ([metadata["run_id"]] if metadata.get("run_id") else [])
    return {"kind": "shift", "model": model, "variant": study.get("variant"),
            "run_id": ",".join(map(str, run_ids)) or None, "mode": summary.get("mode"),
            "dtype": (metadata.get("model") or {}).get("dtype") if isinstance(metadata.get("model"), Mapping) else None}


def _estimate(value: Any) -> dict[str, Any]:
    """A summary's number (plain, or an interval's dict) as ``value``/``low``/``high``/``level``."""
    if isinstance(value, Mapping):
        return {"value": value.get("estimate"), "low": value.get("low"), "high": value.get("high"),
                "level": value.get("level")}
    return {"value": value}


def shift_rows(summary: Mapping[str, Any], identity: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The long-form rows of a shift result's :meth:`~equivariance_probe.shift_result.ShiftResult.summary`.

    Per representation: ``offset_eta2``, ``context_eta2``, ``pair_eta2`` (shares of its variance, with
    intervals over segments) and ``offset_rms`` (in the representation's unit) for the model;
    ``offset_eta2`` per layer and per layer group. Predictions: ``loss`` per offset (nats),
    ``js_offset``, ``js_context``, ``js_ratio``. Sink mass: ``sink_first_key``, ``sink_preceding`` and
    ``sink_segment`` per offset (mean attention weight), for the model and per layer group. Massive
    activations: ``massive_first``, ``massive_rest``, ``massive_median`` (residual magnitudes) and
    ``massive_first_ratio``, ``massive_rest_ratio`` per block (``layer``) and offset.
    Attribution: ``attribution_offset`` and ``attribution_context`` per target block (``layer``: the block
    after which the residual stream is split, not the component's own, which its name says) and component,
    each a share of that residual stream's sum of squares.
    Patching: ``patch_recovered`` and ``patch_residual_removed`` per patched item (``component``).
    """
    if not summary.get("n_segments"):
        return []
    rows = []
    for rep, numbers in summary.get("representations", {}).items():
        where = {"representation": rep}
        for name, value in numbers.items():
            if name.endswith("_eta2"):
                rows.append(_row(identity, name, **_estimate(value), unit="share of variance", **where))
        rows.append(_row(identity, "offset_rms", **_estimate(numbers.get("offset_rms")), unit=numbers.get("unit"),
                         **where))
        for layer, value in enumerate(numbers.get("offset_eta2_by_layer") or []):
            rows.append(_row(identity, "offset_eta2", value, split="layer", layer=layer, unit="share of variance",
                             **where))
        for group, value in (numbers.get("offset_eta2_by_layer_group") or {}).items():
            if group != "all":
                rows.append(_row(identity, "offset_eta2", value, split="layer_group", layer_group=group,
                                 unit="share of variance", **where))
    predictions = summary.get("predictions") or {}
    if predictions:
        loss = _estimate(predictions.get("loss_by_offset"))
        for i, offset in enumerate(summary.get("offsets", [])):
            picked = {key: (value[i] if isinstance(value, Sequence) else value) for key, value in loss.items()}
            rows.append(_row(identity, "loss", **picked, offset=offset, unit="nats"))
        for name in ("js_offset", "js_context", "js_ratio"):
            rows.append(_row(identity, name, **_estimate(predictions.get(name)),
                             unit="ratio" if name == "js_ratio" else "nats"))
    sink = summary.get("sink_mass") or {}
    offsets = summary.get("offsets", [])
    for part in (("first_key", "preceding", "segment") if sink else ()):
        model, groups = _estimate(sink.get(part)), (sink.get("by_layer_group") or {}).get(part) or {}
        for i, offset in enumerate(offsets):
            picked = {key: (value[i] if isinstance(value, Sequence) else value) for key, value in model.items()}
            rows.append(_row(identity, f"sink_{part}", **picked, offset=offset, unit="attention weight"))
            for group, values in groups.items():
                rows.append(_row(identity, f"sink_{part}", values[i], split="layer_group", layer_group=group,
                                 offset=offset, unit="attention weight"))
    return rows + _massive_rows(summary, identity) + _attribution_rows(summary, identity) + _patching_rows(summary, identity)


def _massive_rows(summary: Mapping[str, Any], identity: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The residual stream's largest magnitudes at the segment per block and offset, from the summary's
    ``massive_activations`` (``{part: [layer][offset]}``, each plain or an interval's dict of them)."""
    massive = summary.get("massive_activations") or {}
    rows = []
    for part in (("first", "rest", "median", "first_ratio", "rest_ratio") if massive else ()):
        numbers = _estimate(massive.get(part))
        unit = "ratio" if part.endswith("_ratio") else "residual magnitude"
        for i, offset in enumerate(summary.get("offsets", [])):
            for layer in range(len(numbers["value"] or ())):
                picked = {key: (value[layer][i] if isinstance(value, Sequence) else value)
                          for key, value in numbers.items()}
                rows.append(_row(identity, f"massive_{part}", **picked, split="layer", layer=layer, offset=offset,
                                 unit=unit))
    return rows


def _attribution_rows(summary: Mapping[str, Any], identity: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each component's share of the residual stream's offset (and context) sum of squares after each target
    block, from the summary's ``attribution``: ``{term: {layer: {component: share}}}``."""
    attribution = summary.get("attribution") or {}
    rows = []
    for term in ("offset", "context"):
        for layer, shares in (attribution.get(term) or {}).items():
            for component, share in shares.items():
                rows.append(_row(identity, f"attribution_{term}", **_estimate(share), split="component",
                                 layer=int(layer), component=component, unit="share of sum of squares"))
    return rows


def _patching_rows(summary: Mapping[str, Any], identity: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per patched item, the share of the prediction change it recovers and of the last block's residual
    offset sum of squares it removes, from the summary's ``patching``."""
    rows = []
    for item in (summary.get("patching") or {}).get("items") or ():
        for measure in ("recovered", "residual_removed"):
            if measure in item:
                rows.append(_row(identity, f"patch_{measure}", **_estimate(item[measure]), split="component",
                                 layer=item.get("layer"), head=item.get("head"), component=item["component"],
                                 unit="share"))
    return rows


def positional_rows(summary: Mapping[str, Any], identity: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The long-form rows of a positional study's :meth:`~equivariance_probe.runs.positional.PositionalStudy.summary`.

    ``gram_r2_whole`` / ``gram_r2_off_diagonal`` for the model; ``attention_toeplitz_mean_pattern`` /
    ``attention_toeplitz_per_window`` per head; ``positional_logits_toeplitz_r2`` per head of layer 0;
    ``tisa_r2_{mean,median,min,max}`` over heads; ``permutation_{measure}`` per ablation (``mode``);
    ``shrinkage_{stream}`` and ``correlation_mean_off_diagonal`` per layer, the random-init
    baseline's as variant ``random_init``, without intervals (those analyses compute none);
    the position probes' rows come from :func:`position_probe_rows` (the study's :meth:`to_rows` adds them);
    ``massive_top{i}``, ``massive_median``, ``massive_ratio``, ``massive_position`` and
    ``massive_dimension`` per layer (Sun et al.'s massive activations).
    """
    rows = []
    trained = {**identity, "variant": "trained"}
    baseline = {**identity, "variant": "random_init"}
    if "gram" in summary:
        for name in ("r2_whole", "r2_off_diagonal"):
            rows.append(_row(trained, f"gram_{name}", summary["gram"][name]))
    for which in ("mean_pattern", "per_window"):
        per_head = (summary.get("attention_toeplitz") or {}).get(which, {}).get("per_head") or []
        for layer, heads in enumerate(per_head):
            for head, value in enumerate(heads):
                rows.append(_row(trained, f"attention_toeplitz_{which}", value, split="head", layer=layer, head=head))
    for head, value in enumerate((summary.get("positional_logits") or {}).get("per_head") or []):
        rows.append(_row(trained, "positional_logits_toeplitz_r2", value, split="head", layer=0, head=head))
    for stat in ("mean", "median", "min", "max"):
        if "tisa" in summary:
            rows.append(_row(trained, f"tisa_r2_{stat}", summary["tisa"][stat]))
    for ablation, measures in (summary.get("permutation") or {}).items():
        for measure, value in measures.items():
            rows.append(_row({**trained, "mode": ablation}, f"permutation_{measure}", value))
    for key, who in (("shrinkage", trained), ("shrinkage_baseline", baseline)):
        for stream, values in (summary.get(key) or {}).items():
            for layer, value in enumerate(values):
                rows.append(_row(who, f"shrinkage_{stream}", value, split="layer", layer=layer))
    for key, who in (("correlation", trained), ("correlation_baseline", baseline)):
        for layer, value in enumerate((summary.get(key) or {}).get("mean_off_diagonal_by_layer") or []):
            rows.append(_row(who, "correlation_mean_off_diagonal", value, split="layer", layer=layer))
    for key, who in (("massive", trained), ("massive_baseline", baseline)):
        massive = summary.get(key) or {}
        for layer, top in enumerate(massive.get("top") or []):
            values = {f"massive_top{i + 1}": value for i, value in enumerate(top)}
            values |= {f"massive_{name}": massive[name][layer] for name in ("median", "ratio", "position", "dimension")}
            for statistic, value in values.items():
                rows.append(_row(who, statistic, value, split="layer", layer=layer))
    return rows
