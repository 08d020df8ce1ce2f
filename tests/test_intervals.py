"""Intervals over windows: known answers of the delete-a-group jackknife.

Exactly uniform attention has intervals of width 0; a seeded simulation whose windows are drawn
from a fixed distribution covers the population value about 95 % of the time; groups do not
depend on batching, shards, resumption or saving; a result's paired difference with itself is
exactly 0; and what cannot have an interval says so by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from scipy.stats import t as student_t

from equivariance_probe import (
    AttentionStatistics,
    EquivarianceProbe,
    IncompatibleResultsError,
    InputError,
    Interval,
    IntervalUnavailableError,
    ProbeResult,
    paired_difference,
    random_init_like,
    zero_like,
)
from equivariance_probe.runs.tables import summary_table
from equivariance_probe.analyses.intervals import INTERVAL_STATISTICS
from equivariance_probe.maths.intervals import jackknife_interval, windows_for_half_width
from equivariance_probe.maths.metrics import FORMS, SCALES
from equivariance_probe.records import container, result_file
from equivariance_probe.statistics.groups import group_of

from synthetic import causal_mask, tiny_gemma3, tiny_gpt2

QPVE = [f"{scale}_{form}" for scale in SCALES for form in FORMS]


def tokens(n_docs: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (n_docs, width), generator=torch.Generator().manual_seed(seed))


# -- the maths --------------------------------------------------------------------------------
def test_jackknife_interval_follows_its_formula():
    replicates = np.array([1.0, 2.0, 4.0, 5.0])
    found = jackknife_interval(3.5, replicates, level=0.9)
    se = np.sqrt(3 / 4 * np.sum((replicates - 3.0) ** 2))
    half = student_t.ppf(0.95, 3) * se
    assert found.standard_error == pytest.approx(se, rel=1e-15)
    assert (found.low, found.high) == pytest.approx((3.5 - half, 3.5 + half), rel=1e-15)
    assert (found.level, found.n_groups, found.estimate) == (0.9, 4, 3.5)
    assert str(Interval(0.017, 0.015, 0.019, 0.95, 20, 0.001)) == "0.0170 [0.0150, 0.0190]"
    per_head = jackknife_interval(np.zeros((2, 3)), np.zeros((5, 2, 3)))
    assert per_head.low.shape == (2, 3) and np.all(per_head.width == 0)
    assert windows_for_half_width(24, 0.01, 0.005) == pytest.approx(96)


def test_fewer_than_two_groups_is_undefined_by_name():
    with pytest.raises(IntervalUnavailableError, match="at least 2 groups"):
        jackknife_interval(0.5, np.array([0.4]))
    with pytest.raises(InputError, match="confidence level"):
        jackknife_interval(0.5, np.array([0.4, 0.6]), level=1.5)
    one = EquivarianceProbe(tiny_gpt2()).run(tokens(1, 12), progress=False)
    with pytest.raises(IntervalUnavailableError, match="1 window fall into 1 non-empty interval group"):
        one.query_position_r2("log", "fitted", interval=0.95)
    summary = one.summary()
    assert "at least 2 groups" in summary["intervals"]["unavailable"]
    assert summary["head_stability"]["unavailable"]
    # tables show the number alone
    assert f"| log | fitted | {one.query_position_r2():.4f} |" in summary_table({"one": summary})


def test_groups_spread_keys_evenly_and_depend_on_the_key_alone():
    ids = group_of(np.arange(0, 1024 * 4000, 1024, dtype=np.uint64), 20)  # multiples of 1024: no mod-20 pattern
    counts = np.bincount(ids, minlength=20)
    assert counts.min() > 150 and counts.max() < 250
    assert np.array_equal(group_of([5, 7, 5], 20)[[0, 2]], group_of([5, 5], 20))


# -- known answers --------------------------------------------------------------------------------
def test_exactly_uniform_attention_gives_intervals_of_width_zero():
    """All-zero weights make every head exactly uniform: every R² is 1 in every replicate."""
    result = EquivarianceProbe(tiny_gemma3(zero=True, window=6)).run(tokens(10, 16), batch_size=3, progress=False)
    assert result.interval_groups()["occupied"] >= 5
    for statistic in QPVE:
        for by in (None, "layer", "head"):
            found = result.interval(statistic, by)
            assert np.all(np.abs(found.estimate - 1) < 1e-9), (statistic, by)
            assert np.all(found.width <= 1e-12), (statistic, by, np.max(found.width))
        for group, found in result.interval(statistic, "layer_group").items():
            assert found.width <= 1e-12, (statistic, group)
    prior = result.persistence(interval=0.95).r2_interval("prior")
    assert prior.estimate == pytest.approx(1, abs=1e-12) and prior.width <= 1e-12
    assert np.all(result.toeplitz_r2(interval=0.95, estimator="per_doc").width <= 1e-12)


def _simulated(seed: int, n_windows: int, start: int, n_positions: int = 6) -> AttentionStatistics:
    """``n_windows`` i.i.d. windows: softmax of Gaussian logits with a per-window scale and tilt."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(n_windows, 1, 1, 1, generator=generator) * 3
    tilt = torch.randn(n_windows, 1, 1, 1, generator=generator)
    logits = torch.randn(n_windows, 1, n_positions, n_positions, generator=generator, dtype=torch.float64) * scale
    logits = logits + tilt * torch.arange(n_positions, dtype=torch.float64)
    pattern = torch.softmax(logits.masked_fill(~causal_mask(n_positions), float("-inf")), -1)
    statistics = AttentionStatistics(n_layers=1, n_heads=1, n_positions=n_positions, sliding_windows=[None])
    statistics.begin_batch(torch.full((n_windows,), n_positions), fingerprints=np.arange(start, start + n_windows, dtype=np.uint64))
    statistics.update(0, pattern)
    statistics.end_batch()
    return statistics


