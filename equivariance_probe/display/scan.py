"""The context-length scan on screen: every number of its table against the window length ``T``.

Place in the seams: *display*, drawing only, from a :class:`~equivariance_probe.runs.scan.ContextScan`'s
rows; matplotlib is imported when the figure is drawn (through :mod:`equivariance_probe.display.figures`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..maths.fitting import FIT_NAMES
from ..maths.metrics import FORMS
from .figures import figure_paths, figure_title, pyplot, save_figures

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..runs.scan import ContextScan

__all__ = ["scan_figure", "save_scan"]

_VARIANT_STYLE = {"trained": ("-", "o"), "random_init": ("--", "s"), "zero": (":", "^")}
_GROUP_TITLE = {"all": "all layers", "sliding": "sliding-window layers", "global": "global layers"}


def scan_figure(scan: ContextScan) -> Figure:
    """A grid: one column per layer group (all, sliding-window, global), one row per family of
    numbers (query-position R² on the log scale, on the raw scale, R² of the fits to ``P(dt)``);
    in each panel one colour per form or fit and one line style per variant, against ``T`` (log₂ axis)."""
    plt = pyplot()
    rows = scan.rows()
    groups = scan.groups()
    families = [("QPVE, log scale", [(f"log_{form}", form) for form in FORMS]),
                ("QPVE, raw scale", [(f"raw_{form}", form) for form in FORMS]),
                ("P(dt) fits", [(f"persistence_{fit}_r2", fit) for fit in FIT_NAMES])]
    fig, axes = plt.subplots(len(families), len(groups), figsize=(4.6 * len(groups) + 1, 3.4 * len(families)),
                             squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lengths = scan.context_lengths
    bands = False
    for column, group in enumerate(groups):
        for line, (family, keys) in enumerate(families):
            ax = axes[line][column]
            for variant in scan.variants:
                style, marker = _VARIANT_STYLE.get(variant, ("-.", "d"))
                picked = sorted((r for r in rows if r["layers"] == group and r["variant"] == variant),
                                key=lambda r: r["context_length"])
                for index, (key, label) in enumerate(keys):
                    color = colors[index % len(colors)]
                    x = [r["context_length"] for r in picked]
                    ax.plot(x, [r[key] for r in picked], ls=style, marker=marker, ms=4, lw=1.4, color=color,
                            label=f"{label} ({variant})")
                    banded = [r for r in picked if r.get(f"{key}_low") is not None]
                    if banded:
                        ax.fill_between([r["context_length"] for r in banded], [r[f"{key}_low"] for r in banded],
                                        [r[f"{key}_high"] for r in banded], color=color, alpha=0.12, lw=0)
                        bands = True
            # The axis follows the estimates; an interval wider than the panel runs off it (the table has its bounds).
            estimates = [r[key] for r in rows if r["layers"] == group for key, _ in keys if math.isfinite(r[key])]
            if estimates:
                low, high = min(estimates + [0.0]), max(estimates)
                margin = 0.08 * (high - low or 1.0)
                ax.set_ylim(low - margin, high + margin)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(t) for t in lengths], fontsize=8)
            ax.axhline(0, color="black", lw=0.4)
            ax.set_ylabel("R²")
            n_layers = next(r["n_layers"] for r in rows if r["layers"] == group)
            ax.set_title(f"{family}: {_GROUP_TITLE.get(group, group)} ({n_layers})", fontsize=9)
            if line == len(families) - 1:
                ax.set_xlabel("context length T (tokens)")
            if column == len(groups) - 1:
                ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.02, 0.5))
    words = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}
    styles = ", ".join(f"{words[_VARIANT_STYLE.get(variant, ('-.', 'd'))[0]]}: {variant}" for variant in scan.variants)
    figure_title(fig, f"Context-length scan of {scan.config.get('model')}: the same {rows[0]['spans']} spans of "
                      f"{lengths[-1]} tokens at every length ({', '.join(map(str, lengths))}); "
                      f"{styles}" + ("; shaded: 95 % intervals over spans" if bands else ""), fontsize=11)
    fig.tight_layout()
    return fig


def save_scan(scan: ContextScan, folder: str | os.PathLike, *, format: str | Sequence[str] = "png") -> dict[str, Path]:
    """Write the scan's tables and result files (:meth:`ContextScan.save`) and its figure ``scan.png``
    (and ``.svg``/``.pdf`` as ``format`` asks: :func:`save_figures`)."""
    paths = scan.save(folder)
    paths.update(figure_paths(save_figures({"scan": scan_figure(scan)}, Path(folder), format=format)))
    return paths
