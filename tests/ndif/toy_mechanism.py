"""A toy mechanism for the shift test, importable on the test NDIF server (this folder is on its PYTHONPATH)."""

import torch


def mean_norm(rows: torch.Tensor) -> torch.Tensor:
    """The mean Euclidean norm over a window's segment rows ``[m, d]``: one number per window."""
    return rows.to(torch.float64).norm(dim=-1).mean()
