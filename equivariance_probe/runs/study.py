"""The whole study on one model: trained weights and its untrained baselines.

Runs the same documents through the model, through the same architecture at its own
random initialisation (seeded, the model's own initialiser), and with all weights zero
(every head exactly uniform), and collects one :class:`ProbeResult` per variant
(docs/methods.md#baselines).

Place in the seams: *runs*, orchestration only; the numbers come from the probe, and the
figures are drawn by :mod:`~equivariance_probe.display` from the :class:`Study` it returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..adapters.base import RUNS_REMOTELY
from ..adapters.registry import framework_can, frameworks_that
from ..adapters.request_sizes import RequestLimits
from ..errors import InputError
from ..maths.sinks import SINK_EPSILON
from ..probe import EquivarianceProbe, MeasurementOptions
from ..records.fileformat import make_folder, write_text_atomically
from ..records.provenance import config_fingerprint, corpus_fingerprint, model_identity
from ..records.result_file import RESULT_SUFFIX
from ..records.sharding import Shard, shard_metadata
from ..result import ProbeResult
from .tables import difference_table, summary_table, windows_needed_text
from ..sources.baselines import random_init_like, zero_like
from ..sources.corpus import load_corpus
from ..sources.model_source import ModelSource, loading_keywords, model_source
from ..sources.registry import DEFAULT_MODEL
from ..sources.packing import pack_documents
from .checkpoint import DEFAULT_CHECKPOINT_EVERY, CheckpointedRun, lock_output_folder

__all__ = ["Study", "run_study", "result_filename", "load_study_baselines", "BASELINES", "DEFAULT_STUDY",
           "STUDY_MEASUREMENT", "SINK_PROTOCOL"]

#: Baselines: name -> what it is.
BASELINES = {
    "random_init": "the same architecture at its own random initialisation (seeded)",
    "zero": "the same architecture with every weight zero (every head uniform)",
}

#: The default study, sized to finish in about 10 minutes on 2 CPU cores.
DEFAULT_STUDY = {"n_docs": 24, "context_length": 1024, "batch_size": 4}

#: Gu et al.'s protocol for the attention-sink rate ("When Attention Sink Emerges in Language Models: An
#: Empirical View", ICLR 2025, Table 1): 100 sequences of 64 tokens, every key kept, so that
#: :meth:`~equivariance_probe.result.ProbeResult.sink_rate` of GPT2-XL compares with their 77.00 % on natural text
#: (at :data:`~equivariance_probe.maths.sinks.SINK_EPSILON`).
SINK_PROTOCOL = {"n_docs": 100, "context_length": 64, "exclude_keys": []}

#: How a study measures unless told otherwise: :class:`~equivariance_probe.probe.MeasurementOptions`'
#: defaults, at the study's window length and batch size, keeping an entry sample for the scatter plot.
STUDY_MEASUREMENT = MeasurementOptions(context_length=DEFAULT_STUDY["context_length"],
                                       batch_size=DEFAULT_STUDY["batch_size"], sample_size=20000)


@dataclass
class Study:
    """Results of one study: ``{"trained": ..., "random_init": ..., "zero": ...}``."""

    results: dict[str, ProbeResult]
    config: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: The run's :class:`~equivariance_probe.runs.checkpoint.CheckpointedRun`, whose finished-variant
    #: files :meth:`save` links instead of writing the same bytes again.
    checkpoint: CheckpointedRun | None = field(default=None, repr=False, compare=False)
    #: The threshold ``ε`` of the sink rates its table and text report (Gu et al.'s by default).
    sink_epsilon: float = SINK_EPSILON

    @property
    def trained(self) -> ProbeResult:
        return self.results["trained"]

    def baselines(self) -> dict[str, ProbeResult]:
        return {k: v for k, v in self.results.items() if k != "trained"}

    def table(self, *, extended: bool = False) -> str:
        """Markdown table, one column per variant: query-position R² in every form and scale, the
        fits to ``P(dt)``, the mean per-window Toeplitz R², each with its 95 % interval over windows
        (:func:`~equivariance_probe.runs.tables.summary_table`; ``extended`` adds fit parameters, Figure 1c
        and the heads)."""
        return summary_table({name: result.summary(epsilon=self.sink_epsilon) for name, result in self.results.items()},
                             extended=extended)

    def differences(self) -> str:
        """Markdown table of ``trained − baseline`` for every baseline, each difference with its 95 %
        interval from paired replicates (the same windows in the same groups:
        :func:`~equivariance_probe.result.paired_difference`), and notes where there is none."""
        return difference_table(self.results, "trained")

    def precision(self, half_width: float = 0.005) -> str:
        """How precise the trained model's log fitted R² is, and how many windows ``±half_width`` would need."""
        return windows_needed_text(self.trained.summary(), half_width)

    def report_text(self) -> str:
        """What ``equivariance-probe run`` prints and ``summary.md`` holds: the table, the differences
        from the baselines, the precision reached and the heads."""
        parts = [self.table()]
        if self.baselines():
            parts.append("Differences, each over the same windows (95 % intervals from paired replicates):\n\n"
                         + self.differences())
        parts += [self.precision(), self.heads()]
        return "\n\n".join(parts)

    def heads(self) -> str:
        """The most and least position-bound heads of the trained model (log η²), and its attention sinks."""
        summary = self.trained.summary(epsilon=self.sink_epsilon)
        text = (
            f"most position-bound head: {summary['most_position_bound_head']}; "
            f"least: {summary['least_position_bound_head']} (query-position η², log scale)"
        )
        sinks = summary.get("sinks") or {}
        if sinks.get("rate") is not None:
            text += (f"\nattention sinks (Gu et al.'s sink rate): in {sinks['rate']:.2%} of (window, head) pairs the head "
                     f"puts more than {sinks['epsilon']:g} of its attention on the window's first token "
                     f"({sinks['first_token']}); pooled over windows, {sinks['pooled_rate']:.2%} of heads do")
        return text

    def save(self, folder: str | os.PathLike) -> dict[str, Path]:
        """Write ``results.safetensors`` (trained) and ``baseline_<name>.safetensors`` (result files,
        :meth:`ProbeResult.save`), plus ``summary.md``, holding the folder's lock while it writes.

        Raises:
            CheckpointError: another process holds the folder (see
                :func:`~equivariance_probe.runs.checkpoint.lock_output_folder`).
        """
        folder = Path(folder)
        with lock_output_folder(make_folder(folder)):
            return self._save(folder)

    def _save(self, folder: Path) -> dict[str, Path]:
        paths = {}
        for name, result in self.results.items():
            filename = result_filename(name)
            finished = self.checkpoint.finished_file(name, result) if self.checkpoint is not None else None
            if finished is None or not _link(finished, folder / filename):
                result.save(folder / filename)
            paths[name] = folder / filename
        excluded = self.trained.excluded_keys
        write_text_atomically(
            folder / "summary.md",
            f"# Equivariance probe: {self.config.get('model')}\n\n"
            f"Query-position R² over all visible entries (log scale: y = log max(a, eps), "
            f"eps = {self.trained.log_floor:.3g}; {self.trained.floored()} entries floored). "
            f"Excluded key positions: {list(excluded) or 'none'}. Brackets: 95 % intervals over windows "
            f"(delete-a-group jackknife).\n\n{self.report_text()}\n\n"
            f"Configuration: `{json.dumps(self.config)}`\n\nTimings (s): `{json.dumps(self.timings)}`\n"
        )
        return paths


