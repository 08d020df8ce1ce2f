"""Resume under fault injection: a study killed at dozens of seeded moments, each time resumed, ends
with result files whose every array is bitwise the uninterrupted run's.

Each attempt is a forked child running the command line (``equivariance-probe run ... --resume``
once a checkpoint exists) that dies with ``os._exit`` (no cleanup, no ``finally``, as SIGKILL):

* just before, or just after, the n-th call of a file operation the checkpoint and result writes
  use (``os.fsync`` after a temporary file is written, ``os.replace`` that renames it into place,
  ``os.link`` that links a finished checkpoint file as a result, ``os.unlink`` that clears old
  files), which lands kills inside every write;
* or by SIGKILL from the parent after a random delay within an uninterrupted run's duration,
  which lands anywhere (a forward pass, a sum, a write).

The schedule is seeded; the tally of where the kills landed is printed (``-s``) and every phase
must be hit. Whether a kill lands is not up to the schedule alone: a resumed run makes fewer file
operations than a whole one, and on a loaded machine a run's duration is not the reference run's.
So once ``KILLS`` kills have landed, the schedule draws only phases not hit yet, each of which
lands on the next fresh run (it makes every call an uninterrupted run makes); and a timed kill that
a run outlived is drawn next over half the span, down to a delay of zero after ``TIMED_MISSES``
misses, which always lands (no run finishes in no time). No assertion depends on the clock.
Children run torch on one thread: a fork of a process whose OpenMP pool has run hangs in the pool
otherwise.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from equivariance_probe.cli import main

#: Where an injected kill lands: before or after the n-th call of these, or at a random time.
OPERATIONS = ("fsync", "replace", "link", "unlink")
PHASES = tuple(f"{when} {name}" for name in OPERATIONS for when in ("before", "after")) + ("timed",)
#: Kills in all (each run is killed until an attempt finishes, then compared; then a new run starts).
KILLS = 40
#: Attempts in all before the test gives up on hitting every phase (each miss starts a fresh run).
ATTEMPTS = 3 * KILLS
#: Timed kills that runs may outlive before the next is sent at once: each one halves the span.
TIMED_MISSES = 6
RESULT_FILES = ("results.safetensors", "baseline_random_init.safetensors")

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


@pytest.fixture(scope="module")
def tiny(tiny_model_folder, text_corpus):
    return tiny_model_folder("gpt2", 64), text_corpus(n_docs=8, words=40)


def _arguments(out: Path, model: str, corpus: str, resume: bool) -> list[str]:
    return ["run", "--out", str(out), "--model", model, "--corpus", corpus, "--n-docs", "8", "--context-length", "16",
            "--batch-size", "1", "--checkpoint-every", "2", "--baselines", "random_init", "--sample-size", "50",
            "--no-figures", "--no-progress", *(["--resume"] if resume else [])]


def _child(arguments: list[str], phase: str | None, nth: int) -> None:
    torch.set_num_threads(1)
    silent = os.open(os.devnull, os.O_WRONLY)
    os.dup2(silent, 1)
    os.dup2(silent, 2)
    if phase is not None and phase != "timed":
        when, name = phase.split()
        original, calls = getattr(os, name), [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth and when == "before":
                os._exit(137)
            value = original(*args, **kwargs)
            if calls[0] == nth:
                os._exit(137)
            return value

        setattr(os, name, dying)
    try:
        status = main(arguments)
    except BaseException:  # noqa: BLE001 - any escape is a failure the parent reports
        status = 3
    os._exit(status)


def _attempt(out: Path, model: str, corpus: str, phase: str | None = None, nth: int = 0,
             delay: float | None = None) -> int:
    """One run (resuming where a checkpoint exists); its exit status, 137 or -9 where it was killed."""
    resume = (out / "checkpoint" / "state.json").exists()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        _child(_arguments(out, model, corpus, resume), phase, nth)
    if delay is not None:
        time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _arrays(out: Path) -> dict[str, dict[str, np.ndarray]]:
    return {name: load_file(out / name) for name in RESULT_FILES}


def _calls_of_a_whole_run(out: Path, model: str, corpus: str) -> dict[str, int]:
    """How many times an uninterrupted run calls each operation (so that kills are drawn within a run)."""
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        counts = collections.Counter()
        for name in OPERATIONS:
            def counting(*args, _name=name, _original=getattr(os, name), **kwargs):
                counts[_name] += 1
                return _original(*args, **kwargs)
            setattr(os, name, counting)
        torch.set_num_threads(1)
        silent = os.open(os.devnull, os.O_WRONLY)
        os.dup2(silent, 1)
        os.dup2(silent, 2)
        status = main(_arguments(out, model, corpus, resume=False))
        os.write(writing, repr(dict(counts)).encode())
        os._exit(status)
    os.close(writing)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with os.fdopen(reading) as pipe:
        return eval(pipe.read())  # noqa: S307 - a dict literal this test's own child wrote


def test_resume_after_kills_at_seeded_moments_is_bitwise_the_uninterrupted_run(tiny, tmp_path):
    model, corpus = tiny
    reference_out = tmp_path / "reference"
    start = time.perf_counter()
    calls = _calls_of_a_whole_run(reference_out, model, corpus)
    duration = time.perf_counter() - start
    reference = _arrays(reference_out)
    needed = [phase for phase in PHASES if phase == "timed" or calls.get(phase.split()[-1])]

    schedule = random.Random(20261124)
    tally: collections.Counter[str] = collections.Counter()
    sequence, attempts, timed_misses = 0, 0, 0

    def landed() -> int:
        return sum(tally[phase] for phase in PHASES)

    def missing() -> list[str]:
        return [phase for phase in needed if tally[phase] == 0]

    while landed() < KILLS or missing():
        out = tmp_path / f"run{sequence}"
        while True:  # kill this run again and again until one attempt finishes before its kill
            assert attempts < ATTEMPTS, f"{attempts} attempts did not hit every phase: {dict(tally)}"
            attempts += 1
            phase = schedule.choice(PHASES if landed() < KILLS else missing() or PHASES)
            name = phase.split()[-1]
            nth = schedule.randint(1, max(calls.get(name, 1), 1))
            delay = schedule.uniform(0.0, duration) if phase == "timed" else None
            if delay is not None:  # the span halves with each timed kill a run outlived
                delay = 0.0 if timed_misses >= TIMED_MISSES else delay * 0.5 ** timed_misses
            status = _attempt(out, model, corpus, phase, nth, delay)
            assert status in (0, 137, -9), f"run {sequence} failed (status {status}) after kills: {dict(tally)}"
            if status == 0:
                tally["finished before its kill"] += 1
                timed_misses += phase == "timed"
                break
            tally[phase] += 1
        resumed = _arrays(out)
        assert not (out / "checkpoint").exists()
        for name in RESULT_FILES:
            assert resumed[name].keys() == reference[name].keys(), name
            for key, value in reference[name].items():
                assert np.array_equal(resumed[name][key], value), (sequence, name, key, dict(tally))
        sequence += 1
    print(f"{landed()} kills in {sequence} runs, by where they landed: {dict(tally)}; "
          f"calls of an uninterrupted run: {calls}; timed kills outlived: {timed_misses}")
    assert not missing(), dict(tally)
