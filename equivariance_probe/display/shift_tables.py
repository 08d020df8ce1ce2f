"""The shift test's numbers as HTML tables for its report: one table per kind of number, a column per variant,
long tables with their largest rows first and the rest folded under ``<details>``.

Place in the seams: *display*, below :mod:`~equivariance_probe.display.shift`. The numbers are the result's own
tidy rows (:meth:`~equivariance_probe.ShiftResult.to_rows`, the rows of ``to_dataframe()`` and ``show --csv``),
so the page, the data frame and the CSV say the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ..markup import Markup
from ..maths.intervals import format_interval
from ..shift_result import ShiftResult
from ..statistics.shift import REPRESENTATION_LABELS
from .report import folded_table_html, table_html

__all__ = ["shift_tables_html", "STATISTIC_NAMES"]

#: What each statistic of the tidy rows is, in words.
STATISTIC_NAMES = {
    "offset_eta2": "offset η²",
    "context_eta2": "context η²",
    "pair_eta2": "pair η² (the equivariant part)",
    "offset_rms": "offset RMS",
    "loss": "next-token loss (nats)",
    "js_offset": "Jensen–Shannon divergence between offsets (nats)",
    "js_context": "Jensen–Shannon divergence between contexts (nats)",
    "js_ratio": "their ratio, offsets over contexts",
    "sink_first_key": "on the window's first key",
    "sink_preceding": "on the rest of the text before the segment",
    "sink_segment": "on the segment itself",
    "attribution_offset": "offset sum of squares",
    "attribution_context": "context sum of squares",
    "patch_recovered": "share of the prediction change recovered",
    "patch_residual_removed": "share of the last block's residual offset sum of squares removed",
}


class _Table(NamedTuple):
    """One table of the report: its heading, which rows it holds, and whether it is long enough to sort and fold."""

    title: str
    holds: Callable[[dict[str, Any]], bool]
    fold: bool


_TABLES = (
    _Table("Shares of each representation's variation, and how far the offset moves it",
           lambda row: row["split"] == "model" and row["representation"] is not None, fold=False),
    _Table("Offset η² by layer group", lambda row: row["statistic"] == "offset_eta2" and row["split"] == "layer_group",
           fold=False),
    _Table("Offset η² by layer", lambda row: row["statistic"] == "offset_eta2" and row["split"] == "layer", fold=True),
    _Table("Predictions: loss by offset and divergences",
           lambda row: row["statistic"] == "loss" or row["statistic"].startswith("js_"), fold=False),
    _Table("Attention before the segment (mean weight of its rows), by offset",
           lambda row: row["statistic"].startswith("sink_"), fold=True),
    _Table("Attribution: each component's share of the residual stream's sums of squares after a block",
           lambda row: row["statistic"].startswith("attribution_"), fold=True),
    _Table("Activation patching, per patched item", lambda row: row["statistic"].startswith("patch_"), fold=True),
)


def _label(row: Mapping[str, Any]) -> tuple[str, str]:
    """``(group, what)`` of a row: its statistic and representation, then where it lies (layer, offset, item)."""
    statistic = STATISTIC_NAMES.get(row["statistic"], row["statistic"])
    if row["statistic"].startswith("attribution_"):
        return f"{statistic} after block {row['layer']}", str(row["component"])
    if row["statistic"].startswith("patch_"):
        return statistic, str(row["component"])
    representation = REPRESENTATION_LABELS.get(row["representation"], row["representation"])
    where = [f"layer {row['layer']}" if row["layer"] is not None else None,
             f"layers: {row['layer_group']}" if row["layer_group"] is not None else None,
             f"offset {row['offset']}" if row["offset"] is not None else None]
    place = ", ".join(part for part in where if part)
    if row["statistic"] == "offset_eta2" and row["split"] != "model":
        return representation, place
    if representation:
        return representation, statistic + (f" ({row['unit']})" if row["statistic"] == "offset_rms" else "")
    return statistic, place


def _cell(row: Mapping[str, Any] | None) -> str:
    if row is None or row["value"] is None:
        return "—"
    if row["low"] is None or row["high"] is None:
        return "n/a" if not math.isfinite(float(row["value"])) else f"{float(row['value']):.4f}"
    return format_interval(row["value"], row["low"], row["high"])


def _size(row: Mapping[str, Any] | None) -> float:
    """How large a row's number is, for the order largest first (undefined numbers last)."""
    if row is None or row["value"] is None or not math.isfinite(float(row["value"])):
        return -math.inf
    return abs(float(row["value"]))


def shift_tables_html(variants: Mapping[str, ShiftResult], *, shown: int = 10) -> Markup:
    """Every number of the variants' tidy rows in :data:`_TABLES`' tables, a column per variant; a long table's
    rows ordered by the first variant's magnitude, largest first, the rows after ``shown`` folded."""
    rows = {name: result.to_rows() for name, result in variants.items()}
    first = next(iter(variants))
    parts = []
    for table in _TABLES:
        cells: dict[tuple[str, str], dict[str, Any]] = {}
        for name, variant_rows in rows.items():
            for row in variant_rows:
                if table.holds(row):
                    cells.setdefault(_label(row), {})[name] = row
        if not cells:
            continue
        keys: Sequence[tuple[str, str]] = list(cells)
        folded = table.fold and len(keys) > shown
        if folded:
            keys = sorted(keys, key=lambda key: _size(cells[key].get(first)), reverse=True)
        body = [(group, what, [_cell(cells[(group, what)].get(name)) for name in variants]) for group, what in keys]
        order = (Markup("<p>{} rows, largest first ({}'s magnitude); the first {} shown.</p>").format(
            len(keys), first, shown) if folded else Markup(""))
        html = folded_table_html(list(variants), body, "shift", shown=shown) if folded else table_html(
            list(variants), body, "shift")
        parts.append(Markup("<h3>{}</h3>{}{}").format(table.title, order, html))
    return Markup("").join(parts)
