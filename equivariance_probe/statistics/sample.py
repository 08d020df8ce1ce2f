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

from typing import Any

import numpy as np
import torch

from ..errors import InputError

__all__ = ["EntrySample"]

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

    def update(self, layer: int, pattern: torch.Tensor, visible: torch.Tensor, visible_keys: torch.Tensor) -> None:
        """Offer every visible entry of one layer of a batch.

        Args:
            layer: the layer index.
            pattern: ``[batch, head, query, key]``.
            visible: ``[batch, query, key]`` bool.
            visible_keys: ``|V(q)|`` for this layer, ``[query]``.
        """
        heads = pattern.shape[1]
        entries = visible.nonzero()  # [n_visible, 3]: batch, query, key
        n_visible = entries.shape[0]
        total = heads * n_visible
        if total == 0:
            return
        tau = self.threshold
        below = int(self.rng.binomial(total, tau))
        m = min(below, self.size)
        if m == 0:
            return
        spacings = np.cumsum(self.rng.standard_exponential(m))
        keys = tau * spacings / (spacings[-1] + self.rng.gamma(below + 1 - m))
        chosen = torch.from_numpy(self.rng.choice(total, size=m, replace=False))
        head = chosen // n_visible
        where = entries[chosen % n_visible].cpu()
        query, key = where[:, 1], where[:, 2]
        attention = pattern[where[:, 0].to(pattern.device), head.to(pattern.device), query.to(pattern.device), key.to(pattern.device)]
        new = {
            "key": keys,
            "attention": attention.double().cpu().numpy(),
            "prior": (1.0 / visible_keys.double().cpu()[query]).numpy(),
            "layer": np.full(m, float(layer)),
            "head": head.double().numpy(),
            "query": query.double().numpy(),
            "key_position": key.double().numpy(),
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
