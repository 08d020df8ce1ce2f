"""The shift study as a peer of ``run``: its options checked once, a study killed mid-grid (SIGKILL or SIGTERM)
resumes to the uninterrupted sums bitwise, and its files load lazily, verify each array and load after a
representation is added."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from synthetic import tiny_gpt2

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.cli import main
from equivariance_probe.errors import InputError, IntervalUnavailableError, ResultFileError
from equivariance_probe.records import shift_file
from equivariance_probe.records.container import read_container, read_tensors, tensor_checksum, write_container
from equivariance_probe.sources.shift_grid import ShiftOptions, default_offsets

REPO = Path(__file__).resolve().parents[1]
M = 8
OFFSETS = [0, 5, 20]

# Runs the command line in a process that signals itself when its third segment starts (two segments are in the
# checkpoint): SIGKILL ends it there, mid-grid, with no clean-up; SIGTERM asks it to stop before the next segment.
KILLER = """
import os, signal, sys
from equivariance_probe.probe import EquivarianceProbe
number = getattr(signal, sys.argv[1])
original = EquivarianceProbe._shift_segment
def shift_segment(self, grid, g, *args, **kwargs):
    if g == 2:
        os.kill(os.getpid(), number)
    return original(self, grid, g, *args, **kwargs)
EquivarianceProbe._shift_segment = shift_segment
from equivariance_probe.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def study(tiny_model_folder, text_corpus):
    model = tiny_model_folder("gemma3", n_positions=128)
    corpus = text_corpus(n_docs=8, words=60)

    def args(out, *extra):
        return ["shift", "-o", str(out), "--model", model, "--corpus", corpus, "--n-segments", "4", "--n-contexts", "2",
                "--segment-length", str(M), "--offsets", ",".join(map(str, OFFSETS)), "--interval-groups", "3",
                "--no-progress", "--no-figures", *extra]

    return args


def _assert_identical(a: ShiftResult, b: ShiftResult) -> None:
    assert a.statistics.arrays.keys() == b.statistics.arrays.keys()
    for name, value in a.statistics.arrays.items():
        assert np.array_equal(value, b.statistics.arrays[name]), name  # bitwise: the same additions in the same order
    assert np.array_equal(a.statistics.segment_fingerprints, b.statistics.segment_fingerprints)
    assert a.config == b.config


@pytest.mark.parametrize("sent", ["SIGKILL", "SIGTERM"])
def test_a_shift_study_stopped_mid_grid_resumes_to_the_uninterrupted_sums(study, tmp_path, sent):
    assert main(study(tmp_path / "whole")) == 0
    assert not (tmp_path / "whole" / "checkpoint").exists()  # removed once the results are on disk
    whole = ShiftResult.load(tmp_path / "whole" / "shift_trained.safetensors")
    out = tmp_path / "stopped"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    stopped = subprocess.run([sys.executable, "-c", KILLER, sent, *study(out)], env=environment, capture_output=True,
                             text=True, timeout=300)
    if sent == "SIGKILL":
        assert stopped.returncode == -signal.SIGKILL, stopped.stderr[-2000:]
    else:  # the third segment finishes and is checkpointed; the study stops before the fourth
        assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
        assert "--resume" in stopped.stderr
    assert not (out / "shift_trained.safetensors").exists()  # nothing that looks finished
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["current"]["position"] == (2 if sent == "SIGKILL" else 3)
    partial = ShiftResult.load(out / "checkpoint" / state["current"]["file"])
    assert not partial.complete and partial.n_segments == state["current"]["position"]
    assert main(study(out, "--resume")) == 0
    resumed = ShiftResult.load(out / "shift_trained.safetensors")
    _assert_identical(resumed, whole)
    assert resumed.complete and resumed.metadata["checkpoint"]["resumed_from"]["current"]["position"] > 0
    assert not (out / "checkpoint").exists()
    assert main(study(out, "--resume")) == 0  # finished: nothing left to run, nothing overwritten


