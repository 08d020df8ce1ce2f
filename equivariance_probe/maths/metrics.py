"""Metrics: pure functions from sufficient statistics to the numbers of docs/methods.md.

Inputs are float64 numpy arrays as held by :class:`~equivariance_probe.statistics.AttentionStatistics`
(``L`` layers, ``H`` heads, ``T`` positions). Nothing here knows a model framework.

Query-position R² (docs/methods.md#query-position-r2). Over visible entries with ``y = log a`` (or
``a``) and ``x = log u(q)`` (or ``u(q)``), ``u(q) = 1/|V(q)|``, and groups ``g`` of entries
sharing the query position and visible key set:

* prior R²  ``= 1 - Σ(y - x)² / Σ(y - ȳ)²``
* fitted R² ``= cov(x, y)² / (var x · var y)`` (the least-squares line ``y ≈ α + βx``)
* η²        ``= 1 - Σ(y - ȳ_g)² / Σ(y - ȳ)²``

Sums are combined through group means and within-group sums of squares (never through
``Σy² - (Σy)²/N`` over everything), which keeps the float64 results exact to ~1e-12
even over billions of entries. The jackknife's replicates, which keep ``Σy²`` per head only
(:func:`query_position_r2_from_totals`), take the within-group sum of squares as
``Σy² - Σ_g S_g²/n_g``: one cancellation at the head's scale, which costs about one digit on the
log scale (``Σy²`` is about ten times the within sum of squares there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import check_choice

__all__ = [
    "SCALES",
    "FORMS",
    "r2_from_groups",
    "query_position_r2",
    "query_position_r2_from_totals",
    "toeplitz_r2",
    "toeplitz_r2_key_lag",
    "mean_pattern_key_lag",
    "key_lag_layout",
    "key_lag_visible",
    "bidirectional_mean_pattern",
    "bidirectional_mean_pattern_toeplitz_r2",
]

SCALES = ("log", "raw")
FORMS = ("prior", "fitted", "eta2")


def r2_from_groups(
    count: np.ndarray, total: np.ndarray, within: np.ndarray, x: np.ndarray
) -> dict[str, float]:
    """The three R² forms from per-group sums.

    Args:
        count: ``n_g``, entries per group ``[G]``.
        total: ``Σ_g y`` per group ``[G]``.
        within: ``Σ_g (y - ȳ_g)²`` per group ``[G]``.
        x: the predictor, constant within a group ``[G]``.

    Returns:
        ``{"prior", "fitted", "eta2", "n"}``; R² values are NaN when ``y`` has no variance.
    """
    keep = count > 0
    n, s, w, x = count[keep], total[keep], within[keep], x[keep]
    forms = _r2_forms(n, s, np.clip(w, 0.0, None).sum(), x)
    return {**{form: float(value) for form, value in forms.items()}, "n": float(n.sum())}


def _r2_forms(count: np.ndarray, total: np.ndarray, within: np.ndarray | float, x: np.ndarray) -> dict[str, np.ndarray]:
    """The three R² forms from groups along the last axis (leading axes: independent sets of entries).

    Args:
        count, total, x: ``[..., G]`` entries, ``Σy`` and the predictor per group.
        within: ``[...]`` the within-group sum of squares ``Σ_g Σ(y - ȳ_g)²`` (non-negative).

    Returns:
        ``{"prior", "fitted", "eta2"}``, each ``[...]``; NaN where there is no entry or no variance.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        n_all = count.sum(-1)
        group_mean = np.where(count > 0, total / np.where(count > 0, count, 1), 0.0)
        mean = (total.sum(-1) / n_all)[..., None]
        between = np.sum(count * (group_mean - mean) ** 2, -1)
        tss = within + between
        x_mean = (np.sum(count * x, -1) / n_all)[..., None]
        x_var = np.sum(count * (x - x_mean) ** 2, -1)
        covariance = np.sum(count * (x - x_mean) * (group_mean - mean), -1)
        prior_rss = within + np.sum(count * (group_mean - x) ** 2, -1)
        fitted = np.where(x_var > 0, covariance**2 / (x_var * tss), 0.0)
        defined = (n_all > 0) & (tss > 0.0)
        return {"prior": np.where(defined, 1.0 - prior_rss / tss, np.nan), "fitted": np.where(defined, fitted, np.nan),
                "eta2": np.where(defined, between / tss, np.nan)}


