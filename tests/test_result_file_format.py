"""Result files, format 3: safetensors tensors and a JSON header. Bitwise round trips, readable
without this package, a header checked before anything is read, summaries that read no array,
atomic writes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, ProbeResult, ResultFileError
from equivariance_probe.records import result_file

from synthetic import edited_result_file, result_header, tiny_gemma3


@pytest.fixture(scope="module")
def result():
    tokens = torch.randint(3, 97, (5, 16), generator=torch.Generator().manual_seed(4))
    rows = [row[: 16 - i] for i, row in enumerate(tokens)]  # uneven lengths
    run = EquivarianceProbe(tiny_gemma3(window=6)).run(rows, context_length=16, batch_size=2, progress=False,
                                                       exclude_keys=[0], sample_size=40, sample_seed=3,
                                                       keep_pattern=True)
    run.metadata["note"] = {"nested": [1, 2.5, "three"]}
    return run


def test_round_trip_is_bitwise_exact(result, tmp_path):
    loaded = ProbeResult.load(result.save(tmp_path / "r.safetensors"))
    statistics, original = loaded.statistics, result.statistics
    assert set(statistics.arrays) == set(original.arrays) and "pattern_sum" in statistics.arrays
    for name, value in original.arrays.items():
        assert statistics.arrays[name].dtype == torch.float64
        assert torch.equal(statistics.arrays[name], value), name
    for column, value in original.sample.to_arrays().items():
        assert np.array_equal(statistics.sample.to_arrays()[column], value), column
    assert statistics.sample.size == original.sample.size == 40
    assert np.array_equal(statistics.window_fingerprints, original.window_fingerprints)
    assert statistics.window_fingerprints.dtype == np.uint64 and len(statistics.window_fingerprints) == 5
    assert (statistics.n_windows, statistics.n_tokens) == (original.n_windows, original.n_tokens)
    assert statistics.config() == original.config()
    assert loaded.metadata == {**result.metadata, "complete": True}
    assert json.dumps(loaded.summary(), sort_keys=True) == json.dumps(result.summary(), sort_keys=True)
    # and it merges on exactly as the original would
    more = EquivarianceProbe(tiny_gemma3(window=6)).run(torch.randint(3, 97, (2, 16)), progress=False,
                                                        exclude_keys=[0], sample_size=40, keep_pattern=True)
    for name, value in (result + more).statistics.arrays.items():
        assert torch.equal((loaded + more).statistics.arrays[name], value), name


def test_a_user_reads_the_file_with_safetensors_and_json_alone(result, tmp_path):
    path = result.save(tmp_path / "r.safetensors")
    script = textwrap.dedent(f"""
        import hashlib, json, sys
        import numpy as np
        from safetensors import safe_open
        from safetensors.numpy import load_file

        path = {str(path)!r}
        with safe_open(path, framework="np") as f:                     # the header alone
            header = json.loads(f.metadata()["equivariance_probe"])
        arrays = load_file(path)                                        # every array
        summary = header["summary"]
        # headline numbers recomputed from the arrays
        assert int(arrays["windows_covering"][0]) == header["statistics"]["n_windows"] == summary["n_windows"]
        assert int(arrays["windows_covering"].sum()) == summary["n_tokens"]
        n_heads = header["statistics"]["config"]["n_heads"]
        assert int(arrays["query_count"].sum()) * n_heads == summary["n_entries"]
        assert len(arrays["window_fingerprints"]) == summary["n_windows"]
        # the checksum, as the format documents it
        digest = hashlib.sha256()
        for count in (header["statistics"]["n_windows"], header["statistics"]["n_tokens"]):
            digest.update(f"{{count}}|".encode())
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            digest.update(f"{{name}}|{{a.dtype.name}}|{{tuple(a.shape)}}|".encode())
            digest.update(a.tobytes())
        assert "sha256:" + digest.hexdigest() == header["checksum"]
        assert "equivariance_probe" not in sys.modules
        print(summary["query_position_r2"]["log"]["eta2"])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == pytest.approx(result.query_position_r2("log", "eta2"), rel=1e-15)