def _design(n_segments=3, n_contexts=2, length=25, seed=0):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, 97, (M,), generator=generator).tolist() for _ in range(n_segments)]
    contexts = [torch.randint(3, 97, (length,), generator=generator).tolist() for _ in range(n_contexts)]
    return segments, contexts


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    segments, contexts = _design()
    result = EquivarianceProbe(tiny_gpt2()).shift(segments, contexts, offsets=OFFSETS, segment_length=M, progress=False,
                                                   interval_groups=2)
    return result, result.save(tmp_path_factory.mktemp("shift") / "shift.safetensors")


def test_a_file_loads_lazily_and_verify_names_a_corrupted_array(saved, tmp_path):
    result, path = saved
    loaded = ShiftResult.load(path)
    assert loaded._statistics is None  # the header alone so far
    assert loaded.n_segments == 3 and loaded.config == result.config and loaded.offsets == tuple(OFFSETS)
    assert loaded.verify() == "digests"
    _assert_identical(loaded, result)
    corrupted = tmp_path / "corrupted.safetensors"
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8:8 + length])["centred_logits/within"]["data_offsets"]
    data[8 + length + begin] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    opened = ShiftResult.load(corrupted)  # the header is intact: opening reads no array
    assert opened.n_segments == 3
    with pytest.raises(ResultFileError, match="'centred_logits/within' does not match its digest"):
        opened.verify()


def _without(path, source, prefix):
    """``source`` rewritten as a file written before the representation ``prefix`` existed: its arrays left out."""
    container = read_container(source, shift_file.SHIFT_KIND)
    tensors = {name: value for name, value in read_tensors(container).items() if not name.startswith(prefix)}
    header = {key: value for key, value in container.header.items() if key not in ("digests", "header_checksum")}
    header["checksum"] = tensor_checksum(tensors)
    return write_container(path, tensors, header)


def test_a_file_written_before_a_representation_was_added_loads_with_it_undefined(saved, tmp_path, monkeypatch):
    result, path = saved
    old = _without(tmp_path / "old.safetensors", path, "raw_weights/")
    with pytest.raises(ResultFileError, match="'raw_weights/count' must be F64"):  # not declared as added: malformed
        ShiftResult.load(old)
    # Declared as a later format's representation, as adding one declares it: older files read it as not measured.
    monkeypatch.setitem(shift_file.SHIFT_ADDED, "raw_weights/", shift_file.Added(shift_file.SHIFT_FORMAT_VERSION + 1,
                                                                             "the raw attention weights"))
    loaded = ShiftResult.load(old)
    assert loaded.verify() == "digests"
    assert np.isnan(loaded.share("raw_weights", "offset"))
    assert "raw_weights" in loaded.undefined
    for representation in ("centred_logits", "conditional_weights", "residual"):
        for term in ("offset", "pair", "context"):
            assert loaded.share(representation, term) == result.share(representation, term)
    assert loaded.loss_by_offset().tolist() == result.loss_by_offset().tolist()


