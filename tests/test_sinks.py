"""Attention sinks (Gu et al., ICLR 2025): the first token's weight α₁ per head and the sink rate, against
known answers: the model's own weights (``output_attentions=True``), the closed form of all-zero weights,
crafted patterns, every engine, and files written before the sums existed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, NotRunError, ProbeResult
from equivariance_probe.errors import InputError
from equivariance_probe.maths.intervals import CLIPPED_RANGE, jackknife_interval
from equivariance_probe.statistics import AttentionStatistics
from equivariance_probe.statistics.engines.in_trace import reduce_pattern, visible_mask
from equivariance_probe.statistics.engines.spec import ReductionSpec
from equivariance_probe.statistics.engines.torch_blocks import attention_sums_from_qk, attention_sums_from_weights
from equivariance_probe.statistics.masks import key_bins

from synthetic import edited_result_file, tiny_gemma3, tiny_gpt2, tiny_llama

BUILDERS = {"gemma3-sliding": lambda: tiny_gemma3(window=8), "llama-gqa": tiny_llama, "gpt2": tiny_gpt2}
CONTEXT = 24


def _windows() -> list[torch.Tensor]:
    tokens = torch.randint(3, 90, (5, CONTEXT), generator=torch.Generator().manual_seed(1))
    return [tokens[i, : CONTEXT - 3 * i] for i in range(5)]  # ragged: right padding inside a batch


def _direct_first_key_sum(model, windows) -> np.ndarray:
    """``Σ_windows a[l, h, q, 0]`` from the model's own eager weights, ``[L, H, T]``."""
    model.set_attn_implementation("eager")
    total = None
    with torch.no_grad():
        for window in windows:
            attentions = model(window[None], output_attentions=True).attentions
            first = torch.stack([a[0, :, :, 0] for a in attentions]).double().numpy()  # [L, H, n]
            padded = np.zeros((*first.shape[:2], CONTEXT))
            padded[..., : first.shape[-1]] = first
            total = padded if total is None else total + padded
    return total


