"""Sufficient statistics of attention: float64 sums and counts, merged by adding.

Place in the seams: *statistics*, what streams and merges. Each layer's
``pattern: [batch, head, query, key]`` is reduced, while the forward pass runs, to sums over
documents (and over keys) that are small, independent of the number of documents, and exactly
mergeable: two :class:`AttentionStatistics` measured on disjoint documents add up to the
statistics of their union, whatever the batch sizes, processes or machines. Everything in
METHODS.md sections 1-3 is a function of these sums (:mod:`equivariance_probe.maths`).

Coordinates: ``query`` ``q`` and ``key`` ``k`` are absolute positions in a window; ``lag`` is
``dt = q - k``. Key-lag arrays are indexed ``[key t, lag dt]``, i.e. entry ``a[t+dt, t]``.
The per-layer reduction is :func:`~equivariance_probe.statistics.kernels.reduce_layer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import AttentionCaptureError, IncompatibleResultsError, InputError, NonFiniteAttentionError, option
from .kernels import (
    compiled_entry_moments,
    default_log_floor,
    key_lag_index,
    mask_statistics,
    reduce_layer,
    uniform_prior,
    visible_mask,
)
from .sample import EntrySample

__all__ = ["AttentionStatistics", "STATISTICS", "MASK_LEAK_TOLERANCE"]

#: Largest attention mass per query tolerated outside the mask an adapter reported (first batch):
#: more means the adapter does not know the model's real mask.
MASK_LEAK_TOLERANCE = 1e-3

#: Every statistic, its shape (in terms of L layers, H heads, T positions) and meaning.
STATISTICS: dict[str, tuple[str, str]] = {
    "query_count": ("L T", "visible entries per query position, summed over windows (per head)"),
    "raw_sum": ("L H T", "Σ_k a[q,k] over visible keys, summed over windows"),
    "raw_sq": ("L H T", "Σ_k a[q,k]² over visible keys"),
    "log_sum": ("L H T", "Σ_k log max(a, eps) over visible keys"),
    "log_sq": ("L H T", "Σ_k (log max(a, eps))² over visible keys"),
    "floored": ("L H", "visible entries with a < eps (floored on the log scale)"),
    "lag_sum": ("L H T", "Σ a[t+dt, t] over windows and key positions t, by lag dt"),
    "lag_count": ("L T", "entries behind lag_sum (per head)"),
    "lag_prior_sum": ("L T", "Σ u(t+dt) over the same entries: the uniform prior's curve"),
    "key_lag_sum": ("T T", "Σ over layers, heads, windows of a[t+dt, t], indexed [t, dt]"),
    "key_lag_count": ("T T", "entries behind key_lag_sum"),
    "key_lag_prior_sum": ("T T", "Σ u(t+dt) over the same entries"),
    "doc_toeplitz_sum": ("L H", "Σ over windows of the per-window Toeplitz R²"),
    "doc_toeplitz_count": ("L H", "windows behind doc_toeplitz_sum (those with nonzero variance)"),
    "windows_covering": ("T", "number of windows that have a query at position q"),
    "pattern_sum": ("L H T T", "optional: Σ over windows of a[t+dt, t], indexed [t, dt]"),
}


class AttentionStatistics:
    """Streaming sufficient statistics of a model's attention over a corpus.

    Args:
        n_layers, n_heads: the model's attention layout.
        n_positions: ``T``, the longest window the statistics hold.
        sliding_windows: per layer, ``None`` (full causal) or the sliding window width.
        log_floor: ``eps`` of the log scale; ``None`` takes the smallest normal number of
            the first pattern's dtype.
        excluded_keys: absolute key positions left out of every statistic.
        keep_pattern: keep the window-summed pattern ``[layer, head, T, T]`` (needed for
            the Toeplitz R² of the document-averaged pattern; 8·L·H·T² bytes).
        sample_size: also keep a uniform sample of this many entries
            (:class:`~equivariance_probe.statistics.sample.EntrySample`, for scatter plots); 0 for none.
        sample_seed: seed of that sample.
        device: where the float64 sums live while streaming.

    All arrays are float64 and listed in :data:`STATISTICS`. ``a + b`` and
    :meth:`merge` add them; two statistics merge only if measured the same way, and only if
    they share no window: :attr:`window_fingerprints` holds one 64-bit fingerprint of the token
    ids of every window added with one (sorted, ``uint64``), so that the same document is never
    counted twice by accident.
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
        keep_pattern: bool = True,
        sample_size: int = 0,
        sample_seed: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_layers = int(n_layers)
        self.n_heads = int(n_heads)
        self.n_positions = int(n_positions)
        self.sliding_windows = tuple(None if w is None or w >= n_positions else int(w) for w in sliding_windows)
        self.log_floor = None if log_floor is None else float(log_floor)
        self.excluded_keys = tuple(sorted({int(k) for k in excluded_keys}))
        self.keep_pattern = bool(keep_pattern)
        self.device = torch.device(device)
        self.n_windows = 0
        self.n_tokens = 0
        self.arrays: dict[str, torch.Tensor] = {}
        for name, (shape, _) in STATISTICS.items():
            if name == "pattern_sum" and not self.keep_pattern:
                continue
            self.arrays[name] = torch.zeros(self._shape(shape), dtype=torch.float64, device=self.device)
        self._index: torch.Tensor | None = None
        self._batch_masks: dict[int | None, dict[str, torch.Tensor]] = {}
        self._batch_visible: dict[int | None, torch.Tensor] = {}
        # A batch is added only when every layer of it has been reduced, so an error
        # half-way through a forward pass (NaN attention, an interrupt) leaves the sums
        # exactly as they were after the last complete batch.
        self._pending: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._lengths: torch.Tensor | None = None
        self.sample = EntrySample(sample_size, sample_seed) if sample_size else None
        self._sample_before: dict[str, Any] | None = None
        #: Sorted ``uint64`` fingerprints of the windows added so far (those given one in :meth:`begin_batch`).
        self.window_fingerprints = np.zeros(0, dtype=np.uint64)
        self._batch_fingerprints: np.ndarray | None = None

    def _shape(self, spec: str) -> tuple[int, ...]:
        sizes = {"L": self.n_layers, "H": self.n_heads, "T": self.n_positions}
        return tuple(sizes[s] for s in spec.split())

    # -- streaming ----------------------------------------------------------------
    def begin_batch(self, lengths: torch.Tensor, fingerprints: Any = None) -> None:
        """Start a batch of windows with ``lengths: [batch]`` real tokens each.

        Args:
            lengths: ``[batch]`` real tokens per window.
            fingerprints: ``[batch]`` 64-bit fingerprints of the windows' token ids
                (:func:`~equivariance_probe.records.provenance.window_fingerprints`), kept in
                :attr:`window_fingerprints` when the batch is added (:meth:`end_batch`), so that a
                merge can refuse windows counted twice; ``None`` adds none.
        """
        if fingerprints is not None:
            fingerprints = np.asarray(fingerprints, dtype=np.uint64).reshape(-1)
            if len(fingerprints) != lengths.numel():
                raise InputError(
                    f"begin_batch got {len(fingerprints)} window fingerprints for a batch of {lengths.numel()} windows; "
                    "pass one fingerprint per window (or fingerprints=None)"
                )
        self._batch_fingerprints = fingerprints
        lengths = lengths.to(self.device)
        if self._index is None:
            self._index = key_lag_index(self.n_positions, self.device)
        self.abort_batch()
        self._lengths = lengths
        if self.sample is not None:
            self._sample_before = self.sample.to_arrays()

    def _masks_for(self, window: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if window not in self._batch_masks:
            visible = visible_mask(self.n_positions, window, self._lengths, self.excluded_keys)
            prior = uniform_prior(self.n_positions, window, self.device)
            self._batch_visible[window] = visible
            self._batch_masks[window] = mask_statistics(visible, prior, self._index)
        return self._batch_visible[window], self._batch_masks[window]

    def update(self, layer: int, pattern: torch.Tensor) -> None:
        """Add one layer's ``pattern: [batch, head, query, key]`` of the current batch.

        The pattern may be shorter than ``T`` (the batch's longest window); it is
        treated as padded with invisible entries.
        """
        self._require_batch("update")
        batch, heads, n_query, n_key = pattern.shape
        if heads != self.n_heads or n_query != n_key or n_query > self.n_positions:
            raise AttentionCaptureError(
                f"layer {layer} handed over a pattern of shape {tuple(pattern.shape)}, which does not fit statistics "
                f"for {self.n_heads} heads and {self.n_positions} positions; an adapter must hand over "
                "[batch, head, query, key] with query == key <= the context length"
            )
        if self.log_floor is None:
            self.log_floor = default_log_floor(pattern.dtype if pattern.is_floating_point() else torch.float32)
        if n_query < self.n_positions:
            pad = self.n_positions - n_query
            pattern = torch.nn.functional.pad(pattern, (0, pad, 0, pad))
        pattern = pattern.to(self.device)
        visible, masks = self._masks_for(self.sliding_windows[layer])
        reduced = reduce_layer(
            pattern,
            visible,
            self._index,
            self.log_floor,
            masks["doc_lag_count"],
            keep_pattern=self.keep_pattern,
            max_lag=self.sliding_windows[layer],
            moments=compiled_entry_moments,
        )
        self._check_finite(layer, reduced)
        if self.n_windows == 0:
            self._check_mask(layer, pattern)
        self._pending[layer] = (reduced, masks)
        if self.sample is not None:
            window = self.sliding_windows[layer]
            sizes = torch.arange(1, self.n_positions + 1, device=self.device)
            self.sample.update(layer, pattern, visible, sizes if window is None else sizes.clamp(max=window))

    def _require_batch(self, method: str) -> None:
        if self._lengths is None:
            raise AttentionCaptureError(
                f"AttentionStatistics.{method} was called outside a batch; an adapter reduces attention only "
                "between statistics.begin_batch(lengths) and statistics.end_batch()"
            )

    @staticmethod
    def _check_finite(layer: int, reduced: dict[str, torch.Tensor]) -> None:
        if not bool(torch.isfinite(reduced["raw_sum"]).all() & torch.isfinite(reduced["log_sum"]).all()):
            raise NonFiniteAttentionError(
                f"layer {layer} produced NaN or infinite attention weights on visible entries; "
                "check the model's weights for NaN/inf (e.g. a failed load or an fp16 overflow) "
                "and run it in float32 or bfloat16. Statistics gathered before this batch are kept."
            )

    def _check_mask(self, layer: int, pattern: torch.Tensor) -> None:
        """On the first batch: the model must put no attention outside the mask we read.

        If it did, the adapter reported the wrong mask (e.g. a sliding window it did not
        know of) and every statistic would silently miss attention mass.
        """
        model_mask = visible_mask(self.n_positions, self.sliding_windows[layer], self._lengths)
        real_rows = model_mask.any(-1, keepdim=True).unsqueeze(1)
        outside = torch.where(real_rows & ~model_mask.unsqueeze(1), pattern.abs(), torch.zeros((), dtype=pattern.dtype, device=pattern.device))
        leaked = float(outside.sum(-1).max()) if outside.numel() else 0.0
        if leaked > MASK_LEAK_TOLERANCE:
            self._refuse_mask(layer, leaked)

    def _refuse_mask(self, layer: int, leaked: float) -> None:
        window = self.sliding_windows[layer]
        raise AttentionCaptureError(
            f"layer {layer} puts attention mass up to {leaked:.3g} per query on keys outside the mask the "
            f"adapter reported ({'full causal' if window is None else f'sliding window {window}'}); the "
            "statistics would miss it. The model's mask is not one this adapter understands: report the "
            "architecture, or pass an adapter with the right sliding windows"
        )

    def _add_layer(self, layer: int, reduced: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> None:
        a = self.arrays
        for name in ("raw_sum", "raw_sq", "log_sum", "log_sq", "lag_sum", "floored", "doc_toeplitz_sum", "doc_toeplitz_count"):
            a[name][layer] += reduced[name]
        a["key_lag_sum"] += reduced["key_lag_sum"]
        if self.keep_pattern:
            a["pattern_sum"][layer] += reduced["pattern_sum"]
        a["query_count"][layer] += masks["query_count"]
        a["lag_count"][layer] += masks["lag_count"]
        a["lag_prior_sum"][layer] += masks["lag_prior_sum"]
        a["key_lag_count"] += self.n_heads * masks["key_lag_count"]
        a["key_lag_prior_sum"] += self.n_heads * masks["key_lag_prior_sum"]

    def end_batch(self) -> None:
        """Add the batch: every layer must have been given to :meth:`update`."""
        missing = sorted(set(range(self.n_layers)) - set(self._pending))
        if missing:
            self.abort_batch()
            raise AttentionCaptureError(
                f"the batch ended without attention from layers {missing}, so it was not added; the adapter must "
                "hand over every layer's attention once per batch"
            )
        lengths = self._lengths
        for layer, (reduced, masks) in self._pending.items():
            self._add_layer(layer, reduced, masks)
        covering = torch.arange(self.n_positions, device=self.device).view(1, -1) < lengths.view(-1, 1)
        self.arrays["windows_covering"] += covering.sum(0, dtype=torch.float64)
        self.n_windows += int(lengths.numel())
        self.n_tokens += int(lengths.sum())
        self.window_fingerprints = _joined_fingerprints(self.window_fingerprints, self._batch_fingerprints)
        self._sample_before = None
        self.abort_batch()

    def abort_batch(self) -> None:
        """Forget the current batch: the sums stay as after the last complete batch."""
        if self.sample is not None and self._sample_before is not None:
            self.sample.columns = self._sample_before
        self._sample_before = None
        self._pending = {}
        self._batch_masks = {}
        self._batch_visible = {}
        self._lengths = None

    @property
    def batch_lengths(self) -> torch.Tensor | None:
        """``[batch]`` real tokens per window of the current batch (``None`` outside one).

        Adapters that reduce elsewhere (inside a remote nnsight trace) need it to build
        the same visible mask there.
        """
        return self._lengths

    def reduction_plan(self, width: int) -> dict[str, Any]:
        """What a reduction run elsewhere needs to reduce this batch exactly as :meth:`update` would.

        For adapters that cannot bring patterns home (a remote nnsight trace): they run
        :func:`~equivariance_probe.statistics.kernels.reduce_layer` where the model runs and
        hand the sums to :meth:`add_batch_sums`. Plain values only, so the plan travels with
        the trace.

        Args:
            width: ``W``, the batch's width in tokens (its longest window).

        Returns:
            ``windows`` (per layer, the sliding window, ``None`` where it covers ``W``),
            ``excluded_keys``, ``log_floor``, ``keep_pattern`` and ``check_mask`` (whether the
            reduction must measure attention outside the mask: on the first batch).
        """
        self._require_batch("reduction_plan")
        if self.log_floor is None:
            raise AttentionCaptureError(
                "the statistics need their log_floor before a reduction runs elsewhere; set it from the "
                "model's dtype (statistics.log_floor = default_log_floor(dtype)) first"
            )
        return {
            "windows": [None if w is None or w >= width else int(w) for w in self.sliding_windows],
            "excluded_keys": [int(k) for k in self.excluded_keys],
            "log_floor": float(self.log_floor),
            "keep_pattern": bool(self.keep_pattern),
            "check_mask": self.n_windows == 0,
        }

    def add_batch_sums(self, sums: dict[str, torch.Tensor], width: int) -> None:
        """Add every layer's sums of the current batch, reduced elsewhere with :meth:`reduction_plan`.

        Args:
            sums: float64 tensors for ``W = width`` and ``L`` layers: ``raw_sum, raw_sq,
                log_sum, log_sq, lag_sum: [L, head, W]``; ``floored, doc_toeplitz_sum,
                doc_toeplitz_count: [L, head]``; ``key_lag_sum: [W, W]`` (summed over layers);
                ``outside_mass: [L]`` (largest attention mass a real query put outside the
                mask; 0 when not checked); and, with ``keep_pattern``, ``pattern_sum:
                [L, head, W, W]``.
            width: ``W``.

        The mask part is computed here, so the batch merges exactly like one given to
        :meth:`update`. Key-lag arrays are indexed ``[t, dt]``: a narrower batch's entries
        keep their ``(t, dt)``, so zero-padding to ``T`` embeds them exactly.
        """
        self._require_batch("add_batch_sums")
        outside = sums["outside_mass"]
        if outside.numel() and float(outside.max()) > MASK_LEAK_TOLERANCE:
            layer = int(outside.argmax())
            self._refuse_mask(layer, float(outside[layer]))
        pad = self.n_positions - width

        def padded(value: torch.Tensor, dims: int) -> torch.Tensor:
            return value if pad == 0 else torch.nn.functional.pad(value, (0, pad) * dims)

        zero_key_lag = torch.zeros((self.n_positions, self.n_positions), dtype=torch.float64)
        for layer in range(self.n_layers):
            reduced = {name: padded(sums[name][layer], 1) for name in ("raw_sum", "raw_sq", "log_sum", "log_sq", "lag_sum")}
            for name in ("floored", "doc_toeplitz_sum", "doc_toeplitz_count"):
                reduced[name] = sums[name][layer]
            if "pattern_sum" in sums:
                reduced["pattern_sum"] = padded(sums["pattern_sum"][layer], 2)
            # The reduction summed key_lag_sum over layers (the statistics only keep that sum):
            # it goes with the last layer, zeros with the others.
            last = layer == self.n_layers - 1
            reduced["key_lag_sum"] = padded(sums["key_lag_sum"], 2) if last else zero_key_lag
            reduced = {name: value.to(device=self.device, dtype=torch.float64) for name, value in reduced.items()}
            self._check_finite(layer, reduced)
            _, masks = self._masks_for(self.sliding_windows[layer])
            self._pending[layer] = (reduced, masks)

    # -- merging --------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """What must agree for two statistics to be merged."""
        return {
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_positions": self.n_positions,
            "windows": list(self.sliding_windows),
            "log_floor": self.log_floor,
            "excluded_keys": list(self.excluded_keys),
            "keep_pattern": self.keep_pattern,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], *, device: torch.device | str = "cpu") -> AttentionStatistics:
        """Empty statistics measured as ``config`` (what :meth:`config` returns) describes.

        On ``device="meta"`` nothing is allocated: the arrays have their names and shapes only
        (what a file's schema check compares with).
        """
        return cls(
            n_layers=config["n_layers"],
            n_heads=config["n_heads"],
            n_positions=config["n_positions"],
            sliding_windows=config["windows"],
            log_floor=config["log_floor"],
            excluded_keys=config["excluded_keys"],
            keep_pattern=config["keep_pattern"],
            device=device,
        )

    @classmethod
    def array_shapes(cls, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Name and shape of every array of statistics measured as ``config`` describes (nothing allocated)."""
        return {name: tuple(value.shape) for name, value in cls.from_config(config, device="meta").arrays.items()}

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
    ) -> AttentionStatistics:
        """Statistics holding saved sums (on the CPU), without allocating arrays of their own first.

        Raises:
            IncompatibleResultsError: ``arrays`` are not the arrays of ``config`` (names or shapes).
        """
        expected = cls.array_shapes(config)
        shapes = {name: tuple(value.shape) for name, value in arrays.items()}
        if shapes != expected:
            raise IncompatibleResultsError(
                f"the arrays {shapes} are not those of statistics measured as {config} ({expected})"
            )
        statistics = cls.from_config(config, device="meta")
        statistics.device = torch.device("cpu")
        statistics.arrays = {name: arrays[name].to(torch.float64) for name in expected}
        statistics.n_windows, statistics.n_tokens = int(n_windows), int(n_tokens)
        statistics.window_fingerprints = np.sort(np.asarray(window_fingerprints, dtype=np.uint64).reshape(-1))
        statistics.sample = sample
        return statistics

    def check_compatible(self, other: AttentionStatistics) -> None:
        mine, theirs = self.config(), other.config()
        if mine["log_floor"] is None or theirs["log_floor"] is None:
            mine["log_floor"] = theirs["log_floor"] = None  # an empty side takes the other's floor
        differences = [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
        if differences:
            raise IncompatibleResultsError(
                "cannot merge statistics measured differently (" + "; ".join(differences) + "); "
                "run both with the same model, context_length, exclude_keys, log_floor and keep_pattern"
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
        merged = self.copy()
        merged.log_floor = self.log_floor if self.log_floor is not None else other.log_floor
        for name, value in other.arrays.items():
            merged.arrays[name] = merged.arrays[name] + value.to(merged.device)
        merged.n_windows += other.n_windows
        merged.n_tokens += other.n_tokens
        merged.window_fingerprints = _joined_fingerprints(self.window_fingerprints, other.window_fingerprints)
        if self.sample is not None or other.sample is not None:
            samples = [s for s in (self.sample, other.sample) if s is not None]
            merged.sample = samples[0].merge(samples[1]) if len(samples) == 2 else samples[0].merge(EntrySample(samples[0].size))
        return merged

    __add__ = merge

    def copy(self) -> AttentionStatistics:
        new = AttentionStatistics(
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_positions=self.n_positions,
            sliding_windows=self.sliding_windows,
            log_floor=self.log_floor,
            excluded_keys=self.excluded_keys,
            keep_pattern=self.keep_pattern,
            device=self.device,
        )
        new.arrays = {name: value.clone() for name, value in self.arrays.items()}
        new.n_windows, new.n_tokens = self.n_windows, self.n_tokens
        new.window_fingerprints = self.window_fingerprints.copy()
        if self.sample is not None:
            new.sample = EntrySample.from_arrays(self.sample.size, self.sample.to_arrays())
        return new

    def to(self, device: torch.device | str) -> AttentionStatistics:
        """Move the sums (e.g. to the CPU at the end of a GPU run)."""
        moved = self.copy()
        moved.device = torch.device(device)
        moved.arrays = {name: value.to(device) for name, value in self.arrays.items()}
        return moved

    # -- views used by the metrics ------------------------------------------------
    def numpy(self) -> dict[str, Any]:
        """All arrays as float64 numpy arrays."""
        return {name: value.detach().cpu().numpy() for name, value in self.arrays.items()}

    def visible_keys(self) -> torch.Tensor:
        """``|V(q)|`` per layer under the model's mask: ``[L, T]`` float64."""
        return torch.stack([1.0 / uniform_prior(self.n_positions, w) for w in self.sliding_windows])

    def nbytes(self) -> int:
        return sum(value.numel() * value.element_size() for value in self.arrays.values())

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
