"""One batch of windows on its way into attention statistics: added whole, or not at all.

Place in the seams: *statistics*. :class:`BatchTransaction` holds what a batch needs while its
layers are reduced (the window lengths on the host and on the device, the mask's closed-form
sums, the engine's reused workspace) and the sums of every layer reduced so far, *pending*: the
statistics add them only when every layer of the batch is in and finite
(:meth:`~equivariance_probe.statistics.AttentionStatistics.end_batch`), so that an error half-way
through a forward pass (NaN attention, an interrupt) leaves the sums exactly as they were after
the last complete batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .config import StatisticsConfig
from .engines import ReductionSpec
from .engines.block_maths import BlockWorkspace
from .masks import key_bins, mask_counts, pinned

__all__ = ["BatchTransaction"]


class BatchTransaction:
    """The state of one batch between ``begin_batch`` and ``end_batch``/``abort_batch``.

    Args:
        config: how the statistics are measured.
        lengths: ``[batch]`` real tokens per window.
        device: where the statistics' sums live.
        fingerprints: ``[batch]`` ``uint64`` window fingerprints, or ``None``.
        sample_before: the entry sample's columns before the batch (restored on abort), or ``None``.
    """

    def __init__(
        self,
        config: StatisticsConfig,
        lengths: torch.Tensor,
        device: torch.device,
        fingerprints: np.ndarray | None = None,
        sample_before: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        # On the host for the block bounds and the mask's closed forms (no device-to-host copy
        # per layer), and on the device for what runs there.
        self.host_lengths = pinned(lengths.detach().to("cpu", torch.long))
        self.lengths = self.host_lengths.to(device, non_blocking=True)
        self.fingerprints = fingerprints
        self.sample_before = sample_before
        #: Per layer, the batch-summed sums reduced so far (not yet added).
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        # The query blocks' temporaries, kept from layer to layer within a batch and let go at its end
        # (see BlockWorkspace: on CPU, fresh allocations of that size page-fault).
        self.workspace = BlockWorkspace()
        self._masks: dict[tuple[int | None, str], dict[str, torch.Tensor]] = {}

    def masks_for(self, window: int | None, device: torch.device) -> dict[str, torch.Tensor]:
        """The mask's sums of this batch for one sliding window and its ``key_bin: [T]`` (computed once per
        batch on the host, from the window lengths, and copied to each device that needs them)."""
        key = (window, str(device))
        if key not in self._masks:
            host = (window, "cpu")
            if host not in self._masks:
                config = self.config
                bins, count = key_bins(config.n_positions, config.key_bins)
                counts = mask_counts(self.host_lengths, config.n_positions, window=window,
                                     excluded_keys=config.excluded_keys, key_bin=bins, n_key_bins=count,
                                     causal=config.causal)
                self._masks[host] = {name: pinned(value) for name, value in {**counts, "key_bin": bins}.items()}
            self._masks[key] = {name: value.to(device, non_blocking=True) for name, value in self._masks[host].items()}
        return self._masks[key]

    def spec(
        self, layer: int, width: int, device: torch.device, log_floor: float, block_size: int | None, *,
        scaling: float | None = None, softcap: float | None = None,
    ) -> tuple[ReductionSpec, dict[str, torch.Tensor]]:
        """The :class:`ReductionSpec` of one layer of this batch, ``width`` positions wide, with the mask's sums
        on ``device`` (:meth:`masks_for`) that the reduced sums are completed with."""
        config = self.config
        window = config.sliding_windows[layer]
        masks = self.masks_for(window, device)
        spec = ReductionSpec(
            lengths=self.host_lengths, window=window, causal=config.causal, excluded_keys=config.excluded_keys,
            log_floor=log_floor, key_bin=masks["key_bin"][:width], n_key_bins=config.key_bins,
            keep_pattern=config.keep_pattern, scaling=scaling, softcap=softcap, block_size=block_size,
        )
        return spec, masks

    def missing_layers(self) -> list[int]:
        """Layers of the model whose sums have not been staged."""
        return sorted(set(range(self.config.n_layers)) - set(self.pending))

    def first_nonfinite_layer(self, device: torch.device) -> int | None:
        """The first staged layer whose sums hold NaN or inf, or ``None`` (one device sync for every layer)."""
        finite = [torch.isfinite(reduced["raw_sum"]).all() & torch.isfinite(reduced["log_sum"]).all()
                  for reduced in self.pending.values()]
        if bool(torch.stack([flag.to(device) for flag in finite]).all()):
            return None
        return next(layer for layer, flag in zip(self.pending, finite) if not bool(flag))

    def mask_sums(self, device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
        """Per layer, the mask's closed-form sums of the batch on ``device``, by the names of the arrays
        they add to (per head: the head-summed key-lag arrays take ``H`` times them)."""
        config = self.config
        out = {}
        for layer, window in enumerate(config.sliding_windows):
            mask = self.masks_for(window, device)
            out[layer] = {
                "query_count": mask["query_count"],
                "lag_count": mask["lag_count"],
                "lag_prior_sum": mask["lag_prior_sum"],
                "key_lag_count": config.n_heads * mask["key_lag_count"],
                "key_lag_prior_sum": config.n_heads * mask["key_lag_prior_sum"],
            }
        out[0]["windows_covering"] = self.masks_for(config.sliding_windows[0], device)["windows_covering"]
        return out