def test_coverage_of_a_seeded_simulation_is_close_to_nominal():
    """200 studies of 20 windows each; the population value is that of all 4,000 windows together.

    The binomial standard deviation of the coverage over 200 studies is 0.015 at 95 %: three of them
    either side of 0.95 is the tolerance."""
    studies = [_simulated(seed, 20, start=seed * 20) for seed in range(200)]
    population = studies[0]
    for study in studies[1:]:
        population = population.merge(study)
    statistics = ("log_fitted", "raw_eta2", "log_prior", "toeplitz_per_doc")
    truth = {name: ProbeResult(population).interval(name).estimate for name in statistics}
    for name in statistics:
        covered = [ProbeResult(study).interval(name) for study in studies]
        coverage = np.mean([found.low <= truth[name] <= found.high for found in covered])
        assert 0.95 - 3 * 0.0154 <= coverage <= 0.95 + 3 * 0.0154, (name, coverage)


# -- the same groups however the windows arrive ------------------------------------------------
def _every_interval(result: ProbeResult) -> dict:
    return {(name, by): result.interval(name, by).to_dict() for name in INTERVAL_STATISTICS for by in (None,)}


def test_merged_shards_and_one_run_give_identical_intervals_bitwise():
    """One run whose batches are the shards adds exactly what merging the shards in order adds."""
    docs = tokens(9, 14, seed=3)
    probe = EquivarianceProbe(tiny_gpt2())
    whole = probe.run(docs, batch_size=3, progress=False)
    shards = [probe.run(docs[i : i + 3], batch_size=3, progress=False) for i in (0, 3, 6)]
    merged = shards[0] + shards[1] + shards[2]
    for name, value in whole.statistics.groups.rows.items():
        assert torch.equal(merged.statistics.groups.rows[name], value), name
    assert _every_interval(merged) == _every_interval(whole)
    # in another order the groups are the same windows, and the sums agree to float64 rounding
    reordered = shards[2] + shards[0] + shards[1]
    assert np.array_equal(reordered.statistics.groups.ids, whole.statistics.groups.ids)
    assert torch.equal(reordered.statistics.groups.rows["lengths"], whole.statistics.groups.rows["lengths"])
    for (name, by), found in _every_interval(reordered).items():
        assert found["low"] == pytest.approx(_every_interval(whole)[(name, by)]["low"], rel=1e-9, abs=1e-12)


def test_batch_size_changes_no_group():
    docs = tokens(7, 12, seed=5)
    probe = EquivarianceProbe(tiny_gpt2())
    one, three = (probe.run(docs, batch_size=size, progress=False) for size in (1, 3))
    assert np.array_equal(one.statistics.groups.ids, three.statistics.groups.ids)
    for name, value in one.statistics.groups.rows.items():
        assert torch.allclose(three.statistics.groups.rows[name], value, rtol=1e-12, atol=1e-12), name


# -- files --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def result():
    rows = [row[: 16 - i] for i, row in enumerate(tokens(7, 16, seed=2))]  # uneven lengths
    return EquivarianceProbe(tiny_gemma3(window=6)).run(rows, context_length=16, batch_size=2, progress=False)


