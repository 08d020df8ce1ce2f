"""Per-window attention sums computed from queries and keys, one query block at a time.

Place in the seams: *statistics*, the local engine. :class:`~equivariance_probe.statistics.
AttentionStatistics` adds what these functions return; on CUDA the fused kernel of
:mod:`~equivariance_probe.statistics.triton_kernels` computes the same sums in one launch.

Every statistic of docs/methods.md sections 1-3 (query-position R², persistence, Toeplitz) is a function
of a few float64 sums over the *visible* attention entries of each window (their streaming accumulator,
:class:`~equivariance_probe.statistics.AttentionStatistics`, merges them across batches by
adding). This module computes those sums for one layer and one
batch of right-padded windows directly from the layer's queries and keys, without ever
holding a ``[T, T]`` pattern per head: queries are processed in blocks of ``block_size``
rows, and each block holds only ``[batch, head, block, keys it can see]`` scores (with a
sliding window ``w``, the keys ``[q0 - w + 1, q1)``). A second entry point computes the
same sums from captured post-softmax weights, for models whose attention cannot be
recomputed from ``q`` and ``k`` (ALiBi biases, learned sink logits).

Conventions (those of today's per-layer reduction and of the nnsight adapter's
``recompute_pattern``):

- ``query: [B, H, T, d]``, ``key: [B, H_kv, T, d]`` after rotary embeddings and q/k norms.
  Query head ``h`` reads key head ``h // (H / H_kv)`` (transformers' ``repeat_kv``).
- Scores ``s = softcap(q·kᵀ·scaling)`` with ``softcap(s) = c·tanh(s / c)``; ``scaling``
  defaults to ``d**-0.5``. Scores are computed in float64 for float64 inputs and in
  float32 otherwise (bf16/fp16 inputs are upcast, so products are exact and only the
  accumulation rounds); float32 products are never taken in TF32 or bf16
  (:func:`full_float32_matmul`).
- The model's mask: query ``q`` sees key ``k`` iff ``k <= q`` and, for a sliding window
  ``w``, ``q - k < w``. The softmax ``a = softmax(masked s)`` runs over those keys.
- An entry ``(b, q, k)`` is *visible* to the statistics iff the mask allows it, ``q`` is
  a real token of window ``b`` (``q < lengths[b]``, right padding) and ``k`` is not one of
  ``excluded_keys``. Excluded keys stay in the softmax (the model attends to them, e.g.
  an attention sink) but are left out of every sum.
- The log scale reads ``y = log max(a, eps) = max(log a, log eps)``; from scores,
  ``log a`` is computed as ``s - logsumexp(s)``, which stays accurate where ``a`` itself
  underflows. An entry is *floored* when ``log a < log eps``.
- ``key_bin: [T]`` maps each key position to one of ``K`` contiguous bins, for the
  key-conditioned persistence curves (``key_bin = arange(T)``: one curve per key).

The sums (float64, on the input's device):

==============  ===============  ====================================================
name            shape            meaning
==============  ===============  ====================================================
``raw_sum``     ``[B, H, T]``    ``Σ_k a[q, k]`` over the visible keys of row ``q``
``raw_sq``      ``[B, H, T]``    ``Σ_k a[q, k]²``
``log_sum``     ``[B, H, T]``    ``Σ_k y[q, k]``
``log_sq``      ``[B, H, T]``    ``Σ_k y[q, k]²``
``floored``     ``[B, H]``       visible entries with ``log a < log eps``
``lag_sum``     ``[B, H, T]``    ``Σ_t a[t + dt, t]`` by lag ``dt = q - k``
``key_lag_sum`` ``[K, T]``       ``Σ`` over windows and heads of ``a[q, k]`` with
                                 ``key_bin[k] = κ`` and ``q - k = dt``, ``[κ, dt]``
``pattern_sum`` ``[H, T, T]``    optional: ``Σ_b a[b, h, q, k]``, query-key layout
==============  ===============  ====================================================

Rows of padding queries (``q >= lengths[b]``) are 0 everywhere. The mask-only sums
(entry counts and the uniform prior's curves) do not depend on the model; they come in
closed form from :func:`~equivariance_probe.statistics.masks.mask_counts`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError
from .masks import _check_key_bins, _effective_window, _excluded_flags, default_log_floor, n_lags, visible_key_counts

__all__ = [
    "DEFAULT_BLOCK_MEMORY",
    "ENGINES",
    "BlockWorkspace",
    "SUM_NAMES",
    "attention_sums_from_qk",
    "attention_sums_from_weights",
    "choose_block_size",
    "full_float32_matmul",
    "pattern_sum_from_qk",
    "row_moments",
    "toeplitz_r2_per_window",
]

#: How the sums of a layer can be computed (``AttentionStatistics.update_from_scores``,
#: ``triton_kernels.attention_sums``): ``"auto"`` (the fused Triton kernel on CUDA where Triton
#: imports, else torch), ``"torch"``, ``"triton"``.
ENGINES = ("auto", "torch", "triton")

#: The per-window sums every path returns (``pattern_sum`` is added on request).
SUM_NAMES = ("raw_sum", "raw_sq", "log_sum", "log_sq", "floored", "lag_sum", "key_lag_sum")

#: Default memory budget of one query block's temporaries, in bytes (see
#: :func:`choose_block_size`): about 1.4 million block entries in float32 work, so that
#: memory limits the block only for long contexts or many heads (below 64 rows from
#: ``B·H·T`` of about 22,000 on), where 16-32 rows measured as fast as larger blocks.
DEFAULT_BLOCK_MEMORY = 96 * 2**20

#: Bytes of temporaries per ``[batch, head, query, key]`` entry of a block, by work dtype:
#: the scores, weights, log weights and the mask test in the work dtype, the float64
#: weights (padded for the lag sums), log weights and deviations of the row moments, and
#: what torch allocates inside the operations (a float64 output computed from float32
#: inputs goes through a float32 temporary). The figures are the peak resident memory per
#: entry measured on CPU (``[2, 4, 256, 4096]`` blocks: 69 and 79 bytes), rounded up.
_BYTES_PER_ENTRY = {torch.float32: 72, torch.float64: 80}

#: Query blocks are a multiple of this many rows (when there are that many), which keeps
#: the matrix products on their fast paths.
_BLOCK_MULTIPLE = 16

#: Upper bound on the automatic block size. On CPU (2 cores), once the temporaries stay in a
#: :class:`BlockWorkspace`, blocks of 64 rows were as fast as 128 under full causal attention and
#: 10-15% faster than 128-256 under a 512-token window (``[2, 4]`` windows and heads at T = 1024,
#: ``[1, 4]`` at T = 8192): larger blocks fall out of the caches, and the matrix products gain
#: nothing beyond a few dozen rows.
_MAX_AUTO_BLOCK = 64


# -- small helpers --------------------------------------------------------------------


@contextlib.contextmanager
def full_float32_matmul(device: torch.device | str) -> Iterator[None]:
    """Inside, float32 matrix products on ``device`` use IEEE float32 (no TF32 or bf16).

    torch may be configured (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.set_float32_matmul_precision``, the ``fp32_precision`` settings) to take
    float32 products in TF32 on CUDA or bf16 through oneDNN on CPU, which rounds the
    inputs to 10 or 7 mantissa bits: far too coarse for scores whose softmax we sum to
    float64. The setting is process-global, so it is changed only for the duration of the
    block and restored afterwards (not thread-safe, like the settings themselves).
    """
    device = torch.device(device)
    backend = torch.backends.cuda.matmul if device.type == "cuda" else getattr(
        getattr(torch.backends, "mkldnn", None), "matmul", None
    )
    previous_precision = getattr(backend, "fp32_precision", None) if backend is not None else None
    previous_tf32 = None
    try:
        if previous_precision is not None:
            backend.fp32_precision = "ieee"
        elif device.type == "cuda":
            previous_tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
    except (AttributeError, RuntimeError, ValueError):
        previous_precision = previous_tf32 = None  # a torch without these settings
    try:
        yield
    finally:
        if previous_precision is not None:
            backend.fp32_precision = previous_precision
        if previous_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = previous_tf32


def choose_block_size(
    batch: int,
    heads: int,
    n_positions: int,
    window: int | None,
    dtype: torch.dtype = torch.float32,
    memory_budget: int = DEFAULT_BLOCK_MEMORY,
) -> int:
    """Rows per query block so that one block's temporaries fit ``memory_budget`` bytes.

    A block of ``n`` query rows holds about ``B·H·n·n_keys(n)·bytes_per_entry`` bytes,
    with ``n_keys(n) = T`` under full causal attention and ``min(T, w + n - 1)`` under a
    sliding window ``w``, and ``bytes_per_entry`` 72 for float32 work, 80 for float64
    (measured peaks). The rule takes the largest ``n`` with
    ``B·H·n·n_keys(n)·bytes_per_entry <= budget`` (solving the quadratic for windows),
    rounds it down to a multiple of 16 and clamps it to ``[1, min(T, 64)]``: larger
    blocks only fall out of the caches. With the default 96 MiB: 64 rows at
    ``B·H = 16``, ``T = 1024`` (full causal or window 512), 16 rows at ``B·H = 64``,
    ``T = 1024``, and 32 rows at ``B·H = 4``, ``T = 8192``.

    Args:
        batch, heads: ``B`` and ``H`` (query heads).
        n_positions: ``T``.
        window: sliding window width or ``None``.
        dtype: the work dtype (float32 or float64).
        memory_budget: bytes allowed for one block's temporaries.

    Returns:
        The block size, between 1 and ``T``.
    """
    window = _effective_window(window, n_positions)
    per_row_entry = max(1, batch * heads) * _BYTES_PER_ENTRY.get(dtype, _BYTES_PER_ENTRY[torch.float32])
    entries = memory_budget / per_row_entry  # allowed n·n_keys(n)
    if window is None:
        rows = entries / max(n_positions, 1)
    else:
        # n·(w + n) <= entries, the positive root of n² + w·n - entries.
        rows = (-window + math.sqrt(window * window + 4.0 * entries)) / 2.0
        if rows + window - 1 > n_positions:
            rows = entries / max(n_positions, 1)
    rows = int(rows)
    if rows >= _BLOCK_MULTIPLE:
        rows -= rows % _BLOCK_MULTIPLE
    return max(1, min(rows, _MAX_AUTO_BLOCK, n_positions))


# -- inputs ---------------------------------------------------------------------------


@dataclass
class _Layout:
    """One batch's mask, validated and laid out for the block loop."""

    batch: int
    heads: int
    n_positions: int
    window: int | None  # None when the window covers the context
    lengths: torch.Tensor  # [B] long, on the device
    host_lengths: list[int]
    key_keep: torch.Tensor  # [T] bool: not excluded
    excluded: list[int]  # excluded positions inside [0, T)
    row_count: torch.Tensor  # [B, T] float64 visible keys per row
    key_bin: torch.Tensor  # [T] long
    n_key_bins: int
    log_floor: float
    device: torch.device
    causal: bool = True

    @property
    def n_lags(self) -> int:
        """Lags of the lag sums: ``T`` (``0 .. T-1``) causal, ``2T - 1`` (``-(T-1) .. T-1``) bidirectional."""
        return n_lags(self.n_positions, self.causal)

    @property
    def lag_offset(self) -> int:
        """Index of lag 0 in a lag array."""
        return 0 if self.causal else self.n_positions - 1

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[k0, k1)`` any query of rows ``[q0, q1)`` can see: up to the block's last row under a
        causal mask (from ``q0 - w + 1`` with a window ``w``), every real key of the batch otherwise."""
        if not self.causal:
            return 0, max(self.host_lengths, default=0)
        return (0 if self.window is None else max(0, q0 - self.window + 1)), q1

    def allowed(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The model's mask on rows ``[q0, q1)`` and keys ``[k0, k1)``, broadcastable to
        ``[B, 1, rows, keys]`` bool: ``[1, 1, rows, keys]`` causal, ``[B, 1, 1, keys]`` (the
        window's real keys) bidirectional."""
        key = torch.arange(k0, k1, device=self.device)
        if not self.causal:
            return (key.view(1, -1) < self.lengths.view(-1, 1)).view(-1, 1, 1, k1 - k0)
        query = torch.arange(q0, q1, device=self.device).view(-1, 1)
        allowed = key.view(1, -1) <= query
        if self.window is not None:
            allowed = allowed & (query - key.view(1, -1) < self.window)
        return allowed.view(1, 1, q1 - q0, k1 - k0)

    def masks_more_than_the_model(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether the block holds entries the model sees but the statistics do not read: an
        excluded key among ``[k0, k1)``, or a padding row among ``[q0, q1)``."""
        return any(k0 <= key < k1 for key in self.excluded) or min(self.host_lengths, default=q1) < q1

    def visible(self, q0: int, q1: int, k0: int, k1: int, allowed: torch.Tensor) -> torch.Tensor:
        """Entries the statistics read in the block: ``[B, 1, rows, keys]`` bool."""
        real = torch.arange(q0, q1, device=self.device).view(1, -1) < self.lengths.view(-1, 1)
        visible = allowed & real.view(-1, 1, q1 - q0, 1)
        if self.excluded:
            visible = visible & self.key_keep[k0:k1]
        return visible


def _layout(
    *,
    batch: int,
    heads: int,
    n_positions: int,
    device: torch.device,
    window: int | None,
    lengths: torch.Tensor | None,
    excluded_keys: Sequence[int],
    log_floor: float | None,
    key_bin: torch.Tensor | None,
    n_key_bins: int | None,
    input_dtype: torch.dtype,
    causal: bool = True,
) -> _Layout:
    """Validate the mask arguments shared by every entry point."""
    if lengths is None:
        lengths = torch.full((batch,), n_positions, dtype=torch.long)
    # The lengths are read on the host (block bounds) before they go to the device, so that lengths
    # given on the CPU cost no device-to-host copy.
    host_lengths = [int(n) for n in torch.as_tensor(lengths).reshape(-1).tolist()]
    lengths = torch.as_tensor(lengths).to(device=device, dtype=torch.long, non_blocking=True).reshape(-1)
    if lengths.numel() != batch:
        raise InputError(f"lengths has {lengths.numel()} entries for a batch of {batch} windows")
    if any(n < 0 or n > n_positions for n in host_lengths):
        raise InputError(f"lengths must lie in [0, {n_positions}], got {host_lengths}")
    key_bin, n_key_bins = _check_key_bins(key_bin, n_key_bins, n_positions, device)
    if log_floor is None:
        log_floor = default_log_floor(input_dtype)
    if not log_floor > 0:
        raise InputError(f"log_floor must be positive, got {log_floor}")
    window = _effective_window(window, n_positions)
    if window is not None and not causal:
        raise InputError(f"a bidirectional mask with a sliding window ({window}) is not supported")
    excluded = sorted({int(k) for k in excluded_keys if 0 <= int(k) < n_positions})
    key_keep = ~_excluded_flags(n_positions, excluded, device)
    real = torch.arange(n_positions, device=device).view(1, -1) < lengths.view(-1, 1)
    if causal:
        per_query = visible_key_counts(n_positions, window, excluded, device).view(1, -1)
    else:
        # Every real query of window b sees its L_b real keys that are not excluded.
        per_query = (lengths - sum((lengths > key).long() for key in excluded)).to(torch.float64).view(-1, 1)
    row_count = torch.where(real, per_query, torch.zeros((), dtype=torch.float64, device=device))
    return _Layout(
        batch=batch,
        heads=heads,
        n_positions=n_positions,
        window=window,
        lengths=lengths,
        host_lengths=host_lengths,
        key_keep=key_keep,
        excluded=excluded,
        row_count=row_count,
        key_bin=key_bin,
        n_key_bins=n_key_bins,
        log_floor=float(log_floor),
        device=device,
        causal=bool(causal),
    )


def _check_qk(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Shapes ``(B, H, H_kv, T, d)`` of matching query and key tensors."""
    if query.dim() != 4 or key.dim() != 4:
        raise InputError(
            f"query and key must be [batch, head, position, head_dim], got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    batch, heads, n_positions, dim = query.shape
    kb, kv_heads, n_keys, kdim = key.shape
    if kb != batch or n_keys != n_positions or kdim != dim:
        raise InputError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if kv_heads < 1 or heads % kv_heads:
        raise InputError(f"{heads} query heads cannot share {kv_heads} key heads evenly")
    if key.device != query.device:
        raise InputError(f"query is on {query.device} but key is on {key.device}")
    return batch, heads, kv_heads, n_positions, dim


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_sums(layout: _Layout, keep_pattern: bool) -> dict[str, torch.Tensor]:
    shape = (layout.batch, layout.heads, layout.n_positions)
    zeros = lambda *size: torch.zeros(size, dtype=torch.float64, device=layout.device)  # noqa: E731
    out = {name: zeros(*shape) for name in ("raw_sum", "raw_sq", "log_sum", "log_sq")}
    out["lag_sum"] = zeros(layout.batch, layout.heads, layout.n_lags)
    out["floored"] = zeros(layout.batch, layout.heads)
    out["key_lag_sum"] = zeros(layout.n_key_bins, layout.n_lags)
    if keep_pattern:
        out["pattern_sum"] = zeros(layout.heads, layout.n_positions, layout.n_positions)
    return out


def _blocks(layout: _Layout, block_size: int | None, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` per query block, up to the longest window (later rows are padding), the
    largest block first, so that a :class:`BlockWorkspace` is sized once by the first."""
    if block_size is None:
        block_size = choose_block_size(layout.batch, layout.heads, layout.n_positions, layout.window, dtype)
    block_size = int(block_size)
    if block_size < 1:
        raise InputError(f"block_size must be at least 1, got {block_size}")
    n_real = max(layout.host_lengths, default=0)
    blocks = [(q0, min(q0 + block_size, n_real)) for q0 in range(0, n_real, block_size)]
    blocks = [(q0, q1, *layout.key_range(q0, q1)) for q0, q1 in blocks]
    return sorted(blocks, key=lambda block: (block[1] - block[0]) * (block[3] - block[2]), reverse=True)


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


def _taker(workspace: BlockWorkspace | None, device: torch.device) -> Callable[..., torch.Tensor]:
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


def _block_from_scores(
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
        the per-row ``Σa, Σa², Σy, Σy²`` (``[B, H, rows]`` float64) and the floored entries per
        ``(b, h)`` (``[B, H]`` float64).

    Elementwise maths and row reductions only, so ``torch.compile`` can fuse it.
    """
    take = _taker(workspace, scores.device)
    log_weights = torch.log_softmax(scores, -1, out=take("log_weights", scores.shape, scores.dtype))
    weights = torch.softmax(scores, -1, out=take("weights", scores.shape, scores.dtype))
    below = torch.lt(log_weights, log_eps, out=take("below", scores.shape, torch.bool))
    floored = torch.count_nonzero(below.logical_and_(visible), dim=(-2, -1)).to(torch.float64)
    padded, kept = _padded_float64(weights, pad, pad_after, visible if masked else None, take)
    # The floor, then 0 for every entry the statistics do not read (a product with the 0/1 mask,
    # which the clamp keeps finite), written as float64 in the same pass.
    logs = torch.mul(log_weights.clamp_min_(log_eps), visible, out=take("logs", scores.shape, torch.float64))
    return _moments(padded, kept, logs, visible, row_count, floored, take)


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


def _block_from_weights(
    weights: torch.Tensor, visible: torch.Tensor, row_count: torch.Tensor, log_floor: float, pad: int,
    pad_after: int = 0, workspace: BlockWorkspace | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`_block_from_scores` for captured weights: ``y = log max(a, eps)``, floored ``a < eps``.

    ``weights`` is read, never written (it may be a view of the caller's pattern). Entries the
    statistics do not read may hold anything, NaN included, so they are overwritten with 0
    (``masked_fill_``) rather than multiplied by a 0/1 mask (``NaN·0`` is NaN).
    """
    take = _taker(workspace, weights.device)
    hidden = ~visible
    below = torch.lt(weights, log_floor, out=take("below", weights.shape, torch.bool))
    floored = torch.count_nonzero(below.logical_and_(visible), dim=(-2, -1)).to(torch.float64)
    log_weights = torch.clamp(weights, min=log_floor, out=take("log_weights", weights.shape, weights.dtype)).log_()
    logs = take("logs", weights.shape, torch.float64).copy_(log_weights).masked_fill_(hidden, 0.0)
    padded, kept = _padded_float64(weights, pad, pad_after, None, take)
    kept.masked_fill_(hidden, 0.0)
    return _moments(padded, kept, logs, visible, row_count, floored, take)


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


def _key_lag_index(layout: _Layout, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Flat ``[κ, dt]`` index of each entry of a block into ``key_lag_sum``: ``[rows, keys]``.

    Under a causal mask, entries above the diagonal (which hold 0) point at ``dt = 0`` of their
    key's bin; signed lags sit at ``dt + T - 1``.
    """
    query = torch.arange(q0, q1, device=layout.device).view(-1, 1)
    key = torch.arange(k0, k1, device=layout.device).view(1, -1)
    lag = (query - key).clamp_min(0) if layout.causal else query - key + layout.lag_offset
    return layout.key_bin[k0:k1].view(1, -1) * layout.n_lags + lag


def _accumulate(
    out: dict[str, torch.Tensor],
    layout: _Layout,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    block: tuple[torch.Tensor, ...],
) -> None:
    """Add one block's results (from ``_block_from_*``) to the sums."""
    padded, raw_sum, raw_sq, log_sum, log_sq, floored = block
    rows, n_keys = q1 - q0, k1 - k0
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


# -- optional compilation of the per-block maths ------------------------------------------

_compiled: dict[str, object] = {}
_compile_failed = False


def _block_function(name: str, compile_blocks: bool):
    """The per-block function ``name`` (``"scores"``/``"weights"``), compiled if asked.

    Compilation is tried once per process; any failure (no C++ compiler, an unsupported
    torch) falls back to the eager function for the rest of the process, with a warning,
    so a run never fails because of it. (Compiled and eager blocks agree to float32
    rounding of the weights, not bit for bit; see ``compile_blocks``.)
    """
    eager = _block_from_scores if name == "scores" else _block_from_weights
    if not compile_blocks or _compile_failed:
        return eager
    if name not in _compiled:
        _compiled[name] = torch.compile(eager, dynamic=True)
    return _compiled[name]


def _run_block(
    name: str, compile_blocks: bool, arguments: Callable[[], tuple], workspace: BlockWorkspace | None = None
) -> tuple[torch.Tensor, ...]:
    """Run the per-block function ``name`` on ``arguments()``, compiled if asked.

    ``arguments`` builds the inputs afresh, so after a compiler failure the eager fallback
    does not reuse a tensor the failed call may have touched. The eager function keeps its
    temporaries in ``workspace``; the compiled one allocates its own.
    """
    global _compile_failed
    function = _block_function(name, compile_blocks)
    eager = _block_from_scores if name == "scores" else _block_from_weights
    if function is eager:
        return eager(*arguments(), workspace=workspace)
    try:
        return function(*arguments())
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the same maths
        _compile_failed = True
        warnings.warn(f"torch.compile of the attention block sums failed ({error!r:.200}); using eager torch", stacklevel=3)
        return eager(*arguments(), workspace=workspace)


# -- public entry points --------------------------------------------------------------------


def _block_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    scaling: float,
    softcap: float | None,
    allowed: torch.Tensor,
    workspace: BlockWorkspace | None = None,
) -> torch.Tensor:
    """Masked scores of query rows ``[q0, q1)`` against keys ``[k0, k1)``: ``[B, H, rows, keys]``.

    ``query`` is ``[B, H_kv, G, T, d]`` (the query heads grouped by the key head they
    read), ``key`` is ``[B, H_kv, T, d]``: one batched product per key head serves its
    ``G`` query heads, with no repeated keys. The model's mask enters as a 0/-inf bias
    (``s + 0 = s``, ``s - inf = -inf``).
    """
    batch, kv_heads, group, _, dim = query.shape
    rows, keys = q1 - q0, k1 - k0
    block = query[:, :, :, q0:q1].reshape(batch * kv_heads, group * rows, dim)
    key_block = key[:, :, k0:k1].reshape(batch * kv_heads, keys, dim).transpose(-1, -2)
    scores = _taker(workspace, query.device)("scores", (batch * kv_heads, group * rows, keys), query.dtype)
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, float("-inf"))
    if softcap is None:
        # Scaling and mask in the product's epilogue, scaling·(q·kᵀ) + bias: one pass over the
        # scores where a product, a scaling and an addition were three. The bias ([1, 1, rows, keys]
        # causal, [B, 1, 1, keys] bidirectional) is laid out as the product's [B·H_kv, G·rows, keys].
        if allowed.shape[0] == 1 and allowed.shape[-2] == rows:
            bias = bias.view(1, rows, keys).expand(group, rows, keys).reshape(1, group * rows, keys)
        else:
            bias = bias.view(batch, 1, keys).expand(batch, kv_heads, keys).reshape(batch * kv_heads, 1, keys)
        torch.baddbmm(bias, block, key_block, alpha=scaling, out=scores)
        return scores.view(batch, kv_heads * group, rows, keys)
    torch.bmm(block, key_block, out=scores)
    scores = scores.view(batch, kv_heads * group, rows, keys).mul_(scaling)
    return scores.div_(softcap).tanh_().mul_(softcap).add_(bias)


def _grouped(query: torch.Tensor, key: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Queries as ``[B, H_kv, G, T, d]`` and keys, both in the work dtype."""
    dtype = _work_dtype(query.dtype)
    batch, heads, n_positions, dim = query.shape
    grouped = query.to(dtype).reshape(batch, kv_heads, heads // kv_heads, n_positions, dim)
    return grouped, key.to(dtype), dtype


def attention_sums_from_qk(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    lengths: torch.Tensor | None = None,
    excluded_keys: Sequence[int] = (),
    log_floor: float | None = None,
    key_bin: torch.Tensor | None = None,
    n_key_bins: int | None = None,
    keep_pattern: bool = False,
    block_size: int | None = None,
    compile_blocks: bool = False,
    causal: bool = True,
    workspace: BlockWorkspace | None = None,
) -> dict[str, torch.Tensor]:
    """One layer's per-window attention sums, from its queries and keys, in query blocks.

    For each block of query rows ``[q0, q1)``: scores against the keys ``[k0, q1)`` the
    block can see (``k0 = max(0, q0 - w + 1)`` under a window ``w``), the model's mask,
    ``log a = s - logsumexp(s)``, ``a = exp(log a)``, then per-row moments and
    diagonal sums. Peak memory is one block's temporaries (:func:`choose_block_size`).

    Args:
        query: ``[B, H, T, d]``, any float dtype, after rotary embeddings and q-norm.
        key: ``[B, H_kv, T, d]`` with ``H % H_kv == 0``.
        scaling: score scale; ``None`` means ``d**-0.5``.
        softcap: logit soft-capping ``c`` (``s -> c·tanh(s/c)``), or ``None``.
        window: sliding window width ``w``, or ``None`` for full causal attention.
        lengths: ``[B]`` real tokens per window (right padding); ``None``: all ``T``.
        causal: ``False`` for a bidirectional encoder (BERT): every real query sees every real
            key of its window (padding keys are hidden, as the model's attention mask hides
            them), and lags are signed (``lag_sum: [B, H, 2T-1]``, lag ``dt`` at ``dt + T - 1``).
        excluded_keys: key positions kept in the softmax but left out of every sum.
        log_floor: ``eps`` of the log scale; ``None``: the smallest normal number of
            ``query.dtype``.
        key_bin: ``[T]`` non-decreasing bin of each key position; ``None``: one bin per key.
        n_key_bins: ``K``; ``None``: ``key_bin.max() + 1``.
        keep_pattern: also return ``pattern_sum: [H, T, T]`` (query-key layout, summed
            over the batch).
        block_size: query rows per block; ``None`` chooses it from a memory budget
            (:func:`choose_block_size`). Results do not depend on it beyond float64
            rounding.
        compile_blocks: run the per-block elementwise maths through
            ``torch.compile(dynamic=True)``, falling back to eager (with a warning) on
            any compiler failure. Off by default: on CPU the compiled blocks were
            20-30% faster once warm, but the first call compiles for 30-40 s, and the
            compiled maths round differently from eager (relative differences of
            about 5e-7 in float32 work; rows of identical values stay exact), so
            results would depend on whether a C++ compiler is present (measured on 2
            CPU cores while the engine was built; no benchmark of this repository
            repeats it).
        workspace: a :class:`BlockWorkspace` that keeps the blocks' temporaries between
            calls (one per thread); ``None`` uses one for this call only.

    Returns:
        float64 tensors on ``query.device``: ``raw_sum, raw_sq, log_sum, log_sq: [B, H, T]``,
        ``lag_sum: [B, H, D]``, ``floored: [B, H]``, ``key_lag_sum: [K, D]`` (``D`` lags: ``T``
        causal, ``2T - 1`` bidirectional) and, if ``keep_pattern``, ``pattern_sum: [H, T, T]``
        (see the module docstring).
    """
    batch, heads, kv_heads, n_positions, dim = _check_qk(query, key)
    layout = _layout(
        batch=batch,
        heads=heads,
        n_positions=n_positions,
        device=query.device,
        window=window,
        lengths=lengths,
        excluded_keys=excluded_keys,
        log_floor=log_floor,
        key_bin=key_bin,
        n_key_bins=n_key_bins,
        input_dtype=query.dtype,
        causal=causal,
    )
    grouped_query, work_key, dtype = _grouped(query, key, kv_heads)
    scale = float(dim**-0.5 if scaling is None else scaling)
    log_eps = math.log(layout.log_floor)
    out = _empty_sums(layout, keep_pattern)
    workspace = BlockWorkspace() if workspace is None else workspace
    with full_float32_matmul(query.device), torch.no_grad():
        for q0, q1, k0, k1 in _blocks(layout, block_size, dtype):
            allowed = layout.allowed(q0, q1, k0, k1)
            visible = layout.visible(q0, q1, k0, k1, allowed)
            count = layout.row_count[:, q0:q1].unsqueeze(1)
            masked = layout.masks_more_than_the_model(q0, q1, k0, k1)
            pad_after = 0 if causal else q1 - q0 - 1

            def arguments(q0=q0, q1=q1, k0=k0, k1=k1, allowed=allowed, visible=visible, count=count, masked=masked,
                          pad_after=pad_after) -> tuple:
                scores = _block_scores(grouped_query, work_key, q0, q1, k0, k1, scale, softcap, allowed, workspace)
                return scores, visible, count, log_eps, q1 - q0 - 1, masked, pad_after

            _accumulate(out, layout, q0, q1, k0, k1, _run_block("scores", compile_blocks, arguments, workspace))
    return out


def attention_sums_from_weights(
    pattern: torch.Tensor,
    *,
    window: int | None = None,
    lengths: torch.Tensor | None = None,
    excluded_keys: Sequence[int] = (),
    log_floor: float | None = None,
    key_bin: torch.Tensor | None = None,
    n_key_bins: int | None = None,
    keep_pattern: bool = False,
    block_size: int | None = None,
    compile_blocks: bool = False,
    causal: bool = True,
    workspace: BlockWorkspace | None = None,
) -> dict[str, torch.Tensor]:
    """The sums of :func:`attention_sums_from_qk` from captured post-softmax weights.

    For models whose attention cannot be recomputed from queries and keys (ALiBi
    biases, learned sink logits). Here ``y = log max(a, eps)`` is taken from the weights
    themselves and an entry is floored when ``a < eps``. Weights outside the mask (or
    on padding rows, or excluded keys) are ignored. The work runs in query blocks of
    the given pattern (float32, or float64 for float64 weights).

    Args:
        pattern: ``[B, H, T, T]`` post-softmax weights, any float dtype.
        window, lengths, excluded_keys, log_floor, key_bin, n_key_bins, keep_pattern,
        block_size, compile_blocks, workspace: as in :func:`attention_sums_from_qk`
            (``log_floor=None`` takes the smallest normal number of ``pattern.dtype``).

    Returns:
        The same dict as :func:`attention_sums_from_qk`.
    """
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise InputError(f"pattern must be [batch, head, query, key] with as many keys as queries, got {tuple(pattern.shape)}")
    batch, heads, n_positions, _ = pattern.shape
    layout = _layout(
        batch=batch,
        heads=heads,
        n_positions=n_positions,
        device=pattern.device,
        window=window,
        lengths=lengths,
        excluded_keys=excluded_keys,
        log_floor=log_floor,
        key_bin=key_bin,
        n_key_bins=n_key_bins,
        input_dtype=pattern.dtype,
        causal=causal,
    )
    dtype = _work_dtype(pattern.dtype)
    out = _empty_sums(layout, keep_pattern)
    workspace = BlockWorkspace() if workspace is None else workspace
    with torch.no_grad():
        for q0, q1, k0, k1 in _blocks(layout, block_size, dtype):
            visible = layout.visible(q0, q1, k0, k1, layout.allowed(q0, q1, k0, k1))
            count = layout.row_count[:, q0:q1].unsqueeze(1)
            weights = pattern[:, :, q0:q1, k0:k1].to(dtype)
            arguments = (weights, visible, count, layout.log_floor, q1 - q0 - 1, 0 if causal else q1 - q0 - 1)
            _accumulate(out, layout, q0, q1, k0, k1, _run_block("weights", compile_blocks, lambda a=arguments: a, workspace))
    return out


def pattern_sum_from_qk(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    lengths: torch.Tensor | None = None,
    excluded_keys: Sequence[int] = (),
    block_size: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Only ``pattern_sum``: ``Σ_b a[b, h, q, k]`` over visible entries, ``[H, T, T]`` float64.

    The batch-summed pattern in query-key layout, recomputed block by block like
    :func:`attention_sums_from_qk` (for paths that compute the other sums elsewhere,
    such as the Triton kernel).
    """
    batch, heads, kv_heads, n_positions, dim = _check_qk(query, key)
    layout = _layout(
        batch=batch,
        heads=heads,
        n_positions=n_positions,
        device=query.device,
        window=window,
        lengths=lengths,
        excluded_keys=excluded_keys,
        log_floor=1.0,
        key_bin=None,
        n_key_bins=None,
        input_dtype=query.dtype,
        causal=causal,
    )
    grouped_query, work_key, dtype = _grouped(query, key, kv_heads)
    scale = float(dim**-0.5 if scaling is None else scaling)
    out = torch.zeros((heads, n_positions, n_positions), dtype=torch.float64, device=query.device)
    with full_float32_matmul(query.device), torch.no_grad():
        for q0, q1, k0, k1 in _blocks(layout, block_size, dtype):
            allowed = layout.allowed(q0, q1, k0, k1)
            scores = _block_scores(grouped_query, work_key, q0, q1, k0, k1, scale, softcap, allowed)
            weights = torch.softmax(scores, -1)
            visible = layout.visible(q0, q1, k0, k1, allowed)
            weights = torch.where(visible, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
            out[:, q0:q1, k0:k1] += weights.sum(0, dtype=torch.float64)
    return out


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