def test_summary_repr_and_ranking_of_a_loaded_file_read_no_array(result, tmp_path, monkeypatch):
    path = result.save(tmp_path / "r.safetensors")

    def no_arrays(*args, **kwargs):
        raise AssertionError("an array was read")

    monkeypatch.setattr(result_file, "read_tensors", no_arrays)
    loaded = ProbeResult.load(path)
    summary = loaded.summary()
    assert summary["query_position_r2"]["log"]["eta2"] == result.query_position_r2("log", "eta2")
    assert summary["persistence_fit_r2"]["prior"] == result.persistence().fits["prior"].r2
    assert np.array_equal(np.asarray(summary["head_scores"]["log_eta2"]), result.query_position_r2("log", "eta2", by="head"))
    assert (loaded.n_windows, loaded.n_tokens, loaded.n_layers, loaded.n_heads) == (5, result.n_tokens, 3, 4)
    assert loaded.excluded_keys == (0,) and loaded.log_floor == result.log_floor and loaded.complete
    assert repr(loaded) == repr(result)
    assert loaded.rank_heads().order == result.rank_heads().order
    # the intervals, and the ranking's stability across the jackknife's replicates, come from the header too
    found = result.interval("log_fitted")
    assert summary["intervals"]["query_position_r2"]["log"]["fitted"] == [found.low, found.high]
    assert summary["intervals"]["groups"] == found.n_groups and summary["intervals"]["level"] == 0.95
    assert set(summary["intervals"]["layer_groups"]) == {"sliding", "global"}
    np.testing.assert_array_equal(loaded.rank_heads().stability, result.rank_heads().stability)
    assert "<table>" in loaded._repr_html_()
    with pytest.raises(AssertionError, match="an array was read"):
        loaded.query_position_r2()  # arrays load on first use
    monkeypatch.undo()
    assert loaded.query_position_r2() == result.query_position_r2()


def test_the_header_is_checked_field_by_field_before_anything_is_read(result, tmp_path):
    good = result.save(tmp_path / "r.safetensors")
    cases = [
        (lambda h: h["statistics"]["config"].__setitem__("n_layers", "two"), "config.n_layers"),
        (lambda h: h["statistics"]["config"].pop("windows"), "config.windows"),
        (lambda h: h["statistics"]["config"].__setitem__("windows", [None]), "one entry per layer"),
        (lambda h: h["statistics"]["config"].__setitem__("n_positions", 12), r"the array '\w+' is F64 \[[\d, ]*16\], expected F64 \[[\d, ]*12\]"),
        (lambda h: h["statistics"]["config"].__setitem__("keep_pattern", False), r"unknown arrays \['pattern_sum'\]"),
        (lambda h: h["statistics"].__setitem__("n_tokens", -1), "n_tokens"),
        (lambda h: h["statistics"].__setitem__("n_windows", 2), "more fingerprints than"),
        (lambda h: h["statistics"].__setitem__("sample_size", 10), "exceed 'statistics.sample_size'"),
        (lambda h: h.__setitem__("metadata", [1, 2]), "'metadata' must be an object"),
        (lambda h: h.__setitem__("complete", "yes"), "'complete' must be true or false"),
        (lambda h: h.__setitem__("summary", None), "'summary' must be an object"),
        (lambda h: h.__setitem__("format_version", 2), "must have format_version 3"),
        (lambda h: h.__setitem__("format_version", True), "format_version True"),
        (lambda h: h.__setitem__("kind", "equivariance_probe.PositionalStudy"), "holds 'equivariance_probe.PositionalStudy'.*PositionalStudy.load"),
    ]
    for index, (edit, message) in enumerate(cases):
        path = edited_result_file(good, tmp_path / f"bad{index}.safetensors", edit)
        with pytest.raises(ResultFileError, match=message):
            ProbeResult.load(path)
    # an array changed in place: the header is intact, so the file opens; its numbers do not load
    path = edited_result_file(good, tmp_path / "changed.safetensors", lambda h: None,
                              tensors_edit=lambda t: t["raw_sum"].__setitem__((0, 0, 3), 0.5))
    loaded = ProbeResult.load(path)
    assert loaded.summary()["n_windows"] == 5
    with pytest.raises(ResultFileError, match="array .raw_sum. does not match its digest"):
        loaded.statistics


