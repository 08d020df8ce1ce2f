"""The torch engine: per-window attention sums computed from queries and keys, one query block at a time.

Place in the seams: *statistics*, an engine under the dispatcher of
:mod:`~equivariance_probe.statistics.engines`, which hands it a layer's tensors and the batch's
:class:`~equivariance_probe.statistics.engines.spec.ReductionSpec` (the ``lengths``, ``window``,
``excluded_keys``, ``key_bin`` ... below are its fields); on CUDA the fused kernel of
:mod:`~equivariance_probe.statistics.engines.triton` computes the same sums in one launch. The
per-block maths live in :mod:`~equivariance_probe.statistics.engines.block_maths`.

Every statistic of docs/methods.md sections 1-3 is a function of a few float64 sums over the
*visible* attention entries of each window (their streaming accumulator,
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

=================  ===============  ====================================================
name               shape            meaning
=================  ===============  ====================================================
``raw_sum``        ``[B, H, T]``    ``Σ_k a[q, k]`` over the visible keys of row ``q``
``raw_sq``         ``[B, H, T]``    ``Σ_k a[q, k]²``
``log_sum``        ``[B, H, T]``    ``Σ_k y[q, k]``
``log_sq``         ``[B, H, T]``    ``Σ_k y[q, k]²``
``floored``        ``[B, H]``       visible entries with ``log a < log eps``
``lag_sum``        ``[B, H, T]``    ``Σ_t a[t + dt, t]`` by lag ``dt = q - k``
``key_lag_sum``    ``[K, T]``       ``Σ`` over windows and heads of ``a[q, k]`` with
                                    ``key_bin[k] = κ`` and ``q - k = dt``, ``[κ, dt]``
``pattern_sum``    ``[H, T, T]``    optional: ``Σ_b a[b, h, q, k]``, query-key layout
``first_key_sum``  ``[B, H, T]``    optional: ``a[q, 0]``, the weight on the window's first
                                    token, excluded or not (0 where the mask hides it)
=================  ===============  ====================================================

Rows of padding queries (``q >= lengths[b]``) are 0 everywhere. The mask-only sums
(entry counts and the uniform prior's curves) do not depend on the model; they come in
closed form from :func:`~equivariance_probe.statistics.masks.mask_counts`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import einops
import torch

from ...errors import InputError
from ..masks import _effective_window
from .block_maths import (  # noqa: F401 - row_moments and toeplitz_r2_per_window: the engine's public maths
    BlockWorkspace,
    accumulate_block,
    block_from_scores,
    block_from_weights,
    row_moments,
    taker,
    toeplitz_r2_per_window,
)
from ..sums import engine_sums
from .spec import Layout, ReductionSpec, check_qk, empty_sums, layout, work_dtype

__all__ = [
    "DEFAULT_BLOCK_MEMORY",
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

#: The per-window sums every path returns (``pattern_sum`` and ``first_key_sum`` are added on request): the
#: table's sums that an engine computes (:func:`~equivariance_probe.statistics.sums.engine_sums`).
SUM_NAMES = engine_sums()

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
    matmul = torch.backends.cuda.matmul if device.type == "cuda" else getattr(
        getattr(torch.backends, "mkldnn", None), "matmul", None
    )
    previous_precision = getattr(matmul, "fp32_precision", None) if matmul is not None else None
    previous_tf32 = None
    try:
        if previous_precision is not None:
            matmul.fp32_precision = "ieee"
        elif device.type == "cuda":
            previous_tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
    except (AttributeError, RuntimeError, ValueError):
        previous_precision = previous_tf32 = None  # a torch without these settings
    try:
        yield
    finally:
        if previous_precision is not None:
            matmul.fp32_precision = previous_precision
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


def _blocks(layout: Layout, block_size: int | None, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
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
    eager = block_from_scores if name == "scores" else block_from_weights
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
    eager = block_from_scores if name == "scores" else block_from_weights
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
    block = einops.rearrange(query[:, :, :, q0:q1], "b kv g q d -> (b kv) (g q) d")
    key_block = einops.rearrange(key[:, :, k0:k1], "b kv k d -> (b kv) d k")
    scores = taker(workspace, query.device)("scores", (batch * kv_heads, group * rows, keys), query.dtype)
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, float("-inf"))
    if softcap is None:
        # Scaling and mask in the product's epilogue, scaling·(q·kᵀ) + bias: one pass over the
        # scores where a product, a scaling and an addition were three. The bias ([1, 1, rows, keys]
        # causal, [B, 1, 1, keys] bidirectional) is laid out as the product's [B·H_kv, G·rows, keys].
        if allowed.shape[0] == 1 and allowed.shape[-2] == rows:
            bias = einops.repeat(bias, "1 1 q k -> 1 (g q) k", g=group)
        else:
            bias = einops.repeat(bias, "b 1 1 k -> (b kv) 1 k", kv=kv_heads)
        torch.baddbmm(bias, block, key_block, alpha=scaling, out=scores)
        return scores.view(batch, kv_heads * group, rows, keys)
    torch.bmm(block, key_block, out=scores)
    scores = scores.view(batch, kv_heads * group, rows, keys).mul_(scaling)
    return scores.div_(softcap).tanh_().mul_(softcap).add_(bias)


def _grouped(query: torch.Tensor, key: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Queries as ``[B, H_kv, G, T, d]`` and keys, both in the work dtype."""
    dtype = work_dtype(query.dtype)
    grouped = einops.rearrange(query.to(dtype), "b (kv g) t d -> b kv g t d", kv=kv_heads)
    return grouped, key.to(dtype), dtype


