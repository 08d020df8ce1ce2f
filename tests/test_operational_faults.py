"""Faults a cluster produces, on real files and real processes, each with what it gets.

* a full disk (a real 1 MiB tmpfs, or an injected ``ENOSPC`` where nothing can be mounted): one
  line naming the file and the space it needed, exit 2, and a checkpoint that ``--resume``, once
  space is freed, finishes bitwise equal to an uninterrupted run; a report or figure likewise;
* a flipped byte in a real result file: refused by ``ProbeResult.load``, by every merge and by
  ``show --verify`` / ``verify``, naming the file and the array; ``show`` reads the header alone and
  says so; a file written before per-array digests still loads, flagged;
* two real processes on one output folder: the second is refused, naming the first's process id,
  and a lock left by a dead process is no obstacle;
* SIGTERM to a real command-line run: one line saying how to resume, exit 143, and ``--resume``
  finishes bitwise equal to an uninterrupted run.

Runs use the tiny stand-in model of the other command-line tests, without interval groups (each
checkpoint then costs milliseconds, not a jackknife).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from filesystems import tmpfs

from equivariance_probe import ProbeResult
from equivariance_probe.cli import main
from equivariance_probe.errors import FileWriteError, ResultFileError

RESULT_FILES = ("results.safetensors", "baseline_random_init.safetensors")
PAGE = 4096  # tmpfs allocates whole pages

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals, flock and tmpfs")


@pytest.fixture(scope="module")
def tiny(tiny_model_folder, text_corpus):
    return tiny_model_folder("gpt2", 64), text_corpus(n_docs=6, words=40)


def _arguments(out: Path, model: str, corpus: str, *extra: str) -> list[str]:
    return ["run", "--out", str(out), "--model", model, "--corpus", corpus, "--n-docs", "6", "--context-length", "16",
            "--batch-size", "1", "--checkpoint-every", "2", "--baselines", "random_init", "--sample-size", "50",
            "--interval-groups", "0", "--no-figures", "--no-progress", *extra]


def _environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The uninterrupted run: its folder and every array of its result files."""
    model, corpus = tiny
    out = tmp_path_factory.mktemp("reference") / "out"
    assert main(_arguments(out, model, corpus)) == 0
    return out, _arrays(out)


def _arrays(out: Path) -> dict[str, dict[str, np.ndarray]]:
    return {name: load_file(out / name) for name in RESULT_FILES}


def _lines(stderr: str) -> list[str]:
    """What the program printed on stderr, without transformers' own weight-loading bar."""
    return [line for line in stderr.strip().splitlines() if not line.startswith(("Loading weights", "Writing model"))]


def _assert_bitwise_equal(out: Path, reference: dict[str, dict[str, np.ndarray]]) -> None:
    arrays = _arrays(out)
    for name in RESULT_FILES:
        assert sorted(arrays[name]) == sorted(reference[name])
        for key, value in reference[name].items():
            assert arrays[name][key].dtype == value.dtype and arrays[name][key].tobytes() == value.tobytes(), (name, key)
    assert not (out / "checkpoint").exists()


# -- a full disk -----------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB tmpfs file system, unmounted afterwards (skipped where it cannot be mounted)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    yield from tmpfs(folder, "size=1m")


def _fill(disk: Path, leave: int) -> Path:
    """A ballast file that leaves ``leave`` bytes (whole pages) free on ``disk``."""
    ballast = disk / "ballast"
    size = shutil.disk_usage(disk).free - leave
    ballast.write_bytes(b"\0" * size)
    assert shutil.disk_usage(disk).free == leave
    return ballast


def _enospc_after(calls: int, monkeypatch) -> None:
    """Every file write is flushed with os.fsync: the ``calls``-th one fails as a full disk would."""
    original, seen = os.fsync, [0]

    def fsync(descriptor: int) -> None:
        seen[0] += 1
        if seen[0] >= calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("disk", ["tmpfs", "injected"])
def test_a_full_disk_is_one_line_and_resume_after_freeing_space_is_bitwise_the_uninterrupted_run(
        disk, tiny, reference, request, tmp_path, monkeypatch, capsys):
    model, corpus = tiny
    reference_out, reference_arrays = reference
    # The trained variant's finished file and one chunk of the baseline fit; the baseline's next chunk,
    # written while the previous one still exists, does not: the disk fills mid-run, after checkpoints.
    file_pages = math.ceil((reference_out / "results.safetensors").stat().st_size / PAGE)
    if disk == "tmpfs":
        out = request.getfixturevalue("small_disk") / "out"
        ballast = _fill(out.parent, (2 * file_pages + 5) * PAGE)
    else:
        out = tmp_path / "out"
        # writes: trained chunk, state, trained chunk, state, trained done, state, baseline chunk, state,
        # baseline chunk (the ninth)
        _enospc_after(9, monkeypatch)
    assert main(_arguments(out, model, corpus)) == 2
    error = capsys.readouterr().err
    assert len(_lines(error)) == 1, error
    assert "random_init-000000004.safetensors" in error and "no space left on the device" in error
    needed = int(error.split("the file needs ")[1].split("(")[1].split(" bytes")[0])
    assert needed >= (reference_out / "results.safetensors").stat().st_size * 0.9
    assert "the checkpoint in" in error and "--resume" in error
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["done"] == {"trained": "trained-done.safetensors"} and state["current"]["position"] == 2
    assert not list((out / "checkpoint").glob("*.tmp*")), "a failed write leaves no temporary file"
    assert not (out / "results.safetensors").exists()

    if disk == "tmpfs":
        ballast.unlink()
    else:
        monkeypatch.undo()
    assert main(_arguments(out, model, corpus, "--resume")) == 0
    capsys.readouterr()
    _assert_bitwise_equal(out, reference_arrays)


