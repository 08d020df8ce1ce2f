"""The comparison on screen: every model's persistence curve and headline R² side by side, and
one report per model with its trained weights beside its baselines.

Place in the seams: *display*, drawing only, from a
:class:`~equivariance_probe.runs.compare.Comparison`'s results; matplotlib is imported when a
figure is drawn (through :mod:`equivariance_probe.display.figures`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .figures import figure_paths, figure_title, log_log_axes, pyplot, save_figures
from .report import figures_html, html_page, render_report

from ..markup import Markup
from ..records.fileformat import write_text_atomically
from ..runs.compare import model_folders

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..runs.compare import Comparison

__all__ = ["comparison_figure", "comparison_page", "save_comparison"]

#: The bars of the right panel: (row key of Comparison.rows, label).
_BARS = (("log_fitted", "QPVE log fitted"), ("log_eta2", "QPVE log η²"), ("raw_eta2", "QPVE raw η²"),
         ("persistence_prior_r2", "P(dt) prior-fit R²"), ("toeplitz_r2", "Toeplitz R²"))
_VARIANT_STYLE = {"trained": "-", "random_init": "--", "zero": ":"}


def comparison_figure(comparison: Comparison) -> Figure:
    """Left: ``P(dt)`` of every model and variant (log-log), with the uniform prior's curve of the
    trained model's windows. Right: the headline R² of each model and variant as grouped bars."""
    plt = pyplot()
    fig, (curves_ax, bars_ax) = plt.subplots(1, 2, figsize=(13, 5.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, study) in enumerate(comparison.studies.items()):
        color = colors[index % len(colors)]
        for variant, result in study.results.items():
            curves = result.persistence()
            has = curves.count > 0
            curves_ax.plot(curves.dt[has] + 1, curves.curve[has], color=color, ls=_VARIANT_STYLE.get(variant, "-."),
                           lw=1.6, label=f"{label} ({variant})")
        if index == 0:
            curves = study.trained.persistence()
            has = curves.count > 0
            curves_ax.plot(curves.dt[has] + 1, curves.prior[has], color="black", lw=1, alpha=0.6, label="uniform prior")
    log_log_axes(curves_ax, "Persistence P(dt) per model")
    curves_ax.legend(fontsize=7, loc="lower left")

    rows = comparison.rows()
    width = 0.8 / max(len(rows), 1)
    x = np.arange(len(_BARS))
    for index, row in enumerate(rows):
        color = colors[list(comparison.studies).index(row["model"]) % len(colors)]
        hatch = None if row["variant"] == "trained" else "//"
        bars_ax.bar(x + (index - (len(rows) - 1) / 2) * width, [row[key] for key, _ in _BARS], width,
                    color=color if hatch is None else "white", edgecolor=color, hatch=hatch,
                    label=f"{row['model']} ({row['variant']})")
    bars_ax.set_xticks(x, [name for _, name in _BARS], rotation=20, ha="right", fontsize=8)
    bars_ax.axhline(0, color="black", lw=0.5)
    bars_ax.set_ylabel("R²")
    bars_ax.set_title("Position dependence per model (solid: trained, hatched: baselines)")
    bars_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(len(rows), 3))
    windows, tokens = rows[0]["windows"], rows[0]["tokens"]
    figure_title(fig, f"Across architectures: {windows} windows, {tokens} tokens per model and variant", fontsize=12)
    fig.tight_layout()
    return fig


def comparison_page(comparison: Comparison, reports: dict[str, str] | None = None) -> Markup:
    """The comparison as one self-contained HTML page: its table (a column per model and variant),
    its figure, and links to each model's report (``reports``: model -> relative path)."""
    rows = comparison.rows()
    cell = Markup("<td>{}</td>")
    header = Markup("<tr><th></th><th></th>{}</tr>").format(Markup("").join(
        Markup("<th>{}<br>{}</th>").format(r["model"], r["variant"]) for r in rows))
    lines = Markup("").join(Markup("<tr>{}</tr>").format(Markup("").join(cell.format(c) for c in (group, name, *cells)))
                            for group, name, cells in comparison.table_rows())
    # A report's path is made of folder names the comparison derived (model_folders): relative, inside the
    # output folder; quoted as a URL path so that no character of a label can make it another scheme.
    links = Markup("").join(Markup('<li><a href="{}">{}</a>: trained beside its baselines</li>').format(
        urllib.parse.quote(Path(path).as_posix()), model) for model, path in (reports or {}).items())
    figure = figures_html({"Persistence P(dt) per model and variant; headline R² per model and variant": comparison_figure(comparison)})
    body = Markup("<h1>Equivariance probe: comparison across models</h1><p>{}</p><table>{}{}</table>{}{}").format(
        comparison.config.get("windows_description", ""), header, lines, figure,
        Markup("<h2>Each model's report</h2><ul>{}</ul>").format(links) if links else "")
    return html_page("equivariance_probe comparison", body)


def save_comparison(comparison: Comparison, folder: str | os.PathLike, *,
                    format: str | Sequence[str] = "png") -> dict[str, Path]:
    """Write the comparison's tables and studies (:meth:`Comparison.save`), its figure
    ``comparison.png`` (and ``.svg``/``.pdf`` as ``format`` asks: :func:`save_figures`), each model's
    report ``models/<model>/report.html`` (trained and baselines side by side) and
    ``comparison.html`` (table, figure, links to the reports)."""
    paths = comparison.save(folder)
    folder = Path(folder)
    paths.update(figure_paths(save_figures({"comparison": comparison_figure(comparison)}, folder, format=format)))
    reports = {}
    folders = model_folders(comparison.studies)
    for label, study in comparison.studies.items():
        report = folder / "models" / folders[label] / "report.html"
        render_report(study.trained, baselines=study.baselines()).save(report)
        paths[f"report {label}"] = report
        reports[label] = str(report.relative_to(folder))
    paths["html"] = folder / "comparison.html"
    write_text_atomically(paths["html"], comparison_page(comparison, reports))
    return paths
