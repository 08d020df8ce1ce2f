"""Crafted and damaged files end in a named ResultFileError (one line and exit status 2 at the command line),
never in a bare exception from deep inside Python, numpy or torch, and never load wrong numbers.

Every file here is real and on disk; where the point is that a checksum does not protect, the file is re-signed
(:mod:`crafted`): its digests and header checksum are recomputed after the edit, as anyone can.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crafted import read, resign, resign_with_raw
from synthetic import SyntheticAdapter
from test_heads import built_heads

from equivariance_probe import EquivarianceProbe, ProbeResult, ShiftResult
from equivariance_probe.analyses.positional import gram_toeplitz
from equivariance_probe.cli import main
from equivariance_probe.errors import ResultFileError
from equivariance_probe.records.fileformat import MAX_JSON_DEPTH
from equivariance_probe.runs.positional import PositionalStudy
from equivariance_probe.statistics.shift import ShiftConfig, ShiftStatistics

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def result_path(tmp_path_factory):
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    result = EquivarianceProbe(adapter).run(tokens, progress=False)
    return result.save(tmp_path_factory.mktemp("crafted") / "result.safetensors")


def _shift_result(path, config=None):
    """A shift result with known sums: the offset's share of the centred logits is 0.012 in every cell."""
    config = config or ShiftConfig(n_layers=2, n_heads=2, offsets=(0, 8, 16), n_contexts=3, segment_length=4,
                                   interval_groups=2, sliding_windows=(None, None), hidden_size=4)
    statistics = ShiftStatistics(config)
    rng = np.random.default_rng(0)
    for name, array in statistics.arrays.items():
        array[...] = rng.uniform(1.0, 2.0, size=array.shape)
    # SS_all = within + cell_square − total²/count = 100 in every cell, SS_offset = 1.2.
    # Counts above what they count (a divergence is at most ln 2 per pair, a row's weight at most 1).
    for name in ("js_offset_count", "js_context_count", "nll_count", "sink/rows"):
        statistics.arrays[name][...] = 10.0
    for suffix, value in {"count": 1.0, "total": 0.0, "cell_square": 0.0, "within": 100.0, "offset": 1.2, "context": 3.0}.items():
        for name in statistics.arrays:
            if name.endswith("/" + suffix):
                statistics.arrays[name][...] = value
    statistics.segment_fingerprints = np.arange(4, dtype=np.uint64)
    ShiftResult(statistics, {"model": {"name": "tiny"}}).save(path)
    return path


def _one_line_exit_2(argv, capsys, *words):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "error:" in err
    for word in words:
        assert word in err
    return err


# -- metadata nested very deeply, every checksum valid -------------------------------------------------------------
def test_deeply_nested_metadata_is_refused_by_name_by_every_loader_and_command(result_path, tmp_path, capsys):
    deep = resign_with_raw(result_path, "nested", DEEP, out=tmp_path / "deep.safetensors")
    with pytest.raises(ResultFileError, match="nested deeper|nested more than"):
        ProbeResult.load(deep)
    for command in (["verify", str(deep)], ["merge", str(result_path), str(deep), "-o", str(tmp_path / "m.safetensors")],
                    ["show", str(deep)]):
        _one_line_exit_2(command, capsys, "deep.safetensors", "nested")
    shift = resign_with_raw(_shift_result(tmp_path / "shift.safetensors"), "nested", DEEP, out=tmp_path / "deep_shift.safetensors")
    with pytest.raises(ResultFileError, match="nested"):
        ShiftResult.load(shift)


def test_nesting_just_past_the_limit_is_refused_and_the_package_s_own_depth_reads(result_path, tmp_path):
    # Deep enough to be refused, shallow enough for Python's parser: the depth check itself names it.
    shallow = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    path = resign_with_raw(result_path, "nested", shallow, out=tmp_path / "past.safetensors")
    with pytest.raises(ResultFileError, match=f"more than {MAX_JSON_DEPTH} levels"):
        ProbeResult.load(path)
    ProbeResult.load(result_path).verify()


