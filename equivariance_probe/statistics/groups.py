"""Per-group sums for intervals over windows: the state of a delete-a-group jackknife.

Place in the seams: *statistics*, owned by :class:`~equivariance_probe.statistics.AttentionStatistics`.
The sampling unit is the window (a document, or a region of one). Each window belongs to one of
``G`` groups, chosen from a 64-bit key by a fixed hash (:func:`group_of`): by default the window's
fingerprint (:func:`~equivariance_probe.records.provenance.window_fingerprints`), so that shards,
resumed runs and merges put every window in the same group; or a key the caller gives, so that
runs over different windowings of one text (a context-length scan) share groups by text region.

Per group, float64 sums that merge by adding, only those the headline numbers need recomputed
on "every window but group ``g``" (the jackknife's replicates, :meth:`WindowGroups.replicates`):

====================  ==================  ===========================================================
name                  shape (after G)     meaning
====================  ==================  ===========================================================
``log_sum``           ``[L, H, T]``       ``Σ_k log max(a, eps)`` per query position, as the total's
``raw_sum``           ``[L, H, T]``       ``Σ_k a`` per query position
``log_sq``            ``[L, H]``          ``Σ (log max(a, eps))²`` over every visible entry of the head
``raw_sq``            ``[L, H]``          ``Σ a²`` over every visible entry of the head
``lag_sum``           ``[L, N]``          ``Σ a[t+dt, t]`` summed over heads, by lag (``N`` lags, as the
                                          total's ``lag_sum``)
``doc_toeplitz_sum``  ``[L, H]``          ``Σ`` over the group's windows of the per-window Toeplitz R²
``doc_toeplitz_count`` ``[L, H]``         windows behind it
``first_key_sum``     ``[L, H]``          ``Σ_q a[q, 0]``, the weight on the first token (attention
                                          sinks; only where the statistics keep ``first_key_sum``)
``lengths``           ``[T + 1]``         windows of each length ``0..T``
====================  ==================  ===========================================================

Every sum that depends on the mask alone (entry counts, the uniform prior's curves) follows from
``lengths`` in closed form (:func:`~equivariance_probe.statistics.masks.mask_counts`), so a
group costs ``8·(2·L·H·T + 5·L·H + L·N + T + 1)`` bytes (``4·L·H`` without the first token's sums)
whatever its number of windows. Only
occupied groups are kept (rows sorted by group id), so state and files grow with
``min(windows, G)``, never with the number of documents beyond that.

The sums of one window equal, to float64 rounding, those the totals add for it; a group's rows are
bitwise the same wherever the same windows were added in the same order (a resumed run, shards of
one batch each merged in order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import IncompatibleResultsError, InputError, option
from .masks import mask_counts, pinned
from .sums import group_sums

__all__ = ["WindowGroups", "GROUP_SUMS", "DEFAULT_INTERVAL_GROUPS", "group_of", "KEY_KINDS"]

#: Groups of the jackknife unless asked otherwise: 20 delete-a-group replicates, enough for a
#: t interval with 19 degrees of freedom, cheap enough to keep per group.
DEFAULT_INTERVAL_GROUPS = 20

#: Every per-group sum and its shape after the group axis (``N``: lags, as the total's ``lag_sum``): the table's
#: sums kept per group (:func:`~equivariance_probe.statistics.sums.group_sums`), and the groups' own histogram of
#: window lengths.
GROUP_SUMS: dict[str, str] = {**{name: entry.group for name, entry in group_sums().items()}, "lengths": "T+1"}

#: Group sums kept only where the statistics keep the total they split (files written before them load without).
OPTIONAL_GROUP_SUMS = tuple(name for name, entry in group_sums().items() if entry.kept_if is not None)

#: Where the windows' keys came from: their fingerprints, keys the caller gave, their order in the
#: stream (windows added without either: groups valid, but not the same in another batching), or
#: more than one of these (merged results).
KEY_KINDS = ("window_fingerprint", "explicit", "ordinal", "mixed")


def group_of(keys: Any, n_groups: int) -> np.ndarray:
    """The group of each 64-bit key: ``splitmix64(key) mod G`` (``[n]`` int64).

    The finaliser of splitmix64 (Steele, Lea & Flood 2014) spreads any keys (fingerprints,
    document indices, character offsets that are all multiples of 1024) evenly over the groups.
    """
    z = np.asarray(keys, dtype=np.uint64).reshape(-1)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(n_groups)).astype(np.int64)


def as_keys(keys: Any, what: str = "resampling_keys") -> np.ndarray:
    """Integer keys as ``uint64`` (negative ones by their two's complement)."""
    array = np.asarray(keys)
    if array.dtype == object or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise InputError(f"{what} must be integers (one 64-bit key per window), got {array.dtype} values")
    if array.dtype.kind == "i":
        return array.astype(np.int64).reshape(-1).view(np.uint64)
    return array.astype(np.uint64).reshape(-1)


def _combined_kind(a: str | None, b: str | None) -> str | None:
    if a is None or a == b:
        return b if a is None else a
    return a if b is None else "mixed"


class WindowGroups:
    """Per-group float64 sums of one :class:`~equivariance_probe.statistics.AttentionStatistics`.

    Args:
        n_groups: ``G`` (at least 2).
        n_layers: ``L``.
        n_heads: ``H``.
        n_positions: ``T``.
        n_lags: ``N``, lags of the total's ``lag_sum``.
        device: where the sums live while streaming.
        first_key: keep ``first_key_sum`` (statistics with ``keep_first_key``).

    Streaming follows the statistics' batches: :meth:`begin` with the batch's keys and lengths,
    :meth:`stage` per layer with that layer's per-window sums, :meth:`commit` once every layer is
    in (or :meth:`abort`). :meth:`disable` drops the state for good, with the reason (a remote run
    whose replies sum over windows of several groups).
    """

    def __init__(self, n_groups: int, *, n_layers: int, n_heads: int, n_positions: int, n_lags: int,
                 device: torch.device | str = "cpu", first_key: bool = False) -> None:
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 2:
            raise InputError(f"interval_groups={n_groups!r}: a jackknife needs at least 2 groups of windows; pass "
                             f"{option('interval_groups', DEFAULT_INTERVAL_GROUPS)} (the default), or "
                             f"{option('interval_groups', 0)} for no intervals")
        self.n_groups = n_groups
        self.device = torch.device(device)
        sizes = {"L": n_layers, "H": n_heads, "T": n_positions, "N": n_lags, "T+1": n_positions + 1}
        kept = {name: spec for name, spec in GROUP_SUMS.items() if first_key or name not in OPTIONAL_GROUP_SUMS}
        self.shapes = {name: tuple(sizes[s] for s in spec.split()) for name, spec in kept.items()}
        #: Sorted ids of the occupied groups, one per row of :attr:`rows`.
        self.ids = np.zeros(0, dtype=np.int64)
        self.rows: dict[str, torch.Tensor] = self._empty(0)
        #: One of :data:`KEY_KINDS` (``None`` before any window).
        self.keys: str | None = None
        #: Why there are no group sums, when :meth:`disable` was called.
        self.unavailable: str | None = None
        self._batch: dict[str, Any] | None = None
        self._pending: dict[int, dict[str, torch.Tensor]] = {}

    def _empty(self, count: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        device = self.device if device is None else device
        return {name: torch.zeros((count, *shape), dtype=torch.float64, device=device) for name, shape in self.shapes.items()}

    def describe(self) -> dict[str, Any]:
        """What a file's header says of the groups (besides the config's ``interval_groups``)."""
        return {"occupied": len(self.ids), "keys": self.keys, "unavailable": self.unavailable}

    # -- streaming --------------------------------------------------------------------------
    def begin(self, keys: np.ndarray, kind: str, lengths: torch.Tensor) -> None:
        """Start a batch: ``keys: [B]`` uint64, where they came from (:data:`KEY_KINDS`), ``lengths: [B]`` on the host."""
        self.abort()
        if self.unavailable is not None:
            return
        groups = group_of(keys, self.n_groups)
        present, slot = np.unique(groups, return_inverse=True)
        # "slots": the window-to-group slots copied once per device of the batch, not once per layer.
        self._batch = {"present": present, "slot": pinned(torch.from_numpy(slot.astype(np.int64))), "kind": kind,
                       "lengths": lengths.detach().to("cpu", torch.long), "slots": {}}

    def single_group(self) -> bool:
        """Whether every window of the batch is in one group (so that a batch total is that group's sum)."""
        return self._batch is None or len(self._batch["present"]) == 1

    def stage(self, layer: int, sums: dict[str, torch.Tensor], toeplitz_r2: torch.Tensor, toeplitz_count: torch.Tensor) -> None:
        """Add one layer's sums of the batch to the batch's groups (kept pending until :meth:`commit`).

        Args:
            layer: the layer.
            sums: ``log_sum, raw_sum, log_sq, raw_sq: [W, H, T]``, ``lag_sum: [W, H, N]`` and, where the
                groups keep it, ``first_key_sum: [W, H, T]``, per window
                (``W = B``) or, for a batch whose windows all share one group, summed over it (``W = 1``).
            toeplitz_r2: ``[W, H]`` per-window Toeplitz R² (summed over the windows when ``W = 1``).
            toeplitz_count: ``[W, H]`` windows behind it (1 or 0 per window: 0 where a window has no variance).
        """
        if self._batch is None:
            return
        width = sums["log_sum"].shape[0]
        device = sums["log_sum"].device
        if width == 1 and len(self._batch["present"]) == 1:
            slot, count = torch.zeros(1, dtype=torch.long, device=device), 1
        elif width == len(self._batch["slot"]):
            slots = self._batch["slots"]
            if device not in slots:
                slots[device] = self._batch["slot"].to(device, non_blocking=True)
            slot, count = slots[device], len(self._batch["present"])
        else:
            raise InputError(f"group sums for {width} windows in a batch of {len(self._batch['slot'])} windows of "
                             f"{len(self._batch['present'])} groups; give one row per window")

        def grouped(value: torch.Tensor) -> torch.Tensor:
            value = value.to(torch.float64)
            return torch.zeros((count, *value.shape[1:]), dtype=torch.float64, device=device).index_add_(0, slot, value)

        self._pending[layer] = {
            "log_sum": grouped(sums["log_sum"]),
            "raw_sum": grouped(sums["raw_sum"]),
            "log_sq": grouped(sums["log_sq"].sum(-1)),
            "raw_sq": grouped(sums["raw_sq"].sum(-1)),
            "lag_sum": grouped(sums["lag_sum"].sum(1)),
            "doc_toeplitz_sum": grouped(toeplitz_r2),
            "doc_toeplitz_count": grouped(toeplitz_count),
        }
        if "first_key_sum" in self.shapes:
            self._pending[layer]["first_key_sum"] = grouped(sums["first_key_sum"].sum(-1))

    def commit(self) -> None:
        """Add the batch's pending sums and lengths to the groups' rows."""
        batch, pending = self._batch, self._pending
        self.abort()
        if batch is None:
            return
        self._insert(batch["present"])
        rows = torch.from_numpy(np.searchsorted(self.ids, batch["present"])).to(self.device)
        for layer, sums in pending.items():
            for name, value in sums.items():
                self.rows[name][:, layer].index_add_(0, rows, value.to(self.device))
        lengths = batch["lengths"].to(self.device)
        window_rows = rows[batch["slot"].to(self.device)]
        self.rows["lengths"].index_put_((window_rows, lengths), torch.ones_like(lengths, dtype=torch.float64), accumulate=True)
        self.keys = _combined_kind(self.keys, batch["kind"])

    def abort(self) -> None:
        """Forget the current batch."""
        self._batch = None
        self._pending = {}

    def disable(self, reason: str) -> None:
        """Drop every group sum for good (the intervals then say ``reason``)."""
        self.abort()
        self.unavailable = reason
        self.ids = np.zeros(0, dtype=np.int64)
        self.rows = self._empty(0)

    def _insert(self, ids: np.ndarray) -> None:
        """Rows for groups not yet occupied (zeros), keeping the rows sorted by group id."""
        new = np.setdiff1d(ids, self.ids)
        if not len(new):
            return
        merged = np.union1d(self.ids, new)
        old_rows = torch.from_numpy(np.searchsorted(merged, self.ids)).to(self.device)
        grown = self._empty(len(merged))
        for name, value in self.rows.items():
            grown[name].index_copy_(0, old_rows, value)
        self.ids, self.rows = merged, grown

    # -- merging ------------------------------------------------------------------------------
    def check_compatible(self, other: WindowGroups) -> None:
        if (self.n_groups, self.shapes) != (other.n_groups, other.shapes):
            raise IncompatibleResultsError(
                f"cannot merge group sums of {self.n_groups} and {other.n_groups} interval groups (or of other shapes); "
                "run both with the same interval_groups"
            )

    def merge(self, other: WindowGroups) -> WindowGroups:
        """The groups of both (rows of the same group add: exact float64 addition)."""
        self.check_compatible(other)
        merged = self.copy()
        merged.keys = _combined_kind(self.keys, other.keys)
        if self.unavailable is not None or other.unavailable is not None:
            merged.disable(self.unavailable or other.unavailable)
            return merged
        merged._insert(other.ids)
        rows = torch.from_numpy(np.searchsorted(merged.ids, other.ids)).to(merged.device)
        for name, value in other.rows.items():
            merged.rows[name].index_add_(0, rows, value.to(merged.device))
        return merged

    def copy(self, device: torch.device | str | None = None) -> WindowGroups:
        """A copy (on ``device``, default this one's)."""
        copied = WindowGroups.__new__(WindowGroups)
        copied.n_groups, copied.shapes = self.n_groups, dict(self.shapes)
        copied.device = self.device if device is None else torch.device(device)
        copied.ids = self.ids.copy()
        copied.rows = {name: value.to(copied.device, copy=True) for name, value in self.rows.items()}
        copied.keys, copied.unavailable = self.keys, self.unavailable
        copied._batch, copied._pending = None, {}
        return copied

    # -- files --------------------------------------------------------------------------------
    def tensors(self) -> dict[str, np.ndarray]:
        """``index`` (``[R]`` int64 group ids) and every sum's ``[R, ...]`` rows, R the occupied groups."""
        return {"index": self.ids.copy(), **{name: value.detach().cpu().numpy() for name, value in self.rows.items()}}

    def load(self, tensors: dict[str, Any], described: dict[str, Any]) -> None:
        """Take the rows of :meth:`tensors` and the header's :meth:`describe` (on the CPU).

        Raises:
            IncompatibleResultsError: ids out of range, unsorted or repeated, or rows of other shapes.
        """
        ids = np.asarray(tensors["index"], dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n_groups or np.any(np.diff(ids) <= 0)):
            raise IncompatibleResultsError(f"group ids {ids.tolist()} are not sorted distinct ids below {self.n_groups}")
        rows = {}
        for name, shape in self.shapes.items():
            value = torch.as_tensor(tensors[name]).to(torch.float64)
            if tuple(value.shape) != (len(ids), *shape):
                raise IncompatibleResultsError(f"group sums {name!r} have shape {tuple(value.shape)}, expected {(len(ids), *shape)}")
            rows[name] = value
        self.device = torch.device("cpu")
        self.ids, self.rows = ids, rows
        self.keys, self.unavailable = described.get("keys"), described.get("unavailable")

    def array_shapes(self, occupied: int) -> dict[str, tuple[int, ...]]:
        """Name and shape of every tensor of :meth:`tensors` for ``occupied`` groups."""
        return {"index": (occupied,), **{name: (occupied, *shape) for name, shape in self.shapes.items()}}

    def nbytes(self) -> int:
        return sum(value.numel() * value.element_size() for value in self.rows.values())

    # -- replicates ----------------------------------------------------------------------------
    def replicates(self, *, sliding_windows: Sequence[int | None], excluded_keys: Sequence[int],
                   causal: bool = True) -> dict[str, np.ndarray]:
        """The sums of every replicate "all windows but group ``g``", one row per occupied group.

        Each sum of a replicate is the total over the groups minus group ``g``'s row; its
        mask-only sums follow from its window lengths (the groups' ``lengths`` minus group
        ``g``'s: exact counts) as ``Σ_u n_u·m(u)``, ``m(u)`` the closed-form sums of one window of
        length ``u`` (:func:`~equivariance_probe.statistics.masks.mask_counts`: every mask sum is
        a sum over windows).

        Args:
            sliding_windows: per layer, the statistics' sliding window (``None``: full causal).
            excluded_keys: the statistics' excluded key positions.
            causal: ``False`` for a bidirectional encoder's mask (signed lags, ``N = 2T - 1``).

        Returns:
            numpy float64, ``R`` the occupied groups: ``group: [R]`` (ids), ``windows: [R]``
            (windows in group ``g``), ``query_count: [R, L, T]``, ``log_sum, raw_sum: [R, L, H, T]``,
            ``log_sq, raw_sq, doc_toeplitz_sum, doc_toeplitz_count: [R, L, H]`` (and ``first_key_sum`` where
            kept), ``real_queries: [R]`` (real tokens of the replicate's windows), ``lag_sum:
            [R, L, 1, N]`` (summed over heads, a head axis of 1 kept so that code written for the
            total's ``[L, H, N]`` reads it), ``lag_count, lag_prior_sum: [R, L, N]`` (per head).
        """
        rows = {name: value.detach().cpu().numpy() for name, value in self.rows.items()}
        out: dict[str, np.ndarray] = {"group": self.ids.astype(np.float64), "windows": rows["lengths"].sum(-1)}
        for name, value in rows.items():
            if name != "lengths":
                out[name] = value.sum(0, keepdims=True) - value
        out["lag_sum"] = out["lag_sum"][:, :, None, :]
        lengths = rows["lengths"]
        used = np.flatnonzero(lengths.sum(0) > 0)
        complement = (lengths.sum(0, keepdims=True) - lengths)[:, used]  # [R, U] windows of each used length
        out["real_queries"] = complement @ used.astype(np.float64)
        n_positions = lengths.shape[-1] - 1
        mask_sums: dict[int | None, dict[str, np.ndarray]] = {}
        for window in dict.fromkeys(sliding_windows):
            per_length = [
                mask_counts(torch.tensor([int(u)]), n_positions, window=window, excluded_keys=excluded_keys,
                            key_bin=torch.zeros(n_positions, dtype=torch.long), n_key_bins=1, causal=causal)
                for u in used
            ]
            mask_sums[window] = {name: complement @ torch.stack([m[name] for m in per_length]).numpy()
                                 for name in ("query_count", "lag_count", "lag_prior_sum")}
        for name in ("query_count", "lag_count", "lag_prior_sum"):
            out[name] = np.stack([mask_sums[window][name] for window in sliding_windows], axis=1)
        return out
