"""Text tables of results: headline numbers side by side, paired differences, windows needed.

Place in the seams: *runs*, above :mod:`~equivariance_probe.result`. The tables read
:meth:`~equivariance_probe.result.ProbeResult.summary` dicts (what a result file's header stores,
so a loaded file prints without its arrays) and, for differences, the results themselves
(:func:`~equivariance_probe.result.paired_differences`). A cell is a number, ``0.0157 [0.0143,
0.0171]`` where the summary stores its interval, ``undefined (encoder)`` for a form a result names
undefined, ``–`` where a model has no such layer group.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Any

import numpy as np

from ..errors import IncompatibleResultsError, IntervalUnavailableError
from ..maths import fitting, metrics
from ..maths.intervals import format_interval, is_undefined, windows_for_half_width
from ..maths.sinks import SINK_EPSILON
from ..result import DIFFERENCE_STATISTICS, SUMMARY_LEVEL, TARGET_HALF_WIDTH, ProbeResult, paired_differences
from ..shift_result import check_verdict, number_cell

__all__ = ["csv_text", "summary_table", "summary_rows", "difference_table", "paired_rows", "windows_needed_text", "summary_value",
           "interval_bounds", "row_cell", "markdown_table", "shift_table", "SHIFT_COLUMNS",
           "SHIFT_COLUMN_READINGS", "shift_column_readings", "shift_result_readings"]


def csv_text(rows: list[dict[str, Any]]) -> str:
    """``rows`` (dicts with the same keys, the first row's order) as CSV text with a header line."""
    stream = io.StringIO(newline="")
    writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return stream.getvalue()


def summary_table(summaries: dict[str, dict[str, Any]], *, extended: bool = False) -> str:
    """Markdown table of :meth:`ProbeResult.summary` dicts side by side, one column per label.

    Rows: query-position R² in every scale and form, the R² of each fit to ``P(dt)``, the mean
    per-window Toeplitz R², windows / tokens. ``extended`` adds the fits' parameters, Figure 1c
    (in how many key-position bins the parameter-free prior fits better than both two-parameter
    fits, and the range of its R²), the Toeplitz R² of the document-averaged pattern, the most and
    least position-bound heads and the floored entries.
    """
    return markdown_table(["scale", "form"], list(summaries), summary_rows(summaries, extended=extended))


def markdown_table(labels: list[str], columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """Markdown: the row labels' columns (``labels``), then one column per entry of ``columns``;
    each row is ``(*label cells, [one cell per column])``."""
    header = "|" + "|".join(f" {name} " if name else " " for name in [*labels, *columns]) + "|"
    lines = [header, "|" + "---|" * (len(labels) + len(columns))]
    lines += ["| " + " | ".join([*(str(cell) for cell in row[:-1]), *row[-1]]) + " |" for row in rows]
    return "\n".join(lines)


def summary_rows(summaries: dict[str, dict[str, Any]], *, extended: bool = False) -> list[tuple[str, str, list[str]]]:
    """The rows of :func:`summary_table`: ``(group, what, one cell per summary)``, cells as text."""
    rows: list[tuple[str, str, list[str]]] = []

    def row(group: str, what: str, cell) -> None:
        rows.append((group, what, [cell(summary) for summary in summaries.values()]))

    for scale in metrics.SCALES:
        for form in metrics.FORMS:
            row(scale, form, lambda s, scale=scale, form=form: _qpve_cell(s, scale, form))
    # Models with sliding-window and global layers: the same numbers over each group's entries
    # (the log scale; both scales in the extended table).
    groups = [g for g in ("sliding", "global") if any(g in (s.get("layer_groups") or {}) for s in summaries.values())]
    for group in groups:
        for scale in metrics.SCALES if extended else ("log",):
            for form in metrics.FORMS:
                row(f"{scale}, {group} layers", form,
                    lambda s, group=group, scale=scale, form=form: _group_number(s, group, ("query_position_r2", scale, form)))
    for fit in fitting.FIT_NAMES:
        row("P(dt)", f"{fit} fit R²", lambda s, fit=fit: _fit_r2(s, (), fit))
    if extended:
        row("P(dt)", "power fit c, α", lambda s: _parameters(s, "power", ("c", "alpha")))
        row("P(dt)", "exponential fit c, λ", lambda s: _parameters(s, "exponential", ("c", "lambda")))
        for group in groups:
            for fit in fitting.FIT_NAMES:
                row(f"P(dt), {group} layers", f"{fit} fit R²",
                    lambda s, group=group, fit=fit: _fit_r2(s, ("layer_groups", group), fit))
        row("P(dt) by key (Fig. 1c)", "key bins where the uniform prior fits better than both decays", _prior_best_bins)
        row("P(dt) by key (Fig. 1c)", "uniform prior's R², lowest … highest over key bins",
            lambda s: _spread(s.get("fit_r2_by_key_position", {}).get("prior")))
    row("Toeplitz", "mean per-window R²", lambda s: _with_interval(s, ("toeplitz_r2_per_doc_mean",)))
    if extended:
        row("Toeplitz", "document-averaged pattern R²",
            lambda s: "not kept" if is_undefined(s.get("toeplitz_r2_mean_pattern_mean")) else _number(s["toeplitz_r2_mean_pattern_mean"]))
        row("heads", "most position-bound (log η²)", lambda s: str(s["most_position_bound_head"]))
        row("heads", "least position-bound (log η²)", lambda s: str(s["least_position_bound_head"]))
    epsilon = _sink_epsilon(summaries)
    row("attention sinks", f"sink rate: share of (window, head) with α₁ > {epsilon:g} (Gu et al.)",
        lambda s: _sink_rate_cell(s, "rate"))
    row("attention sinks", f"pooled sink rate: share of heads with window-averaged α₁ > {epsilon:g}",
        lambda s: _sink_rate_cell(s, "pooled_rate"))
    if extended:
        row("attention sinks", "mean first-token weight α₁ over heads",
            lambda s: _sink_value(s, lambda sinks: _number(sinks["mean_weight"])))
        row("attention sinks", "first token", lambda s: _sink_value(s, lambda sinks: str(sinks["first_token"])))
    row("", "windows / tokens", lambda s: f"{s['n_windows']} / {s['n_tokens']}")
    if extended:
        row("", "floored entries (log scale)", lambda s: f"{s['floored_entries']} of {s['n_entries']:,}")
    return rows


def _sink_value(summary: dict[str, Any], cell: Any) -> str:
    """A cell of the attention-sink rows, or why a result has none (a file written before the sink sums)."""
    sinks = summary.get("sinks")
    if not sinks or "unavailable" in sinks:
        return "not kept (run again)"
    return cell(sinks)


def _sink_epsilon(summaries: dict[str, dict[str, Any]]) -> float:
    """The sink rates' threshold ``ε`` of the summaries (the first that says one; Gu et al.'s otherwise)."""
    found = [(s.get("sinks") or {}).get("epsilon") for s in summaries.values()]
    return next((float(e) for e in found if isinstance(e, (int, float))), SINK_EPSILON)


def _sink_rate_cell(summary: dict[str, Any], name: str) -> str:
    """``0.4375 [0.4062, 0.4688]``: a sink rate (``"rate"``, ``"pooled_rate"``) with its interval where the
    summary stores one; ``not kept (run again)`` for the per-window rate of a file written before it."""
    def cell(sinks: dict[str, Any]) -> str:
        if is_undefined(sinks.get(name)):
            return "not kept (run again)"
        bounds = sinks.get(f"{name}_interval")  # a list, or None (NaN once loaded: how JSON holds it) without intervals
        return format_interval(sinks[name], *bounds) if isinstance(bounds, list) else _number(sinks[name])

    return _sink_value(summary, cell)


def difference_table(results: dict[str, ProbeResult], reference: str = "trained", level: float = SUMMARY_LEVEL) -> str:
    """Markdown: one column ``reference − other`` per other result (:func:`paired_rows`), notes below."""
    rows, notes = paired_rows(results, reference, level)
    others = [name for name in results if name != reference]
    table = markdown_table(["scale", "form"], [f"{reference} − {name}" for name in others], rows)
    return "\n".join([table, "", *notes]) if notes else table


def paired_rows(results: dict[str, ProbeResult], reference: str = "trained",
                level: float = SUMMARY_LEVEL) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """Rows of the differences ``reference - other`` for every other result, and notes on those without one.

    Returns:
        ``(rows, notes)``: rows ``(group, what, one cell per other result)`` over
        :data:`DIFFERENCE_STATISTICS` (cells ``-0.1935 [-0.2060, -0.1810]``, ``n/a`` where undefined),
        and one line per other result whose differences have no interval, saying why.
    """
    others = {name: result for name, result in results.items() if name != reference}
    base = results[reference]
    cells: dict[str, list[str]] = {}
    notes: list[str] = []
    for name, other in others.items():
        try:
            differences = paired_differences(base, other, level)
        except (IntervalUnavailableError, IncompatibleResultsError) as error:
            notes.append(f"{reference} − {name}: no interval ({error})")
            cells[name] = ["n/a"] * len(DIFFERENCE_STATISTICS)
            continue
        cells[name] = [format_interval(d.estimate, d.low, d.high) for d in differences.values()]
    rows = []
    for index, statistic in enumerate(DIFFERENCE_STATISTICS):
        if statistic.endswith("_fit"):
            group, what = "P(dt)", f"{statistic[:-4]} fit R²"
        elif statistic == "toeplitz_per_doc":
            group, what = "Toeplitz", "mean per-window R²"
        else:
            group, what = statistic.split("_")
        rows.append((group, what, [cells[name][index] for name in others]))
    return rows, notes


def windows_needed_text(summary: dict[str, Any], half_width: float = TARGET_HALF_WIDTH,
                        path: tuple[str, ...] = ("query_position_r2", "log", "fitted")) -> str:
    """What a summary's interval of one number says of the windows needed for ``±half_width``.

    ``n·(h/half_width)²`` windows from the ``±h`` reached with ``n`` (the standard error falls as
    ``1/√n``); read from the stored summary, so it works on a loaded file's header.
    """
    what = " ".join(path[1:]) + " R²" if path[0] == "query_position_r2" else " ".join(path)
    intervals = summary.get("intervals") or {}
    bounds = summary_value(intervals, path)
    if not isinstance(bounds, list) or len(bounds) != 2 or any(is_undefined(b) for b in bounds):
        reason = intervals.get("unavailable", "no interval stored")
        return f"{what}: no interval, so no estimate of the windows needed ({reason})"
    n_windows = summary["n_windows"]
    # An R² interval clipped at 1 keeps its lower side whole: that side is the ±.
    estimate = summary_value(summary, path)
    reached = (bounds[1] - bounds[0]) / 2
    if isinstance(estimate, (int, float)) and not is_undefined(estimate):
        reached = max(reached, float(estimate) - bounds[0])
    needed = windows_for_half_width(n_windows, reached, half_width)
    return (f"{what}: ±{reached:.4f} at {intervals['level']:.0%} from {n_windows} windows in {intervals['groups']} groups; "
            f"±{half_width:g} needs about {math.ceil(needed)} windows (the interval narrows as 1/√windows)")


def summary_value(tree: Any, path: tuple[str, ...]) -> Any:
    """``tree[path[0]][path[1]]...`` (a summary's number, or its interval in ``summary["intervals"]``),
    ``None`` where a key is missing."""
    for key in path:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def _number(value: Any) -> str:
    return "n/a" if is_undefined(value) else f"{value:.4f}"


def _qpve_cell(summary: dict[str, Any], scale: str, form: str) -> str:
    """A query-position R² with its interval, or ``undefined (encoder)`` for a form the summary names undefined."""
    if f"query_position_r2.{form}" in (summary.get("undefined") or {}):
        return "undefined (encoder)"
    return _with_interval(summary, ("query_position_r2", scale, form))


def interval_bounds(intervals: Any, path: tuple[str, ...]) -> tuple[float | None, float | None]:
    """``(low, high)`` of the interval a summary's ``intervals`` block stores at ``path``, ``(None, None)`` if none."""
    bounds = summary_value(intervals, path)
    if isinstance(bounds, list) and len(bounds) == 2 and all(b is not None for b in bounds):
        return float(bounds[0]), float(bounds[1])
    return None, None


def row_cell(row: dict[str, Any], column: str, missing: str = "–") -> str:
    """A table row's number with its interval where the row holds ``{column}_low`` and ``_high``
    (``0.0379 [0.0351, 0.0407]``); ``missing`` where the row has no such number, ``n/a`` where it is NaN."""
    value = row.get(column)
    if value is None:
        return missing
    if not math.isfinite(value):
        return "n/a"
    if row.get(f"{column}_low") is None:
        return f"{value:.4f}"
    return format_interval(value, row[f"{column}_low"], row[f"{column}_high"])


def _with_interval(summary: dict[str, Any], path: tuple[str, ...]) -> str:
    """A summary's number, with its interval where the summary stores one (``0.0157 [0.0143, 0.0171]``)."""
    value = summary_value(summary, path)
    bounds = summary_value(summary.get("intervals"), path)
    if isinstance(bounds, list) and len(bounds) == 2 and not is_undefined(value):
        return format_interval(value, *bounds)
    return _number(value)


def _group_number(summary: dict[str, Any], group: str, path: tuple[str, ...]) -> str:
    """A layer group's number from a summary (with its interval), ``–`` where the model has no such group."""
    if summary_value(summary, ("layer_groups", group, *path)) is None:
        return "–"
    return _with_interval(summary, ("layer_groups", group, *path))


def _fit_r2(summary: dict[str, Any], where: tuple[str, ...], fit: str) -> str:
    """A fit's R² (with its interval), said as no decay where the fit sits on its bound and as no fit where it failed."""
    if where and summary_value(summary, (*where, "persistence_fit_r2")) is None:
        return "–"  # the model has no such layer group
    if where:
        status = (summary_value(summary, (*where, "persistence_fit_status")) or {}).get(fit, "ok")
    else:
        status = ((summary.get("persistence_fits") or {}).get(fit) or {}).get("status", "ok")
    if status == "failed":
        return "no fit"
    cell = _with_interval(summary, (*where, "persistence_fit_r2", fit))
    return f"{cell} (no decay: at its bound)" if status == "at_bound" else cell


def _parameters(summary: dict[str, Any], fit: str, names: tuple[str, ...]) -> str:
    fits = summary.get("persistence_fits")
    if not fits:
        return "–"
    entry = fits[fit]
    # Files written before fits had a status hold unbounded fits: their parameters are shown as they are.
    status, note = entry.get("status", "ok"), entry.get("note", "")
    if status == "failed":
        return f"no fit ({note})" if note else "no fit"
    cell = ", ".join("n/a" if is_undefined(entry["params"].get(n)) else f"{entry['params'][n]:.4g}" for n in names)
    return f"{cell} (at its bound: {note})" if status == "at_bound" else cell


def _prior_best_bins(summary: dict[str, Any]) -> str:
    by_key = summary.get("fit_r2_by_key_position")
    if not by_key:
        return "–"
    prior, power, exponential = (np.asarray(by_key[n], dtype=np.float64) for n in ("prior", "power", "exponential"))
    defined = np.isfinite(prior)
    best = defined & (prior > np.where(np.isfinite(power), power, -np.inf)) & (prior > np.where(np.isfinite(exponential), exponential, -np.inf))
    return f"{int(best.sum())} of {int(defined.sum())} bins"


def _spread(values: Any) -> str:
    if values is None:
        return "–"
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    return "n/a" if finite.size == 0 else f"{finite.min():.3f} … {finite.max():.3f}"


#: The columns of :func:`shift_table`: a header and where its number lies in a
#: :meth:`~equivariance_probe.ShiftResult.summary` (``None``: computed from several).
SHIFT_COLUMNS: dict[str, tuple[str, ...] | None] = {
    "mode": ("mode",),
    "segments × contexts × offsets": None,
    "centred logits: offset η²": ("representations", "centred_logits", "offset_eta2"),
    "context η²": ("representations", "centred_logits", "context_eta2"),
    "pair η²": ("representations", "centred_logits", "pair_eta2"),
    "offset RMS (nats)": ("representations", "centred_logits", "offset_rms"),
    "residual: offset η²": ("representations", "residual", "offset_eta2"),
    "residual: context η²": ("representations", "residual", "context_eta2"),
    "loss at the first offset / the others (nats)": None,
    "JS between offsets": ("predictions", "js_offset"),
    "JS between contexts": ("predictions", "js_context"),
    "JS ratio": ("predictions", "js_ratio"),
    "layer-0 check": None,
}

#: A plain reading of each column of :func:`shift_table`, printed under it (definitions: docs/methods.md#shift-test).
SHIFT_COLUMN_READINGS: dict[str, str] = {
    "mode": "text: the segment follows other text, and moving it moves that text too; position_ids: the segment "
            "alone, only its position ids moved",
    "segments × contexts × offsets": "the grid: texts moved, texts placed before them, places in the window",
    "centred logits: offset η²": "the share of the variation of the segment's attention logits among its own tokens "
                                 "(each query's row mean removed) that moves with the offset alone; 0: attention "
                                 "within the text does not depend on where the text sits",
    "context η²": "the share that changes with which text precedes the segment",
    "pair η²": "the share that depends only on which two tokens of the text (query and key) are involved, the same "
               "at every offset and after every context: the translation-equivariant part (1: fully equivariant); "
               "the shares and an interaction term add up to 1",
    "offset RMS (nats)": "how large the offset's effect on a centred logit is: its root mean square, in nats (the "
                         "log-attention scale), since a share hides a small total",
    "residual: offset η²": "the same share for the residual stream (the hidden state after each block, every "
                           "dimension of every segment token); its values are in the model's own hidden-state "
                           "scale ('residual-stream units'), which differs from model to model, so only shares "
                           "compare across models",
    "residual: context η²": "the residual stream's share that changes with the preceding text",
    "loss at the first offset / the others (nats)": "the mean next-token loss on the segment at the first offset, "
                                                    "and its range over the other offsets",
    "JS between offsets": "the mean Jensen–Shannon divergence (nats, at most ln 2) between the next-token "
                          "distributions of the same text at two offsets after the same context",
    "JS between contexts": "the same between two preceding texts at one offset",
    "JS ratio": "offsets over contexts: how many times as much moving the text changes its predictions as "
                "changing what precedes it",
    "layer-0 check": "with rotary positions layer 0's offset η² is zero up to rounding; the value and whether it "
                     "passed its dtype's tolerance (not judged without rotary positions)",
}


def shift_result_readings() -> str:
    """The lines printed under :meth:`ShiftResult.table`'s columns (its shares per representation and offset
    RMS in each representation's unit), read as :data:`SHIFT_COLUMN_READINGS` reads the study's table."""
    readings = SHIFT_COLUMN_READINGS
    return "\n".join([
        "Columns: per representation, shares of the variation of the segment's values (η², with 95 % intervals over "
        "segments) and the offset's effect in the representation's own unit.",
        "- offset η²: the share that moves with the offset alone (0: where the text sits changes nothing)",
        f"- context η²: {readings['context η²']}",
        f"- pair η²: {readings['pair η²']}",
        "- offset RMS: the offset's effect as a root mean square, in the unit printed at the row's end: nats for the "
        "centred logits, attention weight for the weights, and for the residual stream the model's own hidden-state "
        "scale ('residual-stream units'), which differs from model to model",
    ])


def shift_column_readings() -> str:
    """The lines printed under a :func:`shift_table`: each column's name and its plain reading
    (:data:`SHIFT_COLUMN_READINGS`); '–' marks what a run did not measure, 'undefined' a share whose
    total is zero."""
    lines = [f"- {column}: {reading}" for column, reading in SHIFT_COLUMN_READINGS.items()]
    return "\n".join(["Columns:", *lines, "Cells: estimate [95 % interval over segments]; '–' not measured by this "
                       "run; 'undefined' a share whose total is zero."])


def shift_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Markdown table of :meth:`~equivariance_probe.ShiftResult.summary` dicts, one row per label (e.g.
    ``"gemma-3-270m float32 / trained"``), one column per :data:`SHIFT_COLUMNS` entry: the shares of the centred
    logits and of the residual stream, the size of the offset effect, the loss and divergences of the predictions,
    and the built-in check. Cells hold ``estimate [low, high]`` where the summary has an interval, ``undefined``
    for a share whose total is zero, ``–`` for what a run did not measure (no predictions; no contexts in
    ``position_ids`` mode)."""
    rows = []
    for label, summary in summaries.items():
        cells = []
        for column, path in SHIFT_COLUMNS.items():
            if column == "segments × contexts × offsets":
                cells.append(f"{summary['n_segments']} × {summary['n_contexts']} × {len(summary['offsets'])}")
            elif column.startswith("loss at"):
                loss = (summary.get("predictions") or {}).get("loss_by_offset")
                estimates = loss.get("estimate") if isinstance(loss, dict) else loss
                cells.append("–" if not estimates else
                             f"{estimates[0]:.3f} / {min(estimates[1:]):.3f}–{max(estimates[1:]):.3f}")
            elif column == "layer-0 check":
                check = summary.get("check") or {}
                cells.append("–" if not check else f"{number_cell(check.get('value'))} ({check_verdict(check)})")
            else:
                value = summary_value(summary, path)
                cells.append(value if isinstance(value, str) else "–" if value is None and _absent(summary, path)
                             else number_cell(value))
        rows.append((label, cells))
    return markdown_table([""], list(SHIFT_COLUMNS), rows)


def _absent(summary: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether ``path`` names something the run did not measure (rather than a share that is undefined)."""
    if path[0] == "predictions":
        return "predictions" not in summary
    return path[-1] == "context_eta2" and summary.get("mode") == "position_ids"