def _cell_moments(count: np.ndarray, total: np.ndarray, squares: np.ndarray) -> np.ndarray:
    """``Σ(y - ȳ_cell)²`` per cell from its count, sum and sum of squares."""
    with np.errstate(invalid="ignore", divide="ignore"):
        within = squares - np.where(count > 0, total**2 / np.where(count > 0, count, 1), 0.0)
    return np.clip(within, 0.0, None)


def _pool(count: np.ndarray, total: np.ndarray, within: np.ndarray, keys: np.ndarray):
    """Pool cells that share a key: counts and sums add, within-SS gains the spread of cell means."""
    unique, inverse = np.unique(keys, return_inverse=True)
    g = len(unique)
    n_g = np.bincount(inverse, weights=count, minlength=g)
    s_g = np.bincount(inverse, weights=total, minlength=g)
    with np.errstate(invalid="ignore", divide="ignore"):
        cell_mean = np.where(count > 0, total / np.where(count > 0, count, 1), 0.0)
        group_mean = np.where(n_g > 0, s_g / np.where(n_g > 0, n_g, 1), 0.0)
    spread = count * (cell_mean - group_mean[inverse]) ** 2
    w_g = np.bincount(inverse, weights=within + spread, minlength=g)
    return unique, inverse, n_g, s_g, w_g


def query_position_r2(
    query_count: np.ndarray,
    value_sum: np.ndarray,
    value_sq: np.ndarray,
    visible_keys: np.ndarray,
    *,
    scale: str,
    by: str | None = None,
) -> dict[str, np.ndarray | float]:
    """Query-position R² in the three forms, over everything, per layer or per head.

    Args:
        query_count: ``[L, T]`` visible entries per query position (per head).
        value_sum: ``[L, H, T]`` ``Σ y`` per query position.
        value_sq: ``[L, H, T]`` ``Σ y²`` per query position.
        visible_keys: ``[L, T]`` ``|V(q)|`` under each layer's mask.
        scale: ``"log"`` (``x = log u``) or ``"raw"`` (``x = u``); ``y`` must match.
        by: ``None`` (all entries; groups are ``(q, |V(q)|)`` across layers and heads),
            ``"layer"`` (``[L]``, groups ``q``) or ``"head"`` (``[L, H]``, groups ``q``).

    Returns:
        ``{"prior", "fitted", "eta2"}`` mapped to a float or an array.
    """
    n_layers, n_heads, context_length = value_sum.shape
    prior = 1.0 / visible_keys
    x_cell = np.log(prior) if scale == "log" else prior  # [L, T]
    count = np.broadcast_to(query_count[:, None, :], value_sum.shape).astype(np.float64)
    within = _cell_moments(count, value_sum, value_sq)
    if by == "head":
        out = {form: np.full((n_layers, n_heads), np.nan) for form in FORMS}
        for layer in range(n_layers):
            for head in range(n_heads):
                r2 = r2_from_groups(count[layer, head], value_sum[layer, head], within[layer, head], x_cell[layer])
                for form in FORMS:
                    out[form][layer, head] = r2[form]
        return out
    if by == "layer":
        out = {form: np.full(n_layers, np.nan) for form in FORMS}
        for layer in range(n_layers):
            keys = np.broadcast_to(np.arange(context_length), (n_heads, context_length)).ravel()
            _, _, n_g, s_g, w_g = _pool(count[layer].ravel(), value_sum[layer].ravel(), within[layer].ravel(), keys)
            r2 = r2_from_groups(n_g, s_g, w_g, x_cell[layer])
            for form in FORMS:
                out[form][layer] = r2[form]
        return out
    check_choice("by", by, (None, "layer", "head"))
    # Total: a group is (query position, visible key set); layers whose masks agree at q share it.
    query = np.broadcast_to(np.arange(context_length), value_sum.shape)
    size = np.broadcast_to(visible_keys[:, None, :], value_sum.shape)
    keys = (query.astype(np.int64) * (context_length + 1) + size.astype(np.int64)).ravel()
    x_full = np.broadcast_to(x_cell[:, None, :], value_sum.shape).ravel()
    unique, inverse, n_g, s_g, w_g = _pool(count.ravel(), value_sum.ravel(), within.ravel(), keys)
    x_g = np.zeros(len(unique))
    x_g[inverse] = x_full
    return {form: value for form, value in r2_from_groups(n_g, s_g, w_g, x_g).items() if form in FORMS}


