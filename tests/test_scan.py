"""The context-length scan on tiny models built from configs, with known answers (fast).

Known answers: a model whose attention is exactly uniform (every weight zero) has query-position
R² = 1 in every form and scale and a persistence curve equal to the prior, in every layer group
and at every length; every length reads the same spans of one stream (checked against windows cut
independently here); the table, CSV, JSON and figure agree; lengths over the model's maximum
context, or whose estimated memory exceeds the limit, are refused before anything runs.
"""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from synthetic import tiny_gemma3  # noqa: E402

from equivariance_probe import ProbeResult, load_corpus, load_model, scan_context_lengths  # noqa: E402
from equivariance_probe.cli import main  # noqa: E402
from equivariance_probe.display.scan import save_scan  # noqa: E402
from equivariance_probe.errors import (  # noqa: E402
    CheckpointError,
    ContextLengthError,
    EmptyCorpusError,
    InputError,
    InsufficientMemoryError,
)
from equivariance_probe.maths.metrics import FORMS, SCALES  # noqa: E402
from equivariance_probe.records.provenance import window_fingerprints  # noqa: E402
from equivariance_probe.runs.scan import length_folder  # noqa: E402

LENGTHS = (8, 16, 32)   # tiny Gemma 3: sliding window 8, so the sliding layers see less than the global one beyond 8
N_TOKENS = 96           # three windows of 32


@pytest.fixture(scope="module")
def tiny(tiny_model_folder, text_corpus):
    """A uniform-attention tiny Gemma 3 (two sliding-window layers, one global) with the word-level tokenizer."""
    tokenizer = load_model(tiny_model_folder("gemma3", 64))[1]
    return tiny_gemma3(zero=True, max_positions=64), tokenizer, text_corpus(n_docs=4, words=60)


@pytest.fixture(scope="module")
def scanned(tiny, tmp_path_factory):
    model, tokenizer, corpus = tiny
    out = tmp_path_factory.mktemp("scan")
    scan = scan_context_lengths((model, tokenizer), context_lengths=LENGTHS[::-1], corpus=corpus, n_tokens=N_TOKENS,
                                baselines=("zero", "random_init"), batch_size=2, out=out, progress=False)
    return scan, out


def test_uniform_attention_gives_one_everywhere(scanned):
    scan, _ = scanned
    assert scan.context_lengths == list(LENGTHS) and scan.variants == ["trained", "random_init", "zero"]
    assert scan.groups() == ["all", "sliding", "global"]
    rows = scan.rows()
    assert len(rows) == len(LENGTHS) * 3 * 3
    for row in (r for r in rows if r["variant"] in ("trained", "zero")):   # both uniform: all weights zero
        for scale in SCALES:
            for form in FORMS:
                assert row[f"{scale}_{form}"] == pytest.approx(1.0, abs=1e-9), row
        assert row["persistence_prior_r2"] == pytest.approx(1.0, abs=1e-9), row
    assert {r["n_layers"] for r in rows if r["layers"] == "sliding"} == {2}
    # Each number is the one the result itself reports for that group.
    result = scan.results[32]["random_init"]
    row = next(r for r in rows if (r["context_length"], r["variant"], r["layers"]) == (32, "random_init", "sliding"))
    assert row["log_eta2"] == pytest.approx(result.query_position_r2("log", "eta2", by="layer_group")["sliding"], rel=1e-12)
    assert row["persistence_power_r2"] == pytest.approx(
        result.persistence(by="layer_group")["sliding"].fits["power"].r2, rel=1e-9, nan_ok=True)


