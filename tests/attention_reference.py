"""Brute-force references: a full float64 softmax ``[B, H, T, T]`` and explicit masks.

Deliberately naive (explicit loops over lags and entries, full masks) so that they
share no code and no trick with the engine they check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from synthetic import causal_mask


def visible(n_positions: int, window: int | None, lengths: torch.Tensor, excluded_keys: Sequence[int]) -> torch.Tensor:
    """``[B, T, T]`` bool: entries the statistics read."""
    mask = causal_mask(n_positions, window).unsqueeze(0).repeat(len(lengths), 1, 1)
    for b, length in enumerate(lengths.tolist()):
        mask[b, length:, :] = False
    for key in excluded_keys:
        if 0 <= key < n_positions:
            mask[:, :, key] = False
    return mask


def float64_log_pattern(query, key, scaling=None, softcap=None, window=None) -> torch.Tensor:
    """``log a`` in float64 from the given (upcast) queries and keys: ``[B, H, T, T]``, -inf hidden."""
    q, k = query.double(), key.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~causal_mask(q.shape[2], window), float("-inf"))
    return scores - torch.logsumexp(scores, -1, keepdim=True)


def sums_from_log_pattern(log_pattern, *, window, lengths, excluded_keys, log_floor, key_bin, n_key_bins, from_weights=False):
    """Every sum, by brute force, from a float64 ``log a`` (or from weights ``a`` when ``from_weights``)."""
    if from_weights:
        weights = log_pattern.double()
        log_a = torch.log(weights)
    else:
        log_a = log_pattern.double()
        weights = torch.exp(log_a)
    batch, heads, n, _ = weights.shape
    vis = visible(n, window, lengths, excluded_keys).unsqueeze(1)
    zero = torch.zeros((), dtype=torch.float64)
    a = torch.where(vis, weights, zero)
    log_eps = math.log(log_floor)
    y = torch.where(vis, log_a.clamp_min(log_eps), zero)
    out = {
        "raw_sum": a.sum(-1),
        "raw_sq": (a * a).sum(-1),
        "log_sum": y.sum(-1),
        "log_sq": (y * y).sum(-1),
        "floored": (vis & (log_a < log_eps)).sum((-2, -1)).double(),
        "pattern_sum": a.sum(0),
    }
    lag = torch.zeros(batch, heads, n, dtype=torch.float64)
    for dt in range(n):
        lag[..., dt] = torch.diagonal(a, offset=-dt, dim1=-2, dim2=-1).sum(-1)
    out["lag_sum"] = lag
    key_lag = torch.zeros(n_key_bins, n, dtype=torch.float64)
    summed = a.sum((0, 1))
    for q in range(n):
        for k in range(q + 1):
            key_lag[key_bin[k], q - k] += summed[q, k]
    out["key_lag_sum"] = key_lag
    # For the float32 floored counts: entries whose log weight is within 1e-4 of log eps.
    out["near_floor"] = (vis & ((log_a - log_eps).abs() < 1e-4)).sum((-2, -1)).double()
    return out


def reference_mask_counts(lengths, n_positions, *, window, excluded_keys, key_bin, n_key_bins):
    """The mask-only sums by explicit loops over a full ``[B, T, T]`` mask."""
    n = n_positions
    vis = visible(n, window, lengths, excluded_keys)
    prior = [1.0 / (min(q + 1, window) if window is not None else q + 1) for q in range(n)]
    out = {
        "query_count": vis.sum((0, 2)).double(),
        "doc_lag_count": torch.zeros(len(lengths), n, dtype=torch.float64),
        "lag_count": torch.zeros(n, dtype=torch.float64),
        "lag_prior_sum": torch.zeros(n, dtype=torch.float64),
        "key_lag_count": torch.zeros(n_key_bins, n, dtype=torch.float64),
        "key_lag_prior_sum": torch.zeros(n_key_bins, n, dtype=torch.float64),
        "windows_covering": torch.tensor([float(sum(int(L) > q for L in lengths)) for q in range(n)], dtype=torch.float64),
    }
    for b in range(len(lengths)):
        for q in range(n):
            for k in range(n):
                if vis[b, q, k]:
                    dt = q - k
                    out["doc_lag_count"][b, dt] += 1
                    out["lag_count"][dt] += 1
                    out["lag_prior_sum"][dt] += prior[q]
                    out["key_lag_count"][key_bin[k], dt] += 1
                    out["key_lag_prior_sum"][key_bin[k], dt] += prior[q]
    return out
