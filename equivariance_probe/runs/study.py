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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..probe import EquivarianceProbe, MeasurementOptions
from ..records.fileformat import make_folder, write_text_atomically
from ..records.provenance import config_fingerprint, corpus_fingerprint, model_identity
from ..records.result_file import RESULT_SUFFIX
from ..records.sharding import Shard, shard_metadata
from ..result import ProbeResult
from .tables import difference_table, summary_table, windows_needed_text
from ..sources.baselines import random_init_like, zero_like
from ..sources.corpus import load_corpus
from ..sources.devices import parse_dtype, resolve_device
from ..adapters.registry import DEFAULT_FRAMEWORK, framework_keyword
from ..sources.models import load_model
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
#: :meth:`~equivariance_probe.result.ProbeResult.sink_rate` of GPT2-XL compares with their 77.00 % on natural text.
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
        return summary_table({name: result.summary() for name, result in self.results.items()}, extended=extended)

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
        summary = self.trained.summary()
        text = (
            f"most position-bound head: {summary['most_position_bound_head']}; "
            f"least: {summary['least_position_bound_head']} (query-position η², log scale)"
        )
        sinks = summary.get("sinks") or {}
        if "rate" in sinks:
            text += (f"\nattention sinks (Gu et al.'s sink rate): {sinks['rate']:.2%} of heads put more than "
                     f"{sinks['epsilon']:g} of their attention on the first token ({sinks['first_token']})")
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
    model: str = "gemma-3-270m",
    *,
    framework: str | None = None,
    corpus: Any = None,
    n_docs: int = DEFAULT_STUDY["n_docs"],
    baselines: Sequence[str] = tuple(BASELINES),
    seed: int = 0,
    options: MeasurementOptions | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    loaded: tuple[Any, Any] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
    resume: bool = False,
    shard: Shard | str | None = None,
    device: str | None = "auto",
    dtype: str | None = None,
    attn_implementation: str = "sdpa",
    pack: bool = False,
    backend: str | None = None,
    **measurement: Any,
) -> Study:
    """Run the study: the trained model and each baseline on the same documents.

    Args:
        model: a packaged model name (``"gemma-3-270m"``), a local folder, or a cached hub name.
        framework: one of the registry's frameworks (``"huggingface"``, the default, ``"transformer_lens"``,
            ``"nnsight"``: :func:`~equivariance_probe.adapters.registry.framework_names`).
        corpus: anything :func:`~equivariance_probe.sources.corpus.load_corpus` reads (``None``: the
            packaged default corpus).
        n_docs: documents (one window each).
        baselines: any of ``"random_init"``, ``"zero"``.
        seed: seed of the random initialisation and of the entry sample.
        options: how each variant is measured, a :class:`~equivariance_probe.probe.MeasurementOptions`
            (default :data:`STUDY_MEASUREMENT`: ``context_length=1024``, ``batch_size=4``,
            ``sample_size=20000``). Its ``sample_seed`` is replaced by one drawn from ``seed`` for each
            checkpoint chunk, variant and shard; a ``context_length`` of ``None`` is the study's 1024.
        cache_dir: where converted packaged models are cached.
        progress: show progress bars.
        loaded: an already loaded ``(model, tokenizer)``, to skip loading.
        checkpoint_dir: save a checkpoint there every ``checkpoint_every`` documents
            (:mod:`equivariance_probe.runs.checkpoint`); ``None``: no checkpoints.
        checkpoint_every: documents between checkpoints (only with ``checkpoint_dir``).
        resume: continue from the checkpoint in ``checkpoint_dir``; refused if it was made
            with another model, corpus or configuration.
        shard: ``Shard(i, n)`` or ``"i/n"``: run only the i-th of n contiguous slices of the
            ``n_docs`` documents (:mod:`equivariance_probe.records.sharding`); merge the shards' results.
        device: where the model runs: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` (the sums live there too unless ``options.device`` says otherwise).
        dtype: the model's parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``);
            ``None``: as loaded (float32).
        attn_implementation: the attention kernel the model runs (``"sdpa"``, ``"eager"``,
            ``"flash_attention_2"``); the probe reads queries and keys whatever the kernel, so the
            numbers agree to float32 rounding, and the fused kernels are faster.
        pack: concatenate the ``n_docs`` documents (EOS between them) and cut them into windows of
            exactly ``context_length`` tokens, each after the tokenizer's special prefix
            (:func:`~equivariance_probe.sources.packing.pack_documents`), instead of one window per
            document; checkpoints and shards then count windows, not documents.
        backend: the deprecated name of ``framework`` (warns).
        **measurement: any field of :class:`~equivariance_probe.probe.MeasurementOptions` by name, over
            those of ``options``: ``context_length`` (window length in tokens), ``batch_size``
            (windows per forward pass), ``exclude_keys`` (key positions left out of every statistic,
            e.g. ``[0]``), ``sample_size`` (entries kept for the scatter plot), ``keep_pattern`` (also
            keep the window-summed pattern, ``8·L·H·T²`` bytes per variant, in memory and in each
            result file, for :meth:`ProbeResult.toeplitz_r2` ``by="head"`` and
            :meth:`ProbeResult.mean_pattern`), ``interval_groups`` (groups of windows for the 95 %
            intervals, by window fingerprint, so the variants, shards and resumed runs share them;
            0 for none), ...
    """
    framework = framework_keyword(framework, backend, DEFAULT_FRAMEWORK)
    options = MeasurementOptions.of(STUDY_MEASUREMENT if options is None else options, **measurement)
    if options.context_length is None:
        options = options.replace(context_length=STUDY_MEASUREMENT.context_length)
    context_length = options.context_length
    check_baselines(baselines)
    # The lock belongs to whoever writes the folder: a Python caller holds the checkpoint folder's as the
    # command line holds its output folder's, taken before the corpus and the model are loaded.
    with contextlib.ExitStack() as held:
        if checkpoint_dir is not None:
            held.enter_context(lock_output_folder(make_folder(checkpoint_dir)))
        timings: dict[str, float] = {}
        shard = Shard.parse(shard) if isinstance(shard, str) else shard
        start = time.perf_counter()
        all_docs = load_corpus(corpus, n_docs=n_docs)
        corpus_identity = corpus_fingerprint(all_docs)
        timings["load_corpus"] = time.perf_counter() - start
        start = time.perf_counter()
        if loaded is not None:
            network, tokenizer = loaded
        else:
            network, tokenizer = load_model(model, framework, cache_dir=cache_dir, device=resolve_device(device),
                                            dtype=parse_dtype(dtype), attn_implementation=attn_implementation)
        timings["load_model"] = time.perf_counter() - start
        # Packed, the units of shards and checkpoints are the windows (the documents fill them unevenly).
        units = pack_documents(all_docs, tokenizer, context_length) if pack else all_docs
        docs = units[slice(*shard.bounds(len(units)))] if shard is not None else units
        config = {
            "model": str(model),
            # Where the documents came from, so that a report can reload one to view heads.
            "corpus": "default" if corpus is None else str(corpus) if isinstance(corpus, (str, os.PathLike)) else None,
            "framework": framework,
            "n_docs": len(all_docs),
            "context_length": context_length,
            "batch_size": options.batch_size,
            "exclude_keys": list(options.exclude_keys),
            "seed": seed,
            "baselines": list(baselines),
            "sample_size": options.sample_size,
            "keep_pattern": bool(options.keep_pattern),
            "checkpoint_every": checkpoint_every if checkpoint_dir is not None else None,
            "attn_implementation": attn_implementation if loaded is None else None,
            "interval_groups": options.interval_groups,
        }
        if pack:  # only then, so that the fingerprints of unpacked studies stay what they were
            config["pack"] = True
        # The fingerprints hash the framework under its first key, "backend", so that the checkpoints and
        # shards written before it was called "framework" still resume and merge.
        fingerprinted = {("backend" if k == "framework" else k): v for k, v in config.items()}
        identity = {"model": model_identity(network), "corpus": corpus_identity,
                    "config": {**fingerprinted, "shard": None if shard is None else str(shard)}}
        # What the numbers depend on (not batch size, sample size or checkpoints): results that differ
        # in it never merge.
        measured = {k: fingerprinted[k] for k in ("backend", "context_length", "exclude_keys", "seed", "pack")
                    if k in fingerprinted}
        provenance = {"model": identity["model"], "corpus": corpus_identity, "config_sha256": config_fingerprint(measured)}
        runner = CheckpointedRun(checkpoint_dir, every=config["checkpoint_every"], identity=identity, resume=resume)
        if shard is not None:
            config["shard"] = str(shard)
        results: dict[str, ProbeResult] = {}
        for index, (name, build) in enumerate(variant_builders(network, baselines, seed)):
            start = time.perf_counter()
            metadata = {"label": name, "study": config, "provenance": provenance}
            if shard is not None:
                metadata["shards"] = shard_metadata(shard, len(units), corpus_identity["sha256"])
            if pack:  # the whole run's windows (each checkpoint chunk records only its own)
                metadata["windows"] = docs.describe()
            results[name] = runner.run_variant(
                name,
                lambda build=build: EquivarianceProbe(build(), tokenizer=tokenizer),
                docs,
                seed_parts=(seed, index, 0 if shard is None else shard.index + 1),
                metadata=metadata,
                options=options,
                progress=progress,
            )
            timings[name] = time.perf_counter() - start
        return Study(results, config, timings, checkpoint=runner)
