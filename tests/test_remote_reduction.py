"""The reduction that runs inside remote nnsight traces (statistics.engines.in_trace.reduce_layer, from a whole
pattern) gives the sums of the local query-block engine (statistics.engines.torch_blocks), reduced over the batch."""

from __future__ import annotations

import pytest
import torch

from equivariance_probe.statistics.engines.torch_blocks import attention_sums_from_weights, toeplitz_r2_per_window
from equivariance_probe.statistics.engines.in_trace import diagonal_sums, reduce_layer, visible_mask
from equivariance_probe.statistics.masks import key_bins, mask_counts


def test_diagonal_sums_are_the_sums_along_each_lag():
    values = torch.randn(2, 3, 7, 7, dtype=torch.float64).tril()
    expected = torch.stack([torch.diagonal(values, offset=-lag, dim1=-2, dim2=-1).sum(-1) for lag in range(7)], -1)
    torch.testing.assert_close(diagonal_sums(values), expected, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("window", [None, 6])
def test_remote_reduction_equals_the_local_engine(window):
    n_positions, heads = 30, 3
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, heads, n_positions, n_positions, generator=generator) * 2
    allowed = visible_mask(n_positions, window, torch.tensor([n_positions]))[0]
    pattern = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    lengths = torch.tensor([30, 17, 2])
    excluded = [0, 4]
    eps = 1e-3
    bins, count = key_bins(n_positions, 8)
    remote = reduce_layer(pattern, visible_mask(n_positions, window, lengths, excluded), eps, bins, count, keep_pattern=True)
    local = attention_sums_from_weights(pattern, window=window, lengths=lengths, excluded_keys=excluded, log_floor=eps,
                                        key_bin=bins, n_key_bins=count, keep_pattern=True)
    close = dict(rtol=1e-6, atol=1e-12)
    for name in ("raw_sum", "raw_sq", "log_sum", "log_sq", "lag_sum", "floored"):
        torch.testing.assert_close(local[name].sum(0), remote[name], **close, msg=name)
    for name in ("key_lag_sum", "pattern_sum"):
        torch.testing.assert_close(local[name], remote[name], **close, msg=name)
    counts = mask_counts(lengths, n_positions, window=window, excluded_keys=excluded, key_bin=bins, n_key_bins=count)
    r2, has_variance = toeplitz_r2_per_window(local, counts["doc_lag_count"])
    torch.testing.assert_close(r2.sum(0), remote["doc_toeplitz_sum"], rtol=1e-5, atol=1e-9)
    assert torch.equal(has_variance.sum(0, dtype=torch.float64), remote["doc_toeplitz_count"])
