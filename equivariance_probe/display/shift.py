"""The shift test on screen: figures of a :class:`~equivariance_probe.ShiftResult`, one head's segment block at
two offsets as an offline CircuitsVis view, and the report section that holds them.

Place in the seams: *display*, drawing only. Every number comes from the result's methods
(:meth:`~equivariance_probe.ShiftResult.share`, :meth:`~equivariance_probe.ShiftResult.loss_by_offset`,
:meth:`~equivariance_probe.ShiftResult.divergence`) with its jackknife interval over segments where the result
has at least two groups of segments; the view's attention comes from a forward pass of the model through the
adapter's segment capture (:func:`~equivariance_probe.features.segments.segment_pass`), the same capture the
shift run decomposes. matplotlib and circuitsvis are imported when something is drawn.

* :func:`shift_layers_figure` — offset η² by layer (centred logits and residual stream), the trained model
  against its baselines (its random initialisation), with 95 % intervals.
* :func:`shift_heads_figure` — per-head offset η² and pair η² (the equivariant part) of the centred logits.
* :func:`shift_loss_figure` — the segment's next-token loss by offset, with intervals.
* :func:`shift_divergence_figure` — Jensen–Shannon divergence between offsets against between contexts, and
  their ratio.
* :func:`shift_sink_figure`, :func:`shift_massive_figure`, :func:`shift_attribution_figure`,
  :func:`shift_patching_figure` — the mechanisms: sink mass, massive activations, attribution and patching (drawn in :mod:`~equivariance_probe.display.shift_mechanisms`, importable
  from here).
* :func:`shift_view` → :class:`ShiftView` — one head's segment block at two offsets, side by side.
* :func:`shift_report_section`, :func:`render_shift_report` — all of it in the HTML report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..features.segments import capture_segment_batch
from ..errors import (IncompatibleResultsError, InputError, IntervalUnavailableError, NotRunError,
                      SupersededSumsError, UndefinedStatisticError, check_index, option)
from ..markup import Markup
from ..maths.intervals import Interval
from ..probe import EquivarianceProbe
from ..shift_result import ShiftResult
from ..sources.shift_grid import shift_grid
from ..statistics.shift import REPRESENTATION_LABELS, REPRESENTATIONS, counted_entries
from .circuitsvis import (CircuitsVisFigure, attention_pattern_figure, figure_row, save_views_page, views_body_html,
                          views_html)
from .figures import _axes_title, figure_or_error, figure_title, one_result, pyplot
from .report import RenderedReport, ReportSection, figures_html, sections_page, table_html
from .shift_mechanisms import (_has_massive, _has_sink_mass, shift_attribution_figure, shift_massive_figure,
                               shift_patching_figure, shift_sink_figure, sink_layer_groups)
from .shift_parts import INTERVAL_LEVEL, _interval_note, _number, _offset_meaning, _titled, _variants, _with_interval
from .shift_tables import shift_tables_html
from .views import _token_strings, parse_heads

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = [
    "shift_layers_figure",
    "shift_heads_figure",
    "shift_loss_figure",
    "shift_divergence_figure",
    "shift_patching_figure",
    "shift_figures",
    "shift_attribution_figure",
    "ShiftView",
    "shift_view",
    "most_moved_head",
    "shift_report_section",
    "render_shift_report",
    "shift_sink_figure",
    "sink_layer_groups",
    "shift_massive_figure",
    "INTERVAL_LEVEL",
]

_REPRESENTATION_NAMES = REPRESENTATION_LABELS


# -- figures ------------------------------------------------------------------------------------------------
def shift_layers_figure(results: ShiftResult | Mapping[str, ShiftResult],
                        baselines: Mapping[str, ShiftResult] | None = None, *,
                        representations: Sequence[str] = ("centred_logits", "residual"), term: str = "offset") -> Figure:
    """``η²`` of ``term`` by layer, one panel per representation and one line per variant (a trained model and its
    random initialisation), with 95 % intervals over segments."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    variants = _variants(results, baselines, where="shift_layers_figure")
    fig, axes = plt.subplots(1, len(representations), figsize=(5.5 * len(representations), 4.2), squeeze=False)
    for ax, representation in zip(axes[0], representations):
        for number, (name, result) in enumerate(variants.items()):
            try:
                estimate, error = _with_interval(_number(result.share, representation, term, by="layer"))
            except SupersededSumsError:  # a file of the grand-mean definition: its other panels still draw
                ax.plot([], [], " ", label=f"{name}: not in this file (measured before the mean vector; run again)")
                continue
            # Each variant a little aside, so that overlapping intervals stay apart.
            layers = np.arange(len(estimate)) + 0.08 * (number - (len(variants) - 1) / 2)
            ax.errorbar(layers, estimate, yerr=error, marker="o", ms=4, capsize=3, label=name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        # Global (full-attention) layers among sliding-window ones, as Gemma 3 interleaves them: shaded, since
        # there the prefix stays in view at every offset.
        groups = next(iter(variants.values())).layer_groups()
        for number, layer in enumerate(groups.get("global", ()) if "sliding" in groups else ()):
            ax.axvspan(layer - 0.4, layer + 0.4, color="0.9", zorder=0, label="global layer" if number == 0 else None)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"{term} η²")
        ax.set_ylim(bottom=0)
        _axes_title(ax, f"{_REPRESENTATION_NAMES[representation]}: {term} η² by layer")
        ax.legend(fontsize=8)
    first = next(iter(variants.values()))
    return _titled(fig, None, f"Shift test, {first.model_name}: share of each layer's variation owed to the {term}",
                   variants, f"; {_offset_meaning(first)}")


