"""Checkpoints: a study killed with SIGKILL at any moment and resumed gives the statistics of an
uninterrupted run, bitwise; checkpoints of another model, corpus or configuration are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from equivariance_probe import CheckpointError, EquivarianceProbe, ProbeResult, run_study
from equivariance_probe.runs.checkpoint import clear_checkpoint
from equivariance_probe.cli import main

from synthetic import tiny_gemma3

REPO = Path(__file__).resolve().parents[1]

# Kills its own process with SIGKILL (no cleanup, no finally blocks) at a chosen moment, then runs the CLI.
KILLER = """
import os, signal, sys
where, when = sys.argv[1], int(sys.argv[2])
calls = {"n": 0}
def kill_on(n):
    calls["n"] += 1
    if calls["n"] == n:
        os.kill(os.getpid(), signal.SIGKILL)
if where == "batch":      # in the middle of a forward pass: the chunk's batches so far are lost
    from equivariance_probe.probe import EquivarianceProbe
    original = EquivarianceProbe._run_batch
    def run_batch(self, *args, **kwargs):
        kill_on(when)
        return original(self, *args, **kwargs)
    EquivarianceProbe._run_batch = run_batch
else:                     # after state.json.tmp is written, before it is renamed over state.json
    import equivariance_probe.records.fileformat as fileformat  # where every atomic JSON write renames
    replace = os.replace
    class Os:
        def __getattr__(self, name):
            return getattr(os, name)
        def replace(self, source, target):
            if str(target).endswith("state.json"):
                kill_on(when)
            return replace(source, target)
    fileformat.os = Os()
from equivariance_probe.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_folder, text_corpus):
    root = tmp_path_factory.mktemp("resume")
    model = tiny_model_folder("gemma3", 64)
    corpus = text_corpus(n_docs=12, words=40)
    (Path(corpus) / "doc5.txt").write_text("   ")  # a blank file: the corpus reader drops it
    return root, model, corpus


def _args(out, model, corpus, *extra):
    # 12 documents, batches of 2, a checkpoint every 3 documents: 2 batches per chunk, 4 chunks per variant.
    return ["run", "--out", str(out), "--model", model, "--corpus", corpus, "--n-docs", "12", "--context-length", "32",
            "--batch-size", "2", "--checkpoint-every", "3", "--baselines", "zero", "--sample-size", "50",
            "--no-progress", "--no-figures", *extra]


def _assert_identical(a: ProbeResult, b: ProbeResult) -> None:
    assert (a.n_windows, a.n_tokens) == (b.n_windows, b.n_tokens)
    for name, value in a.statistics.arrays.items():
        assert torch.equal(value, b.statistics.arrays[name]), name
    for column, value in a.statistics.sample.to_arrays().items():
        assert (value == b.statistics.sample.to_arrays()[column]).all(), column
    # the interval groups too, so the intervals are the same bits
    assert (a.statistics.groups.ids == b.statistics.groups.ids).all()
    for name, value in a.statistics.groups.rows.items():
        assert torch.equal(value, b.statistics.groups.rows[name]), name
    assert a.summary()["intervals"] == b.summary()["intervals"]
    assert a.metadata["skipped_windows"] == b.metadata["skipped_windows"]


@pytest.fixture(scope="module")
def uninterrupted(tiny):
    root, model, corpus = tiny
    out = root / "uninterrupted"
    assert main(_args(out, model, corpus)) == 0
    assert not (out / "checkpoint").exists()  # removed once the results are on disk
    return {name: ProbeResult.load(out / name) for name in ("results.safetensors", "baseline_zero.safetensors")}


@pytest.mark.parametrize(
    "where, when",
    [
        ("batch", 7),  # trained model, 4th chunk, after checkpoints at documents 3, 6 and 9
        ("state", 5),  # trained model finished; while writing the zero baseline's first checkpoint
                       # (state.json.tmp written, not yet renamed)
    ],
)
def test_a_killed_run_resumes_to_the_uninterrupted_statistics(tiny, uninterrupted, tmp_path, where, when):
    root, model, corpus = tiny
    out = tmp_path / "out"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", KILLER, where, str(when), *_args(out, model, corpus)],
                            env=environment, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "results.safetensors").exists()  # a killed run leaves no result that looks complete
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["done"] or state["current"]["position"] > 0
    assert main(_args(out, model, corpus, "--resume")) == 0
    for name, expected in uninterrupted.items():
        resumed = ProbeResult.load(out / name)
        _assert_identical(resumed, expected)
        assert resumed.complete
    assert ProbeResult.load(out / "baseline_zero.safetensors").metadata["checkpoint"]["resumed_from"] is not None
    assert not (out / "checkpoint").exists()