def test_shift_options_are_checked_once_and_settle_the_default_offsets():
    with pytest.raises(InputError, match="batch_size must be a positive integer, not 0"):
        ShiftOptions(batch_size=0)
    with pytest.raises(InputError, match="batch_size must be a positive integer, not 1.5"):
        EquivarianceProbe(tiny_gpt2()).shift(*_design(), offsets=OFFSETS, segment_length=M, batch_size=1.5)
    with pytest.raises(InputError, match="interval_groups must be a non-negative integer"):
        ShiftOptions(interval_groups=-1)
    with pytest.raises(InputError, match="at least two distinct"):
        ShiftOptions(offsets=[5, 5])
    with pytest.raises(InputError, match="offsets must be non-negative integers; 2.5"):
        ShiftOptions(offsets=[0, 2.5])
    with pytest.raises(InputError, match="segment_length=1"):
        ShiftOptions(segment_length=1)
    with pytest.raises(InputError, match="mode"):
        ShiftOptions(mode="tokens")
    with pytest.raises(InputError, match="predictions must be True, False or None"):
        ShiftOptions(predictions="yes")
    with pytest.raises(TypeError, match="offset is not a shift option"):
        ShiftOptions().replace(offset=[0, 1])
    with pytest.raises(TypeError, match="options must be a ShiftOptions"):
        EquivarianceProbe(tiny_gpt2()).shift(*_design(), [0, 5])
    assert ShiftOptions(offsets=[20, 0, 5]).offsets == (0, 5, 20)
    probe = EquivarianceProbe(tiny_gpt2())
    layout = probe.adapter.layout
    assert ShiftOptions(segment_length=M).resolved(layout, 0).offsets == default_offsets(layout.max_context, 0, M)
    # interval_groups=0 means no intervals, as for run: the sums in one row, and an interval says why there is none
    none = probe.shift(*_design(), ShiftOptions(offsets=OFFSETS, segment_length=M, interval_groups=0), progress=False)
    one = probe.shift(*_design(), offsets=OFFSETS, segment_length=M, interval_groups=1, progress=False)
    assert none.config.interval_groups == 0 and none.statistics.arrays["segments"].shape == (1,)
    for name, value in one.statistics.arrays.items():
        assert np.array_equal(none.statistics.arrays[name], value), name
    with pytest.raises(IntervalUnavailableError, match="interval_groups=0"):
        none.share("centred_logits", "offset", interval=0.95)


def test_resume_from_a_partial_result_adds_what_the_uninterrupted_run_adds():
    segments, contexts = _design(n_segments=4)
    probe = EquivarianceProbe(tiny_gpt2())
    options = ShiftOptions(offsets=OFFSETS, segment_length=M, interval_groups=2)
    whole = probe.shift(segments, contexts, options, progress=False)
    calls = []
    original = probe.adapter.run_plan

    def failing(*args, **kwargs):
        calls.append(1)
        # the recompute check's pass, two segments' grids (2 contexts × 3 offsets), then the connection drops
        if len(calls) > 1 + 2 * 2 * len(OFFSETS):
            raise ConnectionError("the connection dropped")
        return original(*args, **kwargs)

    probe.adapter.run_plan = failing
    with pytest.raises(ConnectionError) as stopped:
        probe.shift(segments, contexts, options, progress=False)
    partial = stopped.value.partial_result
    assert partial.n_segments == 2 and not partial.complete
    probe.adapter.run_plan = original
    resumed = probe.shift(segments, contexts, options, progress=False, resume_from=partial)
    assert resumed.complete
    _assert_identical(resumed, whole)
    with pytest.raises(InputError, match="another run's segments or design"):
        probe.shift(segments[1:], contexts, options, progress=False, resume_from=partial)
    with pytest.raises(InputError, match="interval_groups"):
        probe.shift(segments, contexts, options.replace(interval_groups=3), progress=False, resume_from=partial)


def test_a_locked_folder_and_a_checkpoint_of_other_options_are_refused(study, tmp_path, capsys, monkeypatch):
    from equivariance_probe.runs.checkpoint import CheckpointedRun, lock_output_folder

    out = tmp_path / "out"
    out.mkdir()
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with lock_output_folder(out):  # another process holds the folder: the study starts nothing
        held = subprocess.run([sys.executable, "-m", "equivariance_probe.cli", *study(out)], capture_output=True,
                              text=True, env=environment)
    assert held.returncode == 2 and "in use by another equivariance-probe run" in held.stderr
    assert not (out / "checkpoint").exists()
    save_progress = CheckpointedRun.save_progress

    def save_then_stop(self, *args):
        save_progress(self, *args)
        raise KeyboardInterrupt  # stopped right after its first checkpoint

    monkeypatch.setattr(CheckpointedRun, "save_progress", save_then_stop)
    assert main(study(out)) == 130
    monkeypatch.setattr(CheckpointedRun, "save_progress", save_progress)
    assert json.loads((out / "checkpoint" / "state.json").read_text())["current"]["position"] == 1
    capsys.readouterr()
    assert main(study(out, "--resume", "--interval-groups", "2")) == 2
    assert "different config" in capsys.readouterr().err
    assert main(study(out, "--resume")) == 0