# -- a shift result whose configuration claims what it is not --------------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("n_heads", 10**12, ["F64", str(10**12)]),  # absurd: terabytes; refused before any allocation
    ("n_heads", -3, ["config.n_heads", "-3"]),
    ("segment_length", 2.5, ["config.segment_length", "2.5"]),
    ("mode", "sideways", ["config.mode", "'sideways'", "'text' or 'position_ids'"]),
    ("offsets", "0,8,16", ["config.offsets", "'0,8,16'"]),
    ("offsets", [0, 8, 8], ["config.offsets", "distinct"]),
    ("causal", "yes", ["config.causal", "'yes'"]),
    ("interval_groups", True, ["config.interval_groups", "True"]),
    ("components", ["embedding", "head.x"], ["config.components", "'head.x'"]),
    ("components", "embedding", ["config.components", "'embedding'"]),
    ("components", ["embedding"] * 2, ["config.components", "distinct"]),
    ("components", ["embedding", "mlp.0"] * 10**3, ["config.components", "distinct"]),
    ("components", ["embedding", "mlp.0"], ["'attribution/offset_gram' must be F64 [2, 2, 2]"]),  # arrays absent
])
def test_a_shift_configuration_is_checked_against_its_schema_before_anything_is_allocated(tmp_path, field, value, words):
    path = _shift_result(tmp_path / "shift.safetensors")
    resign(path, lambda header: header["config"].update({field: value}))
    with pytest.raises(ResultFileError) as caught:
        ShiftResult.load(path)
    for word in words:
        assert word in str(caught.value)


def test_a_future_shift_format_says_to_upgrade_the_package(tmp_path):
    path = _shift_result(tmp_path / "shift.safetensors")
    resign(path, lambda header: header.update(format_version=99))
    with pytest.raises(ResultFileError, match="upgrade equivariance_probe"):
        ShiftResult.load(path)


def test_non_finite_sums_in_a_re_signed_shift_result_are_refused_not_reported_as_a_share(tmp_path, capsys):
    # A broken run's NaN and infinity, re-signed: were they read, the offset share would be some other number.
    path = _shift_result(tmp_path / "shift.safetensors")
    assert ShiftResult.load(path).share("centred_logits", "offset") == pytest.approx(0.012)
    name = "centred_logits/within"

    def poison(tensors):
        tensors[name][0, 0, 0] = np.nan
        tensors[name][1, 1, 1] = np.inf

    resign(path, edit_tensors=poison, counts=lambda header: ())
    with pytest.raises(ResultFileError, match=rf"non-finite.*'{name}' \(2 of"):
        ShiftResult.load(path).verify()  # the header alone is read on load; the arrays when first used
    with pytest.raises(ResultFileError, match=rf"non-finite.*'{name}' \(2 of"):
        ShiftResult.load(path).share("centred_logits", "offset")
    _one_line_exit_2(["show", str(path)], capsys, "non-finite")


def test_non_finite_sums_in_a_re_signed_result_are_refused_when_read(result_path, tmp_path, capsys):
    def poison(tensors):
        tensors["log_sum"].flat[3] = np.nan

    path = resign(result_path, edit_tensors=poison, counts=lambda h: (h["statistics"]["n_windows"], h["statistics"]["n_tokens"]),
                  out=tmp_path / "nan.safetensors")
    with pytest.raises(ResultFileError, match="non-finite.*'log_sum' \\(1 of"):
        ProbeResult.load(path).verify()
    _one_line_exit_2(["verify", str(path)], capsys, "nan.safetensors", "'log_sum'")


# -- JSON that is not UTF-8; stored fields of the wrong type ---------------------------------------------------------
def test_a_json_result_that_is_not_utf8_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "result.json"
    path.write_bytes(b'{"kind": "equivariance_probe.ProbeResult", "format_version": 2, "model": "\xff\xfe"}')
    with pytest.raises(ResultFileError, match="not valid UTF-8"):
        ProbeResult.load(path)
    _one_line_exit_2(["verify", str(path)], capsys, "UTF-8")