def test_checkpointing_changes_no_number(tiny, uninterrupted, tmp_path):
    """Against a run without checkpoints (one chunk) the sums agree to float64 rounding."""
    root, model, corpus = tiny
    out = tmp_path / "plain"
    assert main([a if a != "3" else "0" for a in _args(out, model, corpus)]) == 0
    plain = ProbeResult.load(out / "results.safetensors")
    assert plain.metadata["checkpoint"]["every"] is None
    checkpointed = uninterrupted["results.safetensors"]
    assert plain.n_windows == checkpointed.n_windows == 11  # the blank file is dropped by the corpus reader
    for name, value in plain.statistics.arrays.items():
        assert torch.allclose(checkpointed.statistics.arrays[name], value, rtol=1e-12, atol=1e-12), name


class _Stop(Exception):
    pass


def _interrupted_study(folder, docs, network, tokenizer, monkeypatch, stop_at=3, **options):
    """A study stopped by an error in its ``stop_at``-th batch, leaving its checkpoint in ``folder``."""
    original = EquivarianceProbe._run_batch
    calls = {"n": 0}

    def run_batch(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(EquivarianceProbe, "_run_batch", run_batch)
        with pytest.raises(KeyboardInterrupt) as caught:
            run_study(corpus=docs, n_docs=len(docs), loaded=(network, tokenizer), checkpoint_dir=folder,
                      checkpoint_every=2, batch_size=1, **options)
    return caught.value


@pytest.fixture()
def setup():
    from synthetic import WORDS

    docs = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(6)]
    return docs, tiny_gemma3(), _WordTokenizer()


class _WordTokenizer:
    pad_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [3 + len(w) * 7 % 90 for w in text.split()]}


def test_api_resume_equals_uninterrupted_and_keeps_the_partial_result(setup, tmp_path, monkeypatch):
    docs, network, tokenizer = setup
    options = dict(context_length=16, baselines=(), sample_size=30, progress=False)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "results.safetensors").write_text("the user's own file")  # never touched by checkpoints
    error = _interrupted_study(tmp_path / "ck", docs, network, tokenizer, monkeypatch, stop_at=4, **options)
    assert error.partial_result.n_windows == 3 and not error.partial_result.complete
    resumed = run_study(corpus=docs, n_docs=6, loaded=(network, tokenizer), checkpoint_dir=tmp_path / "ck",
                        checkpoint_every=2, batch_size=1, resume=True, **options)
    whole = run_study(corpus=docs, n_docs=6, loaded=(network, tokenizer), checkpoint_dir=tmp_path / "ck2",
                      checkpoint_every=2, batch_size=1, **options)
    _assert_identical(resumed.trained, whole.trained)
    assert resumed.trained.metadata["checkpoint"]["resumed_from"]["current"]["position"] == 2
    clear_checkpoint(tmp_path / "ck")
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["results.safetensors"]
    assert (tmp_path / "ck" / "results.safetensors").read_text() == "the user's own file"


def test_a_checkpoint_of_another_model_corpus_or_configuration_is_refused(setup, tmp_path, monkeypatch):
    docs, network, tokenizer = setup
    options = dict(context_length=16, baselines=(), sample_size=0, progress=False)
    folder = tmp_path / "ck"
    _interrupted_study(folder, docs, network, tokenizer, monkeypatch, **options)

    def resume(**changes):
        arguments = dict(corpus=docs, n_docs=6, loaded=(network, tokenizer), checkpoint_dir=folder,
                         checkpoint_every=2, batch_size=1, resume=True, **options)
        arguments.update(changes)
        return run_study(**arguments)

    with pytest.raises(CheckpointError, match="different model.*weights_sha256"):
        resume(loaded=(tiny_gemma3(seed=1), tokenizer))
    with pytest.raises(CheckpointError, match="different corpus"):
        resume(corpus=list(reversed(docs)))
    with pytest.raises(CheckpointError, match="different config.*context_length: 16 then, 12 now"):
        resume(context_length=12)
    with pytest.raises(CheckpointError, match="different config.*checkpoint_every"):
        resume(checkpoint_every=3)
    with pytest.raises(CheckpointError, match="unfinished run; pass resume=True"):
        resume(resume=False)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resume(checkpoint_dir=tmp_path / "nothing")
    (folder / "state.json").write_text('{"kind": "equivariance_probe.StudyCheckpoint", "format_ver')
    with pytest.raises(CheckpointError, match="cannot be read"):
        resume()


def test_cli_refuses_a_foreign_checkpoint_with_status_2(tiny, tmp_path, capsys):
    root, model, corpus = tiny
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps({
        "kind": "equivariance_probe.StudyCheckpoint", "format_version": 1, "fingerprint": "0" * 64,
        "identity": {"model": {"weights_sha256": "f" * 64}, "corpus": {}, "config": {}}, "every": 3,
        "done": {}, "current": None}))
    assert main(_args(out, model, corpus, "--resume")) == 2
    error = capsys.readouterr().err
    assert "different model and corpus and config" in error and "another --out folder" in error
    assert main(_args(out, model, corpus)) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert not (out / "results.safetensors").exists()