def shift_heads_figure(result: ShiftResult, *, representation: str = "centred_logits") -> Figure:
    """Per-head ``[layer, head]`` heat maps of the offset η² and the pair η² (the equivariant part)."""
    result = one_result(result, ShiftResult, where="shift_heads_figure")
    plt = pyplot()
    panels = {term: result.share(representation, term, by="head") for term in ("offset", "pair")}
    n_layers, n_heads = panels["offset"].shape
    fig, axes = plt.subplots(1, 2, figsize=(3 + 4.4 * max(n_heads, 4) / 4, 1.8 + 0.3 * n_layers), squeeze=False)
    for ax, (term, values) in zip(axes[0], panels.items()):
        image = ax.imshow(values, vmin=0, vmax=1 if term == "pair" else None, cmap="magma", aspect="auto")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(n_heads))
        ax.set_yticks(range(n_layers))
        _axes_title(ax, "pair η² (equivariant part)" if term == "pair" else "offset η² (colours up to its largest)",
                    fontsize=9)
        fig.colorbar(image, ax=ax)
    figure_title(fig, f"Per-head shares of the {_REPRESENTATION_NAMES[representation]}: {result.model_name}")
    fig.tight_layout()
    return fig


def shift_loss_figure(results: ShiftResult | Mapping[str, ShiftResult],
                      baselines: Mapping[str, ShiftResult] | None = None) -> Figure:
    """The mean next-token loss (nats) of the segment's own tokens at each offset, one line per variant, with
    95 % intervals over segments."""
    plt = pyplot()
    variants = _variants(results, baselines, where="shift_loss_figure")
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, result in variants.items():
        estimate, error = _with_interval(_number(result.loss_by_offset))
        ax.errorbar(result.offsets, estimate, yerr=error, marker="o", ms=4, capsize=3, label=name)
    ax.set_xlabel("offset s (tokens before the segment)")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend(fontsize=8)
    return _titled(fig, ax, f"Loss on the segment by offset, {next(iter(variants.values())).model_name}", variants)


