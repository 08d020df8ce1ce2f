"""The one table of the attention statistics' sums: every array declared once, with what each part of the
statistics needs to know of it.

Place in the seams: *statistics*, below the engines as well as above them. It holds plain data (a named
tuple of strings and flags) and imports nothing, so that the engines, the batch that stages their sums, the
first batch's check, the interval groups and the files all read the same declarations, and what a remote
trace needs of them can be sent as plain values.

Shapes are strings of size letters: ``L`` layers, ``H`` heads, ``T`` positions, ``D`` lags, ``K`` key bins
(totals); ``B`` windows of a batch (what an engine returns per batch, :attr:`Sum.window`); ``N`` lags (the
groups' lag axis, :attr:`Sum.group`).

The name lists the statistics loop over are read from the table:

* :func:`engine_sums` — what every engine returns per batch (the reduction's outputs, less the optional ones);
* :func:`row_sums` — the per-window sums with one value per query position, zero-padded to ``T`` when staged;
* :func:`head_sums` — the per-head sums, added as they come;
* :func:`checked_sums` — the weight-dependent sums the first batch's check compares;
* :func:`group_sums` — the sums kept per interval group, with their shape after the group axis.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Sum", "STATISTICS", "engine_sums", "row_sums", "head_sums", "checked_sums", "group_sums"]


class Sum(NamedTuple):
    """One array of a family of sums: its shape (letters of the sizes), meaning, merge rule and keep flag,
    and where the streaming machinery meets it."""

    shape: str
    meaning: str
    #: How two runs' arrays combine: a key of :data:`~equivariance_probe.statistics.config.MERGE_RULES`.
    merge: str = "add"
    #: A boolean field of the configuration that must be true for the array to be kept, or ``None``.
    kept_if: str | None = None
    #: The shape an engine returns for one batch (``"B H T"``: per window), or ``None`` where no engine
    #: computes the sum (the mask's counts, computed from the lengths; sums derived from the engine's).
    window: str | None = None
    #: Whether the sum depends on the attention weights, so that the first batch's check compares it
    #: against a float64 reduction of the model's own weights.
    checked: bool = False
    #: The shape after the group axis of the sum kept per interval group, or ``None`` where none is kept.
    group: str | None = None

    @property
    def per_layer(self) -> bool:
        """Whether the array holds one row per layer (its shape starts with ``L``)."""
        return self.shape.split()[0] == "L"


#: Every statistic, its shape (in terms of L layers, H heads, T positions, D lags, K key bins) and meaning.
STATISTICS: dict[str, Sum] = {
    "query_count": Sum("L T", "visible entries per query position, summed over windows (per head)"),
    "raw_sum": Sum("L H T", "Σ_k a[q,k] over visible keys, summed over windows", window="B H T", checked=True,
                   group="L H T"),
    "raw_sq": Sum("L H T", "Σ_k a[q,k]² over visible keys", window="B H T", checked=True, group="L H"),
    "log_sum": Sum("L H T", "Σ_k log max(a, eps) over visible keys", window="B H T", checked=True, group="L H T"),
    "log_sq": Sum("L H T", "Σ_k (log max(a, eps))² over visible keys", window="B H T", checked=True, group="L H"),
    "floored": Sum("L H", "visible entries with a < eps (floored on the log scale)", window="B H", checked=True),
    "lag_sum": Sum("L H D", "Σ a[t+dt, t] over windows and key positions t, by lag dt", window="B H D",
                   checked=True, group="L N"),
    "lag_count": Sum("L D", "entries behind lag_sum (per head)"),
    "lag_prior_sum": Sum("L D", "Σ u(t+dt) over the same entries: the uniform prior's curve"),
    "key_lag_sum": Sum("K D", "Σ over layers, heads, windows of a[t+dt, t] for keys t in bin κ, indexed [κ, dt]",
                       window="K D", checked=True),
    "key_lag_count": Sum("K D", "entries behind key_lag_sum"),
    "key_lag_prior_sum": Sum("K D", "Σ u(t+dt) over the same entries"),
    "doc_toeplitz_sum": Sum("L H", "Σ over windows of the per-window Toeplitz R²", checked=True, group="L H"),
    "doc_toeplitz_count": Sum("L H", "windows behind doc_toeplitz_sum (those with nonzero variance)", group="L H"),
    "windows_covering": Sum("T", "number of windows that have a query at position q"),
    "pattern_sum": Sum("L H T T", "optional: Σ over windows of a[q, k], indexed [q, k]", kept_if="keep_pattern",
                       window="H T T"),
    "first_key_sum": Sum("L H T", "Σ over windows of a[q, 0], the weight on the window's first token of every real "
                         "query q (excluded or not; 0 where the mask hides key 0): the attention-sink sums",
                         kept_if="keep_first_key", window="B H T", checked=True, group="L H"),
}


def engine_sums(table: dict[str, Sum] = STATISTICS) -> tuple[str, ...]:
    """The per-batch sums every engine returns (those an engine computes and no flag makes optional)."""
    return tuple(name for name, entry in table.items() if entry.window is not None and entry.kept_if is None)


def row_sums(table: dict[str, Sum] = STATISTICS) -> tuple[str, ...]:
    """The per-window sums with one value per query position (``B H T``), the optional ones included."""
    return tuple(name for name, entry in table.items() if entry.window == "B H T")


def head_sums(table: dict[str, Sum] = STATISTICS) -> tuple[str, ...]:
    """The per-layer, per-head sums (``L H``), added to the totals as they come."""
    return tuple(name for name, entry in table.items() if entry.shape == "L H")


def checked_sums(table: dict[str, Sum] = STATISTICS) -> tuple[str, ...]:
    """The sums that depend on the attention weights (the others are the mask's counts and prior)."""
    return tuple(name for name, entry in table.items() if entry.checked)


def group_sums(table: dict[str, Sum] = STATISTICS) -> dict[str, Sum]:
    """The sums kept per interval group."""
    return {name: entry for name, entry in table.items() if entry.group is not None}
