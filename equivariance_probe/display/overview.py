"""An overview of heads over a long window: attention summed over blocks of positions, drawn on a canvas.

A CircuitsVis view writes every weight ``a[q, k]`` into the page: at 1,024 positions that is tens of MB
that a browser does not draw in minutes. The overview cuts the window ``0 <= q, k < T`` into blocks of
``B`` consecutive positions (the last one shorter when ``B`` does not divide ``T``) and keeps, per head,
the attention summed over each cell of blocks,

    S[I, J] = sum_{q in I, k in J} a[q, k],

as float64 sums (blocks of at most :data:`DEFAULT_OVERVIEW_BLOCKS` per side by default, so the page's
size does not grow with ``T``). It shows two numbers per cell:

* the *share* ``S[I, J] / |I|``: of the attention of a query in block ``I``, the part that lands on keys
  in block ``J`` (averaged over the block's queries; each row of blocks sums to 1);
* the block log-ratio ``log(max(S[I, J], eps) / U[I, J])``, with ``U`` the same sums of the uniform prior
  ``u[q, k] = 1/|V(q)|`` under the head's mask (0 where the prior puts nothing): red where the head sends
  a block more attention than position alone predicts, blue less, as in the CircuitsVis log-ratio view.

The sums are taken while the pattern streams out of the model, layer by layer
(:func:`capture_head_blocks`), a few query rows at a time, so nothing of size ``T x T`` is kept beyond
the one layer's pattern the adapter hands over; the prior's sums have a closed form
(:func:`prior_block_sums`) that needs no pattern at all.

Place in the seams: *display*, with :mod:`~equivariance_probe.display.views` (whose
:class:`~equivariance_probe.display.views.HeadViews` carries an overview beside its CircuitsVis detail of
a range). The page is plain HTML with one inline script that draws each head on a ``<canvas>``; no
library and no network. Every string from a document or a file reaches the page through
:class:`~equivariance_probe.markup.Markup` or :func:`~equivariance_probe.markup.json_script`, and the
script writes hover text with ``textContent`` only.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..adapters.passes import pattern_pass
from ..errors import InputError, check_integer
from ..markup import Markup, json_script

__all__ = [
    "BlockOverview",
    "block_edges",
    "block_sums",
    "prior_block_sums",
    "capture_head_blocks",
    "check_heads",
    "DEFAULT_OVERVIEW_BLOCKS",
    "MAX_OVERVIEW_BLOCKS",
]

#: Blocks per side when the block size is not given: ``B = ceil(T / 256)``.
DEFAULT_OVERVIEW_BLOCKS = 256
#: The most blocks per side an overview accepts (its page holds ``blocks²`` numbers per head).
MAX_OVERVIEW_BLOCKS = 512
#: Query rows reduced at once are about this many entries (a few MB of float64 per step).
_ENTRIES_PER_STEP = 1 << 21
#: Characters of a block's text shown when hovering it.
_EXCERPT_CHARS = 60


# -- numbers ------------------------------------------------------------------------------------
def check_heads(layout: Any, heads: Sequence[tuple[int, int]]) -> None:
    """Refuse a ``(layer, head)`` that the model's :class:`~equivariance_probe.adapters.base.AttentionLayout` lacks."""
    for layer, head in heads:
        if not (0 <= layer < layout.n_layers and 0 <= head < layout.n_heads):
            raise InputError(
                f"head L{layer}H{head} does not exist: this model has layers 0..{layout.n_layers - 1} and "
                f"heads 0..{layout.n_heads - 1}; pass heads=[(layer, head), ...] within those ranges"
            )


