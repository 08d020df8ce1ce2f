"""The shift test's mechanisms on screen: where the segment's attention goes before it (sink mass), which
components write the residual stream's offset effect (attribution), and what patching each one removes.

Place in the seams: *display*, drawing only, beside :mod:`~equivariance_probe.display.shift` (which lists these
figures in :func:`~equivariance_probe.display.shift.shift_figures` and re-exports them). Every number comes from
:meth:`~equivariance_probe.ShiftResult.sink_mass`, :meth:`~equivariance_probe.ShiftResult.attribution` and
:meth:`~equivariance_probe.ShiftResult.patching`, with its jackknife interval over segments where there are at
least two groups of segments.

* :func:`shift_sink_figure` — the attention the segment's rows put on the window's first key and on the rest of
  the text before it, by offset, one line per layer group (:func:`sink_layer_groups`).
* :func:`shift_massive_figure` — the residual stream's largest magnitude over its median at the segment's first
  token and at its other tokens, by offset, at the block where it peaks (Sun et al.'s massive activations).
* :func:`shift_attribution_figure` — each component's share of the residual stream's offset and context sums
  of squares after the target blocks (a run with attribution), with intervals.
* :func:`shift_patching_figure` — the share of the prediction change that patching each component recovers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UndefinedStatisticError, check_indices
from ..maths.intervals import Interval
from ..shift_result import ShiftResult, measured_terms
from ..shift_result.mechanisms import patched_kind
from .figures import _axes_title, figure_title, one_result, pyplot
from .shift_parts import _interval_note, _number, _offset_meaning, _titled, _variants, _with_interval

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["shift_sink_figure", "sink_layer_groups", "shift_massive_figure", "shift_attribution_figure", "shift_patching_figure"]


def sink_layer_groups(result: ShiftResult) -> dict[str, tuple[int, ...]]:
    """The layer groups of :func:`shift_sink_figure`: sliding-window and global layers for a model with both (Gemma
    3), else every layer of a model with at most 4, else the thirds of its depth."""
    groups = result.layer_groups()
    if "sliding" in groups:
        return {f"{name} layers": layers for name, layers in groups.items() if name != "all"}
    n_layers = result.config.n_layers
    if n_layers <= 4:
        return {f"layer {layer}": (layer,) for layer in range(n_layers)}
    thirds = np.array_split(np.arange(n_layers), 3)
    return {f"layers {int(part[0])}–{int(part[-1])}": tuple(int(layer) for layer in part) for part in thirds}


def shift_sink_figure(results: ShiftResult | Mapping[str, ShiftResult],
                      baselines: Mapping[str, ShiftResult] | None = None) -> Figure:
    """Two panels by offset: the mean attention weight of the segment's rows on the window's first key (the BOS
    sink where the tokenizer puts one first) and on the rest of the text before the segment, one line per layer
    group (:func:`sink_layer_groups`) and variant (solid for the first, then dashed and dotted), with 95 %
    interval bands over segments."""
    plt = pyplot()
    variants = _variants(results, baselines, where="shift_sink_figure")
    first = next(iter(variants.values()))
    groups = sink_layer_groups(first)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False)
    panels = (("first_key", "first key of the window"), ("preceding", "rest of the text before the segment"))
    for ax, (part, what) in zip(axes[0], panels):
        for number, (name, result) in enumerate(variants.items()):
            style = ("-", "--", ":")[number % 3]
            means = _number(result.sink_mass, part, by="layer_group", layer_groups=groups)
            for index, (group, value) in enumerate(means.items()):
                _by_offset(ax, result.offsets, value, ..., style, colours[index % len(colours)],
                           group if len(variants) == 1 else f"{name}: {group}")
        ax.set_ylim(bottom=0)
        _offset_axes(ax, "mean attention weight", f"on the {what}")
    return _offset_figure(fig, "Attention the segment puts before itself", variants)


def shift_massive_figure(results: ShiftResult | Mapping[str, ShiftResult],
                         baselines: Mapping[str, ShiftResult] | None = None, *, layer: int | None = None) -> Figure:
    """The residual stream's largest magnitude over its median at the segment, by offset
    (:meth:`~equivariance_probe.ShiftResult.massive`): at the segment's first token (solid) and at its other tokens
    (dashed), one colour per variant, on a log scale, at block ``layer`` (default: where the first variant's
    largest ratio peaks), with 95 % interval bands over segments. A first-token line far above the other at offset
    0 alone is a massive activation that stays at the window's first position; one far above at every offset
    moves with the text."""
    plt = pyplot()
    variants = _variants(results, baselines, where="shift_massive_figure")
    first = next(iter(variants.values()))
    if layer is None:
        ratio = np.fmax(first.massive("first_ratio"), first.massive("rest_ratio"))
        layer = int(np.nanargmax(np.nanmax(ratio, axis=1))) if np.isfinite(ratio).any() else 0
    layer = check_indices("layer", [layer], first.config.n_layers)[0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for number, (name, result) in enumerate(variants.items()):
        colour = colours[number % len(colours)]
        for part, style, where in (("first_ratio", "-", "first token"), ("rest_ratio", "--", "other tokens")):
            _by_offset(ax, result.offsets, _number(result.massive, part), layer, style, colour,
                       where if len(variants) == 1 else f"{name}: {where}")
    ax.set_yscale("log")
    _offset_axes(ax, "largest |h| / median |h|", f"residual stream after block {layer}, at the segment's tokens")
    return _offset_figure(fig, "Massive activations", variants)


def _offset_axes(ax: Any, ylabel: str, title: str) -> None:
    """A panel of lines by offset: its labels, title and legend."""
    ax.set_xlabel("offset s (tokens of context before the segment)")
    ax.set_ylabel(ylabel)
    _axes_title(ax, title, fontsize=9)
    ax.legend(fontsize=8)


def _offset_figure(fig: Figure, what: str, variants: Mapping[str, ShiftResult]) -> Figure:
    """A figure of lines by offset, titled with the first variant's model, the bands' meaning and the offset's."""
    first = next(iter(variants.values()))
    figure_title(fig, f"{what}, by offset: {first.model_name} "
                      f"({_interval_note(variants).replace('bars', 'bands')}; {_offset_meaning(first)})")
    fig.tight_layout()
    return fig


