"""A self-contained HTML report of one result, built as a list of sections.

Place in the seams: *display*. Sections, in order: the summary table, the study's figures
(embedded as base64 PNG), the head ranking (:mod:`equivariance_probe.analyses.heads`) and, when
given, CircuitsVis views of heads (:mod:`equivariance_probe.display.views`). Other analyses add their own :class:`ReportSection`
through ``extra_sections``. The file opens offline with nothing else: no external script,
style sheet or image; when any section draws with CircuitsVis, its inline bundle is
included once, in the page's head, and every view is drawn from it.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import NotRunError
from ..maths.metrics import FORMS, SCALES
from .circuitsvis import circuitsvis_bundle_script
from .figures import study_figures

if TYPE_CHECKING:  # pragma: no cover
    from ..result import ProbeResult
    from .views import HeadViews

__all__ = ["render_report", "report_sections", "ReportSection", "figures_html", "html_page"]


@dataclass(frozen=True)
class ReportSection:
    """One section of the report.

    Attributes:
        title: the section's heading.
        html: its body (trusted HTML, no external resources).
        uses_circuitsvis: the body calls ``CircuitsVis.render`` and needs the bundle on the page.
    """

    title: str
    html: str
    uses_circuitsvis: bool = False


def _png(figure) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def figures_html(figures: dict[str, Any]) -> str:
    """matplotlib figures (name -> figure) as captioned ``<figure>`` elements with embedded PNG (closes them)."""
    return "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,{_png(figure)}"><figcaption>{name}</figcaption></figure>'
        for name, figure in figures.items()
    )


def html_page(title: str, body: str, head: str = "") -> str:
    """A standalone page in the report's style; ``title`` is escaped, ``body`` and ``head`` are trusted HTML."""
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px}}img{{max-width:100%}}caption{{text-align:left;padding:4px 0}}</style>
{head}</head><body>
{body}
</body></html>"""


def summary_section(result: ProbeResult) -> ReportSection:
    """Run facts, query-position R² in every scale and form, persistence fits."""
    summary = result.summary()
    rows = "".join(
        f"<tr><td>{scale}</td><td>{form}</td><td>{summary['query_position_r2'][scale][form]:.4f}</td></tr>"
        for scale in SCALES
        for form in FORMS
    )
    fits = "".join(f"<tr><td>{name}</td><td>{value:.4f}</td></tr>" for name, value in summary["persistence_fit_r2"].items())
    body = f"""<p>{result.n_windows} windows, {result.n_tokens} tokens, {summary['n_entries']:,} visible entries; log floor
{result.log_floor:.3g} ({summary['floored_entries']} entries floored); excluded keys: {list(result.excluded_keys) or 'none'}.</p>
<h3>Query-position R² (all visible entries)</h3>
<table><tr><th>scale</th><th>form</th><th>R²</th></tr>{rows}</table>
<h3>Persistence fits (R² on P(dt))</h3><table><tr><th>fit</th><th>R²</th></tr>{fits}</table>
<p>Most position-bound head: {summary['most_position_bound_head']}; least: {summary['least_position_bound_head']}
(query-position η², log scale). Mean per-window Toeplitz R²: {summary['toeplitz_r2_per_doc_mean']:.4f}.</p>"""
    return ReportSection("Summary", body)


def figures_section(result: ProbeResult) -> ReportSection:
    """The study's figures for this result, as embedded PNG."""
    return ReportSection("Figures", figures_html(study_figures(result)))


def ranking_section(result: ProbeResult) -> ReportSection:
    """Every head, most position-bound first (see :mod:`equivariance_probe.analyses.heads`)."""
    ranking = result.rank_heads()
    return ReportSection(
        "Heads ranked by how position-bound they are",
        "<p>Hover a column name for its definition; the underlined column is the ordering key. "
        "Higher query-position R² or prior fit = more position-bound; higher Toeplitz R² = attention "
        "that depends on q − k alone.</p>" + ranking.to_html(),
    )


def views_section(views: Sequence[HeadViews]) -> ReportSection:
    """CircuitsVis views (drawn from the bundle the report carries once)."""
    return ReportSection(
        "Heads on one document (CircuitsVis)",
        "".join(view.body_html() for view in views),
        uses_circuitsvis=True,
    )


def report_sections(result: ProbeResult, *, views: HeadViews | Sequence[HeadViews] | None = None) -> list[ReportSection]:
    """The standard sections: summary, figures, head ranking, and views if any are given."""
    sections = [summary_section(result), figures_section(result), ranking_section(result)]
    if views is not None:
        views = [views] if not isinstance(views, Sequence) else list(views)
        if views:
            sections.append(views_section(views))
    return sections


def render_report(
    result: ProbeResult,
    *,
    views: HeadViews | Sequence[HeadViews] | None = None,
    extra_sections: Sequence[ReportSection] = (),
) -> str:
    """The report as one HTML string (no external scripts, stylesheets or images).

    Args:
        result: the result to report.
        views: :class:`~equivariance_probe.display.views.HeadViews` to include (one or several).
        extra_sections: more :class:`ReportSection` objects, appended after the standard ones.

    Raises:
        NotRunError: the result holds no windows.
    """
    if result.n_windows == 0:
        raise NotRunError("this result holds no windows yet: run EquivarianceProbe(model).run(docs) before reporting it")
    sections = report_sections(result, views=views) + list(extra_sections)
    model = str(result.metadata.get("model", {}).get("name", "?"))
    bundle = ""
    if any(section.uses_circuitsvis for section in sections):
        bundle = circuitsvis_bundle_script()
    body = "".join(f"<section><h2>{html.escape(s.title)}</h2>{s.html}</section>" for s in sections)
    return html_page(f"equivariance_probe report: {model}", f"<h1>Equivariance probe: {html.escape(model)}</h1>\n{body}", bundle)
