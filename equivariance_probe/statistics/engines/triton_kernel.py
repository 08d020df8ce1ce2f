"""The fused Triton kernel of the per-window attention sums, and Triton's import.

Place in the seams: *statistics*, inside the Triton engine
(:mod:`~equivariance_probe.statistics.engines.triton`, which launches it). Triton is optional:
without it (or older than :data:`MIN_TRITON_VERSION`) this module still imports, with
``triton = None`` and the reason in ``_TRITON_IMPORT_ERROR``.

The kernel, one program per (window ``b``, query head ``h``, block of ``BLOCK`` query
rows), in the manner of a flash-attention forward pass:

1. Pass 1 over the key tiles the block can see (the loop runs from the first key of the
   sliding window, rounded down to a tile, to the block's last row or the window's
   length, so tiles that the causal mask or the window hide entirely are never
   visited): ``s = softcap(q·kᵀ·scaling)`` and the running row maximum ``m`` and
   ``l = Σ exp(s - m)`` (online softmax).
2. Pass 2 over the same tiles, recomputing ``s``: ``a = exp(s - m) / l`` and
   ``y = (s - m) - log l`` (``= s - logsumexp(s) = log a``, as in the torch path), and
   accumulating per row ``Σa, Σa², Σy, Σy²`` (``y`` floored at ``log eps``) in float64
   from the float32 values, the visible and floored counts, the lag and key-bin
   lag sums with float64 atomic adds (one per lag, or per key bin and lag, of a tile)
   and, in the tile of key 0, each row's weight on key 0 (the attention-sink sums).

Grouped-query attention reads key head ``h // (H / H_kv)`` by index: no repeated keys.

Why two passes over the tiles, each computing ``q·kᵀ``: the lag and key-bin sums add up
entries of *different* rows (a diagonal, a key), so each entry must be scaled by its own
row's final ``1/l`` before it is added, which is known only after the row's last tile.
The row moments alone could be gathered in pass 1 (flash attention's running rescaling for
``Σa, Σa²``; ``Σs, Σs²`` and the log-sum-exp for ``Σy, Σy²``), but that would not save the
second product, and it would lose two exact properties: which entries are floored
(``s < logsumexp + log eps``) is not known before the row's end, and rows of identical
values would no longer get exactly ``n·c`` (below).

Precision:

- Scores ``q·kᵀ`` (then ``·scaling`` in float32, or float64 for float64 inputs):

  ==========  ===================================================================
  inputs      product
  ==========  ===================================================================
  bf16, fp16  ``tl.dot`` of the model's own tiles on the tensor cores, float32
              accumulation, as flash attention and the model's sdpa kernel compute
              them. Every product of two bf16 (8-bit significand) or fp16 (11-bit)
              numbers is exact in float32, so the scores differ from the torch
              path's (inputs upcast, IEEE float32 products) only by the order and the
              hardware's rounding of the float32 accumulation: relative ~1e-7 of
              ``Σ|q_i·k_i|``.
  float32     ``tl.dot(..., input_precision="ieee")``: full float32 products, never
              TF32 (which would round the inputs to 10 bits).
  float64     a float64 ``tl.dot``; the kernel works in float64 throughout.
  other       upcast to float32, then as float32.
  ==========  ===================================================================

  Weights and log weights are then float32 (float64 for float64 inputs) and every sum
  float64. Against a float64 softmax of the same inputs the sums agree to float32
  rounding (``tests/test_triton_kernels.py`` states the tolerances).
- ``tanh`` of the soft cap is evaluated in float64 from ``exp`` (a Taylor polynomial
  near 0), about 1e-15 relative, then rounded to the work dtype; the Triton interpreter
  has no libdevice, and this keeps one code path for the GPU and the tests.
- Rows of identical values (uniform attention: the statistics need ``Σy² = count·mean²``
  *exactly* there, or a spurious within-row variance of order 1e-7 appears): the row's
  largest score ``m`` is known after pass 1, and every entry of a row of equal scores
  takes the value ``c = exp(m - m) / l`` (or ``max((m - m) - log l, log eps)``),
  computed the same way. Pass 2 counts the visible entries that differ from ``c``; a
  row with none gets ``Σ = n·c`` and ``Σ² = (n·c)·c`` in float64, exactly what the
  torch path gives (there the float64 sum of ``n`` equal float32 values is exact and
  the mean-centred squares vanish). Other rows sum float64 squares of float32 values,
  which are exact, so their ``Σ²`` is accurate to float64 too. (A three-pass kernel
  that centres on the row mean would also be exact, at the cost of a third ``q·kᵀ``.)
- Lag sums: a tile's diagonals are lined up by a cyclic skew with ``tl.gather``
  (``skewed[i, c] = a[i, (i + c) mod BLOCK]``, so a column holds two lags), reduced over
  the tile's rows in float64 and added with ``BLOCK`` atomic adds instead of ``BLOCK²``
  (a tile's second lags are the next tile's first ones, carried over). The key-bin lag sums use the same column sums when all of a tile's keys
  fall in one bin (the common case for coarse bins). Otherwise, since bins are contiguous
  and the keys of a skewed column rise with the row, a segmented sum down each column
  (``tl.associative_scan``) totals each (bin, lag) of the tile, and each total is added
  once: ``2·BLOCK`` plus ``BLOCK`` per bin edge inside the tile, instead of one add per
  entry (one bin per key still needs one add per entry). The order of float64 atomic
  adds varies between runs, so ``lag_sum`` and ``key_lag_sum`` are reproducible to
  float64 rounding, not bit for bit.

``pattern_sum`` (``keep_pattern=True``) is not computed by the kernel: it is a
``[H, T, T]`` array that a fused kernel would have to write anyway; it comes from the
torch helper :func:`~equivariance_probe.statistics.engines.torch_blocks.pattern_sum_from_qk`.
"""