def _by_offset(ax: Any, offsets: Sequence[int], value: Any, pick: Any, style: str, colour: str, label: str) -> None:
    """One line by offset, ``value[pick]`` (an estimate, or an :class:`~equivariance_probe.Interval` drawn with its
    band)."""
    estimate, _ = _with_interval(value)
    ax.plot(offsets, estimate[pick], style, marker="o", ms=3, color=colour, label=label)
    if isinstance(value, Interval):
        ax.fill_between(offsets, np.asarray(value.low, dtype=np.float64)[pick],
                        np.asarray(value.high, dtype=np.float64)[pick], color=colour, alpha=0.15, lw=0)


def shift_attribution_figure(results: ShiftResult | Mapping[str, ShiftResult],
                             baselines: Mapping[str, ShiftResult] | None = None, *,
                             layers: Sequence[int] | None = None, terms: Sequence[str] | None = None) -> Figure:
    """Each component's share of the residual stream's sum of squares after each target block
    (:meth:`~equivariance_probe.ShiftResult.attribution`): one panel per term and block, one bar per component and
    variant, with 95 % intervals over segments. Heads (where the run split layers into heads) follow the blocks,
    hatched: a head's share is a part of its attention's."""
    plt = pyplot()
    variants = _variants(results, baselines, where="shift_attribution_figure")
    first = next(iter(variants.values()))
    layers = first.attribution_layers() if layers is None else check_indices("layers", layers, first.config.n_layers)
    terms = tuple(terms or measured_terms(first.mode))
    panels = [(term, layer) for term in terms for layer in layers]
    width = max(6.0, 0.22 * len(first.config.components) * len(variants) + 2)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 3.2 * len(panels)), squeeze=False)
    for ax, (term, layer) in zip(axes[:, 0], panels):
        for number, (name, result) in enumerate(variants.items()):
            shares = _number(result.attribution, layer, term)[layer]
            components = list(shares)
            estimate, error = _with_interval(_stacked(list(shares.values())))
            positions = np.arange(len(components)) + 0.8 * (number + 0.5) / len(variants) - 0.4
            bars = ax.bar(positions, estimate, width=0.8 / len(variants), yerr=error, capsize=2, label=name)
            for bar, component in zip(bars, components):
                if component.startswith("head."):
                    bar.set_hatch("//")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xticks(range(len(components)))
        ax.set_xticklabels(components, rotation=90, fontsize=7)
        ax.set_ylabel("share")
        _axes_title(ax, f"{term} sum of squares of the residual stream after block {layer}")
        ax.legend(fontsize=8)
    return _titled(fig, None, f"Attribution, {first.model_name}: what each component writes of the residual "
                   "stream's variation (block-level shares sum to 1)", variants, f"; {_offset_meaning(first)}")