def block_edges(n_positions: int, block_size: int | None = None) -> np.ndarray:
    """Block boundaries ``[0, B, 2B, ..., T]`` of a window of ``T`` positions.

    Args:
        n_positions: ``T``.
        block_size: ``B`` (default: ``ceil(T / DEFAULT_OVERVIEW_BLOCKS)``, at least 1).

    Returns:
        ``[n_blocks + 1]`` int64; block ``I`` is ``edges[I] <= position < edges[I + 1]``.

    Raises:
        InputError: ``B`` is not a positive integer, or cuts the window into more than
            :data:`MAX_OVERVIEW_BLOCKS` blocks per side.
    """
    check_integer("n_positions", n_positions)
    if block_size is None:
        block_size = max(1, math.ceil(n_positions / DEFAULT_OVERVIEW_BLOCKS))
    check_integer("block_size", block_size,
                  message=f"block_size must be a positive number of positions, got {block_size!r}")
    n_blocks = math.ceil(n_positions / block_size)
    if n_blocks > MAX_OVERVIEW_BLOCKS:
        raise InputError(
            f"block_size={block_size} cuts {n_positions} positions into {n_blocks} blocks per side, more than the "
            f"overview's {MAX_OVERVIEW_BLOCKS}; pass block_size >= {math.ceil(n_positions / MAX_OVERVIEW_BLOCKS)} "
            "(or leave it out), and view a range in full with start= and stop="
        )
    return np.append(np.arange(0, n_positions, block_size), n_positions).astype(np.int64)


def block_sums(pattern: torch.Tensor | np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``S[I, J] = sum_{q in I, k in J} a[q, k]`` in float64, a few query rows at a time.

    Args:
        pattern: ``[query, key]`` attention of one head (any device and float dtype), ``T x T``.
        edges: from :func:`block_edges` for ``T``.

    Returns:
        ``[n_blocks, n_blocks]`` float64. Only ``rows x T`` float64 entries are made at once.
    """
    pattern = torch.as_tensor(pattern)
    n = int(edges[-1])
    if tuple(pattern.shape) != (n, n):
        raise InputError(f"a pattern of shape {tuple(pattern.shape)} does not match blocks of {n} positions; "
                         f"pass the [query, key] pattern of the whole {n}-position window")
    n_blocks = len(edges) - 1
    key_block = torch.as_tensor(np.repeat(np.arange(n_blocks), np.diff(edges)))
    out = torch.zeros(n_blocks, n_blocks, dtype=torch.float64)
    # Whole query blocks per step, about _ENTRIES_PER_STEP entries (at least one block).
    per_step = max(1, _ENTRIES_PER_STEP // max(1, n * int(np.diff(edges).max())))
    for first in range(0, n_blocks, per_step):
        last = min(n_blocks, first + per_step)
        rows = pattern[int(edges[first]):int(edges[last])].to("cpu", torch.float64)
        by_key = torch.zeros(rows.shape[0], n_blocks, dtype=torch.float64).index_add_(1, key_block, rows)
        query_block = key_block[int(edges[first]):int(edges[last])] - first
        out[first:last] = torch.zeros(last - first, n_blocks, dtype=torch.float64).index_add_(0, query_block, by_key)
    return out.numpy()


def prior_block_sums(edges: np.ndarray, window: int | None) -> np.ndarray:
    """``U[I, J]``: :func:`block_sums` of the uniform prior ``u[q, k] = 1/|V(q)|``, in closed form.

    Under a causal mask with sliding window ``w`` (``None``: full causal) a query ``q`` sees the keys
    ``max(0, q - w + 1) <= k <= q``, each with weight ``1/|V(q)|``; the keys of block ``J = [j0, j1)`` it
    sees number ``max(0, min(j1, q + 1) - max(j0, q - w + 1))``. Summed over the queries of block ``I``
    this takes ``T x n_blocks`` steps and no pattern.

    Returns:
        ``[n_blocks, n_blocks]`` float64.
    """
    n = int(edges[-1])
    query = np.arange(n, dtype=np.int64)[:, None]
    first_visible = np.zeros_like(query) if window is None else np.maximum(0, query - window + 1)
    visible = (np.minimum(edges[1:][None, :], query + 1) - np.maximum(edges[:-1][None, :], first_visible)).clip(0)
    per_query = visible / (query + 1 - first_visible)  # [T, n_blocks]: the prior's mass per key block
    return np.add.reduceat(per_query, edges[:-1], axis=0)


def capture_head_blocks(
    adapter: Any,
    tokens: torch.Tensor,
    heads: Sequence[tuple[int, int]],
    edges: np.ndarray,
    detail: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Block sums of the chosen heads on one window, and their full pattern over one range, in one pass.

    The adapter streams ``pattern: [batch, head, query, key]`` one layer at a time; each chosen head of
    that layer is reduced to its block sums and its ``[start:stop, start:stop]`` slice before the
    layer's pattern is dropped.

    Args:
        adapter: an :class:`~equivariance_probe.adapters.base.Adapter` (``probe.adapter``).
        tokens: ``[T]`` token ids of one window.
        heads: ``(layer, head)`` pairs.
        edges: :func:`block_edges` for ``T``.
        detail: ``(start, stop)``: also keep ``a[q, k]`` for ``start <= q, k < stop`` (``None``: nothing).

    Returns:
        ``(sums, pattern)``: ``[n_heads, n_blocks, n_blocks]`` float64 and ``[n_heads, stop - start,
        stop - start]`` float64 (``None`` without ``detail``).
    """
    check_heads(adapter.layout, heads)
    n_positions = int(tokens.shape[-1])
    if int(edges[-1]) != n_positions:
        raise InputError(f"the blocks end at {int(edges[-1])} but the window has {n_positions} tokens; "
                         f"pass edges=block_edges({n_positions}, ...)")
    if detail is not None and not (0 <= detail[0] < detail[1] <= n_positions):
        raise InputError(f"the range {detail} does not fit the window's {n_positions} tokens; "
                         f"pass (start, stop) with 0 <= start < stop <= {n_positions}")
    n_blocks = len(edges) - 1
    sums = np.zeros((len(heads), n_blocks, n_blocks))
    pattern = None if detail is None else np.zeros((len(heads), detail[1] - detail[0], detail[1] - detail[0]))
    wanted: dict[int, list[int]] = {}
    for index, (layer, _) in enumerate(heads):
        wanted.setdefault(layer, []).append(index)

    def keep(layer: int, weights: torch.Tensor) -> None:
        for index in wanted.get(layer, ()):
            one = weights[0, heads[index][1]]
            sums[index] = block_sums(one, edges)
            if detail is not None:
                start, stop = detail
                pattern[index] = one[start:stop, start:stop].to("cpu", torch.float64).numpy()

    pattern_pass(adapter, tokens.reshape(1, -1), keep)
    return sums, pattern


# -- the overview ---------------------------------------------------------------------------------
def block_excerpts(tokens: Sequence[str], edges: np.ndarray) -> list[str]:
    """Each block's tokens joined, cut to a few dozen characters (the hover text)."""
    excerpts = []
    for first, last in zip(edges[:-1], edges[1:]):
        text = "".join(tokens[int(first):int(min(last, first + _EXCERPT_CHARS))])
        excerpts.append(text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 1] + "…")
    return excerpts