@pytest.mark.parametrize("edit, words", [
    (lambda h: h["metadata"].update(model="gpt"), ["metadata.model", "object"]),
    (lambda h: h["summary"].update(most_position_bound_head=["L0H1"]), ["summary.most_position_bound_head"]),
    (lambda h: h["summary"]["query_position_r2"]["log"].update(fitted="0.5"), ["summary.query_position_r2"]),
    (lambda h: h["summary"].update(head_scores={"log_eta2": [[0.5]]}), ["summary.head_scores", "[2, 4]"]),
])
def test_stored_fields_the_result_shows_without_its_arrays_are_type_checked(result_path, tmp_path, edit, words):
    path = resign(result_path, edit, out=tmp_path / "edited.safetensors")
    with pytest.raises(ResultFileError) as caught:
        ProbeResult.load(path)
    for word in words:
        assert word in str(caught.value)


# -- a positional study missing a part, or with an unknown one ------------------------------------------------------
@pytest.fixture
def study_path(tmp_path):
    study = PositionalStudy(parts={"gram": gram_toeplitz(np.random.default_rng(0).normal(size=(8, 4)))},
                            metadata={"model": "tiny"})
    return study.save(tmp_path / "positional.safetensors")


def test_a_positional_study_with_an_unknown_part_names_it(study_path):
    resign(study_path, lambda header: header["parts"].update(attention_lens=header["parts"]["gram"]))
    with pytest.raises(ResultFileError, match=r"unknown part \['attention_lens'\].*Upgrade"):
        PositionalStudy.load(study_path)


def test_a_positional_study_missing_a_field_of_a_part_names_the_part(study_path):
    resign(study_path, lambda header: header["parts"]["gram"].pop("r2_whole"))
    with pytest.raises(ResultFileError, match=r"the part 'gram' is missing a field.*r2_whole"):
        PositionalStudy.load(study_path)


def test_a_positional_study_naming_an_array_it_does_not_hold_is_refused(study_path):
    resign(study_path, lambda header: header["parts"]["gram"].update(gram={"tensor": "parts/elsewhere"}))
    with pytest.raises(ResultFileError, match=r"does not hold: \['parts/elsewhere'\]"):
        PositionalStudy.load(study_path)


def test_a_crafted_header_is_read_without_reading_its_arrays(result_path):
    # The header alone decides: a valid file's arrays are untouched until a number needs them.
    header, _ = read(result_path)
    assert header["kind"] == "equivariance_probe.ProbeResult"
    assert ProbeResult.load(result_path)._file._statistics is None


# -- a checkpoint's state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, words", [
    (b'{"kind": "equivariance_probe.StudyCheckpoint", "format_version": 7}', ["format 7", "upgrade equivariance_probe"]),
    (b"[1, 2, 3]", ["not a checkpoint"]),
    (b'{"kind": "\xff"}', ["not valid UTF-8"]),
    (("[" * 100_000 + "]" * 100_000).encode(), ["nested"]),
])
def test_a_crafted_checkpoint_state_is_refused_by_name(tmp_path, content, words):
    from equivariance_probe.errors import CheckpointError
    from equivariance_probe.runs.checkpoint import CheckpointedRun

    (tmp_path / "state.json").write_bytes(content)
    with pytest.raises(CheckpointError) as caught:
        CheckpointedRun(tmp_path, every=2, identity={"model": {}, "corpus": {}, "config": {}}, resume=True)
    for word in words:
        assert word in str(caught.value)


# -- values that no run writes, re-signed ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mechanisms_path(tmp_path_factory):
    """A real run of a tiny Gemma 3 with attribution (heads of layer 1) and patching, saved."""
    from synthetic import tiny_gemma3
    from test_shift import M, OFFSETS, design

    segments, contexts = design()
    result = EquivarianceProbe(tiny_gemma3()).shift(segments, contexts, offsets=OFFSETS, segment_length=M,
                                                    progress=False, interval_groups=2, attribution=True,
                                                    attribution_heads=[1], patch="mlp.0,attention.1+mlp.1")
    assert result.metadata["attribution_check"]["passed"] and result.metadata["check"]["passed"]
    return result.save(tmp_path_factory.mktemp("mechanisms") / "shift.safetensors")


def _edited(path, tmp_path, edit):
    out = tmp_path / "edited.safetensors"
    return resign(path, edit_tensors=edit, counts=lambda header: (), out=out)


def _negative_diagonal(tensors):
    tensors["attribution/offset_gram"][0, 2, 2] = -abs(tensors["attribution/offset_gram"][0, 2, 2]) - 1.0