def test_save_and_load_keep_the_group_sums_bitwise_and_only_occupied_groups(result, tmp_path):
    path = result.save(tmp_path / "r.safetensors")
    loaded = ProbeResult.load(path)
    groups, original = loaded.statistics.groups, result.statistics.groups
    assert np.array_equal(groups.ids, original.ids) and len(groups.ids) <= 7
    for name, value in original.rows.items():
        assert groups.rows[name].dtype == torch.float64 and torch.equal(groups.rows[name], value), name
    assert groups.keys == "window_fingerprint"
    assert _every_interval(loaded) == _every_interval(result)
    with safe_open(str(path), framework="np") as handle:
        assert handle.get_tensor("groups/log_sum").shape[0] == len(original.ids)
        assert handle.get_tensor("groups/index").dtype == np.int64


def test_version_3_files_without_group_sums_still_load(result, tmp_path):
    """A file of the format before interval groups: no interval_groups in its config, no group tensors."""
    plain = EquivarianceProbe(tiny_gemma3(window=6)).run(tokens(3, 16), progress=False, interval_groups=0)
    path = plain.save(tmp_path / "plain.safetensors")
    opened = container.read_container(path, result_file.RESULT_KIND)
    header = json.loads(json.dumps(opened.header))
    del header["statistics"]["config"]["interval_groups"]
    del header["summary"]["intervals"], header["summary"]["head_stability"]
    tensors = container.read_tensors(opened, opened.tensors)
    container.write_container(tmp_path / "old.safetensors", tensors, {k: v for k, v in header.items() if k != "header_checksum"})
    old = ProbeResult.load(tmp_path / "old.safetensors")
    assert old.query_position_r2() == plain.query_position_r2()
    with pytest.raises(IntervalUnavailableError, match="interval_groups=20"):
        old.query_position_r2(interval=0.95)
    assert "unavailable" in old.interval_groups()
    assert f"| log | fitted | {plain.query_position_r2():.4f} |" in summary_table({"old": old.summary()})


# -- paired differences ------------------------------------------------------------------------
def test_the_paired_difference_of_a_result_with_itself_is_exactly_zero(result):
    for name in INTERVAL_STATISTICS:
        found = paired_difference(result, result, name)
        assert (found.estimate, found.low, found.high) == (0.0, 0.0, 0.0), name
    per_head = paired_difference(result, result, "log_eta2", by="head")
    assert np.all(per_head.estimate == 0) and np.all(per_head.width == 0)


def test_paired_differences_need_the_same_windows(result):
    other = EquivarianceProbe(tiny_gemma3(window=6)).run(tokens(7, 16, seed=9), context_length=16, progress=False)
    with pytest.raises(IncompatibleResultsError, match="different windows"):
        paired_difference(result, other)
    fewer = EquivarianceProbe(tiny_gemma3(window=6)).run(tokens(7, 16, seed=9), progress=False, interval_groups=8)
    with pytest.raises(IncompatibleResultsError, match="interval groups"):
        paired_difference(other, fewer)


def test_a_paired_difference_is_narrower_than_its_parts_when_the_windows_agree():
    docs = tokens(12, 16, seed=4)
    trained = EquivarianceProbe(tiny_gemma3(window=6, seed=1)).run(docs, progress=False)
    other = EquivarianceProbe(tiny_gemma3(window=6, seed=2)).run(docs, progress=False)
    difference = paired_difference(trained, other, "log_fitted")
    assert difference.estimate == pytest.approx(trained.query_position_r2() - other.query_position_r2(), abs=1e-15)
    assert difference.n_groups == trained.interval("log_fitted").n_groups