def _half_floats(values: np.ndarray) -> str:
    """Values as little-endian IEEE half floats in base64: 2.7 characters a number (3 significant digits;
    magnitudes under 6e-8 become 0), a third of the same numbers written as decimals."""
    return base64.b64encode(np.asarray(values, dtype="<f2").tobytes()).decode("ascii")


@dataclass(frozen=True)
class BlockOverview:
    """Block sums of a few heads over a long window, and the uniform prior's, with each block's text.

    Attributes:
        heads: ``(layer, head)`` of each head.
        edges: ``[n_blocks + 1]`` block boundaries (:func:`block_edges`).
        sums: ``[n_heads, n_blocks, n_blocks]`` ``S[I, J] = sum_{q in I, k in J} a[q, k]``.
        prior_sums: ``[n_heads, n_blocks, n_blocks]`` the same of each head's uniform prior.
        excerpts: per block, the start of its text.
        log_floor: ``eps`` of the log-ratio.
        detail: ``(start, stop)`` of the range shown in full beside the overview (outlined), or ``None``.
        log_ratio_limit: colour range ``±limit`` of the log-ratio.
    """

    heads: list[tuple[int, int]]
    edges: np.ndarray
    sums: np.ndarray
    prior_sums: np.ndarray
    excerpts: list[str]
    log_floor: float
    detail: tuple[int, int] | None = None
    log_ratio_limit: float = 4.0

    @property
    def n_positions(self) -> int:
        return int(self.edges[-1])

    @property
    def sizes(self) -> np.ndarray:
        """``[n_blocks]`` positions per block."""
        return np.diff(self.edges)

    @property
    def labels(self) -> list[str]:
        return [f"L{layer}H{head}" for layer, head in self.heads]

    def mean(self) -> np.ndarray:
        """The block-averaged pattern ``S[I, J] / (|I| |J|)``: ``[n_heads, n_blocks, n_blocks]``."""
        return self.sums / np.outer(self.sizes, self.sizes)

    def share(self) -> np.ndarray:
        """``S[I, J] / |I|``: the part of a block-``I`` query's attention on block ``J`` (rows sum to 1)."""
        return self.sums / self.sizes[:, None]

    def log_ratios(self) -> np.ndarray:
        """``log(max(S, eps) / U)`` where the prior puts attention (``U > 0``), 0 elsewhere."""
        visible = self.prior_sums > 0
        ratio = np.log(np.maximum(self.sums, self.log_floor)) - np.log(np.where(visible, self.prior_sums, 1.0))
        return np.where(visible, ratio, 0.0)

    def _data(self) -> dict[str, Any]:
        return {
            "edges": self.edges.tolist(),
            "excerpts": list(self.excerpts),
            "detail": None if self.detail is None else [int(self.detail[0]), int(self.detail[1])],
            "limit": float(self.log_ratio_limit),
            "heads": [{"label": label, "share": _half_floats(share), "ratio": _half_floats(ratio)}
                      for label, share, ratio in zip(self.labels, self.share(), self.log_ratios())],
        }

    def body_html(self) -> Markup:
        """The overview as an HTML fragment: captions, one pair of canvases per head and the script that
        draws them (no library, no network)."""
        size = int(self.sizes[0])
        detail = ("" if self.detail is None else
                  f" The outlined square is positions {self.detail[0]}..{self.detail[1] - 1}, shown in full below.")
        caption = Markup(
            "<h4>Overview of positions 0..{}: blocks of {} positions ({} per side)</h4>"
            "<p>Left: the share of a query's attention that lands in each key block, averaged over the block's "
            "queries (dark: most; log colour scale from 10⁻⁴ to 1). Right: log of the block's attention over the "
            "uniform prior's, red where the head attends there more than position alone predicts, blue less "
            "(saturating at ±{:g}; grey: the mask hides the block). Hover a block for its positions, text and "
            "numbers.{}</p>"
        ).format(self.n_positions - 1, size, len(self.sizes), self.log_ratio_limit, detail)
        return Markup('<div class="block-overview">{}<div class="block-overview-heads"></div>'
                      '<pre class="block-overview-hover" style="white-space:pre-wrap;min-height:3em"></pre>'
                      "<script>({})({});</script></div>").format(caption, Markup(_DRAW), json_script(self._data()))

    def _repr_html_(self) -> str:
        return self.body_html()

    def __repr__(self) -> str:
        return (f"BlockOverview({', '.join(self.labels)}; {self.n_positions} positions in blocks of "
                f"{int(self.sizes[0])})")


