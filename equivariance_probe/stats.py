"""Sufficient statistics of attention: float64 sums and counts, merged by adding.

This is the streaming seam. Each layer's ``pattern: [batch, head, query, key]`` is
reduced, while the forward pass runs, to sums over documents (and over keys) that are
small, independent of the number of documents, and exactly mergeable: two
:class:`AttentionStatistics` measured on disjoint documents add up to the statistics of
their union, whatever the batch sizes, processes or machines. Everything in METHODS.md
sections 1-3 is a function of these sums (see :mod:`equivariance_probe.metrics`).

Coordinates: ``query`` ``q`` and ``key`` ``k`` are absolute positions in a window;
``lag`` is ``dt = q - k``. Key-lag arrays are indexed ``[key t, lag dt]``, i.e. entry
``a[t+dt, t]``.

The reduction functions here use torch alone, so the same code can run inside a
remote nnsight trace.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from .errors import AttentionCaptureError, IncompatibleResultsError, NonFiniteAttentionError
from .sample import EntrySample

__all__ = [
    "AttentionStatistics",
    "reduce_layer",
    "visible_mask",
    "key_lag_index",
    "default_log_floor",
]

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


def default_log_floor(dtype: torch.dtype) -> float:
    """The default ``eps`` of the log scale: the smallest normal number of ``dtype``."""
    return float(torch.finfo(dtype).tiny)


def key_lag_index(n_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat ``[query, key]`` indices that lay a ``[T, T]`` matrix out as ``[key t, lag dt]``.

    ``index[t * T + dt] = (t + dt) * T + t`` where ``t + dt < T``. Slots with
    ``t + dt >= T`` point at ``(0, T-1)``, an entry above the diagonal, which every
    causal mask hides and :func:`reduce_layer` zeroes.

    Returns:
        ``LongTensor [T * T]``.
    """
    t = torch.arange(n_positions, device=device).view(-1, 1)
    dt = torch.arange(n_positions, device=device).view(1, -1)
    query = t + dt
    index = query * n_positions + t
    hidden = torch.full_like(index, max(n_positions - 1, 0))
    return torch.where(query < n_positions, index, hidden).reshape(-1)


def visible_mask(
    n_positions: int,
    window: int | None,
    lengths: torch.Tensor,
    excluded_keys: Sequence[int] = (),
) -> torch.Tensor:
    """``V``: which entries the statistics read, ``[batch, query, key]`` bool.

    ``k <= q`` (causal), ``q - k < window`` for a sliding window, ``q < length`` of the
    window (right padding), and ``k`` not among ``excluded_keys``.
    """
    device = lengths.device
    query = torch.arange(n_positions, device=device).view(-1, 1)
    key = torch.arange(n_positions, device=device).view(1, -1)
    allowed = key <= query
    if window is not None:
        allowed = allowed & (query - key < window)
    for excluded in excluded_keys:
        if 0 <= excluded < n_positions:
            allowed[:, excluded] = False
    real_query = query.view(1, -1) < lengths.view(-1, 1)
    return allowed.unsqueeze(0) & real_query.unsqueeze(-1)