def test_every_length_reads_the_same_text(scanned, tiny):
    scan, _ = scanned
    _, tokenizer, corpus = tiny
    # Independently: the first 31 tokens (after BOS) of each document long enough, cut into windows of T - 1.
    prefixes = [tokenizer(d, add_special_tokens=False)["input_ids"][:31] for d in load_corpus(corpus)][: N_TOKENS // 32]
    for length in LENGTHS:
        text = length - 1
        expected = [[1] + p[i : i + text] for p in prefixes for i in range(0, 31 // text * text, text)]
        windows = scan.windows[length]
        assert windows["n_windows"] == len(expected) == N_TOKENS // length
        assert windows["spans"] == [j for j in range(len(prefixes)) for _ in range(31 // text)]
        for variant, result in scan.results[length].items():
            assert (result.n_windows, result.n_tokens) == (N_TOKENS // length, N_TOKENS), (length, variant)
            assert sorted(result.statistics.window_fingerprints.tolist()) == sorted(window_fingerprints(expected).tolist())
            assert result.metadata["windows"]["spans"] == windows["spans"]
    assert {row["tokens"] for row in scan.rows()} == {N_TOKENS}


def test_files_agree_and_are_reused(scanned, tiny):
    scan, out = scanned
    paths = save_scan(scan, out)
    rows = scan.rows()
    with paths["csv"].open() as stream:
        table = list(csv.DictReader(stream))
    saved = json.loads(paths["json"].read_text())
    assert len(table) == len(saved["rows"]) == len(rows)
    for row, line, stored in zip(rows, table, saved["rows"], strict=True):
        assert float(line["log_fitted"]) == pytest.approx(row["log_fitted"]) and stored["raw_eta2"] == row["raw_eta2"]
        assert int(line["context_length"]) == row["context_length"] and line["layers"] == row["layers"]
    assert saved["windows"]["16"]["spans"] == scan.windows[16]["spans"]
    markdown = paths["markdown"].read_text()
    assert "| T = 8 | T = 16 | T = 32 |" in markdown and "| trained | sliding (2) | QPVE log eta2 | 1.0000 [1.0000, 1.0000] |" in markdown
    assert "|  |  | windows / window tokens | 12 / 96 | 6 / 96 | 3 / 96 |" in markdown
    assert paths["figure"].stat().st_size > 20_000
    for length in LENGTHS:
        for name in ("results", "baseline_zero", "baseline_random_init"):
            reloaded = ProbeResult.load(out / length_folder(length) / f"{name}.safetensors")
            assert reloaded.complete and reloaded.n_tokens == N_TOKENS
    # Run again: every (length, variant) is read back, none measured.
    model, tokenizer, corpus = tiny
    again = scan_context_lengths((model, tokenizer), context_lengths=LENGTHS, corpus=corpus, n_tokens=N_TOKENS,
                                 baselines=("zero", "random_init"), batch_size=2, out=out, progress=False)
    assert again.reused == {t: ["trained", "random_init", "zero"] for t in LENGTHS}
    assert [r["log_eta2"] for r in again.rows()] == [r["log_eta2"] for r in rows]
    # Other text in the same folder: refused, naming what differs, never overwritten.
    with pytest.raises(CheckpointError, match=r"cannot be reused by this scan \(its n_spans, stream differ\)"):
        scan_context_lengths((model, tokenizer), context_lengths=LENGTHS, corpus=corpus, n_tokens=2 * 32,
                             baselines=(), out=out, progress=False)


def test_intervals_over_spans_and_differences_between_lengths(scanned):
    """Windows are grouped by span, so every length resamples the same text: uniform attention has
    intervals of width 0 and differences of exactly 0; a random model's difference between two
    lengths is the difference of its numbers, with an interval around it."""
    scan, _ = scanned
    for length in LENGTHS:
        groups = scan.results[length]["random_init"].interval_groups()
        assert groups["keys"] == "explicit" and groups["occupied"] == N_TOKENS // 32  # one group per span
    for row in scan.rows():
        for key in ("log_fitted", "raw_eta2", "persistence_prior_r2"):
            assert row[f"{key}_low"] <= row[key] + 1e-12 and row[key] <= row[f"{key}_high"] + 1e-12, (key, row)
        if row["variant"] == "trained":
            assert row["log_eta2_high"] - row["log_eta2_low"] == pytest.approx(0.0, abs=1e-9)
    uniform = scan.difference(32, 8, "log_fitted", variant="trained", by="layer_group")
    for group, value in uniform.items():
        assert value.estimate == pytest.approx(0.0, abs=1e-9) and value.high - value.low == pytest.approx(0.0, abs=1e-9)
    random = scan.difference(32, 8, "raw_eta2", variant="random_init")
    a, b = (scan.results[t]["random_init"].query_position_r2("raw", "eta2") for t in (32, 8))
    assert random.estimate == pytest.approx(a - b, abs=1e-12) and random.low < random.estimate < random.high
    rows = scan.difference_rows()
    cells = next(c for what, layers, name, c in rows if (what, layers, name) == ("trained: T − 8", "global", "log_fitted"))
    assert [abs(float(x)) for cell in cells for x in cell.replace("[", "").replace("]", "").split(",")[0].split()] == [0.0] * 6
    assert any(what == "trained − random_init" for what, *_ in rows)
    with pytest.raises(InputError, match="context length 64 is not in the scan"):
        scan.difference(64, 8)


def test_refused_before_running(tiny, tmp_path):
    model, tokenizer, corpus = tiny
    options = dict(corpus=corpus, n_tokens=128, out=tmp_path, progress=False)
    with pytest.raises(ContextLengthError, match=r"context lengths \[128\] are longer than this model's maximum "
                                                r"context of 64 tokens; drop them from context_lengths"):
        scan_context_lengths((model, tokenizer), context_lengths=(32, 128), **options)
    with pytest.raises(InsufficientMemoryError, match=r"not enough memory for context lengths \[32, 64\] "
                                                      r"\(0.00 GiB available\): T = 32 \(batch 128\): .* GiB = weights"):
        scan_context_lengths((model, tokenizer), context_lengths=(32, 64), memory_limit=1, **options)
    assert not any(tmp_path.iterdir())
    with pytest.raises(InputError, match="n_tokens=16 must be at least the longest context length 32"):
        scan_context_lengths((model, tokenizer), context_lengths=(16, 32), corpus=corpus, n_tokens=16)
    with pytest.raises(InputError, match="name a length twice"):
        scan_context_lengths((model, tokenizer), context_lengths=(16, 16), corpus=corpus)
    with pytest.raises(EmptyCorpusError, match=r"asks for 9 spans of 31 stream tokens .* pack the documents"):
        scan_context_lengths((model, tokenizer), context_lengths=(32,), corpus=corpus, n_tokens=9 * 32)


def test_packed_stream_crosses_documents(tiny):
    model, tokenizer, corpus = tiny
    scan = scan_context_lengths((model, tokenizer), context_lengths=(16, 32), corpus=corpus, n_tokens=6 * 32,
                                pack=True, baselines=(), progress=False)
    windows = scan.windows[32]
    assert windows["protocol"] == "packed" and windows["separator"] == [2] and windows["n_spans"] == 6
    assert windows["n_documents"] == 4      # 4 × 61 tokens with EOS between them fill 6 spans of 31
    assert scan.results[16]["trained"].n_tokens == scan.results[32]["trained"].n_tokens == 6 * 32


def test_scan_command(tiny_model_folder, text_corpus, tmp_path, capsys):
    folder, corpus = tiny_model_folder("gemma3", 64), text_corpus(n_docs=4, words=60)
    out = tmp_path / "out"
    arguments = ["scan", "--out", str(out), "--model", folder, "--corpus", corpus, "--context-lengths", "8,16,32",
                 "--n-tokens", "64", "--batch-size", "2", "--no-progress"]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    assert "| T = 8 | T = 16 | T = 32 |" in printed and "random_init" in printed
    for name in ("scan.md", "scan.csv", "scan.json", "scan.png", "T16/results.safetensors",
                 "T16/baseline_random_init.safetensors"):
        assert (out / name).stat().st_size > 0, name
    assert main(arguments + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 * 2 * 3 and {r["reused"] for r in rows} == {True}
    assert main(arguments + ["--context-lengths", "32,128", "--n-tokens", "256"]) == 2
    assert "drop them from --context-lengths" in capsys.readouterr().err
    assert main(arguments + ["--memory-limit-gib", "0.001"]) == 2
    error = capsys.readouterr().err
    assert "not enough memory for context lengths [8, 16, 32]" in error and "Lower --batch-size" in error
    assert "(--memory-limit-gib sets the limit)" in error


def test_scan_command_measures_as_its_flags_say_and_reuses_only_files_measured_so(tiny_model_folder, text_corpus,
                                                                                  tmp_path, capsys):
    folder, corpus = tiny_model_folder("gemma3", 64), text_corpus(n_docs=4, words=60)
    out = tmp_path / "out"
    arguments = ["scan", "--out", str(out), "--model", folder, "--corpus", corpus, "--context-lengths", "8,16",
                 "--n-tokens", "32", "--baselines", "none", "--no-progress"]
    assert main(arguments + ["--interval-groups", "3", "--keep-pattern"]) == 0
    result = ProbeResult.load(out / "T16" / "results.safetensors")
    assert result.interval_groups()["interval_groups"] == 3
    assert result.toeplitz_r2("head").shape == (result.n_layers, result.n_heads)  # the kept pattern
    capsys.readouterr()
    # The same folder measured otherwise is not reused as if it were this scan's.
    assert main(arguments) == 2
    assert "measurement differ" in capsys.readouterr().err
