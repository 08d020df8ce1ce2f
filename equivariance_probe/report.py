"""A self-contained HTML report of one result: summary table and the study's figures.

Figures are embedded as base64 PNG, so the file opens offline with nothing else. (Head
views with CircuitsVis belong here too; see the open issue on looking at heads.)
"""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .metrics import FORMS, SCALES

if TYPE_CHECKING:  # pragma: no cover
    from .result import ProbeResult

__all__ = ["render_report", "with_positional_section"]


def _png(figure) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def render_report(result: ProbeResult) -> str:
    """The report as one HTML string (no external scripts, stylesheets or images)."""
    from .figures import study_figures

    summary = result.summary()
    model = html.escape(str(result.metadata.get("model", {}).get("name", "?")))
    rows = "".join(
        f"<tr><td>{scale}</td><td>{form}</td><td>{summary['query_position_r2'][scale][form]:.4f}</td></tr>"
        for scale in SCALES
        for form in FORMS
    )
    fits = "".join(f"<tr><td>{name}</td><td>{value:.4f}</td></tr>" for name, value in summary["persistence_fit_r2"].items())
    figures = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,{_png(figure)}"><figcaption>{name}</figcaption></figure>'
        for name, figure in study_figures(result).items()
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>equivariance_probe report: {model}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px}}img{{max-width:100%}}</style></head><body>
<h1>Equivariance probe: {model}</h1>
<p>{result.n_windows} windows, {result.n_tokens} tokens, {summary['n_entries']:,} visible entries; log floor
{result.log_floor:.3g} ({summary['floored_entries']} entries floored); excluded keys: {list(result.excluded_keys) or 'none'}.</p>
<h2>Query-position R² (all visible entries)</h2>
<table><tr><th>scale</th><th>form</th><th>R²</th></tr>{rows}</table>
<h2>Persistence fits (R² on P(dt))</h2><table><tr><th>fit</th><th>R²</th></tr>{fits}</table>
<p>Most position-bound head: {summary['most_position_bound_head']}; least: {summary['least_position_bound_head']}
(query-position η², log scale). Mean per-window Toeplitz R²: {summary['toeplitz_r2_per_doc_mean']:.4f}.</p>
<h2>Figures</h2>{figures}
</body></html>"""


# -- issue 6: the positional analyses' section, when a positional.json lies beside the results
def with_positional_section(page: str, results_path: str | os.PathLike[str]) -> str:
    """``page`` with the section of ``positional.json`` (next to ``results_path``) before ``</body>``, if there is one."""
    positional = Path(results_path).with_name("positional.json")
    if not positional.is_file():
        return page
    from .positional_report import render_positional_section
    from .positional_study import PositionalStudy

    section = render_positional_section(PositionalStudy.load(positional))
    return page.replace("</body>", section + "\n</body>", 1)