def shift_divergence_figure(results: ShiftResult | Mapping[str, ShiftResult],
                            baselines: Mapping[str, ShiftResult] | None = None) -> Figure:
    """Per variant, the mean Jensen–Shannon divergence of the segment's predictions between two offsets (same
    context) beside that between two contexts (same offset), with 95 % intervals; their ratio under each variant's name."""
    plt = pyplot()
    variants = _variants(results, baselines, where="shift_divergence_figure")
    fig, ax = plt.subplots(figsize=(2.5 + 2.2 * len(variants), 4.2))
    width, labels = 0.38, []
    for index, (name, result) in enumerate(variants.items()):
        for shift, kind, color in ((-width / 2, "offset", "tab:blue"), (width / 2, "context", "tab:orange")):
            try:
                estimate, error = _with_interval(_number(result.divergence, kind))
            except UndefinedStatisticError:  # position_ids mode: one context, no context divergence
                continue
            ax.bar(index + shift, float(estimate), width, yerr=None if error is None else error.reshape(2, 1),
                   capsize=3, color=color, label=f"between {kind}s" if index == 0 else None)
        labels.append(name)
        try:
            labels[-1] += f"\nratio {_format(_number(result.divergence, 'ratio'))}"
        except UndefinedStatisticError:
            pass
    ax.set_xticks(range(len(variants)), labels, fontsize=8)
    ax.set_ylabel("mean Jensen–Shannon divergence (nats)")
    ax.legend(fontsize=8)
    return _titled(fig, ax, f"Moving the text against changing what precedes it, "
                            f"{next(iter(variants.values())).model_name}", variants)


def _format(number: Any) -> str:
    if isinstance(number, Interval):
        return str(number)
    return "undefined" if not math.isfinite(float(number)) else f"{float(number):.3g}"


def shift_figures(result: ShiftResult, baselines: Mapping[str, ShiftResult] | None = None,
                  name: str = "trained") -> dict[str, Figure]:
    """Every figure of a shift run: ``{"shift_layers", "shift_heads", "shift_loss", "shift_divergence",
    "shift_sink", "shift_massive", "shift_attribution"}`` (the loss and divergence only where the run measured
    predictions; the sink mass and the massive activations only for the variants that hold them, none in a file
    written before they were kept; the attribution only where
    it split the residual stream into components), and ``"shift_patching"`` where it patched
    (:func:`shift_patching_figure`), with the baselines beside ``result`` (called ``name``).

    Raises:
        FigureError: a figure could not be drawn (named, with what failed).
    """
    variants = {name: result, **dict(baselines or {})}
    figures = {"shift_layers": figure_or_error("shift_layers", shift_layers_figure, variants),
               "shift_heads": figure_or_error("shift_heads", shift_heads_figure, result)}
    if result.config.predictions:
        figures["shift_loss"] = figure_or_error("shift_loss", shift_loss_figure, variants)
        figures["shift_divergence"] = figure_or_error("shift_divergence", shift_divergence_figure, variants)
    with_sink = {key: value for key, value in variants.items() if _has_sink_mass(value)}
    if name in with_sink:
        figures["shift_sink"] = figure_or_error("shift_sink", shift_sink_figure, with_sink)
    with_massive = {key: value for key, value in variants.items() if _has_massive(value)}
    if name in with_massive:
        figures["shift_massive"] = figure_or_error("shift_massive", shift_massive_figure, with_massive)
    if result.config.components and all(other.config.components for other in variants.values()):
        figures["shift_attribution"] = figure_or_error("shift_attribution", shift_attribution_figure, variants)
    if result.config.patch_components:
        figures["shift_patching"] = figure_or_error("shift_patching", shift_patching_figure, result)
    return figures


