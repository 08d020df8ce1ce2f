"""Statistics saved in an older array layout, brought to today's before they load.

Place in the seams: *records*, the file format. The statistics know one layout, today's
(:data:`~equivariance_probe.statistics.STATISTICS`); what files of earlier versions hold is
translated here, exactly, so that they load and merge with new results.

* Before the key-position bins (a configuration without ``key_bins``), files kept one key-lag row
  per key, ``[T, T]``, and the summed pattern in key-lag layout ``[t, dt]``. The key rows are
  summed into :data:`~equivariance_probe.statistics.masks.KEY_BINS` bins (exact: the bins are sums
  of keys) and the pattern is moved to query-key layout ``[q, k]``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..statistics.masks import KEY_BINS, key_bins

__all__ = ["current_layout"]


def current_layout(config: dict[str, Any], arrays: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, arrays)`` of saved statistics in today's layout (unchanged when they are in it already)."""
    if "key_bins" in config:
        return config, arrays
    return _from_key_lag_layout(config, arrays)


def _from_key_lag_layout(config: dict[str, Any], arrays: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Saved sums of one key-lag row per key (and a ``[t, dt]`` pattern) in today's binned, query-key layout."""
    n_positions = int(config["n_positions"])
    bins, count = key_bins(n_positions, KEY_BINS)
    converted = dict(arrays)
    for name in ("key_lag_sum", "key_lag_count", "key_lag_prior_sum"):
        if name in arrays and tuple(arrays[name].shape) == (n_positions, n_positions):
            rows = arrays[name].to(torch.float64)
            converted[name] = torch.zeros((count, n_positions), dtype=torch.float64).index_add_(0, bins, rows)
    if "pattern_sum" in arrays and arrays["pattern_sum"].shape[-2:] == (n_positions, n_positions):
        key_lag = arrays["pattern_sum"].to(torch.float64)
        t = torch.arange(n_positions).view(-1, 1)
        dt = torch.arange(n_positions).view(1, -1)
        inside = (t + dt < n_positions).expand(n_positions, n_positions)
        query_key = torch.zeros_like(key_lag)
        query_key[..., (t + dt).expand_as(inside)[inside], t.expand_as(inside)[inside]] = key_lag[..., inside]
        converted["pattern_sum"] = query_key
    return {**config, "key_bins": count}, converted
