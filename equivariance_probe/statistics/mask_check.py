"""The first batch's check that the model attends only where the adapter says it can, and the refusals.

Place in the seams: *statistics*. Every statistic reads attention under the mask an adapter
reports (causal, a sliding window, or bidirectional). If the model's real mask is wider (a
sliding window the adapter did not know of), attention mass falls outside it and every
statistic would silently miss it; so on the first batch captured weights are checked here
(:func:`outside_mass`), and a batch reduced inside a remote trace brings the same measure home.
"""

from __future__ import annotations

import torch

from ..errors import AttentionCaptureError, NonFiniteAttentionError
from .engines.in_trace import visible_mask

__all__ = ["MASK_LEAK_TOLERANCE", "outside_mass", "refuse_mask", "refuse_nonfinite"]

#: Largest attention mass per query tolerated outside the mask an adapter reported (first batch):
#: more means the adapter does not know the model's real mask.
MASK_LEAK_TOLERANCE = 1e-3


def outside_mass(pattern: torch.Tensor, lengths: torch.Tensor, window: int | None, causal: bool) -> float:
    """Largest attention mass a real query of ``pattern: [B, H, T, T]`` puts outside the model's mask."""
    width = pattern.shape[-1]
    if causal:
        model_mask = visible_mask(width, window, lengths)
    else:
        position = torch.arange(width, device=lengths.device)
        real = position.view(1, -1) < lengths.view(-1, 1)  # [B, T]
        model_mask = real.unsqueeze(-1) & real.unsqueeze(-2)
    real_rows = model_mask.any(-1, keepdim=True).unsqueeze(1)
    zero = torch.zeros((), dtype=pattern.dtype, device=pattern.device)
    outside = torch.where(real_rows & ~model_mask.unsqueeze(1), pattern.abs(), zero)
    return float(outside.sum(-1).max()) if outside.numel() else 0.0


def refuse_mask(layer: int, leaked: float, window: int | None, causal: bool) -> None:
    """Raise :class:`~equivariance_probe.errors.AttentionCaptureError`: ``layer`` put ``leaked`` mass outside its mask."""
    mask = "bidirectional" if not causal else "full causal" if window is None else f"sliding window {window}"
    raise AttentionCaptureError(
        f"layer {layer} puts attention mass up to {leaked:.3g} per query on keys outside the mask the "
        f"adapter reported ({mask}); the "
        "statistics would miss it. The model's mask is not one this adapter understands: report the "
        "architecture, or pass an adapter with the right sliding windows"
    )


def refuse_nonfinite(layer: int) -> None:
    """Raise :class:`~equivariance_probe.errors.NonFiniteAttentionError` for ``layer``."""
    raise NonFiniteAttentionError(
        f"layer {layer} produced NaN or infinite attention weights on visible entries; "
        "check the model's weights for NaN/inf (e.g. a failed load or an fp16 overflow) "
        "and run it in float32 or bfloat16. Statistics gathered before this batch are kept."
    )
