"""Torch-only kernels of the statistics: masks, scores, and the reduction of one layer's attention.

Place in the seams: *statistics*, the functions that turn one layer's attention of one batch
into float64 sums. They use torch, math and builtins alone, so the same code runs here and,
shipped by value, inside a remote nnsight trace on a server where equivariance_probe is not
installed (:mod:`~equivariance_probe.adapters.nnsight_remote`). The stateful
:class:`~equivariance_probe.statistics.attention.AttentionStatistics` adds their output up.

Coordinates: ``query`` ``q`` and ``key`` ``k`` are absolute positions in a window; ``lag`` is
``dt = q - k``. Key-lag arrays are indexed ``[key t, lag dt]``, i.e. entry ``a[t+dt, t]``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "default_log_floor",
    "key_lag_index",
    "visible_mask",
    "uniform_prior",
    "mask_statistics",
    "entry_moments",
    "diagonal_sums",
    "reduce_layer",
    "attention_scores",
    "recompute_pattern",
]


def default_log_floor(dtype: torch.dtype) -> float:
    """The default ``eps`` of the log scale: the smallest normal number of ``dtype``."""
    return float(torch.finfo(dtype).tiny)


def key_lag_index(n_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat ``[query, key]`` indices that lay a ``[T, T]`` matrix out as ``[key t, lag dt]``.

    ``index[t * T + dt] = (t + dt) * T + t`` where ``t + dt < T``. Slots with
    ``t + dt >= T`` point at ``(0, T-1)``, an entry above the diagonal, which every
    causal mask hides and :func:`reduce_layer` zeroes.

    Returns:
        ``LongTensor [T * T]``.
    """
    t = torch.arange(n_positions, device=device).view(-1, 1)
    dt = torch.arange(n_positions, device=device).view(1, -1)
    query = t + dt
    index = query * n_positions + t
    hidden = torch.full_like(index, max(n_positions - 1, 0))
    return torch.where(query < n_positions, index, hidden).reshape(-1)


def visible_mask(
    n_positions: int,
    window: int | None,
    lengths: torch.Tensor,
    excluded_keys: Sequence[int] = (),
) -> torch.Tensor:
    """``V``: which entries the statistics read, ``[batch, query, key]`` bool.

    ``k <= q`` (causal), ``q - k < window`` for a sliding window, ``q < length`` of the
    window (right padding), and ``k`` not among ``excluded_keys``.
    """
    device = lengths.device
    query = torch.arange(n_positions, device=device).view(-1, 1)
    key = torch.arange(n_positions, device=device).view(1, -1)
    allowed = key <= query
    if window is not None:
        allowed = allowed & (query - key < window)
    for excluded in excluded_keys:
        if 0 <= excluded < n_positions:
            allowed[:, excluded] = False
    real_query = query.view(1, -1) < lengths.view(-1, 1)
    return allowed.unsqueeze(0) & real_query.unsqueeze(-1)


