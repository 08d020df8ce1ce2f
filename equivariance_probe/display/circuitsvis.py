"""CircuitsVis, offline: its inline script bundle, and figures taken apart into a div and a render call.

Place in the seams: *display*. CircuitsVis objects (``RenderedHTML``) carry an inline bundle of
its script (``local_src``) and a copy that loads the script from a CDN (``str()``); their
``_repr_html_`` probes a public host before choosing. We use the inline source only, so nothing
here reaches the network, and split each figure into its element id and its render call, so that
a page that draws many figures carries the 1.3 MB bundle once (:func:`circuitsvis_bundle_script`).
This depends on how circuitsvis lays out ``local_src`` (checked at run time, with an error that
names the supported versions).
"""

from __future__ import annotations

import functools
import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EquivarianceProbeError

__all__ = ["CircuitsVisFigure", "circuitsvis_bundle", "circuitsvis_bundle_script", "attention_heads_figure", "figure_div",
           "views_body_html", "views_html", "save_views_page",
           "attention_pattern_figure", "figure_row"]


# -- offline CircuitsVis ------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def circuitsvis_bundle() -> str:
    """CircuitsVis' inline script (the ``iife.js`` that ``local_src`` embeds), as it embeds it.

    It defines the global ``CircuitsVis`` when run as a classic script.
    """
    import circuitsvis

    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    # circuitsvis removes closing script tags the same way before inlining the file.
    return path.read_text(encoding="utf-8").replace("</script>", "")


def circuitsvis_bundle_script() -> str:
    """``<script>`` with the bundle, to put once in a page before any :meth:`HeadViews.body_html`."""
    return f"<script>{circuitsvis_bundle()}</script>"


@dataclass(frozen=True)
class CircuitsVisFigure:
    """One CircuitsVis element: the id of its ``<div>`` and the JavaScript that draws it."""

    element_id: str
    call: str


def _split_rendered(rendered: Any) -> CircuitsVisFigure:
    """Take a CircuitsVis ``RenderedHTML`` apart into its element id and its render call.

    ``local_src`` is ``<div id=ID/> <script type=module> BUNDLE CircuitsVis.render(ID, ...)
    </script>``; the render call is all that differs between figures.
    """
    source = rendered.local_src
    bundle = circuitsvis_bundle()
    before, found, after = source.partition(bundle)
    element = re.search(r'id="([^"]+)"', before)
    if not found or element is None or "</script>" not in after:
        raise EquivarianceProbeError(
            "this circuitsvis version lays out its inline HTML differently than equivariance_probe expects; "
            "pin circuitsvis>=1.40,<2"
        )
    call = after.rsplit("</script>", 1)[0].strip()
    # JSON does not escape "</": a token such as "</script>" would end the script early.
    return CircuitsVisFigure(element.group(1), call.replace("</", "<\\/"))


def attention_heads_figure(values: np.ndarray, tokens: list[str], names: list[str], **options: Any) -> CircuitsVisFigure:
    """Several patterns ``[n, query, key]`` as CircuitsVis' ``attention_heads`` (a head selector and one zoomed pattern)."""
    from circuitsvis.attention import attention_heads

    nested = values.tolist()
    return _compact(_split_rendered(attention_heads(nested, tokens, attention_head_names=names, **options)), nested)


def attention_pattern_figure(values: np.ndarray, tokens: list[str], **options: Any) -> CircuitsVisFigure:
    """One pattern ``[query, key]`` as CircuitsVis' ``attention_pattern`` (a heat map; several fit side by side)."""
    from circuitsvis.attention import attention_pattern

    nested = values.tolist()
    return _compact(_split_rendered(attention_pattern(tokens, nested, **options)), nested)


def _compact(figure: CircuitsVisFigure, nested: list) -> CircuitsVisFigure:
    # CircuitsVis writes the numbers with json.dumps' ", " separators and "0.0" for zeros (half of
    # every causal pattern): the same array written compactly is ~30% smaller.
    written = json.dumps(nested)
    compact = re.sub(r"(?<=[\[,])(-?\d+)\.0(?=[,\]])", r"\1", json.dumps(nested, separators=(",", ":")))
    return CircuitsVisFigure(figure.element_id, figure.call.replace(written, compact, 1))


def figure_div(caption: str, figure: CircuitsVisFigure) -> str:
    """A figure's heading and the empty ``<div>`` its render call draws into."""
    return f"<h4>{html.escape(caption)}</h4><div id=\"{figure.element_id}\" class=\"circuitsvis-view\"></div>"


def figure_row(figures: Sequence[tuple[str, CircuitsVisFigure]]) -> str:
    """Captioned figures side by side (wrapping onto more lines where the page is narrow)."""
    cells = "".join(f'<div style="flex:1 1 0;min-width:240px">{figure_div(caption, figure)}</div>'
                    for caption, figure in figures)
    return f'<div style="display:flex;flex-wrap:wrap;gap:12px">{cells}</div>'


def views_body_html(caption_html: str, figures: list[tuple[str, CircuitsVisFigure]], css_class: str,
                    layout: str | None = None) -> str:
    """Captioned figures without the bundle: the page must already have run :func:`circuitsvis_bundle_script`
    (as the report does, once). ``caption_html`` is trusted HTML; ``layout``, the figures' elements laid out
    (e.g. :func:`figure_row`; default: one under the other)."""
    if layout is not None:
        calls = "".join(f"<script>{figure.call}</script>" for _, figure in figures)
        return f'<div class="{css_class}">{caption_html}{layout}{calls}</div>'
    parts = [caption_html] + [figure_div(caption, figure) + f"<script>{figure.call}</script>" for caption, figure in figures]
    return f'<div class="{css_class}">{"".join(parts)}</div>'


def views_html(caption_html: str, figures: list[tuple[str, CircuitsVisFigure]], css_class: str,
               layout: str | None = None) -> str:
    """Captioned figures as one HTML fragment carrying the CircuitsVis bundle once (offline); ``layout`` as in
    :func:`views_body_html`."""
    divs = layout if layout is not None else "".join(figure_div(caption, figure) for caption, figure in figures)
    # One module script, as CircuitsVis' own inline HTML: the bundle's CircuitsVis stays in the
    # module's scope, so several views in one notebook do not clash.
    calls = "\n".join(figure.call for _, figure in figures)
    return (f'<div class="{css_class}">{caption_html}{divs}'
            f'<script crossorigin type="module">{circuitsvis_bundle()}\n{calls}</script></div>')


def save_views_page(path: str | Path, title: str, fragment: str) -> Path:
    """Write a standalone, offline HTML page holding ``fragment`` (from :func:`views_html`)."""
    path = Path(path)
    path.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head>'
                    f"<body>{fragment}</body></html>", encoding="utf-8")
    return path
