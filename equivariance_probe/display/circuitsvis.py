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
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EquivarianceProbeError
from ..markup import Markup, script_safe
from ..records.fileformat import write_text_atomically

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


def circuitsvis_bundle_script() -> Markup:
    """``<script>`` with the bundle, to put once in a page before any :meth:`HeadViews.body_html`."""
    return Markup("<script>{}</script>").format(Markup(circuitsvis_bundle()))


@dataclass(frozen=True)
class CircuitsVisFigure:
    """One CircuitsVis element: the id of its ``<div>`` and the JavaScript that draws it (its data already
    written for a ``<script>`` by :func:`~equivariance_probe.markup.script_safe`)."""

    element_id: str
    call: Markup


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
    # The call is CircuitsVis.render("id", "Name", {json}): every "<", ">" and "&" in it is inside a JSON
    # string (a token, a head's name), so written as a JSON escape it means the same to the script and
    # nothing to the HTML parser: neither "</script>" nor "<!--<script>" in a document can end the script
    # or keep it from ending.
    return CircuitsVisFigure(element.group(1), script_safe(call))


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
    # Markup's own replace would escape its arguments: the numbers are replaced in the plain text.
    return CircuitsVisFigure(figure.element_id, Markup(str.replace(figure.call, written, compact, 1)))


def figure_div(caption: str, figure: CircuitsVisFigure) -> Markup:
    """A figure's heading and the empty ``<div>`` its render call draws into."""
    return Markup('<h4>{}</h4><div id="{}" class="circuitsvis-view"></div>').format(caption, figure.element_id)


def figure_row(figures: Sequence[tuple[str, CircuitsVisFigure]]) -> Markup:
    """Captioned figures side by side (wrapping onto more lines where the page is narrow)."""
    cells = Markup("").join(Markup('<div style="flex:1 1 0;min-width:240px">{}</div>').format(figure_div(caption, figure))
                            for caption, figure in figures)
    return Markup('<div style="display:flex;flex-wrap:wrap;gap:12px">{}</div>').format(cells)


def views_body_html(caption_html: Markup, figures: list[tuple[str, CircuitsVisFigure]], css_class: str,
                    layout: Markup | None = None) -> Markup:
    """Captioned figures without the bundle: the page must already have run :func:`circuitsvis_bundle_script`
    (as the report does, once). ``caption_html`` and ``layout`` are :class:`Markup` (a plain ``str`` is
    escaped); ``layout``, the figures' elements laid out (e.g. :func:`figure_row`; default: one under the other)."""
    script = Markup("<script>{}</script>")
    if layout is not None:
        calls = Markup("").join(script.format(figure.call) for _, figure in figures)
        return Markup('<div class="{}">{}{}{}</div>').format(css_class, caption_html, layout, calls)
    parts = Markup("").join(figure_div(caption, figure) + script.format(figure.call) for caption, figure in figures)
    return Markup('<div class="{}">{}{}</div>').format(css_class, caption_html, parts)


def views_html(caption_html: Markup, figures: list[tuple[str, CircuitsVisFigure]], css_class: str,
               layout: Markup | None = None) -> Markup:
    """Captioned figures as one HTML fragment carrying the CircuitsVis bundle once (offline); ``layout`` as in
    :func:`views_body_html`."""
    divs = layout if layout is not None else Markup("").join(figure_div(caption, figure) for caption, figure in figures)
    # One module script, as CircuitsVis' own inline HTML: the bundle's CircuitsVis stays in the
    # module's scope, so several views in one notebook do not clash.
    calls = Markup("\n").join(figure.call for _, figure in figures)
    return Markup('<div class="{}">{}{}<script crossorigin type="module">{}\n{}</script></div>').format(
        css_class, caption_html, divs, Markup(circuitsvis_bundle()), calls)


def save_views_page(path: str | Path, title: str, fragment: Markup) -> Path:
    """Write a standalone, offline HTML page holding ``fragment`` (from :func:`views_html`) atomically.

    Raises:
        FileWriteError: the folder does not exist or is not writable, ``path`` is a folder, or the disk
            refused the write (nothing is left behind).
    """
    page = Markup('<!DOCTYPE html><html><head><meta charset="utf-8"><title>{}</title></head><body>{}</body></html>')
    return write_text_atomically(path, page.format(title, fragment))
