"""Attention sinks (Gu et al., ICLR 2025): the first token's weight α₁ per head and the sink rate, against
known answers: the model's own weights (``output_attentions=True``), the closed form of all-zero weights,
crafted patterns, every engine, and files written before the sums existed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, NotRunError, ProbeResult, SupersededSumsError, window_fingerprint
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


def _direct_first_key(model, windows) -> tuple[np.ndarray, np.ndarray]:
    """``Σ_windows a[l, h, q, 0]`` from the model's own eager weights, ``[L, H, T]``, and each window's
    ``α₁(w) = (1/T_w)·Σ_q a[l, h, q, 0]``, ``[W, L, H]``."""
    model.set_attn_implementation("eager")
    total, per_window = None, []
    with torch.no_grad():
        for window in windows:
            attentions = model(window[None], output_attentions=True).attentions
            first = torch.stack([a[0, :, :, 0] for a in attentions]).double().numpy()  # [L, H, n]
            per_window.append(first.mean(-1))
            padded = np.zeros((*first.shape[:2], CONTEXT))
            padded[..., : first.shape[-1]] = first
            total = padded if total is None else total + padded
    return total, np.stack(per_window)


def _by_fingerprint(statistics: AttentionStatistics, windows) -> np.ndarray:
    """The statistics' per-window ``α₁ [W, L, H]`` in the order of ``windows`` (found by their fingerprints)."""
    kept = statistics.window_sinks
    rows = [int(np.flatnonzero(kept.keys == np.uint64(window_fingerprint(w.tolist())))[0]) for w in windows]
    return kept.alpha[rows]