def result_filename(variant: str) -> str:
    """The file of a study variant: ``results.safetensors`` (trained) or ``baseline_<variant>.safetensors``."""
    return f"results{RESULT_SUFFIX}" if variant == "trained" else f"baseline_{variant}{RESULT_SUFFIX}"


def load_study_baselines(path: str | os.PathLike, result: ProbeResult) -> tuple[dict[str, ProbeResult], list[str]]:
    """The baselines of the study whose trained result ``result`` was loaded from ``path``.

    The study's metadata names its variants (``metadata["study"]["baselines"]``); each is looked
    for beside ``path`` as :func:`result_filename` writes it (``baseline_<name>.safetensors``), or
    as the ``.json`` files of earlier versions. Loaded lazily (headers only).

    Returns:
        ``(found, missing)``: name -> result, and the names of baselines not found. Both are empty
        for a result that is not a study's trained model.
    """
    if result.metadata.get("label") != "trained":
        return {}, []
    folder = Path(path).parent
    found: dict[str, ProbeResult] = {}
    missing: list[str] = []
    for name in (result.metadata.get("study") or {}).get("baselines") or []:
        candidates = [folder / result_filename(name), folder / f"baseline_{name}.json"]
        existing = next((candidate for candidate in candidates if candidate.is_file()), None)
        if existing is None:
            missing.append(name)
        else:
            found[name] = ProbeResult.load(existing)
    return found, missing


