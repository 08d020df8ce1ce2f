"""The in-trace engine: torch-only reductions that run where the model runs (inside a remote nnsight
trace): scores, masks, and the reduction of one layer's captured attention.

Place in the seams: *statistics*. The functions here use torch, math and builtins alone, so
that, shipped by value, they run inside a remote nnsight trace on a server where
equivariance_probe is not installed (:mod:`~equivariance_probe.adapters.nnsight_remote`). A
remote batch is reduced by :func:`reduce_layer` from the whole pattern of one layer at a time
(the server has the memory); local runs use the query-block engine of
:mod:`~equivariance_probe.statistics.engines.torch_blocks`, which returns the same sums.

Coordinates: ``query`` ``q`` and ``key`` ``k`` are absolute positions in a window; ``lag`` is
``dt = q - k``.
"""

from __future__ import annotations

from collections.abc import Sequence

import einops
import torch

from ..masks import default_log_floor, uniform_prior
from .block_maths import row_moments, toeplitz_r2_per_window

__all__ = [
    "default_log_floor",
    "uniform_prior",
    "visible_mask",
    "visible_from_mask",
    "diagonal_profile_sums",
    "entry_moments",
    "diagonal_sums",
    "reduce_layer",
    "reduce_pattern",
    "attention_scores",
    "recompute_pattern",
    "repeat_kv",
]


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


def visible_from_mask(mask: torch.Tensor | None, shape: Sequence[int]) -> torch.Tensor:
    """Boolean ``[batch, 1 or head, query, key]`` of the entries a mask lets through.

    ``None`` means every entry; a boolean mask is used as is; an additive float mask counts
    an entry as visible unless it holds a large negative value (transformers fills hidden
    entries with the dtype's minimum).
    """
    if mask is None:
        return torch.ones(tuple(shape), dtype=torch.bool)
    mask = mask[..., : shape[-2], : shape[-1]]
    if mask.dtype == torch.bool:
        return mask.expand(*mask.shape[:-2], shape[-2], shape[-1])
    return mask > torch.finfo(mask.dtype).min / 2