def test_resampling_keys_share_groups_between_windowings_of_one_text():
    """A token stream packed at two lengths: keys by text region pair the two runs' groups."""
    stream = tokens(1, 96, seed=6)[0]
    probe = EquivarianceProbe(tiny_gpt2())
    short = probe.run(stream.view(8, 12), progress=False, resampling_keys=np.arange(8) // 2)   # region = 24 tokens
    long = probe.run(stream.view(4, 24), progress=False, resampling_keys=np.arange(4))
    assert short.statistics.groups.keys == "explicit" and np.array_equal(short.statistics.groups.ids, long.statistics.groups.ids)
    found = paired_difference(long, short, "log_fitted")
    assert found.n_groups == len(long.statistics.groups.ids)
    with pytest.raises(InputError, match="one key per row"):
        probe.run(stream.view(4, 24), progress=False, resampling_keys=[1, 2])
    with pytest.raises(IncompatibleResultsError, match="grouped by"):
        paired_difference(long, probe.run(stream.view(4, 24), progress=False))


# -- what has no interval, and the ranking -------------------------------------------------------
def test_what_has_no_interval_says_so_by_name(result):
    with pytest.raises(IntervalUnavailableError, match="document-averaged pattern"):
        result.toeplitz_r2("head", interval=0.95)
    with pytest.raises(IntervalUnavailableError, match="per layer, not per head"):
        result.persistence(by="head", interval=0.95)
    none = EquivarianceProbe(tiny_gpt2()).run(tokens(4, 12), progress=False, interval_groups=0)
    with pytest.raises(IntervalUnavailableError, match="interval_groups=20"):
        none.interval("log_fitted")
    with pytest.raises(InputError, match="at least 2 groups"):
        EquivarianceProbe(tiny_gpt2()).run(tokens(4, 12), progress=False, interval_groups=1)


def test_every_interval_api_returns_intervals(result):
    layers = result.query_position_r2("raw", "eta2", by="layer", interval=0.9)
    assert isinstance(layers, Interval) and layers.low.shape == (3,) and layers.level == 0.9
    groups = result.persistence(by="layer_group", interval=0.95)
    assert set(groups) == {"all", "sliding", "global"}
    assert groups["all"].r2_interval("prior").estimate == result.persistence().fits["prior"].r2
    mean = result.toeplitz_r2(None, interval=0.95, estimator="per_doc")
    assert mean.estimate == pytest.approx(result.summary()["toeplitz_r2_per_doc_mean"], rel=1e-12)
    assert np.all(np.asarray(result.interval("log_eta2", "head").low) <= result.query_position_r2("log", "eta2", by="head"))


def test_ranking_stability_counts_replicates_that_keep_a_head_on_top():
    """A uniform head (most position-bound) beside random heads: every replicate ranks it first."""
    model = tiny_gpt2(seed=0)
    with torch.no_grad():  # head 0 of layer 0: zero queries give uniform attention
        model.transformer.h[0].attn.c_attn.weight[:, :8].zero_()
        model.transformer.h[0].attn.c_attn.bias[:8].zero_()
    result = EquivarianceProbe(model).run(tokens(12, 16, seed=1), progress=False)
    ranking = result.rank_heads(top_k=1)
    assert ranking.order[0] == (0, 0) and ranking.stability[0] == 1.0
    assert ranking.to_records()[0]["in_top_k"] == 1.0
    assert np.nansum(ranking.stability) == pytest.approx(1.0)  # each replicate has one top head
    assert "no in_top_k stability" in result.rank_heads(score="prior_fit").to_text()


# -- the command line --------------------------------------------------------------------------
def test_run_prints_every_number_with_its_interval_and_the_differences(tiny_model_folder, tmp_path, capsys):
    from equivariance_probe.cli import main
    from synthetic import write_text_corpus

    corpus = write_text_corpus(tmp_path / "corpus", n_docs=6, words=30)
    arguments = ["run", "--model", tiny_model_folder("gpt2"), "--corpus", corpus, "--n-docs", "6", "--context-length", "16",
                 "--baselines", "random_init,zero", "--no-progress", "--no-figures", "--sample-size", "0"]
    assert main([*arguments, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    trained = ProbeResult.load(tmp_path / "out" / "results.safetensors")
    zero = ProbeResult.load(tmp_path / "out" / "baseline_zero.safetensors")
    assert f"| log | fitted | {trained.query_position_r2('log', 'fitted', interval=0.95)} |" in printed
    assert "| scale | form | trained − random_init | trained − zero |" in printed
    assert f"| {paired_difference(trained, zero, 'log_fitted')} |" in printed
    assert "±0.005 needs about" in printed
    assert "| scale | form | trained − random_init" in (tmp_path / "out" / "summary.md").read_text()
    assert main([*arguments, "--out", str(tmp_path / "none"), "--interval-groups", "0"]) == 0
    printed = capsys.readouterr().out
    assert "no interval" in printed and f"| log | fitted | {trained.query_position_r2():.4f} |" in printed
    assert main([*arguments, "--out", str(tmp_path / "bad"), "--interval-groups", "1"]) == 2
    assert "--interval-groups 20" in capsys.readouterr().err


def test_an_r2_interval_never_passes_one_and_says_it_was_clipped():
    from equivariance_probe.maths.intervals import CLIPPED, PLAIN, jackknife_interval

    replicates = np.array([0.995, 0.97, 0.999, 0.96, 0.99, 0.985, 0.93, 0.998])
    plain = jackknife_interval(0.9908, replicates)
    assert plain.high > 1 and plain.method == PLAIN  # the symmetric interval runs past the bound
    bounded = jackknife_interval(0.9908, replicates, upper=1.0)
    assert bounded.high == 1.0 and bounded.low == plain.low and bounded.method == CLIPPED
    assert bounded.standard_error == plain.standard_error and bounded.half_width == pytest.approx(plain.half_width)
    assert "clipped at R² = 1" in repr(bounded) and bounded.to_dict()["method"] == CLIPPED
    inside = jackknife_interval(0.05, np.array([0.04, 0.06, 0.05, 0.055]), upper=1.0)
    assert inside.method == PLAIN and inside.high < 1  # nothing to clip: the plain interval


def test_no_r2_interval_of_a_result_exceeds_one():
    """A random model's uniform-prior fit has R² near 1 on every window: a symmetric interval passes 1."""
    from equivariance_probe.analyses.intervals import BY_CHOICES
    from equivariance_probe.maths.intervals import CLIPPED

    from synthetic import tiny_llama

    tokens = torch.randint(3, 97, (6, 24), generator=torch.Generator().manual_seed(1))
    result = EquivarianceProbe(tiny_llama(1)).run(tokens, progress=False, interval_groups=4)
    methods = []
    for statistic in INTERVAL_STATISTICS:
        for by in BY_CHOICES[statistic]:
            found = result.interval(statistic, by)
            for interval in found.values() if isinstance(found, dict) else [found]:
                assert np.all(np.asarray(interval.high) <= 1.0), (statistic, by)
                methods.append(interval.method)
    assert CLIPPED in methods  # some interval did reach past 1 and was clipped, not just never near it
    bounds = result.summary()["intervals"]["persistence_fit_r2"]["prior"]
    assert bounds[1] <= 1.0 and "clipped at 1" in result.summary()["intervals"]["method"]


def test_an_array_valued_interval_prints_its_numbers_one_entry_a_line():
    estimate = np.array([[0.1, 0.2], [0.3, 0.4]])
    interval = Interval(estimate, estimate - 0.05, estimate + 0.05, 0.95, 6, np.full((2, 2), 0.02))
    text = repr(interval)
    assert text.startswith("Interval(of shape (2, 2), 95% over 6 groups of windows:")
    for index in np.ndindex(2, 2):
        value = estimate[index]
        assert f"[{index[0]}, {index[1]}] {value:.4f} [{value - 0.05:.4f}, {value + 0.05:.4f}]" in text
    long = np.arange(30, dtype=float)
    many = Interval(long, long - 1, long + 1, 0.95, 4, np.ones(30))
    lines = str(many).splitlines()
    assert "[0] 0.0000 [-1.0000, 1.0000]" in lines[1] and "[29] 29.0000 [28.0000, 30.0000]" in lines[-1]
    assert "... 18 more ..." in str(many) and len(lines) == 1 + 12 + 1


def test_an_estimate_without_an_interval_prints_as_the_estimate_alone():
    from equivariance_probe.maths.intervals import UNAVAILABLE, estimate_alone

    alone = estimate_alone(0.0123, level=0.95, n_groups=1)
    assert str(alone) == "0.0123 (no interval)" and alone.method == UNAVAILABLE and np.isnan(alone.low)
    assert "1 group: an interval needs at least 2" in repr(alone)
    array = estimate_alone(np.array([0.5, 0.25]), level=0.95, n_groups=1)
    assert "[1] 0.2500 [n/a, n/a]" in str(array)


def test_a_shift_result_s_dictionaries_hold_floats_and_one_segment_gives_differences_without_intervals():
    from test_shift import design
    from test_shift import run as shift_run

    segments, contexts = design(n_segments=1)
    model = tiny_gemma3()
    trained, baseline = (shift_run(network, segments, contexts) for network in (model, random_init_like(model, seed=1)))
    for numbers in (trained.share(by="layer_group"), trained.offset_rms(by="layer_group"), trained.decomposition(),
                    trained.decomposition(by="layer_group")["all"]):
        assert all(type(value) is float for value in numbers.values()), numbers
    assert type(trained.divergence()) is float and "array(" not in repr(trained.share(by="layer_group"))
    difference = trained.paired_difference(baseline, "centred_logits", "offset")
    expected = trained.share("centred_logits", "offset") - baseline.share("centred_logits", "offset")
    assert difference.estimate == pytest.approx(expected, abs=1e-15) and np.isnan(difference.low)
    assert str(difference).endswith("(no interval)") and difference.n_groups == 1
    by_layer = trained.paired_difference(baseline, "residual", "offset", by="layer")
    np.testing.assert_allclose(by_layer.estimate, trained.share("residual", by="layer")
                               - baseline.share("residual", by="layer"), atol=1e-15)
    groups = trained.paired_difference(baseline, by="layer_group")
    assert set(groups) == set(trained.layer_groups()) and all(np.isnan(value.high) for value in groups.values())