@pytest.mark.parametrize("source", ["weights", "recompute"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_first_token_weight_is_the_models_own_weight_on_key_0_excluded_or_not(name, source):
    model = BUILDERS[name]()
    expected, per_window = _direct_first_key(model, _windows())
    tokens = sum(len(w) for w in _windows())
    for excluded in ([0], []):
        result = EquivarianceProbe(model, pattern_source=source).run(
            _windows(), context_length=CONTEXT, batch_size=2, exclude_keys=excluded, progress=False)
        got = result.statistics.arrays["first_key_sum"].numpy()
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(result.first_token_weight(), expected.sum(-1) / tokens, rtol=2e-6)
        np.testing.assert_allclose(_by_fingerprint(result.statistics, _windows()), per_window, rtol=2e-6, atol=1e-7)
        assert result.sink_rate(0.3) == np.mean(per_window > 0.3)  # no α₁ within float32 rounding of 0.3 here
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
    # Every window alike: each window's α₁ is the pooled one, so the per-window and pooled rates agree.
    assert result.pooled_sink_rate() == result.sink_rate()
    np.testing.assert_array_equal(result.sink_rate(by="head"), expected > 0.3)
    with pytest.raises(InputError, match="by="):
        result.pooled_sink_rate(by="head")


def _windows_with_alpha(alpha: np.ndarray, length: int, interval_groups: int = 0, first_window: int = 0,
                        ) -> AttentionStatistics:
    """Statistics of windows of ``length`` tokens whose head ``(l, h)`` has ``α₁ = alpha[w, l, h]`` exactly in window
    ``w``: query 0 puts 1 on key 0, every later query ``p = (T·α₁ - 1)/(T - 1)`` (the rest uniformly on keys
    ``1..q``). Window ``w`` has the fingerprint ``first_window + w``."""
    n_windows, n_layers, n_heads = alpha.shape
    statistics = AttentionStatistics(n_layers=n_layers, n_heads=n_heads, n_positions=length,
                                     sliding_windows=[None] * n_layers, interval_groups=interval_groups)
    q = torch.arange(length).view(-1, 1)
    k = torch.arange(length).view(1, -1)
    for w in range(n_windows):
        statistics.begin_batch(torch.tensor([length]), fingerprints=[first_window + w])
        for layer in range(n_layers):
            p = torch.tensor((length * alpha[w, layer] - 1) / (length - 1), dtype=torch.float64).view(-1, 1, 1)
            pattern = torch.where(k == 0, p, ((1 - p) / q.clamp_min(1)) * ((k >= 1) & (k <= q)))
            pattern[:, 0, 0] = 1.0
            statistics.update(layer, pattern[None])
        statistics.end_batch()
    return statistics


#: One layer, two heads, eight windows: head 0's α₁ is 0.2 in half of the windows and 0.5 in the other half
#: (window-averaged 0.35, above ε = 0.3); head 1's is 0.1 and 0.45 (window-averaged 0.275, below it).
STRADDLING = np.array([[[0.2, 0.1]], [[0.5, 0.45]]] * 4)


def test_the_sink_rate_thresholds_each_window_and_the_pooled_rate_the_average():
    result = ProbeResult(_windows_with_alpha(STRADDLING, 10))
    np.testing.assert_allclose(result.statistics.window_sinks.alpha, STRADDLING[np.argsort(np.arange(8))], rtol=1e-12)
    np.testing.assert_allclose(result.first_token_weight(), [[0.35, 0.275]], rtol=1e-12)
    assert result.sink_rate(0.3) == 0.5  # each head is a sink in half of the windows
    np.testing.assert_array_equal(result.sink_rate(0.3, by="head"), [[0.5, 0.5]])
    np.testing.assert_array_equal(result.sink_rate(0.3, by="layer"), [0.5])
    # Pooled, head 0 counts in every window and head 1 in none: the other side of ε from the per-window share.
    assert result.pooled_sink_rate(0.3) == 0.5 and result.pooled_sink_rate(0.3, by="layer").tolist() == [0.5]
    one = ProbeResult(_windows_with_alpha(STRADDLING[:, :, :1], 10))
    assert one.sink_rate(0.3) == 0.5 and one.pooled_sink_rate(0.3) == 1.0
    other = ProbeResult(_windows_with_alpha(STRADDLING[:, :, 1:], 10))
    assert other.sink_rate(0.3) == 0.5 and other.pooled_sink_rate(0.3) == 0.0
    assert result.sink_rate(0.15) == 0.75 and result.sink_rate(0.05) == 1.0 and result.sink_rate(0.5) == 0.0
    sinks = result.summary()["sinks"]
    assert (sinks["epsilon"], sinks["rate"], sinks["pooled_rate"]) == (0.3, 0.5, 0.5)
    assert result.summary(epsilon=0.15)["sinks"]["rate"] == 0.75
    from equivariance_probe.runs.tables import summary_table

    table = summary_table({"one": one.summary(), "other": other.summary()})
    assert "| attention sinks | sink rate: share of (window, head) with α₁ > 0.3 (Gu et al.) | 0.5000 | 0.5000 |" in table
    assert "| attention sinks | pooled sink rate: share of heads with window-averaged α₁ > 0.3 | 1.0000 | 0.0000 |" in table


def test_the_per_window_rate_has_the_jackknife_interval_over_window_groups():
    from equivariance_probe.statistics.groups import group_of

    alpha = np.random.default_rng(0).uniform(0.1, 0.6, (24, 2, 3))
    statistics = _windows_with_alpha(alpha, 8, interval_groups=5)
    result = ProbeResult(statistics)
    groups = group_of(np.arange(24, dtype=np.uint64), 5)  # each window's group, from its fingerprint
    ids = statistics.groups.ids
    assert len(ids) >= 2
    indicator = alpha > 0.3
    statistic = {None: lambda x: x.mean(), "layer": lambda x: x.mean((0, 2)), "head": lambda x: x.mean(0)}
    for by, of in statistic.items():
        replicates = np.array([of(indicator[groups != g]) for g in ids])
        expected = jackknife_interval(of(indicator), replicates, upper=1.0, lower=0.0)
        found = result.sink_rate(0.3, by=by, interval=0.95)
        np.testing.assert_allclose(found.estimate, expected.estimate, rtol=1e-12)
        np.testing.assert_allclose(found.low, expected.low, rtol=1e-12)
        np.testing.assert_allclose(found.high, expected.high, rtol=1e-12)
    assert result.summary()["sinks"]["rate_interval"] == pytest.approx(
        [result.sink_rate(interval=0.95).low, result.sink_rate(interval=0.95).high])


def test_per_window_weights_stream_and_merge_as_one_run_and_refuse_a_window_twice(tmp_path):
    alpha = np.random.default_rng(1).uniform(0.1, 0.6, (9, 2, 2))
    whole = _windows_with_alpha(alpha, 6, interval_groups=3)
    first = _windows_with_alpha(alpha[:4], 6, interval_groups=3)
    second = _windows_with_alpha(alpha[4:], 6, interval_groups=3, first_window=4)
    for merged in (first + second, second + first):
        np.testing.assert_array_equal(merged.window_sinks.keys, whole.window_sinks.keys)
        np.testing.assert_allclose(merged.window_sinks.alpha, whole.window_sinks.alpha, rtol=1e-15)
        np.testing.assert_allclose(merged.window_sinks.alpha, alpha, rtol=1e-12)  # keys 0..8: the windows' order
    merged = ProbeResult(first + second)
    assert merged.sink_rate(interval=0.95).low == ProbeResult(whole).sink_rate(interval=0.95).low
    with pytest.raises(Exception, match="already in the result"):
        first.merge(_windows_with_alpha(alpha[3:5], 6, interval_groups=3, first_window=3))
    loaded = ProbeResult.load(ProbeResult(whole).save(tmp_path / "whole.safetensors"))
    np.testing.assert_array_equal(loaded.statistics.window_sinks.alpha, whole.window_sinks.alpha)
    assert loaded.sink_rate(0.25, by="head").tolist() == ProbeResult(whole).sink_rate(0.25, by="head").tolist()


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
        # and each window's own sum over its queries, for the per-window sink rate
        torch.testing.assert_close(remote["first_key_window"], expected.sum(-1), rtol=1e-12, atol=1e-15)
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


def _without_sinks(header):
    header["summary"].pop("sinks")
    header["metadata"].pop("first_token")


def _written_before(good: Path, out: Path, *tensors: str, keys: tuple[str, ...], header_edit=None) -> Path:
    """A copy of the result file ``good`` as a version without the tensors ``tensors`` and the configuration's
    ``keys`` wrote it (and every part of the per-window first-token weights, which came last)."""
    from equivariance_probe.records.container import tensor_checksum

    removed = (*tensors, "window_sinks/alpha", "window_sinks/keys")
    edited = {}

    def strip_header(header):
        edited["header"] = header
        for key in (*keys, "keep_window_sinks"):
            header["statistics"]["config"].pop(key)
        for name in removed:
            header["digests"].pop(name)
        if header_edit is not None:
            header_edit(header)

    def strip_tensors(arrays):
        for name in removed:
            arrays.pop(name)
        header = edited["header"]  # the arrays' checksum of a file that never had them
        header["checksum"] = tensor_checksum(arrays, (header["statistics"]["n_windows"], header["statistics"]["n_tokens"]))

    return edited_result_file(good, out, strip_header, tensors_edit=strip_tensors)


def test_a_file_written_before_the_per_window_weights_gives_the_pooled_rate_and_says_to_run_again(tmp_path):
    alpha = np.array([[[0.2, 0.1]], [[0.5, 0.45]]] * 6)
    result = ProbeResult(_windows_with_alpha(alpha, 10, interval_groups=3))
    good = result.save(tmp_path / "new.safetensors")

    def old_summary(header):  # what such a version stored: the pooled rate under the name "rate"
        sinks = header["summary"]["sinks"]
        for name in ("rate", "rate_interval", "rate_by_layer"):
            sinks[name] = sinks.pop(f"pooled_{name}")

    old = ProbeResult.load(_written_before(good, tmp_path / "old.safetensors", keys=(), header_edit=old_summary))
    assert old.keeps_first_token and old.statistics.window_sinks is None
    for ask in (old.sink_rate, lambda: old.sink_rate(by="head"), lambda: old.sink_rate(interval=0.95)):
        with pytest.raises(SupersededSumsError, match="run it again"):
            ask()
    assert old.pooled_sink_rate() == result.pooled_sink_rate() == 0.5
    assert old.pooled_sink_rate(interval=0.95).low == result.pooled_sink_rate(interval=0.95).low
    stored = old.summary()["sinks"]
    assert stored["rate"] is None and "run it again" in stored["rate_unavailable"] and stored["pooled_rate"] == 0.5
    computed = old.summary(epsilon=0.2)["sinks"]  # another threshold: from the arrays
    assert computed["rate"] is None and computed["pooled_rate"] == 1.0 and "run it again" in computed["rate_unavailable"]
    from equivariance_probe.runs.tables import summary_table

    table = summary_table({"old": old.summary(), "new": result.summary()})
    assert "(Gu et al.) | not kept (run again) | 0.5000 [" in table
    with pytest.raises(Exception, match="keep_window_sinks"):  # measured otherwise: the merge names the difference
        old.merge(ProbeResult(_windows_with_alpha(alpha, 10, interval_groups=3, first_window=100)))
    from equivariance_probe.display.report import sinks_section

    assert "not kept (run again)" in str(sinks_section(old).html)


def test_a_file_written_before_the_sink_sums_loads_and_says_to_run_again(tmp_path):
    result = EquivarianceProbe(tiny_gpt2()).run(_windows(), context_length=CONTEXT, batch_size=2, progress=False)
    good = result.save(tmp_path / "new.safetensors")

    old = ProbeResult.load(_written_before(good, tmp_path / "old.safetensors", "first_key_sum", "groups/first_key_sum",
                                           keys=("keep_first_key",), header_edit=_without_sinks))
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


@pytest.mark.parametrize("damage", ["a window short", "missing", "keys as float"])
def test_a_file_whose_per_window_weights_do_not_fit_its_windows_is_refused_by_name(tmp_path, damage):
    from equivariance_probe.errors import ResultFileError

    good = ProbeResult(_windows_with_alpha(STRADDLING, 10)).save(tmp_path / "good.safetensors")

    def edit(tensors):
        if damage == "a window short":
            tensors["window_sinks/alpha"] = tensors["window_sinks/alpha"][:-1]
        elif damage == "missing":
            tensors.pop("window_sinks/alpha")
        else:
            tensors["window_sinks/keys"] = tensors["window_sinks/keys"].astype(np.float64)

    bad = edited_result_file(good, tmp_path / "bad.safetensors", lambda header: None, tensors_edit=edit)
    with pytest.raises(ResultFileError, match="per-window first-token weights 'window_sinks/"):
        ProbeResult.load(bad)
