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

from dataclasses import fields
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from .config import StatisticsConfig
from .engines import ReductionSpec
from .engines.block_maths import BlockWorkspace, toeplitz_r2_per_window
from .groups import as_keys
from .masks import key_bins, mask_counts, pinned
from .sums import head_sums, row_sums

__all__ = ["BatchTransaction", "resampling_keys_of", "window_fingerprint_array"]

#: Fields of the statistics' configuration that the reduction spec has too (``causal``, ``excluded_keys``,
#: ``keep_pattern``, ...): how the statistics are measured is how each batch is reduced.
_SHARED_FIELDS = tuple(sorted({item.name for item in fields(ReductionSpec)} & {item.name for item in fields(StatisticsConfig)}))


#: The per-window sums with one value per query position (``[B, H, W]``), zero-padded to ``T``; the
#: first token's weights only where the statistics keep them (``keep_first_key``).
_ROW_SUMS = row_sums()
#: The per-head sums (``[L, H]``), added as they come.
_HEAD_SUMS = head_sums()


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
        # A measurement option of the configuration reaches the engines under its own name: a field of
        # both dataclasses (an exclusion rule, say) is copied here without being named.
        measured = {name: getattr(config, name) for name in _SHARED_FIELDS}
        spec = ReductionSpec(**{
            **measured, "lengths": self.host_lengths, "window": window, "log_floor": log_floor,
            "key_bin": masks["key_bin"][:width], "n_key_bins": config.key_bins, "scaling": scaling,
            "softcap": softcap, "block_size": block_size,
        })
        return spec, masks

    def stage(
        self, layer: int, sums: dict[str, torch.Tensor], masks: dict[str, torch.Tensor], width: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Keep one layer's batch-summed sums pending, from an engine's per-window ``sums`` of a batch
        ``width`` positions wide (zero-padded to ``T``: entries beyond ``W`` are 0, so the padding embeds
        them exactly) and its per-window Toeplitz R² (from ``masks``, :meth:`masks_for`).

        Returns:
            ``(per_window, r2, has_variance)``: the padded per-window row and lag sums, and each window's
            Toeplitz R² and whether it has variance (``[B, H]``), for the interval groups.
        """
        causal, pad = self.config.causal, self.config.n_positions - width
        per_window = {name: _widened(sums[name], pad) for name in _ROW_SUMS if name in sums}
        per_window["lag_sum"] = _widened(sums["lag_sum"], pad, centred=not causal)
        r2, has_variance = toeplitz_r2_per_window(per_window, masks["doc_lag_count"])
        reduced = {name: value.sum(0) for name, value in per_window.items()}
        reduced["floored"] = sums["floored"].sum(0)
        reduced["doc_toeplitz_sum"] = r2.sum(0)
        reduced["doc_toeplitz_count"] = has_variance.sum(0, dtype=torch.float64)
        reduced["key_lag_sum"] = _widened(sums["key_lag_sum"], pad, centred=not causal)
        if self.config.keep_pattern:
            reduced["pattern_sum"] = _widened(sums["pattern_sum"], pad, dims=2)
        # Checked for NaN and inf in end_batch, all layers at once: one device sync per batch, not per layer.
        self.pending[layer] = reduced
        return per_window, r2, has_variance

    def stage_batch_sums(self, sums: dict[str, torch.Tensor], width: int, device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
        """Keep every layer's sums pending, from sums reduced elsewhere over the whole batch (see
        :meth:`~equivariance_probe.statistics.AttentionStatistics.add_batch_sums` for their shapes); the
        staged sums per layer, float64 on ``device``."""
        config, pad = self.config, self.config.n_positions - width
        zero_key_lag = torch.zeros((config.key_bins, config.n_positions), dtype=torch.float64)
        for layer in range(config.n_layers):
            reduced = {name: _widened(sums[name][layer], pad) for name in (*_ROW_SUMS, "lag_sum") if name in sums}
            for name in _HEAD_SUMS:
                reduced[name] = sums[name][layer]
            if "pattern_sum" in sums:
                reduced["pattern_sum"] = _widened(sums["pattern_sum"][layer], pad, dims=2)
            # The reduction summed key_lag_sum over layers (the statistics only keep that sum):
            # it goes with the last layer, zeros with the others.
            last = layer == config.n_layers - 1
            reduced["key_lag_sum"] = _widened(sums["key_lag_sum"], pad) if last else zero_key_lag
            self.pending[layer] = {name: value.to(device=device, dtype=torch.float64) for name, value in reduced.items()}
        return self.pending

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


def _widened(value: torch.Tensor, pad: int, *, dims: int = 1, centred: bool = False) -> torch.Tensor:
    """``value`` zero-padded by ``pad`` after each of its last ``dims`` axes; ``centred``: signed lags of a
    narrower batch, which sit at ``dt + W - 1``, moved to ``dt + T - 1`` (``pad`` zeros on both sides)."""
    if pad == 0:
        return value
    return torch.nn.functional.pad(value, (pad, pad) if centred else (0, pad) * dims)


def window_fingerprint_array(fingerprints: Any, batch: int) -> np.ndarray | None:
    """A batch's window fingerprints as ``[batch]`` ``uint64`` (``None`` stays ``None``)."""
    if fingerprints is None:
        return None
    fingerprints = np.asarray(fingerprints, dtype=np.uint64).reshape(-1)
    if len(fingerprints) != batch:
        raise InputError(
            f"begin_batch got {len(fingerprints)} window fingerprints for a batch of {batch} windows; "
            "pass one fingerprint per window (or fingerprints=None)"
        )
    return fingerprints


def resampling_keys_of(batch: int, fingerprints: np.ndarray | None, keys: Any, n_windows: int) -> tuple[np.ndarray, str]:
    """Each window's interval-group key and where it came from (see :data:`~.groups.KEY_KINDS`): the keys
    given, else the fingerprints, else the windows' order in the stream (after ``n_windows`` added before)."""
    if keys is not None:
        keys = as_keys(keys)
        if len(keys) != batch:
            raise InputError(f"begin_batch got {len(keys)} resampling keys for a batch of {batch} windows; "
                             "pass one key per window (or resampling_keys=None)")
        return keys, "explicit"
    if fingerprints is not None:
        return fingerprints, "window_fingerprint"
    return np.arange(n_windows, n_windows + batch, dtype=np.uint64), "ordinal"