def test_a_report_or_figure_on_a_full_disk_names_the_file_and_its_size(reference, small_disk, capsys):
    reference_out, _ = reference
    _fill(small_disk, 0)
    assert main(["report", str(reference_out / "results.safetensors"), "-o", str(small_disk / "report.html")]) == 2
    error = capsys.readouterr().err
    assert len(_lines(error)) == 1 and "report.html" in error and "the file needs" in error, error
    assert not list(small_disk.glob("report.html*"))

    from equivariance_probe.display.figures import pyplot, save_figures

    figure = pyplot().figure()
    with pytest.raises(FileWriteError, match=r"persistence\.png.*no space left.*the file needs"):
        save_figures({"persistence": figure}, small_disk)


def test_a_folder_that_cannot_be_created_is_a_named_error_not_a_traceback(tmp_path):
    from equivariance_probe.display.figures import pyplot, save_figures
    from equivariance_probe.runs.checkpoint import CheckpointedRun

    blocked = tmp_path / "a file"
    blocked.write_text("in the way")
    with pytest.raises(FileWriteError, match=r"cannot create the folder .*a file/checkpoint.*NotADirectoryError"):
        CheckpointedRun(blocked / "checkpoint", every=2, identity={"model": "m", "corpus": "c", "config": {}})
    with pytest.raises(FileWriteError, match=r"cannot create the folder .*a file/figures"):
        save_figures({"empty": pyplot().figure()}, blocked / "figures")


# -- a corrupted file ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory):
    """The two shards' result files of one run, each written by the command line."""
    model, corpus = tiny
    out = tmp_path_factory.mktemp("shards")
    for shard in ("0/2", "1/2"):
        assert main(["run", "--out", str(out), "--model", model, "--corpus", corpus, "--n-docs", "6",
                     "--context-length", "16", "--baselines", "none", "--sample-size", "50", "--interval-groups", "0",
                     "--checkpoint-every", "0", "--shard", shard, "--no-figures", "--no-progress"]) == 0
    return out / "shard-0-of-2" / "results.safetensors", out / "shard-1-of-2" / "results.safetensors"


def _flip_a_byte(path: Path, array: str, out: Path) -> Path:
    """A copy of ``path`` with one bit flipped inside ``array``'s data (safetensors: an 8-byte
    header length, the JSON header with each tensor's data_offsets, then the data)."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + length])[array]["data_offsets"]
    data[8 + length + (begin + end) // 2] ^= 0x10
    out.write_bytes(bytes(data))
    return out


def test_a_flipped_byte_is_refused_by_load_merge_and_verify_naming_the_file_and_the_array(shards, tmp_path, capsys):
    first, second = shards
    corrupted = _flip_a_byte(second, "log_sum", tmp_path / "shard-1-corrupted.safetensors")
    named = rf"{corrupted}: the array 'log_sum' does not match its digest"

    loaded = ProbeResult.load(corrupted)  # the header is intact: it opens
    with pytest.raises(ResultFileError, match=named):
        loaded.statistics
    with pytest.raises(ResultFileError, match=named):
        ProbeResult.load(first).merge(ProbeResult.load(corrupted))

    merged = tmp_path / "merged.safetensors"
    assert main(["merge", str(first), str(corrupted), "-o", str(merged)]) == 2
    assert "the array 'log_sum' does not match its digest" in capsys.readouterr().err
    assert not merged.exists()
    assert main(["merge", str(first), str(second), "-o", str(merged)]) == 0  # the intact shards merge
    capsys.readouterr()

    # show reads the header alone, and says so; --verify reads and checks every array
    assert main(["show", str(corrupted)]) == 0
    assert "read from the headers alone: the arrays were not read or checked" in capsys.readouterr().out
    assert main(["show", "--verify", str(corrupted)]) == 2
    error = capsys.readouterr().err
    assert len(_lines(error)) == 1 and str(corrupted) in error and "'log_sum'" in error
    assert main(["show", "--verify", str(first)]) == 0
    assert "every array was read and matches its digest" in capsys.readouterr().out

    assert main(["verify", str(first), str(corrupted)]) == 2
    shown = capsys.readouterr()
    assert f"{first}: every array matches its digest" in shown.out
    assert str(corrupted) in shown.err and "'log_sum'" in shown.err


def test_files_written_before_digests_still_load_flagged_unverified(shards, tmp_path, capsys):
    from synthetic import edited_result_file

    first, _ = shards
    older = edited_result_file(first, tmp_path / "older.safetensors", lambda header: header.pop("digests"))
    result = ProbeResult.load(older)
    assert result.integrity == "checksum" and ProbeResult.load(first).integrity == "digests"
    assert result.verify() == "checksum"
    np.testing.assert_array_equal(result.statistics.numpy()["log_sum"], ProbeResult.load(first).statistics.numpy()["log_sum"])
    assert main(["show", str(older)]) == 0
    assert f"unverified array by array: {older} was written before per-array digests" in capsys.readouterr().out
    assert main(["verify", str(older)]) == 0
    assert "unverified array by array (written before per-array digests)" in capsys.readouterr().out
    # its whole-file checksum still catches a flipped byte, without naming the array
    with pytest.raises(ResultFileError, match="checksum does not match the arrays"):
        ProbeResult.load(_flip_a_byte(older, "log_sum", tmp_path / "older-corrupted.safetensors")).statistics
    legacy = Path(__file__).parent / "data" / "result_format_v1.json"
    assert ProbeResult.load(legacy).integrity == "unverified"


# -- one writer per folder -------------------------------------------------------------------------------
# The command line in a real process that stops itself (SIGSTOP) once its first checkpoint's state is in
# place, so that the parent acts at a moment the run reports, not at one it hopes to catch by polling.
_STOP_AT_FIRST_CHECKPOINT = """
import os, signal, sys
from equivariance_probe.cli import main
replace, stopped = os.replace, []
def replacing(source, destination, *args, **kwargs):
    replace(source, destination, *args, **kwargs)
    if os.fspath(destination).endswith("state.json") and not stopped:
        stopped.append(True)
        os.kill(os.getpid(), signal.SIGSTOP)