def check_baselines(baselines: Sequence[str]) -> None:
    """Raise :class:`InputError` for a baseline name not in :data:`BASELINES`."""
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise InputError(f"unknown baselines {unknown}; choose from {sorted(BASELINES)}")


def variant_builders(network: Any, baselines: Sequence[str], seed: int) -> list[tuple[str, Any]]:
    """``[(name, build)]``: the trained model first, then each baseline of :data:`BASELINES` asked for,
    each built only when ``build()`` is called (one baseline in memory at a time)."""
    variants: list[tuple[str, Any]] = [("trained", lambda: network)]
    if "random_init" in baselines:
        variants.append(("random_init", lambda: random_init_like(network, seed=seed)))
    if "zero" in baselines:
        variants.append(("zero", lambda: zero_like(network)))
    return variants


def _link(source: Path, destination: Path) -> bool:
    """Make ``destination`` a hard link to ``source`` (atomically); ``False`` where links are refused."""
    temporary = destination.with_name(destination.name + ".tmp")
    try:
        temporary.unlink(missing_ok=True)
        os.link(source, temporary)
        os.replace(temporary, destination)
    except OSError:  # another file system, or one without hard links: write the file instead
        temporary.unlink(missing_ok=True)
        return False
    return True


def run_study(
    model: str | ModelSource = DEFAULT_MODEL,
    *,
    corpus: Any = None,
    n_docs: int = DEFAULT_STUDY["n_docs"],
    baselines: Sequence[str] = tuple(BASELINES),
    seed: int = 0,
    options: MeasurementOptions | None = None,
    progress: bool = True,
    loaded: tuple[Any, Any] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
    resume: bool = False,
    shard: Shard | str | None = None,
    pack: bool = False,
    remote: bool | str = False,
    request_limits: RequestLimits | None = None,
    **measurement: Any,
) -> Study:
    """Run the study: the trained model and each baseline on the same documents.

    Args:
        model: a :class:`~equivariance_probe.sources.model_source.ModelSource` (which model, framework, device, dtype,
            kernel), or a model's name alone for its defaults.
        corpus: what :func:`~equivariance_probe.sources.corpus.load_corpus` reads (``None``: the packaged corpus).
        n_docs: documents (one window each).
        baselines: any of ``"random_init"``, ``"zero"``.
        seed: seed of the random initialisation and of the entry sample.
        options: how each variant is measured, a :class:`~equivariance_probe.probe.MeasurementOptions`
            (default :data:`STUDY_MEASUREMENT`); its ``sample_seed`` is replaced by one drawn from ``seed`` for
            each checkpoint chunk, variant and shard; a ``context_length`` of ``None`` is the study's 1024.
        progress: show progress bars.
        loaded: an already loaded ``(model, tokenizer)``, to skip loading (``model`` then only names it).
        checkpoint_dir: save checkpoints there, holding its lock (:mod:`~equivariance_probe.runs.checkpoint`).
        checkpoint_every: documents between checkpoints (with ``checkpoint_dir``).
        resume: continue from the checkpoint in ``checkpoint_dir`` (refused if another model, corpus or setting).
        shard: ``Shard(i, n)`` or ``"i/n"``: only the i-th of n slices of the documents (merge the shards' results).
        pack: concatenate the documents (EOS between them) and cut windows of exactly ``context_length`` tokens
            (:func:`~equivariance_probe.sources.packing.pack_documents`); checkpoints and shards then count windows.
        remote: ``True``, a host URL or ``"local"``: the trained model runs on an NDIF server (``loaded``: an nnsight
            ``TransformersModel`` from its hub id, and its tokenizer; ``framework="nnsight"``; no baselines), one
            request per batch, every finished request checkpointed (docs/guide/remote.md).
        request_limits: how remote requests are sized (:class:`~equivariance_probe.adapters.request_sizes.
            RequestLimits`; default: to a quarter of NDIF's execution timeout or nnsight's 600 s read timeout).
        **measurement: any field of :class:`~equivariance_probe.probe.MeasurementOptions` by name, over those of
            ``options`` (``context_length``, ``batch_size``, ``exclude_keys``, ``sample_size``, ``keep_pattern``,
            ``interval_groups``, ...). Loading keywords (``framework``, ``cache_dir``, ``device``, ``dtype``,
            ``attn_implementation``) are refused with the :class:`ModelSource` that carries them.
    """
    source = model_source(model, loading_keywords(measurement), where="run_study")
    options = MeasurementOptions.of(STUDY_MEASUREMENT if options is None else options, **measurement)
    if options.context_length is None:
        options = options.replace(context_length=STUDY_MEASUREMENT.context_length)
    check_baselines(baselines)
    adapter_options = _remote_options(remote, request_limits, source, loaded, baselines)
    # Whoever writes a folder holds its lock (as the command line does), from before the corpus and model load.
    with contextlib.ExitStack() as held:
        if checkpoint_dir is not None:
            held.enter_context(lock_output_folder(make_folder(checkpoint_dir)))
        timings: dict[str, float] = {}
        shard = Shard.parse(shard) if isinstance(shard, str) else shard
        all_docs, timings["load_corpus"] = _timed(load_corpus, corpus, n_docs=n_docs)
        corpus_identity = corpus_fingerprint(all_docs)
        (network, tokenizer), timings["load_model"] = _timed(source.load) if loaded is None else (loaded, 0.0)
        # Packed, the units of shards and checkpoints are the windows (the documents fill them unevenly).
        units = pack_documents(all_docs, tokenizer, options.context_length) if pack else all_docs
        docs = units[slice(*shard.bounds(len(units)))] if shard is not None else units
        config = _study_config(source, corpus, len(all_docs), options, seed, baselines, pack,
                               checkpoint_every if checkpoint_dir is not None else None, loaded is None, remote)
        identity, provenance = _identity(network, corpus_identity, config, shard)
        runner = CheckpointedRun(checkpoint_dir, every=config["checkpoint_every"], identity=identity, resume=resume)
        if shard is not None:
            config["shard"] = str(shard)
        results: dict[str, ProbeResult] = {}
        for name, result, seconds in _run_variants(runner, network, tokenizer, docs, len(units), baselines, seed,
                                                   shard, corpus_identity, pack, options, progress,
                                                   {"study": config, "provenance": provenance}, adapter_options):
            results[name], timings[name] = result, seconds
        return Study(results, config, timings, checkpoint=runner)