def _asymmetric(tensors):
    tensors["attribution/offset_gram"][1, 0, 3] += 0.01 * abs(tensors["attribution/offset_gram"][1, 0, 0]) + 1e-3


def _negative_divergence(tensors):
    tensors["patch/js_sum"][0, 0, 1] = -0.5


def _share_above_one(tensors):
    tensors["residual/offset"][0, 1, 0] = 2.0 * tensors["residual/within"][0, 1, 0] + 1.0


def _weight_above_one(tensors):
    tensors["sink/first_key"][1, 0, 2, 1] = 2.0 * tensors["sink/rows"][1, 0, 1] + 1.0


def _negative_sum_of_squares(tensors):
    tensors["centred_logits/context"][0, 0, 1] = -1.0


@pytest.mark.parametrize("edit, words", [
    (_negative_diagonal, "'attribution/offset_gram' has a negative diagonal entry"),
    (_asymmetric, "'attribution/offset_gram' is not symmetric"),
    (_negative_divergence, "'patch/js_sum' holds a negative sum"),
    (_share_above_one, "'residual/offset' with its context term exceeds the variation"),
    (_weight_above_one, "'sink/first_key' with 'sink/preceding' exceeds one attention weight per row"),
    (_negative_sum_of_squares, "'centred_logits/context' holds a negative sum"),
])
def test_sums_that_no_run_writes_are_refused_when_read_not_shown_as_shares(mechanisms_path, tmp_path, capsys, edit,
                                                                           words):
    path = _edited(mechanisms_path, tmp_path, edit)
    with pytest.raises(ResultFileError, match="which no run writes") as caught:
        ShiftResult.load(path).summary()
    assert words in str(caught.value)
    _one_line_exit_2(["show", str(path)], capsys, words)


@pytest.mark.parametrize("field, value, words", [
    ("components", "attention.9", "component names of its 3 layers and 4 heads"),
    ("components", "head.1.7", "component names of its 3 layers and 4 heads"),
    ("patch_components", "attention.x+mlp.1", "'config.patch_components' must be a list of component names"),
    ("patch_components", "mlp.5", "'config.patch_components' must be a list of component names"),
])
def test_component_names_must_be_valid_for_the_recorded_layers_and_heads(mechanisms_path, tmp_path, capsys, field,
                                                                         value, words):
    def rename(header):
        header["config"][field][-1] = value

    path = resign(mechanisms_path, rename, out=tmp_path / "renamed.safetensors")
    with pytest.raises(ResultFileError, match="malformed") as caught:
        ShiftResult.load(path)
    assert words in str(caught.value)
    _one_line_exit_2(["show", str(path)], capsys, f"'config.{field}'")


def test_a_check_is_recomputed_from_the_arrays_never_copied_from_the_header(mechanisms_path, tmp_path, capsys):
    def claim(header):  # a header that says what the arrays do not
        header["metadata"]["check"].update(passed=False, value=0.5)
        header["metadata"]["attribution_check"].update(passed=True, value=0.0)

    def double_a_component(tensors):  # still a Gram matrix, but the components no longer add up to the stream
        for term in ("offset", "context"):
            tensors[f"attribution/{term}_gram"][:, 1, :] *= 3.0
            tensors[f"attribution/{term}_gram"][:, :, 1] *= 3.0

    path = resign(mechanisms_path, claim, double_a_component, counts=lambda header: (),
                  out=tmp_path / "claimed.safetensors")
    loaded = ShiftResult.load(path)
    checks = loaded.recorded_checks()
    assert checks["check"]["passed"] is True and checks["check"]["value"] < 1e-6  # the arrays' layer-0 η²
    assert checks["attribution"]["passed"] is False and checks["attribution"]["value"] > 0.1
    summary = loaded.summary()
    assert summary["check"]["passed"] is True and summary["attribution"]["check"]["passed"] is False
    table = loaded.table()
    assert "(passed;" in table.split("check: layer-0")[1] and "NOT passed" in loaded.attribution_table()
    capsys.readouterr()
    assert main(["show", str(path)]) == 0
    assert "(passed)" in capsys.readouterr().out  # the header's "not passed" is not what is shown
