"""The context-length scan: the same text at several window lengths ``T``, trained vs baselines, one table.

Place in the seams: *runs*, orchestration above the probe. It builds one token stream from the
corpus (:mod:`~equivariance_probe.sources.packing`), cuts it into windows at every length, runs the
trained model and its baselines (:data:`~equivariance_probe.runs.study.BASELINES`, built as
:func:`~equivariance_probe.runs.study.run_study` builds them) through
:class:`~equivariance_probe.probe.EquivarianceProbe`, and collects the numbers each
:class:`~equivariance_probe.result.ProbeResult` already computes (its summary: every query-position
R² form and scale and the persistence fits' R², over all layers and per layer group). It computes
nothing itself; the figure is drawn by :mod:`equivariance_probe.display.scan`.

The same text at every length: the stream is read in spans of ``S = T_max - len(prefix)`` tokens
(``T_max`` the longest length, ``prefix`` the tokenizer's special prefix, ``[BOS]`` for Gemma), and
at every length ``T`` each span is cut into windows of ``prefix + (T - len(prefix))`` tokens
(:func:`~equivariance_probe.sources.packing.pack_stream`). With lengths that divide ``T_max``
(powers of two) every length reads ``n_spans · T_max`` window tokens from the same spans; the
table says how many windows, window tokens and stream tokens each length read. Each window's
span (:attr:`~equivariance_probe.sources.packing.PackedWindows.spans`, also in each result's
``metadata["windows"]["spans"]``) is the key that pairs windows of different lengths by text.

The stream (``pack``): by default each span is the beginning of one document (its first ``S``
tokens; documents shorter than that are skipped), so that at ``T_max`` every window is the study's
one window per document; ``pack=True`` concatenates the documents with EOS between them instead
(TransformerLens' ``tokenize_and_concatenate``), so that spans may cross documents.

Before anything runs, each length is checked against the model's maximum context
(:class:`~equivariance_probe.errors.ContextLengthError`) and its estimated memory against the
memory available (:func:`~equivariance_probe.sources.resources.estimate_memory`,
:class:`~equivariance_probe.errors.InsufficientMemoryError`). With an output folder each
``(length, variant)`` result is written as soon as it is measured
(``T<length>/results.safetensors``, ``T<length>/baseline_<name>.safetensors``: the study's names,
so ``equivariance-probe report`` shows a length's baselines beside it), and a complete file of the
same model, stream and settings is reused instead of measured again.

Example:
    >>> from equivariance_probe import scan_context_lengths
    >>> scan = scan_context_lengths("gemma-3-270m", context_lengths=(256, 1024), n_tokens=2048, out="scan_out")
    >>> print(scan.table())
    >>> scan.save("scan_out")          # scan.md / scan.csv / scan.json beside the result files
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (CheckpointError, ContextLengthError, EmptyCorpusError, IncompatibleResultsError, InputError,
                      IntervalUnavailableError, UndefinedStatisticError, check_integer, is_integer, option)
from ..maths.fitting import FIT_NAMES
from ..maths.intervals import format_interval
from ..maths.metrics import FORMS, SCALES
from ..probe import EquivarianceProbe, MeasurementOptions
from ..records.provenance import corpus_fingerprint, model_identity, window_fingerprints
from ..result import ProbeResult, paired_difference
from ..sources.corpus import load_corpus
from ..sources.model_source import ModelSource, loading_keywords, model_source
from ..sources.registry import DEFAULT_MODEL
from ..sources.packing import PackedWindows, document_separator, pack_stream, special_prefix, token_stream
from ..sources.resources import MemoryEstimate, ModelSize, check_fits, estimate_memory_of, model_size
from ..statistics.masks import LAYER_GROUPS  # the groups in table order (ProbeResult.layer_groups)
from .checkpoint import lock_output_folder
from .study import check_baselines, result_filename, variant_builders
from ..records.fileformat import make_folder, write_text_atomically
from .tables import csv_text, interval_bounds, markdown_table, row_cell, summary_value

__all__ = [
    "ContextScan",
    "scan_context_lengths",
    "scan_windows",
    "DEFAULT_CONTEXT_LENGTHS",
    "DEFAULT_SCAN",
    "LAYER_GROUPS",
    "length_folder",
]

#: The lengths scanned by default (Gemma 3's sliding window is 512: below, at and above it).
DEFAULT_CONTEXT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)

#: The default scan: two windows of the longest length (16,384 window tokens per length), trained
#: vs its own random initialisation, batches of about 4,096 tokens.
DEFAULT_SCAN = {"n_tokens": 16384, "baselines": ("random_init",), "batch_tokens": 4096}

#: Options that change what a length's result file holds, beyond the exclusions (always in its identity):
#: a file of the scan is reused only if these are as asked, and they enter its identity only where they
#: differ from :class:`~equivariance_probe.probe.MeasurementOptions`' defaults, so that files written
#: before they were recorded are still reused under the defaults.
_STORED_OPTIONS = ("log_floor", "keep_pattern", "min_tokens", "max_windows", "sample_size", "sample_seed", "key_bins",
                   "interval_groups")

#: The numbers whose differences between lengths (and trained minus baseline) the scan tabulates.
DIFFERENCE_ROWS = ("log_fitted", "log_eta2", "raw_eta2", "prior_fit")


def length_folder(context_length: int) -> str:
    """The folder of one length's result files in a scan's output: ``T<length>``."""
    return f"T{context_length}"


@dataclass
class ContextScan:
    """The scan: one :class:`ProbeResult` per ``(length, variant)`` over the same text.

    Attributes:
        results: ``{T: {variant: ProbeResult}}``, lengths ascending, ``"trained"`` first.
        windows: ``{T: description}`` of each length's windows
            (:meth:`~equivariance_probe.sources.packing.PackedWindows.describe`).
        estimates: ``{T: MemoryEstimate}`` checked before the run.
        timings: ``{T: {variant: seconds}}`` (0 for a reused file).
        reused: ``{T: [variants read from existing files]}``.
        config: the arguments and the text's description.
    """

    results: dict[int, dict[str, ProbeResult]]
    windows: dict[int, dict[str, Any]]
    estimates: dict[int, MemoryEstimate]
    timings: dict[int, dict[str, float]]
    reused: dict[int, list[str]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def context_lengths(self) -> list[int]:
        return list(self.results)

    @property
    def variants(self) -> list[str]:
        return list(next(iter(self.results.values())))

    def groups(self) -> list[str]:
        """The layer groups of the model, in :data:`LAYER_GROUPS` order (``["all"]`` for one kind of layer)."""
        first = next(iter(next(iter(self.results.values())).values()))
        return [group for group in LAYER_GROUPS if group in first.layer_groups()]

    def rows(self) -> list[dict[str, Any]]:
        """One row per ``(length, variant, layer group)``: every number of the table, and what it rests on.

        Keys: ``context_length, variant, layers`` (``all``/``sliding``/``global``), ``n_layers``
        (in the group), ``windows, tokens`` (window tokens, special prefix included),
        ``text_tokens`` (stream tokens read), ``spans``; ``{scale}_{form}`` for the query-position
        R² over the group's visible entries and ``persistence_{fit}_r2`` for the fits to its
        ``P(dt)``, each with ``_low`` and ``_high``: its 95 % interval over spans (``None`` where the
        result has none, e.g. fewer than two spans); ``batch_size, seconds, reused, estimated_memory_gib``.
        """
        rows = []
        for length, variants in self.results.items():
            windows = self.windows[length]
            for variant, result in variants.items():
                summary = result.summary()
                layers = result.layer_groups()
                intervals = summary.get("intervals") or {}
                for group in self.groups():
                    numbers = summary if group == "all" else summary["layer_groups"][group]
                    bounds = intervals if group == "all" else (intervals.get("layer_groups") or {}).get(group) or {}
                    row: dict[str, Any] = {
                        "context_length": length, "variant": variant, "layers": group, "n_layers": len(layers[group]),
                        "windows": result.n_windows, "tokens": result.n_tokens, "text_tokens": windows["text_tokens"],
                        "spans": windows["n_spans"],
                    }
                    for scale in SCALES:
                        for form in FORMS:
                            path = ("query_position_r2", scale, form)
                            row[f"{scale}_{form}"] = _as_float(summary_value(numbers, path))
                            row[f"{scale}_{form}_low"], row[f"{scale}_{form}_high"] = interval_bounds(bounds, path)
                    for fit in FIT_NAMES:
                        path = ("persistence_fit_r2", fit)
                        row[f"persistence_{fit}_r2"] = _as_float(summary_value(numbers, path))
                        row[f"persistence_{fit}_r2_low"], row[f"persistence_{fit}_r2_high"] = interval_bounds(bounds, path)
                    row["batch_size"] = int(result.metadata.get("batch_size", 0))
                    row["seconds"] = self.timings[length][variant]
                    row["reused"] = variant in self.reused.get(length, [])
                    row["estimated_memory_gib"] = self.estimates[length].total / 2**30
                    rows.append(row)
        return rows

    def table_rows(self) -> list[tuple[str, str, str, list[str]]]:
        """The rows of :meth:`table`: ``(variant, layers, statistic, one cell per length)``."""
        rows = self.rows()
        by_key = {(r["context_length"], r["variant"], r["layers"]): r for r in rows}
        lengths = self.context_lengths
        lines: list[tuple[str, str, str, list[str]]] = []
        first = [by_key[(length, self.variants[0], "all")] for length in lengths]
        lines.append(("", "", "windows / window tokens", [f"{r['windows']} / {r['tokens']}" for r in first]))
        lines.append(("", "", "stream tokens read (spans)", [f"{r['text_tokens']} ({r['spans']})" for r in first]))
        for variant in self.variants:
            for group in self.groups():
                cells = [by_key[(length, variant, group)] for length in lengths]
                name = f"{group} ({cells[0]['n_layers']})"
                for scale in SCALES:
                    for form in FORMS:
                        lines.append((variant, name, f"QPVE {scale} {form}", [row_cell(r, f"{scale}_{form}") for r in cells]))
                for fit in FIT_NAMES:
                    lines.append((variant, name, f"P(dt) {fit} fit R²", [row_cell(r, f"persistence_{fit}_r2") for r in cells]))
            seconds = [by_key[(length, variant, "all")] for length in lengths]
            lines.append((variant, "", "seconds", ["reused" if r["reused"] else f"{r['seconds']:.1f}" for r in seconds]))
        return lines

    def difference(self, context_length: int, reference: int, statistic: str = "log_fitted", *,
                   variant: str = "trained", by: str | None = None, level: float = 0.95) -> Any:
        """``θ(T) - θ(T_ref)`` of one variant with its interval, paired span by span.

        Both lengths read the same spans and group their windows by span, so the delete-a-group
        jackknife deletes the same text at both lengths (:func:`~equivariance_probe.result.paired_difference`).

        Args:
            context_length: a length of the scan.
            reference: the length it is compared with.
            statistic: a name of :data:`~equivariance_probe.analyses.intervals.INTERVAL_STATISTICS`
                (``"log_fitted"``, ``"raw_eta2"``, ``"prior_fit"``, ``"toeplitz_per_doc"``, ...).
            variant: ``"trained"`` or a baseline of the scan.
            by: ``None``, ``"layer"``, ``"head"`` or ``"layer_group"`` (``{group: Interval}``).
            level: the confidence level.

        Raises:
            InputError: a length or variant the scan does not hold.
            IntervalUnavailableError: fewer than two spans in two different groups (says why).
        """
        for length in (context_length, reference):
            if length not in self.results:
                raise InputError(f"context length {length} is not in the scan; choose one of {self.context_lengths}")
        if variant not in self.variants:
            raise InputError(f"variant {variant!r} is not in the scan; choose one of {self.variants}")
        return paired_difference(self.results[context_length][variant], self.results[reference][variant], statistic,
                                 by, level)

    def difference_rows(self, statistics: Sequence[str] = DIFFERENCE_ROWS,
                        level: float = 0.95) -> list[tuple[str, str, str, list[str]]]:
        """Rows ``(variant, layers, statistic, one cell per length)`` of ``θ(T) - θ(T_min)`` with its
        interval (paired by span, :meth:`difference`), and of ``trained - baseline`` at each length
        (paired by span over the same windows); ``n/a (why)`` where there is no interval."""
        lengths = self.context_lengths
        groups = self.groups()
        by = "layer_group" if len(groups) > 1 else None

        def cells(pair) -> dict[str, list[str]]:
            out: dict[str, list[str]] = {group: [] for group in groups}
            for a, b in pair:
                try:
                    found = paired_difference(a, b, statistic, by, level)
                except (IntervalUnavailableError, IncompatibleResultsError, UndefinedStatisticError) as error:
                    reason = "undefined" if isinstance(error, UndefinedStatisticError) else "n/a"
                    for group in groups:
                        out[group].append(reason)
                    continue
                for group in groups:
                    value = found[group] if by else found
                    out[group].append(format_interval(value.estimate, value.low, value.high))
            return out

        lines: list[tuple[str, str, str, list[str]]] = []
        for statistic in statistics:
            for variant in self.variants:
                found = cells([(self.results[t][variant], self.results[lengths[0]][variant]) for t in lengths])
                for group in groups:
                    lines.append((f"{variant}: T − {lengths[0]}", group, statistic, found[group]))
            for baseline in self.variants[1:]:
                found = cells([(self.results[t][self.variants[0]], self.results[t][baseline]) for t in lengths])
                for group in groups:
                    lines.append((f"{self.variants[0]} − {baseline}", group, statistic, found[group]))
        return lines

    def table(self) -> str:
        """Markdown: one column per length ``T``, one row per ``(variant, layer group, statistic)``."""
        return markdown_table(["variant", "layers", "statistic"], [f"T = {t}" for t in self.context_lengths],
                              self.table_rows())

    def difference_table(self) -> str:
        """Markdown of :meth:`difference_rows`: one column per length."""
        return markdown_table(["difference", "layers", "statistic"], [f"T = {t}" for t in self.context_lengths],
                              self.difference_rows())

    def save(self, folder: str | os.PathLike) -> dict[str, Path]:
        """Write ``scan.md``, ``scan.csv``, ``scan.json``, and every result file not yet in ``folder``
        (``T<length>/results.safetensors``, ``T<length>/baseline_<name>.safetensors``); the figure
        is drawn by the display layer (:func:`~equivariance_probe.display.scan.save_scan`)."""
        folder = Path(folder)
        with lock_output_folder(make_folder(folder)):
            for length, variants in self.results.items():
                for variant, result in variants.items():
                    path = folder / length_folder(length) / result_filename(variant)
                    if not path.is_file():
                        make_folder(path.parent)
                        result.save(path)
            rows = self.rows()
            paths = {"csv": folder / "scan.csv", "json": folder / "scan.json", "markdown": folder / "scan.md"}
            write_text_atomically(paths["csv"], csv_text(rows))
            document = {"config": self.config, "rows": rows, "windows": {str(t): w for t, w in self.windows.items()},
                        "estimates": {str(t): e.describe() for t, e in self.estimates.items()},
                        "timings": {str(t): v for t, v in self.timings.items()},
                        "reused": {str(t): v for t, v in self.reused.items()}}
            write_text_atomically(paths["json"], json.dumps(document, indent=1, allow_nan=False, default=_json_number) + "\n")
            write_text_atomically(
                paths["markdown"],
                f"# Equivariance probe: context-length scan of {self.config.get('model')}\n\n"
                f"{self.config.get('text_description', '')}\n\n"
                "QPVE: query-position R² over every visible entry of the layers in the group (log scale: "
                "y = log max(a, eps)). P(dt): R² of each fit to the group's persistence curve. Layer groups are "
                "the model's declared kinds (sliding-window and global layers), whatever T.\n\n"
                f"{self.table()}\n\n"
                "Differences with their 95 % intervals, paired span by span (the delete-a-group jackknife deletes "
                "the same text at both lengths, or in both variants):\n\n"
                f"{self.difference_table()}\n\nConfiguration: `{json.dumps(self.config.get('arguments', {}))}`\n",
            )
            return paths



def _as_float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not np.isfinite(value) else str(value)


# ----------------------------------------------------------------------------- the text


def scan_windows(
    documents: Sequence[str],
    tokenizer: Any,
    context_lengths: Sequence[int],
    n_tokens: int,
    *,
    pack: bool = False,
) -> dict[int, PackedWindows]:
    """The windows of every length, cut from one stream in the spans of the longest length.

    Args:
        documents: texts, in order.
        tokenizer: the model's tokenizer.
        context_lengths: the lengths ``T``.
        n_tokens: window tokens at the longest length: ``n_tokens // T_max`` spans are read.
        pack: ``True``: the EOS-separated concatenation of the documents; ``False``: the first
            ``T_max - len(prefix)`` tokens of each document that has that many.

    Returns:
        ``{T: PackedWindows}``, lengths ascending.

    Raises:
        EmptyCorpusError: the corpus does not give ``n_tokens // T_max`` spans.
    """
    lengths = sorted(context_lengths)
    longest = lengths[-1]
    prefix = special_prefix(tokenizer)
    protocol = "packed" if pack else "document_prefixes"
    separator = document_separator(tokenizer) if pack else ()
    span = longest - len(prefix)
    n_spans = n_tokens // longest
    stream, used = token_stream(documents, tokenizer, protocol=protocol, separator=separator, span_tokens=span,
                                max_tokens=n_spans * span)
    if len(stream) < n_spans * span:
        what = (f"documents of at least {span} tokens" if not pack else "tokens in the whole corpus")
        raise EmptyCorpusError(
            f"n_tokens={n_tokens} asks for {n_spans} spans of {span} stream tokens (windows of {longest} tokens), "
            f"but the corpus gives {len(stream) // span} ({used} {what}); lower {option('n_tokens')} or the longest "
            f"{option('context_lengths')}, pass a larger corpus"
            + ("" if pack else f", or pack the documents ({option('pack', True)})")
        )
    return {length: pack_stream(stream, length, prefix=prefix, span_tokens=span, separator=separator,
                                protocol=protocol, n_documents=used) for length in lengths}


# ----------------------------------------------------------------------------- checks before running


def _check_lengths(context_lengths: Sequence[int], n_tokens: int, batch_size: int | None) -> list[int]:
    lengths = list(context_lengths)
    if not lengths or not all(is_integer(t, 2) for t in lengths):
        raise InputError(f"context_lengths must be integers of at least 2 tokens, e.g. {list(DEFAULT_CONTEXT_LENGTHS)}; "
                         f"got {lengths!r}")
    if len(set(lengths)) != len(lengths):
        raise InputError(f"context_lengths {lengths} name a length twice; give each length once")
    lengths.sort()
    check_integer("n_tokens", n_tokens, minimum=lengths[-1],
                  message=f"{option('n_tokens', n_tokens)} must be at least the longest context length {lengths[-1]} "
                          f"(one window of it); pass {option('n_tokens', 2 * lengths[-1])} for two")
    check_integer("batch_size", batch_size, allow_none=True,
                  message=f"batch_size must be a positive integer or None (about 4096 tokens per batch), got {batch_size!r}")
    return lengths


def _batch_size(length: int, batch_size: int | None) -> int:
    return batch_size if batch_size is not None else max(1, DEFAULT_SCAN["batch_tokens"] // length)


def _check_fits(size: ModelSize, lengths: list[int], batch_size: int | None, copies: int,
                memory_limit: int | None) -> dict[int, MemoryEstimate]:
    """Refuse, before anything runs, lengths over the model's maximum context or over the memory limit."""
    too_long = [t for t in lengths if size.max_context is not None and t > size.max_context]
    if too_long:
        raise ContextLengthError(
            f"context lengths {too_long} are longer than this model's maximum context of {size.max_context} tokens; "
            f"drop them from {option('context_lengths')} (at most {size.max_context})"
        )
    estimates = {t: estimate_memory_of(size, context_length=t, batch_size=_batch_size(t, batch_size), copies=copies)
                 for t in lengths}
    check_fits(estimates, memory_limit, what="context lengths ",
               name=lambda t: f"T = {t} (batch {_batch_size(t, batch_size)})",
               fix=f"Lower {option('batch_size')}, drop these lengths from {option('context_lengths')}, or free memory "
                   f"({option('memory_limit')} sets the limit)")
    return estimates