os.replace = replacing
sys.exit(main(sys.argv[1:]))
"""


def _stopping_at_first_checkpoint(arguments: list[str], **popen) -> subprocess.Popen:
    """A command-line run that has stopped itself right after writing its first checkpoint."""
    process = subprocess.Popen([sys.executable, "-c", _STOP_AT_FIRST_CHECKPOINT, *arguments], env=_environment(),
                               **popen)
    _, status = os.waitpid(process.pid, os.WUNTRACED)  # returns when it stops (or, wrongly, ends)
    if not os.WIFSTOPPED(status):
        process.returncode = os.waitstatus_to_exitcode(status)
        raise AssertionError(f"the run ended (status {process.returncode}) before its first checkpoint")
    return process


def _lock_holder(out: Path) -> str:
    from equivariance_probe.runs.checkpoint import LOCK_FILE

    try:
        return (out / LOCK_FILE).read_text()
    except OSError:
        return ""


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first_process(tiny, reference, tmp_path, capsys):
    model, corpus = tiny
    out = tmp_path / "out"
    out.mkdir()
    # A lock left by a process killed while holding it is no obstacle: the kernel released it.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from equivariance_probe.runs.checkpoint import lock_output_folder; "
                               "lock = lock_output_folder(sys.argv[1]); lock.__enter__(); print('held', flush=True); "
                               "time.sleep(600)", str(out)],
        stdout=subprocess.PIPE, text=True, env=_environment())
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert _lock_holder(out).split()[0] == str(holder.pid)  # its file is still there

    first = _stopping_at_first_checkpoint(_arguments(out, model, corpus), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True)
    try:  # it stopped mid-run, holding the folder, for as long as the second one takes
        assert _lock_holder(out).startswith(f"{first.pid} ")
        assert main(_arguments(out, model, corpus)) == 2
        error = capsys.readouterr().err
        assert len(_lines(error)) == 1 and f"in use by another equivariance-probe run (process {first.pid} " in error
        assert main(_arguments(out, model, corpus, "--resume")) == 2  # --resume too
        assert f"process {first.pid} " in capsys.readouterr().err
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
    assert _lock_holder(out) == ""  # released and removed
    _assert_bitwise_equal(out, reference[1])  # the first run was not disturbed


# -- a scheduler's SIGTERM -------------------------------------------------------------------------------
def test_sigterm_stops_with_one_line_exit_143_and_resume_is_bitwise_the_uninterrupted_run(tiny, reference, tmp_path,
                                                                                          capsys):
    model, corpus = tiny
    out = tmp_path / "out"
    run = _stopping_at_first_checkpoint(_arguments(out, model, corpus), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
    try:  # SIGTERM while it is stopped after its first checkpoint: the handler runs as it continues
        run.send_signal(signal.SIGTERM)
        os.kill(run.pid, signal.SIGCONT)
        stdout, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 143, stderr
    lines = _lines(stderr)
    assert len(lines) == 1, stderr
    assert lines[0].startswith("equivariance-probe run: stopped by SIGTERM before the next batch; the checkpoint in ")
    assert lines[0].endswith("run the same command with --resume to continue from it")
    assert stdout == "" and not (out / "results.safetensors").exists()
    assert main(_arguments(out, model, corpus, "--resume")) == 0
    capsys.readouterr()
    _assert_bitwise_equal(out, reference[1])