# -- one head at two offsets (CircuitsVis) ------------------------------------------------------------------
@dataclass(frozen=True)
class ShiftView:
    """One head's attention among a segment's own tokens at two offsets.

    Attributes:
        tokens: ``[m]`` the segment's token strings.
        head: ``(layer, head)``.
        offsets: the two offsets ``(s₁, s₂)``.
        conditional: ``[2, m, m]`` weights conditional on the segment's keys ``a_ij / Σ_j' a_ij'`` at each offset.
        centred: ``[2, m, m]`` centred logits ``score_ij − mean_j' score_ij'`` at each offset.
        entries: ``[m, m]`` the counted entries (visible keys, rows with at least two); 0 elsewhere.
        causal: whether queries see only earlier keys.
        title: a caption (model, segment, context, mode).
        decimals: values are rounded to this many decimals when rendered (``None``: not rounded).
    """

    tokens: list[str]
    head: tuple[int, int]
    offsets: tuple[int, int]
    conditional: np.ndarray
    centred: np.ndarray
    entries: np.ndarray
    causal: bool = True
    title: str = ""
    decimals: int | None = 3

    @property
    def label(self) -> str:
        return f"L{self.head[0]}H{self.head[1]}"

    @property
    def change(self) -> np.ndarray:
        """``[m, m]`` the centred logits at ``s₂`` minus at ``s₁`` (nats): what moving the text did to this head."""
        return self.centred[1] - self.centred[0]

    @property
    def logit_limit(self) -> float:
        """The colour range ``±limit`` of the centred logits and their change: the largest magnitude shown."""
        return max(float(np.abs(self.centred).max()), float(np.abs(self.change).max())) or 1.0

    def _round(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        return values if self.decimals is None else np.round(values, self.decimals) + 0.0  # + 0.0: no "-0.0"

    def _rows(self) -> list[list[tuple[str, CircuitsVisFigure]]]:
        """Two rows of side-by-side heat maps: the conditional weights at both offsets; the centred logits at both
        offsets and their change."""
        first, second = self.offsets
        weights = [(f"{self.label} at offset {offset}: a_ij / Σ_j' a_ij'",
                    attention_pattern_figure(self._round(values), self.tokens, max_value=1.0, min_value=0.0,
                                             mask_upper_tri=self.causal))
                   for offset, values in zip(self.offsets, self.conditional)]
        logits = {f"{self.label} centred logits at offset {first}": self.centred[0],
                  f"{self.label} centred logits at offset {second}": self.centred[1],
                  f"{self.label} change from offset {first} to {second}": self.change}
        limit = self.logit_limit
        centred = [(caption, attention_pattern_figure(self._round(values), self.tokens, max_value=limit,
                                                      min_value=-limit, positive_color="red", negative_color="blue",
                                                      mask_upper_tri=self.causal))
                   for caption, values in logits.items()]
        return [weights, centred]

    def _layout(self) -> tuple[list[tuple[str, CircuitsVisFigure]], Markup]:
        rows = self._rows()
        limit = self.logit_limit
        layout = Markup(
            "<h4>Attention among the segment's tokens, conditional on its keys, at offsets {} and {}</h4>{}"
            "<h4>Centred logits (nats; red above the row's mean, blue below; colours saturate at ±{}) "
            "at both offsets, and their change: what this head's offset η² measures</h4>{}"
        ).format(self.offsets[0], self.offsets[1], figure_row(rows[0]), f"{limit:.3g}", figure_row(rows[1]))
        return [figure for row in rows for figure in row], layout

    def _caption(self) -> Markup:
        rounding = "not rounded" if self.decimals is None else f"rounded to {self.decimals} decimals"
        return Markup("<p>{} Head {}; the segment's {} tokens as queries and keys; entries outside the counted block "
                      "(hidden keys, rows with one key) are 0; values {}.</p>").format(
            self.title, self.label, len(self.tokens), rounding)

    def body_html(self) -> Markup:
        """The view without the CircuitsVis bundle (a page that already ran it, as the report)."""
        figures, layout = self._layout()
        return views_body_html(self._caption(), figures, "shift-view", layout)

    def to_html(self) -> Markup:
        """The view as one offline HTML fragment carrying the CircuitsVis bundle once."""
        figures, layout = self._layout()
        return views_html(self._caption(), figures, "shift-view", layout)

    def _repr_html_(self) -> str:
        return self.to_html()

    def save(self, path: str | Path) -> Path:
        """Write a standalone, offline HTML page with the view, atomically.

        Raises:
            FileWriteError: the folder does not exist or is not writable, ``path`` is a folder, or the disk
                refused the write (nothing is left behind).
        """
        return save_views_page(path, "shift view", self.to_html())

    def __repr__(self) -> str:
        return f"ShiftView({self.label}; offsets {self.offsets[0]} and {self.offsets[1]}; {len(self.tokens)} tokens)"


def most_moved_head(result: ShiftResult) -> tuple[int, int]:
    """The head whose centred logits owe the largest share to the offset (undefined shares skipped)."""
    shares = np.nan_to_num(result.share("centred_logits", "offset", by="head"), nan=-1.0)
    layer, head = np.unravel_index(int(np.argmax(shares)), shares.shape)
    return int(layer), int(head)


def shift_view(model: Any, segments: Sequence[Any], contexts: Sequence[Any] | None = None, *,
               head: tuple[int, int] | str | None = None, offsets: Sequence[int] | None = None,
               result: ShiftResult | None = None, segment: int = 0, context: int = 0,
               segment_length: int | None = None, mode: str | None = None, decimals: int | None = 3,
               tokenizer: Any | None = None) -> ShiftView:
    """One head's segment block at two offsets, from two forward passes of the model.

    The windows are the shift test's (:class:`~equivariance_probe.ShiftGrid`): the tokenizer's special prefix,
    the first ``s`` tokens of context ``context`` and segment ``segment`` (``mode="position_ids"``: the prefix and
    segment with position ids from ``s``). The block is captured as the shift run captures it
    (:func:`~equivariance_probe.features.segments.capture_segment_batch`, the run's own capture loop: scores from the
    queries and keys the model's own kernel receives, turned into the run's representations).

    Args:
        model: an :class:`~equivariance_probe.EquivarianceProbe`, or any model it accepts.
        segments: as given to :meth:`~equivariance_probe.EquivarianceProbe.shift`.
        contexts: as given to :meth:`~equivariance_probe.EquivarianceProbe.shift`.
        head: ``(layer, head)`` or ``"L3H1"`` (default: ``result``'s head with the largest offset η² of the
            centred logits).
        offsets: two offsets (default: ``result``'s smallest and largest).
        result: the shift run on these texts: the default head, offsets, segment length and mode.
        segment: which segment.
        context: which context precedes it.
        segment_length: default ``result``'s (else 64).
        mode: default ``result``'s (else ``"text"``).
        decimals: round rendered values (``None``: full precision).
        tokenizer: for a plain Hugging Face model, its tokenizer.

    Example:
        >>> view = shift_view(probe, segments, contexts, result=result)  # doctest: +SKIP
        >>> view.save("shift_view.html")  # doctest: +SKIP
    """
    probe = model if isinstance(model, EquivarianceProbe) else EquivarianceProbe(model, tokenizer=tokenizer)
    adapter = probe.adapter
    layout = adapter.layout
    if isinstance(head, str):
        parsed = parse_heads(head)
        if len(parsed) != 1:
            raise InputError(f"head={head!r} names {len(parsed)} heads; the view shows one, e.g. 'L3H1'")
        head = parsed[0]
    if head is None:
        if result is None:
            raise InputError("no head to view: pass head=(layer, head), or result= to view the head the offset moves most")
        head = most_moved_head(result)
    if isinstance(head, (str, bytes)) or not isinstance(head, Sequence) or len(head) != 2:
        raise InputError(f"head={head!r} is not a (layer, head) pair; pass {option('head', 'L3H1')}")
    layer = check_index("head", head[0], example="L3H1")
    index = check_index("head", head[1], what="head", example="L3H1")
    if not (layer < layout.n_layers and index < layout.n_heads):
        raise InputError(f"head L{layer}H{index} does not exist: this model has layers 0..{layout.n_layers - 1} and heads "
                         f"0..{layout.n_heads - 1}; pass a head within those ranges")
    if offsets is None:
        if result is None:
            raise InputError("no offsets to view: pass offsets=(s1, s2), or result= to view its smallest and largest")
        offsets = (result.offsets[0], result.offsets[-1])
    offsets = tuple(int(s) for s in offsets)
    if len(offsets) != 2 or offsets[0] == offsets[1]:
        raise InputError(f"offsets={list(offsets)} must be two different offsets, e.g. (0, 512)")
    segment_length = segment_length or (result.config.segment_length if result is not None else 64)
    mode = mode or (result.mode if result is not None else "text")
    segments, contexts = list(segments), None if contexts is None else list(contexts)
    for what, items, chosen in (("segment", segments, segment), ("context", contexts or [None], context)):
        if not 0 <= chosen < len(items):
            raise InputError(f"{what}={chosen} is not one of the {len(items)} {what}s given; pass an index below {len(items)}")
    grid = shift_grid([segments[segment]], contexts, adapter.tokenizer, offsets=offsets, segment_length=segment_length,
                      mode=mode, max_context=layout.max_context)
    entries = [counted_entries(segment_length, layout.causal, window) for window in layout.sliding_windows]
    conditional, centred = np.zeros((2, segment_length, segment_length)), np.zeros((2, segment_length, segment_length))
    for row, offset in enumerate(offsets):
        captured: dict[str, torch.Tensor] = {}

        def add(name: str, at: int, offset_index: int, values: torch.Tensor) -> None:
            if at == layer and name in ("conditional_weights", "centred_logits"):
                captured[name] = values[index]

        capture_segment_batch(adapter, grid.batch(0, context, [grid.offsets.index(offset)]), segment_length, entries, add)
        conditional[row][entries[layer].numpy()] = captured["conditional_weights"].cpu().numpy()
        centred[row][entries[layer].numpy()] = captured["centred_logits"].cpu().numpy()
    where = "position ids moved" if mode == "position_ids" else f"after context {context}"
    return ShiftView(tokens=_token_strings(adapter, grid.segments[0].tolist()), head=(layer, index), offsets=offsets,
                     conditional=conditional, centred=centred, entries=entries[layer].numpy(), causal=layout.causal,
                     title=f"Model {result.model_name if result is not None else adapter.model_name}, segment "
                           f"{segment} ({where}).", decimals=decimals)


# -- the report ---------------------------------------------------------------------------------------------
def shift_report_section(result: ShiftResult, baselines: Mapping[str, ShiftResult] | None = None, *,
                         view: ShiftView | None = None, name: str = "trained") -> ReportSection:
    """The shift test in the HTML report: its numbers as tables, a column per variant, long ones largest first with
    the rest folded (:func:`~equivariance_probe.display.shift_tables.shift_tables_html`), the differences from the
    baselines, the figures (:func:`shift_figures`, each captioned with whether it draws intervals) and, when given,
    the CircuitsVis view (drawn from the bundle the report carries once)."""
    variants = {name: result, **dict(baselines or {})}
    captions = _captions(result, variants, name)
    figures = {captions[key]: figure for key, figure in shift_figures(result, baselines, name).items()}
    body = Markup("<p>The same texts placed after other contexts at offsets {}; {}. Each representation's variation "
                  "is split exactly into what depends on the pair of tokens (equivariant), the offset, the context and "
                  "the rest.</p>{}{}{}").format(list(result.offsets), _offset_meaning(result), shift_tables_html(variants),
                                                _differences_html(result, baselines or {}, name), figures_html(figures))
    if view is not None:
        body += Markup("<h3>One head's segment block at two offsets (CircuitsVis)</h3>") + view.body_html()
    return ReportSection("The shift test: the same text moved through the window", body,
                         uses_circuitsvis=view is not None)


def _captions(result: ShiftResult, variants: Mapping[str, ShiftResult], name: str) -> dict[str, str]:
    """Each figure's caption, saying what it draws and whether its bars are intervals, from the same variants and
    the same test (:func:`~equivariance_probe.display.shift_parts._interval_note`) as the figure's own title."""
    sinks = {key: value for key, value in variants.items() if _has_sink_mass(value)} or variants
    massive = {key: value for key, value in variants.items() if _has_massive(value)} or variants
    drawn = {"variants": _interval_note(variants), "sinks": _interval_note(sinks).replace("bars", "bands"),
             "massive": _interval_note(massive).replace("bars", "bands"),
             "alone": _interval_note({name: result})}
    return {
        "shift_layers": f"Offset η² by layer, centred logits and residual stream, each variant ({drawn['variants']})",
        "shift_heads": f"Per-head offset η² and pair η² (the equivariant part) of the centred logits, {name} "
                       "(estimates: a heat map draws no intervals)",
        "shift_loss": f"Next-token loss on the segment by offset ({drawn['variants']})",
        "shift_divergence": "Jensen–Shannon divergence between offsets against between contexts, and their ratio "
                            f"({drawn['variants']})",
        "shift_sink": "Mean attention weight of the segment's rows on the window's first key and on the rest of the "
                      f"text before the segment, by offset and layer group ({drawn['sinks']})",
        "shift_massive": "The residual stream's largest magnitude over its median at the segment's first token and at "
                         f"its other tokens, by offset, at the block where it peaks ({drawn['massive']})",
        "shift_attribution": "Each component's share of the residual stream's offset and context sums of squares after "
                             f"the target blocks ({drawn['variants']})",
        "shift_patching": f"Activation patching, {name}: the share of the prediction change that goes away when a "
                          f"component's output at the segment is the reference offset's ({drawn['alone']})",
    }


def _differences_html(result: ShiftResult, baselines: Mapping[str, ShiftResult], name: str) -> Markup:
    """The model's offset and pair η² minus each baseline's over the same segments, with 95 % intervals from
    paired jackknife replicates (:meth:`~equivariance_probe.ShiftResult.paired_difference`)."""
    if not baselines:
        return Markup("")
    rows, notes = [], []
    for representation in REPRESENTATIONS:
        for term in ("offset", "pair"):
            cells = []
            for baseline_name, baseline in baselines.items():
                try:
                    cells.append(str(result.paired_difference(baseline, representation, term, level=INTERVAL_LEVEL)))
                except (IncompatibleResultsError, IntervalUnavailableError) as error:
                    cells.append("—")
                    notes.append(f"{baseline_name}: {error}")
            rows.append((_REPRESENTATION_NAMES[representation], f"{term} η²", cells))
    columns = [f"{name} − {baseline_name}" for baseline_name in baselines]
    remarks = Markup("").join(Markup("<p>{}</p>").format(note) for note in dict.fromkeys(notes))
    return Markup("<h3>Differences over the same segments</h3><p>Each difference with its 95 % interval from paired "
                  "jackknife replicates (the same segments in the same groups, so what they share cancels).</p>{}{}"
                  ).format(table_html(columns, rows, "shift-differences"), remarks)


def render_shift_report(result: ShiftResult, baselines: Mapping[str, ShiftResult] | None = None, *,
                        view: ShiftView | None = None, name: str = "trained") -> RenderedReport:
    """A self-contained offline HTML page holding :func:`shift_report_section` (CircuitsVis' bundle once): a
    :class:`~equivariance_probe.display.report.RenderedReport` that a notebook draws and ``save(path)`` writes."""
    if result.n_segments == 0:
        raise NotRunError("this shift result holds no segment yet: run probe.shift(segments, contexts) before reporting it")
    section = shift_report_section(result, baselines, view=view, name=name)
    return sections_page(f"equivariance_probe shift test: {result.model_name}",
                         f"Equivariance probe, shift test: {result.model_name}", [section])