def uniform_prior(n_positions: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``u(q) = 1/|V(q)|`` under the model's mask (no padding, no exclusions): ``[T]`` float64."""
    visible = torch.arange(1, n_positions + 1, device=device, dtype=torch.float64)
    if window is not None:
        visible = visible.clamp(max=window)
    return 1.0 / visible


def mask_statistics(visible: torch.Tensor, prior: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parts of the statistics that depend on the mask alone (shared by all heads).

    Args:
        visible: ``[batch, query, key]`` bool from :func:`visible_mask`.
        prior: ``u(q)``, ``[T]`` float64.
        index: :func:`key_lag_index` for ``T``.
    """
    batch, n_positions, _ = visible.shape
    visible_kl = visible.reshape(batch, -1)[:, index].view(batch, n_positions, n_positions)
    prior_kl = prior[index // n_positions].view(n_positions, n_positions)
    count_kl = visible_kl.sum(0, dtype=torch.float64)  # [t, dt]
    return {
        "query_count": visible.sum((0, 2), dtype=torch.float64),
        "lag_count": count_kl.sum(0),
        "lag_prior_sum": (count_kl * prior_kl).sum(0),
        "key_lag_count": count_kl,
        "key_lag_prior_sum": count_kl * prior_kl,
        "visible_kl": visible_kl,
        "doc_lag_count": visible_kl.sum(1, dtype=torch.float64),  # [batch, dt]
    }


def entry_moments(
    pattern: torch.Tensor, mask: torch.Tensor, row_count: torch.Tensor, log_floor: float
) -> tuple[torch.Tensor, ...]:
    """The per-entry work of :func:`reduce_layer`: one pass of elementwise maths and row sums.

    Args:
        pattern: ``[batch, head, query, key]`` float32 or float64.
        mask: ``[batch, 1, query, key]`` bool, visible entries.
        row_count: ``[batch, 1, query]`` float64, visible keys per row.
        log_floor: ``eps`` of the log scale.

    Returns:
        ``visible_weights`` (pattern, 0 where hidden), per row ``Σa, Σa², Σlog, Σlog²``
        (``[batch, head, query]`` float64), floored entries per head ``[head]`` and the
        batch-summed pattern ``[head, query, key]`` float64.

    This function is elementwise maths and reductions only, so ``torch.compile`` fuses it
    into a few loops (about 10x fewer passes over memory than eager on CPU).
    """
    zero = torch.zeros((), dtype=pattern.dtype, device=pattern.device)
    visible_weights = torch.where(mask, pattern, zero)
    logs = torch.where(mask, torch.log(pattern.clamp_min(log_floor)), zero)
    row_sum, row_sq = _row_moments(visible_weights, mask, row_count)
    log_sum, log_sq = _row_moments(logs, mask, row_count)
    floored = ((pattern < log_floor) & mask).sum((0, 2, 3), dtype=torch.float64)
    batch_sum = visible_weights.sum(0, dtype=torch.float64)
    return visible_weights, row_sum, row_sq, log_sum, log_sq, floored, batch_sum


#: Patterns with at least this many entries go through the compiled ``entry_moments``.
COMPILE_MIN_ENTRIES = 2**22
_compiled_moments: Any = None
_compile_failed = False


def _moments_function(numel: int):
    """``entry_moments``, compiled when worthwhile and possible, else eager.

    Compilation costs ~20 s once per process (cached on disk by torch) and needs a C++
    compiler; it is skipped for small patterns, when ``EQUIVARIANCE_PROBE_COMPILE=0``,
    and after any failure (with a warning), so results never depend on it.
    """
    global _compiled_moments, _compile_failed
    if numel < COMPILE_MIN_ENTRIES or _compile_failed or os.environ.get("EQUIVARIANCE_PROBE_COMPILE", "1") == "0":
        return entry_moments
    if _compiled_moments is None:
        _compiled_moments = torch.compile(entry_moments, dynamic=True)
    return _compiled_moments


def _entry_moments(pattern, mask, row_count, log_floor):
    global _compile_failed
    function = _moments_function(pattern.numel())
    if function is entry_moments:
        return entry_moments(pattern, mask, row_count, log_floor)
    try:
        return function(pattern, mask, row_count, log_floor)
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the same maths
        import warnings

        _compile_failed = True
        warnings.warn(f"torch.compile of the attention reduction failed ({error!r:.200}); using eager torch", stacklevel=2)
        return entry_moments(pattern, mask, row_count, log_floor)


def diagonal_sums(visible_weights: torch.Tensor, max_lag: int) -> torch.Tensor:
    """``D[b, h, dt] = Σ_t a[b, h, t+dt, t]`` for ``dt < max_lag`` (0 beyond): ``[batch, head, T]`` float64.

    One strided view per lag: cheaper than gathering the whole pattern into key-lag layout.
    """
    batch, heads, n_positions, _ = visible_weights.shape
    out = torch.zeros((batch, heads, n_positions), dtype=torch.float64, device=visible_weights.device)
    for lag in range(min(max_lag, n_positions)):
        out[..., lag] = torch.diagonal(visible_weights, offset=-lag, dim1=-2, dim2=-1).sum(-1, dtype=torch.float64)
    return out


def reduce_layer(
    pattern: torch.Tensor,
    visible: torch.Tensor,
    index: torch.Tensor,
    log_floor: float,
    doc_lag_count: torch.Tensor,
    keep_pattern: bool = False,
    max_lag: int | None = None,
    moments: Any = None,
) -> dict[str, torch.Tensor]:
    """Reduce one layer's attention of one batch to per-head sums.

    Args:
        pattern: ``[batch, head, query, key]`` post-softmax weights, any float dtype
            (bf16/fp16 are upcast to float32 first).
        visible: ``[batch, query, key]`` bool, the entries to read (:func:`visible_mask`).
        index: :func:`key_lag_index` for ``T``.
        log_floor: ``eps``; the log scale reads ``log max(a, eps)``.
        doc_lag_count: ``[batch, dt]`` visible entries per lag in each window.
        keep_pattern: also return the key-lag pattern summed over the batch.
        max_lag: no visible entry has ``q - k >= max_lag`` (the sliding window); ``None``: ``T``.
        moments: the function doing the per-entry work, :func:`entry_moments` by default;
            local runs pass a compiled version of it. (Code that runs inside a remote
            nnsight trace keeps the default: it must use plain torch.)

    Returns:
        float64 tensors: ``raw_sum, raw_sq, log_sum, log_sq, lag_sum: [head, T]``,
        ``floored, doc_toeplitz_sum, doc_toeplitz_count: [head]``, ``key_lag_sum: [T, T]``
        and, if asked, ``pattern_sum: [head, T, T]`` (key-lag layout).

    Per window, the Toeplitz R² (TISA appendix B) of a head's pattern is
    ``1 - RSS/TSS`` with ``RSS = Σ a² - Σ_dt n_dt m_dt²`` (``m_dt`` the mean of the
    diagonal ``dt``) and ``TSS = Σ a² - N ā²``, over visible entries.
    """
    batch, heads, n_positions, _ = pattern.shape
    work_dtype = torch.float64 if pattern.dtype == torch.float64 else torch.float32
    weights = pattern.to(work_dtype)
    mask = visible.unsqueeze(1)
    row_count = visible.sum(-1, dtype=torch.float64).unsqueeze(1)  # [batch, 1, query]
    visible_weights, row_sum, row_sq, log_sum, log_sq, floored, batch_sum = (moments or entry_moments)(
        weights, mask, row_count, log_floor
    )
    out = {
        "raw_sum": row_sum.sum(0),
        "raw_sq": row_sq.sum(0),
        "log_sum": log_sum.sum(0),
        "log_sq": log_sq.sum(0),
        "floored": floored,
    }
    # Lag sums from the batch-summed pattern: one gather of [head, T, T], not [batch, head, T, T].
    key_lag = batch_sum.reshape(heads, -1)[:, index].view(heads, n_positions, n_positions)  # [head, t, dt]
    out["lag_sum"] = key_lag.sum(1)
    out["key_lag_sum"] = key_lag.sum(0)
    if keep_pattern:
        out["pattern_sum"] = key_lag
    diagonal_sum = diagonal_sums(visible_weights, max_lag or n_positions)  # [batch, head, dt]

    # Per-window Toeplitz R².
    n_entries = doc_lag_count.sum(-1).unsqueeze(1)  # [batch, 1]
    total = row_sum.sum(-1)  # [batch, head]
    square = row_sq.sum(-1)
    lag_count = doc_lag_count.unsqueeze(1)
    diagonal_fit = torch.where(lag_count > 0, diagonal_sum.square() / lag_count.clamp_min(1), torch.zeros_like(diagonal_sum))
    rss = (square - diagonal_fit.sum(-1)).clamp_min(0)
    tss = square - total.square() / n_entries.clamp_min(1)
    # A window whose pattern has no variance (one token, or exactly uniform over a
    # single diagonal) has no Toeplitz R²; it is left out and not counted.
    has_variance = tss > 1e-12 * square.clamp_min(1e-300)
    r2 = torch.where(has_variance, 1 - rss / tss.clamp_min(1e-300), torch.zeros_like(tss))
    out["doc_toeplitz_sum"] = r2.sum(0)
    out["doc_toeplitz_count"] = has_variance.sum(0, dtype=torch.float64)
    return out


def _row_moments(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ_k y`` and ``Σ_k y²`` per row, in float64, accurate to float64 even for float32 ``y``.

    Squaring float32 values rounds each square (relative 6e-8), which would leave a
    spurious within-group variance of order 1e-7 where the truth is exactly 0 (uniform
    attention). So the sum of squares is built from deviations around the row mean:
    ``Σy² = Σ(y - m̃)² - n(m - m̃)² + n m²`` with ``m`` the float64 mean and ``m̃`` its
    rounding to ``y``'s dtype.

    Args:
        values: ``[batch, head, query, key]``, zero where ``mask`` is false.
        mask: ``[batch, 1, query, key]`` bool.
        count: ``[batch, 1, query]`` float64 visible keys per row.
    """
    total = values.sum(-1, dtype=torch.float64)
    mean = total / count.clamp_min(1)
    mean_rounded = mean.to(values.dtype)
    deviation = torch.where(mask, values - mean_rounded.unsqueeze(-1), torch.zeros((), dtype=values.dtype, device=values.device))
    spread = (deviation * deviation).sum(-1, dtype=torch.float64)
    offset = mean - mean_rounded.to(torch.float64)
    squares = (spread - count * offset * offset + count * mean * mean).clamp_min(0)
    return total, squares


class AttentionStatistics:
    """Streaming sufficient statistics of a model's attention over a corpus.

    Args:
        n_layers, n_heads: the model's attention layout.
        n_positions: ``T``, the longest window the statistics hold.
        windows: per layer, ``None`` (full causal) or the sliding window width.
        log_floor: ``eps`` of the log scale; ``None`` takes the smallest normal number of
            the first pattern's dtype.
        excluded_keys: absolute key positions left out of every statistic.
        keep_pattern: keep the window-summed pattern ``[layer, head, T, T]`` (needed for
            the Toeplitz R² of the document-averaged pattern; 8·L·H·T² bytes).
        sample_size: also keep a uniform sample of this many entries
            (:class:`~equivariance_probe.sample.EntrySample`, for scatter plots); 0 for none.
        sample_seed: seed of that sample.
        device: where the float64 sums live while streaming.

    All arrays are float64 and listed in :data:`STATISTICS`. ``a + b`` and
    :meth:`merge` add them; two statistics merge only if measured the same way.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        n_heads: int,
        n_positions: int,
        windows: Sequence[int | None],
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
        self.windows = tuple(None if w is None or w >= n_positions else int(w) for w in windows)
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

    def _shape(self, spec: str) -> tuple[int, ...]:
        sizes = {"L": self.n_layers, "H": self.n_heads, "T": self.n_positions}
        return tuple(sizes[s] for s in spec.split())

    # -- streaming ----------------------------------------------------------------
    def begin_batch(self, lengths: torch.Tensor) -> None:
        """Start a batch of windows with ``lengths: [batch]`` real tokens each."""
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
        batch, heads, n_query, n_key = pattern.shape
        if heads != self.n_heads or n_query != n_key or n_query > self.n_positions:
            raise ValueError(
                f"pattern of shape {tuple(pattern.shape)} does not fit statistics for "
                f"{self.n_heads} heads and {self.n_positions} positions"
            )
        if self.log_floor is None:
            self.log_floor = default_log_floor(pattern.dtype if pattern.is_floating_point() else torch.float32)
        if n_query < self.n_positions:
            pad = self.n_positions - n_query
            pattern = torch.nn.functional.pad(pattern, (0, pad, 0, pad))
        pattern = pattern.to(self.device)
        if self._lengths is None:
            raise RuntimeError("AttentionStatistics.update called outside begin_batch/end_batch")
        visible, masks = self._masks_for(self.windows[layer])
        reduced = reduce_layer(
            pattern,
            visible,
            self._index,
            self.log_floor,
            masks["doc_lag_count"],
            keep_pattern=self.keep_pattern,
            max_lag=self.windows[layer],
            moments=_entry_moments,
        )
        if not bool(torch.isfinite(reduced["raw_sum"]).all() & torch.isfinite(reduced["log_sum"]).all()):
            raise NonFiniteAttentionError(
                f"layer {layer} produced NaN or infinite attention weights on visible entries; "
                "check the model's weights for NaN/inf (e.g. a failed load or an fp16 overflow) "
                "and run it in float32 or bfloat16. Statistics gathered before this batch are kept."
            )
        if self.n_windows == 0:
            self._check_mask(layer, pattern)
        self._pending[layer] = (reduced, masks)
        if self.sample is not None:
            window = self.windows[layer]
            sizes = torch.arange(1, self.n_positions + 1, device=self.device)
            self.sample.update(layer, pattern, visible, sizes if window is None else sizes.clamp(max=window))

    def _check_mask(self, layer: int, pattern: torch.Tensor) -> None:
        """On the first batch: the model must put no attention outside the mask we read.

        If it did, the adapter reported the wrong mask (e.g. a sliding window it did not
        know of) and every statistic would silently miss attention mass.
        """
        model_mask = visible_mask(self.n_positions, self.windows[layer], self._lengths)
        real_rows = model_mask.any(-1, keepdim=True).unsqueeze(1)
        outside = torch.where(real_rows & ~model_mask.unsqueeze(1), pattern.abs(), torch.zeros((), dtype=pattern.dtype, device=pattern.device))
        leaked = float(outside.sum(-1).max()) if outside.numel() else 0.0
        if leaked > 1e-3:
            window = self.windows[layer]
            raise AttentionCaptureError(
                f"layer {layer} puts attention mass up to {leaked:.3g} per query on keys outside the mask the "
                f"adapter reported ({'full causal' if window is None else f'sliding window {window}'}); the "
                "statistics would miss it. The model's mask is not one this adapter understands: report the "
                "architecture, or pass an adapter with the right windows"
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
            raise RuntimeError(f"batch ended without attention from layers {missing}; it was not added")
        lengths = self._lengths
        for layer, (reduced, masks) in self._pending.items():
            self._add_layer(layer, reduced, masks)
        covering = torch.arange(self.n_positions, device=self.device).view(1, -1) < lengths.view(-1, 1)
        self.arrays["windows_covering"] += covering.sum(0, dtype=torch.float64)
        self.n_windows += int(lengths.numel())
        self.n_tokens += int(lengths.sum())
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

    def add_reduced(self, layer: int, reduced: dict[str, torch.Tensor]) -> None:
        """Add one layer's sums of the current batch, already reduced by :func:`reduce_layer`.

        For adapters that cannot bring patterns home (remote nnsight): they run
        :func:`reduce_layer` where the model runs, on this batch's visible mask, and add
        the result here. The mask part is computed here, so the batch merges exactly
        like one given to :meth:`update`. ``log_floor`` must be set before the
        reduction ran, since the reduction used it.

        Args:
            layer: the layer the sums belong to.
            reduced: the dict :func:`reduce_layer` returns for this batch with ``T`` =
                :attr:`n_positions` (``key_lag_sum`` is summed over layers by
                :meth:`end_batch` anyway, so it may hold several layers' sum on one
                layer and zeros on the others).
        """
        if self._lengths is None:
            raise RuntimeError("AttentionStatistics.add_reduced called outside begin_batch/end_batch")
        if self.log_floor is None:
            raise RuntimeError("AttentionStatistics.add_reduced needs log_floor set before the reduction ran")
        reduced = {name: value.to(device=self.device, dtype=torch.float64) for name, value in reduced.items()}
        if not bool(torch.isfinite(reduced["raw_sum"]).all() & torch.isfinite(reduced["log_sum"]).all()):
            raise NonFiniteAttentionError(
                f"layer {layer} produced NaN or infinite attention weights on visible entries; "
                "check the model's weights for NaN/inf (e.g. a failed load or an fp16 overflow) "
                "and run it in float32 or bfloat16. Statistics gathered before this batch are kept."
            )
        _, masks = self._masks_for(self.windows[layer])
        self._pending[layer] = (reduced, masks)

    # -- merging --------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """What must agree for two statistics to be merged."""
        return {
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_positions": self.n_positions,
            "windows": list(self.windows),
            "log_floor": self.log_floor,
            "excluded_keys": list(self.excluded_keys),
            "keep_pattern": self.keep_pattern,
        }

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

    def merge(self, other: AttentionStatistics) -> AttentionStatistics:
        """A new statistics object holding the sums of both (exact: float64 addition)."""
        self.check_compatible(other)
        merged = self.copy()
        merged.log_floor = self.log_floor if self.log_floor is not None else other.log_floor
        for name, value in other.arrays.items():
            merged.arrays[name] = merged.arrays[name] + value.to(merged.device)
        merged.n_windows += other.n_windows
        merged.n_tokens += other.n_tokens
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
            windows=self.windows,
            log_floor=self.log_floor,
            excluded_keys=self.excluded_keys,
            keep_pattern=self.keep_pattern,
            device=self.device,
        )
        new.arrays = {name: value.clone() for name, value in self.arrays.items()}
        new.n_windows, new.n_tokens = self.n_windows, self.n_tokens
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
        return torch.stack([1.0 / uniform_prior(self.n_positions, w) for w in self.windows])

    def nbytes(self) -> int:
        return sum(value.numel() * value.element_size() for value in self.arrays.values())

    def __repr__(self) -> str:
        return (
            f"AttentionStatistics(layers={self.n_layers}, heads={self.n_heads}, positions={self.n_positions}, "
            f"windows={self.n_windows}, tokens={self.n_tokens}, {self.nbytes() / 2**20:.1f} MiB)"
        )
