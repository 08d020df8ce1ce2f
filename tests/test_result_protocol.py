"""Every result speaks one language: the Result protocol, one missing-value convention, one error for an empty
result, paired differences as methods, ``by=`` as the split axis, and the older spellings warning once."""

import json
import math

import numpy as np
import pytest
import torch

from synthetic import tiny_bert, tiny_gpt2

from equivariance_probe import (
    EmptyResultError,
    EquivarianceProbe,
    InputError,
    MergeableResult,
    NotRunError,
    PositionalStudy,
    ProbeResult,
    Result,
    ShiftResult,
    UndefinedStatisticError,
    paired_difference,
)
from equivariance_probe.analyses.positional import gram_toeplitz
from equivariance_probe.statistics import AttentionStatistics
from equivariance_probe.statistics.shift import ShiftStatistics

OFFSETS = [0, 7, 30]


def windows(seed):
    return torch.randint(5, 90, (8, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def probe_results():
    """A small causal model on the same windows, trained and a second seed (the paired baseline), and an encoder."""
    options = {"context_length": 16, "batch_size": 4, "interval_groups": 4, "keep_pattern": True}
    trained = EquivarianceProbe(tiny_gpt2(seed=0)).run(windows(0), **options)
    other = EquivarianceProbe(tiny_gpt2(seed=1)).run(windows(0), **options)
    encoder = EquivarianceProbe(tiny_bert()).run(windows(0), **options)
    return trained, other, encoder


@pytest.fixture(scope="module")
def shift_results():
    generator = torch.Generator().manual_seed(0)
    segments = [torch.randint(3, 97, (10,), generator=generator).tolist() for _ in range(4)]
    contexts = [torch.randint(3, 97, (30,), generator=generator).tolist() for _ in range(3)]
    options = {"offsets": OFFSETS, "segment_length": 10, "progress": False, "interval_groups": 4}
    trained = EquivarianceProbe(tiny_gpt2(seed=0).to(torch.float64)).shift(segments, contexts, **options)
    other = EquivarianceProbe(tiny_gpt2(seed=1).to(torch.float64)).shift(segments, contexts, **options)
    return trained, other


@pytest.fixture(scope="module")
def positional():
    """A positional study whose Gram matrix is exactly Toeplitz (R² = 1) and one analysis it skipped."""
    i = np.arange(12)
    embeddings = np.stack([np.cos(i * w) for w in (0.3, 0.7)] + [np.sin(i * w) for w in (0.3, 0.7)], axis=1)
    return PositionalStudy(parts={"gram": gram_toeplitz(embeddings)}, skipped={"tisa": "needs a causal model"},
                           metadata={"model": "made-up", "settings": {"n_docs": 3}})


def test_every_result_satisfies_the_protocol(probe_results, shift_results, positional):
    for result in (probe_results[0], shift_results[0], positional):
        assert isinstance(result, Result)
        assert isinstance(result.model_name, str) and result.complete is True
        assert isinstance(result.undefined, dict)
        assert isinstance(result.table(0.9), str) and result.to_rows(0.9)
        json.dumps(result.summary(0.9), allow_nan=False)  # plain JSON values: None, never NaN
    for result in probe_results[0], shift_results[0]:
        assert isinstance(result, MergeableResult)
        assert result.layer_groups() == {"all": (0, 1)}
    assert not isinstance(positional, MergeableResult)  # analyses of one model do not add up
    assert probe_results[0].config["n_layers"] == 2 and shift_results[0].config.n_layers == 2
    assert positional.config == {"n_docs": 3}
    assert positional.undefined == {"tisa": "needs a causal model"}
    assert positional.summary()["gram"]["r2_whole"] == pytest.approx(1.0, abs=1e-12)


def test_undefined_numbers_are_none_in_every_summary_and_nan_on_request(probe_results):
    encoder = probe_results[2]
    assert set(encoder.undefined) == {"query_position_r2.prior", "query_position_r2.fitted"}
    summary = encoder.summary()
    assert summary["query_position_r2"]["log"]["prior"] is None
    assert summary["query_position_r2"]["log"]["eta2"] == pytest.approx(encoder.query_position_r2("log", "eta2"))
    assert math.isnan(encoder.summary(missing=math.nan)["query_position_r2"]["log"]["prior"])
    assert "undefined" in encoder.table()
    # A number of a study that has none: NaN in the analysis, None in the summary, NaN on request.
    flat = PositionalStudy(parts={"gram": gram_toeplitz(np.ones((6, 3)))}, metadata={"model": "flat"})
    assert math.isnan(flat.parts["gram"].r2_whole)
    assert flat.summary()["gram"]["r2_whole"] is None
    assert math.isnan(flat.summary(missing=math.nan)["gram"]["r2_whole"])
    assert "nan" in flat.table()  # the table reads the analysis' own numbers


def test_a_loaded_result_gives_the_stored_summary_with_the_same_convention(probe_results, tmp_path):
    encoder = probe_results[2]
    loaded = ProbeResult.load(encoder.save(tmp_path / "encoder.safetensors"))
    assert loaded.summary() == encoder.summary()
    assert math.isnan(loaded.summary(missing=math.nan)["query_position_r2"]["raw"]["fitted"])
    assert loaded.table() == encoder.table()


def test_undefined_is_a_property_holding_a_plain_dict(probe_results, shift_results):
    encoder = probe_results[2]
    assert type(encoder.undefined) is dict and type(shift_results[0].undefined) is dict
    assert set(encoder.undefined) == {"query_position_r2.prior", "query_position_r2.fitted"}
    with pytest.raises(TypeError, match="not callable"):
        encoder.undefined()


def test_an_empty_result_raises_one_error_that_old_except_clauses_still_catch(shift_results):
    empty_probe = ProbeResult(AttentionStatistics(n_layers=1, n_heads=1, n_positions=8, sliding_windows=[None]))
    empty_shift = ShiftResult(ShiftStatistics(shift_results[0].config))
    for call in (lambda: empty_probe.query_position_r2(), lambda: empty_shift.share()):
        with pytest.raises(EmptyResultError, match="run"):
            call()
        with pytest.raises(NotRunError):
            call()
        with pytest.raises(UndefinedStatisticError):  # what a shift result raised for it before
            call()
    assert empty_probe.summary() == {"n_windows": 0} and empty_shift.summary() == {"n_segments": 0}


def test_paired_difference_is_a_method_and_the_function_is_its_alias(probe_results, shift_results):
    trained, other, _ = probe_results
    method = trained.paired_difference(other, "log_eta2", by="layer")
    function = paired_difference(trained, other, "log_eta2", by="layer")
    np.testing.assert_array_equal(method.estimate, function.estimate)
    np.testing.assert_array_equal(method.low, function.low)
    np.testing.assert_array_equal(method.estimate, trained.query_position_r2("log", "eta2", by="layer")
                                  - other.query_position_r2("log", "eta2", by="layer"))
    shift, shift_other = shift_results
    difference = shift.paired_difference(shift_other, "centred_logits", "offset", by="total")
    assert difference.estimate == pytest.approx(shift.share("centred_logits", "offset")
                                                - shift_other.share("centred_logits", "offset"), abs=1e-15)


def test_total_is_the_synonym_of_none_for_every_split(probe_results, shift_results):
    trained = probe_results[0]
    assert trained.floored("total") == trained.floored(None)
    assert trained.persistence("total").r2("power") == trained.persistence(None).r2("power")
    assert trained.sink_rate(by="total") == trained.sink_rate()
    assert trained.interval("log_fitted", "total").estimate == trained.interval("log_fitted").estimate
    assert shift_results[0].share(by="total") == shift_results[0].share(by=None)


def test_by_is_the_split_axis_and_never_names_an_estimator_or_a_ranking_score(probe_results):
    trained = probe_results[0]
    per_head = trained.toeplitz_r2(estimator="per_doc")
    with pytest.raises(InputError, match="head_per_doc"):
        trained.toeplitz_r2(by="head_per_doc")
    assert trained.toeplitz_r2(None, estimator="per_doc") == pytest.approx(float(per_head.mean()), rel=1e-12)
    with pytest.raises(TypeError, match="'by'"):
        trained.rank_heads(by="toeplitz", top_k=None)
    assert trained.rank_heads("toeplitz", top_k=None).key == "toeplitz"
    with pytest.raises(ValueError, match="estimator"):
        trained.toeplitz_r2(estimator="per_window")


def test_merge_takes_allow_duplicate_windows_on_both_results(probe_results, shift_results):
    trained = probe_results[0]
    again = EquivarianceProbe(tiny_gpt2(seed=0)).run(windows(0), context_length=16, batch_size=4, interval_groups=4,
                                                       keep_pattern=True)  # another run of the same windows
    shift = shift_results[0]
    for result, repeat in (trained, again), (shift, shift):
        with pytest.raises(ValueError, match="twice"):
            result + repeat
        doubled = result.merge(repeat, allow_duplicate_windows=True)
        assert type(doubled) is type(result) and doubled.complete
    # Every sum doubles, so every ratio of sums is the same number.
    doubled = trained.merge(again, allow_duplicate_windows=True)
    assert doubled.n_windows == 2 * trained.n_windows
    assert doubled.query_position_r2() == pytest.approx(trained.query_position_r2(), rel=1e-12)
    doubled = shift.merge(shift, allow_duplicate_windows=True)
    assert doubled.n_segments == 2 * shift.n_segments
    assert doubled.share("centred_logits", "offset") == pytest.approx(shift.share("centred_logits", "offset"), rel=1e-12)