def test_foreign_files_are_refused(tmp_path):
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.zeros((4, 2), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ResultFileError, match="not one of equivariance_probe"):
        ProbeResult.load(tmp_path / "model.safetensors")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(ResultFileError, match="neither a safetensors file"):
        ProbeResult.load(tmp_path / "image.png")
    with pytest.raises(ResultFileError, match="cannot read"):
        ProbeResult.load(tmp_path / "missing.safetensors")


def test_the_format_is_chosen_by_content_not_by_name(result, tmp_path):
    import shutil

    binary = result.save(tmp_path / "r.safetensors")
    shutil.copy(binary, tmp_path / "named_like_json.json")
    assert ProbeResult.load(tmp_path / "named_like_json.json").n_windows == 5
    shutil.copy(__import__("pathlib").Path(__file__).parent / "data" / "result_format_v2.json", tmp_path / "v2.safetensors")
    assert ProbeResult.load(tmp_path / "v2.safetensors").n_windows == 3


def test_a_failed_save_leaves_the_previous_file(result, tmp_path, monkeypatch):
    path = result.save(tmp_path / "r.safetensors")
    before = path.read_bytes()

    def failing_save(tensors, filename, metadata=None):
        open(filename, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.numpy.save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        result.save(path)
    assert path.read_bytes() == before and not (tmp_path / "r.safetensors.tmp").exists()


def test_default_result_files_hold_only_what_the_statistics_need(tmp_path):
    tokens = torch.randint(3, 97, (3, 16), generator=torch.Generator().manual_seed(5))
    run = EquivarianceProbe(tiny_gemma3(window=6)).run(tokens, progress=False)
    header = result_header(run.save(tmp_path / "r.safetensors"))
    assert header["statistics"]["config"]["keep_pattern"] is False and header["statistics"]["sample_size"] is None
    from safetensors import safe_open

    with safe_open(str(tmp_path / "r.safetensors"), framework="np") as handle:
        names = set(handle.keys())
    assert "pattern_sum" not in names and not any(name.startswith("sample/") for name in names)


def test_show_prints_every_headline_number_without_reading_an_array(result, tmp_path, monkeypatch, capsys):
    from equivariance_probe.cli import main

    path = result.save(tmp_path / "results.safetensors")

    def no_arrays(*args, **kwargs):
        raise AssertionError("an array was read")

    monkeypatch.setattr(result_file, "read_tensors", no_arrays)
    assert main(["show", str(path)]) == 0
    printed = capsys.readouterr().out
    for row in ("| log | prior |", "| log | fitted |", "| log | eta2 |", "| raw | prior |", "| raw | fitted |",
                "| raw | eta2 |", "| P(dt) | power fit R² |", "| P(dt) | exponential fit c, λ |",
                "| P(dt) by key (Fig. 1c) | key bins where the uniform prior fits better than both decays |", "| Toeplitz | mean per-window R² |",
                "| heads | most position-bound (log η²) |", "|  | windows / tokens | 5 / "):
        assert row in printed, row
    # every headline number with its 95 % interval, from the header alone
    assert f"| log | eta2 | {result.query_position_r2('log', 'eta2', interval=0.95)} |" in printed
    assert f"| P(dt) | prior fit R² | {result.persistence(interval=0.95).r2_interval('prior')} |" in printed
    assert f"| Toeplitz | mean per-window R² | {result.toeplitz_r2(None, interval=0.95, estimator='per_doc')} |" in printed
    assert main(["show", "--json", str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)[str(path)]
    assert shown["summary"]["query_position_r2"]["raw"]["fitted"] == result.query_position_r2("raw", "fitted")
    assert shown["complete"] is True
    (tmp_path / "broken.safetensors").write_bytes(path.read_bytes()[:50])
    assert main(["show", str(tmp_path / "broken.safetensors")]) == 2
    assert "cut inside its header" in capsys.readouterr().err
