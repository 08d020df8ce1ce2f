"""Values a user types into the shift test go through the probe's validators: nothing is silently coerced (2.5 is
not run as 2, True not as 1, -3 groups not as one), token ids are checked against the model's vocabulary before
any forward pass, and every refusal names the value and the fix. Merges and paired differences that are refused
name what differs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from synthetic import tiny_gemma3
from test_shift import M, OFFSETS, design

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.errors import IncompatibleResultsError, InputError
from equivariance_probe.statistics.shift import ShiftConfig, ShiftStatistics


@pytest.fixture(scope="module")
def probe():
    return EquivarianceProbe(tiny_gemma3())


@pytest.fixture(autouse=True)
def no_forward_pass(probe, monkeypatch):
    """Every refusal here comes before the model runs: a forward pass fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model ran before the input was checked")

    monkeypatch.setattr(probe.adapter, "check_segment_recompute", refuse)


def shift(probe, segments=None, contexts=None, **options):
    if segments is None:
        segments, contexts = design()
    return probe.shift(segments, contexts, **{"offsets": OFFSETS, "segment_length": M, "progress": False, **options})


@pytest.mark.parametrize("offsets, shown", [
    ([0, 2.5, 30], "2.5"),
    ([0, True, 30], "True"),
    ([0, "7", 30], "'7'"),
    ([0, math.nan, 30], "nan"),
    ([0, -7, 30], "-7"),
    ("0,7,30", "'0,7,30'"),
])
def test_offsets_are_integers_as_typed_never_coerced(probe, offsets, shown):
    with pytest.raises(InputError, match="offsets") as caught:
        shift(probe, offsets=offsets)
    assert shown in str(caught.value) and "offsets=[0, 256, 512]" in str(caught.value)


@pytest.mark.parametrize("groups", [-3, 2.5, "4", True, None])
def test_interval_groups_is_a_non_negative_integer(probe, groups):
    with pytest.raises(InputError, match=rf"interval_groups must be a non-negative integer.*{groups!r}"):
        shift(probe, interval_groups=groups)


@pytest.mark.parametrize("where", ["segments", "contexts"])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_forward_pass(probe, where):
    segments, contexts = design()
    vocab = probe.adapter.vocab_size
    (segments if where == "segments" else contexts)[1][3] = vocab + 5
    with pytest.raises(InputError, match=rf"{where}' token ids must lie in 0..{vocab - 1}.*{vocab + 5}"):
        shift(probe, segments, contexts)
    (segments if where == "segments" else contexts)[1][3] = -1
    with pytest.raises(InputError, match="must lie in 0.."):
        shift(probe, segments, contexts)


def test_float_tensors_of_ids_are_refused_not_truncated(probe):
    segments, contexts = design()
    floats = [torch.tensor(s, dtype=torch.float32) + 0.5 for s in segments]
    with pytest.raises(InputError, match="float32 tensor.*truncated"):
        shift(probe, floats, contexts)


def test_predictions_and_batch_size_are_not_coerced(probe):
    with pytest.raises(InputError, match="predictions must be True, False or None.*'no'"):
        shift(probe, predictions="no")
    with pytest.raises(InputError, match="batch_size must be a positive integer.*2.0"):
        shift(probe, batch_size=2.0)


def test_one_string_is_not_taken_as_a_list_of_one_character_segments(probe):
    _, contexts = design()
    with pytest.raises(InputError, match="segments must be a list of texts"):
        shift(probe, "a whole text given where a list was meant", contexts)


def test_the_probe_s_run_checks_token_ids_against_the_vocabulary_too(probe):
    tokens = torch.randint(3, 97, (2, 16))
    tokens[0, 4] = probe.adapter.vocab_size
    with pytest.raises(InputError, match="must lie in 0.."):
        probe.run(tokens, progress=False)


# -- refusals that name what differs -------------------------------------------------------------------------------
def _result(offsets=(0, 7, 30), mode="text", model="model-a", weights="a" * 64, fingerprints=(1, 2)):
    config = ShiftConfig(n_layers=1, n_heads=1, offsets=offsets, n_contexts=2 if mode == "text" else 1,
                         segment_length=4, mode=mode, interval_groups=2, sliding_windows=(None,), hidden_size=4)
    statistics = ShiftStatistics(config)
    statistics.segment_fingerprints = np.asarray(fingerprints, dtype=np.uint64)
    return ShiftResult(statistics, {"model": {"name": model, "weights_sha256": weights}, "contexts_sha256": "c" * 64})


def test_a_refused_shift_merge_names_the_models_the_modes_and_the_offsets():
    with pytest.raises(IncompatibleResultsError) as caught:
        _result().merge(_result(offsets=(0, 8, 30), mode="position_ids", model="model-b", weights="b" * 64,
                                fingerprints=(3,)))
    message = str(caught.value)
    assert "'model-a'" in message and "'model-b'" in message
    assert "mode: 'text' vs 'position_ids'" in message
    assert "offsets: [0, 7, 30] vs [0, 8, 30]" in message


def test_a_refused_paired_difference_names_what_differs():
    with pytest.raises(IncompatibleResultsError, match=r"offsets: \[0, 7, 30\] vs \[0, 8, 30\].*segments: 2 vs 1"):
        _result().paired_difference(_result(offsets=(0, 8, 30), fingerprints=(1,)))


def test_an_option_the_model_s_adapter_does_not_take_is_refused_by_name():
    with pytest.raises(InputError, match=r"HuggingFaceAdapter takes no option 'attn_implementation'.*\['pattern_source'\]"):
        EquivarianceProbe(tiny_gemma3(), attn_implementation="eager")


@pytest.mark.parametrize("option, value, words", [
    ("exclude_keys", ["0"], ["exclude_keys", "'0'"]),
    ("exclude_keys", [1.5], ["exclude_keys", "1.5"]),
    ("exclude_keys", "0", ["exclude_keys must be a list"]),
    ("sample_size", 2.5, ["sample_size", "2.5"]),
    ("log_floor", "1e-6", ["log_floor", "'1e-6'"]),
    ("log_floor", math.inf, ["log_floor", "inf"]),
])
def test_the_probe_s_run_takes_its_options_as_typed(probe, option, value, words):
    tokens = torch.randint(3, 97, (2, 16))
    with pytest.raises(InputError) as caught:
        probe.run(tokens, progress=False, **{option: value})
    for word in words:
        assert word in str(caught.value)
