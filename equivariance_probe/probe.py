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

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .adapters import Adapter, get_adapter
from .adapters.checks import FirstBatchChecks, run_first_batch_checks
from .adapters.request_sizes import windows_per_pass
from .features.mechanisms import MechanismSums, SegmentMechanism
from .features.segments import capture_segment_grid, read_mechanisms
from .errors import (
    ContextLengthError,
    EmptyCorpusError,
    InputError,
    UnsupportedModelError,
    check_integer,
    is_integer,
    option,
)
from .progress import STOP_REQUESTED, _bar_class, _stop_if_requested, keeping_partial, progress_bar  # noqa: F401 - _bar_class: imported from here by tests
from .records.provenance import corpus_fingerprint, run_metadata, window_fingerprint, window_fingerprints
from .result import ProbeResult
from .shift_result import ShiftResult, record_checks
from .sources.devices import resolve_device
from .sources.packing import PackedWindows, first_token_record, special_prefix, windows_record
from .sources.shift_grid import ShiftOptions, shift_grid
from .sources.padding import check_not_left_padded, rows_from_encoding
from .statistics import AttentionStatistics
from .statistics.groups import as_keys, group_of
from .statistics.shift import ShiftConfig, ShiftStatistics, segment_entries
from .statistics.masks import KEY_BINS
# MEASUREMENT_FIELDS: read from here by the command line.
from .statistics.options import MEASUREMENT_FIELDS, MeasurementOptions, check_measurement_values  # noqa: F401

__all__ = ["EquivarianceProbe", "MeasurementOptions", "ShiftOptions", "DEFAULT_CONTEXT_LENGTH", "progress_bar", "counted",
           "STOP_REQUESTED", "keeping_partial"]

#: Context length for strings when none is given (the study's), capped at the model's maximum.
DEFAULT_CONTEXT_LENGTH = 1024