from __future__ import annotations

import re

from . import _interpreting  # noqa: F401 - one definition, read by the engine and the tests

__all__ = ["MIN_TRITON_VERSION", "triton_available"]

#: The oldest Triton the kernel runs on: ``tl.gather`` (the cyclic skew of the lag sums) and its
#: support in the CPU interpreter first shipped in Triton 3.3.0. pyproject.toml pins the same
#: lower bound (``tests/test_triton_kernels.py`` checks that the two agree).
MIN_TRITON_VERSION = (3, 3)


def _triton_version_problem(version: str) -> str | None:
    """Why Triton ``version`` cannot run the kernel (naming the version needed), or ``None`` if it can."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return f"cannot read the installed Triton's version {version!r}"
    if (int(match.group(1)), int(match.group(2))) >= MIN_TRITON_VERSION:
        return None
    needed = ".".join(map(str, MIN_TRITON_VERSION))
    return (
        f"Triton {version} is installed, but the fused kernel needs Triton >= {needed} (tl.gather); "
        f"pip install 'triton>={needed}'"
    )


def _import_triton() -> tuple[object | None, object | None, Exception | None]:
    """``(triton, triton.language, None)``, or ``(None, None, why)`` when Triton is absent or too old."""
    try:
        import triton
        import triton.language as tl
    except Exception as error:  # noqa: BLE001 - any import failure means "no Triton"
        return None, None, error
    problem = _triton_version_problem(getattr(triton, "__version__", ""))
    if problem is not None:
        return None, None, ImportError(problem)
    return triton, tl, None


# Triton is optional: without it (or without CUDA) the torch path runs.
triton, tl, _TRITON_IMPORT_ERROR = _import_triton()


def triton_available() -> bool:
    """Whether Triton is importable in this process."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _tanh64(x):
        """``tanh`` in float64 from ``exp`` (the Triton interpreter has no libdevice).

        ``(1 - e)/(1 + e)`` with ``e = exp(-2|x|)`` for ``|x| >= 0.3`` (no cancellation
        there) and the Taylor series of ``tanh(x)/x`` to ``x^24`` below; about 1e-15
        relative everywhere, so float32 callers get a correctly rounded value up to a
        rare last-bit tie. Coefficients enter through ``tl.full(..., tl.float64)`` so they
        are not rounded to float32 literals.
        """
        x = x.to(tl.float64)
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        far = (1.0 - e) / (1.0 + e)
        x2 = ax * ax
        p = tl.full([], 1.5918905069328964e-05, tl.float64)
        p = p * x2 + tl.full([], -3.927832388331683e-05, tl.float64)
        p = p * x2 + tl.full([], 9.691537956929451e-05, tl.float64)
        p = p * x2 + tl.full([], -0.00023912911424355248, tl.float64)
        p = p * x2 + tl.full([], 0.000590027440945586, tl.float64)
        p = p * x2 + tl.full([], -0.0014558343870513183, tl.float64)
        p = p * x2 + tl.full([], 0.003592128036572481, tl.float64)
        p = p * x2 + tl.full([], -0.008863235529902197, tl.float64)
        p = p * x2 + tl.full([], 0.021869488536155203, tl.float64)
        p = p * x2 + tl.full([], -0.05396825396825397, tl.float64)
        p = p * x2 + tl.full([], 0.13333333333333333, tl.float64)
        p = p * x2 + tl.full([], -0.3333333333333333, tl.float64)
        p = p * x2 + tl.full([], 1.0, tl.float64)
        magnitude = tl.where(ax < 0.3, ax * p, far)
        return tl.where(x < 0, -magnitude, magnitude)

    @triton.jit
    def _score_tile(
        q, k_ptrs, key_ok, scaling, softcap,
        DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ):
        """One tile of scores ``softcap(q·kᵀ·scaling)``, ``[BLOCK, BLOCK]`` in ``DTYPE``.

        ``q`` is ``[BLOCK, BLOCK_D]`` in ``DOT_DTYPE``; ``k_ptrs`` point at ``kᵀ``,
        ``[BLOCK_D, BLOCK]``. Float64 multiplies in float64; float32 with IEEE products
        (``input_precision="ieee"``), never TF32; bf16/fp16 on the tensor cores with float32
        accumulation (see the module docstring).
        """
        k = tl.load(k_ptrs, mask=key_ok, other=0.0).to(DOT_DTYPE)
        if DOT_DTYPE == tl.float64:
            s = tl.dot(q, k)
        elif DOT_DTYPE == tl.float32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k, out_dtype=tl.float32).to(DTYPE)
        s = s * scaling
        if HAS_SOFTCAP:
            s = (softcap * _tanh64(s / softcap)).to(DTYPE)
        return s

    @triton.jit
    def _masked_tile(
        q, k_base, n0, offs, dims, rows, hi, window, stride_kt, scaling, softcap,
        HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
    ):
        """The key tile from ``n0``: ``(cols, s, allowed)``, its key positions, its scores
        (:func:`_score_tile`) and the model's mask on it (causal, keys below ``hi``, the sliding window),
        the same in both passes of the kernel."""
        cols = n0 + offs
        k_ptrs = k_base + cols[None, :] * stride_kt + dims[:, None]
        key_ok = (cols[None, :] < hi) & (dims[:, None] < HEAD_DIM)
        s = _score_tile(q, k_ptrs, key_ok, scaling, softcap, DTYPE, DOT_DTYPE, HAS_SOFTCAP)
        allowed = (cols[None, :] <= rows[:, None]) & (cols[None, :] < hi)
        if HAS_WINDOW:
            allowed = allowed & (rows[:, None] - cols[None, :] < window)
        return cols, s, allowed

    @triton.jit
    def _add_within_segment(total_a, segment_a, total_b, segment_b):
        """Combine of a segmented sum (for ``tl.associative_scan``): sums restart where the segment changes.

        Associative as long as no segment label comes back after another one, so each segment is
        one contiguous run.
        """
        return tl.where(segment_a == segment_b, total_a + total_b, total_b), segment_b

    @triton.jit
    def _attention_sums_kernel(
        q_ptr, k_ptr, lengths_ptr, keep_ptr, key_bin_ptr, params_ptr,
        raw_sum_ptr, raw_sq_ptr, log_sum_ptr, log_sq_ptr, floored_ptr, lag_sum_ptr, key_lag_ptr, first_key_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        n_heads, group, n_positions, window,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_EXCLUDED: tl.constexpr,
        HAS_FIRST_KEY: tl.constexpr,
    ):
        """Sums of one (window, query head, block of ``BLOCK`` query rows); see the module docstring.

        Outputs are float64: per row ``[B, H, T]`` (stored, each row owned by one program),
        ``lag_sum [B, H, T]`` and ``key_lag_sum [K, T]`` (atomic adds; zeroed by the caller) and, with
        ``HAS_FIRST_KEY``, ``first_key_sum [B, H, T]`` (stored: each row's weight on key 0 under the
        model's mask, ``allowed & real``, not ``visible``: an excluded key 0 keeps its weight there).
        ``params`` holds ``(scaling, softcap, log eps)`` in float64.
        """
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        kv_head = h // group
        length = tl.load(lengths_ptr + b).to(tl.int32)
        q0 = pid_m * BLOCK
        if q0 < length:  # blocks of padding rows contribute nothing
            scaling = tl.load(params_ptr).to(DTYPE)
            softcap = tl.load(params_ptr + 1).to(DTYPE)
            log_eps = tl.load(params_ptr + 2).to(DTYPE)
            offs = tl.arange(0, BLOCK)
            rows = q0 + offs
            dims = tl.arange(0, BLOCK_D)
            q_ptrs = q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :]
            q = tl.load(q_ptrs, mask=(rows[:, None] < n_positions) & (dims[None, :] < HEAD_DIM), other=0.0).to(DOT_DTYPE)
            real = rows < length
            # Keys [lo, hi): real rows see keys k <= q < hi; tiles left of the sliding
            # window or right of the block's last row are never visited.
            hi = tl.minimum(q0 + BLOCK, length)
            if HAS_WINDOW:
                lo = tl.maximum(q0 - window + 1, 0) // BLOCK * BLOCK
            else:
                lo = 0
            k_base = k_ptr + b * stride_kb + kv_head * stride_kh

            # Pass 1: row maximum and Σ exp(s - max) (online softmax).
            m_i = tl.full([BLOCK], float("-inf"), DTYPE)
            l_i = tl.zeros([BLOCK], DTYPE)
            for n0 in range(lo, hi, BLOCK):
                cols, s, allowed = _masked_tile(q, k_base, n0, offs, dims, rows, hi, window, stride_kt, scaling,
                                                softcap, HEAD_DIM, DTYPE, DOT_DTYPE, HAS_SOFTCAP, HAS_WINDOW)
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
                m_i = m_new
            # As in the torch path: a = exp(s - m) / l and log a = (s - m) - log l, which is
            # s - logsumexp(s) and stays accurate where a underflows.
            m_row = tl.where(m_i == float("-inf"), 0.0, m_i)
            l_row = tl.where(l_i > 0, l_i, 1.0)
            log_l = tl.log(l_row)
            # The value every entry of a row of equal scores takes, computed as entries are.
            top = m_i - m_row
            c_a = tl.exp(top) / l_row
            c_y = tl.maximum(top - log_l, log_eps)

            # Pass 2: recompute the scores, accumulate the sums.
            sum_a = tl.zeros([BLOCK], tl.float64)
            sq_a = tl.zeros([BLOCK], tl.float64)
            sum_y = tl.zeros([BLOCK], tl.float64)
            sq_y = tl.zeros([BLOCK], tl.float64)
            n_visible = tl.zeros([BLOCK], tl.int32)
            differ_a = tl.zeros([BLOCK], tl.int32)
            differ_y = tl.zeros([BLOCK], tl.int32)
            n_floored = tl.zeros([BLOCK], tl.int32)
            lag_base = lag_sum_ptr + pid_bh * n_positions
            # Cyclic skew of a tile: skewed[i, c] = a[i, (i + c) mod BLOCK]. Column c then
            # holds key j = i + c (lag q0 - n0 - c) where i + c < BLOCK and j = i + c - BLOCK
            # (lag q0 - n0 - c + BLOCK) elsewhere.
            skew_index = (offs[:, None] + offs[None, :]) % BLOCK
            lower = (offs[:, None] + offs[None, :]) < BLOCK
            # For the key-bin sums: the next key down each skewed column, and the row where the
            # column's first lag ends.
            next_index = (offs[:, None] + offs[None, :] + 1) % BLOCK
            last_low = (offs[:, None] + offs[None, :]) == BLOCK - 1
            carried_sum = tl.zeros([BLOCK], tl.float64)
            carried_lag = q0 - lo - offs
            first_a = tl.zeros([BLOCK], tl.float64)
            for n0 in range(lo, hi, BLOCK):
                cols, s, allowed = _masked_tile(q, k_base, n0, offs, dims, rows, hi, window, stride_kt, scaling,
                                                softcap, HEAD_DIM, DTYPE, DOT_DTYPE, HAS_SOFTCAP, HAS_WINDOW)
                visible = allowed & real[:, None]
                if HAS_EXCLUDED:
                    keep = tl.load(keep_ptr + cols, mask=cols < n_positions, other=0) != 0
                    visible = visible & keep[None, :]
                shifted = tl.where(allowed, s, float("-inf")) - m_row[:, None]
                y = shifted - log_l[:, None]
                a = tl.where(visible, tl.exp(shifted) / l_row[:, None], 0.0)
                floored_y = tl.where(visible, tl.maximum(y, log_eps), 0.0)
                a64 = a.to(tl.float64)
                y64 = floored_y.to(tl.float64)
                sum_a += tl.sum(a64, 1)
                sq_a += tl.sum(a64 * a64, 1)
                sum_y += tl.sum(y64, 1)
                sq_y += tl.sum(y64 * y64, 1)
                n_visible += tl.sum(visible.to(tl.int32), 1)
                differ_a += tl.sum((visible & (a != c_a[:, None])).to(tl.int32), 1)
                differ_y += tl.sum((visible & (floored_y != c_y[:, None])).to(tl.int32), 1)
                n_floored += tl.sum((visible & (y < log_eps)).to(tl.int32), 1)
                if HAS_FIRST_KEY:
                    if n0 == 0:  # only the first tile holds key 0
                        at_first = allowed & real[:, None] & (cols[None, :] == 0)
                        first_a += tl.sum(tl.where(at_first, tl.exp(shifted) / l_row[:, None], 0.0).to(tl.float64), 1)

                # Lag sums: BLOCK atomic adds per tile instead of BLOCK². A tile's second lags
                # (high) are the previous tile's first ones (low), so those are carried over and
                # added together; the last tile's first lags are added after the loop.
                skewed = tl.gather(a, skew_index, axis=1).to(tl.float64)
                low_sum = tl.sum(tl.where(lower, skewed, 0.0), 0)
                high_sum = tl.sum(tl.where(lower, 0.0, skewed), 0)
                low_lag = q0 - n0 - offs
                high_lag = low_lag + BLOCK
                low_ok = (low_lag >= 0) & (low_lag < n_positions)
                high_ok = (high_lag >= 0) & (high_lag < n_positions)
                tl.atomic_add(lag_base + high_lag, high_sum + carried_sum, mask=high_ok)
                carried_sum = low_sum
                carried_lag = low_lag

                # Key-bin lag sums, summed over windows and heads.
                last = tl.minimum(n0 + BLOCK, hi) - 1
                first_bin = tl.load(key_bin_ptr + n0)
                last_bin = tl.load(key_bin_ptr + last)
                if first_bin == last_bin:
                    # The whole tile is one bin: reuse the column sums.
                    bin_base = key_lag_ptr + first_bin * n_positions
                    tl.atomic_add(bin_base + low_lag, low_sum, mask=low_ok)
                    tl.atomic_add(bin_base + high_lag, high_sum, mask=high_ok)
                else:
                    # The tile straddles bins. Down a skewed column the keys rise with the row in
                    # each of its two lags, and so do their (non-decreasing) bins: the segments
                    # (bin, lag) are contiguous runs, labelled 2·bin + (second lag), and a
                    # segmented sum down the column gives each its total, added once at its last
                    # row, instead of one atomic add per entry. Keys past the end take the last
                    # key's bin, so the bins keep rising (their weights are 0).
                    bins = tl.load(key_bin_ptr + tl.minimum(cols, n_positions - 1)).to(tl.int32)
                    bin_tile = tl.broadcast_to(bins[None, :], [BLOCK, BLOCK])
                    skewed_bin = tl.gather(bin_tile, skew_index, axis=1)
                    next_bin = tl.gather(bin_tile, next_index, axis=1)
                    segment = 2 * skewed_bin + tl.where(lower, 0, 1)
                    ends = (offs[:, None] == BLOCK - 1) | last_low | (skewed_bin != next_bin)
                    totals, _ = tl.associative_scan((skewed, segment), 0, _add_within_segment)
                    lag = tl.where(lower, low_lag[None, :], high_lag[None, :])
                    tl.atomic_add(
                        key_lag_ptr + skewed_bin * n_positions + lag,
                        totals,
                        mask=ends & (lag >= 0) & (lag < n_positions) & (totals != 0.0),
                    )

            carried_ok = (carried_lag >= 0) & (carried_lag < n_positions)
            tl.atomic_add(lag_base + carried_lag, carried_sum, mask=carried_ok)

            # Rows of identical values: exactly n·c and (n·c)·c (see the module docstring).
            count = n_visible.to(tl.float64)
            c_a64 = c_a.to(tl.float64)
            c_y64 = c_y.to(tl.float64)
            same_a = (differ_a == 0) & (n_visible > 0)
            same_y = (differ_y == 0) & (n_visible > 0)
            sum_a = tl.where(same_a, count * c_a64, sum_a)
            sq_a = tl.where(same_a, (count * c_a64) * c_a64, sq_a)
            sum_y = tl.where(same_y, count * c_y64, sum_y)
            sq_y = tl.where(same_y, (count * c_y64) * c_y64, sq_y)
            out = pid_bh * n_positions + rows
            row_ok = rows < n_positions
            tl.store(raw_sum_ptr + out, sum_a, mask=row_ok)
            tl.store(raw_sq_ptr + out, sq_a, mask=row_ok)
            tl.store(log_sum_ptr + out, sum_y, mask=row_ok)
            tl.store(log_sq_ptr + out, sq_y, mask=row_ok)
            tl.store(floored_ptr + out, n_floored.to(tl.float64), mask=row_ok)
            if HAS_FIRST_KEY:
                tl.store(first_key_ptr + out, first_a, mask=row_ok)

else:  # no Triton here: the engine refuses to run, and attention_sums_triton says why
    _tanh64 = _score_tile = _masked_tile = _add_within_segment = _attention_sums_kernel = None
