"""Checkpoints: a study that is killed at any moment resumes with the same statistics.

Place in the seams: *runs*, between the study orchestration (:mod:`equivariance_probe.runs.study`)
and the probe. :class:`CheckpointedRun` runs each variant's documents in *chunks* of ``every``
documents (chunk ``c`` is ``docs[c·every : (c+1)·every]``), adds each chunk's float64 sums to
the variant's total, and after each chunk writes the total and the position in the corpus to
the checkpoint folder. The chunking depends on ``every`` alone, never on where a run was
interrupted, so a resumed run performs exactly the additions of an uninterrupted one and its
sums are **bitwise** equal. (Against a run with another ``every`` or no checkpoints they agree
to float64 rounding, like any two batchings.)

A remote model's batches are requests to a server (NDIF), and there each request is a chunk of its own,
so that every finished request is on disk: the chunk's size is what the adapter planned from the first
request's measured time (:mod:`~equivariance_probe.adapters.request_sizes`), recorded in the state
(``current["requests"]``) and planned again from the same measurement on resume, so that, under the same
limits, a resumed run sends the requests the interrupted one would have sent and its sums are bitwise equal.

The entry sample (bottom-k, :mod:`equivariance_probe.statistics.sample`) is drawn per chunk with the seed
``SeedSequence([seed, variant, shard, chunk])`` and merged exactly across chunks, so it also
resumes exactly; it depends on ``every`` (another chunking draws another, equally uniform,
sample).

Folder layout (``<out>/checkpoint/``), every file written to a temporary name, flushed to
disk and renamed, so a kill leaves either the old or the new version, never half of one:

* ``state.json`` — ``{"kind", "format_version", "fingerprint", "identity", "every", "done":
  {variant: file}, "current": {"variant", "position", "skipped", "file"[, "requests"]} | null}`` (``requests``:
  a remote run's plan of its requests);
* ``<variant>-<position>.safetensors`` — the variant's partial :class:`ProbeResult` (``complete:
  false``) after ``position`` documents, in the result file format with its window fingerprints
  (:mod:`equivariance_probe.records.result_file`); ``<variant>-done.safetensors`` — its finished
  result.

The state is written after the file it points to, and older files are deleted after the
state, so the state always points to complete files. ``identity`` holds the fingerprints of
the model, the corpus and the configuration (:mod:`equivariance_probe.records.provenance`); a
checkpoint whose identity differs from the resuming run's is refused, naming what differs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, EmptyCorpusError, EquivarianceProbeError, FileWriteError, ResultFileError, check_integer, option
from ..probe import MeasurementOptions, counted, progress_bar
from ..records.fileformat import make_folder, parse_json, write_json_atomically
from ..records.provenance import config_fingerprint
from ..records.result_file import RESULT_SUFFIX
from ..result import ProbeResult

__all__ = ["CheckpointedRun", "chunk_seed", "clear_checkpoint", "has_checkpoint", "lock_output_folder", "CHECKPOINT_FOLDER",
           "DEFAULT_CHECKPOINT_EVERY", "LOCK_FILE"]

CHECKPOINT_FOLDER = "checkpoint"
DEFAULT_CHECKPOINT_EVERY = 50
_KIND = "equivariance_probe.StudyCheckpoint"
_VERSION = 1
_STATE = "state.json"
#: The lock file of an output folder (:func:`lock_output_folder`).
LOCK_FILE = ".equivariance-probe.lock"


def chunk_seed(seed: int, *parts: int) -> int:
    """An independent 63-bit seed for the entry sample of one chunk: ``SeedSequence([seed, *parts])``."""
    return int(np.random.SeedSequence([int(seed), *(int(p) for p in parts)]).generate_state(1, np.uint64)[0] >> 1)


#: The files a checkpoint writes (``.json`` results: written by earlier versions, cleared like the
#: others), and the temporaries a kill can leave of them: ``<name>.tmp`` (``write_atomically``) and
#: ``.tmpXXXXXX``, the temporary that safetensors' ``save_file`` itself writes in the destination
#: folder and then renames (Rust's ``tempfile``: ``.tmp`` and six random letters or digits; seen
#: with strace on safetensors 0.8), which a SIGKILL inside ``save_file`` leaves behind and which
#: would keep the folder from being removed. Nothing else in the folder is ever deleted.
_OWN_FILE = re.compile(r"(state\.json|[A-Za-z0-9_]+-(\d{9}|done)\.(json|safetensors))(\.tmp)?|\.tmp[A-Za-z0-9]{6}")


def _own_files(folder: Path) -> list[Path]:
    return [path for path in folder.iterdir() if path.is_file() and _OWN_FILE.fullmatch(path.name)]


def has_checkpoint(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds the checkpoint of an unfinished run (its ``state.json``)."""
    return (Path(folder) / _STATE).is_file()