@pytest.mark.parametrize("source", ["weights", "recompute"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_first_token_weight_is_the_models_own_weight_on_key_0_excluded_or_not(name, source):
    model = BUILDERS[name]()
    expected = _direct_first_key_sum(model, _windows())
    tokens = sum(len(w) for w in _windows())
    for excluded in ([0], []):
        result = EquivarianceProbe(model, pattern_source=source).run(
            _windows(), context_length=CONTEXT, batch_size=2, exclude_keys=excluded, progress=False)
        got = result.statistics.arrays["first_key_sum"].numpy()
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(result.first_token_weight(), expected.sum(-1) / tokens, rtol=2e-6)
    if name == "gemma3-sliding":  # sliding layers: no query at q >= 8 sees key 0
        sliding = [layer for layer, w in enumerate(result.statistics.sliding_windows) if w is not None]
        assert sliding and np.all(got[sliding][..., 8:] == 0)


def test_zero_weights_give_the_closed_form_mean_of_one_over_q_plus_one():
    model = tiny_gpt2(zero=True)
    windows = _windows()
    result = EquivarianceProbe(model).run(windows, context_length=CONTEXT, batch_size=2, exclude_keys=[0], progress=False)
    # Every head is uniform over its q + 1 keys: a[q, 0] = 1/(q + 1), pooled over every real query (to the
    # float32 rounding of the model's softmax, one ulp of each weight).
    lengths = [len(w) for w in windows]
    expected = sum(sum(1.0 / (q + 1) for q in range(n)) for n in lengths) / sum(lengths)
    np.testing.assert_allclose(result.first_token_weight(), expected, rtol=1.2e-7)
    assert result.first_token_weight(None) == pytest.approx(expected, rel=1.2e-7)
    # With windows of one length the pooled mean is the mean of per-window means (Gu et al.'s).
    same = EquivarianceProbe(model).run([w[:16] for w in windows[:3]], context_length=16, progress=False)
    assert same.first_token_weight(None) == pytest.approx(np.mean([1.0 / (q + 1) for q in range(16)]), rel=1.2e-7)
    assert same.sink_rate(0.3) == 0.0 and same.sink_rate(0.2) == 1.0  # 0.2113 for every head


def _crafted(weights_on_first: np.ndarray, lengths, interval_groups=0, keys=None) -> AttentionStatistics:
    """Statistics of patterns whose head ``(l, h)`` puts ``weights_on_first[l, h]`` on key 0 of every query
    ``q >= 1`` (and the rest uniformly on keys ``1..q``); query 0 puts 1 on key 0."""
    n_layers, n_heads = weights_on_first.shape
    n = max(lengths)
    statistics = AttentionStatistics(n_layers=n_layers, n_heads=n_heads, n_positions=n, sliding_windows=[None] * n_layers,
                                     interval_groups=interval_groups)
    q = torch.arange(n).view(-1, 1)
    k = torch.arange(n).view(1, -1)
    for index, length in enumerate(lengths):
        statistics.begin_batch(torch.tensor([length]), resampling_keys=None if keys is None else [keys[index]])
        for layer in range(n_layers):
            p = torch.tensor(weights_on_first[layer], dtype=torch.float64).view(-1, 1, 1)
            rest = ((1 - p) / q.clamp_min(1)) * ((k >= 1) & (k <= q))
            pattern = torch.where(k == 0, p, rest)
            pattern[:, 0, 0] = 1.0
            statistics.update(layer, pattern[None, :, :length, :length])
        statistics.end_batch()
    return statistics


def test_sink_rate_counts_heads_above_epsilon_by_layer_and_overall():
    on_first = np.array([[0.9, 0.5, 0.31, 0.1], [0.05, 0.29, 0.6, 0.0]])
    result = ProbeResult(_crafted(on_first, [10, 10, 10]))
    expected = (1 + 9 * on_first) / 10  # query 0 gives 1, queries 1..9 give p
    np.testing.assert_allclose(result.first_token_weight(), expected, rtol=1e-12)
    np.testing.assert_allclose(result.first_token_weight("layer"), expected.mean(1), rtol=1e-12)
    assert result.sink_rate() == pytest.approx(np.mean(expected > 0.3))
    np.testing.assert_allclose(result.sink_rate(by="layer"), (expected > 0.3).mean(1))
    assert result.sink_rate() == 5 / 8  # α₁ = 0.91, 0.55, 0.379, 0.19 | 0.145, 0.361, 0.64, 0.1
    np.testing.assert_array_equal(result.sink_rate(by="layer"), [3 / 4, 2 / 4])
    assert result.sink_rate(0.0) == 1.0 and result.sink_rate(0.9) == 1 / 8
    with pytest.raises(InputError, match="epsilon=1.5"):
        result.sink_rate(1.5)
    with pytest.raises(InputError, match="by="):
        result.sink_rate(by="head")


def test_intervals_are_jackknife_replicates_of_the_windows_without_each_group():
    on_first = np.array([[0.9, 0.5, 0.31, 0.1]])
    lengths = [10, 7, 12, 5]
    statistics = _crafted(on_first, lengths, interval_groups=4, keys=[0, 1, 2, 3])
    result = ProbeResult(statistics)
    found = result.first_token_weight("head", interval=0.95)
    per_window = np.array([(1 + (n - 1) * on_first) for n in lengths])  # Σ_q a[q, 0] per window: [W, 1, H]
    ids = statistics.groups.ids
    from equivariance_probe.statistics.groups import group_of

    groups = group_of(np.arange(4, dtype=np.uint64), 4)
    replicates = np.array([per_window[groups != g].sum(0) / np.sum(np.array(lengths)[groups != g]) for g in ids])
    expected = jackknife_interval(per_window.sum(0) / sum(lengths), replicates, upper=1.0, lower=0.0)
    np.testing.assert_allclose(found.low, expected.low, rtol=1e-12)
    np.testing.assert_allclose(found.high, expected.high, rtol=1e-12)
    rate = result.sink_rate(interval=0.95)
    assert rate.estimate == result.sink_rate() and 0.0 <= rate.low <= rate.estimate <= rate.high <= 1.0
    assert result.summary()["sinks"]["rate_interval"] == [rate.low, rate.high]


def test_interval_of_a_bounded_share_is_clipped_to_zero_and_one():
    clipped = jackknife_interval(0.01, [0.0, 0.02, 0.0, 0.03], upper=1.0, lower=0.0)
    assert clipped.low == 0.0 and clipped.method == CLIPPED_RANGE and "clipped to [0, 1]" in repr(clipped)


def test_every_engine_gives_the_weight_on_key_0_under_the_models_mask():
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(3, 4, 20, 8, generator=generator, dtype=torch.float64)
    key = torch.randn(3, 2, 20, 8, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([20, 13, 4])
    for window in (None, 6):
        scores = torch.matmul(query, key.repeat_interleave(2, 1).transpose(-1, -2)) * 8**-0.5
        allowed = visible_mask(20, window, torch.tensor([20]))[0]
        pattern = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        seen = (torch.arange(20).view(1, -1) < lengths.view(-1, 1))
        if window is not None:
            seen &= torch.arange(20).view(1, -1) < window
        expected = torch.where(seen.unsqueeze(1), pattern[..., 0], 0.0)  # [B, H, T]
        spec = ReductionSpec(lengths=lengths, window=window, excluded_keys=(0, 3), keep_first_key=True, block_size=5)
        torch.testing.assert_close(attention_sums_from_qk(query, key, spec)["first_key_sum"], expected, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(attention_sums_from_weights(pattern, spec)["first_key_sum"], expected, rtol=1e-12,
                                   atol=1e-15)
        bins, count = key_bins(20, 4)
        plain = {**ReductionSpec.of(spec, key_bin=bins, n_key_bins=count, log_floor=1e-6).plain()}
        remote = reduce_pattern(pattern, lengths, plain)
        torch.testing.assert_close(remote["first_key_sum"], expected.sum(0), rtol=1e-12, atol=1e-15)
        assert "first_key_sum" not in attention_sums_from_qk(query, key, ReductionSpec.of(spec, keep_first_key=False))


def test_triton_kernel_gives_the_weight_on_key_0():
    from equivariance_probe.statistics.engines import triton as fused

    if not fused.triton_available() or not (torch.cuda.is_available() or fused._interpreting()):
        pytest.skip("the Triton kernel cannot run here (no Triton, or no CUDA and TRITON_INTERPRET unset)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(2, 4, 37, 16, generator=generator).to(device)
    key = torch.randn(2, 2, 37, 16, generator=generator).to(device)
    for window in (None, 7):
        spec = ReductionSpec(lengths=torch.tensor([37, 20]), window=window, excluded_keys=(0,), keep_first_key=True,
                             log_floor=1e-2)
        reference = attention_sums_from_qk(query, key, spec)["first_key_sum"]
        got = fused.attention_sums_triton(query, key, ReductionSpec.of(spec, block_size=16))["first_key_sum"]
        torch.testing.assert_close(got, reference, rtol=2e-6, atol=1e-10)
        assert float(reference.abs().max()) > 0.05


def test_streaming_equals_merged_halves():
    model = tiny_llama()
    windows = _windows()
    # One window per batch everywhere: the model's own float32 forward pass rounds differently in other batch shapes.
    whole = EquivarianceProbe(model).run(windows, context_length=CONTEXT, batch_size=1, progress=False)
    first = EquivarianceProbe(model).run(windows[:2], context_length=CONTEXT, batch_size=1, progress=False)
    second = EquivarianceProbe(model).run(windows[2:], context_length=CONTEXT, batch_size=1, progress=False)
    np.testing.assert_allclose((first + second).first_token_weight(), whole.first_token_weight(), rtol=1e-12)


def test_result_names_the_first_token():
    tokens = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = 7
    result = EquivarianceProbe(tiny_gpt2()).run(tokens, progress=False)
    assert result.metadata["first_token"]["ids"] == {"7": 4} and "(id 7) at position 0 of every window" in result.first_token
    mixed = EquivarianceProbe(tiny_gpt2()).run(torch.arange(3, 27).view(2, 12), progress=False)
    assert "first text token of each window (2 distinct ids" in mixed.first_token
    assert mixed.summary()["sinks"]["first_token"] == mixed.first_token


def test_a_file_written_before_the_sink_sums_loads_and_says_to_run_again(tmp_path):
    result = EquivarianceProbe(tiny_gpt2()).run(_windows(), context_length=CONTEXT, batch_size=2, progress=False)
    good = result.save(tmp_path / "new.safetensors")

    edited = {}

    def strip_header(header):
        edited["header"] = header
        header["statistics"]["config"].pop("keep_first_key")
        header["summary"].pop("sinks")
        header["metadata"].pop("first_token")
        for name in ("first_key_sum", "groups/first_key_sum"):
            header["digests"].pop(name)

    def strip_tensors(tensors):
        from equivariance_probe.records.container import tensor_checksum

        tensors.pop("first_key_sum")
        tensors.pop("groups/first_key_sum")
        header = edited["header"]  # the arrays' checksum of a file that never had them
        header["checksum"] = tensor_checksum(tensors, (header["statistics"]["n_windows"], header["statistics"]["n_tokens"]))

    old = ProbeResult.load(edited_result_file(good, tmp_path / "old.safetensors", strip_header, tensors_edit=strip_tensors))
    assert not old.keeps_first_token
    assert old.query_position_r2() == pytest.approx(result.query_position_r2(), rel=1e-12)
    assert old.interval("log_fitted").low == pytest.approx(result.interval("log_fitted").low, rel=1e-12)
    for ask in (old.sink_rate, old.first_token_weight, lambda: old.sink_rate(interval=0.95)):
        with pytest.raises(NotRunError, match="run it again"):
            ask()
    from equivariance_probe.runs.tables import summary_table

    assert "not kept (run again)" in summary_table({"old": old.summary()})
    with pytest.raises(Exception, match="keep_first_key"):  # measured otherwise: the merge names the difference
        old.merge(EquivarianceProbe(tiny_gpt2()).run(_windows()[:1], context_length=CONTEXT, progress=False))
    legacy = ProbeResult.load(Path(__file__).parent / "data" / "result_format_v2.json")
    with pytest.raises(NotRunError, match="first_key_sum"):
        legacy.sink_rate()


def test_a_merge_names_the_first_token_of_both_parts():
    tokens = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = 7
    model = tiny_gpt2()
    a, b = (EquivarianceProbe(model).run(part, progress=False) for part in (tokens[:2], tokens[2:]))
    assert (a + b).metadata["first_token"]["ids"] == {"7": 4} and "(id 7) at position 0" in (a + b).first_token
    other = tokens[2:].clone()
    other[:, 0] = 8
    mixed = a + EquivarianceProbe(model).run(other, progress=False)
    assert mixed.metadata["first_token"]["ids"] == {"7": 2, "8": 2} and "at least 2 distinct ids" in mixed.first_token