def diagonal_profile_sums(scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the sum and count of visible scores on each diagonal ``k = q - key``.

    Args:
        scores: ``[batch, head, query, key]``.
        visible: bool, broadcastable to ``scores``.

    Returns:
        ``(sums [head, 2T-1], counts [head, 2T-1])`` float64, index ``k + T - 1`` for
        ``k = -(T-1) .. T-1``.
    """
    batch, heads, n_query, n_key = scores.shape
    visible = visible.expand_as(scores)
    index = (torch.arange(n_query).view(-1, 1) - torch.arange(n_key).view(1, -1) + n_key - 1).to(scores.device)
    index = index.expand(batch, heads, n_query, n_key)
    width = n_query + n_key - 1
    values = torch.where(visible, scores.to(torch.float64), torch.zeros((), dtype=torch.float64, device=scores.device))
    sums = torch.zeros(heads, width, dtype=torch.float64, device=scores.device)
    counts = torch.zeros(heads, width, dtype=torch.float64, device=scores.device)
    by_head = "batch head query key -> head (batch query key)"
    flat_index = einops.rearrange(index, by_head)
    sums.scatter_add_(1, flat_index, einops.rearrange(values, by_head))
    counts.scatter_add_(1, flat_index, einops.rearrange(visible, by_head).to(torch.float64))
    return sums.cpu(), counts.cpu()


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
    row_sum, row_sq = row_moments(visible_weights, mask, row_count)
    log_sum, log_sq = row_moments(logs, mask, row_count)
    floored = ((pattern < log_floor) & mask).sum((0, 2, 3), dtype=torch.float64)
    batch_sum = visible_weights.sum(0, dtype=torch.float64)
    return visible_weights, row_sum, row_sq, log_sum, log_sq, floored, batch_sum


def diagonal_sums(values: torch.Tensor) -> torch.Tensor:
    """``D[..., dt] = Σ_t values[..., t+dt, t]``: sums along the diagonals at and below the main one, ``[..., T]``.

    The matrix is padded with ``T - 1`` zero columns in front and read with row stride ``W + 1``
    (``W = 2T - 1``), which shifts row ``i`` left by ``i``: diagonals become columns, and one sum
    over the rows gives every diagonal at once (a strided view; no loop over lags).
    """
    n_positions = values.shape[-1]
    leading = values.shape[:-2]
    flat = values.reshape(-1, n_positions, n_positions)
    padded = torch.nn.functional.pad(flat, (n_positions - 1, 0)).contiguous()
    width = 2 * n_positions - 1
    skewed = padded.as_strided(
        (flat.shape[0], n_positions, n_positions), (n_positions * width, width + 1, 1), padded.storage_offset()
    )
    return skewed.sum(-2, dtype=torch.float64).flip(-1).reshape(*leading, n_positions)


def reduce_layer(
    pattern: torch.Tensor,
    visible: torch.Tensor,
    log_floor: float,
    key_bin: torch.Tensor,
    n_key_bins: int,
    keep_pattern: bool = False,
) -> dict[str, torch.Tensor]:
    """Reduce one layer's captured attention of one batch to per-head sums (the remote path).

    Args:
        pattern: ``[batch, head, query, key]`` post-softmax weights, any float dtype
            (bf16/fp16 are upcast to float32 first).
        visible: ``[batch, query, key]`` bool, the entries to read (:func:`visible_mask`).
        log_floor: ``eps``; the log scale reads ``log max(a, eps)``.
        key_bin: ``[T]`` long, the key-position bin of every key.
        n_key_bins: ``K``.
        keep_pattern: also return the pattern summed over the batch.

    Returns:
        float64 tensors: ``raw_sum, raw_sq, log_sum, log_sq, lag_sum: [head, T]``,
        ``floored, doc_toeplitz_sum, doc_toeplitz_count: [head]``, ``key_lag_sum: [K, T]``
        (summed over heads, indexed ``[key bin, lag]``) and, if asked, ``pattern_sum: [head, T, T]``
        (query-key layout).

    Per window, the Toeplitz R² (TISA appendix B) of a head's pattern is
    ``1 - RSS/TSS`` with ``RSS = Σ a² - Σ_dt n_dt m_dt²`` (``m_dt`` the mean of the
    diagonal ``dt``) and ``TSS = Σ a² - N ā²``, over visible entries.
    """
    batch, heads, n_positions, _ = pattern.shape
    work_dtype = torch.float64 if pattern.dtype == torch.float64 else torch.float32
    mask = visible.unsqueeze(1)
    row_count = visible.sum(-1, dtype=torch.float64).unsqueeze(1)  # [batch, 1, query]
    visible_weights, row_sum, row_sq, log_sum, log_sq, floored, batch_sum = entry_moments(
        pattern.to(work_dtype), mask, row_count, log_floor
    )
    diagonal_sum = diagonal_sums(visible_weights)  # [batch, head, dt]
    out = {
        "raw_sum": row_sum.sum(0),
        "raw_sq": row_sq.sum(0),
        "log_sum": log_sum.sum(0),
        "log_sq": log_sq.sum(0),
        "floored": floored,
        "lag_sum": diagonal_sum.sum(0),
    }
    # Key-bin lag sums: every entry (q, k) of the head-summed pattern goes to [bin(k), q - k].
    query = torch.arange(n_positions, device=pattern.device).view(-1, 1)
    key = torch.arange(n_positions, device=pattern.device).view(1, -1)
    index = key_bin.to(pattern.device).view(1, -1) * n_positions + (query - key).clamp_min(0)
    key_lag = torch.zeros(n_key_bins * n_positions, dtype=torch.float64, device=pattern.device)
    key_lag.index_add_(0, index.reshape(-1), batch_sum.sum(0).reshape(-1))
    out["key_lag_sum"] = key_lag.view(n_key_bins, n_positions)
    if keep_pattern:
        out["pattern_sum"] = batch_sum

    # Per-window Toeplitz R²; a window without variance is left out and not counted.
    doc_lag_count = diagonal_sums(visible.to(torch.float64))  # [batch, dt]
    r2, has_variance = toeplitz_r2_per_window({"raw_sum": row_sum, "raw_sq": row_sq, "lag_sum": diagonal_sum},
                                              doc_lag_count)
    out["doc_toeplitz_sum"] = r2.sum(0)
    out["doc_toeplitz_count"] = has_variance.sum(0, dtype=torch.float64)
    return out


def reduce_pattern(pattern: torch.Tensor, lengths: torch.Tensor, spec: dict, visible=None) -> dict:
    """The in-trace engine: one layer's sums of ``pattern: [batch, head, query, key]`` under a reduction spec
    in plain form (:meth:`~equivariance_probe.statistics.engines.spec.ReductionSpec.plain`: ``window``,
    ``excluded_keys``, ``log_floor``, ``key_bin``, ``n_key_bins``, ``keep_pattern``, ``keep_first_key``), as
    :func:`reduce_layer` returns them, with ``first_key_sum: [head, T]`` (``Σ_b a[b, h, q, 0]`` over the
    real queries whose mask shows key 0, excluded or not: the attention-sink sums) and ``first_key_window:
    [batch, head]`` (``Σ_q a[b, h, q, 0]``, each window's, for the per-window sink rate) when
    ``keep_first_key``; ``visible`` (:func:`visible_mask`) when the caller already has it for this window."""
    # No typing names in here: annotations would make the payload import `typing`.
    n_positions = pattern.shape[-1]
    if visible is None:
        visible = visible_mask(n_positions, spec["window"], lengths, spec["excluded_keys"])
    key_bin = torch.tensor(spec["key_bin"][:n_positions], dtype=torch.long, device=pattern.device)
    out = reduce_layer(pattern, visible, spec["log_floor"], key_bin, spec["n_key_bins"], keep_pattern=spec["keep_pattern"])
    if spec.get("keep_first_key"):
        # Read from the pattern, not through `visible`: an excluded key 0 is still in the softmax.
        query = torch.arange(n_positions, device=pattern.device).view(1, -1)
        seen = query < lengths.to(pattern.device).view(-1, 1)
        if spec["window"] is not None:
            seen = seen & (query < spec["window"])
        first = pattern[..., 0].to(torch.float64)
        first = torch.where(seen.unsqueeze(1), first, torch.zeros_like(first))
        out["first_key_sum"] = first.sum(0)
        out["first_key_window"] = first.sum(-1)
    return out


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query attention's keys or values, one per query head: ``x: [..., kv_head, position, d]`` ->
    ``[..., head, position, d]``, each key head repeated for the ``H / H_kv`` consecutive query heads it serves
    (``repeat_kv`` in transformers; ``x`` itself when every query head has its own).
    """
    if x.shape[-3] == n_heads:
        return x
    return einops.repeat(x, "... kv t d -> ... (kv g) t d", g=n_heads // x.shape[-3])


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
    key = repeat_kv(key, query.shape[1])
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