# ----------------------------------------------------------------------------- resuming


def _reusable(path: Path, identity: dict[str, Any], windows: PackedWindows) -> ProbeResult | None:
    """The complete result at ``path`` if it was measured on this model, text and settings; ``None``
    if there is no file. A file of another scan is refused, never overwritten."""
    if not path.is_file():
        return None
    result = ProbeResult.load(path)
    stored = (result.metadata.get("scan") or {}).get("identity")
    if not result.complete or stored != identity:
        differs = ("it is partial" if not result.complete else "it is not a scan's result" if not isinstance(stored, dict)
                   else "its " + ", ".join(k for k in sorted(set(identity) | set(stored)) if identity.get(k) != stored.get(k))
                   + " differ")
        raise CheckpointError(
            f"{path} cannot be reused by this scan ({differs}); choose another output folder, or delete the file "
            "to measure it again"
        )
    expected = np.sort(window_fingerprints(windows.tokens))
    if not np.array_equal(np.sort(result.statistics.window_fingerprints), expected):
        raise CheckpointError(f"{path} holds other windows than this scan cuts at T = {windows.context_length}; "
                              "choose another output folder, or delete the file to measure it again")
    return result


# ----------------------------------------------------------------------------- the scan


def scan_context_lengths(
    model: str | ModelSource | tuple[Any, Any] = DEFAULT_MODEL,
    *,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    corpus: Any = None,
    n_tokens: int = DEFAULT_SCAN["n_tokens"],
    pack: bool = False,
    baselines: Sequence[str] = DEFAULT_SCAN["baselines"],
    batch_size: int | None = None,
    seed: int = 0,
    options: MeasurementOptions | None = None,
    out: str | os.PathLike | None = None,
    memory_limit: int | None = None,
    progress: bool = True,
    **measurement: Any,
) -> ContextScan:
    """Run the trained model and its baselines on the same text at every context length.

    Args:
        model: a :class:`~equivariance_probe.sources.model_source.ModelSource`, a model's name alone for its defaults,
            or a loaded ``(model, tokenizer)``.
        context_lengths: the lengths ``T`` (any order; run shortest first).
        corpus: anything :func:`~equivariance_probe.sources.corpus.load_corpus` reads (``None``: the
            packaged Wikipedia articles).
        n_tokens: window tokens per length: ``n_tokens // T_max`` spans of the longest length ``T_max``.
        pack: concatenate the documents with EOS between them (``False``: each span is the start of
            one document; see the module docstring).
        baselines: any of ``"random_init"``, ``"zero"``.
        batch_size: windows per forward pass at every length; ``None``: ``max(1, 4096 // T)``.
        seed: seed of the random initialisation.
        options: how each length is measured, a :class:`~equivariance_probe.probe.MeasurementOptions`; its
            ``context_length`` and ``batch_size`` are each length's, and each window's interval group is its
            span's, so that every length resamples the same text regions.
        out: folder for the result files, written as each is measured; complete files of the same
            scan already there are reused.
        memory_limit: bytes a length may need; ``None``: the memory available now.
        progress: show progress bars.
        **measurement: any field of :class:`~equivariance_probe.probe.MeasurementOptions` by name, over those of
            ``options``. Loading keywords are refused with the :class:`ModelSource` that carries
            them.

    Raises:
        ContextLengthError: a length exceeds the model's maximum context (checked before anything runs).
        InsufficientMemoryError: a length's estimated need exceeds ``memory_limit`` (likewise).
        EmptyCorpusError: the corpus does not fill ``n_tokens // T_max`` spans.
        CheckpointError: ``out`` holds a result file of another scan.
        InputError: bad arguments.
    """
    spec = model_source(model, loading_keywords(measurement), where="scan_context_lengths")
    lengths = _check_lengths(context_lengths, n_tokens, batch_size)
    check_baselines(baselines)
    options = MeasurementOptions.of(options, **measurement)
    loaded = spec if isinstance(spec, tuple) else None
    size = model_size(loaded[0] if loaded is not None else spec.load_config())
    estimates = _check_fits(size, lengths, batch_size, 2 if baselines else 1, memory_limit)
    tokenizer = loaded[1] if loaded is not None else spec.load_tokenizer()
    windows = scan_windows(load_corpus(corpus), tokenizer, lengths, n_tokens, pack=pack)
    start = time.perf_counter()
    network = loaded[0] if loaded is not None else spec.load()[0]
    measured, config = _scan_identity(network, windows[lengths[-1]], options, pack, None if loaded else spec)
    config["arguments"].update(context_lengths=lengths, n_tokens=n_tokens, pack=pack, baselines=list(baselines),
                               batch_size=batch_size, seed=seed, corpus="default" if corpus is None else
                               str(corpus) if isinstance(corpus, (str, os.PathLike)) else None)
    config["load_seconds"] = time.perf_counter() - start
    results: dict[int, dict[str, ProbeResult]] = {t: {} for t in lengths}
    timings: dict[int, dict[str, float]] = {t: {} for t in lengths}
    reused: dict[int, list[str]] = {t: [] for t in lengths}
    for variant, build in variant_builders(network, baselines, seed):
        identity = {**measured, "variant": variant, "seed": seed if variant == "random_init" else None}
        for length, result, seconds, was_reused in _variant_lengths(build, tokenizer, windows, lengths, identity, out,
                                                                     variant, options, batch_size, progress, config):
            results[length][variant], timings[length][variant] = result, seconds
            if was_reused:
                reused[length].append(variant)
        gc.collect()  # the baseline just measured leaves memory before the next is built
    return ContextScan(results, {t: w.describe() for t, w in windows.items()}, estimates, timings, reused, config)


