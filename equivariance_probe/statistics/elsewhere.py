"""Batches reduced elsewhere: the plan a remote reduction follows, and adding what it sends back.

Place in the seams: *statistics*. An adapter that cannot bring a batch's attention home (a remote
nnsight trace, where a 70B model's patterns would be gigabytes per document) asks the statistics
for a plan (:func:`reduction_plan`: the batch's reduction spec in plain form), reduces every
layer where the model runs with the in-trace engine
(:mod:`~equivariance_probe.statistics.engines.in_trace`), and hands the batch-summed sums back
(:func:`add_batch_sums`), which complete the batch exactly like a local one.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import AttentionCaptureError
from .mask_check import MASK_LEAK_TOLERANCE, refuse_mask, refuse_nonfinite

if TYPE_CHECKING:
    from .batch import BatchTransaction
    from .groups import WindowGroups
    from .window_sinks import WindowSinks


class StreamingStatistics(Protocol):
    """What this module reads and writes of :class:`~equivariance_probe.statistics.AttentionStatistics`,
    declared here so that the streaming object imports this module and not the other way round."""

    causal: bool
    log_floor: float | None
    block_size: int | None
    sliding_windows: tuple[int | None, ...]
    n_windows: int
    n_layers: int
    device: torch.device
    groups: WindowGroups | None
    window_sinks: WindowSinks | None
    paths: dict[str, int]

__all__ = ["add_batch_sums", "reduction_plan"]


def reduction_plan(statistics: StreamingStatistics, batch: BatchTransaction, width: int) -> dict[str, Any]:
    """What a reduction run elsewhere needs to reduce this batch exactly as :meth:`~equivariance_probe.statistics.AttentionStatistics.update` would.

    For adapters that cannot bring patterns home (a remote nnsight trace): they run
    :func:`~equivariance_probe.statistics.engines.in_trace.reduce_layer` where the model runs and
    hand the sums to :func:`add_batch_sums`. Plain values only, so the plan travels with
    the trace.

    Args:
        width: ``W``, the batch's width in tokens (its longest window).

    Returns:
        ``spec``: the batch's :class:`~equivariance_probe.statistics.engines.spec.ReductionSpec` in plain
        form (:meth:`~equivariance_probe.statistics.engines.spec.ReductionSpec.plain`, without a window),
        ``windows`` (per layer, the sliding window, ``None`` where it covers ``W``) and ``check_mask``
        (whether the reduction must measure attention outside the mask: on the first batch).
    """
    if not statistics.causal:
        raise AttentionCaptureError(
            "a bidirectional encoder's attention cannot be reduced inside a remote trace (the remote reduction "
            "knows causal masks); run the encoder locally"
        )
    if statistics.log_floor is None:
        raise AttentionCaptureError(
            "the statistics need their log_floor before a reduction runs elsewhere; set it from the "
            "model's dtype (statistics.log_floor = default_log_floor(dtype)) first"
        )
    spec, _ = batch.spec(0, width, torch.device("cpu"), statistics.log_floor, statistics.block_size)
    return {
        "spec": {**spec.plain(), "window": None},
        "windows": [None if w is None or w >= width else int(w) for w in statistics.sliding_windows],
        "check_mask": statistics.n_windows == 0,
    }

def add_batch_sums(
statistics: StreamingStatistics, batch: BatchTransaction, sums: dict[str, torch.Tensor], width: int
) -> None:
    """Add every layer's sums of the current batch, reduced elsewhere with :func:`reduction_plan`.

    Args:
        sums: float64 tensors for ``W = width`` and ``L`` layers: ``raw_sum, raw_sq,
            log_sum, log_sq, lag_sum: [L, head, W]``; ``floored, doc_toeplitz_sum,
            doc_toeplitz_count: [L, head]``; ``key_lag_sum: [K, W]`` (summed over layers);
            ``outside_mass: [L]`` (largest attention mass a real query put outside the
            mask; 0 when not checked); with ``keep_pattern``, ``pattern_sum:
            [L, head, W, W]`` (query-key layout); and, with ``keep_first_key``, ``first_key_sum: [L, head, W]``
            and ``first_key_window: [L, B, head]`` (each window's ``Σ_q a[q, 0]``, for the per-window sink rate).
        width: ``W``.

    The mask part is computed here, so the batch merges exactly like one given to
    :meth:`~equivariance_probe.statistics.AttentionStatistics.update`: entries beyond ``W`` are 0, so zero-padding to ``T`` embeds them exactly.

    Interval groups: the sums are totals over the batch, so they are a group's sums only when
    every window of the batch is in one group (always with ``batch_size=1``); a batch of
    windows of several groups drops the group sums of these statistics for good, with a warning
    (the intervals then say why).
    """
    outside = sums["outside_mass"]
    if outside.numel() and float(outside.max()) > MASK_LEAK_TOLERANCE:
        layer = int(outside.argmax())
        refuse_mask(layer, float(outside[layer]), statistics.sliding_windows[layer], statistics.causal)
    _drop_groups_of_mixed_batches(statistics)
    for layer, reduced in batch.stage_batch_sums(sums, width, statistics.device).items():
        if not bool(torch.isfinite(reduced["raw_sum"]).all() & torch.isfinite(reduced["log_sum"]).all()):
            refuse_nonfinite(layer)
        if statistics.groups is not None:
            statistics.groups.stage(layer, {name: value.unsqueeze(0) for name, value in reduced.items()},
                              reduced["doc_toeplitz_sum"].unsqueeze(0), reduced["doc_toeplitz_count"].unsqueeze(0))
        if statistics.window_sinks is not None:
            statistics.window_sinks.stage(layer, sums["first_key_window"][layer])
    statistics.paths["remote"] = statistics.paths.get("remote", 0) + statistics.n_layers

def _drop_groups_of_mixed_batches(statistics: StreamingStatistics) -> None:
    """Drop the group sums when a batch reduced elsewhere (summed over its windows) spans several groups."""
    if statistics.groups is None or statistics.groups.unavailable is not None or statistics.groups.single_group():
        return
    reason = ("a batch was reduced remotely, where its sums come back added over its windows, and its windows fall "
              "in more than one interval group; rerun remotely with batch_size=1 (each reply is then one window's) "
              "or locally for intervals")
    statistics.groups.disable(reason)
    warnings.warn(f"interval groups dropped: {reason}", stacklevel=3)
