"""Float64 sums of per-layer representations over documents: variance and correlation by position.

Place in the seams: *statistics*, beside the attention statistics: counts and sums that
merge by adding. :func:`~equivariance_probe.analyses.order.representation_sums` fills them
from a model's attention outputs and residual streams; the variance-shrinkage and
position-correlation analyses (docs/methods.md#order) read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import IncompatibleResultsError

__all__ = ["RepresentationSums", "variance_or_zero"]


@dataclass
class RepresentationSums:
    """Float64 sums over documents of per-layer representations; merge by adding.

    Attributes:
        count: number of documents.
        sum, sum_sq: ``[stream, layer, position, dim]`` ``Σ_doc x`` and ``Σ_doc x²``.
        within_dims: ``[stream, layer, position]`` ``Σ_doc Var_d(x[doc, q, :])``.
        cross: ``[layer, position, position]`` ``Σ_doc Σ_d x_i,d·x_j,d`` of the residual stream.
        streams: names of the streams (``("attention", "residual")``).
    """

    count: int
    sum: torch.Tensor
    sum_sq: torch.Tensor
    within_dims: torch.Tensor
    cross: torch.Tensor
    streams: tuple[str, ...] = ("attention", "residual")

    @classmethod
    def empty(cls, n_layers: int, n_positions: int, dim: int) -> RepresentationSums:
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64)  # noqa: E731
        return cls(0, zeros(2, n_layers, n_positions, dim), zeros(2, n_layers, n_positions, dim),
                   zeros(2, n_layers, n_positions), zeros(n_layers, n_positions, n_positions))

    def add(self, stream: int, layer: int, x: torch.Tensor) -> None:
        """Add ``x: [batch, position, dim]`` of one stream and layer (the batch's count is added by :meth:`add_documents`)."""
        x = x.detach().to(torch.float64).cpu()
        self.sum[stream, layer] += x.sum(0)
        self.sum_sq[stream, layer] += (x * x).sum(0)
        self.within_dims[stream, layer] += x.var(-1, unbiased=False).sum(0)
        if self.streams[stream] == "residual":
            self.cross[layer] += torch.einsum("bid,bjd->ij", x, x)

    def add_documents(self, n: int) -> None:
        self.count += n

    def merge(self, other: RepresentationSums) -> RepresentationSums:
        """The sums of both (exact: float64 addition); both must hold the same layers, positions and width."""
        if self.sum.shape != other.sum.shape or self.cross.shape != other.cross.shape or self.streams != other.streams:
            raise IncompatibleResultsError(
                f"cannot merge representation sums of shapes {tuple(self.sum.shape)} and {tuple(other.sum.shape)}; "
                "sum the same model's layers over windows of the same length"
            )
        return RepresentationSums(self.count + other.count, self.sum + other.sum, self.sum_sq + other.sum_sq,
                                  self.within_dims + other.within_dims, self.cross + other.cross, self.streams)

    __add__ = merge

    def variance_across_documents(self) -> np.ndarray:
        """``[stream, layer, position]`` ``mean_d Var_doc(x[:, q, d])``."""
        mean = self.sum / self.count
        return variance_or_zero(self.sum_sq / self.count, mean * mean).mean(-1).numpy()

    def variance_across_dimensions(self) -> np.ndarray:
        """``[stream, layer, position]`` ``mean_doc Var_d(x[doc, q, :])``."""
        return (self.within_dims / self.count).numpy()


#: A variance below this fraction of the second moment is float64 cancellation, not spread:
#: a position that holds the same token in every document (a BOS) has variance exactly 0.
_CANCELLATION = 1e-9


def variance_or_zero(second_moment: torch.Tensor, squared_mean: torch.Tensor) -> torch.Tensor:
    """``E[x²] - E[x]²``, exactly 0 where it is within float64 cancellation of 0."""
    variance = second_moment - squared_mean
    return torch.where(variance > _CANCELLATION * second_moment.abs(), variance, torch.zeros((), dtype=variance.dtype))
