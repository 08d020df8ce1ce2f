"""Sufficient statistics of attention: float64 sums and counts, merged by adding.

Place in the seams: *statistics*, what streams and merges. Each layer's attention of a batch
of windows is reduced, while the forward pass runs, to sums over documents (and over keys)
that are small, independent of the number of documents, and exactly mergeable: two
:class:`AttentionStatistics` measured on disjoint documents add up to the statistics of
their union, whatever the batch sizes, processes or machines. Everything in docs/methods.md
sections 1-3 is a function of these sums (:mod:`equivariance_probe.maths`).

Two ways in, the same sums out:

* :meth:`AttentionStatistics.update_from_scores` — from a layer's queries and keys, as the
  model hands them to its attention kernel: the weights are recomputed in query blocks
  (:mod:`~equivariance_probe.statistics.engines.torch_blocks`; one fused Triton kernel on CUDA,
  :mod:`~equivariance_probe.statistics.engines.triton`), never holding a ``[T, T]`` pattern
  per head, while the model runs its own kernel (sdpa, flash).
* :meth:`AttentionStatistics.update` — from captured post-softmax weights
  ``pattern: [batch, head, query, key]``, for what the recomputation cannot model (ALiBi,
  learned sink logits, custom attention) and for frameworks that hand over patterns.

State that grows with ``T²`` is kept only when asked (``keep_pattern``); the key-lag sums live in
``K`` key bins, and the mask's part comes in closed form. A layer's sums stay on the device its
queries are on (``device_map``) until they are read, and are moved once, not per batch.

Coordinates: absolute positions ``q``, ``k`` in a window, lags ``dt = q - k`` (``D = T`` causal,
``2T - 1`` signed bidirectional: :mod:`~equivariance_probe.statistics.masks`); key-lag arrays are
``[key bin κ, lag dt]``. How they are measured: :mod:`~equivariance_probe.statistics.config`; one
batch on its way in: :mod:`~equivariance_probe.statistics.batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import AttentionCaptureError, IncompatibleResultsError, check_choice, option
from . import elsewhere
from .batch import BatchTransaction, resampling_keys_of, window_fingerprint_array
from .config import STATISTICS, StatisticsConfig, merge_arrays
from .engines import ENGINES, reduce_scores, reduce_weights
from .groups import DEFAULT_INTERVAL_GROUPS, WindowGroups
from .mask_check import MASK_LEAK_TOLERANCE, outside_mass, refuse_mask, refuse_nonfinite
from .masks import KEY_BINS, default_log_floor
from .sample import EntrySample
from .window_sinks import WindowSinks

__all__ = ["AttentionStatistics", "STATISTICS", "MASK_LEAK_TOLERANCE", "ENGINES"]

class AttentionStatistics:
    """Streaming sufficient statistics of a model's attention over a corpus.

    The keywords ``n_layers`` … ``interval_groups`` are the fields of
    :class:`~equivariance_probe.statistics.config.StatisticsConfig`, documented there: how the statistics
    are measured, what must agree for a merge (``n_positions`` is ``T``, the longest window held).

    Args:
        sample_size: also keep a uniform sample of this many entries
            (:class:`~equivariance_probe.statistics.sample.EntrySample`, for scatter plots); 0 for none.
        sample_seed: seed of that sample.
        device: where the float64 sums live while streaming (a layer computed on another
            device keeps its sums there until they are read).
        engine: one of :data:`ENGINES`, for :meth:`update_from_scores`
            (:func:`~equivariance_probe.statistics.engines.reduce_scores` routes it).
        block_size: query rows per block of the torch engine (``None``: from a memory budget).

    The arguments that must agree for a merge are held in :attr:`settings`, a
    :class:`~equivariance_probe.statistics.config.StatisticsConfig`. All arrays are float64 and
    listed in :data:`STATISTICS`. ``a + b`` and :meth:`merge` add them; two statistics merge only if
    measured the same way, and only if they share no window: :attr:`window_fingerprints` holds one
    64-bit fingerprint of the token ids of every window added with one (sorted, ``uint64``), so that
    the same document is never counted twice by accident.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        n_heads: int,
        n_positions: int,
        sliding_windows: Sequence[int | None],
        log_floor: float | None = None,
        excluded_keys: Sequence[int] = (),
        keep_pattern: bool = False,
        key_bins: int = KEY_BINS,
        sample_size: int = 0,
        sample_seed: int | None = None,
        device: torch.device | str = "cpu",
        engine: str = "auto",
        block_size: int | None = None,
        causal: bool = True,
        interval_groups: int = DEFAULT_INTERVAL_GROUPS,
        keep_first_key: bool = True,
    ) -> None:
        settings = StatisticsConfig(
            n_layers=n_layers, n_heads=n_heads, n_positions=n_positions, sliding_windows=tuple(sliding_windows),
            log_floor=log_floor, excluded_keys=tuple(excluded_keys), keep_pattern=keep_pattern, key_bins=key_bins,
            causal=causal, interval_groups=interval_groups, keep_first_key=keep_first_key,
        )
        self._setup(settings, device=device, engine=engine, block_size=block_size)
        self.sample = EntrySample(sample_size, sample_seed) if sample_size else None

    def _setup(self, settings: StatisticsConfig, *, device: torch.device | str, engine: str,
               block_size: int | None) -> None:
        check_choice("engine", engine, ENGINES)
        #: How these statistics are measured: what must agree for a merge.
        self.settings = settings
        self.engine = engine
        self.block_size = block_size
        self.device = torch.device(device)
        self.n_windows = 0
        self.n_tokens = 0
        self._arrays = {name: torch.zeros(shape, dtype=torch.float64, device=self.device)
                        for name, shape in settings.shapes().items()}
        #: Per layer, sums kept on the device the layer ran on (models spread over devices),
        #: added to the arrays when they are read (:attr:`arrays`).
        self._elsewhere: dict[int, dict[str, torch.Tensor]] = {}
        self._batch: BatchTransaction | None = None
        self.sample: EntrySample | None = None
        #: Sorted ``uint64`` fingerprints of the windows added so far (those given one in :meth:`begin_batch`).
        self.window_fingerprints = np.zeros(0, dtype=np.uint64)
        #: Which engine computed the sums of :meth:`update_from_scores` (``"torch"``/``"triton"``), and
        #: how many layer-batches went through captured weights (:meth:`update`).
        self.paths: dict[str, int] = {}
        #: Per-group sums of the windows for intervals, or ``None`` (``interval_groups=0``).
        self.groups = None if settings.interval_groups == 0 else WindowGroups(
            settings.interval_groups, n_layers=settings.n_layers, n_heads=settings.n_heads,
            n_positions=settings.n_positions, n_lags=settings.n_lags, device=self.device,
            first_key=settings.keep_first_key)
        #: Each window's first-token weight per layer and head (Gu et al.'s per-window sink rate), or ``None``
        #: (statistics that keep no first-token weights).
        self.window_sinks = WindowSinks(settings.n_layers, settings.n_heads) if settings.keep_window_sinks else None

    # -- the configuration, field by field -----------------------------------------------
    n_layers = property(lambda self: self.settings.n_layers, doc="The model's attention layers.")
    n_heads = property(lambda self: self.settings.n_heads, doc="Query heads per layer.")
    n_positions = property(lambda self: self.settings.n_positions, doc="``T``, the longest window held.")
    sliding_windows = property(lambda self: self.settings.sliding_windows, doc="Per layer, the sliding window or ``None``.")
    excluded_keys = property(lambda self: self.settings.excluded_keys, doc="Key positions left out of every sum.")
    keep_pattern = property(lambda self: self.settings.keep_pattern, doc="Whether the summed pattern is kept.")
    key_bins = property(lambda self: self.settings.key_bins, doc="``K``, key-position bins of the key-lag sums.")
    causal = property(lambda self: self.settings.causal, doc="``False`` for a bidirectional encoder.")
    n_lags = property(lambda self: self.settings.n_lags, doc="``D``: lags, ``T`` causal, ``2T - 1`` bidirectional.")

    @property
    def log_floor(self) -> float | None:
        """``eps`` of the log scale (``None`` until the first attention's dtype sets it)."""
        return self.settings.log_floor

    @log_floor.setter
    def log_floor(self, value: float | None) -> None:
        self.settings = self.settings.with_log_floor(value)

    @property
    def arrays(self) -> dict[str, torch.Tensor]:
        """Every sum of :data:`STATISTICS` (float64), on :attr:`device`, complete to the last added batch."""
        for layer, sums in self._elsewhere.items():
            self._add(layer, sums, self._arrays)  # the sums kept on other devices, once: then dropped
        self._elsewhere = {}
        return self._arrays

    @arrays.setter
    def arrays(self, value: dict[str, torch.Tensor]) -> None:
        self._elsewhere = {}
        self._arrays = value

    @staticmethod
    def _add(layer: int, sums: dict[str, torch.Tensor], arrays: dict[str, torch.Tensor]) -> None:
        """Add one layer's sums to ``arrays``: to the layer's row of a per-layer array, to the whole of another."""
        for name, value in sums.items():
            target = arrays[name][layer] if STATISTICS[name].per_layer else arrays[name]
            target += value.to(target.device)

    # -- streaming ----------------------------------------------------------------
    def begin_batch(self, lengths: torch.Tensor, fingerprints: Any = None, *, resampling_keys: Any = None) -> None:
        """Start a batch of windows with ``lengths: [batch]`` real tokens each.

        Args:
            lengths: ``[batch]`` real tokens per window.
            fingerprints: ``[batch]`` 64-bit fingerprints of the windows' token ids
                (:func:`~equivariance_probe.records.provenance.window_fingerprints`), kept in
                :attr:`window_fingerprints` when the batch is added (:meth:`end_batch`), so that a
                merge can refuse windows counted twice; ``None`` adds none.
            resampling_keys: ``[batch]`` 64-bit keys that choose each window's interval group
                (:func:`~equivariance_probe.statistics.groups.group_of`); ``None``: the fingerprints
                (the window's order in the stream where there are none).
        """
        fingerprints = window_fingerprint_array(fingerprints, lengths.numel())
        keys, kind = resampling_keys_of(lengths.numel(), fingerprints, resampling_keys, self.n_windows)
        self.abort_batch()
        sample_before = None if self.sample is None else self.sample.to_arrays()
        self._batch = BatchTransaction(self.settings, lengths, self.device, fingerprints, sample_before)
        if self.groups is not None:
            self.groups.begin(keys, kind, self._batch.host_lengths)
        if self.window_sinks is not None:
            self.window_sinks.begin(keys, self._batch.host_lengths)

    def update_from_scores(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        scaling: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """Add one layer's attention of the current batch, recomputed from its queries and keys.

        ``a = softmax(mask(softcap(q·kᵀ·scaling)))`` under the layer's mask (causal, its sliding
        window), as every transformers attention kernel computes it; the sums are taken in query
        blocks (or by the fused kernel on CUDA), never holding a ``[T, T]`` pattern per head.

        Args:
            layer: the layer.
            query: ``[batch, head, query, head_dim]`` after rotary embeddings and q-norm; the
                batch's width may be less than ``T``.
            key: ``[batch, kv_head, key, head_dim]``, likewise (grouped-query heads read key head
                ``h // (H / H_kv)``).
            scaling: the score scale (``head_dim**-0.5`` when ``None``).
            softcap: logit soft-capping ``c`` (``s -> c·tanh(s/c)``), or ``None``.
        """
        batch_state = self._require_batch("update_from_scores")
        batch, heads, width, _ = query.shape
        if heads != self.n_heads or width > self.n_positions or key.shape[-2] != width:
            raise AttentionCaptureError(
                f"layer {layer} handed over queries {tuple(query.shape)} and keys {tuple(key.shape)}, which do not fit "
                f"statistics for {self.n_heads} heads and {self.n_positions} positions"
            )
        if self.log_floor is None:
            self.log_floor = default_log_floor(query.dtype)
        spec, masks = batch_state.spec(layer, width, query.device, self.log_floor, self.block_size,
                                       scaling=scaling, softcap=softcap)
        sums, path = reduce_scores(query, key, spec, engine=self.engine, workspace=batch_state.workspace)
        self.paths[path] = self.paths.get(path, 0) + 1
        self._add_layer(layer, sums, masks, width)
        if self.sample is not None:
            self.sample.update_from_scores(
                layer, query, key, batch_state.host_lengths, scaling=scaling, softcap=softcap, window=spec.window,
                excluded_keys=spec.excluded_keys, causal=spec.causal,
            )

    def update(self, layer: int, pattern: torch.Tensor) -> None:
        """Add one layer's captured ``pattern: [batch, head, query, key]`` of the current batch.

        The pattern may be shorter than ``T`` (the batch's longest window); it is
        treated as padded with invisible entries. On the first batch, attention outside the
        mask the adapter reported is refused (:data:`MASK_LEAK_TOLERANCE`).
        """
        batch_state = self._require_batch("update")
        batch, heads, n_query, n_key = pattern.shape
        if heads != self.n_heads or n_query != n_key or n_query > self.n_positions:
            raise AttentionCaptureError(
                f"layer {layer} handed over a pattern of shape {tuple(pattern.shape)}, which does not fit statistics "
                f"for {self.n_heads} heads and {self.n_positions} positions; an adapter must hand over "
                "[batch, head, query, key] with query == key <= the context length"
            )
        if self.log_floor is None:
            self.log_floor = default_log_floor(pattern.dtype if pattern.is_floating_point() else torch.float32)
        spec, masks = batch_state.spec(layer, n_query, pattern.device, self.log_floor, self.block_size)
        if self.n_windows == 0:
            leaked = outside_mass(pattern, batch_state.lengths.to(pattern.device), spec.window, spec.causal)
            if leaked > MASK_LEAK_TOLERANCE:
                refuse_mask(layer, leaked, spec.window, spec.causal)
        sums = reduce_weights(pattern, spec, workspace=batch_state.workspace)
        self.paths["weights"] = self.paths.get("weights", 0) + 1
        self._add_layer(layer, sums, masks, n_query)
        if self.sample is not None:
            self.sample.update(layer, pattern, batch_state.host_lengths, window=spec.window,
                               excluded_keys=spec.excluded_keys, causal=spec.causal)

    def _add_layer(self, layer: int, sums: dict[str, torch.Tensor], masks: dict[str, torch.Tensor], width: int) -> None:
        """Reduce a layer's per-window sums over the batch (and the per-window Toeplitz R²) and keep them pending."""
        per_window, r2, has_variance = self._batch.stage(layer, sums, masks, width)
        if self.groups is not None:
            self.groups.stage(layer, per_window, r2, has_variance.to(torch.float64))
        if self.window_sinks is not None:
            self.window_sinks.stage(layer, per_window["first_key_sum"].sum(-1))

    def _require_batch(self, method: str) -> BatchTransaction:
        if self._batch is None:
            raise AttentionCaptureError(
                f"AttentionStatistics.{method} was called outside a batch; an adapter reduces attention only "
                "between statistics.begin_batch(lengths) and statistics.end_batch()"
            )
        return self._batch

    def end_batch(self) -> None:
        """Add the batch: every layer must have been given to :meth:`update` or :meth:`update_from_scores`."""
        batch = self._require_batch("end_batch")
        missing = batch.missing_layers()
        if missing:
            self.abort_batch()
            raise AttentionCaptureError(
                f"the batch ended without attention from layers {missing}, so it was not added; the adapter must "
                "hand over every layer's attention once per batch"
            )
        nonfinite = batch.first_nonfinite_layer(self.device)
        if nonfinite is not None:
            self.abort_batch()
            refuse_nonfinite(nonfinite)
        for layer, reduced in batch.pending.items():
            if next(iter(reduced.values())).device == self.device:
                self._add(layer, reduced, self._arrays)
            else:  # kept on its own device until the arrays are read
                kept = self._elsewhere.setdefault(layer, {})
                for name, value in reduced.items():
                    kept[name] = kept[name] + value if name in kept else value.clone()
        if self.groups is not None:
            self.groups.commit()
        if self.window_sinks is not None:
            self.window_sinks.commit()
        for layer, sums in batch.mask_sums(self.device).items():
            self._add(layer, sums, self._arrays)
        self.n_windows += int(batch.host_lengths.numel())
        self.n_tokens += int(batch.host_lengths.sum())
        self.window_fingerprints = _joined_fingerprints(self.window_fingerprints, batch.fingerprints)
        batch.sample_before = None
        self.abort_batch()

    def abort_batch(self) -> None:
        """Forget the current batch: the sums stay as after the last complete batch."""
        batch, self._batch = self._batch, None
        if batch is not None and self.sample is not None and batch.sample_before is not None:
            self.sample.columns = batch.sample_before
        if self.groups is not None:
            self.groups.abort()
        if self.window_sinks is not None:
            self.window_sinks.abort()

    @property
    def batch_lengths(self) -> torch.Tensor | None:
        """``[batch]`` real tokens per window of the current batch (``None`` outside one).

        Adapters that reduce elsewhere (inside a remote nnsight trace) need it to build
        the same visible mask there.
        """
        return None if self._batch is None else self._batch.lengths

    def reduction_plan(self, width: int) -> dict[str, Any]:
        """What a reduction run elsewhere (a remote trace) needs to reduce this batch exactly as :meth:`update`
        would: :func:`~equivariance_probe.statistics.elsewhere.reduction_plan`."""
        return elsewhere.reduction_plan(self, self._require_batch("reduction_plan"), width)

    def add_batch_sums(self, sums: dict[str, torch.Tensor], width: int) -> None:
        """Add every layer's sums of the current batch, reduced elsewhere with :meth:`reduction_plan`:
        :func:`~equivariance_probe.statistics.elsewhere.add_batch_sums`."""
        elsewhere.add_batch_sums(self, self._require_batch("add_batch_sums"), sums, width)

    # -- merging --------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """What must agree for two statistics to be merged, as files store it (:meth:`StatisticsConfig.to_dict`)."""
        return self.settings.to_dict()

    @classmethod
    def from_settings(
        cls, settings: StatisticsConfig, *, device: torch.device | str = "cpu", engine: str = "auto",
        block_size: int | None = None,
    ) -> AttentionStatistics:
        """Empty statistics measured as ``settings`` says (no entry sample).

        On ``device="meta"`` nothing is allocated: the arrays have their names and shapes only.
        """
        statistics = cls.__new__(cls)
        statistics._setup(settings, device=device, engine=engine, block_size=block_size)
        return statistics

    @classmethod
    def from_config(cls, config: dict[str, Any], *, device: torch.device | str = "cpu") -> AttentionStatistics:
        """Empty statistics measured as ``config`` (what :meth:`config` returns) describes."""
        return cls.from_settings(StatisticsConfig.from_dict(config), device=device)

    @classmethod
    def array_shapes(cls, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Name and shape of every array of statistics measured as ``config`` describes (nothing allocated)."""
        return StatisticsConfig.from_dict(config).shapes()

    @classmethod
    def from_arrays(
        cls,
        config: dict[str, Any],
        arrays: dict[str, torch.Tensor],
        *,
        n_windows: int,
        n_tokens: int,
        window_fingerprints: Any = (),
        sample: EntrySample | None = None,
        groups: dict[str, Any] | None = None,
        groups_described: dict[str, Any] | None = None,
        window_sinks: dict[str, Any] | None = None,
    ) -> AttentionStatistics:
        """Statistics holding saved sums (on the CPU), without allocating arrays of their own first.

        ``config`` and ``arrays`` are in today's layout (files of older layouts are brought to it
        by :mod:`~equivariance_probe.records.layouts`). ``groups`` holds the interval groups' rows
        (:meth:`~.groups.WindowGroups.tensors`) and ``groups_described`` the header's
        :meth:`~.groups.WindowGroups.describe`, for a config with ``interval_groups``; ``window_sinks`` the
        per-window first-token weights (:meth:`~.window_sinks.WindowSinks.tensors`), for a config with
        ``keep_window_sinks``.

        Raises:
            IncompatibleResultsError: ``arrays`` are not the arrays of ``config`` (names or shapes).
        """
        settings = StatisticsConfig.from_dict(config)
        expected = settings.shapes()
        shapes = {name: tuple(value.shape) for name, value in arrays.items()}
        if shapes != expected:
            raise IncompatibleResultsError(
                f"the arrays {shapes} are not those of statistics measured as {config} ({expected})"
            )
        statistics = cls.from_settings(settings, device="meta")
        statistics.device = torch.device("cpu")
        statistics.arrays = {name: arrays[name].to(torch.float64) for name in expected}
        statistics.n_windows, statistics.n_tokens = int(n_windows), int(n_tokens)
        statistics.window_fingerprints = np.sort(np.asarray(window_fingerprints, dtype=np.uint64).reshape(-1))
        statistics.sample = sample
        if statistics.groups is not None:
            if groups is None:
                raise IncompatibleResultsError(f"statistics measured as {config} need their interval groups' sums")
            statistics.groups.load(groups, groups_described or {})
        if statistics.window_sinks is not None:
            if window_sinks is None:
                raise IncompatibleResultsError(f"statistics measured as {config} need their per-window first-token weights")
            statistics.window_sinks.load(window_sinks)
        return statistics

    def check_compatible(self, other: AttentionStatistics) -> None:
        differences = self.settings.differences(other.settings)
        if differences:
            raise IncompatibleResultsError(
                "cannot merge statistics measured differently (" + "; ".join(differences) + "); "
                "run both with the same model, context_length, exclude_keys, log_floor, keep_pattern and interval_groups"
            )

    def merge(self, other: AttentionStatistics, *, allow_duplicate_windows: bool = False) -> AttentionStatistics:
        """A new statistics object holding the sums of both (exact: float64 addition).

        Args:
            other: statistics measured the same way (:meth:`check_compatible`).
            allow_duplicate_windows: add windows that both hold (the same token ids, by
                :attr:`window_fingerprints`) anyway, counting them twice; for users who weight
                windows twice on purpose.

        Raises:
            IncompatibleResultsError: measured differently, or sharing windows (naming how many).
        """
        self.check_compatible(other)
        if not allow_duplicate_windows:
            shared = int(np.isin(other.window_fingerprints, self.window_fingerprints).sum())
            if shared:
                raise IncompatibleResultsError(
                    f"{shared} of the {len(other.window_fingerprints)} windows being merged in are already in the "
                    "result (the same token ids, by their 64-bit fingerprints): merging would count them twice. "
                    "Merge results of different documents; to count those windows twice on purpose, pass "
                    f"{option('allow_duplicate_windows', True)}"
                )
        merged = self._like(self.device, merge_arrays(self.arrays, other.arrays))
        merged.log_floor = self.log_floor if self.log_floor is not None else other.log_floor
        if merged.groups is not None:
            merged.groups = merged.groups.merge(other.groups)
        if merged.window_sinks is not None:
            merged.window_sinks = merged.window_sinks.merge(other.window_sinks)
        merged.n_windows += other.n_windows
        merged.n_tokens += other.n_tokens
        merged.window_fingerprints = _joined_fingerprints(self.window_fingerprints, other.window_fingerprints)
        if self.sample is not None or other.sample is not None:
            samples = [s for s in (self.sample, other.sample) if s is not None]
            merged.sample = samples[0].merge(samples[1]) if len(samples) == 2 else samples[0].merge(EntrySample(samples[0].size))
        return merged

    __add__ = merge

    def copy(self) -> AttentionStatistics:
        return self._like(self.device, {name: value.clone() for name, value in self.arrays.items()})

    def to(self, device: torch.device | str) -> AttentionStatistics:
        """Move the sums (e.g. to the CPU at the end of a GPU run)."""
        return self._like(torch.device(device), {name: value.to(device) for name, value in self.arrays.items()})

    def _like(self, device: torch.device, arrays: dict[str, torch.Tensor]) -> AttentionStatistics:
        """A copy of everything but the arrays, which are ``arrays``, on ``device`` (no batch in progress)."""
        new = AttentionStatistics.from_settings(self.settings, device="meta", engine=self.engine,
                                                block_size=self.block_size)
        new.device = device
        new.arrays = arrays
        new.groups = None if self.groups is None else self.groups.copy(device)
        new.window_sinks = None if self.window_sinks is None else self.window_sinks.copy()
        new.paths = dict(self.paths)
        new.n_windows, new.n_tokens = self.n_windows, self.n_tokens
        new.window_fingerprints = self.window_fingerprints.copy()
        if self.sample is not None:
            new.sample = EntrySample.from_arrays(self.sample.size, self.sample.to_arrays())
        return new

    # -- views used by the metrics ------------------------------------------------
    def numpy(self) -> dict[str, Any]:
        """All arrays as float64 numpy arrays."""
        return {name: value.detach().cpu().numpy() for name, value in self.arrays.items()}

    def visible_keys(self) -> torch.Tensor:
        """``|V(q)|`` per layer under the model's mask: ``[L, T]`` float64 (:meth:`StatisticsConfig.visible_keys`)."""
        return self.settings.visible_keys()

    def nbytes(self) -> int:
        groups = 0 if self.groups is None else self.groups.nbytes()
        groups += 0 if self.window_sinks is None else self.window_sinks.nbytes()
        return groups + sum(value.numel() * value.element_size() for value in self.arrays.values())

    def __repr__(self) -> str:
        return (
            f"AttentionStatistics(layers={self.n_layers}, heads={self.n_heads}, positions={self.n_positions}, "
            f"n_windows={self.n_windows}, n_tokens={self.n_tokens}, {self.nbytes() / 2**20:.1f} MiB)"
        )


def _joined_fingerprints(kept: np.ndarray, new: np.ndarray | None) -> np.ndarray:
    """``kept`` and ``new`` window fingerprints as one sorted ``uint64`` array (repeats kept: a
    corpus may hold the same document twice, and then a run counts it twice)."""
    if new is None or len(new) == 0:
        return kept
    return np.sort(np.concatenate([kept, np.asarray(new, dtype=np.uint64)]))
