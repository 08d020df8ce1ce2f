"""EquivarianceProbe: documents → windows → adapter → statistics.

Place in the seams: the core class, above the adapters, the statistics and the result. The
probe turns documents into token windows, runs them through the model's adapter batch by
batch, and feeds each layer's attention to
:class:`~equivariance_probe.statistics.AttentionStatistics` as it is computed. It holds no
maths of its own.

Tokenisation of strings (the study's protocol): each document is tokenised with the
model's tokenizer *including its special tokens* (Gemma and Llama prepend BOS; GPT-2
adds nothing) and truncated to its first ``context_length`` tokens: one window per
document. Documents shorter than that are kept at their own length (statistics count
only the positions they have); documents with fewer than ``min_tokens`` tokens (e.g.
empty strings) are skipped and counted in ``metadata["skipped_windows"]``. Token tensors
are used as given, one row per window; so are packed windows
(:class:`~equivariance_probe.sources.packing.PackedWindows`, documents concatenated and cut into
windows of exactly ``T``), whose description the result keeps. ``metadata["windows"]`` records
which of these protocols a run used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import numbers
import sys
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .adapters import Adapter, get_adapter
from .adapters.base import SegmentBatch
from .adapters.checks import FirstBatchChecks, run_first_batch_checks
from .errors import ContextLengthError, EmptyCorpusError, EquivarianceProbeError, InputError, StopRequested, check_integer, is_integer, option
from .records.provenance import (
    corpus_fingerprint,
    library_versions,
    model_identity,
    model_revision,
    window_fingerprint,
    window_fingerprints,
)
from .result import ProbeResult
from .shift_result import ShiftResult, shift_check
from .sources.devices import resolve_device
from .sources.packing import PackedWindows, first_token_record, special_prefix, windows_record
from .sources.shift_grid import default_offsets, shift_grid
from .sources.padding import check_not_left_padded, rows_from_encoding
from .statistics import AttentionStatistics
from .statistics.groups import DEFAULT_INTERVAL_GROUPS, as_keys, group_of
from .statistics.shift import ShiftConfig, ShiftStatistics, segment_entries, segment_representations
from .statistics.masks import KEY_BINS

__all__ = ["EquivarianceProbe", "MeasurementOptions", "DEFAULT_CONTEXT_LENGTH", "progress_bar", "counted", "STOP_REQUESTED"]

#: Set from outside (the command line sets it on SIGTERM) to stop every run before its next batch:
#: the run raises :class:`~equivariance_probe.errors.StopRequested`, its complete batches kept as
#: the exception's ``partial_result``. A batch is never cut half-way, and a scheduler's grace period
#: (30 s by default in Slurm and Kubernetes) is spent finishing one batch, not a checkpoint's chunk.
STOP_REQUESTED = threading.Event()


def _stop_if_requested() -> None:
    if STOP_REQUESTED.is_set():
        raise StopRequested("a stop was requested (SIGTERM): stopped before the next batch")

#: Context length for strings when none is given (the study's), capped at the model's maximum.
DEFAULT_CONTEXT_LENGTH = 1024


@dataclass(frozen=True)
class MeasurementOptions:
    """How a run measures: one value passed whole from the command line through studies,
    comparisons and scans down to :meth:`EquivarianceProbe.run`.

    Every field has the default :meth:`EquivarianceProbe.run` uses; a study or a scan starts from its
    own defaults and sets what it decides (:meth:`replace`). The probe checks the values against the
    model when it runs (a context length longer than the model's maximum, excluded keys outside the
    window), so building one never fails on a value.

    Attributes:
        context_length: window length ``T`` in tokens (``None``: 1024, capped at the model's maximum;
            for a tensor, its width).
        batch_size: windows per forward pass. Results do not depend on it.
        exclude_keys: key positions left out of every statistic (e.g. ``(0,)``, the first token,
            which many heads use as an attention sink).
        log_floor: ``eps`` of the log scale, ``log max(a, eps)``; default the smallest normal number
            of the attention dtype (1.2e-38 for float32 and bfloat16).
        keep_pattern: also keep the pattern summed over windows (``8·L·H·T²`` bytes: 600 MB for
            Gemma 3 270M at T = 1024, in memory and in the result file), which only
            ``toeplitz_r2(by="head")``, ``mean_pattern`` and the ``toeplitz`` ranking score read.
        min_tokens: windows with fewer tokens are skipped (and counted).
        max_windows: stop after this many windows (``None``: no limit).
        sample_size: also keep a uniform sample of this many visible entries (for the
            attention-vs-prior scatter plot); 0 keeps none.
        sample_seed: seed of that sample (use different seeds for shards to be merged).
        device: where the float64 sums live (``None``: the model's device).
        key_bins: key-position bins of the key-conditioned persistence curves (the study's
            Figure 1c): one per key up to this many positions, equal-width bins beyond.
        engine: how attention recomputed from queries and keys is reduced: ``"auto"`` (a fused
            Triton kernel on CUDA where Triton imports, else torch in query blocks), ``"torch"`` or
            ``"triton"``.
        interval_groups: ``G``, groups of windows for the intervals over windows (the
            delete-a-group jackknife); 0 for none. Each group keeps ``8·(2·L·H·T + 4·L·H + L·T + T + 1)``
            bytes (1.2 MB for Gemma 3 270M at T = 1024); only groups that hold windows are kept.

    Example:
        >>> options = MeasurementOptions(context_length=256, exclude_keys=[0])
        >>> options.replace(batch_size=8).batch_size, options.exclude_keys
        (8, (0,))
    """

    context_length: int | None = None
    batch_size: int = 4
    exclude_keys: tuple[int, ...] = ()
    log_floor: float | None = None
    keep_pattern: bool = False
    min_tokens: int = 2
    max_windows: int | None = None
    sample_size: int = 0
    sample_seed: int | None = None
    device: str | torch.device | None = None
    key_bins: int = KEY_BINS
    engine: str = "auto"
    interval_groups: int = DEFAULT_INTERVAL_GROUPS

    def __post_init__(self) -> None:
        # Any iterable of positions is accepted, kept as a tuple so that the options stay hashable and
        # frozen; the probe checks the positions against the window when it runs.
        keys = self.exclude_keys
        if not isinstance(keys, tuple) and isinstance(keys, Iterable) and not isinstance(keys, (str, bytes)):
            object.__setattr__(self, "exclude_keys", tuple(keys))

    def replace(self, **changes: Any) -> MeasurementOptions:
        """A copy with ``changes`` (field name -> value).

        Raises:
            TypeError: a name that is not a measurement option (listing those that are).
        """
        unknown = sorted(set(changes) - set(MEASUREMENT_FIELDS))
        if unknown:
            raise TypeError(f"{', '.join(unknown)} {'is not a measurement option' if len(unknown) == 1 else 'are not measurement options'}; "
                            f"the options are {', '.join(MEASUREMENT_FIELDS)}")
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def of(cls, options: MeasurementOptions | None = None, /, **changes: Any) -> MeasurementOptions:
        """``options`` (default: ``MeasurementOptions()``) with ``changes``: how a function that takes
        both an options object and single keywords combines them (the keywords win).

        Raises:
            TypeError: ``options`` is not a :class:`MeasurementOptions` (e.g. a context length given by
                position: pass ``context_length=...``), or a change is not a measurement option.
        """
        if options is not None and not isinstance(options, MeasurementOptions):
            raise TypeError(f"options must be a MeasurementOptions, not {type(options).__name__} ({options!r}); "
                            "pass single options by name, e.g. context_length=1024")
        return (cls() if options is None else options).replace(**changes)


#: The names of :class:`MeasurementOptions`' fields, in order.
MEASUREMENT_FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(MeasurementOptions))


def _check_measurement_values(options: MeasurementOptions) -> None:
    """Refuse, as typed, the options whose values would otherwise be coerced (``int(1.5)`` key positions, a
    fractional sample size) or fail deep inside (a log floor given as text)."""
    keys = options.exclude_keys
    if not isinstance(keys, tuple):
        raise InputError(f"exclude_keys must be a list of key positions, not {keys!r}; pass e.g. {option('exclude_keys', [0])}")
    for key in keys:  # numpy's integers are integers too (numbers.Integral); bool and float are not
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
            raise InputError(f"exclude_keys must be non-negative integer key positions; {key!r} is not one (of "
                             f"{list(keys)!r}); pass e.g. {option('exclude_keys', [0])}")
    check_integer("sample_size", options.sample_size, minimum=0, message=(
        f"sample_size must be a non-negative integer (0: no sample), not {options.sample_size!r}"))
    floor = options.log_floor
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not math.isfinite(floor)
                              or floor <= 0):
        raise InputError(f"log_floor must be a positive finite number or None (the dtype's smallest normal number), "
                         f"not {floor!r}; pass e.g. {option('log_floor', 1e-6)}")


class EquivarianceProbe:
    """Measure how much a model's attention depends on absolute position.

    Args:
        model: a TransformerLens ``TransformerBridge`` or ``HookedTransformer``, an nnsight
            ``LanguageModel``, or a Hugging Face causal LM (see ``adapters.SUPPORTED_MODELS``).
        tokenizer: a tokenizer for models that do not carry one (plain Hugging Face models).
        **adapter_options: passed to the adapter (e.g. ``remote=True`` for nnsight).

    Example:
        >>> probe = EquivarianceProbe(model, tokenizer=tokenizer)  # doctest: +SKIP
        >>> result = probe.run(docs, context_length=1024, batch_size=4)  # doctest: +SKIP
        >>> result.query_position_r2(scale="log", form="fitted")  # doctest: +SKIP
    """

    def __init__(self, model: Any, *, tokenizer: Any | None = None, **adapter_options: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.adapter_options = adapter_options
        self.adapter: Adapter = get_adapter(model, tokenizer=tokenizer, **adapter_options)
        if self.adapter.device.type == "meta":
            raise InputError(
                f"this {type(model).__name__}'s weights are on the meta device (built without loading them), so it "
                "cannot be run here; load its weights (from_pretrained, or load_model(name)), or run it remotely "
                "with an nnsight model and remote=True"
            )
        #: The statistics of the last run (``run`` or ``shift``) so far, kept even if the run stopped with an error.
        self.last_result: ProbeResult | ShiftResult | None = None
        #: The outcome of the first-batch checks of the recomputation and the engine (kept for later runs
        #: of this probe, which check again only for another engine option), or ``None`` before them.
        self.checks: FirstBatchChecks | None = None

    def __repr__(self) -> str:
        layout = self.adapter.layout
        return (
            f"EquivarianceProbe({self.adapter.framework}: {self.adapter.model_name()!r}, "
            f"{layout.n_layers} layers × {layout.n_heads} heads)"
        )

    # -- inputs -------------------------------------------------------------------------
    def _context_length(self, docs: Any, context_length: int | None) -> int:
        layout = self.adapter.layout
        if context_length is None:
            if isinstance(docs, torch.Tensor) and docs.dim() >= 1:
                context_length = int(docs.shape[-1])
            else:
                context_length = min(DEFAULT_CONTEXT_LENGTH, layout.max_context or DEFAULT_CONTEXT_LENGTH)
        check_integer("context_length", context_length)
        if layout.max_context is not None and context_length > layout.max_context:
            raise ContextLengthError(
                f"context_length={context_length} is longer than this model's maximum context of "
                f"{layout.max_context} tokens; pass context_length={layout.max_context} or less"
            )
        return context_length

    def _rows(self, docs: Any, context_length: int) -> Iterator[list[int] | None]:
        """One list of token ids per window (``None`` for a document that became empty)."""
        if isinstance(docs, (str, bytes)):
            raise InputError(
                "docs is a single string; pass a list of documents (e.g. [text]) so that each is its own window"
            )
        if isinstance(docs, torch.Tensor):
            if docs.dim() == 2:
                check_not_left_padded(docs, self.adapter.tokenizer)
            yield from self._tensor_rows(docs, context_length)
            return
        if isinstance(docs, Mapping):  # a tokenizer's BatchEncoding: padding removed by its attention_mask
            for row in rows_from_encoding(docs):
                yield from self._tensor_rows(row, context_length)
            return
        try:
            iterator = iter(docs)
        except TypeError:
            raise InputError(
                f"docs must be a list of strings, a LongTensor [n_docs, n_tokens], or an iterable of either; "
                f"got {type(docs).__name__}"
            ) from None
        for doc in iterator:
            if isinstance(doc, str):
                yield self._encode(doc, context_length)
            elif isinstance(doc, torch.Tensor):
                yield from self._tensor_rows(doc, context_length)
            elif isinstance(doc, (list, tuple)) and all(is_integer(t) for t in doc):
                yield from self._tensor_rows(torch.tensor(doc, dtype=torch.long), context_length)
            else:
                raise InputError(
                    f"a document of type {type(doc).__name__} cannot be run; each document must be a string, "
                    "a 1-D or 2-D integer tensor of token ids, or a list of int token ids"
                )

    def _encode(self, text: str, context_length: int) -> list[int] | None:
        if not text.strip():
            return None
        ids = self.adapter.encode(text)[:context_length]
        vocab = self.adapter.vocab_size
        if vocab is not None and ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InputError(
                f"the tokenizer produced token id {max(ids)} but the model's vocabulary has {vocab} ids: the "
                "tokenizer does not belong to this model; pass the model's own tokenizer"
            )
        return ids

    def _tensor_rows(self, tokens: torch.Tensor, context_length: int) -> Iterator[list[int]]:
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise InputError(
                f"token ids must be an integer tensor, got dtype {tokens.dtype}; convert with tokens.long()"
            )
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise InputError(f"token ids must have shape [n_docs, n_tokens], got {tuple(tokens.shape)}")
        if tokens.shape[1] > context_length:
            raise ContextLengthError(
                f"token windows have {tokens.shape[1]} tokens but context_length={context_length}; token tensors "
                f"are used as given, so slice them (tokens[:, :{context_length}]) or raise context_length"
            )
        self._check_vocabulary(tokens)
        for row in tokens.tolist():
            yield row

    def _check_vocabulary(self, tokens: torch.Tensor, what: str = "token ids") -> None:
        """Refuse ids outside the model's vocabulary before any forward pass (the embedding would end in a bare
        IndexError, or on a GPU in a device-side assertion)."""
        vocab = self.adapter.vocab_size
        if tokens.numel() and (int(tokens.min()) < 0 or (vocab is not None and int(tokens.max()) >= vocab)):
            raise InputError(
                f"{what} must lie in 0..{(vocab or 0) - 1} (the model's vocabulary), got values from "
                f"{int(tokens.min())} to {int(tokens.max())}; were they made with another tokenizer?"
            )

    # -- running ---------------------------------------------------------------------------
    def run(
        self,
        docs: Iterable[str] | Iterable[torch.Tensor] | torch.Tensor | PackedWindows,
        options: MeasurementOptions | None = None,
        *,
        progress: bool | str = True,
        resampling_keys: Any = None,
        **measurement: Any,
    ) -> ProbeResult:
        """Run documents through the model and return their attention statistics.

        Args:
            docs: a list of strings, a LongTensor ``[n_docs, n_tokens]`` of token ids,
                :class:`~equivariance_probe.sources.packing.PackedWindows` (``load_corpus(pack=T,
                tokenizer=...)``: used as their token tensor, their description kept in
                ``metadata["windows"]``), or any iterable of strings or token tensors (streamed:
                only one batch is in memory).
            options: how to measure, a :class:`MeasurementOptions` (default: its defaults).
            progress: show a progress bar; a string shows one under that name (e.g. ``"T=1024, trained"``).
            resampling_keys: one 64-bit integer per window, in the order the windows are read (one
                per string, one per row of a token tensor; skipped windows included), choosing each
                window's interval group; windows with the same key share a group, so runs over
                different windowings of one text (a context-length scan) can pair their groups by
                text region (:func:`~equivariance_probe.result.paired_difference`). Default: each
                window's fingerprint, which gives every shard, resumed run and merge the same groups.
            **measurement: any field of :class:`MeasurementOptions` by name (``context_length=1024,
                batch_size=4, exclude_keys=[0], keep_pattern=True, ...``), over those of ``options``.
                ``engine`` picks the reduction; the result's ``metadata["engine"]`` says which ran.
                ``interval_groups`` gives the intervals over windows
                (``result.query_position_r2(..., interval=0.95)``).

        Returns:
            A :class:`ProbeResult`. If the run stops with an error (or an interrupt), the
            windows of complete batches so far are in ``probe.last_result`` and in the
            error's ``partial_result`` attribute.

        Raises:
            TypeError: a keyword that is not a measurement option.
        """
        options = MeasurementOptions.of(options, **measurement)
        batch_size, min_tokens, max_windows = options.batch_size, options.min_tokens, options.max_windows
        check_integer("batch_size", batch_size)
        _check_measurement_values(options)
        windows = windows_record(docs)
        if isinstance(docs, PackedWindows):
            docs = docs.tokens
        context_length = self._context_length(docs, options.context_length)
        exclude_keys = tuple(int(k) for k in options.exclude_keys)
        self._check_run_options(context_length, exclude_keys, min_tokens, max_windows, options.key_bins, options.device)
        statistics = self._statistics(options, context_length, exclude_keys)
        keys = _resampling_keys(resampling_keys, docs)
        metadata = self._metadata(context_length, batch_size, min_tokens)
        metadata["windows"] = windows
        result = ProbeResult(statistics, metadata)
        self.last_result = result
        unit = counted(docs)
        bar = progress_bar(bool(progress), _count(docs), progress if isinstance(progress, str) else unit, unit)
        skipped = 0
        first_tokens: dict[int, int] = {}  # windows by their first token id: what the sink numbers weigh
        try:
            batch: list[list[int]] = []
            batch_keys: list[int] = []
            read = 0
            for read, row in enumerate(self._rows(docs, context_length), 1):
                bar.update(1)
                if keys is not None and read > len(keys):
                    raise InputError(f"resampling_keys has {len(keys)} keys, but docs hold more windows; give one key per "
                                     "window (one per string, one per row of a token tensor)")
                if row is None or len(row) < min_tokens:
                    skipped += 1
                    continue
                batch.append(row)
                batch_keys.append(read - 1)
                first_tokens[int(row[0])] = first_tokens.get(int(row[0]), 0) + 1
                if max_windows is not None and statistics.n_windows + len(batch) >= max_windows:
                    break
                if len(batch) == batch_size:
                    _stop_if_requested()
                    self._run_batch(batch, statistics, None if keys is None else keys[batch_keys])
                    batch, batch_keys = [], []
            else:
                if keys is not None and read != len(keys):
                    raise InputError(f"resampling_keys has {len(keys)} keys for {read} windows; give one key per window")
            if batch:
                _stop_if_requested()
                self._run_batch(batch, statistics, None if keys is None else keys[batch_keys])
        except BaseException as error:
            # Whatever stopped the run (the package's own error, an interrupt, an OSError from a
            # document generator, a ValueError from a user's hook), the batches done so far are kept
            # and marked partial, so nothing computed is lost and nothing claims to be complete.
            statistics.abort_batch()
            metadata["engine"] = self._engine(statistics)
            metadata["skipped_windows"] = skipped
            metadata["complete"] = False
            with contextlib.suppress(AttributeError, TypeError):  # exceptions with __slots__ take no attribute
                error.partial_result = result  # type: ignore[attr-defined]
            raise
        finally:
            bar.close()
            metadata["first_token"] = first_token_record(first_tokens, self.adapter.tokenizer)
        metadata["skipped_windows"] = skipped
        if statistics.n_windows == 0:
            raise EmptyCorpusError(
                f"no window had at least {min_tokens} tokens ({skipped} documents skipped as empty or too short); "
                "pass non-empty documents, or lower min_tokens"
            )
        metadata["complete"] = True
        metadata["engine"] = self._engine(statistics)
        if statistics.device.type != "cpu":
            result.statistics = statistics.to("cpu")
        return result

    def _statistics(self, options: MeasurementOptions, context_length: int, exclude_keys: tuple[int, ...]) -> AttentionStatistics:
        """Empty statistics for windows of ``context_length`` tokens of this model, measured as ``options`` say."""
        layout = self.adapter.layout
        return AttentionStatistics(
            n_layers=layout.n_layers,
            n_heads=layout.n_heads,
            n_positions=context_length,  # the statistics' word for the window length
            sliding_windows=layout.sliding_windows,
            log_floor=options.log_floor,
            excluded_keys=exclude_keys,
            keep_pattern=options.keep_pattern,
            sample_size=options.sample_size,
            sample_seed=options.sample_seed,
            device=options.device if options.device is not None else self.adapter.device,
            key_bins=options.key_bins,
            engine=options.engine,
            causal=layout.causal,
            interval_groups=options.interval_groups,
        )

    def _check_run_options(
        self,
        context_length: int,
        exclude_keys: tuple[int, ...],
        min_tokens: int,
        max_windows: int | None,
        key_bins: int,
        device: Any,
    ) -> None:
        """Refuse options that would run without measuring anything, or measure something other than asked."""
        if any(k < 0 for k in exclude_keys):
            raise InputError(f"exclude_keys must be non-negative key positions, got {list(exclude_keys)}")
        outside = sorted(k for k in exclude_keys if k >= context_length)
        if outside:
            raise InputError(
                f"exclude_keys={list(exclude_keys)} names key positions {outside} that a window of "
                f"context_length={context_length} does not have (positions 0..{context_length - 1}); drop them "
                "or raise context_length"
            )
        if len(set(exclude_keys)) >= context_length:
            raise InputError(
                f"exclude_keys={list(exclude_keys)} leaves out every key position of a window of "
                f"context_length={context_length}, so no statistic has anything to measure; exclude fewer keys"
            )
        if context_length < 2:
            # One token attends only to itself (weight 1): no position varies, so every R² is 0/0.
            raise InputError(
                f"context_length={context_length} gives windows of one token, whose attention (1 on itself) "
                "has no position to depend on, so every R² is undefined; pass context_length=2 or more"
            )
        check_integer("min_tokens", min_tokens)
        if min_tokens > context_length:
            raise InputError(
                f"min_tokens={min_tokens} is more than context_length={context_length}, so every window would be "
                f"skipped as too short; pass min_tokens={context_length} or less, or raise context_length"
            )
        check_integer("max_windows", max_windows, allow_none=True,
                      message=f"max_windows must be a positive integer or None (no limit), not {max_windows!r}")
        check_integer("key_bins", key_bins,
                      message=f"key_bins must be a positive integer, not {key_bins!r}; the default is {KEY_BINS}")
        if device is not None:
            resolve_device(device)  # a named error for a device torch cannot use (CUDA on a machine without it)

    def _engine(self, statistics: AttentionStatistics) -> dict[str, Any]:
        """How the sums were computed: the attention source, its first-batch check, the engine's check
        against a float64 reduction of the model's own weights, and how many layer-batches each path reduced (``torch``/``triton`` from queries and keys, ``weights``, ``remote``)."""
        checks = self.checks or FirstBatchChecks()
        return {
            "source": self.adapter.resolved_source(),
            "check": dict(checks.source),
            "engine_check": dict(checks.engine),
            "paths": dict(statistics.paths),
        }

    def _run_batch(self, rows: list[list[int]], statistics: AttentionStatistics, keys: Any = None) -> None:
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        longest = int(lengths.max())  # the batch's longest window, at most context_length
        # Right padding: under a causal mask no real query sees a padding key, so the pad
        # id is irrelevant and no attention mask is needed (an encoder's adapter masks padding
        # keys itself, from the lengths begin_batch records).
        tokens = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        # Each window's fingerprint goes with its sums (kept only if the batch is added), so that
        # results that share a window refuse to merge, whichever path reduced the batch.
        statistics.begin_batch(lengths, fingerprints=window_fingerprints(rows), resampling_keys=keys)
        if statistics.n_windows == 0 and self.adapter.first_batch_checks() and (
            self.checks is None or not self.checks.covers(statistics.engine, self.adapter.resolved_source())
        ):
            self.checks = run_first_batch_checks(self.adapter, tokens, statistics)
        self.adapter.run_statistics(tokens, statistics)
        statistics.end_batch()

    # -- the shift test ----------------------------------------------------------------------------
    def shift(
        self,
        segments: Iterable[Any],
        contexts: Iterable[Any] | None = None,
        *,
        offsets: Iterable[int] | None = None,
        segment_length: int = 64,
        mode: str = "text",
        batch_size: int = 1,
        predictions: bool | None = None,
        interval_groups: int = DEFAULT_INTERVAL_GROUPS,
        progress: bool | str = True,
    ) -> ShiftResult:
        """Move the same texts through the window and measure what changes (the shift test).

        Each segment (its first ``segment_length`` tokens, no special tokens) is placed after the first ``s``
        tokens of each context, for every offset ``s``, behind the tokenizer's special prefix
        (:class:`~equivariance_probe.sources.shift_grid.ShiftGrid`). Its attention among its own tokens (centred
        logits, weights conditional on the segment's keys, raw weights), its residual stream after every block
        and its next-token predictions are decomposed into what depends on the pair of tokens, the offset, the
        context and the rest (:mod:`~equivariance_probe.maths.shift`). In ``"text"`` mode the offset is the
        segment's position *and* the amount of text before it. ``mode="position_ids"`` runs the prefix and the
        segment alone with position ids starting at ``s`` (no contexts): only the position code moves.

        Memory does not grow with segments or contexts: a segment's grid is summed context by context, and
        finished segments add into interval groups of segments (fingerprinted: a merge refuses a segment twice).

        Args:
            segments: texts (strings) or token-id lists to move.
            contexts: texts or token-id lists that precede them, each at least ``max(offsets)`` tokens, none
                equal to a segment (``None`` in ``"position_ids"`` mode).
            offsets: the offsets ``s`` (default: six from 0 to the longest window of at most 1024 tokens, and
                both sides of a sliding window: :func:`~equivariance_probe.sources.shift_grid.default_offsets`).
            segment_length: ``m`` tokens per segment.
            mode: ``"text"`` or ``"position_ids"``.
            batch_size: windows per forward pass (windows of one context at several offsets; results do not
                depend on it; the logits kept per pass span the batch's longest segment-to-end stretch).
            predictions: measure next-token predictions (default: for a causal language model with its head).
            interval_groups: groups of segments for the jackknife intervals (0: none).
            progress: show a progress bar over segments.

        Returns:
            A :class:`~equivariance_probe.ShiftResult`. Its ``metadata["check"]`` holds the built-in check: for
            a model with rotary positions, layer 0's offset η² of the centred logits, which is at rounding level
            in exact arithmetic. If the run stops, the segments finished so far are in ``probe.last_result`` and
            the error's ``partial_result``, marked partial.
        """
        from .adapters.internals import rotary_modules
        from .adapters.modules import hf_model_of, residual_width

        layout = self.adapter.layout
        tokenizer = self.adapter.tokenizer
        check_integer("batch_size", batch_size)
        check_integer("interval_groups", interval_groups, minimum=0, message=(
            f"interval_groups must be a non-negative integer (0: no intervals), not {interval_groups!r}; pass e.g. "
            f"{option('interval_groups', DEFAULT_INTERVAL_GROUPS)}"))
        if predictions is not None and not isinstance(predictions, bool):
            raise InputError(f"predictions must be True, False or None (the default for the model), not {predictions!r}")
        if offsets is None:
            prefix = special_prefix(tokenizer) if tokenizer is not None else ()
            offsets = default_offsets(layout.max_context, len(prefix), segment_length, layout.sliding_windows)
        grid = shift_grid(segments, contexts, tokenizer, offsets=offsets, segment_length=segment_length,
                          mode=mode, max_context=layout.max_context)
        self._check_vocabulary(grid.segments, "the segments' token ids")
        self._check_vocabulary(grid.contexts, "the contexts' token ids")
        if predictions is None:  # a causal language model's head; a bare decoder (Gemma3TextModel) has none
            predictions = layout.causal and self.adapter.has_language_model_head()
        predictions = bool(predictions)
        config = ShiftConfig(n_layers=layout.n_layers, n_heads=layout.n_heads, offsets=grid.offsets,
                             n_contexts=grid.n_contexts, segment_length=grid.segment_length,
                             prefix_length=len(grid.prefix), mode=mode, interval_groups=max(1, interval_groups),
                             causal=layout.causal, sliding_windows=tuple(layout.sliding_windows), predictions=predictions,
                             hidden_size=residual_width(self.adapter.model))
        statistics = ShiftStatistics(config)
        metadata = self._metadata(grid.longest_window(), batch_size, grid.segment_length)
        metadata.update(shift=grid.describe(), complete=False,
                        contexts_sha256=corpus_fingerprint(grid.contexts).get("sha256"),
                        capture=self.adapter.segment_capture)
        result = ShiftResult(statistics, metadata)
        metadata = result.metadata
        self.last_result = result
        # Every adapter that runs the shift test holds a Hugging Face model (raw weights) inside.
        has_rotary = bool(rotary_modules(hf_model_of(self.adapter.model)))
        window, _ = grid.window(0, 0, grid.offsets[-1])  # the recomputed block against the model's own weights
        check = self.adapter.check_segment_recompute(torch.tensor([window]), grid.segment_length)
        if check is not None:
            metadata["recompute_check"] = check
        entries = [segment_entries(config, layer) for layer in range(layout.n_layers)]
        n_offsets = len(grid.offsets)
        bar = progress_bar(bool(progress), int(grid.segments.shape[0]), progress if isinstance(progress, str) else "segments")
        try:
            for g in range(int(grid.segments.shape[0])):
                fingerprint = window_fingerprint(grid.segments[g])
                state = statistics.new_segment(fingerprint)
                targets = grid.segments[g, 1:] if predictions else None
                batches = [[self._shift_batch(grid, g, f, list(range(first, min(first + batch_size, n_offsets))))
                            for first in range(0, n_offsets, batch_size)] for f in range(grid.n_contexts)]
                group = int(group_of([fingerprint], config.interval_groups)[0])
                if self.adapter.sums_segment_grid:  # summed where the model runs: only the sums come back
                    statistics.add_segment_sums(fingerprint, group, self.adapter.segment_grid_sums(batches, config, targets))
                else:
                    for context in batches:
                        for batch in context:
                            self._run_shift_batch(grid.segment_length, batch, state, entries, targets)
                        state.end_context()
                    statistics.add_segment(fingerprint, group, state)
                bar.update(1)
        except BaseException as error:
            with contextlib.suppress(AttributeError, TypeError):
                error.partial_result = result  # type: ignore[attr-defined]
            raise
        finally:
            bar.close()
        metadata["complete"] = True
        metadata["check"] = shift_check(result, has_rotary=has_rotary, dtype=str(self.adapter.dtype).replace("torch.", ""))
        return result

    @staticmethod
    def _shift_batch(grid: Any, segment: int, context: int, indices: list[int]) -> SegmentBatch:
        """The right-padded windows ``(segment, context, offsets[i])`` for ``i`` in ``indices``."""
        rows, starts = zip(*(grid.window(segment, context, grid.offsets[i]) for i in indices))
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
        tokens = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
        for b, row in enumerate(rows):
            tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        position_start = torch.tensor(starts, dtype=torch.long) if grid.mode == "position_ids" else None
        return SegmentBatch(tokens, lengths, tuple(indices), position_start)

    def _run_shift_batch(self, segment_length: int, batch: SegmentBatch, state: Any, entries: list[torch.Tensor],
                         targets: torch.Tensor | None) -> None:
        """Run one batch of a segment's windows here and add their blocks to ``state``."""
        indices = batch.offset_indices

        def on_attention(layer: int, scores: torch.Tensor, log_normaliser: torch.Tensor) -> None:
            for b, index in enumerate(indices):
                for name, values in segment_representations(scores[b], log_normaliser[b], entries[layer]).items():
                    state.add(name, layer, index, values)

        def on_residual(layer: int, hidden: torch.Tensor) -> None:
            for b, index in enumerate(indices):
                state.add("residual", layer, index, hidden[b].reshape(1, -1))

        log_probs = self.adapter.run_segment(batch.tokens, batch.lengths, segment_length, on_attention=on_attention,
                                             on_residual=on_residual, position_start=batch.position_start,
                                             predictions=targets is not None)
        if targets is not None:
            for b, index in enumerate(indices):
                state.add_predictions(index, log_probs[b, :-1], targets)

    def _metadata(self, context_length: int, batch_size: int, min_tokens: int) -> dict[str, Any]:
        info = self.adapter.info()
        layout = self.adapter.layout
        return {
            "run_id": uuid.uuid4().hex,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": {
                "name": info.name,
                "framework": info.framework,
                "dtype": info.dtype,
                "device": info.device,
                **info.extra,
                "revision": model_revision(self.adapter.model),
                # Which weights these are (a strided sample of every tensor): results of one model name
                # with other weights (a fine-tune, a random_init_like copy) refuse to merge.
                "weights_sha256": model_identity(self.adapter.model).get("weights_sha256"),
            },
            "layout": {
                "n_layers": layout.n_layers,
                "n_heads": layout.n_heads,
                "windows": list(layout.sliding_windows),
                "max_context": layout.max_context,
                "causal": layout.causal,
            },
            "context_length": context_length,
            "batch_size": batch_size,
            "min_tokens": min_tokens,
            "tokenisation": "each document tokenised with the model's tokenizer including its special tokens, "
            "truncated to its first context_length tokens; token tensors used as given",
            "versions": library_versions(),
        }


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _FinishOnce:
    """A tqdm bar whose last step is drawn by ``close()`` alone: tqdm draws the step that reaches the
    total and then draws it again when closed, which a log (stderr not a terminal) shows as two lines
    at 100 %."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def update(self, n: int = 1) -> None:
        if self.bar.total is not None and self.bar.n + n >= self.bar.total:
            self.bar.n += n  # drawn once, by close()
        else:
            self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def counted(docs: Any) -> str:
    """What a progress bar over ``docs`` counts: ``"windows"`` for token rows (a tensor, packed
    windows: one row is one window, whatever documents it holds), ``"documents"`` for texts
    (each string becomes one window, truncated to the context)."""
    return "windows" if isinstance(docs, (torch.Tensor, PackedWindows)) else "documents"


def _bar_class() -> Any:
    """tqdm's widget bar inside a Jupyter kernel where ipywidgets is installed, else its plain bar.

    ``tqdm.auto`` picks the widget bar in every kernel and, without ipywidgets, warns
    ("IProgress not found") before falling back; choosing here gives the same bars without the
    warning.
    """
    shell = None
    if "IPython" in sys.modules:
        with contextlib.suppress(Exception):
            shell = sys.modules["IPython"].get_ipython()
    if shell is not None and "IPKernelApp" in getattr(shell, "config", {}):
        try:
            import ipywidgets  # noqa: F401 - only asks whether the widget bar can draw
        except ImportError:
            pass
        else:
            from tqdm.notebook import tqdm as widget_bar

            return widget_bar
    from tqdm.std import tqdm as plain_bar

    return plain_bar


def _resampling_keys(resampling_keys: Any, docs: Any) -> Any:
    """The caller's resampling keys as :func:`~equivariance_probe.statistics.groups.as_keys` reads them (``None``:
    windows are grouped by their token ids), refused where a token tensor has another number of rows."""
    keys = None if resampling_keys is None else as_keys(resampling_keys)
    if keys is not None and isinstance(docs, torch.Tensor):
        rows = 1 if docs.dim() == 1 else int(docs.shape[0])
        if len(keys) != rows:
            raise InputError(f"resampling_keys has {len(keys)} keys for a tensor of {rows} windows; give one key per row")
    return keys


def _count(docs: Any) -> int | None:
    """How many windows or documents ``docs`` holds, where that is known before reading them (the progress bar's total)."""
    if isinstance(docs, torch.Tensor):
        return 1 if docs.dim() == 1 else int(docs.shape[0])
    return len(docs) if hasattr(docs, "__len__") and not isinstance(docs, Mapping) else None


def progress_bar(enabled: bool, total: int | None, description: str = "documents", unit: str = "documents") -> Any:
    """A progress bar over ``total`` items, drawn at 100 % once, or one that shows nothing when not ``enabled``.

    Args:
        enabled: ``False`` shows nothing.
        total: the number of items (``None``: unknown, the bar counts without a percentage).
        description: what is measured (a study's variant: ``"trained: documents"``).
        unit: what one step counts, in the plural (``"documents"`` or ``"windows"``, :func:`counted`).

    In a Jupyter kernel the bar is tqdm's widget where ipywidgets is installed, otherwise one plain
    line on stderr.
    """
    if not enabled:
        return _NoProgress()
    singular = unit[:-1] if unit.endswith("s") else unit
    return _FinishOnce(_bar_class()(total=total, desc=description, unit=f" {singular}"))