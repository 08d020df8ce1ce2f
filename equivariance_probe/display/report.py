"""A self-contained HTML report of one result, or of a study's trained model beside its
baselines, built as a list of sections.

Place in the seams: *display*. Sections, in order: the summary table (one column per variant:
trained, random init, zero; every headline number with its 95 % interval over windows, and the
trained-minus-baseline differences over the same windows with theirs), the study's figures (embedded as base64 PNG: persistence and
Figure 1c of every variant side by side, per-head heatmaps of each), the head ranking
(:mod:`equivariance_probe.analyses.heads`), the attention sinks (the first token's weight per head and
the sink rate, where the results keep them) and, when given, CircuitsVis views of heads
(:mod:`equivariance_probe.display.views`). Other analyses add their own :class:`ReportSection`
through ``extra_sections``. The model is named as the user named it
(:attr:`~equivariance_probe.result.ProbeResult.model_name`). The file opens offline with nothing else: no external script,
style sheet or image; when any section draws with CircuitsVis, its inline bundle is
included once, in the page's head, and every view is drawn from it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import NotRunError, SupersededSumsError
from ..maths.sinks import SINK_EPSILON
from ..markup import Markup
from ..records.fileformat import write_text_atomically
from ..runs.tables import paired_rows, summary_rows
from .circuitsvis import circuitsvis_bundle_script
from .figures import (figure_bytes, first_token_figure, fit_by_key_figure, head_curves_figure, heatmaps_figure,
                      persistence_figure, scatter_figure, sink_rate_figure, variant_columns)

if TYPE_CHECKING:  # pragma: no cover
    from ..result import ProbeResult
    from .views import HeadViews

__all__ = ["render_report", "report_sections", "ReportSection", "RenderedReport", "figures_html", "html_page",
           "sections_page", "table_html", "folded_table_html", "sinks_section"]


@dataclass(frozen=True)
class ReportSection:
    """One section of the report.

    Attributes:
        title: the section's heading.
        html: its body as :class:`~equivariance_probe.markup.Markup` (no external resources); a plain
            ``str`` is data and appears on the page as text, escaped.
        uses_circuitsvis: the body calls ``CircuitsVis.render`` and needs the bundle on the page.
    """

    title: str
    html: Markup | str
    uses_circuitsvis: bool = False


def _png(figure) -> str:
    import matplotlib.pyplot as plt

    drawn = figure_bytes(figure, "png", dpi=100)
    plt.close(figure)
    return base64.b64encode(drawn).decode("ascii")


def figures_html(figures: dict[str, Any]) -> Markup:
    """matplotlib figures (caption -> figure) as captioned ``<figure>`` elements with embedded PNG (closes them),
    each shown at its own size (100 pixels per inch), so that its labels stay as large as drawn: a figure wider than
    the page scrolls sideways instead of shrinking."""
    return Markup("").join(
        Markup('<figure><img alt="{name}" src="data:image/png;base64,{png}"><figcaption>{name}</figcaption></figure>')
        .format(name=name, png=_png(figure))
        for name, figure in figures.items()
    )


#: The report's style; ``{root}`` is the element it applies to (``body`` on a page, the report's
#: ``<div>`` inside a notebook, so that it leaves the notebook's own style alone).
_STYLE = ("{root}{{font-family:sans-serif;max-width:1100px;margin:auto}}{root} table{{border-collapse:collapse}}"
          "{root} td,{root} th{{border:1px solid #ccc;padding:3px 8px}}{root} img{{max-width:100%}}"
          "{root} figure img{{max-width:none}}{root} details{{margin:0.3em 0 1em}}{root} summary{{cursor:pointer}}"
          "{root} caption{{text-align:left;padding:4px 0}}{root} figure{{margin:1em 0;overflow-x:auto}}"
          "{root} figcaption{{font-size:90%;color:#444}}")


def html_page(title: str, body: Markup | str, head: Markup | str = "") -> Markup:
    """A standalone page in the report's style; ``body`` and ``head`` are :class:`Markup` (a plain ``str``
    is escaped, as ``title`` always is)."""
    return Markup('''<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style>
{head}</head><body>
{body}
</body></html>''').format(title=title, style=Markup(_STYLE.format(root="body")), head=head, body=body)


class RenderedReport:
    """The HTML report: drawn by a notebook, saved by a script (as CircuitsVis' ``RenderedHTML``).

    ``str(report)`` is the standalone page (what :meth:`save` writes); ``_repr_html_`` is the same
    content as one ``<div>`` whose style applies to it alone, so that a notebook cell that ends
    with ``render_report(...)`` draws the report, CircuitsVis views included, offline.

    Example:
        >>> report = render_report(result, views=views)   # doctest: +SKIP
        >>> report.save("report.html")                     # doctest: +SKIP
        >>> report      # the last line of a notebook cell: the report is drawn  # doctest: +SKIP

    Attributes:
        title: the page's title (names the model).
        body: the sections' HTML.
        head: what goes in the page's head (CircuitsVis' inline bundle when a section draws with it).
    """

    def __init__(self, title: str, body: Markup | str, head: Markup | str = "") -> None:
        self.title = title
        self.body = body
        self.head = head

    def __str__(self) -> str:
        return html_page(self.title, self.body, self.head)

    def _repr_html_(self) -> str:
        return Markup('<div class="equivariance-probe-report"><style>{}</style>{}{}</div>').format(
            Markup(_STYLE.format(root=".equivariance-probe-report")), self.head, self.body)

    def save(self, path: str | Path) -> Path:
        """Write the standalone, offline page to ``path`` (UTF-8, atomically) and return the path.

        Raises:
            FileWriteError: the folder does not exist or is not writable, or ``path`` is a folder.
        """
        return write_text_atomically(path, str(self))

    def __repr__(self) -> str:
        return f"RenderedReport({self.title!r}, {len(str(self)) / 1e6:.2f} MB; .save(path) writes it)"


def summary_section(result: ProbeResult, baselines: Mapping[str, ProbeResult] | None = None,
                    sink_epsilon: float = SINK_EPSILON) -> ReportSection:
    """Run facts, then one table with a column per variant: query-position R² in every scale and
    form, the persistence fits and their parameters, Figure 1c, Toeplitz scores, heads and sink rates
    (at ``sink_epsilon``)."""
    variants = variant_columns(result, baselines)
    summaries = {name: variant.summary(epsilon=sink_epsilon) for name, variant in variants.items()}
    first = summaries[next(iter(summaries))]
    table = table_html(list(summaries), summary_rows(summaries, extended=True), "summary")
    compared, differences = "", Markup("")
    if len(variants) > 1:
        compared = (" Baselines (docs/methods.md#baselines): <code>random_init</code> is the same architecture at its own "
                    "random initialisation, <code>zero</code> has every weight zero (every head exactly uniform).")
        differences = _differences_html(variants)
    body = Markup("""<p>{windows} windows, {tokens} tokens, {entries} visible entries per variant;
