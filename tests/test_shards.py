"""Shards: deterministic disjoint slices whose merged result equals the single run; merges of
duplicate, overlapping, foreign or partial shards are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from equivariance_probe import IncompatibleResultsError, InputError, ProbeResult, Shard, run_study
from equivariance_probe.cli import main

from synthetic import WORDS, save_tiny_model_with_tokenizer, tiny_gpt2, write_text_corpus


@pytest.mark.parametrize("n_docs", [0, 1, 7, 10, 101])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_shards_are_disjoint_and_cover_the_corpus(n_docs, count):
    docs = list(range(n_docs))
    pieces = [Shard(i, count).select(docs) for i in range(count)]
    assert sum(pieces, []) == docs  # in order, each document exactly once
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_bad_shard_specifications_are_refused():
    assert Shard.parse(" 2 / 4 ") == Shard(2, 4)
    for text in ("4/4", "-1/4", "1", "a/b", "1/0"):
        with pytest.raises(InputError, match="shard"):
            Shard.parse(text)


class _WordTokenizer:
    pad_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [0] + [(3 + 5 * len(w) + WORDS.index(w) if w in WORDS else 50) % 97 for w in text.split()]}


def test_merged_shards_equal_the_single_run():
    docs = [" ".join((WORDS * 3)[i : i + 10 + 3 * i]) for i in range(7)]
    network, tokenizer = tiny_gpt2(), _WordTokenizer()
    options = dict(corpus=docs, n_docs=7, loaded=(network, tokenizer), context_length=24, batch_size=2,
                   baselines=("zero",), sample_size=40, progress=False)
    single = run_study(**options)
    shards = [run_study(shard=f"{i}/3", **options) for i in range(3)]
    assert [s.trained.n_windows for s in shards] == [2, 2, 3]
    for variant in ("trained", "zero"):
        merged = shards[2].results[variant] + shards[0].results[variant] + shards[1].results[variant]
        whole = single.results[variant]
        assert (merged.n_windows, merged.n_tokens) == (whole.n_windows, whole.n_tokens)
        for name, value in whole.statistics.arrays.items():
            assert torch.allclose(merged.statistics.arrays[name], value, rtol=1e-12, atol=1e-12), name
        assert merged.metadata["shards"]["indices"] == [0, 1, 2]
        # disjoint shards share no window, and the merge holds every window's fingerprint once
        assert np.array_equal(merged.statistics.window_fingerprints, whole.statistics.window_fingerprints)
        assert merged.metadata["shards"]["ranges"] == [[0, 2], [2, 4], [4, 7]]
        assert len(merged.entry_sample()["attention"]) == 40
    assert shards[0].trained.metadata["shards"]["corpus_sha256"] == single.trained.metadata["provenance"]["corpus"]["sha256"]


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    model = save_tiny_model_with_tokenizer(root / "model", kind="gpt2", n_positions=32)
    corpus = write_text_corpus(root / "corpus", n_docs=5, words=30)
    other = write_text_corpus(root / "other", n_docs=6, words=30)

    def run(out, *extra, corpus=corpus):
        arguments = ["run", "--out", str(root / out), "--model", model, "--corpus", corpus, "--context-length", "16",
                     "--baselines", "zero", "--no-progress", "--no-figures", "--sample-size", "0", *extra]
        assert main(arguments) == 0
        shard = [a for a in extra if "/" in a]
        subfolder = f"shard-{shard[0].replace('/', '-of-')}" if shard else ""
        return root / out / subfolder / "results.safetensors"

    return {
        "whole": run("whole", "--n-docs", "5"),
        "0/2": run("s0", "--n-docs", "5", "--shard", "0/2"),
        "1/2": run("s1", "--n-docs", "5", "--shard", "1/2"),
        "1/3": run("t1", "--n-docs", "5", "--shard", "1/3"),
        "other 1/2": run("o1", "--n-docs", "6", "--shard", "1/2", corpus=other),
        "seed 1/2": run("e1", "--n-docs", "5", "--shard", "1/2", "--seed", "1"),
        "root": root,
    }


def test_cli_merge_of_two_shards_equals_the_single_run(shard_files, capsys):
    out = shard_files["root"] / "merged.json"
    assert main(["merge", str(shard_files["0/2"]), str(shard_files["1/2"]), "-o", str(out)]) == 0
    merged, whole = ProbeResult.load(out), ProbeResult.load(shard_files["whole"])
    assert merged.complete and merged.n_windows == whole.n_windows == 5
    for name, value in whole.statistics.arrays.items():
        assert torch.allclose(merged.statistics.arrays[name], value, rtol=1e-12, atol=1e-12), name
    assert main(["merge", str(shard_files["0/2"]), "-o", str(shard_files["root"] / "half.json")]) == 0
    assert "shards [1] of 2 are still missing" in capsys.readouterr().out


def test_cli_merge_of_a_partial_shard_is_a_partial_merge_with_a_note(shard_files, tmp_path, capsys):
    result = ProbeResult.load(shard_files["1/2"])
    result.metadata["complete"] = False
    partial = result.save(tmp_path / "partial.json")
    out = tmp_path / "merged.json"
    assert main(["merge", str(shard_files["0/2"]), str(partial), "-o", str(out)]) == 0
    assert "merged result is partial" in capsys.readouterr().err
    merged, whole = ProbeResult.load(out), ProbeResult.load(shard_files["whole"])
    assert not merged.complete and merged.n_windows == whole.n_windows
    for name, value in whole.statistics.arrays.items():
        assert torch.allclose(merged.statistics.arrays[name], value, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize(
    "inputs, message",
    [
        (["0/2", "0/2"], "both results contain run"),
        (["0/2", "1/3"], "different shard counts"),
        (["0/2", "other 1/2"], "different corpora"),
        (["0/2", "seed 1/2"], "different study configurations"),
        (["0/2", "whole"], "not a shard"),
        (["0/2", "zero 1/2"], "different study variants"),
    ],
)
def test_cli_merge_refuses_what_would_double_count_or_mix(shard_files, tmp_path, capsys, inputs, message):
    paths = []
    for name in inputs:
        if name == "zero 1/2":
            paths.append(shard_files["1/2"].with_name("baseline_zero.safetensors"))
        else:
            paths.append(shard_files[name])
    assert main(["merge", *map(str, paths), "-o", str(tmp_path / "merged.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "merged.json").exists()


def test_overlapping_ranges_are_refused(shard_files):
    a = ProbeResult.load(shard_files["0/2"])
    b = ProbeResult.load(shard_files["1/2"])
    b.metadata["shards"] = {**b.metadata["shards"], "indices": [5], "count": 2, "ranges": [[1, 4]]}
    with pytest.raises(IncompatibleResultsError, match="shards overlap: documents 0..1 and 1..3"):
        a + b


def test_shard_auto_takes_rank_and_world_size_from_the_launcher(shard_files, monkeypatch, capsys):
    root = shard_files["root"]
    model, corpus = str(root / "model"), str(root / "corpus")
    arguments = ["run", "--out", str(root / "auto"), "--model", model, "--corpus", corpus, "--n-docs", "5",
                 "--context-length", "16", "--baselines", "none", "--no-progress", "--no-figures", "--shard", "auto"]
    for name in ("RANK", *SLURM_ARRAY):
        monkeypatch.delenv(name, raising=False)
    assert main(arguments) == 2
    assert "RANK and WORLD_SIZE" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(arguments) == 0
    result = ProbeResult.load(root / "auto" / "shard-1-of-2" / "results.safetensors")
    assert result.metadata["shards"]["ranges"] == [[2, 5]] and result.n_windows == 3


SLURM_ARRAY = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_STEP",
               "SLURM_ARRAY_TASK_COUNT")


def test_shard_auto_takes_the_task_of_a_slurm_job_array(shard_files, monkeypatch):
    """``sbatch --array=4-5`` on a two-shard corpus: task 5 is shard 1/2, the same documents and sums
    as ``--shard 1/2``."""
    root = shard_files["root"]
    for name in ("RANK", "WORLD_SIZE", *SLURM_ARRAY):
        monkeypatch.delenv(name, raising=False)
    for name, value in zip(SLURM_ARRAY, ("5", "4", "5", "1", "2"), strict=True):
        monkeypatch.setenv(name, value)
    arguments = ["run", "--out", str(root / "array"), "--model", str(root / "model"), "--corpus", str(root / "corpus"),
                 "--n-docs", "5", "--context-length", "16", "--baselines", "zero", "--no-progress", "--no-figures",
                 "--sample-size", "0", "--shard", "auto"]  # the options of shard_files' runs
    assert main(arguments) == 0
    result = ProbeResult.load(root / "array" / "shard-1-of-2" / "results.safetensors")
    assert result.metadata["shards"]["indices"] == [1] and result.metadata["shards"]["ranges"] == [[2, 5]]
    arrays = load_file(root / "array" / "shard-1-of-2" / "results.safetensors")
    explicit = load_file(shard_files["1/2"])
    assert arrays.keys() == explicit.keys()
    assert all(np.array_equal(arrays[key], explicit[key]) for key in arrays)
    assert result.n_windows == 3


@pytest.mark.parametrize(("variables", "shard"), [
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4"}, Shard(0, 4)),
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_MAX": "7",
      "SLURM_ARRAY_TASK_COUNT": "4"}, Shard(3, 4)),
    ({"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "12",
      "SLURM_ARRAY_TASK_STEP": "4", "SLURM_ARRAY_TASK_COUNT": "4"}, Shard(2, 4)),  # --array=0-12:4
    ({"RANK": "2", "WORLD_SIZE": "3"}, Shard(2, 3)),
])
def test_shard_from_the_environment_of_each_launcher(variables, shard):
    assert Shard.from_environment(variables) == shard


@pytest.mark.parametrize(("variables", "message"), [
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "0"}, "needs SLURM_ARRAY_TASK_COUNT, which is not set"),
    ({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4"},
     "SLURM_ARRAY_TASK_ID, which is 'x', not a whole number"),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4"},
     r"this task's ID lies outside its array \(SLURM_ARRAY_TASK_ID=5, SLURM_ARRAY_TASK_MIN=0"),
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "7",
      "SLURM_ARRAY_TASK_COUNT": "3"}, r"one range .*a count of 3 does not span 1\.\.7 .*sbatch --array=0-2"),  # 1,3,7
    ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "2", "RANK": "0",
      "WORLD_SIZE": "2"}, r"both a Slurm array task \(SLURM_ARRAY_TASK_ID=1\) and a torchrun/accelerate rank"),
])
def test_inconsistent_slurm_array_variables_are_refused_by_name(variables, message):
    with pytest.raises(InputError, match=message):
        Shard.from_environment(variables)