def _scores_inputs(
    query: torch.Tensor, key: torch.Tensor, spec: ReductionSpec
) -> tuple[Layout, torch.Tensor, torch.Tensor, torch.dtype, float]:
    """What the block loops over scores read: the laid-out spec, the grouped queries and the keys in the
    work dtype, the work dtype and the score scale."""
    batch, heads, kv_heads, n_positions, dim = check_qk(query, key)
    laid_out = layout(spec, batch=batch, heads=heads, n_positions=n_positions, device=query.device,
                      input_dtype=query.dtype)
    grouped_query, work_key, dtype = _grouped(query, key, kv_heads)
    return laid_out, grouped_query, work_key, dtype, float(dim**-0.5 if spec.scaling is None else spec.scaling)


def attention_sums_from_qk(
    query: torch.Tensor,
    key: torch.Tensor,
    spec: ReductionSpec | None = None,
    /,
    *,
    workspace: BlockWorkspace | None = None,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """One layer's per-window attention sums, from its queries and keys, in query blocks.

    For each block of query rows ``[q0, q1)``: scores against the keys ``[k0, q1)`` the
    block can see (``k0 = max(0, q0 - w + 1)`` under a window ``w``), the model's mask,
    ``log a = s - logsumexp(s)``, ``a = exp(log a)``, then per-row moments and
    diagonal sums. Peak memory is one block's temporaries (:func:`choose_block_size`).

    Args:
        query: ``[B, H, T, d]``, any float dtype, after rotary embeddings and q-norm.
        key: ``[B, H_kv, T, d]`` with ``H % H_kv == 0``.
        spec: the mask, exclusions, key bins, scale and soft cap
            (:class:`~equivariance_probe.statistics.engines.spec.ReductionSpec`); ``options``
            are its fields, given one by one (they replace the spec's).
        workspace: a :class:`BlockWorkspace` that keeps the blocks' temporaries between
            calls (one per thread); ``None`` uses one for this call only.

    ``compile_blocks=True`` runs the per-block elementwise maths through
    ``torch.compile(dynamic=True)``, falling back to eager (with a warning) on any compiler
    failure. Off by default: on CPU the compiled blocks were 20-30% faster once warm, but the
    first call compiles for 30-40 s, and the compiled maths round differently from eager
    (relative differences of about 5e-7 in float32 work; rows of identical values stay exact),
    so results would depend on whether a C++ compiler is present (measured on 2 CPU cores
    while the engine was built; no benchmark of this repository repeats it).

    Returns:
        float64 tensors on ``query.device``: ``raw_sum, raw_sq, log_sum, log_sq: [B, H, T]``,
        ``lag_sum: [B, H, D]``, ``floored: [B, H]``, ``key_lag_sum: [K, D]`` (``D`` lags: ``T``
        causal, ``2T - 1`` bidirectional), if ``keep_pattern``, ``pattern_sum: [H, T, T]`` and, if
        ``keep_first_key``, ``first_key_sum: [B, H, T]`` (see the module docstring).
    """
    spec = ReductionSpec.of(spec, **options)
    laid_out, grouped_query, work_key, dtype, scale = _scores_inputs(query, key, spec)
    log_eps = math.log(laid_out.log_floor)
    out = empty_sums(laid_out, spec.keep_pattern, spec.keep_first_key)
    workspace = BlockWorkspace() if workspace is None else workspace
    with full_float32_matmul(query.device), torch.no_grad():
        for q0, q1, k0, k1 in _blocks(laid_out, spec.block_size, dtype):
            allowed = laid_out.allowed(q0, q1, k0, k1)
            visible = laid_out.visible(q0, q1, k0, k1, allowed)
            count = laid_out.row_count[:, q0:q1].unsqueeze(1)
            masked = laid_out.masks_more_than_the_model(q0, q1, k0, k1)
            pad_after = 0 if spec.causal else q1 - q0 - 1

            def arguments(q0=q0, q1=q1, k0=k0, k1=k1, allowed=allowed, visible=visible, count=count, masked=masked,
                          pad_after=pad_after) -> tuple:
                scores = _block_scores(grouped_query, work_key, q0, q1, k0, k1, scale, spec.softcap, allowed, workspace)
                return scores, visible, count, log_eps, q1 - q0 - 1, masked, pad_after

            block = _run_block("scores", spec.compile_blocks, arguments, workspace)
            accumulate_block(out, laid_out, q0, q1, k0, k1, block)
    return out


def attention_sums_from_weights(
    pattern: torch.Tensor,
    spec: ReductionSpec | None = None,
    /,
    *,
    workspace: BlockWorkspace | None = None,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """The sums of :func:`attention_sums_from_qk` from captured post-softmax weights.

    For models whose attention cannot be recomputed from queries and keys (ALiBi
    biases, learned sink logits). Here ``y = log max(a, eps)`` is taken from the weights
    themselves and an entry is floored when ``a < eps``. Weights outside the mask (or
    on padding rows, or excluded keys) are ignored. The work runs in query blocks of
    the given pattern (float32, or float64 for float64 weights).

    Args:
        pattern: ``[B, H, T, T]`` post-softmax weights, any float dtype.
        spec, workspace, options: as in :func:`attention_sums_from_qk` (``scaling`` and ``softcap``
            are not read; ``log_floor=None`` takes the smallest normal number of ``pattern.dtype``).

    Returns:
        The same dict as :func:`attention_sums_from_qk`.
    """
    spec = ReductionSpec.of(spec, **options)
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise InputError(f"pattern must be [batch, head, query, key] with as many keys as queries, got {tuple(pattern.shape)}")
    batch, heads, n_positions, _ = pattern.shape
    laid_out = layout(spec, batch=batch, heads=heads, n_positions=n_positions, device=pattern.device,
                      input_dtype=pattern.dtype)
    dtype = work_dtype(pattern.dtype)
    out = empty_sums(laid_out, spec.keep_pattern, spec.keep_first_key)
    workspace = BlockWorkspace() if workspace is None else workspace
    with torch.no_grad():
        for q0, q1, k0, k1 in _blocks(laid_out, spec.block_size, dtype):
            visible = laid_out.visible(q0, q1, k0, k1, laid_out.allowed(q0, q1, k0, k1))
            count = laid_out.row_count[:, q0:q1].unsqueeze(1)
            weights = pattern[:, :, q0:q1, k0:k1].to(dtype)
            arguments = (weights, visible, count, laid_out.log_floor, q1 - q0 - 1, 0 if spec.causal else q1 - q0 - 1)
            block = _run_block("weights", spec.compile_blocks, lambda a=arguments: a, workspace)
            accumulate_block(out, laid_out, q0, q1, k0, k1, block)
    return out


def pattern_sum_from_qk(
    query: torch.Tensor, key: torch.Tensor, spec: ReductionSpec | None = None, /, **options: Any
) -> torch.Tensor:
    """Only ``pattern_sum``: ``Σ_b a[b, h, q, k]`` over visible entries, ``[H, T, T]`` float64.

    The batch-summed pattern in query-key layout, recomputed block by block like
    :func:`attention_sums_from_qk` (for paths that compute the other sums elsewhere,
    such as the Triton kernel).
    """
    spec = ReductionSpec.of(spec, **options)
    laid_out, grouped_query, work_key, dtype, scale = _scores_inputs(query, key, spec)
    heads, n_positions = laid_out.heads, laid_out.n_positions
    out = torch.zeros((heads, n_positions, n_positions), dtype=torch.float64, device=query.device)
    with full_float32_matmul(query.device), torch.no_grad():
        for q0, q1, k0, k1 in _blocks(laid_out, spec.block_size, dtype):
            allowed = laid_out.allowed(q0, q1, k0, k1)
            scores = _block_scores(grouped_query, work_key, q0, q1, k0, k1, scale, spec.softcap, allowed)
            weights = torch.softmax(scores, -1)
            visible = laid_out.visible(q0, q1, k0, k1, allowed)
            weights = torch.where(visible, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
            out[:, q0:q1, k0:k1] += weights.sum(0, dtype=torch.float64)
    return out