def query_position_r2_from_totals(
    query_count: np.ndarray,
    value_sum: np.ndarray,
    square_total: np.ndarray,
    visible_keys: np.ndarray,
    *,
    scale: str,
    by: str | None = None,
) -> dict[str, np.ndarray]:
    """Query-position R² in the three forms from per-query sums and each head's ``Σy²``, for many sets at once.

    The jackknife's replicates keep ``Σy`` per query position but ``Σy²`` per head only; over a
    set of entries grouped by ``g``, the within-group sum of squares is then
    ``Σy² - Σ_g S_g²/n_g`` (clipped at 0), and the forms follow as in :func:`r2_from_groups`.

    Args:
        query_count: ``[R, L, T]`` visible entries per query position (per head), ``R`` sets.
        value_sum: ``[R, L, H, T]`` ``Σy`` per query position.
        square_total: ``[R, L, H]`` ``Σy²`` over the head's entries.
        visible_keys: ``[L, T]`` ``|V(q)|`` under each layer's mask.
        scale: ``"log"`` or ``"raw"``.
        by: ``None`` (``[R]``; groups ``(q, |V(q)|)`` across layers, as :func:`query_position_r2`),
            ``"layer"`` (``[R, L]``) or ``"head"`` (``[R, L, H]``).

    Returns:
        ``{"prior", "fitted", "eta2"}`` mapped to arrays of the shapes above.
    """
    check_choice("by", by, (None, "layer", "head"))
    prior = 1.0 / visible_keys
    x_cell = np.log(prior) if scale == "log" else prior  # [L, T]
    n_heads = value_sum.shape[2]
    if by == "head":
        count, total, squares, x = query_count[:, :, None, :], value_sum, square_total, x_cell[:, None, :]
    elif by == "layer":
        count, total, squares, x = n_heads * query_count, value_sum.sum(2), square_total.sum(2), x_cell
    else:
        n_layers, context_length = x_cell.shape
        query = np.broadcast_to(np.arange(context_length), (n_layers, context_length))
        keys = (query.astype(np.int64) * (context_length + 1) + visible_keys.astype(np.int64)).ravel()
        unique, inverse = np.unique(keys, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        starts = np.searchsorted(inverse[order], np.arange(len(unique)))

        def pooled(cells: np.ndarray) -> np.ndarray:  # [R, L, T] -> [R, groups]
            return np.add.reduceat(cells.reshape(len(cells), -1)[:, order], starts, axis=1)

        x = np.zeros(len(unique))
        x[inverse] = x_cell.ravel()
        count, total, squares = pooled(n_heads * query_count), pooled(value_sum.sum(2)), square_total.sum((1, 2))
    count = np.broadcast_to(count, total.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        between_groups = np.where(count > 0, total**2 / np.where(count > 0, count, 1), 0.0).sum(-1)
    return _r2_forms(count, total, np.clip(squares - between_groups, 0.0, None), x)


# -- Toeplitz scores -----------------------------------------------------------------
def toeplitz_r2(matrix: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Toeplitz R² of a square matrix (Wennberg & Henter, TISA appendix B).

    The best Toeplitz approximation has, on each diagonal ``q - k = d``, the mean of the
    entries there. ``R² = 1 - RSS/TSS`` with ``TSS`` around the grand mean, over the
    entries where ``mask`` is true (all entries if ``mask`` is None).

    Args:
        matrix: ``[query, key]`` (e.g. an attention pattern or a Gram matrix ``E Eᵀ``).
        mask: ``[query, key]`` bool, the entries that count.
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    rows, cols = matrix.shape
    mask = np.ones_like(matrix, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    offset = (np.arange(rows)[:, None] - np.arange(cols)[None, :]) + (cols - 1)
    values, diagonals = matrix[mask], offset[mask]
    if values.size < 2:
        return float("nan")
    count = np.bincount(diagonals, minlength=rows + cols - 1)
    total = np.bincount(diagonals, weights=values, minlength=rows + cols - 1)
    diagonal_mean = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    rss = float(np.sum((values - diagonal_mean[diagonals]) ** 2))
    tss = float(np.sum((values - values.mean()) ** 2))
    return 1.0 - rss / tss if tss > 0 else float("nan")


def key_lag_visible(
    context_length: int, window: int | None, windows_covering: np.ndarray, excluded_keys: Sequence[int] = ()
) -> np.ndarray:
    """Visible entries in key-lag layout ``[key t, lag dt]`` of a document-averaged pattern."""
    t = np.arange(context_length)[:, None]
    dt = np.arange(context_length)[None, :]
    query = t + dt
    visible = query < context_length
    visible &= windows_covering[np.minimum(query, context_length - 1)] > 0
    if window is not None:
        visible &= dt < window
    for key in excluded_keys:
        if 0 <= key < context_length:
            visible[key, :] = False
    return visible


def key_lag_layout(matrices: np.ndarray) -> np.ndarray:
    """Square matrices ``[..., query, key]`` laid out by key and lag, ``[..., key t, lag dt]``.

    Entry ``[t, dt]`` is ``matrix[t + dt, t]`` (0 where ``t + dt >= T``), so each diagonal at or
    below the main one becomes a column (what :func:`toeplitz_r2_key_lag` reads).
    """
    context_length = matrices.shape[-1]
    t = np.arange(context_length)[:, None]
    query = t + np.arange(context_length)[None, :]
    inside = query < context_length
    laid_out = matrices[..., np.minimum(query, context_length - 1), np.broadcast_to(t, query.shape)]
    return np.where(inside, laid_out, 0.0)


def mean_pattern_key_lag(pattern_sum: np.ndarray, windows_covering: np.ndarray) -> np.ndarray:
    """Document-averaged pattern in key-lag layout: ``pattern_sum[..., t, dt] / #windows(t+dt)``."""
    context_length = pattern_sum.shape[-1]
    query = np.minimum(np.arange(context_length)[:, None] + np.arange(context_length)[None, :], context_length - 1)
    covering = windows_covering[query]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(covering > 0, pattern_sum / np.where(covering > 0, covering, 1), 0.0)


def toeplitz_r2_key_lag(values: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Toeplitz R² of matrices stored in key-lag layout, where each diagonal is a column.

    Args:
        values: ``[..., key t, lag dt]``.
        visible: ``[key t, lag dt]`` bool.

    Returns:
        ``[...]`` R² per matrix.
    """
    weights = visible.astype(np.float64)
    n_lag = weights.sum(0)  # [dt]
    n_all = weights.sum()
    masked = values * weights
    lag_mean = masked.sum(-2) / np.maximum(n_lag, 1)  # [..., dt]
    grand_mean = masked.sum((-2, -1)) / max(n_all, 1)
    rss = (((values - lag_mean[..., None, :]) ** 2) * weights).sum((-2, -1))
    tss = (((values - grand_mean[..., None, None]) ** 2) * weights).sum((-2, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tss > 0, 1.0 - rss / np.where(tss > 0, tss, 1), np.nan)


def bidirectional_mean_pattern(
    pattern_sum: np.ndarray, windows_covering: np.ndarray, excluded_keys: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """An encoder's document-averaged pattern and the entries it has.

    Every real key is visible to every real query of an encoder's window, so entry ``(q, k)`` is held
    by the windows that reach both: ``#windows(q, k) = c[max(q, k)]`` with ``c = windows_covering``.

    Args:
        pattern_sum: ``[..., query, key]`` the pattern summed over windows.
        windows_covering: ``[T]`` windows that reach each position.
        excluded_keys: key positions left out.

    Returns:
        ``(mean, visible)``: ``[..., query, key]`` ``pattern_sum / #windows(q, k)`` (0 where no window holds
        the entry or its key is excluded), and ``[query, key]`` the entries held.
    """
    context_length = pattern_sum.shape[-1]
    both = windows_covering[np.maximum.outer(np.arange(context_length), np.arange(context_length))]
    visible = both > 0
    for key in excluded_keys:
        if 0 <= key < context_length:
            visible[:, key] = False
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(visible, pattern_sum / np.where(visible, both, 1), 0.0)
    return mean, visible


def bidirectional_mean_pattern_toeplitz_r2(
    pattern_sum: np.ndarray, windows_covering: np.ndarray, excluded_keys: Sequence[int] = ()
) -> np.ndarray:
    """Toeplitz R² of an encoder's document-averaged pattern per head, over the entries it has
    (:func:`bidirectional_mean_pattern`): ``[L, H]`` from ``pattern_sum [L, H, T, T]``."""
    mean, visible = bidirectional_mean_pattern(pattern_sum, windows_covering, excluded_keys)
    return np.array([[toeplitz_r2(mean[layer, head], visible) for head in range(mean.shape[1])]
                     for layer in range(mean.shape[0])])