def test_saving_a_checkpointed_study_links_the_finished_files_instead_of_rewriting_them(setup, tmp_path):
    docs, network, tokenizer = setup
    study = run_study(corpus=docs, n_docs=6, loaded=(network, tokenizer), checkpoint_dir=tmp_path / "ck",
                      checkpoint_every=4, batch_size=2, context_length=16, baselines=("zero",), sample_size=30,
                      progress=False)
    study.save(tmp_path / "out")
    for name, filename in (("trained", "results.safetensors"), ("zero", "baseline_zero.safetensors")):
        written, finished = tmp_path / "out" / filename, tmp_path / "ck" / f"{name}-done.safetensors"
        assert os.path.samefile(written, finished)  # one file on disk, not a second encoding
        # ...holding exactly what ProbeResult.save writes for the study's result, final metadata included
        study.results[name].save(tmp_path / f"direct-{name}.json")
        assert written.read_bytes() == (tmp_path / f"direct-{name}.json").read_bytes()
        assert ProbeResult.load(written).metadata["label"] == name
    clear_checkpoint(tmp_path / "ck")
    assert ProbeResult.load(tmp_path / "out" / "results.safetensors").complete  # the link outlives the checkpoint

    # A result changed after the run no longer matches its checkpoint copy: it is written anew.
    study2 = run_study(corpus=docs, n_docs=6, loaded=(network, tokenizer), checkpoint_dir=tmp_path / "ck2",
                       checkpoint_every=4, batch_size=2, context_length=16, baselines=(), sample_size=30,
                       progress=False)
    study2.trained.metadata["note"] = "edited"
    study2.save(tmp_path / "out2")
    assert not os.path.samefile(tmp_path / "out2" / "results.safetensors", tmp_path / "ck2" / "trained-done.safetensors")
    assert ProbeResult.load(tmp_path / "out2" / "results.safetensors").metadata["note"] == "edited"


def test_a_kill_while_the_checkpoint_is_cleared_leaves_a_run_that_resumes(tiny, tmp_path, monkeypatch, capsys):
    """Killed while its checkpoint is cleared: were a finished variant's file deleted before state.json,
    the state would point to a deleted file and --resume refuse it as unreadable (tests/test_resume_faults.py
    lands kills there)."""
    import equivariance_probe.runs.checkpoint as checkpoint

    root, model, corpus = tiny
    out = tmp_path / "out"
    deleted = []
    real_unlink = Path.unlink

    def dying_unlink(self, *args, **kwargs):  # the first file the clearing deletes, then the kill
        real_unlink(self, *args, **kwargs)
        if self.parent.name == "checkpoint":
            deleted.append(self.name)
            raise KeyboardInterrupt

    real_clear = checkpoint.clear_checkpoint

    def clear_then_die(folder):
        monkeypatch.setattr(Path, "unlink", dying_unlink)
        try:
            real_clear(folder)
        finally:
            monkeypatch.setattr(Path, "unlink", real_unlink)

    monkeypatch.setattr(checkpoint, "clear_checkpoint", clear_then_die)
    assert main(_args(out, model, corpus)) == 130
    monkeypatch.setattr(checkpoint, "clear_checkpoint", real_clear)
    assert deleted == ["state.json"]  # the state goes first: no state points to a deleted file
    capsys.readouterr()
    assert main(_args(out, model, corpus, "--resume")) == 0
    assert "had finished" in capsys.readouterr().out
    assert ProbeResult.load(out / "results.safetensors").complete and not (out / "checkpoint").exists()


# Writes one large safetensors file, long enough for the parent to see what lies in its folder mid-write.
_SAVE_LARGE = """
import sys, numpy as np
from safetensors.numpy import save_file
save_file({"sums": np.zeros(2**25, dtype=np.float32)}, sys.argv[1])
"""


def test_a_kill_inside_safetensors_own_write_leaves_nothing_the_clearing_keeps(tmp_path):
    """safetensors' ``save_file`` writes a temporary of its own (``.tmpXXXXXX``) beside its
    destination and renames it, so a SIGKILL inside it leaves that file among the checkpoint's;
    clearing the finished checkpoint removes it and the folder, and still keeps any file a
    checkpoint never writes. The leftover is whatever the killed write left besides its
    destination, found without the checkpoint's own file pattern."""
    import time

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    destination = "trained-done.safetensors.tmp"  # the name write_atomically hands to save_file
    leftovers: list[str] = []
    for _ in range(5):  # the parent polls for the temporary; a write that outran the poll is retried
        child = subprocess.Popen([sys.executable, "-c", _SAVE_LARGE, str(folder / destination)])
        while child.poll() is None and not leftovers:
            leftovers = [name for name in os.listdir(folder) if name != destination]
            time.sleep(0.0005)
        child.kill()
        child.wait()
        if leftovers:
            break
        for path in folder.iterdir():
            path.unlink()
    if not leftovers:
        pytest.skip("this safetensors writes its file in place (no temporary of its own was seen)")
    assert all(name.startswith(".tmp") for name in leftovers), leftovers
    (folder / "state.json").write_text("{}")
    clear_checkpoint(folder)
    assert not folder.exists()

    folder.mkdir()
    (folder / ".tmpAb12Cd").write_bytes(b"")
    (folder / "notes.txt").write_text("the user's own file")
    clear_checkpoint(folder)
    assert sorted(os.listdir(folder)) == ["notes.txt"]