def clear_checkpoint(folder: str | os.PathLike) -> None:
    """Delete a checkpoint's files (after the finished study's results were saved), and its
    folder if nothing else is in it.

    ``state.json`` goes first: a kill part-way through then leaves files that no state points to
    (the next run ignores and clears them), never a state pointing to deleted files, which a
    resume would refuse as unreadable.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return
    (folder / _STATE).unlink(missing_ok=True)
    for path in _own_files(folder):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()


#: Output folders whose lock this process holds (resolved path -> how many holders): an entry point that writes
#: a folder takes its lock, and one called inside another (the command line's ``run`` saving a study) holds it
#: again rather than refusing its own process (``flock`` locks of two descriptors exclude each other even there).
_HELD_HERE: dict[Path, int] = {}
_HELD_HERE_GUARD = threading.Lock()


@contextlib.contextmanager
def lock_output_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold the advisory lock of an output folder for the life of a run: one writer per folder.

    Every entry point that writes an output folder takes it (the command line's commands, and from Python
    :func:`~equivariance_probe.runs.study.run_study`'s checkpoint folder and ``Study.save``, ...); within one
    process the lock is re-entrant, so a writer called by another writer of the same folder holds it too.

    ``fcntl.flock`` on ``<folder>/.equivariance-probe.lock``, which holds the holder's process id
    and host name. The kernel releases the lock when its holder exits, however it exits (SIGKILL
    included), so a lock file left by a dead process is no obstacle. The file is removed on release
    while still locked; a process that opened it just before re-checks after locking that the path
    still names the file it locked, and starts again otherwise, so two runs never hold two files.
    Without ``fcntl`` (Windows) nothing is locked.

    Raises:
        CheckpointError: another process holds the folder (named by its process id and host).
    """
    key = Path(folder).resolve()
    with _HELD_HERE_GUARD:
        held = key in _HELD_HERE
        if held:
            _HELD_HERE[key] += 1
    if held:
        try:
            yield Path(folder) / LOCK_FILE
        finally:
            with _HELD_HERE_GUARD:
                _HELD_HERE[key] -= 1
        return
    with _locked(Path(folder)) as path:
        with _HELD_HERE_GUARD:
            _HELD_HERE[key] = 1
        try:
            yield path
        finally:
            with _HELD_HERE_GUARD:
                del _HELD_HERE[key]


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[Path]:
    """The ``flock`` of :func:`lock_output_folder`, taken once."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks of this kind
        yield Path(folder) / LOCK_FILE
        return
    path = Path(folder) / LOCK_FILE
    while True:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise FileWriteError(f"cannot write into the output folder {str(folder)!r} (its lock file: "
                                 f"{error.strerror or error}); write into a folder you can write to") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 200).decode("utf-8", "replace").split()
            os.close(descriptor)
            named = f"process {holder[0]} on host {holder[1]}" if len(holder) >= 2 else "a process that has just started"
            raise CheckpointError(
                f"the output folder {str(folder)!r} is in use by another equivariance-probe run ({named}, holding "
                f"{str(path)!r}); wait for that run to end, or write into another folder"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(descriptor).st_ino:
            break
        os.close(descriptor)  # locked a file its last holder had just removed: lock the current one
    try:
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(descriptor)


class CheckpointedRun:
    """Runs variants chunk by chunk, checkpointing after each chunk; resumes from a checkpoint.

    Args:
        folder: the checkpoint folder, or ``None`` for no checkpoints (one chunk per variant
            unless ``every`` is given).
        every: documents per chunk (``None``: the whole corpus in one chunk).
        identity: ``{"model", "corpus", "config"}`` fingerprints of this run.
        resume: continue from the checkpoint in ``folder`` (which must exist and match).
            Without it, an existing checkpoint is refused rather than overwritten.
        result_type: the result its files hold (:class:`ProbeResult`; the shift test's runner,
            :mod:`~equivariance_probe.runs.shift`, keeps :class:`~equivariance_probe.ShiftResult` s, one
            checkpoint per ``every`` segments, through :meth:`resume_point`, :meth:`save_progress` and
            :meth:`finish`).

    Raises:
        CheckpointError: resume without a checkpoint, a checkpoint of another model, corpus
            or configuration, an unreadable checkpoint, or a checkpoint where a fresh run
            would overwrite it.
    """

    def __init__(
        self,
        folder: str | os.PathLike | None,
        *,
        every: int | None,
        identity: dict[str, Any],
        resume: bool = False,
        result_type: type = ProbeResult,
    ) -> None:
        check_integer("checkpoint_every", every, allow_none=True, error=CheckpointError,
                      message=f"checkpoint_every must be a positive number of documents or None, not {every!r}")
        self.folder = None if folder is None else Path(folder)
        self.every = every
        self.result_type = result_type
        self.identity = json.loads(json.dumps(identity, default=str))  # as it reads back from state.json
        self.fingerprint = config_fingerprint(identity)
        self.done: dict[str, str] = {}
        # variant -> (statistics, metadata) of the result as this process wrote it to <variant>-done.safetensors
        self._written: dict[str, tuple[Any, str]] = {}
        self.current: dict[str, Any] | None = None
        self.resumed_from: dict[str, Any] | None = None
        if self.folder is None:
            if resume:
                raise CheckpointError(
                    f"{option('resume', True)} needs a checkpoint folder: pass {option('checkpoint_dir')} as well"
                )
            return
        state_path = self.folder / _STATE
        if resume:
            if not state_path.exists():
                raise CheckpointError(
                    f"{option('resume', True)}: there is no checkpoint in {str(self.folder)!r} (no {_STATE}); "
                    f"run without {option('resume')} to start, or point {option('checkpoint_dir')} at the interrupted "
                    "run's checkpoint"
                )
            self._restore(state_path)
        elif state_path.exists():
            raise CheckpointError(
                f"{str(self.folder)!r} holds the checkpoint of an unfinished run; pass {option('resume', True)} to "
                f"continue it, or delete {str(self.folder)!r} to start over"
            )
        make_folder(self.folder)

    # -- state ------------------------------------------------------------------------
    def _restore(self, state_path: Path) -> None:
        try:
            state = parse_json(state_path.read_bytes(), str(state_path))
        except (OSError, ResultFileError) as error:
            raise CheckpointError(f"the checkpoint {state_path} cannot be read ({error}); delete its folder and start over") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{state_path} is not a checkpoint (not a JSON object); delete its folder and start over")
        version = state.get("format_version")
        if state.get("kind") == _KIND and isinstance(version, int) and version > _VERSION:
            raise CheckpointError(
                f"{state_path} is a checkpoint of format {version}, written by a newer equivariance_probe than this one "
                f"(format {_VERSION}); upgrade equivariance_probe to resume it, or delete its folder and start over"
            )
        if state.get("kind") != _KIND or version != _VERSION:
            raise CheckpointError(
                f"{state_path} is not a checkpoint this equivariance_probe can read (kind {state.get('kind')!r}, "
                f"format_version {version!r}); delete its folder and start over"
            )
        if state.get("fingerprint") != self.fingerprint:
            theirs = state.get("identity", {})
            parts = [part for part in ("model", "corpus", "config") if theirs.get(part) != self.identity.get(part)]
            details = "; ".join(_difference(part, theirs.get(part), self.identity.get(part)) for part in parts)
            raise CheckpointError(
                f"the checkpoint in {str(self.folder)!r} was made by a run with a different "
                f"{' and '.join(parts) or 'identity'} ({details}); resume only with the same model, corpus and "
                f"options, or start a new run in another {option('checkpoint_dir')} folder"
            )
        if state.get("every") != self.every:
            raise CheckpointError(f"the checkpoint was written every {state.get('every')} documents, not {self.every}")
        self.done = dict(state.get("done", {}))
        self.current = state.get("current")
        self.resumed_from = {"variants_done": sorted(self.done), "current": self.current}

    def _save_state(self) -> None:
        assert self.folder is not None
        write_json_atomically(
            self.folder / _STATE,
            {
                "kind": _KIND,
                "format_version": _VERSION,
                "fingerprint": self.fingerprint,
                "identity": self.identity,
                "every": self.every,
                "done": self.done,
                "current": self.current,
                "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            },
        )
        keep = {_STATE, *self.done.values(), *([self.current["file"]] if self.current and self.current["file"] else [])}
        for path in _own_files(self.folder):
            if path.name not in keep:
                path.unlink(missing_ok=True)

    def _load(self, filename: str) -> Any:
        assert self.folder is not None
        try:
            result = self.result_type.load(self.folder / filename)
            result.statistics  # read now (checksum verified): the file is replaced or deleted as the run goes on
            return result
        except (OSError, EquivarianceProbeError) as error:
            raise CheckpointError(f"the checkpoint file {filename} cannot be read ({error}); delete the folder and start over") from error

    # -- running ----------------------------------------------------------------------
    def run_variant(
        self,
        name: str,
        build_probe: Callable[[], Any],
        docs: Sequence[Any],
        *,
        seed_parts: Sequence[int],
        options: MeasurementOptions,
        progress: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> ProbeResult:
        """The variant's result over ``docs``, resumed from the checkpoint where there is one.

        Args:
            name: the variant (``"trained"``, ``"random_init"``, ...).
            build_probe: makes the :class:`EquivarianceProbe` (called only if work is left).
            docs: the documents of this run (after sharding).
            seed_parts: ``(seed, variant, shard)``; the chunk index is appended for each chunk's sample seed.
            options: how to measure (:meth:`EquivarianceProbe.run`); its ``sample_seed`` is each chunk's.
            progress: a progress bar over the documents (or windows, for token rows).
            metadata: added to the finished result's metadata *before* it is written to the
                checkpoint, so that the written copy is the final file (see :meth:`finished_file`).
        """
        if name in self.done:
            result = self._load(self.done[name])
            result.metadata.update(metadata or {})
            return result
        position, skipped, total = self.resume_point(name)
        every = self.every or max(len(docs), 1)
        probe = build_probe()
        adapter = probe.adapter
        # A remote model's batches are requests to a server: each is its own chunk, so that every finished
        # request is in the checkpoint, and its size is what the adapter planned from the first request's time
        # (recorded in the state, so a resumed run sends the requests the interrupted one would have).
        requests = adapter.requests
        if requests is not None and self.current is not None and self.current.get("requests"):
            requests.restore(self.current["requests"])
        unit = counted(docs)
        bar = progress_bar(progress, len(docs), f"{name}: {unit}", unit)
        bar.update(position)
        try:
            start = position
            while start < len(docs):
                chunk = docs[start : start + (requests.windows(options.batch_size, options.context_length) if requests else every)]
                try:
                    part = probe.run(chunk, options.replace(sample_seed=chunk_seed(*seed_parts, start // every)),
                                     progress=False)
                except EmptyCorpusError:
                    skipped += len(chunk)  # every document of the chunk was empty or too short
                except BaseException as error:  # any fault: the chunks done so far are kept, marked partial
                    partial = getattr(error, "partial_result", None)
                    if total is not None:
                        partial = total if partial is None or partial.n_windows == 0 else _add(total, partial)
                    if partial is not None:
                        partial.metadata["complete"] = False
                        with contextlib.suppress(AttributeError, TypeError):  # exceptions with __slots__
                            error.partial_result = partial  # type: ignore[attr-defined]
                    raise
                else:
                    skipped += int(part.metadata.get("skipped_windows", 0))
                    total = part if total is None else _add(total, part)
                position = start = start + len(chunk)
                bar.update(len(chunk))
                if self.folder is not None and position < len(docs):
                    self.save_progress(name, position, skipped, total, requests and requests.plan)
        finally:
            bar.close()
        if total is None:
            raise EmptyCorpusError(
                f"no document of the {len(docs)} given had enough tokens (all skipped as empty or too short); "
                "pass non-empty documents, or lower min_tokens"
            )
        total.metadata["skipped_windows"] = skipped
        total.metadata["complete"] = True
        if requests is not None and requests.plan is not None:  # the plan the last requests were sent under
            total.metadata["requests"] = requests.plan.to_dict()
        return self.finish(name, total, metadata)

    def resume_point(self, name: str) -> tuple[int, int, Any]:
        """``(position, skipped, partial result or None)`` where variant ``name`` goes on: what the checkpoint
        holds of it (the items done, those skipped, their sums), or ``(0, 0, None)`` for a variant not started."""
        if self.current is None or self.current["variant"] != name:
            return 0, 0, None
        total = self._load(self.current["file"]) if self.current["file"] else None
        return int(self.current["position"]), int(self.current["skipped"]), total

    def finished(self, name: str) -> Any:
        """Variant ``name``'s finished result as the checkpoint holds it, or ``None`` where it is not done."""
        return self._load(self.done[name]) if name in self.done else None

    def finish(self, name: str, total: Any, metadata: dict[str, Any] | None = None) -> Any:
        """Record variant ``name`` as done: ``total`` (complete) with the checkpoint's record and ``metadata``
        added, written to ``<name>-done.safetensors`` and the state (when checkpointing)."""
        total.metadata["checkpoint"] = {"every": self.every, "resumed_from": self.resumed_from}
        total.metadata.update(metadata or {})
        if self.folder is not None:
            filename = f"{name}-done{RESULT_SUFFIX}"
            total.save(self.folder / filename)
            self._written[name] = (total.statistics, _metadata_key(total.metadata))
            self.done[name] = filename
            self.current = None
            self._save_state()
        return total

    def finished_file(self, name: str, result: ProbeResult) -> Path | None:
        """The checkpoint file that holds exactly ``result`` as :meth:`ProbeResult.save` writes it, or ``None``.

        A finished variant is written to the checkpoint (so that a kill during the next variant
        loses nothing) with its final metadata; the study's own result file can then be a hard
        link to it instead of a second write of the same sums. Only files this process wrote
        count, and only while ``result`` still has the same statistics object and metadata.
        """
        written = self._written.get(name)
        if self.folder is None or written is None or name not in self.done:
            return None
        statistics, metadata = written
        if result.statistics is not statistics or _metadata_key(result.metadata) != metadata:
            return None
        path = self.folder / self.done[name]
        return path if path.is_file() else None

    def save_progress(self, name: str, position: int, skipped: int, total: Any, requests: Any = None) -> None:
        """Checkpoint variant ``name`` after ``position`` items (``skipped`` of them empty), their sums ``total``
        (marked partial) written first, then the state that points to them (with ``requests``, a remote run's
        request plan, so that a resumed run sends the requests the interrupted one would have)."""
        assert self.folder is not None
        filename = None
        if total is not None:
            total.metadata["complete"] = False
            filename = f"{name}-{position:09d}{RESULT_SUFFIX}"
            total.save(self.folder / filename)
        # file is None while every document so far was skipped: only the position is saved.
        self.current = {"variant": name, "position": position, "skipped": skipped, "file": filename}
        if requests is not None:  # a remote run's plan of its requests (RequestPlan.to_dict)
            self.current["requests"] = requests.to_dict()
        self._save_state()


def _metadata_key(metadata: dict[str, Any]) -> str:
    return json.dumps(metadata, sort_keys=True, default=str)


def _add(total: ProbeResult, part: ProbeResult) -> ProbeResult:
    """``total`` with ``part``'s sums added; keeps ``total``'s metadata (one run, many chunks).

    Chunks are disjoint slices of one corpus, so a window in both is a document the corpus holds
    twice, which a run without checkpoints counts twice too: the chunks add as that run would.
    """
    return ProbeResult(total.statistics.merge(part.statistics, allow_duplicate_windows=True), dict(total.metadata))


def _difference(part: str, theirs: Any, mine: Any) -> str:
    if not isinstance(theirs, dict) or not isinstance(mine, dict):
        return f"{part}: {theirs!r} vs {mine!r}"
    keys = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
    shown = ", ".join(f"{k}: {theirs.get(k)!r} then, {mine.get(k)!r} now" for k in keys[:4])
    return f"{part} {shown}"
