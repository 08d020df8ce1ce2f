"""How attention statistics are measured, and which sums they hold: declared once.

Place in the seams: *statistics*. :class:`StatisticsConfig` is everything that must agree for two
:class:`~equivariance_probe.statistics.AttentionStatistics` to merge (the model's layout, the
window length, the mask's exclusions, the log floor, the key bins, the interval groups); it
builds the statistics, is written into result files (:meth:`StatisticsConfig.to_dict`) and read
back (:meth:`StatisticsConfig.from_dict`), and says what differs between two runs
(:meth:`StatisticsConfig.differences`).

:data:`~equivariance_probe.statistics.sums.STATISTICS` (in :mod:`.sums`, re-exported here) declares every
array once: its shape in the letters ``L`` (layers), ``H`` (heads), ``T`` (positions), ``D`` (lags), ``K``
(key bins), its meaning, how two runs' arrays merge (:data:`MERGE_RULES`), for optional arrays the
configuration flag that keeps them, and what the engines, the first batch's check and the interval
groups need of it.
An array whose shape starts with ``L`` holds one row per layer, which a layer's batch adds to;
any other array is added to whole. Allocation, merging, copying, moving between devices and
the file schema are all loops over this table.
"""

from __future__ import annotations

import operator

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from ..errors import InputError
from .masks import KEY_BINS, check_window_kind, n_lags, uniform_prior
from .sums import STATISTICS, Sum

__all__ = ["MERGE_RULES", "STATISTICS", "StatisticsConfig", "Sum", "merge_arrays", "shapes_of"]


#: How two runs' arrays of a sum combine. Sums and counts add (float64 addition is exact for counts
#: and rounds once per merge for sums), whatever the batch sizes, processes or machines.
MERGE_RULES: dict[str, Callable[[Any, Any], Any]] = {"add": operator.add}

#: Field names of :class:`StatisticsConfig` as files spell them, where they differ.
_FILE_NAMES = {"sliding_windows": "windows"}

#: What a file's configuration without a key meant when it was written: statistics of one key-lag
#: row per key (before the key bins), causal, without interval groups, without the first token's sums.
_FILE_DEFAULTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "key_bins": lambda config: config["n_positions"],
    "causal": lambda config: True,
    "interval_groups": lambda config: 0,
    "keep_first_key": lambda config: False,
    "keep_window_sinks": lambda config: False,
}