def _record_requests(metadata: dict[str, Any], adapter: Adapter) -> None:
    """Record in ``metadata["requests"]`` what a remote adapter planned for its requests (nothing for local ones)."""
    if adapter.requests is not None and adapter.requests.plan is not None:
        metadata["requests"] = adapter.requests.plan.to_dict()


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
            f"EquivarianceProbe({self.adapter.framework}: {self.adapter.model_name!r}, "
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
                f"{option('context_length', context_length)} is longer than this model's maximum context of "
                f"{layout.max_context} tokens; pass {option('context_length', layout.max_context)} or less"
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
                f"token windows have {tokens.shape[1]} tokens but {option('context_length', context_length)}; token tensors "
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
        check_measurement_values(options)
        windows = windows_record(docs)
        if isinstance(docs, PackedWindows):
            docs = docs.tokens
        context_length = self._context_length(docs, options.context_length)
        exclude_keys = tuple(int(k) for k in options.exclude_keys)
        self._check_run_options(context_length, exclude_keys, min_tokens, max_windows, options.key_bins, options.device)
        statistics = self._statistics(options, context_length, exclude_keys)
        keys = _resampling_keys(resampling_keys, docs)
        metadata = run_metadata(self.adapter, context_length, batch_size, min_tokens)
        metadata["windows"] = windows
        result = ProbeResult(statistics, metadata)
        self.last_result = result
        unit = counted(docs)
        bar = progress_bar(bool(progress), _count(docs), progress if isinstance(progress, str) else unit, unit)
        counts = {"skipped": 0}
        first_tokens: dict[int, int] = {}  # windows by their first token id: what the sink numbers weigh

        def stopped() -> None:
            statistics.abort_batch()
            metadata["engine"] = self._engine(statistics)
            metadata["skipped_windows"] = counts["skipped"]
            _record_requests(metadata, self.adapter)

        def first_token() -> None:
            metadata["first_token"] = first_token_record(first_tokens, self.adapter.tokenizer)

        with keeping_partial(result, bar, on_stop=stopped, always=first_token):
            for batch, batch_keys in self._batches(docs, context_length, options, keys, statistics, bar, counts,
                                                   first_tokens):
                _stop_if_requested()
                self._run_batch(batch, statistics, None if keys is None else keys[batch_keys])
        return self._finished_run(result, counts["skipped"], min_tokens)

    def _finished_run(self, result: ProbeResult, skipped: int, min_tokens: int) -> ProbeResult:
        """``result`` of a run that read every window, marked complete, its sums on the CPU.

        Raises:
            EmptyCorpusError: every window was skipped.
        """
        statistics, metadata = result.statistics, result.metadata
        metadata["skipped_windows"] = skipped
        if statistics.n_windows == 0:
            raise EmptyCorpusError(
                f"no window had at least {min_tokens} tokens ({skipped} documents skipped as empty or too short); "
                "pass non-empty documents, or lower min_tokens"
            )
        metadata["complete"] = True
        metadata["engine"] = self._engine(statistics)
        _record_requests(metadata, self.adapter)
        if statistics.device.type != "cpu":
            result.statistics = statistics.to("cpu")
        return result

    def _batches(self, docs: Any, context_length: int, options: MeasurementOptions, keys: Any,
                 statistics: AttentionStatistics, bar: Any, counts: dict[str, int],
                 first_tokens: dict[int, int]) -> Iterator[tuple[list[list[int]], list[int]]]:
        """The run's batches of windows (token rows) with their read indices, ``batch_size`` at a time, skipping
        (and counting) windows shorter than ``min_tokens`` and stopping after ``max_windows``."""
        batch: list[list[int]] = []
        batch_keys: list[int] = []
        read = 0
        for read, row in enumerate(self._rows(docs, context_length), 1):
            bar.update(1)
            if keys is not None and read > len(keys):
                raise InputError(f"resampling_keys has {len(keys)} keys, but docs hold more windows; give one key per "
                                 "window (one per string, one per row of a token tensor)")
            if row is None or len(row) < options.min_tokens:
                counts["skipped"] += 1
                continue
            batch.append(row)
            batch_keys.append(read - 1)
            first_tokens[int(row[0])] = first_tokens.get(int(row[0]), 0) + 1
            if options.max_windows is not None and statistics.n_windows + len(batch) >= options.max_windows:
                break
            if len(batch) >= windows_per_pass(self.adapter, options.batch_size, context_length):
                yield batch, batch_keys
                batch, batch_keys = [], []
        else:
            if keys is not None and read != len(keys):
                raise InputError(f"resampling_keys has {len(keys)} keys for {read} windows; give one key per window")
        if batch:
            yield batch, batch_keys

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
                f"{option('exclude_keys', list(exclude_keys))} names key positions {outside} that a window of "
                f"{option('context_length', context_length)} does not have (positions 0..{context_length - 1}); drop "
                f"them or raise {option('context_length')}"
            )
        if len(set(exclude_keys)) >= context_length:
            raise InputError(
                f"{option('exclude_keys', list(exclude_keys))} leaves out every key position of a window of "
                f"{option('context_length', context_length)}, so no statistic has anything to measure; exclude fewer keys"
            )
        if context_length < 2:
            # One token attends only to itself (weight 1): no position varies, so every R² is 0/0.
            raise InputError(
                f"{option('context_length', context_length)} gives windows of one token, whose attention (1 on itself) "
                f"has no position to depend on, so every R² is undefined; pass {option('context_length', 2)} or more"
            )
        check_integer("min_tokens", min_tokens)
        if min_tokens > context_length:
            raise InputError(
                f"{option('min_tokens', min_tokens)} is more than {option('context_length', context_length)}, so every "
                f"window would be skipped as too short; pass {option('min_tokens', context_length)} or less, or raise "
                f"{option('context_length')}"
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
            "source": self.adapter.source.resolved(),
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
        if statistics.n_windows == 0 and self.adapter.source.checks() and (
            self.checks is None or not self.checks.covers(statistics.engine, self.adapter.source.resolved())
        ):
            self.checks = run_first_batch_checks(self.adapter, tokens, statistics)
        self.adapter.run_statistics(tokens, statistics)
        statistics.end_batch()

    # -- the shift test ----------------------------------------------------------------------------
    def shift(
        self,
        segments: Iterable[Any],
        contexts: Iterable[Any] | None = None,
        options: ShiftOptions | None = None,
        *,
        progress: bool | str = True,
        resume_from: ShiftResult | None = None,
        on_segment: Callable[[ShiftResult], None] | None = None,
        mechanisms: Sequence[SegmentMechanism] = (),
        **shift_options: Any,
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
            options: how to measure, a :class:`~equivariance_probe.sources.shift_grid.ShiftOptions` (default: its
                defaults; the offsets default to six from 0 to the longest window of at most 1024 tokens and both
                sides of a sliding window, :func:`~equivariance_probe.sources.shift_grid.default_offsets`).
            progress: show a progress bar over segments (a string: under that name).
            resume_from: the partial result of an earlier run of these segments with these options (a checkpoint,
                :mod:`~equivariance_probe.runs.shift`): its segments are kept and the run goes on from the next,
                adding exactly what an uninterrupted run adds.
            on_segment: called with the result after each segment is added (a checkpoint writes it).
            mechanisms: :class:`~equivariance_probe.features.mechanisms.SegmentMechanism` s of one's own, each a
                site and a measure of the segment's rows there, read in the run's own passes (on a model whose grid
                is summed where it runs, in one more request per batch) and summed by offset into
                ``metadata["mechanisms"]`` (:func:`~equivariance_probe.features.mechanisms.mechanism_by_offset`);
                not with ``resume_from`` (the sums are not checkpointed).
            **shift_options: any field of ``ShiftOptions`` by name (``offsets=[0, 256, 512], segment_length=64``).

        Returns:
            A :class:`~equivariance_probe.ShiftResult`. Its ``metadata["check"]`` holds the built-in check: for
            a model with rotary positions, layer 0's offset η² of the centred logits, which is at rounding level
            in exact arithmetic. If the run stops, the segments finished so far are in ``probe.last_result`` and
            the error's ``partial_result``, marked partial.

        Raises:
            TypeError: a keyword that is not a shift option.
        """
        from .adapters.internals import rotary_modules
        from .adapters.modules import hf_model_of

        options = ShiftOptions.of(options, **shift_options)
        tokenizer = self.adapter.tokenizer
        options = options.resolved(self.adapter.layout, len(special_prefix(tokenizer)) if tokenizer is not None else 0)
        grid = shift_grid(segments, contexts, tokenizer, offsets=options.offsets, segment_length=options.segment_length,
                          mode=options.mode, max_context=self.adapter.layout.max_context)
        self._check_vocabulary(grid.segments, "the segments' token ids")
        self._check_vocabulary(grid.contexts, "the contexts' token ids")
        if mechanisms and resume_from is not None:
            raise InputError("mechanisms are summed in memory, not checkpointed, so a resumed run would miss the "
                             "first run's segments; run them without resume_from")
        sums = MechanismSums(mechanisms, grid.offsets) if mechanisms else None
        result = self._shift_result(grid, options, resume_from)
        self.last_result = result
        window, _ = grid.window(0, 0, grid.offsets[-1])  # the recomputed block against the model's own weights
        check = self.adapter.check_segment_recompute(torch.tensor([window]), grid.segment_length)
        if check is not None:
            result.metadata["recompute_check"] = check
        n_segments, done = int(grid.segments.shape[0]), result.n_segments
        bar = progress_bar(bool(progress), n_segments, progress if isinstance(progress, str) else "segments", "segments")
        bar.update(done)
        heads = []
        with keeping_partial(result, bar):
            for g in range(done, n_segments):
                _stop_if_requested()
                heads.append(self._shift_segment(grid, g, options.batch_size, result.statistics, sums))
                if sums is not None:
                    result.metadata["mechanisms"] = sums.to_dict()
                bar.update(1)
                if on_segment is not None:
                    on_segment(result)
        result.metadata["complete"] = True
        # Every adapter that runs the shift test holds a Hugging Face model (raw weights) inside.
        rotary = self.adapter.layout.rotary
        if rotary is None:  # an adapter that does not say: the Hugging Face model inside
            rotary = bool(rotary_modules(hf_model_of(self.adapter.model)))
        record_checks(result, has_rotary=rotary,
                      dtype=str(self.adapter.dtype).replace("torch.", ""), head_differences=heads)
        return result

    def _shift_result(self, grid: Any, options: ShiftOptions, resume_from: ShiftResult | None) -> ShiftResult:
        """The empty result of a shift run on ``grid`` (or ``resume_from``'s sums, checked to be this run's)."""
        from .adapters.modules import residual_width

        layout = self.adapter.layout
        predictions = options.predictions
        if predictions is None:  # a causal language model's head; a bare decoder (Gemma3TextModel) has none
            predictions = layout.causal and self.adapter.has_language_model_head
        config = ShiftConfig(n_layers=layout.n_layers, n_heads=layout.n_heads, offsets=grid.offsets,
                             n_contexts=grid.n_contexts, segment_length=grid.segment_length,
                             prefix_length=len(grid.prefix), mode=grid.mode, interval_groups=options.interval_groups,
                             causal=layout.causal, sliding_windows=tuple(layout.sliding_windows),
                             predictions=bool(predictions), hidden_size=layout.hidden_size or residual_width(self.adapter.model),
                             components=self._attribution_components(options),
                             patch_components=tuple(options.patch), patch_reference=options.patch_reference)
        statistics = ShiftStatistics(config)
        if resume_from is not None:
            done = resume_from.statistics
            expected = [window_fingerprint(grid.segments[g]) for g in range(min(done.n_segments, len(grid.segments)))]
            if done.config != config or [int(f) for f in done.segment_fingerprints] != expected:
                raise InputError("resume_from holds another run's segments or design ("
                                 f"{'; '.join(done.config.differences(config)) or 'other segments'}); resume only the "
                                 "run it is the partial result of, with the same segments, contexts and options")
            statistics.arrays = {name: value.copy() for name, value in done.arrays.items()}
            statistics.segment_fingerprints = done.segment_fingerprints.copy()
        metadata = run_metadata(self.adapter, grid.longest_window(), options.batch_size, grid.segment_length)
        metadata.update(shift=grid.describe(), complete=False,
                        contexts_sha256=corpus_fingerprint(grid.contexts).get("sha256"),
                        capture=self.adapter.segment_capture)
        return ShiftResult(statistics, metadata)

    def _attribution_components(self, options: ShiftOptions) -> tuple[str, ...]:
        """The attribution's components for ``options`` (none without attribution): the embedding, every block's
        attention and MLP, and the heads of ``options.attribution_heads``.

        Raises:
            UnsupportedModelError: attribution heads on a model whose segment grid is summed where it runs (nnsight
                remote), which reads block-level components only.
        """
        from .adapters.components import block_component_names, head_component_names
        from .adapters.plan import Read

        if options.attribution and self.adapter.sums_segment_grid and options.attribution_heads:
            raise UnsupportedModelError(
                f"attribution_heads={list(options.attribution_heads)}: a head's part is formed from its output and the "
                "output projection's weights, which a remote nnsight session (the segment's grid summed on the server) "
                "does not read; ask the remote model for the block-level attribution (attribution=True alone), or "
                "run the heads on a local model (remote=False)")
        layout = self.adapter.layout
        if options.attribution or options.patch:  # refuses, before any window runs, a block it cannot split
            sites = [*block_component_names(layout.n_layers),
                     *(f"pieces.{layer}" for layer in (options.attribution_heads if options.attribution else ()))]
            self.adapter.check_plan(self.adapter.plan([(site, Read(lambda value: None)) for site in sites]))
        if not options.attribution:
            return ()
        return block_component_names(layout.n_layers) + head_component_names(options.attribution_heads, layout.n_heads)

    def _shift_segment(self, grid: Any, g: int, batch_size: int, statistics: ShiftStatistics,
                       mechanisms: MechanismSums | None = None) -> float | None:
        """Run segment ``g``'s whole grid and add it to ``statistics`` (in its interval group); returns the largest
        relative difference between the attribution heads' pieces and their attention's output (0 without heads;
        ``None`` where the grid was summed where the model runs)."""
        config = statistics.config
        fingerprint = window_fingerprint(grid.segments[g])
        state = statistics.new_segment(fingerprint)
        targets = grid.segments[g, 1:] if config.predictions else None
        batches = grid.batches(g, batch_size)
        group = int(group_of([fingerprint], config.rows)[0])
        if self.adapter.sums_segment_grid:  # summed where the model runs: only the sums come back
            statistics.add_segment_sums(fingerprint, group, self.adapter.segment_grid_sums(batches, config, targets))
            if mechanisms is not None:
                read_mechanisms(self.adapter, batches, config.segment_length, mechanisms)
            return None
        entries = [segment_entries(config, layer) for layer in range(config.n_layers)]
        capture_segment_grid(self.adapter, batches, state, entries, targets, mechanisms)
        statistics.add_segment(fingerprint, group, state)
        return state.heads_difference


def counted(docs: Any) -> str:
    """What a progress bar over ``docs`` counts: ``"windows"`` for token rows (a tensor, packed
    windows: one row is one window, whatever documents it holds), ``"documents"`` for texts
    (each string becomes one window, truncated to the context)."""
    return "windows" if isinstance(docs, (torch.Tensor, PackedWindows)) else "documents"


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
