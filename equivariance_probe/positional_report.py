"""The HTML section of the positional analyses (issue 6), self-contained (figures as base64 PNG).

:func:`render_positional_section` returns a ``<section>`` for the study report
(:mod:`equivariance_probe.report` inserts it when a ``positional.json`` lies beside the
results file); :func:`render_positional_page` wraps it in a standalone page.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import numpy as np

from .report import ReportSection, figures_html, html_page

if TYPE_CHECKING:  # pragma: no cover
    from .positional_study import PositionalStudy

__all__ = ["positional_report_section", "render_positional_body", "render_positional_section", "render_positional_page"]


def _number(value: float) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _title(study: PositionalStudy) -> str:
    return f"Where order comes from: {study.metadata.get('model', '?')}"


def render_positional_body(study: PositionalStudy) -> str:
    """The section's body (no heading): a table per analysis and every figure, embedded."""
    summary = study.summary()
    blocks = [f"<p>Conventions: {html.escape(str(study.metadata.get('conventions', '')))}.</p>"]
    if "gram" in summary:
        gram = summary["gram"]
        blocks.append("<h3>Position-embedding Gram matrix</h3>" + _table(
            ["positions", "offset rows dropped", "Toeplitz R² (whole, diagonal included)", "Toeplitz R² (diagonal excluded)"],
            [[str(gram["n_positions"]), str(gram["offset"]), _number(gram["r2_whole"]), _number(gram["r2_off_diagonal"])]]))
    for key, title in (("positional_logits", "Layer-0 positional logits, Toeplitz R² per head"),
                       ("tisa", "TISA kernel fits to mean pre-softmax score profiles, R² over heads")):
        if key in summary:
            s = summary[key]
            blocks.append(f"<h3>{title}</h3>" + _table(["mean", "median", "min", "max"],
                                                        [[_number(s[k]) for k in ("mean", "median", "min", "max")]]))
    if "permutation" in summary:
        rows = [[html.escape(name)] + [_number(v[k]) for k in ("kl_mean", "kl_max", "tv_mean", "hidden_change_mean", "effect", "upper_mass")]
                for name, v in summary["permutation"].items()]
        blocks.append("<h3>Permutation sensitivity</h3>" + _table(
            ["ablation", "mean KL", "max KL", "mean TV", "mean ‖Δh‖/‖h‖", "max |Δlogit| vs none (unpermuted)", "max mass on later keys"], rows))
    if "shrinkage" in summary:
        rows = []
        for key, label in (("shrinkage", "trained"), ("shrinkage_baseline", "untrained")):
            for stream, values in summary.get(key, {}).items():
                rows.append([label, stream, ", ".join(_number(v) for v in values)])
        blocks.append("<h3>Variance shrinkage: exponent γ per layer</h3>" + _table(["model", "stream", "γ by layer"], rows))
    if "correlation" in summary:
        rows = [[label, ", ".join(_number(v) for v in summary[key]["mean_off_diagonal_by_layer"])]
                for key, label in (("correlation", "trained"), ("correlation_baseline", "untrained")) if key in summary]
        blocks.append("<h3>Position correlations: mean over i ≠ j per layer</h3>" + _table(["model", "by layer"], rows))
    if study.skipped:
        blocks.append("<p>Skipped: " + "; ".join(f"{html.escape(k)} ({html.escape(v)})" for k, v in study.skipped.items()) + "</p>")
    return "".join(blocks) + figures_html(study.figures())


def positional_report_section(study: PositionalStudy) -> ReportSection:
    """The study report's section for ``study``."""
    return ReportSection(title=_title(study), html=render_positional_body(study))


def render_positional_section(study: PositionalStudy) -> str:
    """One ``<section class="positional">`` element: heading, tables, figures."""
    return f'<section class="positional"><h2>{html.escape(_title(study))}</h2>{render_positional_body(study)}</section>'


def render_positional_page(study: PositionalStudy) -> str:
    """A standalone HTML page holding only the positional section."""
    return html_page(f"equivariance_probe positional analyses: {study.metadata.get('model', '?')}",
                     render_positional_section(study))