def uniform_prior(n_positions: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``u(q) = 1/|V(q)|`` under the model's mask (no padding, no exclusions): ``[T]`` float64."""
    visible = torch.arange(1, n_positions + 1, device=device, dtype=torch.float64)
    if window is not None:
        visible = visible.clamp(max=window)
    return 1.0 / visible


def mask_statistics(visible: torch.Tensor, prior: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parts of the statistics that depend on the mask alone (shared by all heads).

    Args:
        visible: ``[batch, query, key]`` bool from :func:`visible_mask`.
        prior: ``u(q)``, ``[T]`` float64.
        index: :func:`key_lag_index` for ``T``.
    """
    batch, n_positions, _ = visible.shape
    visible_kl = visible.reshape(batch, -1)[:, index].view(batch, n_positions, n_positions)
    prior_kl = prior[index // n_positions].view(n_positions, n_positions)
    count_kl = visible_kl.sum(0, dtype=torch.float64)  # [t, dt]
    return {
        "query_count": visible.sum((0, 2), dtype=torch.float64),
        "lag_count": count_kl.sum(0),
        "lag_prior_sum": (count_kl * prior_kl).sum(0),
        "key_lag_count": count_kl,
        "key_lag_prior_sum": count_kl * prior_kl,
        "visible_kl": visible_kl,
        "doc_lag_count": visible_kl.sum(1, dtype=torch.float64),  # [batch, dt]
    }


def entry_moments(
    pattern: torch.Tensor, mask: torch.Tensor, row_count: torch.Tensor, log_floor: float
) -> tuple[torch.Tensor, ...]:
    """The per-entry work of :func:`reduce_layer`: one pass of elementwise maths and row sums.

    Args:
        pattern: ``[batch, head, query, key]`` float32 or float64.
        mask: ``[batch, 1, query, key]`` bool, visible entries.
        row_count: ``[batch, 1, query]`` float64, visible keys per row.
        log_floor: ``eps`` of the log scale.

    Returns:
        ``visible_weights`` (pattern, 0 where hidden), per row ``Σa, Σa², Σlog, Σlog²``
        (``[batch, head, query]`` float64), floored entries per head ``[head]`` and the
        batch-summed pattern ``[head, query, key]`` float64.

    This function is elementwise maths and reductions only, so ``torch.compile`` fuses it
    into a few loops (about 10x fewer passes over memory than eager on CPU).
    """
    zero = torch.zeros((), dtype=pattern.dtype, device=pattern.device)
    visible_weights = torch.where(mask, pattern, zero)
    logs = torch.where(mask, torch.log(pattern.clamp_min(log_floor)), zero)
    row_sum, row_sq = _row_moments(visible_weights, mask, row_count)
    log_sum, log_sq = _row_moments(logs, mask, row_count)
    floored = ((pattern < log_floor) & mask).sum((0, 2, 3), dtype=torch.float64)
    batch_sum = visible_weights.sum(0, dtype=torch.float64)
    return visible_weights, row_sum, row_sq, log_sum, log_sq, floored, batch_sum


#: Patterns with at least this many entries go through the compiled ``entry_moments``.
COMPILE_MIN_ENTRIES = 2**22
_compiled_moments: Any = None
_compile_failed = False


def _moments_function(numel: int):
    """``entry_moments``, compiled when worthwhile and possible, else eager.

    Compilation costs ~20 s once per process (cached on disk by torch) and needs a C++
    compiler; it is skipped for small patterns, when ``EQUIVARIANCE_PROBE_COMPILE=0``,
    and after any failure (with a warning), so results never depend on it.
    """
    global _compiled_moments
    if numel < COMPILE_MIN_ENTRIES or _compile_failed or os.environ.get("EQUIVARIANCE_PROBE_COMPILE", "1") == "0":
        return entry_moments
    if _compiled_moments is None:
        _compiled_moments = torch.compile(entry_moments, dynamic=True)
    return _compiled_moments


def compiled_entry_moments(pattern, mask, row_count, log_floor):
    """:func:`entry_moments` through ``torch.compile`` where that pays off, else eager (same maths)."""
    global _compile_failed
    function = _moments_function(pattern.numel())
    if function is entry_moments:
        return entry_moments(pattern, mask, row_count, log_floor)
    try:
        return function(pattern, mask, row_count, log_floor)
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the same maths
        _compile_failed = True
        warnings.warn(f"torch.compile of the attention reduction failed ({error!r:.200}); using eager torch", stacklevel=2)
        return entry_moments(pattern, mask, row_count, log_floor)


def diagonal_sums(visible_weights: torch.Tensor, max_lag: int) -> torch.Tensor:
    """``D[b, h, dt] = Σ_t a[b, h, t+dt, t]`` for ``dt < max_lag`` (0 beyond): ``[batch, head, T]`` float64.

    One strided view per lag: cheaper than gathering the whole pattern into key-lag layout.
    """
    batch, heads, n_positions, _ = visible_weights.shape
    out = torch.zeros((batch, heads, n_positions), dtype=torch.float64, device=visible_weights.device)
    for lag in range(min(max_lag, n_positions)):
        out[..., lag] = torch.diagonal(visible_weights, offset=-lag, dim1=-2, dim2=-1).sum(-1, dtype=torch.float64)
    return out


def reduce_layer(
    pattern: torch.Tensor,
    visible: torch.Tensor,
    index: torch.Tensor,
    log_floor: float,
    doc_lag_count: torch.Tensor,
    keep_pattern: bool = False,
    max_lag: int | None = None,
    moments: Any = None,
) -> dict[str, torch.Tensor]:
    """Reduce one layer's attention of one batch to per-head sums.

    Args:
        pattern: ``[batch, head, query, key]`` post-softmax weights, any float dtype
            (bf16/fp16 are upcast to float32 first).
        visible: ``[batch, query, key]`` bool, the entries to read (:func:`visible_mask`).
        index: :func:`key_lag_index` for ``T``.
        log_floor: ``eps``; the log scale reads ``log max(a, eps)``.
        doc_lag_count: ``[batch, dt]`` visible entries per lag in each window.
        keep_pattern: also return the key-lag pattern summed over the batch.
        max_lag: no visible entry has ``q - k >= max_lag`` (the sliding window); ``None``: ``T``.
        moments: the function doing the per-entry work, :func:`entry_moments` by default;
            local runs pass a compiled version of it. (Code that runs inside a remote
            nnsight trace keeps the default: it must use plain torch.)

    Returns:
        float64 tensors: ``raw_sum, raw_sq, log_sum, log_sq, lag_sum: [head, T]``,
        ``floored, doc_toeplitz_sum, doc_toeplitz_count: [head]``, ``key_lag_sum: [T, T]``
        and, if asked, ``pattern_sum: [head, T, T]`` (key-lag layout).

    Per window, the Toeplitz R² (TISA appendix B) of a head's pattern is
    ``1 - RSS/TSS`` with ``RSS = Σ a² - Σ_dt n_dt m_dt²`` (``m_dt`` the mean of the
    diagonal ``dt``) and ``TSS = Σ a² - N ā²``, over visible entries.
    """
    batch, heads, n_positions, _ = pattern.shape
    work_dtype = torch.float64 if pattern.dtype == torch.float64 else torch.float32
    weights = pattern.to(work_dtype)
    mask = visible.unsqueeze(1)
    row_count = visible.sum(-1, dtype=torch.float64).unsqueeze(1)  # [batch, 1, query]
    visible_weights, row_sum, row_sq, log_sum, log_sq, floored, batch_sum = (moments or entry_moments)(
        weights, mask, row_count, log_floor
    )
    out = {
        "raw_sum": row_sum.sum(0),
        "raw_sq": row_sq.sum(0),
        "log_sum": log_sum.sum(0),
        "log_sq": log_sq.sum(0),
        "floored": floored,
    }
    # Lag sums from the batch-summed pattern: one gather of [head, T, T], not [batch, head, T, T].
    key_lag = batch_sum.reshape(heads, -1)[:, index].view(heads, n_positions, n_positions)  # [head, t, dt]
    out["lag_sum"] = key_lag.sum(1)
    out["key_lag_sum"] = key_lag.sum(0)
    if keep_pattern:
        out["pattern_sum"] = key_lag
    diagonal_sum = diagonal_sums(visible_weights, max_lag or n_positions)  # [batch, head, dt]

    # Per-window Toeplitz R².
    n_entries = doc_lag_count.sum(-1).unsqueeze(1)  # [batch, 1]
    total = row_sum.sum(-1)  # [batch, head]
    square = row_sq.sum(-1)
    lag_count = doc_lag_count.unsqueeze(1)
    diagonal_fit = torch.where(lag_count > 0, diagonal_sum.square() / lag_count.clamp_min(1), torch.zeros_like(diagonal_sum))
    rss = (square - diagonal_fit.sum(-1)).clamp_min(0)
    tss = square - total.square() / n_entries.clamp_min(1)
    # A window whose pattern has no variance (one token, or exactly uniform over a
    # single diagonal) has no Toeplitz R²; it is left out and not counted.
    has_variance = tss > 1e-12 * square.clamp_min(1e-300)
    r2 = torch.where(has_variance, 1 - rss / tss.clamp_min(1e-300), torch.zeros_like(tss))
    out["doc_toeplitz_sum"] = r2.sum(0)
    out["doc_toeplitz_count"] = has_variance.sum(0, dtype=torch.float64)
    return out


def _row_moments(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ_k y`` and ``Σ_k y²`` per row, in float64, accurate to float64 even for float32 ``y``.

    Squaring float32 values rounds each square (relative 6e-8), which would leave a
    spurious within-group variance of order 1e-7 where the truth is exactly 0 (uniform
    attention). So the sum of squares is built from deviations around the row mean:
    ``Σy² = Σ(y - m̃)² - n(m - m̃)² + n m²`` with ``m`` the float64 mean and ``m̃`` its
    rounding to ``y``'s dtype.

    Args:
        values: ``[batch, head, query, key]``, zero where ``mask`` is false.
        mask: ``[batch, 1, query, key]`` bool.
        count: ``[batch, 1, query]`` float64 visible keys per row.
    """
    total = values.sum(-1, dtype=torch.float64)
    mean = total / count.clamp_min(1)
    mean_rounded = mean.to(values.dtype)
    deviation = torch.where(mask, values - mean_rounded.unsqueeze(-1), torch.zeros((), dtype=values.dtype, device=values.device))
    spread = (deviation * deviation).sum(-1, dtype=torch.float64)
    offset = mean - mean_rounded.to(torch.float64)
    squares = (spread - count * offset * offset + count * mean * mean).clamp_min(0)
    return total, squares


def attention_scores(
    query: torch.Tensor, key: torch.Tensor, scaling: float | None, softcap: float | None
) -> torch.Tensor:
    """Pre-softmax, pre-mask attention scores as eager attention computes them.

    ``s = softcap(q·kᵀ·scaling)`` with ``softcap(s) = c·tanh(s/c)`` (Gemma 2) when ``softcap``
    is given. Grouped-query attention: each key head serves ``H / H_kv`` consecutive query
    heads (``repeat_kv`` in transformers). Float32 for half-precision inputs, float64 kept.

    Args:
        query: ``[batch, head, query, head_dim]``, after rotary embeddings and q-norm.
        key: ``[batch, kv_head, key, head_dim]``, likewise.
        scaling: the module's score scale (``head_dim**-0.5`` when ``None``, as eager).
        softcap: logit soft-capping ``c``, or ``None``.

    Returns:
        ``[batch, head, query, key]`` scores.
    """
    n_heads, n_kv_heads = query.shape[1], key.shape[1]
    if n_heads != n_kv_heads:
        key = key.repeat_interleave(n_heads // n_kv_heads, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def recompute_pattern(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """Post-softmax attention from queries and keys, as eager attention computes it.

    ``a = softmax(mask(softcap(q·kᵀ·scaling)))`` in float32, where
    ``softcap(s) = c·tanh(s/c)`` (Gemma 2) and the mask hides ``k > q`` and, for a
    sliding window ``w``, ``q - k >= w``. Grouped-query attention: each key head serves
    ``H / H_kv`` consecutive query heads (``repeat_kv`` in transformers).

    Args:
        query: ``[batch, head, query, head_dim]``, after rotary embeddings and q-norm.
        key: ``[batch, kv_head, key, head_dim]``, likewise.
        scaling: the module's score scale (``head_dim**-0.5`` when ``None``, as eager).
        softcap: logit soft-capping ``c``, or ``None``.
        window: sliding window width ``w``, or ``None`` for full causal attention.

    Returns:
        ``[batch, head, query, key]`` float32, rows sum to 1.
    """
    scores = attention_scores(query, key, scaling, softcap).float()
    n_query, n_key = scores.shape[-2], scores.shape[-1]
    q = torch.arange(n_query, device=scores.device).view(-1, 1)
    k = torch.arange(n_key, device=scores.device).view(1, -1)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    # Every row keeps its diagonal, so no row is all -inf (right padding, causal mask).
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)
