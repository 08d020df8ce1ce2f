"""The reduction spec: everything but the queries and keys that decides one layer's sums of one batch.

Place in the seams: *statistics*, the engines' common input. An engine is a function
``f(query, key, spec) -> sums`` (or ``f(pattern, spec)`` from captured weights); the statistics
build one :class:`ReductionSpec` per batch and layer (the batch's window lengths, the layer's mask,
what the sums leave out, the key bins, the score's scale and soft cap), and every engine reads
it the same way through :func:`layout`, which validates it against the tensors and lays it out on
their device. A new option of the reduction (an exclusion rule, say) is a field here, read by the
engines that implement it. :meth:`ReductionSpec.plain` is its form in builtins, which travels
into a remote nnsight trace (:mod:`~equivariance_probe.statistics.engines.in_trace`).

torch, math and builtins only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import InputError
from ..sums import STATISTICS
from ..masks import _check_key_bins, _effective_window, _excluded_flags, check_window_kind, default_log_floor, n_lags, visible_key_counts

__all__ = ["Layout", "ReductionSpec", "check_qk", "empty_sums", "layout", "work_dtype"]


@dataclass(frozen=True, eq=False)
class ReductionSpec:
    """How one layer's attention of one batch is reduced to sums (every field has its neutral default).

    Attributes:
        lengths: ``[B]`` real tokens per window (right padding), best on the host; ``None``: all ``T``.
        window: sliding window width ``w``, or ``None`` for full causal attention.
        causal: ``False`` for a bidirectional encoder (BERT): every real query sees every real key of
            its window, and lags are signed (``lag_sum: [B, H, 2T-1]``, lag ``dt`` at ``dt + T - 1``).
        excluded_keys: key positions kept in the softmax but left out of every sum.
        log_floor: ``eps`` of the log scale; ``None``: the smallest normal number of the input's dtype.
        key_bin: ``[T]`` non-decreasing bin of each key position; ``None``: one bin per key.
        n_key_bins: ``K``; ``None``: ``key_bin.max() + 1``.
        keep_pattern: also return ``pattern_sum: [H, T, T]`` (query-key layout, summed over the batch).
        keep_first_key: also return ``first_key_sum: [B, H, T]``, the model's weight ``a[q, 0]`` on the
            window's first token for every real query ``q``, whatever ``excluded_keys`` says (an excluded
            key stays in the softmax, and its weight is what an attention-sink rate reads), 0 where the
            model's mask hides key 0 (a sliding window at ``q >= w``) and on padding rows.
        scaling: score scale; ``None`` means ``d**-0.5``.
        softcap: logit soft-capping ``c`` (``s -> c·tanh(s/c)``), or ``None``.
        block_size: query rows per block (the torch engine) or per tile (the Triton kernel, rounded up
            to a power of two of at least 16); ``None`` chooses it. Results do not depend on it beyond
            float64 rounding.
        compile_blocks: run the torch engine's per-block maths through ``torch.compile`` (see
            :func:`~equivariance_probe.statistics.engines.torch_blocks.attention_sums_from_qk`).
    """

    lengths: torch.Tensor | Sequence[int] | None = None
    window: int | None = None
    causal: bool = True
    excluded_keys: Sequence[int] = ()
    log_floor: float | None = None
    key_bin: torch.Tensor | None = None
    n_key_bins: int | None = None
    keep_pattern: bool = False
    keep_first_key: bool = False
    scaling: float | None = None
    softcap: float | None = None
    block_size: int | None = None
    compile_blocks: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "excluded_keys", tuple(sorted({int(k) for k in self.excluded_keys})))

    @classmethod
    def of(cls, spec: ReductionSpec | None = None, **options: Any) -> ReductionSpec:
        """``spec`` with ``options`` (fields) replaced; a new spec from ``options`` alone when ``spec`` is ``None``."""
        if spec is None:
            return cls(**options)
        return dataclasses.replace(spec, **options) if options else spec

    def plain(self) -> dict[str, Any]:
        """The spec in builtins (lists, floats, ``None``): what travels into a remote trace."""
        out = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, torch.Tensor):
                value = [int(v) for v in value.reshape(-1).tolist()]
            elif isinstance(value, tuple):
                value = list(value)
            out[item.name] = value
        return out


def check_qk(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Shapes ``(B, H, H_kv, T, d)`` of matching query and key tensors."""
    if query.dim() != 4 or key.dim() != 4:
        raise InputError(
            f"query and key must be [batch, head, position, head_dim], got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    batch, heads, n_positions, dim = query.shape
    kb, kv_heads, n_keys, kdim = key.shape
    if kb != batch or n_keys != n_positions or kdim != dim:
        raise InputError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if kv_heads < 1 or heads % kv_heads:
        raise InputError(f"{heads} query heads cannot share {kv_heads} key heads evenly")
    if key.device != query.device:
        raise InputError(f"query is on {query.device} but key is on {key.device}")
    return batch, heads, kv_heads, n_positions, dim


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Layout:
    """One batch's spec, validated and laid out on the tensors' device for an engine."""

    batch: int
    heads: int
    n_positions: int
    window: int | None  # None when the window covers the context
    lengths: torch.Tensor  # [B] long, on the device
    host_lengths: list[int]
    key_keep: torch.Tensor  # [T] bool: not excluded
    excluded: list[int]  # excluded positions inside [0, T)
    row_count: torch.Tensor  # [B, T] float64 visible keys per row
    key_bin: torch.Tensor  # [T] long
    n_key_bins: int
    log_floor: float
    device: torch.device
    causal: bool = True

    @property
    def n_lags(self) -> int:
        """Lags of the lag sums: ``T`` (``0 .. T-1``) causal, ``2T - 1`` (``-(T-1) .. T-1``) bidirectional."""
        return n_lags(self.n_positions, self.causal)

    @property
    def lag_offset(self) -> int:
        """Index of lag 0 in a lag array."""
        return 0 if self.causal else self.n_positions - 1

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[k0, k1)`` any query of rows ``[q0, q1)`` can see: up to the block's last row under a
        causal mask (from ``q0 - w + 1`` with a window ``w``), every real key of the batch otherwise."""
        if not self.causal:
            return 0, max(self.host_lengths, default=0)
        return (0 if self.window is None else max(0, q0 - self.window + 1)), q1

    def allowed(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The model's mask on rows ``[q0, q1)`` and keys ``[k0, k1)``, broadcastable to
        ``[B, 1, rows, keys]`` bool: ``[1, 1, rows, keys]`` causal, ``[B, 1, 1, keys]`` (the
        window's real keys) bidirectional."""
        key = torch.arange(k0, k1, device=self.device)
        if not self.causal:
            return (key.view(1, -1) < self.lengths.view(-1, 1)).view(-1, 1, 1, k1 - k0)
        query = torch.arange(q0, q1, device=self.device).view(-1, 1)
        allowed = key.view(1, -1) <= query
        if self.window is not None:
            allowed = allowed & (query - key.view(1, -1) < self.window)
        return allowed.view(1, 1, q1 - q0, k1 - k0)

    def masks_more_than_the_model(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether the block holds entries the model sees but the statistics do not read: an
        excluded key among ``[k0, k1)``, or a padding row among ``[q0, q1)``."""
        return any(k0 <= key < k1 for key in self.excluded) or min(self.host_lengths, default=q1) < q1

    def first_key_seen(self, q0: int, q1: int) -> torch.Tensor:
        """Rows ``[q0, q1)`` whose weight on the window's first token counts for the sink sums: real queries
        whose mask shows key 0 (every one but those at ``q >= w`` under a sliding window ``w``), whether or
        not key 0 is excluded from the other sums. ``[B, 1, rows]`` bool."""
        query = torch.arange(q0, q1, device=self.device).view(1, -1)
        seen = query < self.lengths.view(-1, 1)
        if self.causal and self.window is not None:
            seen = seen & (query < self.window)
        return seen.view(-1, 1, q1 - q0)

    def visible(self, q0: int, q1: int, k0: int, k1: int, allowed: torch.Tensor) -> torch.Tensor:
        """Entries the statistics read in the block: ``[B, 1, rows, keys]`` bool."""
        real = torch.arange(q0, q1, device=self.device).view(1, -1) < self.lengths.view(-1, 1)
        visible = allowed & real.view(-1, 1, q1 - q0, 1)
        if self.excluded:
            visible = visible & self.key_keep[k0:k1]
        return visible


def layout(spec: ReductionSpec, *, batch: int, heads: int, n_positions: int, device: torch.device,
           input_dtype: torch.dtype) -> Layout:
    """``spec`` validated against a batch of ``batch`` windows of ``n_positions``, laid out on ``device``.

    Raises:
        InputError: lengths, key bins, log floor or window that do not fit (naming the value).
    """
    lengths = spec.lengths
    if lengths is None:
        lengths = torch.full((batch,), n_positions, dtype=torch.long)
    # The lengths are read on the host (block bounds) before they go to the device, so that lengths
    # given on the CPU cost no device-to-host copy.
    host_lengths = [int(n) for n in torch.as_tensor(lengths).reshape(-1).tolist()]
    lengths = torch.as_tensor(lengths).to(device=device, dtype=torch.long, non_blocking=True).reshape(-1)
    if lengths.numel() != batch:
        raise InputError(f"lengths has {lengths.numel()} entries for a batch of {batch} windows")
    if any(n < 0 or n > n_positions for n in host_lengths):
        raise InputError(f"lengths must lie in [0, {n_positions}], got {host_lengths}")
    key_bin, n_key_bins = _check_key_bins(spec.key_bin, spec.n_key_bins, n_positions, device)
    log_floor = default_log_floor(input_dtype) if spec.log_floor is None else spec.log_floor
    if not log_floor > 0:
        raise InputError(f"log_floor must be positive, got {log_floor}")
    window = _effective_window(spec.window, n_positions)
    check_window_kind(window, spec.causal)
    excluded = [k for k in spec.excluded_keys if 0 <= k < n_positions]
    key_keep = ~_excluded_flags(n_positions, excluded, device)
    real = torch.arange(n_positions, device=device).view(1, -1) < lengths.view(-1, 1)
    if spec.causal:
        per_query = visible_key_counts(n_positions, window, excluded, device).view(1, -1)
    else:
        # Every real query of window b sees its L_b real keys that are not excluded.
        per_query = (lengths - sum((lengths > key).long() for key in excluded)).to(torch.float64).view(-1, 1)
    row_count = torch.where(real, per_query, torch.zeros((), dtype=torch.float64, device=device))
    return Layout(batch=batch, heads=heads, n_positions=n_positions, window=window, lengths=lengths,
                  host_lengths=host_lengths, key_keep=key_keep, excluded=excluded, row_count=row_count,
                  key_bin=key_bin, n_key_bins=n_key_bins, log_floor=float(log_floor), device=device,
                  causal=bool(spec.causal))


def empty_sums(layout: Layout, keep_pattern: bool, keep_first_key: bool = False) -> dict[str, torch.Tensor]:
    """Zeroed per-window sums of a batch, one per sum of the table an engine computes (its ``window`` shape): ``raw_sum, raw_sq, log_sum, log_sq: [B, H, T]``, ``lag_sum: [B, H, D]``,
    ``floored: [B, H]``, ``key_lag_sum: [K, D]``, if ``keep_pattern`` ``pattern_sum: [H, T, T]`` and, if
    ``keep_first_key``, ``first_key_sum: [B, H, T]``."""
    sizes = {"B": layout.batch, "H": layout.heads, "T": layout.n_positions, "D": layout.n_lags, "K": layout.n_key_bins}
    kept = {None: True, "keep_pattern": keep_pattern, "keep_first_key": keep_first_key}
    return {name: torch.zeros(tuple(sizes[letter] for letter in entry.window.split()), dtype=torch.float64,
                              device=layout.device)
            for name, entry in STATISTICS.items() if entry.window is not None and kept[entry.kept_if]}