def _run_variants(runner: CheckpointedRun, network: Any, tokenizer: Any, docs: Any, n_units: int,
                  baselines: Sequence[str], seed: int, shard: Shard | None, corpus_identity: dict[str, Any], pack: bool,
                  options: MeasurementOptions, progress: bool, metadata: dict[str, Any],
                  adapter_options: dict[str, Any]) -> Iterator[tuple[str, ProbeResult, float]]:
    """``(variant, result, seconds)`` of the trained model and each baseline in turn, each built only when its turn
    comes (one baseline in memory at a time), run through ``runner``'s checkpoints; ``adapter_options``: the
    probe's remote settings."""
    for index, (name, build) in enumerate(variant_builders(network, baselines, seed)):
        start = time.perf_counter()
        variant_metadata = {"label": name, **metadata}
        if shard is not None:
            variant_metadata["shards"] = shard_metadata(shard, n_units, corpus_identity["sha256"])
        if pack:  # the whole run's windows (each checkpoint chunk records only its own)
            variant_metadata["windows"] = docs.describe()
        result = runner.run_variant(
            name, lambda build=build: EquivarianceProbe(build(), tokenizer=tokenizer, **adapter_options), docs,
            seed_parts=(seed, index, 0 if shard is None else shard.index + 1), metadata=variant_metadata,
            options=options, progress=progress)
        yield name, result, time.perf_counter() - start


