"""The shift study: the shift test on a model and its baselines, into one output folder, resumable.

Place in the seams: *runs*, beside :mod:`~equivariance_probe.runs.study` (what ``equivariance-probe run`` calls);
``equivariance-probe shift`` calls :func:`run_shift_study`. It loads the model once, settles the shift options
against it once (:meth:`~equivariance_probe.sources.shift_grid.ShiftOptions.resolved`: the default offsets),
draws segments and contexts from one corpus, and runs
:meth:`~equivariance_probe.EquivarianceProbe.shift` on the trained model and each baseline, one baseline in
memory at a time.

A study is a peer of ``run``'s: it holds the output folder's lock for its whole life
(:func:`~equivariance_probe.runs.checkpoint.lock_output_folder`), and checkpoints every ``checkpoint_every``
segments into ``<out>/checkpoint/`` through the same :class:`~equivariance_probe.runs.checkpoint.CheckpointedRun`
(``<variant>-<segments>.safetensors``: the partial shift result, and ``state.json``). A study killed at any moment
(SIGKILL, or SIGTERM, which stops it before its next segment) and run again with ``resume=True`` goes on from
the last checkpoint's segment and adds exactly what the uninterrupted run adds: its sums are **bitwise** those of
a run that was never stopped, whatever ``checkpoint_every`` (each segment's sums are added to its interval
group's row one segment at a time, in order, in both). Each variant's ``shift_<variant>.safetensors`` is written
when it finishes; the checkpoint is removed once every variant's file is on disk.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..adapters.base import RUNS_ENCODERS
from ..adapters.registry import framework_can, frameworks_that
from ..errors import EquivarianceProbeError, InputError, option
from ..probe import EquivarianceProbe
from ..records.provenance import corpus_fingerprint, model_identity
from ..shift_result import ShiftResult
from ..sources.model_source import ModelSource, model_source
from ..sources.packing import special_prefix
from ..sources.shift_grid import DEFAULT_PATCH_SHIFT, DEFAULT_SHIFT, ShiftOptions, check_shift_options, split_documents
from .checkpoint import CHECKPOINT_FOLDER, CheckpointedRun, clear_checkpoint, has_checkpoint, lock_output_folder
from .study import check_baselines, variant_builders

__all__ = ["ShiftStudy", "run_shift_study", "shift_file", "DEFAULT_SHIFT_CHECKPOINT_EVERY"]

#: Segments between checkpoints: one (a segment's grid is a few hundred forward passes, its checkpoint one small file).
DEFAULT_SHIFT_CHECKPOINT_EVERY = 1


def shift_file(out: str | os.PathLike, variant: str) -> Path:
    """The result file of one variant of a shift study: ``<out>/shift_<variant>.safetensors``."""
    return Path(out) / f"shift_{variant}.safetensors"


@dataclass
class ShiftStudy:
    """What a shift study measured and wrote.

    Attributes:
        results: variant (``"trained"`` first, then the baselines) -> its :class:`~equivariance_probe.ShiftResult`.
        segments: the segments' token ids, as the study drew them.
        contexts: the contexts' token ids (``None`` in ``"position_ids"`` mode).
        options: the shift options, settled for the model (its offsets given or defaulted).
        probe: the trained model's probe (``None`` when the study had finished before and was only read back).
        wrote: the result files (written, or read back).
    """

    results: dict[str, ShiftResult]
    segments: list[list[int]]
    contexts: list[list[int]] | None
    options: ShiftOptions
    probe: EquivarianceProbe | None = None
    wrote: list[Path] = field(default_factory=list)


def load_shift_model(source: ModelSource) -> tuple[Any, Any]:
    """``(model, tokenizer)`` as a shift study runs them: the model of ``source`` as ``run_study`` loads it (each
    baseline is built from it and wrapped the same way), or the packaged BERT encoder, which runs as a Hugging Face
    model (the segment ends the window, attention both ways)."""
    if source.is_packaged_encoder:
        if not framework_can(source.framework, RUNS_ENCODERS):
            raise InputError(f"the packaged encoder {source.name!r} runs on a framework that runs encoders "
                             f"({', '.join(frameworks_that(RUNS_ENCODERS))}) only; drop "
                             f"{option('framework', source.framework)}")
        return source.load_positional()
    return source.load()


def run_shift_study(
    model: str | ModelSource,
    out: str | os.PathLike,
    options: ShiftOptions | None = None,
    *,
    corpus: Any = None,
    n_segments: int | None = None,
    n_contexts: int | None = None,
    baselines: Sequence[str] = (),
    seed: int = 0,
    checkpoint_every: int | None = DEFAULT_SHIFT_CHECKPOINT_EVERY,
    resume: bool = False,
    progress: bool = True,
    **loading: Any,
) -> ShiftStudy:
    """The shift test on ``model`` and its ``baselines``, written to ``out`` (``shift_<variant>.safetensors``).

    Args:
        model: a :class:`~equivariance_probe.sources.model_source.ModelSource` (which model, framework, device,
            dtype, kernel), or a model's name alone for its defaults; the packaged encoder runs as a Hugging Face
            model (:func:`load_shift_model`).
        out: the output folder (created; locked while the study runs).
        options: how to measure (:class:`~equivariance_probe.sources.shift_grid.ShiftOptions`; default offsets for
            the model where it gives none).
        corpus: documents (texts or token-id lists), a corpus path, or ``None`` (the packaged Wikipedia articles):
            contexts are the first ``n_contexts`` documents of at least ``max(offsets)`` tokens, segments the first
            ``n_segments`` others (:func:`~equivariance_probe.sources.shift_grid.split_documents`).
        n_segments: segments to move (default 8, or 2 with patching:
            :data:`~equivariance_probe.sources.shift_grid.DEFAULT_SHIFT`, ``DEFAULT_PATCH_SHIFT``).
        n_contexts: contexts before them (one, the prefix, in ``"position_ids"`` mode; default 4, or 2 with
            patching).
        baselines: from :data:`~equivariance_probe.runs.study.BASELINES` (each a second run of the whole grid).
        seed: seed of the random initialisation.
        checkpoint_every: segments between checkpoints in ``<out>/checkpoint`` (``None`` or 0: none).
        resume: go on from the checkpoint of an interrupted study with the same model, texts and options.
        progress: progress bars over segments.
        **loading: loading keywords (``framework``, ``cache_dir``, ``device``, ``dtype``, ``attn_implementation``)
            are refused with the :class:`ModelSource` that carries them.

    Raises:
        CheckpointError: ``resume`` without a checkpoint, a checkpoint of another study, or a checkpoint that a
            fresh study would overwrite.
    """
    source = model_source(model, loading, where="run_shift_study")
    options = ShiftOptions.of(options)
    defaults = {**DEFAULT_SHIFT, **DEFAULT_PATCH_SHIFT} if options.patch else DEFAULT_SHIFT
    n_segments = defaults["n_segments"] if n_segments is None else n_segments
    n_contexts = defaults["n_contexts"] if n_contexts is None else n_contexts
    check_baselines(baselines)
    # Everything that needs no model is checked before one loads (a minute for a packaged model's first load).
    check_shift_options(offsets=options.offsets, segment_length=options.segment_length, mode=options.mode,
                        n_contexts=n_contexts)
    out = Path(out)
    with lock_output_folder(out):
        folder = out / CHECKPOINT_FOLDER
        names = [name for name, _ in variant_builders(None, baselines, seed)]
        if resume and not has_checkpoint(folder) and all(_finished(shift_file(out, name)) for name in names):
            clear_checkpoint(folder)  # killed after its files were written, while its checkpoint was cleared
            results = {name: ShiftResult.load(shift_file(out, name)) for name in names}
            trained = results["trained"]
            return ShiftStudy(results, [], None, options.replace(offsets=trained.offsets),
                              wrote=[shift_file(out, name) for name in names])
        study = _measured_study(source, out, options, corpus, n_segments, n_contexts, baselines, seed,
                                checkpoint_every or None, resume, progress)
        clear_checkpoint(folder)  # only once every variant's file is on disk
        return study


def _measured_study(source: ModelSource, out: Path, options: ShiftOptions, corpus: Any, n_segments: int,
                    n_contexts: int, baselines: Sequence[str], seed: int, every: int | None, resume: bool,
                    progress: bool) -> ShiftStudy:
    """Load the model, settle the options and the texts, and run every variant (resumed where checkpointed)."""
    network, tokenizer = load_shift_model(source)
    probe = EquivarianceProbe(network, tokenizer=tokenizer)
    options = options.resolved(probe.adapter.layout, len(special_prefix(tokenizer)))
    segments, contexts = _texts(corpus, tokenizer, options, n_segments, n_contexts)
    recorded = dataclasses.asdict(options)
    if not options.patch:  # as a study without patching recorded its options before patching existed: it resumes
        recorded = {key: value for key, value in recorded.items() if key not in ("patch", "patch_reference")}
    identity = {"model": model_identity(network), "corpus": corpus_fingerprint([*segments, *(contexts or [])]),
                "config": {"command": "shift", "options": recorded, "baselines": list(baselines), "seed": seed,
                           "framework": source.framework}}
    runner = CheckpointedRun(out / CHECKPOINT_FOLDER if every else None, every=every, identity=identity, resume=resume,
                             result_type=ShiftResult)
    study = ShiftStudy({}, segments, contexts, options, probe)
    for name, build in variant_builders(network, baselines, seed):  # one baseline in memory at a time
        result = runner.finished(name)
        if result is None:
            variant = probe if name == "trained" else EquivarianceProbe(build(), tokenizer=tokenizer)
            result = _run_variant(runner, name, variant, segments, contexts, options, progress,
                                  {"study": {"model": source.name, "variant": name}})  # as the user named them
        study.results[name] = result
        study.wrote.append(result.save(shift_file(out, name)))
    return study


def _run_variant(runner: CheckpointedRun, name: str, probe: EquivarianceProbe, segments: list[list[int]],
                 contexts: list[list[int]] | None, options: ShiftOptions, progress: bool,
                 metadata: dict[str, Any]) -> ShiftResult:
    """One variant's shift run, from the checkpoint's last segment where there is one, checkpointed as it goes."""
    _, _, partial = runner.resume_point(name)

    def checkpoint(result: ShiftResult) -> None:
        done = result.n_segments
        if runner.folder is not None and runner.every and done % runner.every == 0 and done < len(segments):
            runner.save_progress(name, done, 0, result)

    result = probe.shift(segments, contexts, options, resume_from=partial, on_segment=checkpoint,
                         progress=f"{name}: segments" if progress else False)
    return runner.finish(name, result, metadata)


def _texts(corpus: Any, tokenizer: Any, options: ShiftOptions, n_segments: int,
           n_contexts: int) -> tuple[list[list[int]], list[list[int]] | None]:
    """Segments and contexts drawn from ``corpus`` (contexts ``None`` in ``"position_ids"`` mode)."""
    from ..sources.corpus import load_corpus

    documents = load_corpus(corpus) if corpus is None or isinstance(corpus, (str, Path)) else corpus
    position_ids = options.mode == "position_ids"
    segments, contexts = split_documents(documents, tokenizer, n_segments=n_segments,
                                         n_contexts=1 if position_ids else n_contexts,
                                         segment_length=options.segment_length, context_length=max(options.offsets))
    return segments, None if position_ids else contexts


def _finished(path: Path) -> bool:
    """Whether ``path`` is a complete shift result file."""
    try:
        return path.is_file() and ShiftResult.load(path).complete
    except EquivarianceProbeError:
        return False
