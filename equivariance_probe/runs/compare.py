"""The study across architectures: several models on the same windows, in one table.

Place in the seams: *runs*, orchestration above :func:`~equivariance_probe.runs.study.run_study`. For each
model it runs the trained weights and its baselines (by default its own random
initialisation) through the probe and collects the numbers into one table, one row per
``(model, variant)``; it computes nothing itself.

Same windows for every model: one text per window, cut from a corpus document so that
*every* model's tokenizer (with its special tokens, as the probe tokenises) yields at least
``T`` tokens from it; the probe then truncates each model's tokens to exactly ``T``. So every
number rests on the same documents and the same number of tokens per window (a check).

Cost: each model's wall time per variant (windows per minute) and its peak resident memory
(:class:`~equivariance_probe.sources.resources.PeakMemory`) are measured in the same run.
Before anything is loaded, each model's memory need is estimated
(:func:`~equivariance_probe.sources.resources.estimate_memory`) and a model that does not fit
in the available memory is refused with the estimate. The comparison's figure is drawn by
:func:`~equivariance_probe.display.comparison.comparison_figure`.

Example:
    >>> from equivariance_probe import compare_models
    >>> comparison = compare_models(n_docs=2, context_length=128)      # the three packaged models
    >>> print(comparison.table())
    >>> comparison.save("compare_out")        # comparison.md/.csv/.json and per-model results
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from ..errors import EmptyCorpusError, IncompatibleResultsError, InputError, IntervalUnavailableError, check_integer
from ..maths.metrics import FORMS, SCALES
from ..probe import MeasurementOptions
from ..result import DIFFERENCE_STATISTICS, paired_differences
from ..records.fileformat import make_folder, write_text_atomically
from .tables import csv_text, interval_bounds, markdown_table, row_cell, summary_value
from ..sources.corpus import load_corpus
from ..sources.model_source import ModelSource, loading_keywords, model_source
from ..sources.resources import MemoryEstimate, PeakMemory, check_fits, estimate_memory_of, model_size
from .checkpoint import lock_output_folder
from .study import Study, check_baselines, run_study

__all__ = [
    "Comparison",
    "ModelCost",
    "compare_models",
    "common_windows",
    "DEFAULT_COMPARE_MODELS",
    "DEFAULT_COMPARISON",
    "COMPARISON_MEASUREMENT",
    "model_folders",
]

#: The packaged models (:data:`equivariance_probe.sources.registry.REGISTRY`), smallest context first.
DEFAULT_COMPARE_MODELS = ("gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")

#: The default comparison, sized to run the three packaged models, trained and at random
#: initialisation, in well under 30 minutes on 2 CPU cores (docs/guide/comparisons.md).
DEFAULT_COMPARISON = {"n_docs": 12, "context_length": 512, "batch_size": 4, "baselines": ("random_init",)}

#: How a comparison measures unless told otherwise: every model at one window length, no entry sample
#: (the comparison draws no scatter plot).
COMPARISON_MEASUREMENT = MeasurementOptions(context_length=DEFAULT_COMPARISON["context_length"],
                                            batch_size=DEFAULT_COMPARISON["batch_size"])

_FITS = ("power", "exponential", "prior")

#: Columns of :meth:`Comparison.rows` read from each result's summary, and where.
_SUMMARY_PATHS: dict[str, tuple[str, ...]] = {
    **{f"{scale}_{form}": ("query_position_r2", scale, form) for scale in SCALES for form in FORMS},
    **{f"persistence_{fit}_r2": ("persistence_fit_r2", fit) for fit in _FITS},
    "toeplitz_r2": ("toeplitz_r2_per_doc_mean",),
}


def _differences(trained: Any, baseline: Any) -> dict[str, float | None]:
    """``trained_minus_{statistic}`` with ``_low``/``_high`` for every difference the study reports
    (``None`` everywhere for the trained row itself, and where the two have no paired intervals)."""
    found = {name: (None, None, None) for name in DIFFERENCE_STATISTICS}
    if baseline is not None:
        with contextlib.suppress(IntervalUnavailableError, IncompatibleResultsError):
            found = {name: (d.estimate, d.low, d.high) for name, d in paired_differences(trained, baseline).items()}
    return {f"trained_minus_{name}{suffix}": value for name, values in found.items()
            for suffix, value in zip(("", "_low", "_high"), values)}


@dataclass(frozen=True)
class ModelCost:
    """What one model's part of the comparison cost, measured in the run.

    Attributes:
        seconds: wall time per variant (building the baseline included), in seconds.
        load_seconds: loading the trained model (a packaged model's first conversion excluded:
            that happens before, when its tokenizer is read).
        peak_bytes: peak resident memory of the process while this model was loaded and run.
        peak_method: how ``peak_bytes`` was measured (see :class:`~equivariance_probe.sources.resources.PeakMemory`).
        estimate: the memory estimate checked before loading.
    """

    seconds: dict[str, float]
    load_seconds: float
    peak_bytes: int | None
    peak_method: str
    estimate: MemoryEstimate

    def windows_per_minute(self, variant: str, n_windows: int) -> float:
        return 60.0 * n_windows / self.seconds[variant]


@dataclass
class Comparison:
    """The comparison: one :class:`~equivariance_probe.runs.study.Study` and one cost per model."""

    studies: dict[str, Study]
    costs: dict[str, ModelCost]
    config: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        fitted = "; ".join(
            f"{label}: " + ", ".join(f"{variant} {result.query_position_r2('log', 'fitted'):.4f}"
                                     for variant, result in study.results.items())
            for label, study in self.studies.items())
        return (f"Comparison({len(self.studies)} models; log fitted query-position R²: {fitted}; "
                ".table(), .rows(), .save(folder))")

    def rows(self) -> list[dict[str, Any]]:
        """One row per ``(model, variant)``: every number of the table, and what it rests on.

        Keys: ``model, variant, windows, tokens``; ``{scale}_{form}`` for the query-position R²
        (scale ``log``/``raw``, form ``prior``/``fitted``/``eta2``); ``persistence_{fit}_r2`` for
        the power, exponential and uniform-prior fits to ``P(dt)``; ``toeplitz_r2`` (mean over
        windows and heads of the per-window Toeplitz R²); each of these with ``_low`` and ``_high``,
        its 95 % interval over windows (``None`` where there is none); for a baseline,
        ``trained_minus_{statistic}`` with ``_low``/``_high`` (the difference from the model's trained
        weights over the same windows, :data:`~equivariance_probe.result.DIFFERENCE_STATISTICS`);
        ``seconds, windows_per_minute, peak_memory_gib, estimated_memory_gib, n_parameters, n_layers, n_heads``.
        """
        rows = []
        for label, study in self.studies.items():
            cost = self.costs[label]
            for variant, result in study.results.items():
                row: dict[str, Any] = {"model": label, "variant": variant,
                                       "windows": result.n_windows, "tokens": result.n_tokens}
                summary = result.summary()
                for column, path in _SUMMARY_PATHS.items():
                    row[column] = float(summary_value(summary, path))
                    row[f"{column}_low"], row[f"{column}_high"] = interval_bounds(summary.get("intervals"), path)
                row.update(_differences(study.trained, result if variant != "trained" else None))
                row["seconds"] = cost.seconds[variant]
                row["windows_per_minute"] = cost.windows_per_minute(variant, result.n_windows)
                row["peak_memory_gib"] = None if cost.peak_bytes is None else cost.peak_bytes / 2**30
                row["estimated_memory_gib"] = cost.estimate.total / 2**30
                row["n_parameters"] = cost.estimate.n_parameters
                row["n_layers"], row["n_heads"] = result.n_layers, result.n_heads
                rows.append(row)
        return rows

    def table_rows(self) -> list[tuple[str, str, list[str]]]:
        """The rows of :meth:`table`: ``(group, statistic, one cell per (model, variant))``, cells as text."""
        rows = self.rows()
        lines: list[tuple[str, str, list[str]]] = []

        def line(group: str, name: str, cells: list[str]) -> None:
            lines.append((group, name, cells))

        for scale in SCALES:
            for form in FORMS:
                line(f"QPVE {scale}", form, [row_cell(r, f"{scale}_{form}") for r in rows])
        for fit in _FITS:
            line("P(dt)", f"{fit} fit R²", [row_cell(r, f"persistence_{fit}_r2") for r in rows])
        line("Toeplitz", "mean per-window R²", [row_cell(r, "toeplitz_r2") for r in rows])
        for statistic in DIFFERENCE_STATISTICS:
            name = statistic.replace("_fit", " fit R²").replace("toeplitz_per_doc", "Toeplitz per-window R²").replace("_", " ")
            line("trained − baseline", name, [row_cell(r, f"trained_minus_{statistic}") for r in rows])
        line("", "windows / tokens", [f"{r['windows']} / {r['tokens']}" for r in rows])
        line("", "layers × heads", [f"{r['n_layers']} × {r['n_heads']}" for r in rows])
        line("cost", "windows per minute", [f"{r['windows_per_minute']:.1f}" for r in rows])
        line("cost", "peak memory (GiB)", ["–" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}" for r in rows])
        line("cost", "estimated memory (GiB)", [f"{r['estimated_memory_gib']:.2f}" for r in rows])
        return lines

    def table(self) -> str:
        """Markdown: one column per ``(model, variant)``, one row per statistic."""
        header = [f"{r['model']}<br>{r['variant']}" for r in self.rows()]
        return markdown_table(["", ""], header, self.table_rows())

    def save(self, folder: str | os.PathLike) -> dict[str, Path]:
        """Write ``comparison.md``, ``comparison.csv``, ``comparison.json``, and each model's study
        (:meth:`Study.save`) under ``models/<model>/``; the figure is drawn by the display layer."""
        folder = Path(folder)
        with lock_output_folder(make_folder(folder)):
            rows = self.rows()
            paths = {"csv": folder / "comparison.csv", "json": folder / "comparison.json",
                     "markdown": folder / "comparison.md"}
            write_text_atomically(paths["csv"], csv_text(rows))
            costs = {label: {"seconds": c.seconds, "load_seconds": c.load_seconds, "peak_bytes": c.peak_bytes,
                             "peak_method": c.peak_method, "estimate": c.estimate.describe()}
                     for label, c in self.costs.items()}
            folders = model_folders(self.studies)
            write_text_atomically(paths["json"], json.dumps({"config": self.config, "rows": rows, "costs": costs,
                                                             "folders": folders}, indent=2) + "\n")
            method = next(iter(self.costs.values())).peak_method if self.costs else ""
            write_text_atomically(
                paths["markdown"],
                "# Equivariance probe: comparison across models\n\n"
                f"{self.config.get('windows_description', '')}\n\n"
                "QPVE: query-position R² over every visible entry (log scale: y = log max(a, eps)). "
                "P(dt): R² of each fit to the persistence curve. Toeplitz: mean over windows and heads of "
                "the per-window Toeplitz R². Brackets: 95 % intervals over windows (delete-a-group jackknife); "
                "trained − baseline: the difference over the same windows, in the baseline's column. "
                "Cost: windows per minute of each variant (building the "
                f"baseline included) and the model's peak resident memory ({method}).\n\n"
                f"{self.table()}\n\nConfiguration: `{json.dumps(self.config.get('arguments', {}))}`\n",
            )
            for label, study in self.studies.items():
                study.save(folder / "models" / folders[label])
            return paths


def model_folders(labels: Iterable[str]) -> dict[str, str]:
    """The folder of each model's study in a saved comparison (``models/<folder>/``): its label, safe as one file
    name, and unique.

    A label is the user's (a path, a hub name): every character but letters, digits, ``.``, ``_`` and ``-``
    becomes ``_``, and leading and trailing ``_`` and ``.`` go, so no folder is ``.``, ``..`` or hidden and none
    leaves ``models/``. Two labels that come out the same (``org/model`` and ``org_model``; or differing only in
    case, one folder on macOS and Windows) are told apart by ``-2``, ``-3``, ... in the order given; the mapping
    is recorded in ``comparison.json`` under ``"folders"``.

    Example:
        >>> model_folders(["org/model", "org_model", ".."])
        {'org/model': 'org_model', 'org_model': 'org_model-2', '..': 'model'}
    """
    folders: dict[str, str] = {}
    used: set[str] = set()
    for label in labels:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", str(label)).strip("_.") or "model"
        name, number = base, 1
        while name.lower() in used:
            number += 1
            name = f"{base}-{number}"
        used.add(name.lower())
        folders[label] = name
    return folders


# ----------------------------------------------------------------------------- windows


def _token_count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def _end_of_token(tokenizer: Any, text: str, index: int) -> int | None:
    """Character offset where token ``index`` of ``text`` ends; ``None`` if ``text`` is shorter."""
    try:
        encoding = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer: no offsets
        return len(text) if _token_count(tokenizer, text) > index else None
    if len(encoding["input_ids"]) <= index:
        return None
    return int(encoding["offset_mapping"][index][1])


def common_windows(texts: Sequence[str], tokenizers: Mapping[str, Any], context_length: int, n_docs: int) -> list[str]:
    """The first ``n_docs`` texts cut so that every tokenizer yields at least ``context_length`` tokens.

    For each text, the cut is the largest (over tokenizers) character offset at which token
    ``T - 1`` ends (special tokens counted, as the probe tokenises); since a prefix can tokenise
    differently at its end, the cut is then extended until every tokenizer really yields ``T``
    tokens from it. Texts too short for some tokenizer are skipped. The probe truncates each
    model's tokens to exactly ``T``.

    Args:
        texts: documents, in order.
        tokenizers: label -> Hugging Face tokenizer.
        context_length: ``T``.
        n_docs: windows wanted.

    Returns:
        ``n_docs`` strings (prefixes of documents).

    Raises:
        EmptyCorpusError: fewer than ``n_docs`` documents are long enough for every tokenizer.
    """
    windows: list[str] = []
    for text in texts:
        ends = [_end_of_token(tokenizer, text, context_length - 1) for tokenizer in tokenizers.values()]
        if any(end is None for end in ends):
            continue
        cut = max(ends)
        while any(_token_count(t, text[:cut].strip()) < context_length for t in tokenizers.values()):
            cut = min(len(text), cut + 16)
        windows.append(text[:cut].strip())
        if len(windows) == n_docs:
            return windows
    raise EmptyCorpusError(
        f"only {len(windows)} documents of the corpus give at least {context_length} tokens with every "
        f"tokenizer ({', '.join(tokenizers)}), but n_docs={n_docs}; lower n_docs or context_length, or "
        "pass a corpus with longer documents."
    )


# ----------------------------------------------------------------------------- the comparison


def compare_models(
    models: Sequence[str | ModelSource] | Mapping[str, str | ModelSource | tuple[Any, Any]] = DEFAULT_COMPARE_MODELS,
    *,
    corpus: Any = None,
    n_docs: int = DEFAULT_COMPARISON["n_docs"],
    baselines: Sequence[str] = DEFAULT_COMPARISON["baselines"],
    seed: int = 0,
    options: MeasurementOptions | None = None,
    memory_limit: int | None = None,
    progress: bool = True,
    **measurement: Any,
) -> Comparison:
    """Run the study on several models over the same windows and collect one table.

    Args:
        models: models by name or :class:`~equivariance_probe.sources.model_source.ModelSource` (loaded one at a
            time), or a mapping label -> name, spec or an already loaded ``(model, tokenizer)``.
        corpus: anything :func:`~equivariance_probe.sources.corpus.load_corpus` reads (``None``: the
            packaged Wikipedia articles).
        n_docs: windows (one per document).
        baselines: any of ``"random_init"``, ``"zero"`` (each model's own).
        seed: seed of the random initialisations.
        options: how every model is measured, a :class:`~equivariance_probe.probe.MeasurementOptions`
            (default :data:`COMPARISON_MEASUREMENT`: ``context_length=512``, ``batch_size=4``, no entry
            sample); ``context_length`` is the tokens per window ``T``, the same for every model.
        memory_limit: bytes a model may use; ``None``: the memory available now.
        progress: show progress bars.
        **measurement: any field of :class:`~equivariance_probe.probe.MeasurementOptions` by name, over
            those of ``options`` (``interval_groups`` groups windows by their token ids' fingerprints, which
            differ between tokenizers, so per model). Loading keywords are refused with the
            :class:`ModelSource` that carries them.

    Returns:
        A :class:`Comparison`.

    Raises:
        InsufficientMemoryError: a model's estimated need exceeds ``memory_limit`` (checked for
            every model before any is loaded).
        EmptyCorpusError: too few documents are long enough for every tokenizer.
        InputError: bad arguments.
    """
    legacy = loading_keywords(measurement)
    entries: dict[str, Any] = (dict(models) if isinstance(models, Mapping) else
                               {m.name if isinstance(m, ModelSource) else str(m): m for m in models})
    entries = {label: model_source(entry, legacy, where="compare_models") for label, entry in entries.items()}
    if not entries:
        raise InputError("models is empty; pass at least one model name, e.g. ['gemma-3-270m'].")
    check_baselines(baselines)
    options = MeasurementOptions.of(COMPARISON_MEASUREMENT if options is None else options, **measurement)
    context_length, batch_size = options.context_length, options.batch_size
    for name, value in (("n_docs", n_docs), ("context_length", context_length), ("batch_size", batch_size)):
        check_integer(name, value, message=f"{name} must be a positive integer, got {value!r}")
    tokenizers, estimates = _tokenizers_that_fit(entries, context_length, batch_size, 2 if baselines else 1,
                                                 memory_limit)
    texts = common_windows(load_corpus(corpus), tokenizers, context_length, n_docs)
    studies: dict[str, Study] = {}
    costs: dict[str, ModelCost] = {}
    for label, entry in entries.items():
        with PeakMemory() as peak:
            start = time.perf_counter()
            loaded = entry.load() if isinstance(entry, ModelSource) else entry
            load_seconds = time.perf_counter() - start
            study = run_study(label, corpus=texts, n_docs=len(texts),
                              baselines=baselines, seed=seed, options=options, progress=progress, loaded=loaded)
            del loaded
            gc.collect()  # one model in memory at a time
        _check_same_tokens(label, study, len(texts), context_length)
        studies[label] = study
        costs[label] = ModelCost(seconds={v: study.timings[v] for v in study.results}, load_seconds=load_seconds,
                                 peak_bytes=peak.bytes, peak_method=peak.method, estimate=estimates[label])
    config = {
        "arguments": {"models": list(entries), "n_docs": n_docs, "context_length": context_length,
                      "batch_size": batch_size, "baselines": list(baselines), "exclude_keys": list(options.exclude_keys),
                      "seed": seed, "interval_groups": options.interval_groups},
        "windows_description": _windows_description(len(texts), context_length, corpus),
    }
    return Comparison(studies, costs, config)


def _tokenizers_that_fit(entries: dict[str, Any], context_length: int, batch_size: int, copies: int,
                         memory_limit: int | None) -> tuple[dict[str, Any], dict[str, MemoryEstimate]]:
    """``(tokenizers, estimates)``: each model's tokenizer (converting packaged models once, without keeping their
    weights) and its memory estimate, checked against ``memory_limit`` for every model before any is loaded."""
    tokenizers = {label: e.load_tokenizer() if isinstance(e, ModelSource) else e[1] for label, e in entries.items()}
    estimates = {label: estimate_memory_of(model_size(e.load_config() if isinstance(e, ModelSource) else e[0]),
                                           context_length=context_length, batch_size=batch_size, copies=copies)
                 for label, e in entries.items()}
    check_fits(estimates, memory_limit, what="",
               fix="Lower batch_size or context_length, leave these models out, or free memory.")
    return tokenizers, estimates


def _windows_description(n_windows: int, context_length: int, corpus: Any) -> str:
    """How the comparison's windows were cut, in words."""
    return (f"{n_windows} windows of exactly {context_length} tokens per model, cut from the same "
            f"{n_windows} documents ({'the packaged Wikipedia articles' if corpus is None else 'the given corpus'}) "
            "so that every model's tokenizer yields at least that many tokens, each model with its own tokenizer.")


def _check_same_tokens(label: str, study: Study, n_windows: int, context_length: int) -> None:
    """Every variant of ``label`` read ``n_windows × context_length`` tokens, as every other model did."""
    for variant, result in study.results.items():
        if result.n_tokens != n_windows * context_length:
            raise IncompatibleResultsError(
                f"{label} ({variant}) read {result.n_tokens} tokens, not {n_windows} × {context_length}; "
                "the windows were not cut to the same length for every model (please report this)."
            )
