"""Attention sinks: the first token's mean weight per head and the share of heads above a threshold.

Place in the seams: *maths*, pure functions of numpy arrays. From Gu et al., "When Attention Sink
Emerges in Language Models: An Empirical View" (ICLR 2025), section 3, as their released evaluation
code computes it: per window ``w``, layer ``l`` and head ``h``, ``α₁(w, l, h) = (1/T_w)·Σ_q a[l, h, q, 0]``
is the mean over the window's queries (the first included) of the attention weight on the window's
first token, and the sink rate ``Sink^ε₁`` is the mean over *(window, layer, head)* of the indicator
``α₁(w, l, h) > ε`` (:func:`window_sink_rate`; they take ``ε = 0.3``, 64-token windows and 100 sequences).

Pooled over windows (docs/methods.md#attention-sinks): with ``first_key_sum[l, h] = Σ_windows Σ_q
a[l, h, q, 0]`` over the real queries of every window and ``N = Σ_windows (real queries)``,

    ``α₁(l, h) = first_key_sum[l, h] / N``.

With windows of one length ``T`` this is the mean over windows of ``α₁(w, l, h)`` (every window has ``T``
queries); with ragged windows each query weighs the same. Under a sliding window ``w`` a query at
``q >= w`` cannot see the first token and adds 0 (it counts in ``N``). Thresholding this pooled weight
once per head (:func:`sink_rate`, the *pooled sink rate*) is another statistic: it differs from Gu et al.'s
wherever a head's per-window ``α₁`` straddles ``ε``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import check_choice, check_fraction

__all__ = ["SINK_EPSILON", "SINK_BY", "first_token_weight", "split_heads", "sink_rate", "window_sink_rate",
           "window_sink_replicates", "check_epsilon"]

#: Gu et al.'s threshold: a head is a sink head in a window when its ``α₁ > 0.3`` there.
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


def check_epsilon(epsilon: Any) -> float:
    """``epsilon`` as a float in ``[0, 1)`` (an attention weight threshold), or :class:`InputError` naming it."""
    return check_fraction("epsilon", epsilon, meaning=f"a weight threshold (Gu et al.: {SINK_EPSILON})",
                          example=SINK_EPSILON)


def window_sink_rate(alpha: np.ndarray, epsilon: float = SINK_EPSILON, by: str | None = None) -> Any:
    """Gu et al.'s ``Sink^ε₁``: the mean of the indicator ``α₁(w, l, h) > ε`` over windows and heads.

    ``rate = (1/(W·L·H))·Σ_w Σ_l Σ_h 1[α₁(w, l, h) > ε]`` from ``alpha: [W, L, H]`` (each window's
    first-token weight); ``by="head"`` keeps ``[L, H]`` (the share of windows in which each head is a sink),
    ``"layer"`` ``[L]``, ``None`` one number. A share in ``[0, 1]`` (Gu et al. print it in percent).

    Example:
        >>> window_sink_rate(np.array([[[0.2]], [[0.5]]]), 0.3)  # one head, α₁ 0.2 then 0.5
        0.5
    """
    check_choice("by", by, SINK_BY)
    return split_heads((np.asarray(alpha) > epsilon).astype(np.float64).mean(0), by)


def window_sink_replicates(alpha: np.ndarray, window_groups: np.ndarray, groups: np.ndarray, epsilon: float,
                           by: str | None) -> np.ndarray:
    """The delete-a-group jackknife's replicates of :func:`window_sink_rate`: per group ``g`` of ``groups``
    (``[G']``), the rate over the windows whose group (``window_groups: [W]``) is not ``g``; ``[G', ...]``."""
    indicator = (np.asarray(alpha) > epsilon).astype(np.float64)  # [W, L, H]
    per_group = np.zeros((len(groups), *indicator.shape[1:]))
    slot = np.searchsorted(groups, window_groups)
    np.add.at(per_group, slot, indicator)
    counts = np.bincount(slot, minlength=len(groups)).astype(np.float64)
    rest = (per_group.sum(0, keepdims=True) - per_group) / (counts.sum() - counts).reshape(-1, 1, 1)
    return np.asarray(split_heads(rest, by))