def overview_of(adapter: Any, ids: Sequence[int], heads: Sequence[tuple[int, int]], tokens: Sequence[str], *,
                block_size: int | None, detail: tuple[int, int] | None, log_floor: float,
                sliding_windows: Sequence[int | None], log_ratio_limit: float = 4.0,
                ) -> tuple[BlockOverview, np.ndarray | None]:
    """One pass of ``ids`` through the adapter: the overview of ``heads`` (``tokens``: the strings of ``ids``)
    and their pattern over ``detail``."""
    edges = block_edges(len(ids), block_size)
    sums, pattern = capture_head_blocks(adapter, torch.tensor(list(ids), dtype=torch.long), heads, edges, detail)
    n = len(ids)
    # A window at least as wide as the document hides nothing there: it is full causal.
    masks = [None if w is None or w >= n else int(w) for w in sliding_windows]
    priors = {w: prior_block_sums(edges, w) for w in dict.fromkeys(masks)}
    overview = BlockOverview(
        heads=list(heads), edges=edges, sums=sums, prior_sums=np.stack([priors[w] for w in masks]),
        excerpts=block_excerpts(tokens, edges), log_floor=log_floor, detail=detail, log_ratio_limit=log_ratio_limit,
    )
    return overview, pattern


# The drawing script: a function of the overview's data (written by json_script), run once where the
# fragment stands. Hover text is set with textContent, so a block's text is never read as markup.
_DRAW = """function (data) {
  var root = document.currentScript.parentElement;
  var holder = root.querySelector(".block-overview-heads"), hover = root.querySelector(".block-overview-hover");
  var edges = data.edges, n = edges.length - 1, scale = Math.max(1, Math.floor(512 / n));
  function halves(text) {  // base64 of little-endian IEEE half floats
    var bytes = atob(text), out = new Float32Array(bytes.length / 2);
    for (var i = 0; i < out.length; i++) {
      var h = bytes.charCodeAt(2 * i) | (bytes.charCodeAt(2 * i + 1) * 256);
      var sign = h & 0x8000 ? -1 : 1, exponent = (h >> 10) & 31, fraction = h & 1023;
      out[i] = exponent === 0 ? sign * fraction * Math.pow(2, -24)
        : exponent === 31 ? (fraction ? NaN : sign * Infinity)
        : sign * (1 + fraction / 1024) * Math.pow(2, exponent - 15);
    }
    return out;
  }
  function shareColour(v) {
    var t = v <= 0 ? 0 : Math.min(1, Math.max(0, (Math.log10(v) + 4) / 4));
    return [Math.round(255 - 247 * t), Math.round(255 - 207 * t), Math.round(255 - 148 * t)];
  }
  function ratioColour(v, hidden) {
    if (hidden) return [225, 225, 225];
    var t = Math.min(1, Math.abs(v) / data.limit), w = Math.round(255 * (1 - t));
    return v >= 0 ? [255, w, w] : [w, w, 255];
  }
  function canvas(values, colour, hiddenFrom) {
    var small = document.createElement("canvas");
    small.width = n; small.height = n;
    var context = small.getContext("2d"), image = context.createImageData(n, n);
    for (var i = 0; i < n * n; i++) {
      var c = colour(values[i], hiddenFrom !== undefined && hiddenFrom[i] === 0 && values[i] === 0);
      image.data[4 * i] = c[0]; image.data[4 * i + 1] = c[1]; image.data[4 * i + 2] = c[2]; image.data[4 * i + 3] = 255;
    }
    context.putImageData(image, 0, 0);
    var big = document.createElement("canvas");
    big.width = n * scale; big.height = n * scale;
    big.className = "block-overview-canvas";
    var draw = big.getContext("2d");
    draw.imageSmoothingEnabled = false;
    draw.drawImage(small, 0, 0, n * scale, n * scale);
    if (data.detail) {
      var a = 0, b = n;
      while (a + 1 < n && edges[a + 1] <= data.detail[0]) a++;
      while (b - 1 > 0 && edges[b - 1] >= data.detail[1]) b--;
      draw.strokeStyle = "#000"; draw.lineWidth = 2;
      draw.strokeRect(a * scale, a * scale, (b - a) * scale, (b - a) * scale);
    }
    return big;
  }
  data.heads.forEach(function (written) {
    var head = {label: written.label, share: halves(written.share), ratio: halves(written.ratio)};
    var figure = document.createElement("div");
    figure.style.display = "inline-block"; figure.style.margin = "0 16px 16px 0";
    var title = document.createElement("div");
    title.textContent = head.label + ": share of attention by block, and log(attention / uniform prior)";
    figure.appendChild(title);
    [canvas(head.share, shareColour), canvas(head.ratio, ratioColour, head.share)].forEach(function (drawn) {
      drawn.style.marginRight = "8px"; drawn.style.cursor = "crosshair";
      drawn.addEventListener("mousemove", function (event) {
        var box = drawn.getBoundingClientRect();
        var j = Math.floor((event.clientX - box.left) / scale), i = Math.floor((event.clientY - box.top) / scale);
        if (i < 0 || j < 0 || i >= n || j >= n) return;
        hover.textContent = head.label + "  queries " + edges[i] + ".." + (edges[i + 1] - 1) + " -> keys " +
          edges[j] + ".." + (edges[j + 1] - 1) + ": share " + head.share[i * n + j].toPrecision(3) + ", log(a/u) " +
          head.ratio[i * n + j].toPrecision(3) + "\\nqueries' text: " + JSON.stringify(data.excerpts[i]) +
          "\\nkeys' text:    " + JSON.stringify(data.excerpts[j]);
      });
      figure.appendChild(drawn);
    });
    holder.appendChild(figure);
  });
  root.setAttribute("data-drawn", String(Math.round(performance.now())));
}"""
