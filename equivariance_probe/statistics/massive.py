"""Massive activations: per layer, the largest residual-stream magnitudes against the median, and where they sit.

Place in the seams: *statistics*, torch-only mergeable sums. Sun et al. 2024 ("Massive Activations in
Large Language Models") find a few residual-stream coordinates, at fixed hidden dimensions and
mostly on the first token, whose magnitude is thousands of times the median; they report, per
layer, the three largest magnitudes ``|h|`` of a sequence's hidden states and the median magnitude,
averaged over sequences. :class:`MassiveActivationSums` keeps exactly that, streamed: for each window
``w`` and layer ``l`` (the layer's output ``h[w, l]``, ``[T, d]``):

* ``top_i(w, l)``, the ``i``-th largest ``|h|`` over positions and dimensions (``i = 1..k``);
* ``median(w, l)``, the median of the ``T·d`` magnitudes (the mean of the two middle ones when
  ``T·d`` is even, as numpy's);
* the position in the window and the hidden dimension of the largest;

and sums them over windows (float64; counts for the positions and dimensions), so that batches,
runs and shards merge by addition and memory does not grow with the windows. The reported numbers
are the means over windows, ``mean_w top_i`` and ``mean_w median``, and their ratio
``mean_w top_1 / mean_w median`` (:meth:`MassiveActivationSums.summary`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["MassiveActivationSums", "MASSIVE_TOP"]

#: How many of the largest magnitudes are kept per window and layer (Sun et al. plot the top 3).
MASSIVE_TOP = 3


@dataclass
class MassiveActivationSums:
    """Sums over windows of each layer's largest and median residual magnitudes (module docstring).

    Attributes:
        count: windows added.
        top: ``[layer, k]`` ``Σ_w top_i(w, l)``.
        median: ``[layer]`` ``Σ_w median(w, l)``.
        position: ``[layer, T]`` windows whose largest magnitude sits at each position.
        dimension: ``[layer, d]`` windows whose largest magnitude sits in each hidden dimension.
    """

    count: int
    top: torch.Tensor
    median: torch.Tensor
    position: torch.Tensor
    dimension: torch.Tensor

    @classmethod
    def empty(cls, n_layers: int, n_positions: int, dim: int, top: int = MASSIVE_TOP) -> MassiveActivationSums:
        return cls(0, torch.zeros(n_layers, top, dtype=torch.float64), torch.zeros(n_layers, dtype=torch.float64),
                   torch.zeros(n_layers, n_positions, dtype=torch.int64), torch.zeros(n_layers, dim, dtype=torch.int64))

    def add(self, layer: int, hidden: torch.Tensor) -> None:
        """Add one layer's output ``[batch, T, d]`` of a batch of windows (:meth:`add_windows` counts them)."""
        magnitude = hidden.detach().to("cpu", torch.float64).abs()
        batch, length, dim = magnitude.shape
        flat = magnitude.reshape(batch, length * dim)
        values, index = flat.topk(self.top.shape[1], dim=1)
        self.top[layer] += values.sum(0)
        self.median[layer] += torch.quantile(flat, 0.5, dim=1).sum()
        self.position[layer] += torch.bincount(index[:, 0] // dim, minlength=self.position.shape[1])
        self.dimension[layer] += torch.bincount(index[:, 0] % dim, minlength=self.dimension.shape[1])

    def add_windows(self, n: int) -> None:
        self.count += int(n)

    def merge(self, other: MassiveActivationSums) -> MassiveActivationSums:
        """The sums of both (windows of one run, or of two shards)."""
        return MassiveActivationSums(self.count + other.count, self.top + other.top, self.median + other.median,
                                     self.position + other.position, self.dimension + other.dimension)

    def summary(self) -> dict[str, Any]:
        """Per layer: ``top`` (``[layer][i]`` mean over windows of the ``i``-th largest ``|h|``), ``median``,
        ``ratio`` (``top_1 / median``), and where the largest sits: the ``position`` in the window and the
        hidden ``dimension`` where it sits in most windows, each with the share of windows
        (``position_share``, ``dimension_share``)."""
        count = max(self.count, 1)
        top = (self.top / count).numpy()
        median = (self.median / count).numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(median > 0, top[:, 0] / median, np.nan)
        position, dimension = self.position.numpy(), self.dimension.numpy()
        return {"n_windows": self.count, "top": top.tolist(), "median": median.tolist(), "ratio": ratio.tolist(),
                "position": position.argmax(1).tolist(), "position_share": (position.max(1) / count).tolist(),
                "dimension": dimension.argmax(1).tolist(), "dimension_share": (dimension.max(1) / count).tolist()}

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "top": self.top.tolist(), "median": self.median.tolist(),
                "position": self.position.tolist(), "dimension": self.dimension.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MassiveActivationSums:
        return cls(int(data["count"]), torch.as_tensor(np.asarray(data["top"], dtype=np.float64)),
                   torch.as_tensor(np.asarray(data["median"], dtype=np.float64)),
                   torch.as_tensor(np.asarray(data["position"], dtype=np.int64)),
                   torch.as_tensor(np.asarray(data["dimension"], dtype=np.int64)))