def _remote_options(remote: bool | str, request_limits: RequestLimits | None, source: ModelSource, loaded: Any,
                    baselines: Sequence[str]) -> dict[str, Any]:
    """The probe's keywords of a remote study (none for a local one), refusing what a remote study cannot do."""
    if not remote:
        if request_limits is not None:
            raise InputError("request_limits sizes remote requests only; pass remote=True (or a host URL) with it, "
                             "or leave it out")
        return {}
    if not framework_can(source.framework, RUNS_REMOTELY) or loaded is None or list(baselines):
        remote_frameworks = frameworks_that(RUNS_REMOTELY)
        raise InputError(
            f"remote={remote!r} runs a model on a server, which the {'/'.join(remote_frameworks)} framework does: "
            f"pass ModelSource(name, framework={remote_frameworks[0]!r}), "
            "loaded=(model, tokenizer) with model = nnsight.TransformersModel(hub_id), and baselines=() (a baseline's "
            f"weights would be made here); got framework={source.framework!r}, "
            f"loaded={'given' if loaded is not None else None}, baselines={list(baselines)!r}")
    return {"remote": remote, "request_limits": request_limits}


def _identity(network: Any, corpus_identity: dict[str, Any], config: dict[str, Any],
              shard: Shard | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(identity, provenance)``: what a checkpoint must match to be resumed, and what each result records of
    where its numbers come from."""
    # Checkpoints and fingerprints keep the key they had before the study record spelt it "framework", so that
    # shards and checkpoints written before still merge and resume.
    fingerprinted = {("backend" if k == "framework" else k): v for k, v in config.items()}
    identity = {"model": model_identity(network), "corpus": corpus_identity,
                "config": {**fingerprinted, "shard": None if shard is None else str(shard)}}
    # What the numbers depend on (not batch size, sample size or checkpoints): results that differ in it never merge.
    measured = {k: fingerprinted[k] for k in ("backend", "context_length", "exclude_keys", "seed", "pack")
                if k in fingerprinted}
    return identity, {"model": identity["model"], "corpus": corpus_identity,
                      "config_sha256": config_fingerprint(measured)}


def _study_config(source: ModelSource, corpus: Any, n_docs: int, options: MeasurementOptions, seed: int,
                  baselines: Sequence[str], pack: bool, checkpoint_every: int | None, loads: bool,
                  remote: bool | str = False) -> dict[str, Any]:
    """The study's recorded configuration (``Study.config``, each result's ``metadata["study"]``); ``loads``: the
    study loaded the model itself (else its kernel is the caller's and not recorded)."""
    config = {
        "model": source.name,
        # Where the documents came from, so that a report can reload one to view heads.
        "corpus": "default" if corpus is None else str(corpus) if isinstance(corpus, (str, os.PathLike)) else None,
        "framework": source.framework,
        "n_docs": n_docs,
        "context_length": options.context_length,
        "batch_size": options.batch_size,
        "exclude_keys": list(options.exclude_keys),
        "seed": seed,
        "baselines": list(baselines),
        "sample_size": options.sample_size,
        "keep_pattern": bool(options.keep_pattern),
        "checkpoint_every": checkpoint_every,
        "attn_implementation": source.attn_implementation if loads else None,
        "interval_groups": options.interval_groups,
    }
    if pack:  # only then, so that the fingerprints of unpacked studies stay what they were
        config["pack"] = True
    if remote:  # likewise for local studies
        config["remote"] = remote if isinstance(remote, str) else True
    return config


def _timed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``(function(*args, **kwargs), seconds it took)``."""
    start = time.perf_counter()
    return function(*args, **kwargs), time.perf_counter() - start
