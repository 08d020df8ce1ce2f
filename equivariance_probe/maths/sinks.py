"""Attention sinks: the first token's mean weight per head and the share of heads above a threshold.

Place in the seams: *maths*, pure functions of numpy arrays. From Gu et al., "When Attention Sink
Emerges in Language Models: An Empirical View" (ICLR 2025), section 3: per layer ``l`` and head
``h``, ``α₁(l, h)`` is the mean over a window's queries of the attention weight on the window's
first token, and the sink rate ``Sink^ε₁`` is the share of heads with ``α₁ > ε`` (they take
``ε = 0.3``, 64-token windows and 100 sequences).

Pooled over windows (docs/methods.md#attention-sinks): with ``first_key_sum[l, h] = Σ_windows Σ_q
a[l, h, q, 0]`` over the real queries of every window and ``N = Σ_windows (real queries)``,

    ``α₁(l, h) = first_key_sum[l, h] / N``.

With windows of one length ``T`` this is Gu et al.'s mean over sequences of the per-window means
(every window has ``T`` queries); with ragged windows each query weighs the same. Under a sliding
window ``w`` a query at ``q >= w`` cannot see the first token and adds 0 (it counts in ``N``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import check_choice

__all__ = ["SINK_EPSILON", "SINK_BY", "first_token_weight", "split_heads", "sink_rate"]

#: Gu et al.'s threshold: a head is a sink head when ``α₁ > 0.3``.
SINK_EPSILON = 0.3

#: How the first token's weight and the sink rate are split: every head, per layer (the mean over its
#: heads, or its share of sink heads), or one number over all heads.
SINK_BY = ("head", "layer", None)


def first_token_weight(first_key_sum: np.ndarray, real_queries: Any) -> np.ndarray:
    """``α₁ = first_key_sum / N``: ``first_key_sum: [..., L, H]`` summed over queries and windows, ``real_queries``
    ``N`` (a number, or ``[...]`` one per replicate); NaN where ``N = 0``."""
    total = np.asarray(first_key_sum, dtype=np.float64)
    count = np.asarray(real_queries, dtype=np.float64).reshape(np.shape(real_queries) + (1, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.where(count > 0, count, 1.0), np.nan)


def split_heads(alpha: np.ndarray, by: str | None) -> Any:
    """``α₁: [..., L, H]`` as asked: every head (``"head"``), the mean over each layer's heads (``"layer"``,
    ``[..., L]``) or over every head (``None``, ``[...]``)."""
    check_choice("by", by, SINK_BY)
    if by == "head":
        return alpha
    if by == "layer":
        return alpha.mean(-1)
    value = alpha.reshape(*alpha.shape[:-2], -1).mean(-1)
    return float(value) if np.ndim(value) == 0 else value


def sink_rate(alpha: np.ndarray, epsilon: float = SINK_EPSILON, by: str | None = None) -> Any:
    """``Sink^ε₁``: the share of heads with ``α₁ > ε``, from ``α₁: [..., L, H]``; per layer (``"layer"``,
    ``[..., L]``) or over every head (``None``). A share in ``[0, 1]`` (Gu et al. print it in percent)."""
    check_choice("by", by, ("layer", None))
    return split_heads((np.asarray(alpha) > epsilon).astype(np.float64), by)