log scale y = log max(a, eps) with eps = {floor}; excluded keys: {excluded}.{compared}</p>
<h3>Query-position R², persistence fits, Toeplitz R² and heads{per_variant}</h3>
<p>Rows: query-position R² over all visible entries (QPVE: prior, fitted, η²; log and raw scale); R² and parameters of
the fits to the persistence curve P(dt); Figure 1c (the fits to P_t(dt) per key-position bin); Toeplitz R²; the most and
least position-bound heads (log η²). Brackets: 95 % intervals over windows (delete-a-group jackknife, windows as the
sampling unit).</p>
{table}{differences}""").format(
        windows=result.n_windows, tokens=result.n_tokens, entries=f"{first['n_entries']:,}", floor=f"{result.log_floor:.3g}",
        excluded=list(result.excluded_keys) or "none", compared=Markup(compared),
        per_variant=" per variant" if len(variants) > 1 else "", table=table, differences=differences)
    return ReportSection("Summary", body)


def _differences_html(variants: Mapping[str, ProbeResult]) -> Markup:
    """The first variant minus each other one, over the same windows, with 95 % intervals from paired replicates."""
    reference = next(iter(variants))
    rows, notes = paired_rows(dict(variants), reference)
    columns = [f"{reference} − {name}" for name in variants if name != reference]
    remarks = Markup("").join(Markup("<p>{}</p>").format(note) for note in notes)
    return Markup("<h3>Differences over the same windows</h3><p>Each difference with its 95 % interval from paired jackknife "
                  "replicates (the same windows in the same groups, so what they share cancels).</p>{}{}").format(
        table_html(columns, rows, "differences"), remarks)


def table_html(columns: Sequence[str], rows: Sequence[tuple[str, str, Sequence[str]]], css_class: str) -> Markup:
    """A table of ``(group, what, cells)`` rows under one heading per column (text escaped)."""
    cell = Markup("<td>{}</td>")
    header = Markup("<tr><th></th><th></th>{}</tr>").format(Markup("").join(Markup("<th>{}</th>").format(name) for name in columns))
    body = Markup("").join(
        Markup("<tr>{}</tr>").format(Markup("").join(cell.format(c) for c in (group, what, *cells)))
        for group, what, cells in rows
    )
    return Markup('<table class="{}">{}{}</table>').format(css_class, header, body)


def folded_table_html(columns: Sequence[str], rows: Sequence[tuple[str, str, Sequence[str]]], css_class: str, *,
                      shown: int = 10) -> Markup:
    """:func:`table_html` of the first ``shown`` rows, the rest folded under a ``<details>`` that says how many
    rows it holds (give the rows largest first: the page then opens on what matters)."""
    if len(rows) <= shown:
        return table_html(columns, rows, css_class)
    rest = len(rows) - shown
    return Markup("{}<details><summary>{} more row{}</summary>{}</details>").format(
        table_html(columns, rows[:shown], css_class), rest, "s" if rest != 1 else "",
        table_html(columns, rows[shown:], css_class))


def figures_section(result: ProbeResult, baselines: Mapping[str, ProbeResult] | None = None) -> ReportSection:
    """The study's figures: persistence (Fig. 1a) and fit quality by key position (Fig. 1c) of every
    variant side by side, per-head persistence (1b) and the scatter (1d) of the result, and the
    per-head heatmaps of every variant."""
    variants = variant_columns(result, baselines)
    side_by_side = " (trained and baselines side by side)" if len(variants) > 1 else ""
    figures = {
        f"Fig. 1a — persistence P(dt) with power, exponential and uniform-prior fits{side_by_side}": persistence_figure(variants),
        f"Fig. 1b — per-head persistence, {result.metadata.get('label') or result.model_name}": head_curves_figure(result),
        f"Fig. 1c — R² of each fit to P_t(dt) by key position{side_by_side}": fit_by_key_figure(variants),
    }
    if result.statistics.sample is not None and len(result.statistics.sample):
        figures[f"Fig. 1d — sampled entries against the uniform prior, {result.metadata.get('label') or result.model_name}"] = scatter_figure(result)
    for name, variant in variants.items():
        figures[f"Per-head query-position R² and Toeplitz R², {name}"] = heatmaps_figure(variant)
    return ReportSection("Figures", figures_html(figures))


def sinks_section(result: ProbeResult, baselines: Mapping[str, ProbeResult] | None = None,
                  epsilon: float = SINK_EPSILON) -> ReportSection | None:
    """Attention sinks (Gu et al., ICLR 2025): per variant the sink rate at ``epsilon`` (per window, as their
    released code computes it) and the pooled one, each with its interval, the mean first-token weight and the
    first token, then the heat map of ``α₁`` per head and the sink rate by layer; ``None`` where a variant keeps
    no first-token sums (a file written before them)."""
    variants = variant_columns(result, baselines)
    if not all(variant.keeps_first_token for variant in variants.values()):
        return None
    rows = []
    for name, variant in variants.items():
        rates = [_rate_cell(variant.sink_rate, epsilon), _rate_cell(variant.pooled_sink_rate, epsilon)]
        rows.append(("", name, [*rates, f"{variant.first_token_weight(None):.4f}", variant.first_token]))
    table = table_html([f"sink rate (α₁(w) > {epsilon:g}) [95 %]", f"pooled sink rate (mean α₁ > {epsilon:g}) [95 %]",
                        "mean α₁", "first token"], rows, "sinks")
    figures = {"Mean weight α₁ on the first token, per head": first_token_figure(variants, epsilon=epsilon),
               "Sink rate by layer": sink_rate_figure(variants, epsilon=epsilon)}
    body = (Markup("<p>α₁(w, l, h): the mean over every real query of window w of head (l, h)'s attention weight on "
                   "the window's first token (kept in the softmax whatever the excluded keys). The sink rate is the "
                   "share of (window, layer, head) triples with α₁(w, l, h) &gt; {} (Gu et al., \"When Attention Sink "
                   "Emerges in Language Models\", ICLR 2025, and their released code, who report 77.00 % for GPT2-XL "
                   "on natural text in 64-token windows); the pooled sink rate thresholds each head's window-averaged "
                   "α₁ once (docs/methods.md#attention-sinks).</p>").format(f"{epsilon:g}")
            + table + figures_html(figures))
    return ReportSection("Attention sinks", body)


def _rate_cell(rate: Any, epsilon: float) -> str:
    """A sink rate with its 95 % interval, the number alone without interval groups, or ``not kept (run again)``
    for the per-window rate of a file written before it."""
    try:
        return str(rate(epsilon, interval=0.95))
    except SupersededSumsError:
        return "not kept (run again)"
    except NotRunError:  # no interval groups: the number alone
        return f"{rate(epsilon):.4f}"


def ranking_section(result: ProbeResult) -> ReportSection:
    """Every head, most position-bound first (see :mod:`equivariance_probe.analyses.heads`)."""
    ranking = result.rank_heads()
    return ReportSection(
        "Heads ranked by how position-bound they are",
        Markup("<p>Hover a column name for its definition; the underlined column is the ordering key. "
               "Higher query-position R² or prior fit = more position-bound; higher Toeplitz R² = attention "
               "that depends on q − k alone.</p>") + ranking.to_html(),
    )


def views_section(views: Sequence[HeadViews]) -> ReportSection:
    """CircuitsVis views (drawn from the bundle the report carries once)."""
    return ReportSection(
        "Heads on one document (CircuitsVis)",
        Markup("").join(view.body_html() for view in views),
        uses_circuitsvis=True,
    )


def report_sections(
    result: ProbeResult,
    *,
    baselines: Mapping[str, ProbeResult] | None = None,
    views: HeadViews | Sequence[HeadViews] | None = None,
    sink_epsilon: float = SINK_EPSILON,
) -> list[ReportSection]:
    """The standard sections: summary and figures (with the baselines side by side), the head
    ranking of ``result``, the attention sinks at ``sink_epsilon``, and views if any are given."""
    sections = [summary_section(result, baselines, sink_epsilon), figures_section(result, baselines),
                ranking_section(result)]
    sinks = sinks_section(result, baselines, sink_epsilon)
    if sinks is not None:
        sections.append(sinks)
    if views is not None:
        views = [views] if not isinstance(views, Sequence) else list(views)
        if views:
            sections.append(views_section(views))
    return sections


def render_report(
    result: ProbeResult,
    *,
    baselines: Mapping[str, ProbeResult] | None = None,
    views: HeadViews | Sequence[HeadViews] | None = None,
    extra_sections: Sequence[ReportSection] = (),
    sink_epsilon: float = SINK_EPSILON,
) -> RenderedReport:
    """The report: no external scripts, stylesheets or images.

    Returns a :class:`RenderedReport`: a notebook draws it, ``.save(path)`` writes the page,
    ``str(report)`` is the page's HTML.

    Args:
        result: the result to report (a study's trained model).
        baselines: the same study's baselines, name -> result (``Study.baselines()``, or the
            ``baseline_<name>`` files beside a study's results), shown side by side with ``result``.
        views: :class:`~equivariance_probe.display.views.HeadViews` to include (one or several).
        extra_sections: more :class:`ReportSection` objects, appended after the standard ones.
        sink_epsilon: the sink rates' threshold ``ε`` (Gu et al.'s 0.3 by default).

    Raises:
        NotRunError: the result (or a baseline) holds no windows.
    """
    for variant in [result, *dict(baselines or {}).values()]:
        if variant.n_windows == 0:
            raise NotRunError("this result holds no windows yet: run EquivarianceProbe(model).run(docs) before reporting it")
    sections = report_sections(result, baselines=baselines, views=views, sink_epsilon=sink_epsilon) + list(extra_sections)
    model = result.model_name
    return sections_page(f"equivariance_probe report: {model}", f"Equivariance probe: {model}", sections)


def sections_page(title: str, heading: str, sections: Sequence[ReportSection]) -> RenderedReport:
    """Sections as one self-contained page under ``heading``, with CircuitsVis' bundle once in its head
    when any section draws with it."""
    bundle = circuitsvis_bundle_script() if any(section.uses_circuitsvis for section in sections) else ""
    body = Markup("").join(Markup("<section><h2>{}</h2>{}</section>").format(s.title, s.html) for s in sections)
    return RenderedReport(title, Markup("<h1>{}</h1>\n{}").format(heading, body), bundle)
