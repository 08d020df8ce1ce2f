"""The query-block engine (statistics.engines.torch_blocks) and the mask counts against brute-force float64 references.

Tolerances: float64 inputs agree with the float64 reference to 1e-12 relative. Float32
and bf16 inputs are compared with the float64 softmax of the *same* (upcast) inputs at
1e-6 relative: the engine computes scores in float32, so each weight carries a relative
error of about ``|s|·2^-24`` (a few 1e-7 at the score scales used here), and the sums
inherit it. Floored counts may differ by the entries within 1e-4 of the floor.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from equivariance_probe.statistics.engines import torch_blocks as engine
from equivariance_probe.statistics.engines.spec import ReductionSpec
from equivariance_probe.statistics.engines.torch_blocks import (
    attention_sums_from_qk,
    attention_sums_from_weights,
    choose_block_size,
    full_float32_matmul,
)
from equivariance_probe.statistics.masks import mask_counts, uniform_prior, visible_key_counts

import attention_reference as reference
from synthetic import causal_mask

SUMS = ("raw_sum", "raw_sq", "log_sum", "log_sq", "lag_sum", "key_lag_sum")


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-12, "atol": 1e-14} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-10}


def make_qk(batch, heads, kv_heads, n_positions, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, n_positions, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, n_positions, dim, generator=generator, dtype=torch.float64)
    return query.to(dtype), key.to(dtype)


def assert_sums_close(out, ref, dtype, names=SUMS):
    for name in names:
        assert out[name].dtype == torch.float64
        torch.testing.assert_close(out[name], ref[name], **tolerance(dtype), msg=lambda m, n=name: f"{n}: {m}")


def assert_floored_close(out, ref):
    difference = (out["floored"] - ref["floored"]).abs()
    assert bool((difference <= ref["near_floor"]).all()), (out["floored"], ref["floored"])


CASES = list(
    itertools.product(
        [torch.float32, torch.bfloat16, torch.float64],  # dtype
        [(4, 2), (4, 1)],  # (H, H_kv)
        [None, 6, 37, 50],  # window (37 and 50 cover the whole context)
        [None, 5, 16],  # block size (neither divides 37)
    )
)


@pytest.mark.parametrize("dtype, heads, window, block_size", CASES)
def test_qk_sums_match_float64_reference(dtype, heads, window, block_size):
    n_heads, n_kv = heads
    n_positions = 37
    query, key = make_qk(3, n_heads, n_kv, n_positions, 16, dtype)
    softcap = 4.0 if (window or 0) % 2 == 0 else None  # alternate soft-capping across cases
    lengths = torch.tensor([37, 21, 0])
    excluded = [0, 5, 100]  # 100 lies outside the context and is ignored
    key_bin = torch.arange(n_positions) // 4
    log_floor = 1e-2
    out = attention_sums_from_qk(
        query, key, softcap=softcap, window=window, lengths=lengths, excluded_keys=excluded,
        log_floor=log_floor, key_bin=key_bin, n_key_bins=10, keep_pattern=True, block_size=block_size,
    )
    log_pattern = reference.float64_log_pattern(query, key, softcap=softcap, window=window)
    ref = reference.sums_from_log_pattern(
        log_pattern, window=window, lengths=lengths, excluded_keys=excluded, log_floor=log_floor,
        key_bin=key_bin, n_key_bins=10,
    )
    assert_sums_close(out, ref, dtype, SUMS + ("pattern_sum",))
    assert_floored_close(out, ref)
    assert out["floored"].sum() > 0  # the floor was exercised
    assert out["raw_sum"][2].abs().max() == 0  # an empty window contributes nothing
    assert out["raw_sum"][1, :, 21:].abs().max() == 0  # nor do padding rows


@pytest.mark.parametrize("n_positions, block_size", [(32, 8), (32, 16), (32, 32), (32, 1), (33, 8), (1, None)])
def test_block_sizes_that_do_and_do_not_divide_the_context(n_positions, block_size):
    query, key = make_qk(2, 4, 2, n_positions, 16, torch.float64, seed=1)
    lengths = torch.tensor([n_positions, max(n_positions - 7, 1)])
    out = attention_sums_from_qk(query, key, lengths=lengths, block_size=block_size, window=9, excluded_keys=[3])
    ref = reference.sums_from_log_pattern(
        reference.float64_log_pattern(query, key, window=9), window=9, lengths=lengths, excluded_keys=[3],
        log_floor=torch.finfo(torch.float64).tiny, key_bin=torch.arange(n_positions), n_key_bins=n_positions,
    )
    assert_sums_close(out, ref, torch.float64)
    assert torch.equal(out["floored"], ref["floored"])


def test_default_log_floor_is_the_smallest_normal_of_the_input_dtype():
    query, key = make_qk(1, 2, 1, 20, 16, torch.float32)
    query = query * 40  # very peaked rows: some weights fall below float32's smallest normal
    out = attention_sums_from_qk(query, key)
    ref = reference.sums_from_log_pattern(
        reference.float64_log_pattern(query, key), window=None, lengths=torch.tensor([20]), excluded_keys=[],
        log_floor=torch.finfo(torch.float32).tiny, key_bin=torch.arange(20), n_key_bins=20,
    )
    assert ref["floored"].sum() > 0
    assert_floored_close(out, ref)
    # Floored entries read log eps exactly; the others their (accurate) log weight,
    # even where the weight itself underflows to 0 in float32.
    torch.testing.assert_close(out["log_sum"], ref["log_sum"], rtol=1e-6, atol=0)


def recompute_pattern(query, key, scaling=None, softcap=None, window=None):
    """Eager attention as the nnsight adapter's ``recompute_pattern`` computes it (float32)."""
    n_heads, n_kv = query.shape[1], key.shape[1]
    key = key.repeat_interleave(n_heads // n_kv, dim=1)
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * (
        query.shape[-1] ** -0.5 if scaling is None else scaling
    )
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~causal_mask(query.shape[2], window), float("-inf"))
    return torch.softmax(scores.float(), dim=-1)


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 4.0), (12, 4.0)])
def test_weights_path_equals_qk_path_on_the_recomputed_pattern(window, softcap):
    query, key = make_qk(3, 4, 2, 37, 16, torch.float32, seed=2)
    options = dict(
        window=window, lengths=torch.tensor([37, 30, 9]), excluded_keys=[0, 2], log_floor=1e-3,
        key_bin=torch.arange(37) // 6, keep_pattern=True,
    )
    from_qk = attention_sums_from_qk(query, key, softcap=softcap, **options)
    pattern = recompute_pattern(query, key, softcap=softcap, window=window)
    from_weights = attention_sums_from_weights(pattern, block_size=8, **options)
    assert_sums_close(from_weights, from_qk, torch.float32, SUMS + ("pattern_sum",))
    ref = reference.sums_from_log_pattern(
        pattern, from_weights=True, window=window, lengths=options["lengths"], excluded_keys=[0, 2],
        log_floor=1e-3, key_bin=options["key_bin"], n_key_bins=7,
    )
    assert_sums_close(from_weights, ref, torch.float32)
    assert_floored_close(from_qk, ref)
    assert_floored_close(from_weights, ref)


