"""The per-block maths of the torch engine: softmax, row moments and diagonal sums of one query block.

Place in the seams: *statistics*, inside the torch engine
(:mod:`~equivariance_probe.statistics.engines.torch_blocks`, which cuts a layer into query blocks
and adds up what these functions return). :func:`row_moments` and :func:`toeplitz_r2_per_window`
also run inside remote nnsight traces (:mod:`~equivariance_probe.statistics.engines.in_trace`),
so this module uses torch, math and builtins alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .spec import Layout

__all__ = ["BlockWorkspace", "accumulate_block", "block_from_scores", "block_from_weights", "row_moments",
           "toeplitz_r2_per_window"]


# -- the block's temporaries --------------------------------------------------------------


class BlockWorkspace:
    """Buffers for a query block's temporaries, reused from block to block and from layer to layer.

    Why: glibc serves an allocation of a few megabytes with freshly mapped pages and unmaps them
    when it is freed, so on CPU every block's new temporaries were faulted in page by page: up to
    17,000 minor page faults per layer (tens of milliseconds, a third of the engine's time) for a
    batch of two 1024-token windows with 4 heads, depending on the allocation history. A
    workspace keeps one flat buffer per temporary and hands out views of its first elements;
    a buffer is replaced only when a larger block needs more. The block loops run the largest
    block first, so one allocation per buffer serves a whole layer.

    :class:`~equivariance_probe.statistics.AttentionStatistics` keeps one for the duration of a
    batch. It holds about one block's temporaries (:func:`choose_block_size`). Not thread-safe:
    one workspace per thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape``: a view of buffer ``name``, valid until the
        next ``take(name, ...)``."""
        size = math.prod(shape)
        device = torch.device(device)
        slot = (name, device)  # a model spread over devices keeps one buffer on each
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            self._buffers.pop(slot, None)  # freed before the larger one is allocated
            buffer = self._buffers[slot] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(tuple(shape))

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def clear(self) -> None:
        """Let every buffer go."""
        self._buffers.clear()


def taker(workspace: BlockWorkspace | None, device: torch.device) -> Callable[..., torch.Tensor]:
    """``take(name, shape, dtype)``: from ``workspace``, or a fresh tensor without one (the compiled blocks)."""
    if workspace is None:
        return lambda name, shape, dtype: torch.empty(tuple(shape), dtype=dtype, device=device)
    return lambda name, shape, dtype: workspace.take(name, shape, dtype, device)


# -- per-block maths ----------------------------------------------------------------------


def row_moments(
    values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, deviation: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ_k y`` and ``Σ_k y²`` per row, in float64, accurate to float64 even for float32 ``y``.

    Squaring float32 values rounds each square (relative 6e-8), which would leave a
    spurious within-group variance of order 1e-7 where the truth is exactly 0 (uniform
    attention). So the sum of squares is built from deviations around the row mean:
    ``Σy² = Σ(y - m̃)² - n(m - m̃)² + n m²`` with ``m`` the float64 mean and ``m̃`` its
    rounding to ``y``'s dtype. A row of identical values has an exact float64 sum, so
    ``m = m̃ = y`` and every deviation is 0: it gets ``Σy² = (n·m)·m``, exactly
    ``count·mean²``. (The block functions pass float64 copies of float32 values, for
    which ``m̃ = m`` and the deviations and their squares are float64 too.)

    Args:
        values: ``[..., key]`` float32 or float64, zero (and finite) where ``mask`` is false.
        mask: bool, or 0/1 in ``values``' dtype, broadcastable to ``values``.
        count: ``[...]`` float64 visible keys per row.
        deviation: a buffer of ``values``' shape and dtype for the deviations (overwritten), or
            ``None`` to allocate one.

    Returns:
        ``(Σy, Σy²)``, each ``[...]`` float64.
    """
    total = values.sum(-1, dtype=torch.float64)
    mean = total / count.clamp_min(1)
    mean_rounded = mean.to(values.dtype)
    mask = mask if mask.dtype == values.dtype else mask.to(values.dtype)
    # values - mask·m̃ in one pass: the deviation of a visible entry, and exactly 0 for a hidden one
    # (which holds 0). On CPU that is ~1.5x faster than a subtraction followed by a product with the
    # mask, and ~4x faster than torch.where with a broadcast mask.
    deviation = torch.addcmul(values, mask, mean_rounded.unsqueeze(-1), value=-1, out=deviation)
    if values.dtype == torch.float64:
        # Σd² as the square of vector_norm, one pass over d: vecdot and (d*d).sum() write the
        # products out first on CPU, twice the time. The square of the root is within 2 ulp of Σd²,
        # and 0 where every deviation is 0.
        spread = torch.linalg.vector_norm(deviation, dim=-1).square()
    else:
        spread = (deviation * deviation).sum(-1, dtype=torch.float64)
    offset = mean - mean_rounded.to(torch.float64)
    squares = (spread - count * offset * offset + count * mean * mean).clamp_min(0)
    return total, squares


def block_from_scores(
    scores: torch.Tensor, visible: torch.Tensor, row_count: torch.Tensor, log_eps: float, pad: int, masked: bool,
    pad_after: int = 0, workspace: BlockWorkspace | None = None,
) -> tuple[torch.Tensor, ...]:
    """Softmax and row moments of one query block, from masked scores.

    ``log a = log_softmax(s)`` and ``a = softmax(s)``, each one fused pass of torch's
    (``(s - m) - log Σ exp(s - m)`` and ``exp(s - m) / Σ exp(s - m)`` with ``m`` the row
    maximum, so ``log a`` stays accurate where ``a`` underflows), in the scores' dtype. The
    weights and the log weights are then copied once to float64, the weights straight into the
    zero-padded buffer the lag sums read: every sum reads float64 (:func:`row_moments`), where a
    float32 tensor summed with ``dtype=torch.float64`` is copied to float64 by torch on CPU
    once per sum. A float32 value squared in float64 is exact, and rows of identical values
    stay exact.

    Args:
        scores: ``[B, H, rows, keys]`` float32/64, ``-inf`` where the model's mask hides
            an entry (every row keeps at least its diagonal).
        visible: ``[B, 1, rows, keys]`` bool, the entries the statistics read.
        row_count: ``[B, 1, rows]`` float64, visible keys per row.
        log_eps: ``log eps``, the floor of the log scale.
        pad: zero columns put in front of the weights (for :func:`_lag_sums`).
        masked: whether the block holds entries the model sees but the statistics do not
            (excluded keys, padding rows); without them ``softmax`` already gives every
            hidden weight 0 (``exp(-inf)``).
        pad_after: zero columns put after the weights (signed lags of a bidirectional block).
        workspace: where the block's temporaries live (:class:`BlockWorkspace`); ``None``
            allocates them.

    Returns:
        ``padded_weights`` (``[B, H, rows, pad + keys + pad_after]`` float64, 0 where not visible),
        the per-row ``Σa, Σa², Σy, Σy²`` (``[B, H, rows]`` float64), the floored entries per
        ``(b, h)`` (``[B, H]`` float64) and the weights' first key column ``[B, H, rows]`` (a view,
        unmasked: the sink sums read it, masked, in :func:`accumulate_block` before the next block
        reuses the buffer).

    Elementwise maths and row reductions only, so ``torch.compile`` can fuse it.
    """
    take = taker(workspace, scores.device)
    log_weights = torch.log_softmax(scores, -1, out=take("log_weights", scores.shape, scores.dtype))
    weights = torch.softmax(scores, -1, out=take("weights", scores.shape, scores.dtype))
    below = torch.lt(log_weights, log_eps, out=take("below", scores.shape, torch.bool))
    floored = torch.count_nonzero(below.logical_and_(visible), dim=(-2, -1)).to(torch.float64)
    padded, kept = _padded_float64(weights, pad, pad_after, visible if masked else None, take)
    # The floor, then 0 for every entry the statistics do not read (a product with the 0/1 mask,
    # which the clamp keeps finite), written as float64 in the same pass.
    logs = torch.mul(log_weights.clamp_min_(log_eps), visible, out=take("logs", scores.shape, torch.float64))
    return (*_moments(padded, kept, logs, visible, row_count, floored, take), weights[..., 0])


def _padded_float64(
    weights: torch.Tensor, pad: int, pad_after: int, visible: torch.Tensor | None, take: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights: [..., keys]`` in float64 between ``pad`` and ``pad_after`` zero columns, 0 where
    ``visible`` (if given) is false: the padded buffer (for :func:`_lag_sums`) and its view of the
    weights."""
    keys = weights.shape[-1]
    padded = take("padded", (*weights.shape[:-1], pad + keys + pad_after), torch.float64)
    padded[..., :pad].zero_()
    padded[..., pad + keys :].zero_()
    kept = padded[..., pad : pad + keys]
    if visible is None:
        kept.copy_(weights)
    else:
        torch.mul(weights, visible, out=kept)
    return padded, kept


def block_from_weights(
    weights: torch.Tensor, visible: torch.Tensor, row_count: torch.Tensor, log_floor: float, pad: int,
    pad_after: int = 0, workspace: BlockWorkspace | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`block_from_scores` for captured weights: ``y = log max(a, eps)``, floored ``a < eps``.

    ``weights`` is read, never written (it may be a view of the caller's pattern). Entries the
    statistics do not read may hold anything, NaN included, so they are overwritten with 0
    (``masked_fill_``) rather than multiplied by a 0/1 mask (``NaN·0`` is NaN).
    """
    take = taker(workspace, weights.device)
    hidden = ~visible
    below = torch.lt(weights, log_floor, out=take("below", weights.shape, torch.bool))
    floored = torch.count_nonzero(below.logical_and_(visible), dim=(-2, -1)).to(torch.float64)
    log_weights = torch.clamp(weights, min=log_floor, out=take("log_weights", weights.shape, weights.dtype)).log_()
    logs = take("logs", weights.shape, torch.float64).copy_(log_weights).masked_fill_(hidden, 0.0)
    padded, kept = _padded_float64(weights, pad, pad_after, None, take)
    kept.masked_fill_(hidden, 0.0)
    return (*_moments(padded, kept, logs, visible, row_count, floored, take), weights[..., 0])


def _moments(
    padded: torch.Tensor,
    weights: torch.Tensor,
    logs: torch.Tensor,
    visible: torch.Tensor,
    row_count: torch.Tensor,
    floored: torch.Tensor,
    take: Callable[..., torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Both scales' row moments of a block (shared by both block kinds), with the padded weights."""
    mask = take("mask", visible.shape, weights.dtype).copy_(visible)  # one 0/1 mask serves both scales
    deviation = take("deviation", weights.shape, weights.dtype)
    raw_sum, raw_sq = row_moments(weights, mask, row_count, deviation)
    log_sum, log_sq = row_moments(logs, mask, row_count, deviation)
    return padded, raw_sum, raw_sq, log_sum, log_sq, floored


def _lag_sums(padded: torch.Tensor, rows: int, n_keys: int) -> torch.Tensor:
    """Sums of a block's weights along its diagonals: ``[B, H, n_keys]`` float64 by lag.

    The block holds rows ``q = q0 + i`` and keys ``k = k0 + j`` with
    ``n_keys = q1 - k0``, so its lags ``q - k`` run over ``[0, n_keys)`` (entries with
    ``k > q`` are zero). ``padded`` is the block with ``rows - 1`` zero columns in front
    (width ``W = n_keys + rows - 1``). Reading it with row stride ``W + 1`` shifts row
    ``i`` left by ``i``: element ``[i, c]`` of the strided view is ``a[i, c + i - rows + 1]``,
    whose lag is ``n_keys - 1 - c`` for every ``i``. So diagonals become columns, and one
    reduction over the rows of this view, with no copy and no index arithmetic, gives
    every diagonal sum at once (reversed).

    Why the skew and not a scatter: ``index_add_``/``scatter_add_`` on CPU run a serial,
    non-vectorised loop over ``B·H·rows·keys`` elements with an int64 index each, while
    the skewed reduction is a plain vectorised sum of contiguous rows. On a
    ``[4, 4, 48, 1024]`` float64 block (2 CPU cores) the skewed sum took 0.14 ms against
    1.9 ms for ``index_add_`` and 4 ms for ``scatter_add_``. The price is the
    ``rows - 1`` zero columns, which cost nothing extra here because the float64 copy
    of the weights is written straight into the padded buffer.
    """
    batch, heads, _, width = padded.shape
    padded = padded.contiguous()
    skewed = padded.as_strided(
        (batch, heads, rows, n_keys),
        (heads * rows * width, rows * width, width + 1, 1),
        padded.storage_offset(),
    )
    return skewed.sum(-2, dtype=torch.float64).flip(-1)


def _signed_lag_sums(padded: torch.Tensor, rows: int, n_keys: int) -> torch.Tensor:
    """:func:`_lag_sums` of a bidirectional block, every lag signed: ``[B, H, rows + n_keys - 1]``.

    ``padded`` holds the block's ``n_keys`` key columns between ``rows - 1`` zero columns on
    each side (width ``W = n_keys + 2(rows - 1)``). The same skewed view (row stride ``W + 1``),
    now ``rows + n_keys - 1`` columns wide, puts at column ``c`` the entries of lag
    ``q0 - k0 + rows - 1 - c``; reversed, index ``m`` holds lag ``q0 - k1 + 1 + m``.
    """
    return _lag_sums(padded, rows, rows + n_keys - 1)


def _key_lag_index(layout: Layout, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Flat ``[κ, dt]`` index of each entry of a block into ``key_lag_sum``: ``[rows, keys]``.

    Under a causal mask, entries above the diagonal (which hold 0) point at ``dt = 0`` of their
    key's bin; signed lags sit at ``dt + T - 1``.
    """
    query = torch.arange(q0, q1, device=layout.device).view(-1, 1)
    key = torch.arange(k0, k1, device=layout.device).view(1, -1)
    lag = (query - key).clamp_min(0) if layout.causal else query - key + layout.lag_offset
    return layout.key_bin[k0:k1].view(1, -1) * layout.n_lags + lag


def accumulate_block(
    out: dict[str, torch.Tensor],
    layout: Layout,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    block: tuple[torch.Tensor, ...],
) -> None:
    """Add one block's results (from ``block_from_*``) to the sums.

    ``first_key_sum`` (when asked for) takes the block's first key column only where the block starts at
    key 0 (a block of a sliding window that starts later holds rows that cannot see key 0: they stay 0),
    on the rows :meth:`~.spec.Layout.first_key_seen` names; ``torch.where``, not a product, because
    captured weights outside the mask may hold NaN.
    """
    padded, raw_sum, raw_sq, log_sum, log_sq, floored, first = block
    rows, n_keys = q1 - q0, k1 - k0
    if "first_key_sum" in out and k0 == 0:
        seen = layout.first_key_seen(q0, q1)
        out["first_key_sum"][..., q0:q1] = torch.where(seen, first, torch.zeros((), dtype=first.dtype, device=first.device))
    out["raw_sum"][..., q0:q1] = raw_sum
    out["raw_sq"][..., q0:q1] = raw_sq
    out["log_sum"][..., q0:q1] = log_sum
    out["log_sq"][..., q0:q1] = log_sq
    out["floored"] += floored
    if layout.causal:
        out["lag_sum"][..., :n_keys] += _lag_sums(padded, rows, n_keys)
    else:
        first = q0 - k1 + 1 + layout.lag_offset  # index of the block's most negative lag
        out["lag_sum"][..., first : first + rows + n_keys - 1] += _signed_lag_sums(padded, rows, n_keys)
    weights = padded[..., rows - 1 : rows - 1 + n_keys]
    if "pattern_sum" in out:
        per_head = weights.sum(0, dtype=torch.float64)  # [H, rows, keys]
        out["pattern_sum"][:, q0:q1, k0:k1] += per_head
        summed = per_head.sum(0)
    else:
        summed = weights.sum((0, 1), dtype=torch.float64)  # [rows, keys]
    # One scatter of the batch- and head-summed block, 1/(B·H) of the entries: the
    # key bins vary along both axes of the block, so no skew lines them up.
    out["key_lag_sum"].view(-1).index_add_(0, _key_lag_index(layout, q0, q1, k0, k1).reshape(-1), summed.reshape(-1))


def toeplitz_r2_per_window(sums: dict[str, torch.Tensor], doc_lag_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window's Toeplitz R² (TISA appendix B) per head, from the per-window sums.

    Over a window's visible entries, the best Toeplitz fit puts the mean ``m_dt`` of each
    diagonal on it, so ``RSS = Σa² - Σ_dt n_dt·m_dt² = Σa² - Σ_dt D_dt²/n_dt`` with
    ``D_dt`` the diagonal sum (``lag_sum``) and ``n_dt`` its entry count
    (``doc_lag_count``), and ``TSS = Σa² - (Σa)²/N``. A window without variance (one
    token, or exactly uniform over a single diagonal) has no R²; it is reported as 0
    and flagged.

    Args:
        sums: the dict of :func:`attention_sums_from_qk` (``raw_sum, raw_sq, lag_sum``).
        doc_lag_count: ``[B, T]`` from :func:`mask_counts`.

    Returns:
        ``(r2, has_variance)``: ``[B, H]`` float64 and bool.
    """
    n_entries = doc_lag_count.sum(-1).unsqueeze(1)  # [B, 1]
    total = sums["raw_sum"].sum(-1)  # [B, H]
    square = sums["raw_sq"].sum(-1)
    lag_count = doc_lag_count.unsqueeze(1)  # [B, 1, T]
    zero = torch.zeros((), dtype=torch.float64, device=total.device)
    diagonal_fit = torch.where(lag_count > 0, sums["lag_sum"].square() / lag_count.clamp_min(1), zero)
    rss = (square - diagonal_fit.sum(-1)).clamp_min(0)
    tss = square - total.square() / n_entries.clamp_min(1)
    has_variance = tss > 1e-12 * square.clamp_min(1e-300)
    r2 = torch.where(has_variance, 1 - rss / tss.clamp_min(1e-300), zero)
    return r2, has_variance
