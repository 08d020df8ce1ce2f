"""The study's figures, drawn with matplotlib from a :class:`ProbeResult`.

Place in the seams: *display*, rendering only: every number comes from the result's methods.
matplotlib is imported when a figure is drawn, never at package import.

* ``persistence``  — Fig. 1a: ``P(dt)`` with power, exponential and uniform-prior fits.
* ``head_curves``  — Fig. 1b: ``P(dt)`` of every head.
* ``fit_by_key``   — Fig. 1c: R² of each fit to ``P_t(dt)`` against key position ``t`` (one
  panel per result: trained and its baselines side by side).
* ``scatter``      — Fig. 1d: attention against the uniform prior, log-log, from the
  run's bounded entry sample, with the query-position R² in the title.
* ``heatmaps``     — per-head query-position R² (log, fitted) and Toeplitz R².
* ``first_token``  — the first token's mean weight ``α₁`` of every head (attention sinks, Gu et
  al. ICLR 2025), one panel per result.
* ``sink_rate``    — Gu et al.'s sink rate by layer: the share of (window, head) pairs with ``α₁ > ε``, one
  line per result.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping, Sequence
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EquivarianceProbeError, FigureError, InputError, SupersededSumsError, option
from ..maths.sinks import SINK_EPSILON
from ..records.fileformat import make_folder, write_bytes_atomically

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from ..result import ProbeResult

__all__ = [
    "figure_or_error",
    "persistence_figure",
    "head_curves_figure",
    "fit_by_key_figure",
    "scatter_figure",
    "heatmaps_figure",
    "first_token_figure",
    "sink_rate_figure",
    "sink_rate_of",
    "study_figures",
    "save_figures",
    "figure_formats",
    "figure_paths",
    "figure_bytes",
    "FIGURE_FORMATS",
    "pyplot",
    "log_log_axes",
    "fitted_title",
    "figure_title",
    "variant_columns",
]

_FIT_STYLE = {"power": ("tab:orange", "--"), "exponential": ("tab:green", ":"), "prior": ("black", "-.")}


def pyplot() -> Any:
    """``matplotlib.pyplot``, on the Agg backend unless a display backend (a notebook's) is in use."""
    import matplotlib

    if "MPLBACKEND" not in os.environ and matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        # Scripts and CI have no display; notebooks keep their inline backend.
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fitted_title(text: str, width_inches: float, fontsize: float) -> str:
    """``text`` wrapped into lines that fit ``width_inches`` at ``fontsize`` points.

    matplotlib centres a title and clips whatever runs past the figure's edges; an average
    character is about 0.55 em wide, so a line holds ``72·width / (0.55·fontsize)`` characters.
    """
    characters = max(12, int(72 * width_inches / (0.55 * fontsize)))
    return "\n".join(textwrap.wrap(text, characters)) or text


def figure_title(fig: Any, text: str, fontsize: float = 11) -> None:
    """A figure title (``suptitle``) wrapped to the figure's width, so that no caption is clipped."""
    fig.suptitle(fitted_title(text, fig.get_figwidth(), fontsize), fontsize=fontsize)


def _axes_title(ax: Any, text: str, fontsize: float = 10) -> None:
    ax.set_title(fitted_title(text, ax.get_position().width * ax.figure.get_figwidth(), fontsize), fontsize=fontsize)


def log_log_axes(ax: Any, title: str) -> None:
    """Persistence axes: log distance ``dt + 1`` against log mean attention."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distance dt + 1")
    ax.set_ylabel("mean attention")
    _axes_title(ax, title)
    ax.legend(fontsize=8)


def _label(result: ProbeResult) -> str:
    """A result's name in a figure: its study variant with the model (``gemma-3-270m (trained)``)
    or the model alone, as the user named it."""
    variant = result.metadata.get("label")
    return f"{result.model_name} ({variant})" if variant else result.model_name


def _probe_result() -> type:
    from ..result import ProbeResult

    return ProbeResult


def _results(results: ProbeResult | Mapping[str, ProbeResult], baselines: Mapping[str, ProbeResult] | None = None,
             *, where: str) -> dict[str, ProbeResult]:
    """``{name: result}`` as every figure of several variants takes them (:func:`variants_of`); a single result
    alone is named by :func:`_label`."""
    from ..result import ProbeResult

    if isinstance(results, ProbeResult) and not baselines:
        return {_label(results): results}
    return variants_of(results, baselines, ProbeResult, where=where)


def variants_of(results: Any, baselines: Mapping[str, Any] | None, kind: type, *, where: str) -> dict[str, Any]:
    """``{name: result}`` of results of ``kind``: ``results`` one result (named by its study variant, else its
    model) followed by ``baselines``, or a mapping of variants (``baselines`` then ``None``).

    Raises:
        InputError: a value that is not a ``kind``, or a mapping of variants beside ``baselines``.
    """
    usage = (f"{where} takes a {kind.__name__} and its baselines ({where}(result, {{'random_init': baseline}})) "
             f"or one mapping of variants ({where}({{'trained': result, 'random_init': baseline}}))")
    if isinstance(results, Mapping):
        if baselines:
            raise InputError(f"{usage}, not both: got a mapping of variants and baselines={sorted(baselines)}")
        variants = dict(results)
    elif isinstance(results, kind):
        study = results.metadata.get("study") if isinstance(results.metadata.get("study"), Mapping) else {}
        variants = {str(study.get("variant") or study.get("label") or results.metadata.get("label")
                        or results.model_name): results}
        if baselines is not None and not isinstance(baselines, Mapping):
            raise InputError(f"{usage}; got baselines of type {type(baselines).__name__}")
        variants.update(baselines or {})
    else:
        raise InputError(f"{usage}; got {type(results).__name__}")
    wrong = {name: type(value).__name__ for name, value in variants.items() if not isinstance(value, kind)}
    if wrong or not variants:
        raise InputError(f"{usage}; got {wrong or 'an empty mapping'}")
    return variants


def one_result(result: Any, kind: type, *, where: str) -> Any:
    """``result`` for a figure of one result; a mapping of variants is refused with what to pass instead.

    Raises:
        InputError: ``result`` is not a ``kind``.
    """
    if not isinstance(result, kind):
        example = f" (e.g. {where}(variants['trained']), once per variant)" if isinstance(result, Mapping) else ""
        raise InputError(f"{where} draws one {kind.__name__}, not {type(result).__name__}: pass the result "
                         f"itself{example}")
    return result




def persistence_figure(results: ProbeResult | Mapping[str, ProbeResult],
                       baselines: Mapping[str, ProbeResult] | None = None) -> Figure:
    """Fig. 1a: mean attention by distance with its three fits, one panel per result."""
    plt = pyplot()
    results = _results(results, baselines, where="persistence_figure")
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), squeeze=False)
    for ax, (label, result) in zip(axes[0], results.items()):
        curves = result.persistence()
        has = curves.count > 0
        dt = curves.dt[has]
        ax.plot(dt + 1, curves.curve[has], color="tab:blue", lw=2, label="P(dt)")
        for name, fit in curves.fits.items():
            color, style = _FIT_STYLE[name]
            if fit.status == "failed":  # no curve to draw: the legend says why
                ax.plot([], [], color=color, ls=style, label=f"{name}: no fit ({fit.note})")
                continue
            bound = " at its bound, no decay" if fit.status == "at_bound" else ""
            ax.plot(dt + 1, fit.prediction, color=color, ls=style, label=f"{name} (R²={fit.r2:.3f}{bound})")
        # The axes show the data's range.
        values = np.concatenate([curves.curve[has], curves.prior[has]])
        values = values[values > 0]
        if values.size:
            ax.set_ylim(values.min() / 3, values.max() * 3)
        log_log_axes(ax, label)
    model = next(iter(results.values())).model_name
    figure_title(fig, f"Persistence of {model}: mean attention a[t+dt, t] over windows, t, layers and heads")
    fig.tight_layout()
    return fig


def head_curves_figure(result: ProbeResult) -> Figure:
    """Fig. 1b: ``P(dt)`` of every head, coloured by layer, with the uniform prior."""
    result = one_result(result, _probe_result(), where="head_curves_figure")
    plt = pyplot()
    curves = result.persistence(by="head")
    overall = result.persistence()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    cmap = plt.get_cmap("viridis")
    n_layers, n_heads = curves.shape
    for layer in range(n_layers):
        for head in range(n_heads):
            has = curves.count[layer, head] > 0
            ax.plot(curves.dt[has] + 1, curves.curve[layer, head][has], color=cmap(layer / max(n_layers - 1, 1)), lw=0.6, alpha=0.6)
    has = overall.count > 0
    ax.plot(overall.dt[has] + 1, overall.prior[has], color="black", ls="-.", lw=1.5, label="uniform prior")
    log_log_axes(ax, f"{_label(result)}: per-head persistence (colour = layer 0..{n_layers - 1})")
    fig.tight_layout()
    return fig


def fit_by_key_figure(results: ProbeResult | Mapping[str, ProbeResult],
                      baselines: Mapping[str, ProbeResult] | None = None, *,
                      bins: int = 16) -> Figure:
    """Fig. 1c: R² of the power, exponential and prior fits to ``P_t(dt)`` by key position bin,
    one panel per result (a study's trained model and its baselines side by side)."""
    plt = pyplot()
    results = _results(results, baselines, where="fit_by_key_figure")
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (label, result) in zip(axes[0], results.items()):
        curves = result.persistence(by="key_position", bins=min(bins, result.context_length))
        centres = 0.5 * (curves.key_bins[:-1] + curves.key_bins[1:] - 1)
        for name in ("power", "exponential", "prior"):
            color, style = _FIT_STYLE[name]
            ax.plot(centres, curves.r2(name), color=color, ls=style, marker="o", ms=3, label=name)
        ax.set_xlabel("key position t (bin centre)")
        ax.set_ylabel("R² of fit to P_t(dt)")
        _axes_title(ax, f"{label}: fit quality by key position")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def scatter_figure(result: ProbeResult) -> Figure:
    """Fig. 1d: sampled attention entries against the uniform prior (log-log)."""
    result = one_result(result, _probe_result(), where="scatter_figure")
    plt = pyplot()
    sample = result.entry_sample()
    floor = result.log_floor or np.finfo(np.float32).tiny
    attention = np.maximum(sample["attention"], floor)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter(sample["prior"], attention, s=2, alpha=0.25, c=sample["layer"], cmap="viridis", rasterized=True)
    lo = sample["prior"].min()
    ax.plot([lo, 1], [lo, 1], color="black", lw=1, ls="--", label="a = u(q)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("uniform prior u(q) = 1/|V(q)|")
    ax.set_ylabel("attention a (floored at eps)")
    r2 = {form: result.query_position_r2("log", form) for form in ("prior", "fitted", "eta2")}
    _axes_title(
        ax,
        f"{_label(result)}: log scale R² prior {r2['prior']:.3f}, fitted {r2['fitted']:.3f}, η² {r2['eta2']:.3f} "
        f"({len(attention)} sampled of {result.n_entries():,} entries; R² over all entries)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def heatmaps_figure(result: ProbeResult) -> Figure:
    """Per-head query-position R² (log scale, fitted and η²) and Toeplitz R²."""
    result = one_result(result, _probe_result(), where="heatmaps_figure")
    plt = pyplot()
    panels = {
        "query-position R² (log, fitted)": result.query_position_r2("log", "fitted", by="head"),
        "query-position η² (log)": result.query_position_r2("log", "eta2", by="head"),
    }
    try:
        panels["Toeplitz R² (mean pattern)"] = result.toeplitz_r2("head")
    except Exception:  # noqa: BLE001 - runs without keep_pattern still have the per-window score
        panels["Toeplitz R² (per-window mean)"] = result.toeplitz_r2("head", estimator="per_doc")
    n_layers, n_heads = result.n_layers, result.n_heads
    fig, axes = plt.subplots(1, len(panels), figsize=(3 + 2.2 * len(panels) * max(n_heads, 4) / 4, 1.5 + 0.25 * n_layers), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels.items()):
        _head_panel(fig, ax, values, title, "magma")
    figure_title(fig, f"Per-head scores: {_label(result)}")
    fig.tight_layout()
    return fig


def _head_panel(fig: Any, ax: Any, values: np.ndarray, title: str, cmap: str) -> None:
    """One ``[layer, head]`` heat map on the scale ``[0, 1]``, titled, with its colour bar."""
    image = ax.imshow(values, vmin=0, vmax=1, cmap=cmap, aspect="auto")
    _axes_title(ax, title, fontsize=9)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.colorbar(image, ax=ax)


def sink_rate_of(result: ProbeResult, epsilon: float = SINK_EPSILON, by: str | None = None) -> tuple[Any, str]:
    """``(rate, name)``: Gu et al.'s per-window sink rate, ``"sink rate"``; or, for a file written before each
    window's first-token weight was kept, its pooled sink rate, ``"pooled sink rate"``."""
    try:
        return result.sink_rate(epsilon, by=by), "sink rate"
    except SupersededSumsError:
        return result.pooled_sink_rate(epsilon, by=by), "pooled sink rate"


def first_token_figure(results: ProbeResult | Mapping[str, ProbeResult],
                       baselines: Mapping[str, ProbeResult] | None = None, *,
                       epsilon: float = SINK_EPSILON) -> Figure:
    """The first token's mean weight ``α₁`` (:meth:`~equivariance_probe.result.ProbeResult.first_token_weight`)
    of every head, one heat map per result on one scale ``[0, 1]``, with each result's sink rate at ``epsilon``."""
    plt = pyplot()
    results = _results(results, baselines, where="first_token_figure")
    first = next(iter(results.values()))
    n_layers, n_heads = first.n_layers, first.n_heads
    width = 2.2 + 2.4 * max(n_heads, 4) / 4
    fig, axes = plt.subplots(1, len(results), figsize=(width * len(results), 1.8 + 0.25 * n_layers), squeeze=False)
    for ax, (label, result) in zip(axes[0], results.items()):
        rate, name = sink_rate_of(result, epsilon)
        _head_panel(fig, ax, result.first_token_weight("head"), f"{label}: {name} {rate:.1%} (α₁ > {epsilon:g})", "viridis")
    figure_title(fig, f"Mean attention weight α₁ on the first token ({first.first_token}), per head")
    fig.tight_layout()
    return fig


def sink_rate_figure(results: ProbeResult | Mapping[str, ProbeResult],
                     baselines: Mapping[str, ProbeResult] | None = None, *,
                     epsilon: float = SINK_EPSILON) -> Figure:
    """Gu et al.'s sink rate by layer: the share of each layer's (window, head) pairs whose first-token weight
    ``α₁`` is above ``epsilon``, one line per result (the trained model and its baselines on one axes; a file
    written before the per-window weights shows its pooled rate, labelled so)."""
    plt = pyplot()
    results = _results(results, baselines, where="sink_rate_figure")
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, result in results.items():
        rate, name = sink_rate_of(result, epsilon, by="layer")
        overall, _ = sink_rate_of(result, epsilon)
        ax.plot(np.arange(len(rate)), 100 * rate, marker="o", ms=3, label=f"{label} ({name} {overall:.1%} overall)")
    ax.set_ylim(-3, 103)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"(window, head) pairs with α₁ > {epsilon:g} (%)")
    _axes_title(ax, f"Sink rate by layer (Gu et al., ICLR 2025: ε = {epsilon:g})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def study_figures(result: ProbeResult, baselines: dict[str, ProbeResult] | None = None, *,
                  sink_epsilon: float = SINK_EPSILON) -> dict[str, Figure]:
    """Every figure of the study for one result, with its baselines side by side in Fig. 1a and 1c
    (each baseline's heatmaps: :func:`heatmaps_figure`); the sink rates at ``sink_epsilon``."""
    variants = variant_columns(result, baselines)
    figures = {
        "persistence": persistence_figure(variants),
        "head_curves": head_curves_figure(result),
        "fit_by_key": fit_by_key_figure(variants),
        "heatmaps": heatmaps_figure(result),
    }
    if result.statistics.sample is not None and len(result.statistics.sample):
        figures["scatter"] = scatter_figure(result)
    if all(variant.keeps_first_token for variant in variants.values()):
        figures["first_token"] = first_token_figure(variants, epsilon=sink_epsilon)
        figures["sink_rate"] = sink_rate_figure(variants, epsilon=sink_epsilon)
    return figures


def variant_columns(result: ProbeResult, baselines: Mapping[str, ProbeResult] | None) -> dict[str, ProbeResult]:
    """Panel titles and table columns: the result's study variant (``trained``) or model name, then each baseline's name."""
    first = str(result.metadata.get("label") or result.model_name)
    return {first: result, **(baselines or {})}


#: The files a figure can be written as: PNG for screens and reports, SVG and PDF for papers.
FIGURE_FORMATS = ("png", "svg", "pdf")

#: Fonts travel with the file, so that it looks the same on a machine without this one's fonts: SVG
#: text becomes paths, PDF embeds TrueType (Type 42) fonts, which journals ask for instead of Type 3.
#: No creation date is written, so the same figure gives the same bytes.
_SAVE_SETTINGS = {"svg.fonttype": "path", "pdf.fonttype": 42, "ps.fonttype": 42, "svg.hashsalt": "equivariance_probe"}
_UNDATED = {"png": None, "svg": {"Date": None}, "pdf": {"CreationDate": None}}


def figure_formats(format: str | Sequence[str] = "png") -> tuple[str, ...]:
    """The formats ``format`` names (``"png"``, ``"png,svg,pdf"`` or a list), checked, each once, in order.

    Raises:
        InputError: an empty list or a format matplotlib is not asked to write here.

    Example:
        >>> figure_formats("png, SVG,pdf")
        ('png', 'svg', 'pdf')
    """
    names = format.split(",") if isinstance(format, str) else list(format)
    formats = tuple(dict.fromkeys(str(name).strip().lower().lstrip(".") for name in names if str(name).strip()))
    unknown = [name for name in formats if name not in FIGURE_FORMATS]
    if unknown or not formats:
        raise InputError(
            f"figure format {format!r} is not one of {', '.join(FIGURE_FORMATS)}; pass for example "
            f"{option('format', 'png,svg,pdf')}"
        )
    return formats


def figure_or_error(name: str, draw: Callable[..., Any], *args: Any) -> Any:
    """``draw(*args)``, a figure; a failure that is not already one of the package's named errors becomes a
    :class:`~equivariance_probe.errors.FigureError` that names the figure ``name`` and what failed, so that a
    caller that saved the results first can say what is kept and what was not drawn."""
    try:
        return draw(*args)
    except EquivarianceProbeError:
        raise
    except Exception as error:  # any failure inside matplotlib or our drawing code: the figure is what is lost
        raise FigureError(f"the figure {name!r} could not be drawn ({type(error).__name__}: {error})",
                          figure=name) from error


def save_figures(figures: dict[str, Any], folder: str | os.PathLike, prefix: str = "", *,
                 format: str | Sequence[str] = "png") -> list[Path]:
    """Write figures as ``{folder}/{prefix}{name}.{format}`` files, one per format, and close them.

    Every figure the package writes goes through here. SVG keeps its text as paths and PDF embeds its
    fonts (TrueType), so a file opens the same on a machine without matplotlib's fonts; PNG is drawn
    at 120 dpi. Each file is drawn in memory and written atomically, so a full disk is a
    :class:`~equivariance_probe.errors.FileWriteError` saying how many bytes the figure needed.

    Args:
        figures: ``{name: matplotlib figure}``.
        folder: Where to write (created if missing).
        prefix: Put before each name (``"baseline_zero_"``).
        format: ``"png"`` (default), ``"svg"``, ``"pdf"``, or several: ``"png,svg,pdf"`` or a list.

    Returns:
        The paths written, figure by figure, each in the order of ``format``.

    Raises:
        InputError: an unknown format (:func:`figure_formats`).

    Example:
        >>> save_figures(study_figures(result), "figures", format="png,pdf")  # doctest: +SKIP
    """
    formats = figure_formats(format)
    plt = pyplot()
    folder = Path(folder)
    make_folder(folder)
    paths = []
    for name, figure in figures.items():
        for kind in formats:
            paths.append(write_bytes_atomically(folder / f"{prefix}{name}.{kind}", figure_bytes(figure, kind)))
        plt.close(figure)
    return paths


def figure_bytes(figure: Any, kind: str = "png", *, dpi: int = 120) -> bytes:
    """One figure drawn as a ``kind`` file's bytes (``png``, ``svg`` or ``pdf``), fonts carried in the file and
    no creation date; the figure stays open. Every figure the package writes or embeds is drawn here."""
    import matplotlib

    (kind,) = figure_formats(kind)
    buffer = io.BytesIO()
    with matplotlib.rc_context(_SAVE_SETTINGS):
        figure.savefig(buffer, format=kind, dpi=dpi, metadata=_UNDATED[kind])
    return buffer.getvalue()


def figure_paths(paths: Sequence[Path]) -> dict[str, Path]:
    """The files of one figure by key for a ``paths`` mapping: ``"figure"`` for the first format
    written, ``"figure svg"``, ``"figure pdf"`` for the others."""
    return {"figure" if i == 0 else f"figure {path.suffix.lstrip('.')}": path for i, path in enumerate(paths)}
