"""Results save, load and merge exactly; bad files and bad merges are refused clearly."""

import json

import numpy as np
import pytest
import torch

from equivariance_probe import (
    AttentionStatistics,
    EquivarianceProbe,
    FileWriteError,
    IncompatibleResultsError,
    NotRunError,
    ProbeResult,
    ResultFileError,
)

from synthetic import edited_result_file, result_header, tiny_gemma3, tiny_gpt2

V2_FIXTURE = __import__("pathlib").Path(__file__).parent / "data" / "result_format_v2.json"


@pytest.fixture(scope="module")
def result():
    tokens = torch.randint(3, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    return EquivarianceProbe(tiny_gemma3(window=6)).run(tokens, progress=False, exclude_keys=[0], keep_pattern=True)


def test_save_load_round_trip_is_exact(result, tmp_path):
    path = result.save(tmp_path / "run.safetensors")
    loaded = ProbeResult.load(path)
    for name, value in result.statistics.arrays.items():
        assert torch.equal(loaded.statistics.arrays[name], value), name
    assert loaded.n_windows == result.n_windows and loaded.excluded_keys == (0,)
    assert loaded.query_position_r2("log", "eta2") == result.query_position_r2("log", "eta2")
    assert np.array_equal(loaded.toeplitz_r2(), result.toeplitz_r2())
    summary = result_header(path)["summary"]
    assert summary["query_position_r2"]["log"]["fitted"] == pytest.approx(result.query_position_r2("log", "fitted"))
    assert not (tmp_path / "run.safetensors.tmp").exists()


def test_merge_of_saved_halves_equals_the_whole(tmp_path):
    model = tiny_gpt2()
    tokens = torch.randint(0, 97, (6, 20), generator=torch.Generator().manual_seed(1))
    probe = EquivarianceProbe(model)
    whole = probe.run(tokens, progress=False)
    probe.run(tokens[:2], progress=False).save(tmp_path / "a.safetensors")
    probe.run(tokens[2:], progress=False).save(tmp_path / "b.safetensors")
    merged = ProbeResult.load(tmp_path / "a.safetensors").merge(ProbeResult.load(tmp_path / "b.safetensors"))
    for name, value in whole.statistics.arrays.items():
        assert torch.allclose(merged.statistics.arrays[name], value, rtol=1e-12, atol=1e-12), name


def test_truncated_file_and_newer_version_are_refused(result, tmp_path):
    # Version 2 (JSON)
    text = V2_FIXTURE.read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(ResultFileError, match="not valid JSON"):
        ProbeResult.load(tmp_path / "cut.json")
    data = json.loads(text)
    data["format_version"] = 99
    (tmp_path / "new.json").write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="format_version 99.*Upgrade"):
        ProbeResult.load(tmp_path / "new.json")
    data["format_version"] = 1
    del data["statistics"]["arrays"]["raw_sum"]
    (tmp_path / "missing.json").write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="raw_sum"):
        ProbeResult.load(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ResultFileError, match="not an equivariance_probe result"):
        ProbeResult.load(tmp_path / "other.json")
    # Version 3 (safetensors)
    path = result.save(tmp_path / "run.safetensors")
    binary = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(binary[: len(binary) // 2])
    with pytest.raises(ResultFileError, match="not a complete safetensors file"):
        ProbeResult.load(tmp_path / "cut.safetensors")
    (tmp_path / "cut_header.safetensors").write_bytes(binary[:100])
    with pytest.raises(ResultFileError, match="cut inside its header"):
        ProbeResult.load(tmp_path / "cut_header.safetensors")
    edited_result_file(path, tmp_path / "new.safetensors", lambda h: h.__setitem__("format_version", 99))
    with pytest.raises(ResultFileError, match="format_version 99.*Upgrade"):
        ProbeResult.load(tmp_path / "new.safetensors")
    edited_result_file(path, tmp_path / "missing.safetensors", lambda h: None, tensors_edit=lambda t: t.pop("raw_sum"))
    with pytest.raises(ResultFileError, match="raw_sum"):
        ProbeResult.load(tmp_path / "missing.safetensors")
    (tmp_path / "other.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ResultFileError, match="not an equivariance_probe result"):
        ProbeResult.load(tmp_path / "other.safetensors")


def test_incompatible_merges_are_refused(result):
    tokens = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    no_exclusion = EquivarianceProbe(tiny_gemma3(window=6)).run(tokens, progress=False)
    with pytest.raises(IncompatibleResultsError, match="excluded_keys"):
        result.merge(no_exclusion)
    shorter = EquivarianceProbe(tiny_gemma3(window=6)).run(tokens[:, :12], progress=False, exclude_keys=[0])
    with pytest.raises(IncompatibleResultsError, match="n_positions"):
        result + shorter
    other_model = EquivarianceProbe(tiny_gpt2()).run(tokens, progress=False)
    with pytest.raises(IncompatibleResultsError):
        result + other_model


def test_empty_result_says_which_method_to_call():
    statistics = AttentionStatistics(n_layers=1, n_heads=1, n_positions=4, sliding_windows=[None])
    with pytest.raises(NotRunError, match=r"EquivarianceProbe\(model\)\.run"):
        ProbeResult(statistics).query_position_r2()
    assert "empty" in repr(ProbeResult(statistics))


def test_memory_does_not_grow_with_documents():
    """The sums have a fixed size; the interval groups' rows grow with the occupied groups, at most G; each window
    adds its first-token weight per layer and head and its key, ``8·(L·H + 1)`` bytes (Gu et al.'s sink rate)."""
    model = tiny_gpt2()
    probe = EquivarianceProbe(model)
    few = probe.run(torch.randint(0, 97, (2, 16)), progress=False, interval_groups=4)
    many = probe.run(torch.randint(0, 97, (40, 16)), progress=False, interval_groups=4)
    more = probe.run(torch.randint(0, 97, (80, 16)), progress=False, interval_groups=4)
    assert len(few.statistics.groups.ids) <= 2 and len(many.statistics.groups.ids) == 4
    def fixed(statistics):
        return statistics.nbytes() - statistics.groups.nbytes() - statistics.window_sinks.nbytes()

    assert fixed(few.statistics) == fixed(many.statistics) == fixed(more.statistics)
    assert more.statistics.groups.nbytes() == many.statistics.groups.nbytes()
    for result in (few, many, more):
        assert result.statistics.window_sinks.nbytes() == 8 * (2 * 4 + 1) * result.n_windows  # tiny GPT-2: 2 layers, 4 heads


def test_repr_and_html_show_headline_numbers(result):
    text = repr(result)
    assert "query-position R²" in text and "most position-bound head" in text
    html = result._repr_html_()
    assert "<table>" in html and "eta2" in html


def test_entry_sample_is_uniform_bounded_saved_and_merged(tmp_path):
    from equivariance_probe.statistics.sample import EntrySample

    model = tiny_gpt2()
    tokens = torch.randint(0, 97, (6, 16), generator=torch.Generator().manual_seed(3))
    result = EquivarianceProbe(model).run(tokens, progress=False, sample_size=300, sample_seed=1)
    sample = result.entry_sample()
    assert len(sample["attention"]) == 300
    assert np.all(sample["key_position"] <= sample["query"])
    assert np.allclose(sample["prior"], 1.0 / (sample["query"] + 1))
    loaded = ProbeResult.load(result.save(tmp_path / "r.safetensors"))
    assert np.array_equal(loaded.entry_sample()["attention"], sample["attention"])
    # Uniformity: offered 10 equal parts (10 heads × 5,050 causal entries each) one after the other, as the
    # sample's threshold falls, every part is kept about equally often.
    uniform = EntrySample(2000, seed=0)
    for part in range(10):
        uniform.update(part, torch.full((1, 10, 100, 100), float(part)), torch.tensor([100]))
    counts = np.bincount(uniform.columns["layer"].astype(int), minlength=10)
    assert counts.sum() == 2000 and counts.min() > 120 and counts.max() < 290
    merged = uniform.merge(EntrySample(2000, seed=5))
    assert len(merged) == 2000


def test_save_where_no_file_can_be_written_is_a_named_error_and_leaves_no_tmp(result, tmp_path, monkeypatch):
    with pytest.raises(FileWriteError, match=r"is a folder; give a file name inside it"):
        result.save(tmp_path)  # onto a path that is a folder
    with pytest.raises(FileWriteError, match=r"folder .*no_dir.* does not exist; create it first"):
        result.save(tmp_path / "no_dir" / "out.safetensors")
    import os

    def refuse(*args, **kwargs):  # tests run as root, where chmod does not stop a write
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(FileWriteError, match=r"not writable by this user.*write into a folder you can write to") as caught:
        result.save(tmp_path / "read_only.safetensors")
    assert isinstance(caught.value, OSError) and isinstance(caught.value.__cause__, PermissionError)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .tmp left behind, no result claimed


def test_a_merge_of_one_model_name_with_other_weights_is_refused_with_the_fix():
    from equivariance_probe import random_init_like

    model = tiny_gpt2()
    tokens = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    trained = EquivarianceProbe(model).run(tokens[:1], progress=False)
    same_weights = EquivarianceProbe(model).run(tokens[1:], progress=False)
    assert (trained + same_weights).n_windows == 2
    copy = random_init_like(model, seed=1)  # seed 0 would rebuild tiny_gpt2 weights exactly
    other_weights = EquivarianceProbe(copy).run(tokens[1:], progress=False)
    assert other_weights.metadata["model"]["name"] == trained.metadata["model"]["name"]
    digest = trained.metadata["model"]["weights_sha256"][:12]
    with pytest.raises(IncompatibleResultsError, match=rf"weights sha256 {digest}.*random_init_like.*merge only results of the same weights"):
        trained + other_weights


def test_a_merge_of_two_models_names_both_and_the_fix():
    tokens = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(6))
    gpt2 = EquivarianceProbe(tiny_gpt2()).run(tokens, progress=False)
    gemma = EquivarianceProbe(tiny_gemma3(window=6)).run(tokens, progress=False)
    names = gpt2.metadata["model"]["name"], gemma.metadata["model"]["name"]
    assert names[0] != names[1]
    with pytest.raises(IncompatibleResultsError, match=rf"{names[0]!r} and {names[1]!r}.*merge only results of one model"):
        gpt2 + gemma


def test_partial_results_merge_into_a_partial_result_from_python_and_the_command_line(tmp_path, capsys):
    from equivariance_probe.cli import main

    tokens = torch.randint(3, 97, (4, 16), generator=torch.Generator().manual_seed(7))
    model = tiny_gpt2()
    whole = EquivarianceProbe(model).run(tokens, progress=False)
    first = EquivarianceProbe(model).run(tokens[:2], progress=False)
    first.metadata["complete"] = False  # as a run that stopped after its first two windows leaves it
    second = EquivarianceProbe(model).run(tokens[2:], progress=False)
    merged = first + second
    assert merged.complete is False
    for name, value in whole.statistics.arrays.items():
        assert torch.allclose(value, merged.statistics.arrays[name], rtol=1e-12, atol=1e-12), name
    paths = [str(first.save(tmp_path / "a.safetensors")), str(second.save(tmp_path / "b.safetensors"))]
    assert main(["merge", *paths, "-o", str(tmp_path / "ab.safetensors")]) == 0
    err = capsys.readouterr().err
    assert "a.safetensors is a partial result" in err and "merged result is partial" in err
    assert ProbeResult.load(tmp_path / "ab.safetensors").complete is False


def test_merge_into_a_missing_folder_on_the_command_line_is_one_line_and_exit_2(result, tmp_path, capsys):
    from equivariance_probe.cli import main

    half = str(result.save(tmp_path / "a.safetensors"))
    other = EquivarianceProbe(tiny_gemma3(window=6)).run(
        torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(8)), progress=False, exclude_keys=[0],
        keep_pattern=True)
    assert main(["merge", half, str(other.save(tmp_path / "b.safetensors")), "-o",
                 str(tmp_path / "no_dir" / "out.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_dir" in err[0] and "does not exist" in err[0]
