"""Each window's first-token weight ``α₁(w)`` per layer and head: what Gu et al.'s sink rate thresholds.

Place in the seams: *statistics*, owned by :class:`~equivariance_probe.statistics.AttentionStatistics`
beside its sums. Gu et al. ("When Attention Sink Emerges in Language Models: An Empirical View", ICLR
2025, and their released evaluation code) compare the first key's importance with ``ε`` window by window,

    ``α₁(w, l, h) = (1/T_w) · Σ_q a[l, h, q, 0]``,

over every real query ``q`` of window ``w`` (the first included; ``T_w`` its real tokens; a query whose
sliding window hides key 0 adds 0), and average the indicator ``α₁(w) > ε`` afterwards. A threshold of
the window-averaged weight cannot be rebuilt from sums over windows, so the run keeps the
``[windows, L, H]`` float64 array itself (``8·L·H`` bytes a window: 2.3 KiB for Gemma 3 270M), with each
window's interval-group key (:func:`~equivariance_probe.statistics.groups.group_of`), so that any ``ε``
and the jackknife over window groups can be chosen after the run.

Streaming follows the statistics' batches (:meth:`WindowSinks.begin`, :meth:`WindowSinks.stage` per layer,
:meth:`WindowSinks.commit` or :meth:`WindowSinks.abort`); two runs merge by concatenating their windows
(the statistics refuse windows both hold, by fingerprint, before they get here). Rows are kept sorted by
key (stably), so that a merge's rows do not depend on the order of its parts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import IncompatibleResultsError

__all__ = ["WindowSinks", "WINDOW_SINK_TENSORS"]

#: The tensors of :meth:`WindowSinks.tensors`: ``alpha`` (``[W, L, H]`` float64) and ``keys`` (``[W]`` uint64).
WINDOW_SINK_TENSORS = ("alpha", "keys")


class WindowSinks:
    """Per-window ``α₁`` of one :class:`~equivariance_probe.statistics.AttentionStatistics`.

    Args:
        n_layers: ``L``.
        n_heads: ``H``.

    Attributes:
        alpha: ``[W, L, H]`` float64, each window's mean weight on its first token.
        keys: ``[W]`` uint64, each window's interval-group key (its fingerprint, a key the caller gave, or
            its place in the stream).
    """

    def __init__(self, n_layers: int, n_heads: int) -> None:
        self.shape = (int(n_layers), int(n_heads))
        self.alpha = np.zeros((0, *self.shape), dtype=np.float64)
        self.keys = np.zeros(0, dtype=np.uint64)
        self._batch: tuple[np.ndarray, np.ndarray] | None = None
        self._pending: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.keys)

    # -- streaming --------------------------------------------------------------------------
    def begin(self, keys: np.ndarray, lengths: torch.Tensor) -> None:
        """Start a batch: ``keys: [B]`` uint64 (the windows' interval-group keys), ``lengths: [B]`` real tokens."""
        self.abort()
        self._batch = (np.asarray(keys, dtype=np.uint64).reshape(-1),
                       lengths.detach().to("cpu", torch.float64).numpy().reshape(-1))

    def stage(self, layer: int, first_key: torch.Tensor) -> None:
        """One layer's ``first_key: [B, H]``, ``Σ_q a[q, 0]`` of each window of the batch (kept until :meth:`commit`)."""
        if self._batch is not None:
            self._pending[layer] = first_key.detach()

    def commit(self) -> None:
        """Add the batch's windows: ``α₁ = Σ_q a[q, 0] / T_w`` (NaN for a window without tokens)."""
        batch, pending = self._batch, self._pending
        self.abort()
        if batch is None or not pending:
            return
        keys, lengths = batch
        device = next(iter(pending.values())).device
        totals = torch.stack([pending[layer].to(device, torch.float64) for layer in range(self.shape[0])], 1)
        totals = totals.cpu().numpy()  # [B, L, H]: one copy to the host per batch
        with np.errstate(invalid="ignore", divide="ignore"):
            alpha = np.where(lengths[:, None, None] > 0, totals / np.maximum(lengths, 1.0)[:, None, None], np.nan)
        self._extend(keys, alpha)

    def abort(self) -> None:
        """Forget the current batch."""
        self._batch = None
        self._pending = {}

    def _extend(self, keys: np.ndarray, alpha: np.ndarray) -> None:
        keys = np.concatenate([self.keys, keys])
        order = np.argsort(keys, kind="stable")
        self.keys, self.alpha = keys[order], np.concatenate([self.alpha, alpha])[order]

    # -- merging and files --------------------------------------------------------------------
    def merge(self, other: WindowSinks) -> WindowSinks:
        """The windows of both (the statistics' merge has refused repeated windows already)."""
        if self.shape != other.shape:
            raise IncompatibleResultsError(f"cannot merge per-window first-token weights of {self.shape} and "
                                           f"{other.shape} (layers, heads); merge results of one model")
        merged = self.copy()
        merged._extend(other.keys, other.alpha)
        return merged

    def copy(self) -> WindowSinks:
        copied = WindowSinks(*self.shape)
        copied.alpha, copied.keys = self.alpha.copy(), self.keys.copy()
        return copied

    def tensors(self) -> dict[str, np.ndarray]:
        """``alpha: [W, L, H]`` float64 and ``keys: [W]`` uint64, as a result file holds them."""
        return {"alpha": self.alpha, "keys": self.keys}

    def array_shapes(self, n_windows: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shape and safetensors dtype of each tensor of :meth:`tensors` for ``n_windows`` windows."""
        return {"alpha": ((n_windows, *self.shape), "F64"), "keys": ((n_windows,), "U64")}

    def load(self, tensors: dict[str, Any]) -> None:
        """Take the rows of :meth:`tensors`.

        Raises:
            IncompatibleResultsError: rows of another shape, or keys that do not match them.
        """
        alpha = np.asarray(tensors["alpha"], dtype=np.float64)
        keys = np.asarray(tensors["keys"], dtype=np.uint64).reshape(-1)
        if alpha.shape[1:] != self.shape or len(alpha) != len(keys):
            raise IncompatibleResultsError(f"per-window first-token weights of shape {alpha.shape} with {len(keys)} "
                                           f"keys, expected [windows, {self.shape[0]}, {self.shape[1]}] and one key each")
        order = np.argsort(keys, kind="stable")
        self.alpha, self.keys = alpha[order], keys[order]

    def nbytes(self) -> int:
        return int(self.alpha.nbytes + self.keys.nbytes)