def _variant_lengths(build: Any, tokenizer: Any, windows: dict[int, Any], lengths: list[int], identity: dict[str, Any],
                     out: str | os.PathLike | None, variant: str, options: MeasurementOptions, batch_size: int | None,
                     progress: bool, config: dict[str, Any]) -> Iterator[tuple[int, ProbeResult, float, bool]]:
    """``(length, result, seconds, reused)`` of one variant at each length: a complete result file of the same scan
    in ``out`` is reused, the rest measured (the variant is built only if one of its lengths must be)."""
    probe = None
    for length in lengths:
        path = Path(out) / length_folder(length) / result_filename(variant) if out is not None else None
        existing = _reusable(path, identity, windows[length]) if path is not None else None
        if existing is not None:
            yield length, existing, 0.0, True
            continue
        probe = probe or EquivarianceProbe(build(), tokenizer=tokenizer)
        start = time.perf_counter()
        result = _measure_length(probe, windows[length], length, options, batch_size, progress, variant, identity,
                                 config, path)
        yield length, result, time.perf_counter() - start, False


def _scan_identity(network: Any, longest: Any, options: MeasurementOptions, pack: bool,
                   spec: ModelSource | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(identity, config)``: what the numbers depend on (the model's weights, the text, how it is measured: a
    result file of the scan is reused only under the same identity and windows), and the scan's recorded
    configuration (its ``arguments`` completed by the caller); ``spec``: the spec the scan loaded, if it did."""
    stream = longest.tokens[:, len(longest.prefix):]
    measured = {"model": model_identity(network), "stream": corpus_fingerprint([stream])["sha256"],
                "protocol": longest.protocol, "span_tokens": longest.span_tokens, "n_spans": longest.n_spans,
                "prefix": list(longest.prefix), "exclude_keys": list(options.exclude_keys)}
    defaults = MeasurementOptions()
    stored = {name: getattr(options, name) for name in _STORED_OPTIONS if getattr(options, name) != getattr(defaults, name)}
    if stored:
        measured["measurement"] = stored
    text = (f"{longest.n_spans} spans of {longest.span_tokens} stream tokens "
            + (f"from {longest.n_documents} documents concatenated with EOS {list(longest.separator)} between them"
               if pack else f"(the first {longest.span_tokens} tokens of {longest.n_documents} documents)")
            + f", each window after the special prefix {list(longest.prefix)}; every length reads the same spans.")
    config = {
        "model": spec.name if spec is not None else measured["model"].get("name_or_path") or measured["model"]["class"],
        "arguments": {"exclude_keys": list(options.exclude_keys),
                      "attn_implementation": spec.attn_implementation if spec is not None else None, **stored},
        "text_description": text,
    }
    return measured, config


def _measure_length(probe: EquivarianceProbe, windows: Any, length: int, options: MeasurementOptions,
                    batch_size: int | None, progress: bool, variant: str, identity: dict[str, Any],
                    config: dict[str, Any], path: Path | None) -> ProbeResult:
    """One variant at one length, with the study's metadata (so that a report of one length shows its baselines
    beside it), written to ``path`` as soon as it is measured."""
    # Interval groups by span, not by window: every length then resamples the same text regions,
    # so that two lengths pair group by group (ContextScan.difference).
    result = probe.run(windows, options.replace(context_length=length, batch_size=_batch_size(length, batch_size)),
                       progress=progress and f"T={length}, {variant}: windows", resampling_keys=windows.spans)
    arguments = config["arguments"]
    result.metadata.update(
        label=variant,
        study={"model": config["model"], "context_length": length, "baselines": arguments["baselines"],
               "exclude_keys": arguments["exclude_keys"], "seed": arguments["seed"]},
        scan={"identity": identity, "context_lengths": arguments["context_lengths"],
              "n_tokens": arguments["n_tokens"], "pack": arguments["pack"]},
    )
    if path is not None:
        make_folder(path.parent)
        result.save(path)
    return result
