"""The shift test's decomposition: the identity, brute force = streaming = merged shards, undefined shares."""

import numpy as np
import pytest
import torch

from equivariance_probe.errors import IncompatibleResultsError
from equivariance_probe.maths.shift import (
    centre_about_mean_vector,
    decomposition,
    decomposition_sums,
    jensen_shannon,
    offset_rms,
    shares,
    vector_decomposition_sums,
)
from equivariance_probe.statistics.shift import ShiftConfig, ShiftStatistics, jensen_shannon_torch


def brute_force_terms(y: np.ndarray) -> dict[str, float]:
    """The five sums of squares of ``y [G, F, S, E]`` straight from their definitions."""
    grand = y.mean()
    cell = y.mean((1, 2))
    by_offset = y.mean(1)
    by_context = y.mean(2)
    n_contexts, n_offsets = y.shape[1:3]
    residual = y - by_offset[:, None] - by_context[:, :, None] + cell[:, None, None]
    return {
        "all": ((y - grand) ** 2).sum(),
        "pair": n_contexts * n_offsets * ((cell - grand) ** 2).sum(),
        "offset": n_contexts * ((by_offset - cell[:, None]) ** 2).sum(),
        "context": n_offsets * ((by_context - cell[:, None]) ** 2).sum(),
        "residual": (residual ** 2).sum(),
    }


def grid_values(seed: int = 0, segments: int = 5, contexts: int = 3, offsets: int = 4, layers: int = 2, heads: int = 3,
                entries: int = 7) -> np.ndarray:
    """``[G, F, S, L, H, E]`` with entry, offset, context and interaction effects and a large common offset."""
    rng = np.random.default_rng(seed)
    shape = (segments, contexts, offsets, layers, heads, entries)
    pair = rng.normal(size=(segments, 1, 1, layers, heads, entries))
    offset = 0.3 * rng.normal(size=(segments, 1, offsets, layers, heads, entries))
    context = 0.2 * rng.normal(size=(segments, contexts, 1, layers, heads, entries))
    return 50.0 + pair + offset + context + 0.05 * rng.normal(size=shape)


def stream(values: np.ndarray, fingerprints, groups: int = 4,
           attention: tuple[str, ...] = ("centred_logits", "conditional_weights", "raw_weights")) -> ShiftStatistics:
    """``values [G, F, S, L, H, E]`` through the streaming sums: each ``[H, E]`` cell as every attention representation
    of ``attention`` and, flattened, as the residual stream (``H`` its tokens, ``E`` its hidden dimensions)."""
    segments, contexts, offsets, layers, heads, entries = values.shape
    config = ShiftConfig(n_layers=layers, n_heads=heads, offsets=tuple(range(offsets)), n_contexts=contexts,
                         segment_length=4, interval_groups=groups, predictions=False, hidden_size=entries)
    statistics = ShiftStatistics(config)
    for g, fingerprint in enumerate(fingerprints):
        grid = statistics.new_segment(fingerprint)
        for f in range(contexts):
            for s in range(offsets):
                for layer in range(layers):
                    for rep in attention:
                        grid.add(rep, layer, s, torch.from_numpy(values[g, f, s, layer]))
                    grid.add("residual", layer, s, torch.from_numpy(values[g, f, s, layer].reshape(1, -1)))
            grid.end_context()
        statistics.add_segment(fingerprint, fingerprint % groups, grid)
    return statistics


def test_identity_and_brute_force_per_head():
    y = grid_values()
    sums = decomposition_sums(y)
    terms = decomposition(sums)
    for layer in range(y.shape[3]):
        for head in range(y.shape[4]):
            expected = brute_force_terms(y[:, :, :, layer, head])
            for name, value in expected.items():
                assert terms[name][layer, head] == pytest.approx(value, rel=1e-9, abs=1e-9), name
    total = terms["pair"] + terms["offset"] + terms["context"] + terms["residual"]
    np.testing.assert_allclose(total, terms["all"], rtol=1e-14)


def test_streaming_equals_brute_force_and_merged_shards():
    y = grid_values(seed=1)
    whole = stream(y, range(100, 105))
    brute = decomposition_sums(y)
    totals = whole.totals()
    for name, value in brute.items():
        np.testing.assert_allclose(totals[f"centred_logits/{name}"], value, rtol=1e-10, atol=1e-9)
    residual = decomposition(centre_about_mean_vector(
        {name: totals[f"residual/{name}"] for name in [*brute, "total_by_dim"]}))
    # The residual stream's entries: the heads as its tokens, the entries as its hidden dimensions.
    expected = decomposition(centre_about_mean_vector(vector_decomposition_sums(y)))
    for name in expected:
        np.testing.assert_allclose(residual[name][:, 0], expected[name], rtol=1e-10, atol=1e-9)
    first, second = stream(y[:2], range(100, 102)), stream(y[2:], range(102, 105))
    merged = first + second
    for name, value in whole.arrays.items():
        np.testing.assert_allclose(merged.arrays[name], value, rtol=1e-12, atol=1e-12)
    with pytest.raises(IncompatibleResultsError, match="count twice"):
        merged.merge(stream(y[:1], [104]))


def test_rounding_level_offset_share_stays_at_rounding_level():
    """An exactly offset-free grid with a large common value: the streamed offset share is ~0, not cancellation noise."""
    rng = np.random.default_rng(2)
    y = np.broadcast_to(1e3 + rng.normal(size=(3, 1, 1, 1, 2, 9)), (3, 4, 5, 1, 2, 9)).copy()
    y += 1e-3 * rng.normal(size=(3, 4, 1, 1, 2, 9))  # contexts only
    totals = stream(y, range(3), groups=1).totals()
    eta = shares({name: totals[f"centred_logits/{name}"] for name in decomposition_sums(y)})
    assert np.all(eta["offset"] <= 1e-12)
    assert np.all(eta["context"] > 1e-12)


def test_constant_values_give_undefined_shares():
    y = np.zeros((2, 3, 4, 1, 2, 5))
    sums = decomposition_sums(y)
    eta = shares(sums)
    for name in eta:
        assert np.all(np.isnan(eta[name])), name
    assert np.all(offset_rms(sums) == 0.0)


def test_jensen_shannon_known_values_and_torch_equals_numpy():
    with np.errstate(divide="ignore"):
        p = np.log(np.array([[1.0, 0.0], [0.5, 0.5]]))
        q = np.log(np.array([[0.0, 1.0], [0.5, 0.5]]))
        np.testing.assert_allclose(jensen_shannon(p, q), [np.log(2.0), 0.0], atol=1e-15)
        # The streaming form reads -inf log-probabilities (a masked logit) as probability 0, never as NaN.
        np.testing.assert_allclose(jensen_shannon_torch(torch.from_numpy(p), torch.from_numpy(q)).numpy(),
                                   [np.log(2.0), 0.0], atol=1e-15)
    rng = np.random.default_rng(3)
    a, b = (torch.log_softmax(torch.from_numpy(rng.normal(size=(4, 11))), -1) for _ in range(2))
    np.testing.assert_allclose(jensen_shannon_torch(a, b).numpy(), jensen_shannon(a.numpy(), b.numpy()), rtol=1e-12)
    # More rows than one chunk of the streaming run: the chunks join in order.
    a, b = (torch.log_softmax(torch.from_numpy(rng.normal(size=(19, 11))), -1) for _ in range(2))
    np.testing.assert_allclose(jensen_shannon_torch(a, b).numpy(), jensen_shannon(a.numpy(), b.numpy()), rtol=1e-12)