def _stacked(values: Sequence[Any]) -> Any:
    """Per-component numbers as one: an :class:`~equivariance_probe.Interval` of arrays where they are intervals."""
    if values and isinstance(values[0], Interval):
        first = values[0]
        return Interval(*(np.array([getattr(v, key) for v in values]) for key in ("estimate", "low", "high")),
                        first.level, first.n_groups, np.array([v.standard_error for v in values]), first.method)
    return np.asarray(values, dtype=np.float64)


def _bars(numbers: Sequence[Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`_with_interval` of several numbers (all intervals, or all estimates) side by side."""
    pairs = [_with_interval(number) for number in numbers]
    estimate = np.array([float(value) for value, _ in pairs])
    if any(error is None for _, error in pairs):
        return estimate, None
    return estimate, np.stack([error for _, error in pairs], axis=1)


def shift_patching_figure(result: ShiftResult) -> Figure:
    """Activation patching: per layer, the share of the prediction change recovered by patching the block's
    attention and its MLP (the reference offset's outputs at the segment), side by side, with 95 % intervals;
    heads and other items patched in the run in a second panel."""
    result = one_result(result, ShiftResult, where="shift_patching_figure")
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    measure = "recovered" if result.config.predictions else "residual_removed"
    numbers = _number(result.patching, measure)
    kinds = {item: patched_kind(item) for item in numbers}  # a combined item ("attention.1+mlp.1") is one of the others
    blocks = {kind: {kinds[item][1]: value for item, value in numbers.items() if kinds[item][0] == kind}
              for kind in ("attention", "mlp")}
    others = {item: value for item, value in numbers.items() if kinds[item][0] not in blocks}
    panels = int(any(blocks.values())) + int(bool(others))
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    ylabel = ("share of the prediction change recovered" if measure == "recovered"
              else "share of the last block's residual offset SS removed")
    if any(blocks.values()):
        ax = axes.pop(0)
        for shift, kind, color in ((-0.2, "attention", "tab:blue"), (0.2, "mlp", "tab:orange")):
            if not blocks[kind]:
                continue
            layers = sorted(blocks[kind])
            values = [blocks[kind][layer] for layer in layers]
            estimate, error = _bars(values)
            ax.bar(np.array(layers) + shift, estimate, 0.4, yerr=error, capsize=2, color=color, label=kind)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        _axes_title(ax, "each block's attention and MLP patched alone")
    if others:
        ax = axes.pop(0)
        estimate, error = _bars(list(others.values()))
        ax.bar(range(len(others)), estimate, yerr=error, capsize=2, color="tab:green")
        ax.set_xticks(range(len(others)), [item if len(item) < 24 else item[:21] + "..." for item in others],
                      rotation=60, ha="right", fontsize=7)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_ylabel(ylabel)
        _axes_title(ax, "other patched items")
    reference = result.offsets[result.config.patch_reference]
    return _titled(fig, None, f"Activation patching, {result.model_name}: each component's output at the segment "
                              f"taken from the window at offset {reference}", {result.model_name: result})


def _defined(read: Callable[[], Any]) -> bool:
    """Whether a statistic the result reads (``result.sink_mass``, ``result.massive``) is defined for it: a file
    written before it was measured raises :class:`UndefinedStatisticError`."""
    try:
        read()
    except UndefinedStatisticError:
        return False
    return True


def _has_sink_mass(result: ShiftResult) -> bool:
    return _defined(result.sink_mass)


def _has_massive(result: ShiftResult) -> bool:
    return _defined(result.massive)
