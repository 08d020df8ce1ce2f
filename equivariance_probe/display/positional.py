"""The positional analyses on screen: figures and the HTML section of a :class:`PositionalStudy`.

Place in the seams: *display*, rendering only; matplotlib is imported when a figure is drawn
(see :mod:`equivariance_probe.display.figures`). :func:`positional_report_section` is the study
report's section (the command line adds it when a ``positional.safetensors`` lies beside the results);
:func:`render_positional_page` wraps it in a standalone page.

Figures:

* ``gram``              — heatmap of the position-embedding Gram matrix ``E_P E_Pᵀ``.
* ``positional_logits`` — per head, layer-0 positional logits (TISA Fig. 2).
* ``tisa``              — per head, the mean pre-softmax score by lag ``k = q - key`` and its kernel fit.
* ``permutation``       — KL and relative hidden-state change under permutations, per ablation.
* ``shrinkage``         — variance by position (log-log) and the fitted exponent per layer, trained vs untrained.
* ``correlation``       — position correlation matrices of the residual stream, selected layers.
* ``probe``             — held-out R² of the linear position probes by layer (position and
  ``log(1 + position)``) and their mean absolute error, trained against the random initialisation,
  with their jackknife intervals over groups of documents.
* ``massive``           — per layer, the three largest residual magnitudes and the median (log scale),
  trained against the random initialisation (Sun et al. 2024's massive activations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .figures import figure_title, fitted_title, pyplot
from ..errors import IntervalUnavailableError
from ..markup import Markup
from .report import ReportSection, figures_html, html_page

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from ..runs.positional import PositionalStudy

__all__ = [
    "gram_figure",
    "positional_logits_figure",
    "tisa_figure",
    "permutation_figure",
    "shrinkage_figure",
    "correlation_figure",
    "position_probe_figure",
    "massive_activations_figure",
    "positional_figures",
    "positional_report_section",
    "render_positional_body",
    "render_positional_section",
    "render_positional_page",
]


def gram_figure(gram: Any, title: str = "") -> Figure:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.3))
    image = ax.imshow(gram.gram, cmap="RdBu_r", vmin=-np.abs(gram.gram).max(), vmax=np.abs(gram.gram).max())
    fig.colorbar(image, ax=ax)
    ax.set_xlabel("position j")
    ax.set_ylabel("position i")
    ax.set_title(fitted_title(f"{title}Gram E_P E_Pᵀ: Toeplitz R² {gram.r2_whole:.3f} whole, {gram.r2_off_diagonal:.3f} "
                              "off-diag.", 4.0, 9), fontsize=9)
    fig.tight_layout()
    return fig


def _grid(plt, n: int, columns: int, size: float = 2.2):
    rows = int(np.ceil(n / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(size * columns, size * rows), squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    return fig, axes.ravel()


def positional_logits_figure(logits: Any) -> Figure:
    plt = pyplot()
    n_heads = logits.scores.shape[0]
    fig, axes = _grid(plt, n_heads, min(n_heads, 6))
    for head, ax in enumerate(axes[:n_heads]):
        scores = np.where(logits.visible, logits.scores[head], np.nan)
        ax.imshow(scores, cmap="viridis")
        ax.set_title(f"H{head} R²={logits.toeplitz_r2[head]:.2f}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    figure_title(fig, f"Layer {logits.layer} positional logits (word embeddings = vocabulary mean)", fontsize=10)
    fig.tight_layout()
    return fig


def tisa_figure(tisa: dict[str, Any], max_panels: int = 24) -> Figure:
    """Head profiles against their fits; at most ``max_panels`` heads, spread over the layers."""
    plt = pyplot()
    profile, fits = tisa["profile"], tisa["fits"]
    means = profile.mean()
    n_layers, n_heads = means.shape[:2]
    heads = [(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    if len(heads) > max_panels:
        heads = [heads[i] for i in np.linspace(0, len(heads) - 1, max_panels).round().astype(int)]
    fig, axes = _grid(plt, len(heads), min(len(heads), 6), size=2.4)
    for ax, (layer, head) in zip(axes, heads):
        curve = means[layer, head]
        has = np.isfinite(curve)
        fit = fits.fits[layer][head]
        ax.plot(profile.lags[has], curve[has], color="tab:blue", lw=1)
        if np.isfinite(fit.r2):
            ax.plot(profile.lags[has], fit.predict(profile.lags[has]), color="tab:red", ls="--", lw=1)
        ax.set_title(f"L{layer}H{head} R²={fit.r2:.2f}", fontsize=8)
        ax.tick_params(labelsize=6)
    figure_title(fig, f"Mean pre-softmax score by lag k = q - key (blue) and {fits.n_kernels}-kernel TISA fit (red)", fontsize=10)
    fig.tight_layout()
    return fig


def permutation_figure(permutation: Any) -> Figure:
    plt = pyplot()
    names = list(permutation.kl)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (label, table) in zip(axes, (("KL(p ‖ p_π)", permutation.kl), ("total variation", permutation.total_variation),
                                         ("‖h_π - h‖ / ‖h‖", permutation.hidden_change))):
        data = [np.maximum(table[name].ravel(), 1e-18) for name in names]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(names) + 1), [n.replace("+", "+\n") for n in names], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
    figure_title(fig, f"Permutation sensitivity ({permutation.n_tokens}-token prompts, tokens {permutation.keep_first}..n-2 permuted)", fontsize=10)
    fig.tight_layout()
    return fig


def shrinkage_figure(shrinkage: Any, baseline: Any | None = None) -> Figure:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    cmap = plt.get_cmap("viridis")
    variance = shrinkage.across_documents["attention"]
    n_layers, n_positions = variance.shape
    q = np.arange(n_positions) + 1
    for panel, (label, result) in enumerate((("trained", shrinkage), ("untrained", baseline))):
        ax = axes[panel]
        if result is None:
            ax.axis("off")
            continue
        table = result.across_documents["attention"]
        for layer in range(n_layers):
            ax.plot(q, table[layer], color=cmap(layer / max(n_layers - 1, 1)), lw=1)
        anchor = shrinkage.q_min  # position 0 often holds the same BOS in every document (variance 0)
        ax.plot(q[anchor:], table[0, anchor] * (anchor + 1) / q[anchor:], color="black", ls="--", lw=1, label="∝ 1/(q+1)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("q + 1")
        ax.set_ylabel("variance of attention output")
        ax.set_title(f"{label} (colour: layer)", fontsize=9)
        ax.legend(fontsize=8)
    ax = axes[2]
    for label, result, style in (("trained", shrinkage, "-"), ("untrained", baseline, "--")):
        if result is None:
            continue
        for stream, color in (("attention", "tab:blue"), ("residual", "tab:orange")):
            ax.plot(result.exponent[stream], color=color, ls=style, marker="o", ms=3, label=f"{stream}, {label}")
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xlabel("layer")
    ax.set_ylabel("γ in var ∝ (q+1)^-γ")
    ax.legend(fontsize=7)
    ax.set_title(f"fitted exponent (q ≥ {shrinkage.q_min})", fontsize=9)
    fig.tight_layout()
    return fig


def correlation_figure(correlation: np.ndarray, max_layers: int = 6, title: str = "") -> Figure:
    plt = pyplot()
    n_layers = correlation.shape[0]
    layers = np.unique(np.linspace(0, n_layers - 1, min(max_layers, n_layers)).round().astype(int))
    fig, axes = _grid(plt, len(layers), len(layers), size=2.6)
    for ax, layer in zip(axes, layers):
        image = ax.imshow(correlation[layer], cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=list(axes[: len(layers)]), shrink=0.8)
    figure_title(fig, f"{title}Correlation across documents between positions i, j (residual stream)", fontsize=10)
    return fig


def position_probe_figure(probe: Any, baseline: Any | None = None) -> Figure:
    """Held-out R² (position, ``log(1 + position)``) and MAE by layer, trained (solid) against untrained (dashed).

    Each point is the pooled score of every row's held-out prediction, its bar the delete-a-group
    jackknife interval over groups of documents
    (:meth:`~equivariance_probe.analyses.position_probe.PositionProbe.interval`; none for a result
    written before the probe kept its sums).
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = (("position", "r2", "held-out R², position"), ("log1p_position", "r2", "held-out R², log(1 + position)"),
              ("position", "mae", "held-out mean distance (tokens)"))
    for ax, (target, score, label) in zip(axes, panels):
        for name, result, style, color in (("trained", probe, "-", "tab:blue"), ("untrained", baseline, "--", "tab:orange")):
            if result is None:
                continue
            estimate = np.asarray(result.score(target, score))
            layers = np.arange(len(estimate))
            try:
                interval = result.interval(target, score)
                bars = [estimate - interval.low, interval.high - estimate]
            except IntervalUnavailableError:
                bars = None
            ax.errorbar(layers, estimate, yerr=bars, ls=style, color=color, marker="o", ms=3, capsize=2, lw=1,
                        label=name)
        if score == "r2":
            ax.axhline(0.0, color="black", lw=0.8, ls=":")
        ax.set_xlabel("layer (0: embeddings)")
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=8)
    figure_title(fig, f"Linear position probes: ridge on the residual stream, {probe.n_windows} windows of "
                      f"{probe.context_length} tokens from {probe.n_documents} documents, {probe.positions.shape[1]} "
                      f"positions each, {probe.n_folds} document folds ({probe.level:.0%} jackknife intervals over "
                      f"{min(probe.interval_groups, probe.n_documents)} groups of documents)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def massive_activations_figure(massive: Any, baseline: Any | None = None) -> Figure:
    """Per layer, the mean over windows of the three largest residual magnitudes and of the median (log
    scale), trained (solid) against untrained (dashed): Sun et al. 2024's Fig. of massive activations."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for result, style, name in ((massive, "-", "trained"), (baseline, "--", "untrained")):
        if result is None:
            continue
        summary = result.summary()
        top, layers = np.asarray(summary["top"]), np.arange(len(summary["median"]))
        for i, color in zip(range(top.shape[1]), ("tab:red", "tab:orange", "tab:olive")):
            ax.plot(layers, top[:, i], ls=style, color=color, marker="o", ms=3, lw=1, label=f"top {i + 1} ({name})")
        ax.plot(layers, summary["median"], ls=style, color="tab:blue", marker="o", ms=3, lw=1, label=f"median ({name})")
    ax.set_yscale("log")
    ax.set_xlabel("block (its output)")
    ax.set_ylabel("|h|, mean over windows")
    ax.legend(fontsize=7, ncol=2)
    figure_title(fig, f"Massive activations: largest and median residual magnitudes, {massive.count} windows",
                 fontsize=9)
    fig.tight_layout()
    return fig


def positional_figures(study: PositionalStudy) -> dict[str, Figure]:
    """Every figure of a study, by name (the analyses that ran)."""
    parts = study.parts
    figures: dict[str, Figure] = {}
    if "gram" in parts:
        figures["gram"] = gram_figure(parts["gram"])
    if "positional_logits" in parts:
        figures["positional_logits"] = positional_logits_figure(parts["positional_logits"])
    if "tisa" in parts:
        figures["tisa"] = tisa_figure(parts["tisa"])
    if "permutation" in parts:
        figures["permutation"] = permutation_figure(parts["permutation"])
    if "shrinkage" in parts:
        figures["shrinkage"] = shrinkage_figure(parts["shrinkage"], parts.get("shrinkage_baseline"))
    if "correlation" in parts:
        figures["correlation"] = correlation_figure(parts["correlation"])
    if "correlation_baseline" in parts:
        figures["correlation_baseline"] = correlation_figure(parts["correlation_baseline"], title="Untrained: ")
    if "probe" in parts:
        figures["probe"] = position_probe_figure(parts["probe"], parts.get("probe_baseline"))
    if "massive" in parts:
        figures["massive"] = massive_activations_figure(parts["massive"], parts.get("massive_baseline"))
    return figures


# -- the HTML section ------------------------------------------------------------------------------
def _number(value: Any) -> str:
    """A number as the tables show it; ``n/a`` for a missing or non-finite one, and for anything that is not a
    number at all (a stored value of a file someone edited is shown as text only through :func:`_table`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value):
        return "n/a"
    return f"{value:.4g}"


def _table(header: list[str], rows: list[list[Any]]) -> Markup:
    """A table whose every header and cell is escaped (cells are data: names and numbers read back from a file)."""
    head = Markup("").join(Markup("<th>{}</th>").format(h) for h in header)
    body = Markup("").join(Markup("<tr>{}</tr>").format(Markup("").join(Markup("<td>{}</td>").format(cell) for cell in row))
                           for row in rows)
    return Markup("<table><tr>{}</tr>{}</table>").format(head, body)


def _title(study: PositionalStudy) -> str:
    return f"Where order comes from: {study.model_name}"


def render_positional_body(study: PositionalStudy) -> Markup:
    """The section's body (no heading): a table per analysis and every figure, embedded."""
    summary = study.summary()
    blocks = [Markup("<p>Conventions: {}.</p>").format(str(study.metadata.get("conventions", "")))]
    if "gram" in summary:
        gram = summary["gram"]
        blocks.append(Markup("<h3>Position-embedding Gram matrix</h3>") + _table(
            ["positions", "offset rows dropped", "Toeplitz R² (whole, diagonal included)", "Toeplitz R² (diagonal excluded)"],
            [[str(gram["n_positions"]), str(gram["offset"]), _number(gram["r2_whole"]), _number(gram["r2_off_diagonal"])]]))
    if "attention_toeplitz" in summary:
        blocks.append(_attention_beside_gram(summary))
    for key, title in (("positional_logits", "Layer-0 positional logits, Toeplitz R² per head"),
                       ("tisa", "TISA kernel fits to mean pre-softmax score profiles, R² over heads")):
        if key in summary:
            s = summary[key]
            blocks.append(Markup("<h3>{}</h3>").format(title) + _table(["mean", "median", "min", "max"],
                                                        [[_number(s[k]) for k in ("mean", "median", "min", "max")]]))
    if "permutation" in summary:
        rows = [[name] + [_number(v[k]) for k in ("kl_mean", "kl_max", "tv_mean", "hidden_change_mean", "effect", "upper_mass")]
                for name, v in summary["permutation"].items()]
        blocks.append(Markup("<h3>Permutation sensitivity</h3>") + _table(
            ["ablation", "mean KL", "max KL", "mean TV", "mean ‖Δh‖/‖h‖", "max |Δlogit| vs none (unpermuted)", "max mass on later keys"], rows))
    if "shrinkage" in summary:
        rows = []
        for key, label in (("shrinkage", "trained"), ("shrinkage_baseline", "untrained")):
            for stream, values in summary.get(key, {}).items():
                rows.append([label, stream, ", ".join(_number(v) for v in values)])
        blocks.append(Markup("<h3>Variance shrinkage: exponent γ per layer</h3>") + _table(["model", "stream", "γ by layer"], rows))
    if "correlation" in summary:
        rows = [[label, ", ".join(_number(v) for v in summary[key]["mean_off_diagonal_by_layer"])]
                for key, label in (("correlation", "trained"), ("correlation_baseline", "untrained")) if key in summary]
        blocks.append(Markup("<h3>Position correlations: mean over i ≠ j per layer</h3>") + _table(["model", "by layer"], rows))
    if "probe" in summary:
        blocks.append(_probe_table(summary))
    if "massive" in summary:
        blocks.append(_massive_table(summary))
    if study.skipped:
        blocks.append(Markup("<p>Skipped: {}</p>").format(
            Markup("; ").join(Markup("{} ({})").format(k, v) for k, v in study.skipped.items())))
    return Markup("").join(blocks) + figures_html(positional_figures(study))


def _massive_table(summary: dict) -> Markup:
    """Per layer, the largest residual magnitudes, the median, their ratio and where the largest sits."""
    rows = []
    for key, label in (("massive", "trained"), ("massive_baseline", "untrained")):
        part = summary.get(key)
        for layer, top in enumerate((part or {}).get("top") or []):
            rows.append([label, str(layer), ", ".join(_number(v) for v in top), _number(part["median"][layer]),
                         _number(part["ratio"][layer]),
                         f"{part['position'][layer]} ({part['position_share'][layer]:.0%})",
                         f"{part['dimension'][layer]} ({part['dimension_share'][layer]:.0%})"])
    intro = Markup(
        "<h3>Massive activations</h3><p>Sun et al. 2024: per block (its output, the residual stream after it), the "
        "three largest magnitudes |h| of a window's residual stream and the median magnitude, each averaged over "
        "{windows} windows, the ratio of the largest to the median, and the position in the window and hidden "
        "dimension where the largest sits (in what share of windows).</p>").format(windows=summary["massive"]["n_windows"])
    return intro + _table(["model", "block", "top 3 |h|", "median |h|", "largest / median", "position", "dimension"],
                          rows)


def _probe_table(summary: dict) -> Markup:
    """Per layer, the probes' pooled held-out R² and mean |error| with their jackknife intervals, trained beside
    untrained."""
    probe, baseline = summary["probe"], summary.get("probe_baseline")

    def cell(part: dict | None, target: str, score: str, layer: int) -> str:
        if part is None:
            return "–"
        values = part[target]
        return (f"{_number(values[score][layer])} [{_number(values[score + '_low'][layer])}, "
                f"{_number(values[score + '_high'][layer])}]")

    header = ["layer", "R² position (trained)", "R² position (untrained)", "R² log(1+position) (trained)",
              "R² log(1+position) (untrained)", "mean |error| tokens (trained)", "mean |error| tokens (untrained)"]
    rows = [[str(layer), cell(probe, "position", "r2", layer), cell(baseline, "position", "r2", layer),
             cell(probe, "log1p_position", "r2", layer), cell(baseline, "log1p_position", "r2", layer),
             cell(probe, "position", "mae", layer), cell(baseline, "position", "mae", layer)]
            for layer in range(len(probe["position"]["r2"]))]
    intro = Markup(
        "<h3>Linear position probes</h3><p>Ridge regression (standardised features, penalty chosen by "
        "leave-one-out on the training rows) from each layer's residual stream to the token's position, "
        "held-out R² and mean absolute error (Haviv et al.'s distance in tokens) of every row's prediction by "
        "the probe of the fold that held it out, {folds} folds of {documents} documents ({windows} windows of "
        "{length} tokens, {positions} positions each from {first} on); brackets: {interval} over groups of "
        "documents, {level}. Layer 0 is the embeddings, layer l the output of block l − 1.</p>"
    ).format(folds=probe["n_folds"], documents=probe["n_documents"], windows=probe["n_windows"],
             length=probe["context_length"], positions=probe["positions_per_window"], first=probe["min_position"],
             interval=probe["position"]["interval"], level=f"{probe['level']:.0%}")
    return intro + _table(header, rows)


def _attention_beside_gram(summary: dict) -> Markup:
    """Each head's attention Toeplitz R² beside the position code's: the Gram matrix's (one per model)
    and, for layer 0, the head's positional logits (TISA eq. 9-12)."""
    part = summary["attention_toeplitz"]
    mean, per_window = part["mean_pattern"]["per_head"], part["per_window"]["per_head"]
    gram = summary.get("gram")
    logits = summary.get("positional_logits", {}).get("per_head")
    header = ["layer", "head", "attention R² (document-averaged pattern)", "attention R² (mean per window)",
              "Gram E_P E_Pᵀ R² (whole)", "Gram R² (off-diagonal)", "layer-0 positional-logit R²"]
    rows = []
    for layer, heads in enumerate(mean):
        for head, value in enumerate(heads):
            rows.append([str(layer), str(head), _number(value), _number(per_window[layer][head]),
                         _number(gram["r2_whole"]) if gram else "–", _number(gram["r2_off_diagonal"]) if gram else "–",
                         _number(logits[head]) if logits is not None and layer == 0 and head < len(logits) else "–"])
    kind = "causal" if part["causal"] else "bidirectional: both directions, signed lags"
    return Markup("<h3>Attention Toeplitz R² per head beside the position code's</h3><p>{} windows of {} tokens, every "
                  "visible entry ({}). The Gram matrix is one per model; positional logits are layer 0's.</p>{}").format(
        part["n_windows"], part["context_length"], kind, _table(header, rows))


def positional_report_section(study: PositionalStudy) -> ReportSection:
    """The study report's section for ``study``."""
    return ReportSection(title=_title(study), html=render_positional_body(study))


def render_positional_section(study: PositionalStudy) -> Markup:
    """One ``<section class="positional">`` element: heading, tables, figures."""
    return Markup('<section class="positional"><h2>{}</h2>{}</section>').format(_title(study), render_positional_body(study))


def render_positional_page(study: PositionalStudy) -> str:
    """A standalone HTML page holding only the positional section."""
    return html_page(f"equivariance_probe positional analyses: {study.model_name}",
                     render_positional_section(study))
