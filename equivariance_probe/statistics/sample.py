"""A bounded, mergeable uniform sample of attention entries (for scatter plots).

Place in the seams: *statistics*; it streams and merges like the sums beside it.

The study's Figure 1d plots attention against the uniform prior for individual entries;
there are billions, so we keep a uniform sample of at most ``size`` of them. It is a
*bottom-k* sample: every visible entry gets an independent uniform key and the ``size``
entries with the smallest keys are kept. Bottom-k samples merge exactly (the union's
``size`` smallest keys), so shards and batches combine like the sums do.

Drawing a key for every entry would cost as much as the statistics themselves. Instead,
for a batch of ``N`` entries and the current threshold ``τ`` (the largest kept key, or 1
while the sample is not full), the number of entries with a key below ``τ`` is drawn as
``c ~ Binomial(N, τ)``; only the ``m = min(c, size)`` smallest of those ``c`` keys can
enter, and they are generated directly as order statistics
(``τ · S_i / (S_m + G)``, ``S_i`` partial sums of unit exponentials and
``G ~ Gamma(c + 1 - m)``) and given to ``m`` distinct entries chosen uniformly. The
result has exactly the distribution of bottom-k sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InputError

__all__ = ["EntrySample"]

#: Sampled rows whose scores are formed in one matrix product (bounds the memory of a draw at long contexts).
_ROWS_PER_PRODUCT = 256

#: Columns of the sample, one value per kept entry.
COLUMNS = ("key", "attention", "prior", "layer", "head", "query", "key_position")


class EntrySample:
    """Uniform sample of at most ``size`` visible entries ``(window, layer, head, q, k)``.

    Args:
        size: the most entries kept.
        seed: seed of the sampling generator (``None``: fresh entropy). Shards to be merged
            must use different seeds (or ``None``), or their keys are not independent.
    """

    def __init__(self, size: int = 20000, seed: int | None = None) -> None:
        if size < 1:
            raise InputError(f"sample_size must be a positive number of entries, got {size}")
        self.size = int(size)
        self.rng = np.random.default_rng(seed)
        self.columns: dict[str, np.ndarray] = {c: np.zeros(0) for c in COLUMNS}

    def __len__(self) -> int:
        return len(self.columns["key"])

    @property
    def threshold(self) -> float:
        """Keys at or above this cannot enter the sample."""
        return float(self.columns["key"].max()) if len(self) >= self.size else 1.0

    def update(
        self,
        layer: int,
        pattern: torch.Tensor,
        lengths: torch.Tensor,
        *,
        window: int | None = None,
        excluded_keys: Sequence[int] = (),
        causal: bool = True,
    ) -> None:
        """Offer every visible entry of one layer of a batch, from captured weights.

        Args:
            layer: the layer index.
            pattern: ``[batch, head, query, key]``.
            lengths: ``[batch]`` real tokens per window.
            window: the layer's sliding window, or ``None``.
            excluded_keys: key positions left out of the statistics.
            causal: ``False`` for a bidirectional encoder (every real key of the window visible).
        """
        drawn = self._draw(pattern.shape[1], pattern.shape[-1], lengths, window, excluded_keys, causal)
        if drawn is None:
            return
        batch, head, query, key = (index.to(pattern.device) for index in drawn)
        self._add(layer, drawn, pattern[batch, head, query, key], self._visible_keys(drawn, lengths, window, excluded_keys, causal))

    def update_from_scores(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        lengths: torch.Tensor,
        *,
        scaling: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
        excluded_keys: Sequence[int] = (),
        causal: bool = True,
    ) -> None:
        """Offer every visible entry of one layer of a batch, recomputing only the sampled ones.

        ``a[q, k] = exp(s[q, k] - logsumexp_k' s[q, k'])`` with the scores ``s = softcap(q·kᵀ·scaling)``
        of the sampled rows only (the row's keys under the causal mask and the window), so the
        sample costs ``O(rows drawn · T)``, not a pattern.

        Args:
            layer: the layer index.
            query: ``[batch, head, query, head_dim]``; key: ``[batch, kv_head, key, head_dim]``.
            lengths, window, excluded_keys, causal: as in :meth:`update`.
            scaling, softcap: the layer's score scale and soft-capping.
        """
        heads, width = query.shape[1], query.shape[2]
        drawn = self._draw(heads, width, lengths, window, excluded_keys, causal)
        if drawn is None:
            return
        batch, head, row, column = (index.to(query.device) for index in drawn)
        group = heads // key.shape[1]
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        kv_heads = key.shape[1]

        # Each sampled row's log-sum-exp over the keys its mask shows, one matrix product per
        # (window, key head) and chunk of rows: memory is a chunk of rows × T, whatever T.
        rows = torch.unique(torch.stack([batch, head, row]), dim=1)  # [3, R], sorted lexicographically
        row_lse = torch.empty(rows.shape[1], dtype=dtype, device=query.device)
        positions = torch.arange(width, device=query.device).view(1, -1)
        pair_of_row = rows[0] * kv_heads + rows[1] // group
        for pair in torch.unique(pair_of_row).tolist():
            b, kv = divmod(int(pair), kv_heads)
            selected = (pair_of_row == pair).nonzero().view(-1)
            for chunk in selected.split(_ROWS_PER_PRODUCT):
                scores = query[b, rows[1, chunk], rows[2, chunk]].to(dtype) @ key[b, kv].to(dtype).T * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                if causal:
                    allowed = positions <= rows[2, chunk].view(-1, 1)
                    if window is not None:
                        allowed &= rows[2, chunk].view(-1, 1) - positions < window
                else:  # the window's real keys, as the model's padding mask leaves them
                    allowed = positions < int(lengths[b])
                row_lse[chunk] = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
        flat_rows = (rows[0] * heads + rows[1]) * width + rows[2]
        which = torch.searchsorted(flat_rows, (batch * heads + head) * width + row)
        sampled = (query[batch, head, row].to(dtype) * key[batch, head // group, column].to(dtype)).sum(-1) * scale
        if softcap is not None:
            sampled = torch.tanh(sampled / softcap) * softcap
        self._add(layer, drawn, (sampled - row_lse[which]).exp(),
                  self._visible_keys(drawn, lengths, window, excluded_keys, causal))

    def _draw(
        self, heads: int, width: int, lengths: torch.Tensor, window: int | None, excluded_keys: Sequence[int],
        causal: bool = True,
    ) -> tuple[torch.Tensor, ...] | None:
        """Which entries enter the sample from one layer of a batch: ``(batch, head, query, key)`` long tensors.

        The visible entries are numbered in ``(window, query, key)`` order without building the
        mask (each row ``q < length`` of a window holds the keys ``max(0, q - w + 1) .. q`` that
        are not excluded; under a bidirectional mask, the keys ``0 .. length - 1``), and ``m`` of
        the ``heads × n_visible`` entries are drawn as in the module docstring.
        """
        lengths = lengths.detach().to("cpu", torch.long)
        if window is not None and window >= width:
            window = None
        excluded = sorted({int(k) for k in excluded_keys if 0 <= int(k) < width})
        query = torch.arange(width)
        first = torch.zeros_like(query) if window is None or not causal else (query - window + 1).clamp_min(0)
        if causal:
            last = query.view(1, -1).expand(len(lengths), -1)  # [B, T]: the row's last visible key
        else:
            last = (lengths.view(-1, 1) - 1).expand(-1, width)
        per_row = last - first.view(1, -1) + 1
        for key in excluded:
            per_row = per_row - ((first.view(1, -1) <= key) & (key <= last)).long()
        row_count = torch.where(query.view(1, -1) < lengths.view(-1, 1), per_row, 0).reshape(-1)
        ends = row_count.cumsum(0)
        n_visible = int(ends[-1]) if len(ends) else 0
        total = heads * n_visible
        if total == 0:
            return None
        tau = self.threshold
        below = int(self.rng.binomial(total, tau))
        m = min(below, self.size)
        if m == 0:
            return None
        spacings = np.cumsum(self.rng.standard_exponential(m))
        self._keys = tau * spacings / (spacings[-1] + self.rng.gamma(below + 1 - m))
        chosen = torch.from_numpy(self.rng.choice(total, size=m, replace=False))
        head = chosen // n_visible
        entry = chosen % n_visible
        flat_row = torch.searchsorted(ends, entry, right=True)
        rank = entry - (ends[flat_row] - row_count[flat_row])
        batch, row = flat_row // width, flat_row % width
        column = first[row] + rank
        for key in excluded:  # the rank-th key that is not excluded, counting from the row's first key
            column += ((first[row] <= key) & (key <= column)).long()
        return batch, head, row, column

    @staticmethod
    def _visible_keys(
        drawn: tuple[torch.Tensor, ...], lengths: torch.Tensor, window: int | None, excluded_keys: Sequence[int],
        causal: bool,
    ) -> torch.Tensor:
        """``|V(q)|`` of each drawn entry's row under the model's mask (the prior is its inverse):
        ``min(q + 1, w)`` causal; the window's real keys bidirectional, where excluded keys stay
        in the model's softmax and so in ``|V|`` as they do for the causal prior."""
        batch, _, row, _ = (index.cpu() for index in drawn)
        if causal:
            return (row + 1).double() if window is None else (row + 1).clamp(max=window).double()
        return lengths.detach().to("cpu", torch.long)[batch].double()

    def _add(self, layer: int, drawn: tuple[torch.Tensor, ...], attention: torch.Tensor, visible_keys: torch.Tensor) -> None:
        batch, head, row, column = (index.cpu() for index in drawn)
        new = {
            "key": self._keys,
            "attention": attention.double().cpu().numpy(),
            "prior": (1.0 / visible_keys).numpy(),
            "layer": np.full(len(row), float(layer)),
            "head": head.double().numpy(),
            "query": row.double().numpy(),
            "key_position": column.double().numpy(),
        }
        self._keep_smallest(new)

    def _keep_smallest(self, new: dict[str, np.ndarray]) -> None:
        joined = {c: np.concatenate([self.columns[c], new[c]]) for c in COLUMNS}
        if len(joined["key"]) > self.size:
            order = np.argpartition(joined["key"], self.size - 1)[: self.size]
            joined = {c: v[order] for c, v in joined.items()}
        self.columns = joined

    def merge(self, other: EntrySample) -> EntrySample:
        """The bottom-k sample of the union (exact)."""
        merged = EntrySample(max(self.size, other.size))
        merged.columns = {c: v.copy() for c, v in self.columns.items()}
        merged._keep_smallest(other.columns)
        return merged

    __add__ = merge

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {c: v.copy() for c, v in self.columns.items()}

    @classmethod
    def from_arrays(cls, size: int, arrays: dict[str, Any]) -> EntrySample:
        sample = cls(size)
        sample.columns = {c: np.asarray(arrays[c], dtype=np.float64) for c in COLUMNS}
        return sample