def test_weights_outside_the_mask_are_ignored():
    query, key = make_qk(2, 2, 2, 24, 16, torch.float64, seed=3)
    pattern = torch.exp(reference.float64_log_pattern(query, key, window=5))
    polluted = pattern + torch.rand_like(pattern) * (~causal_mask(24, 5))  # mass outside the window
    options = dict(window=5, lengths=torch.tensor([24, 10]), excluded_keys=[1])
    clean = attention_sums_from_weights(pattern, **options)
    dirty = attention_sums_from_weights(polluted, **options)
    for name in clean:
        torch.testing.assert_close(dirty[name], clean[name], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("zero", ["query", "key"])
def test_uniform_attention_is_exact(dtype, window, zero):
    """All-zero queries (or keys) make every head uniform over the visible keys."""
    n_positions = 29
    query, key = make_qk(3, 4, 2, n_positions, 16, dtype, seed=4)
    if zero == "query":
        query = torch.zeros_like(query)
    else:
        key = torch.zeros_like(key)
    lengths = torch.tensor([29, 17, 1])
    excluded = [0, 4]
    key_bin = torch.arange(n_positions) // 3
    out = attention_sums_from_qk(
        query, key, window=window, lengths=lengths, excluded_keys=excluded, key_bin=key_bin, block_size=7,
    )
    count = visible_key_counts(n_positions, window, excluded).expand(3, -1).clone()
    count[torch.arange(n_positions).view(1, -1) >= lengths.view(-1, 1)] = 0
    count = count.unsqueeze(1)
    for total_name, square_name in (("raw_sum", "raw_sq"), ("log_sum", "log_sq")):
        total, square = out[total_name], out[square_name]
        mean = total / count.clamp_min(1)
        if dtype == torch.float64:
            # A float64 row sum of equal float64 values rounds, so only to rounding here.
            torch.testing.assert_close(square, count * mean * mean, rtol=1e-15, atol=0)
        else:
            # Exactly count·mean² (bit for bit): no spurious within-row variance.
            assert torch.equal(square, count * mean * mean), total_name
        within = square - total * total / count.clamp_min(1)
        assert float(within.abs().max()) <= 4 * torch.finfo(torch.float64).eps * float(square.abs().max())
    # Each visible weight is u(q) = 1/|V(q)| (the mask, not the exclusions, sets it).
    prior = uniform_prior(n_positions, window)
    rtol = 1e-15 if dtype == torch.float64 else 1e-7
    torch.testing.assert_close(out["raw_sum"], (count * prior).expand(-1, 4, -1), rtol=rtol, atol=0)
    counts = mask_counts(lengths, n_positions, window=window, excluded_keys=excluded, key_bin=key_bin)
    torch.testing.assert_close(out["lag_sum"].sum(0), counts["lag_prior_sum"].expand(4, -1), rtol=rtol, atol=1e-300)
    # key_lag_prior_sum subtracts prefix sums (relative error ~T·1e-16, see mask_counts).
    rtol = 1e-12 if dtype == torch.float64 else 1e-7
    torch.testing.assert_close(out["key_lag_sum"], 4 * counts["key_lag_prior_sum"], rtol=rtol, atol=1e-300)


def rotary_lag_only_qk(n_positions, dim, window_seed=5):
    """Queries and keys whose scores depend on ``q - k`` only (rotations by ``θ·t``, as RoPE)."""
    generator = torch.Generator().manual_seed(window_seed)
    pairs = dim // 2
    theta = torch.rand(pairs, generator=generator, dtype=torch.float64)
    vq = torch.randn(pairs, 2, generator=generator, dtype=torch.float64) * 1.5
    vk = torch.randn(pairs, 2, generator=generator, dtype=torch.float64)
    angle = torch.arange(n_positions, dtype=torch.float64).view(-1, 1) * theta.view(1, -1)  # [T, pairs]
    cos, sin = torch.cos(angle), torch.sin(angle)

    def rotate(v):
        x, y = v[:, 0], v[:, 1]
        return torch.stack([cos * x - sin * y, sin * x + cos * y], -1).reshape(n_positions, dim)

    return rotate(vq), rotate(vk)


@pytest.mark.parametrize("window", [None, 6])
def test_lag_only_scores(window):
    """Scores that depend on ``q - k`` alone: lag sums in closed form from ``f(dt)``."""
    n_positions, dim = 30, 8
    q_rows, k_rows = rotary_lag_only_qk(n_positions, dim)
    query = q_rows.view(1, 1, n_positions, dim).expand(2, 2, -1, -1).contiguous()
    key = k_rows.view(1, 1, n_positions, dim).expand(2, 1, -1, -1).contiguous()
    lengths = torch.tensor([30, 19])
    out = attention_sums_from_qk(query, key, scaling=1.0, window=window, lengths=lengths, block_size=8)
    # q_t·k_s = vqᵀ R(θ(s - t)) vk depends on t - s only: f(dt) = q_dt·k_0.
    f = q_rows @ k_rows[0]
    # Row q sees lags 0..min(q, w-1); its weights are softmax(f[0..]) over those lags.
    expected = torch.zeros(2, n_positions, dtype=torch.float64)
    for b, length in enumerate(lengths.tolist()):
        for q in range(length):
            n_visible = q + 1 if window is None else min(q + 1, window)
            expected[b, :n_visible] += torch.softmax(f[:n_visible], 0)
    torch.testing.assert_close(out["lag_sum"], expected.unsqueeze(1).expand(2, 2, -1), rtol=1e-12, atol=1e-15)
    ref = reference.sums_from_log_pattern(
        reference.float64_log_pattern(query, key, scaling=1.0, window=window), window=window, lengths=lengths,
        excluded_keys=[], log_floor=torch.finfo(torch.float64).tiny, key_bin=torch.arange(n_positions),
        n_key_bins=n_positions,
    )
    assert_sums_close(out, ref, torch.float64)


MASK_CASES = list(
    itertools.product(
        [None, 1, 5, 23, 40],  # window (23 and 40 cover the context)
        [(), (0,), (0, 3, 22, 99)],  # excluded keys (99 is outside)
        ["per_key", "coarse", "uneven"],  # key bins
    )
)


@pytest.mark.parametrize("window, excluded, bins", MASK_CASES)
def test_mask_counts_match_brute_force(window, excluded, bins):
    n_positions = 23
    lengths = torch.tensor([23, 11, 0, 1, 23])
    if bins == "per_key":
        key_bin, n_bins = torch.arange(n_positions), n_positions
    elif bins == "coarse":
        key_bin, n_bins = torch.arange(n_positions) // 6, 4
    else:  # uneven widths and an empty bin (2), plus a trailing empty bin (5)
        key_bin = torch.tensor([0] * 2 + [1] * 9 + [3] * 1 + [4] * 11)
        n_bins = 6
    out = mask_counts(lengths, n_positions, window=window, excluded_keys=excluded, key_bin=key_bin, n_key_bins=n_bins)
    ref = reference.reference_mask_counts(
        lengths, n_positions, window=window if window is None or window < n_positions else None,
        excluded_keys=excluded, key_bin=key_bin, n_key_bins=n_bins,
    )
    assert set(out) == set(ref)
    for name in ref:
        exact = "count" in name or name == "windows_covering"
        torch.testing.assert_close(out[name], ref[name], rtol=0 if exact else 1e-12, atol=0 if exact else 1e-14, msg=name)


def test_mask_counts_agree_with_the_attention_sums_entry_counts():
    """``mask_counts`` and the attention sums read the same visible entries."""
    n_positions = 31
    lengths = torch.tensor([31, 12])
    options = dict(window=8, excluded_keys=[0, 9], key_bin=torch.arange(n_positions) // 5)
    ones = torch.ones(2, 4, n_positions, n_positions, dtype=torch.float64)
    from_ones = attention_sums_from_weights(ones, lengths=lengths, **options)  # visible weights 1: sums are counts
    counts = mask_counts(lengths, n_positions, **options)
    torch.testing.assert_close(from_ones["raw_sum"].sum((0, 1)) / 4, counts["query_count"], rtol=0, atol=0)
    torch.testing.assert_close(from_ones["lag_sum"][:, 0], counts["doc_lag_count"], rtol=0, atol=0)
    torch.testing.assert_close(from_ones["key_lag_sum"] / 4, counts["key_lag_count"], rtol=0, atol=0)


def test_uniform_prior_and_visible_key_counts():
    assert torch.equal(uniform_prior(5, None), 1 / torch.tensor([1.0, 2, 3, 4, 5], dtype=torch.float64))
    assert torch.equal(uniform_prior(5, 3), 1 / torch.tensor([1.0, 2, 3, 3, 3], dtype=torch.float64))
    assert visible_key_counts(6, 3, [0, 4]).tolist() == [0, 1, 2, 3, 2, 2]


def test_batches_merge_by_addition():
    """Sums of sub-batches, concatenated or added, equal the sums of the whole batch."""
    query, key = make_qk(4, 4, 2, 25, 16, torch.float64, seed=7)
    lengths = torch.tensor([25, 3, 18, 25])
    options = dict(window=10, excluded_keys=[0], key_bin=torch.arange(25) // 5, keep_pattern=True)
    whole = attention_sums_from_qk(query, key, lengths=lengths, **options)
    first = attention_sums_from_qk(query[:1], key[:1], lengths=lengths[:1], **options)
    rest = attention_sums_from_qk(query[1:], key[1:], lengths=lengths[1:], block_size=4, **options)
    for name in ("raw_sum", "raw_sq", "log_sum", "log_sq", "lag_sum", "floored"):
        torch.testing.assert_close(whole[name], torch.cat([first[name], rest[name]]), rtol=1e-13, atol=0)
    for name in ("key_lag_sum", "pattern_sum"):
        torch.testing.assert_close(whole[name], first[name] + rest[name], rtol=1e-13, atol=1e-300)


def test_a_workspace_shared_across_calls_changes_no_bit():
    """One BlockWorkspace reused across layers, shapes, dtypes, masks and both entry points gives
    bitwise the sums of calls that each allocate their own temporaries."""
    workspace = engine.BlockWorkspace()
    calls = []
    for seed, (batch, heads, kv_heads, n_positions, dtype) in enumerate(
        [(2, 4, 2, 33, torch.float32), (1, 4, 1, 70, torch.float32), (2, 4, 2, 33, torch.float64), (3, 2, 2, 12, torch.bfloat16)]
    ):
        query, key = make_qk(batch, heads, kv_heads, n_positions, 16, dtype, seed=seed)
        lengths = torch.tensor([n_positions, max(1, n_positions - 5), 4][:batch])
        options = dict(lengths=lengths, window=[None, 9][seed % 2], excluded_keys=[0, 2][: seed % 3], block_size=8,
                       key_bin=torch.arange(n_positions) // 4)
        calls.append(lambda ws, q=query, k=key, o=options: attention_sums_from_qk(q, k, workspace=ws, **o))
        pattern = torch.softmax(torch.randn(batch, heads, n_positions, n_positions, generator=torch.Generator().manual_seed(seed)), -1)
        pattern[..., 0, 1] = float("nan")  # outside the causal mask: never read
        calls.append(lambda ws, p=pattern, o=options: attention_sums_from_weights(p, workspace=ws, **o))
        calls.append(lambda ws, q=query, k=key, o=options: attention_sums_from_qk(q, k, causal=False, workspace=ws,
                                                                                  **{**o, "window": None}))
    for call in calls + calls[::-1]:
        shared, own = call(workspace), call(None)
        for name, value in own.items():
            assert torch.equal(shared[name], value), name


def test_a_workspace_is_sized_by_the_first_block_and_then_reused():
    """The largest block comes first, so a second call of the same shape allocates nothing new,
    and its buffers hold what one block needs (no more than the block budget's estimate)."""
    query, key = make_qk(2, 4, 1, 96, 16, torch.float32)
    workspace = engine.BlockWorkspace()
    attention_sums_from_qk(query, key, block_size=16, workspace=workspace)
    buffers = {slot: buffer.data_ptr() for slot, buffer in workspace._buffers.items()}
    held = workspace.nbytes
    attention_sums_from_qk(query, key, block_size=16, workspace=workspace)
    assert {slot: buffer.data_ptr() for slot, buffer in workspace._buffers.items()} == buffers
    largest = 2 * 4 * 16 * 96  # [B, H, rows, keys] of the last block
    assert 0 < held <= largest * engine._BYTES_PER_ENTRY[torch.float32]
    blocks = engine._blocks(engine.layout(ReductionSpec(), batch=2, heads=4, n_positions=96, device=query.device,
                                          input_dtype=torch.float32), 16, torch.float32)
    assert blocks[0] == (80, 96, 0, 96) and sorted(b[0] for b in blocks) == list(range(0, 96, 16))
    workspace.clear()
    assert workspace.nbytes == 0


def test_choose_block_size_follows_the_memory_budget():
    budget = 32 * 2**20
    per_entry = engine._BYTES_PER_ENTRY[torch.float32]
    rows = choose_block_size(4, 4, 1024, None, torch.float32, budget)
    assert rows % 16 == 0 and 4 * 4 * rows * 1024 * per_entry <= budget < 4 * 4 * (rows + 16) * 1024 * per_entry
    windowed = choose_block_size(4, 4, 1024, 128, torch.float32, budget)
    assert windowed > rows and 4 * 4 * windowed * (128 + windowed - 1) * per_entry <= budget
    in_float64 = choose_block_size(4, 1, 8192, None, torch.float64, budget)
    assert in_float64 < choose_block_size(4, 1, 8192, None, torch.float32, budget)
    assert choose_block_size(1, 1, 10, None) == 10  # never more than T
    assert choose_block_size(64, 64, 2**17, None) == 1  # at least one row
    assert choose_block_size(1, 1, 10**6, None, torch.float32, 2**40) == 64  # capped
    assert choose_block_size(2, 2, 100, 500) == choose_block_size(2, 2, 100, None)  # window >= T


def test_input_validation():
    query, key = make_qk(2, 3, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="share"):
        attention_sums_from_qk(query, key)
    query, key = make_qk(2, 4, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="lengths"):
        attention_sums_from_qk(query, key, lengths=torch.tensor([9, 1]))
    with pytest.raises(ValueError, match="non-decreasing"):
        attention_sums_from_qk(query, key, key_bin=torch.arange(8).flip(0))
    with pytest.raises(ValueError, match="key_bin values"):
        attention_sums_from_qk(query, key, key_bin=torch.zeros(8, dtype=torch.long) + 3, n_key_bins=2)
    with pytest.raises(ValueError, match="window"):
        attention_sums_from_qk(query, key, window=0)
    with pytest.raises(ValueError, match="does not match"):
        attention_sums_from_qk(query, key[:, :, :4])


def test_full_float32_matmul_restores_the_setting():
    backend = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if backend is None or not hasattr(backend, "fp32_precision"):
        pytest.skip("this torch has no oneDNN fp32_precision setting")
    before = backend.fp32_precision
    backend.fp32_precision = "bf16"
    try:
        with full_float32_matmul("cpu"):
            assert backend.fp32_precision == "ieee"
        assert backend.fp32_precision == "bf16"
        # A bf16 matmul setting would cost ~3 digits; the sums must not see it.
        query, key = make_qk(1, 2, 1, 16, 64, torch.float32, seed=8)
        out = attention_sums_from_qk(query, key)
        ref = reference.sums_from_log_pattern(
            reference.float64_log_pattern(query, key), window=None, lengths=torch.tensor([16]), excluded_keys=[],
            log_floor=torch.finfo(torch.float32).tiny, key_bin=torch.arange(16), n_key_bins=16,
        )
        assert_sums_close(out, ref, torch.float32)
    finally:
        backend.fp32_precision = before


def test_compile_failure_falls_back_to_eager(monkeypatch):
    """``compile_blocks=True`` never changes results: a compiler failure falls back to eager."""
    query, key = make_qk(2, 2, 1, 12, 16, torch.float32, seed=9)
    eager = attention_sums_from_qk(query, key, window=5)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(engine, "_compiled", {"scores": broken})
    monkeypatch.setattr(engine, "_compile_failed", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = attention_sums_from_qk(query, key, window=5, compile_blocks=True)
    assert any("torch.compile" in str(w.message) for w in caught)
    for name in eager:
        assert torch.equal(eager[name], compiled[name])
    assert engine._compile_failed


def test_module_imports_only_torch_einops_and_the_standard_library():
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse(Path(engine.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    # einops names the axes it moves and is pure Python (and installed on NDIF's servers).
    assert imported - {"torch", "einops", "__future__"} <= set(sys.stdlib_module_names), imported


def test_toeplitz_r2_of_a_lag_only_pattern_is_one_and_of_a_uniform_head_below():
    """docs/methods.md#checks: a pattern depending only on q - k scores 1; uniform causal less."""
    n_positions = 24
    f = torch.linspace(0, -3, n_positions, dtype=torch.float64)  # weight by lag, any profile
    lag = torch.arange(n_positions).view(-1, 1) - torch.arange(n_positions).view(1, -1)
    toeplitz = torch.where(lag >= 0, f[lag.clamp_min(0)].exp(), torch.zeros((), dtype=torch.float64))
    uniform = torch.tril(torch.ones(n_positions, n_positions, dtype=torch.float64))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    pattern = torch.stack([toeplitz, uniform]).unsqueeze(0)  # [1, 2, T, T]: head 0 Toeplitz, head 1 uniform
    lengths = torch.tensor([n_positions])
    sums = attention_sums_from_weights(pattern, lengths=lengths)
    counts = mask_counts(lengths, n_positions)
    r2, has_variance = engine.toeplitz_r2_per_window(sums, counts["doc_lag_count"])
    assert bool(has_variance.all())
    torch.testing.assert_close(r2[0, 0], torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
    # Closed form for the uniform causal head, computed independently.
    entries = [(q, k, 1 / (q + 1)) for q in range(n_positions) for k in range(q + 1)]
    mean = sum(a for *_, a in entries) / len(entries)
    tss = sum((a - mean) ** 2 for *_, a in entries)
    diagonal = {}
    for q, k, a in entries:
        diagonal.setdefault(q - k, []).append(a)
    rss = sum((a - sum(d) / len(d)) ** 2 for d in diagonal.values() for a in d)
    torch.testing.assert_close(r2[0, 1], torch.tensor(1 - rss / tss, dtype=torch.float64), rtol=1e-10, atol=0)
    assert float(r2[0, 1]) < 0.9


def test_key_bins_are_checked_on_the_host_and_never_read_back_from_a_device():
    """Bins on an accelerator are taken as given (reading them back would sync the device on every
    layer); the statistics check theirs on the host, where bad bins are refused."""
    from equivariance_probe.errors import InputError
    from equivariance_probe.statistics.masks import _check_key_bins

    on_device = torch.zeros(8, dtype=torch.long, device="meta")  # any read of its values would raise
    bins, count = _check_key_bins(on_device, 2, 8, torch.device("meta"))
    assert bins.device.type == "meta" and count == 2
    with pytest.raises(InputError, match="non-decreasing"):
        _check_key_bins(torch.tensor([0, 1, 0, 1]), 2, 4, torch.device("cpu"))
    with pytest.raises(InputError, match=r"lie in \[0, 2\)"):
        _check_key_bins(torch.tensor([0, 1, 2, 2]), 2, 4, torch.device("cpu"))
