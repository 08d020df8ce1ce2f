"""Every result knows its windows by a 64-bit fingerprint of their token ids, so that merging two
results that share a window is refused (naming how many), unless asked for on purpose."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, IncompatibleResultsError
from equivariance_probe.records.provenance import window_fingerprint

from synthetic import SyntheticAdapter, tiny_gpt2, uniform_pattern


def _blake2b_64(ids: list[int]) -> int:
    """The fingerprint as docs/guide/long-runs.md tells users to compute it, without the package."""
    return int.from_bytes(hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=8).digest(), "little")


def test_the_fingerprint_is_blake2b_of_the_little_endian_ids():
    assert window_fingerprint([1, 2, 3]) == _blake2b_64([1, 2, 3])
    assert window_fingerprint(torch.tensor([1, 2, 3])) == window_fingerprint(np.array([1, 2, 3], dtype=np.int32))
    # A known answer, so that the hash can never change silently between releases or machines.
    assert window_fingerprint([1, 2, 3]) == int.from_bytes(
        hashlib.blake2b(b"\x01" + 7 * b"\x00" + b"\x02" + 7 * b"\x00" + b"\x03" + 7 * b"\x00", digest_size=8).digest(),
        "little")
    assert window_fingerprint([1, 2]) != window_fingerprint([1, 2, 0])  # a prefix is another window


@pytest.fixture(scope="module")
def probe():
    return EquivarianceProbe(tiny_gpt2())


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n, 12), generator=torch.Generator().manual_seed(seed))


def test_a_run_keeps_one_sorted_fingerprint_per_window(probe):
    tokens = _tokens(5, 0)
    rows = [row[: 12 - i] for i, row in enumerate(tokens.tolist())]  # uneven lengths: padding is not hashed
    result = probe.run([torch.tensor(r) for r in rows], context_length=12, batch_size=2, progress=False)
    expected = np.sort(np.array([_blake2b_64(r) for r in rows], dtype=np.uint64))
    assert result.statistics.window_fingerprints.dtype == np.uint64
    np.testing.assert_array_equal(result.statistics.window_fingerprints, expected)
    # carried by copy, to and merge
    np.testing.assert_array_equal(result.statistics.copy().window_fingerprints, expected)
    np.testing.assert_array_equal(result.statistics.to("cpu").window_fingerprints, expected)
    other = probe.run(_tokens(2, 1), progress=False)
    merged = result + other
    assert len(merged.statistics.window_fingerprints) == merged.n_windows == 7
    assert np.all(np.diff(merged.statistics.window_fingerprints.astype(object)) >= 0)


def test_merging_results_that_share_windows_is_refused_naming_how_many(probe):
    tokens = _tokens(4, 2)
    first = probe.run(tokens, progress=False)
    overlapping = probe.run(torch.cat([tokens[1:3], _tokens(3, 3)]), progress=False)
    with pytest.raises(IncompatibleResultsError, match=r"2 of the 5 windows .* already in the result.*allow_duplicate_windows=True"):
        first + overlapping
    with pytest.raises(IncompatibleResultsError, match="4 of the 4 windows"):
        first.merge(probe.run(tokens, progress=False))  # the same documents run twice
    # The escape hatch counts them twice, as asked.
    doubled = first.merge(probe.run(tokens, progress=False), allow_duplicate_windows=True)
    assert doubled.n_windows == 8 and len(doubled.statistics.window_fingerprints) == 8
    for name, value in first.statistics.arrays.items():
        assert torch.allclose(doubled.statistics.arrays[name], 2 * value, rtol=1e-12, atol=0), name


def test_an_aborted_batch_adds_no_fingerprint():
    def pattern(layer, tokens):
        if tokens[0, 0] == 7:
            raise KeyboardInterrupt  # during the second batch
        return uniform_pattern(tokens.shape[1]).expand(tokens.shape[0], 1, -1, -1)

    probe = EquivarianceProbe(SyntheticAdapter(pattern, n_layers=1, n_heads=1))
    tokens = torch.arange(24).view(4, 6) % 5
    tokens[2:, 0] = 7
    with pytest.raises(KeyboardInterrupt):
        probe.run(tokens, batch_size=2, progress=False)
    partial = probe.last_result
    assert partial.n_windows == 2
    np.testing.assert_array_equal(partial.statistics.window_fingerprints,
                                  np.sort(np.array([_blake2b_64(r) for r in tokens[:2].tolist()], dtype=np.uint64)))


def test_begin_batch_refuses_a_fingerprint_count_that_does_not_match():
    from equivariance_probe import AttentionStatistics, InputError

    statistics = AttentionStatistics(n_layers=1, n_heads=1, n_positions=4, sliding_windows=[None])
    with pytest.raises(InputError, match="3 window fingerprints for a batch of 2 windows"):
        statistics.begin_batch(torch.tensor([4, 3]), fingerprints=[1, 2, 3])