@dataclass(frozen=True)
class StatisticsConfig:
    """What must agree for two attention statistics to merge.

    Attributes:
        n_layers: the model's attention layers.
        n_heads: query heads per layer.
        n_positions: ``T``, the longest window the statistics hold.
        sliding_windows: per layer, ``None`` (full causal) or the sliding window width (``None``
            also where the window covers ``T``).
        log_floor: ``eps`` of the log scale; ``None`` until the first attention's dtype sets it.
        excluded_keys: absolute key positions left out of every statistic (sorted, unique).
        keep_pattern: whether the window-summed pattern ``[L, H, T, T]`` is kept.
        key_bins: ``K``, key-position bins of the key-conditioned lag sums (at most ``T``).
        causal: ``False`` for a bidirectional encoder (no sliding windows, signed lags).
        interval_groups: ``G``, groups of windows for intervals; 0 for none.
        keep_first_key: whether the first token's weights ``first_key_sum: [L, H, T]`` are kept (the
            attention-sink rate); files written before them read as ``False``.
        keep_window_sinks: whether each window's first-token weight ``α₁ [windows, L, H]`` is kept (Gu et al.'s
            per-window sink rate, :mod:`~equivariance_probe.statistics.window_sinks`); only with
            ``keep_first_key``; files written before it read as ``False``.
    """

    n_layers: int
    n_heads: int
    n_positions: int
    sliding_windows: tuple[int | None, ...]
    log_floor: float | None = None
    excluded_keys: tuple[int, ...] = ()
    keep_pattern: bool = False
    key_bins: int = KEY_BINS
    causal: bool = True
    interval_groups: int = field(default=0)
    keep_first_key: bool = True
    keep_window_sinks: bool = True

    def __post_init__(self) -> None:
        n_positions = int(self.n_positions)
        windows = tuple(None if w is None or w >= n_positions else int(w) for w in self.sliding_windows)
        normal = {
            "n_layers": int(self.n_layers),
            "n_heads": int(self.n_heads),
            "n_positions": n_positions,
            "sliding_windows": windows,
            "log_floor": None if self.log_floor is None else float(self.log_floor),
            "excluded_keys": tuple(sorted({int(k) for k in self.excluded_keys})),
            "keep_pattern": bool(self.keep_pattern),
            "key_bins": max(1, min(int(self.key_bins), n_positions)),
            "causal": bool(self.causal),
            "interval_groups": int(self.interval_groups),
            "keep_first_key": bool(self.keep_first_key),
            "keep_window_sinks": bool(self.keep_window_sinks) and bool(self.keep_first_key),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)
        if len(windows) != self.n_layers:
            raise InputError(f"{len(windows)} sliding windows given for {self.n_layers} layers; give one per layer")
        for window in windows:
            check_window_kind(window, self.causal, f"sliding_windows={list(self.sliding_windows)}")

    # -- shapes -----------------------------------------------------------------------
    @property
    def n_lags(self) -> int:
        """``D``: lags of the lag sums, ``T`` causal, ``2T - 1`` bidirectional."""
        return n_lags(self.n_positions, self.causal)

    def sizes(self) -> dict[str, int]:
        """The size of each letter of a :class:`Sum`'s shape."""
        return {"L": self.n_layers, "H": self.n_heads, "T": self.n_positions, "D": self.n_lags, "K": self.key_bins}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name and shape of every array these statistics keep (:data:`STATISTICS`)."""
        return shapes_of(STATISTICS, self.sizes(), self)

    def visible_keys(self) -> torch.Tensor:
        """``|V(q)|`` per layer under the model's mask: ``[L, T]`` float64.

        For a bidirectional encoder the visible keys are the window's, the same for every query:
        ``T`` (a full window) everywhere, so that the query-position groups are the positions alone.
        """
        if not self.causal:
            return torch.full((self.n_layers, self.n_positions), float(self.n_positions), dtype=torch.float64)
        return torch.stack([1.0 / uniform_prior(self.n_positions, w) for w in self.sliding_windows])

    # -- files and merges ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain values as files store them (tuples as lists, ``sliding_windows`` as ``windows``)."""
        return {
            _FILE_NAMES.get(name, name): list(value) if isinstance(value, tuple) else value
            for name, value in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> StatisticsConfig:
        """The configuration a file's :meth:`to_dict` describes (keys older files lack take :data:`_FILE_DEFAULTS`)."""
        values = {}
        for item in fields(cls):
            name = _FILE_NAMES.get(item.name, item.name)
            values[item.name] = config[name] if name in config else _FILE_DEFAULTS[item.name](config)
        return cls(**values)

    def with_log_floor(self, log_floor: float | None) -> StatisticsConfig:
        return replace(self, log_floor=log_floor)

    def differences(self, other: StatisticsConfig) -> list[str]:
        """``"field: mine vs theirs"`` for every field that differs (an unset log floor matches any)."""
        mine, theirs = self.to_dict(), other.to_dict()
        if mine["log_floor"] is None or theirs["log_floor"] is None:
            mine["log_floor"] = theirs["log_floor"] = None  # an empty side takes the other's floor
        return [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


def merge_arrays(mine: dict[str, Any], theirs: dict[str, Any], table: dict[str, Sum] | None = None) -> dict[str, Any]:
    """Two runs' arrays combined by each array's merge rule (torch tensors on ``mine``'s devices; numpy
    arrays as they are)."""
    table = STATISTICS if table is None else table
    return {name: MERGE_RULES[table[name].merge](value, _beside(theirs[name], value)) for name, value in mine.items()}


def _beside(other: Any, value: Any) -> Any:
    """``other`` on ``value``'s device when both are torch tensors."""
    return other.to(value.device) if isinstance(value, torch.Tensor) else other


def shapes_of(table: dict[str, Sum], sizes: dict[str, int], config: Any) -> dict[str, tuple[int, ...]]:
    """Name and shape of every array of ``table`` that ``config`` keeps (its ``kept_if`` flag true), with the
    letters of the shapes read in ``sizes``."""
    return {
        name: tuple(sizes[letter] for letter in entry.shape.split())
        for name, entry in table.items()
        if entry.kept_if is None or getattr(config, entry.kept_if)
    }
