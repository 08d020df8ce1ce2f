"""The mask's part of the statistics, in closed form: which entries a statistic reads, and how many.

Place in the seams: *statistics*. A causal model's mask lets query ``q`` see key ``k`` iff
``k <= q`` and, under a sliding window ``w``, ``q - k < w``; a bidirectional encoder's (BERT)
lets every real token see every real token of its window. The statistics read an entry only
if, besides, ``q`` is a real token of its window (right padding) and ``k`` is not an excluded
key (:func:`mask_counts`). Lags ``dt = q - k`` are ``0 .. T-1`` under a causal mask and
``-(T-1) .. T-1`` (signed, stored at index ``dt + T - 1``) under a bidirectional one
(:func:`lag_values`). Everything that depends on the mask alone (entry counts, the
uniform prior ``u(q) = 1/|V(q)|`` and its sums) follows from the window lengths in
``O(B·T + K·T)``, never from a ``[T, T]`` mask. Key positions are grouped into ``K``
contiguous bins for the key-conditioned persistence curves (:func:`key_bins`).

torch, math and builtins only: :func:`uniform_prior` and :func:`default_log_floor` also run
inside remote nnsight traces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError

__all__ = [
    "KEY_BINS",
    "check_window_kind",
    "default_log_floor",
    "uniform_prior",
    "windows_covering",
    "visible_key_counts",
    "key_bins",
    "key_bin_edges",
    "mask_counts",
    "LAYER_GROUPS",
    "layer_groups",
    "n_lags",
    "lag_values",
]

#: Key-position bins the statistics keep for the key-conditioned persistence curves (the
#: study's Figure 1c): one bin per key when ``T <= KEY_BINS``, else ``KEY_BINS`` bins of (nearly)
#: equal width, so that this state grows as ``K·T``, not ``T²``. Figures use 16 bins, a divisor.
KEY_BINS = 64


#: Names of the layer groups, in display order: every layer, the sliding-window layers, the global
#: (full-context) layers.
LAYER_GROUPS = ("all", "sliding", "global")


def layer_groups(sliding_windows: Sequence[int | None]) -> dict[str, tuple[int, ...]]:
    """Layers grouped by the kind of mask the model declares for them.

    ``"all"`` holds every layer; where the model has both kinds, ``"sliding"`` holds the layers
    with a sliding window and ``"global"`` those that see the whole context. A group is defined by
    the model's declared kind, not by what a window of a given length makes of it: at ``T <= w``
    a sliding layer's mask equals a global one's, but it is still the other kind of layer
    (Gemma 3's local layers also use another rotary base), so a scan over lengths compares the
    same layers at every length.

    Args:
        sliding_windows: per layer, ``None`` (global) or the declared window width.

    Returns:
        ``{name: layer indices}``, names in :data:`LAYER_GROUPS` order; only ``"all"`` for a
        model whose layers are all of one kind.

    Example:
        >>> layer_groups([512, 512, None])
        {'all': (0, 1, 2), 'sliding': (0, 1), 'global': (2,)}
    """
    layers = tuple(range(len(sliding_windows)))
    sliding = tuple(layer for layer in layers if sliding_windows[layer] is not None)
    glob = tuple(layer for layer in layers if sliding_windows[layer] is None)
    if not sliding or not glob:
        return {"all": layers}
    return {"all": layers, "sliding": sliding, "global": glob}


def n_lags(n_positions: int, causal: bool = True) -> int:
    """How many lags ``dt = q - k`` a window of ``T`` positions has: ``T`` causal, ``2T - 1`` bidirectional."""
    return int(n_positions) if causal else max(2 * int(n_positions) - 1, 0)


def lag_values(n_positions: int, causal: bool = True) -> torch.Tensor:
    """The lag ``dt`` at each index of a lag array: ``[n_lags]`` long, ``0 .. T-1`` causal,
    ``-(T-1) .. T-1`` bidirectional (index ``dt + T - 1``)."""
    n = int(n_positions)
    return torch.arange(n) if causal else torch.arange(-(n - 1), n)


def default_log_floor(dtype: torch.dtype) -> float:
    """The default ``eps`` of the log scale: the smallest normal number of ``dtype``."""
    return float(torch.finfo(dtype if dtype.is_floating_point else torch.float32).tiny)


def uniform_prior(
    n_positions: int, window: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The uniform prior ``u(q) = 1 / |V(q)|`` under the model's mask.

    ``|V(q)| = min(q + 1, w)`` (``q + 1`` without a window). Padding and excluded keys do
    not change it: it is the attention of a head that spreads evenly over the keys the
    *model* lets it see.

    Args:
        n_positions: ``T``.
        window: sliding window width ``w``, or ``None`` for full causal attention.
        device: where the result lives.

    Returns:
        ``[T]`` float64.
    """
    visible = torch.arange(1, n_positions + 1, device=device, dtype=torch.float64)
    if window is not None:
        visible = visible.clamp(max=window)
    return 1.0 / visible


def _excluded_flags(
    n_positions: int, excluded_keys: Sequence[int], device: torch.device | str
) -> torch.Tensor:
    """``[T]`` bool, true at the excluded key positions that lie in ``[0, T)``."""
    flags = torch.zeros(n_positions, dtype=torch.bool, device=device)
    inside = [int(k) for k in excluded_keys if 0 <= int(k) < n_positions]
    if inside:
        flags[torch.tensor(inside, dtype=torch.long, device=device)] = True
    return flags


def check_window_kind(window: int | None, causal: bool, given: str | None = None) -> None:
    """Refuse a sliding window under a bidirectional mask: the statistics know causal sliding windows and
    full bidirectional attention, not bidirectional windows (``window``: ``None`` where it covers the context)."""
    if window is not None and not causal:
        raise InputError(
            f"{given or f'a sliding window of {window}'} with causal=False: a bidirectional mask with a sliding "
            "window is not supported; the statistics know causal sliding windows and full bidirectional attention"
        )


def _effective_window(window: int | None, n_positions: int) -> int | None:
    """``None`` for a window that covers the whole context (the mask is then full causal)."""
    if window is None:
        return None
    window = int(window)
    if window < 1:
        raise InputError(f"a sliding window must be at least 1 wide, got {window}")
    return None if window >= n_positions else window


def windows_covering(lengths: torch.Tensor, n_positions: int) -> torch.Tensor:
    """``c[q]``: the number of windows with a real token at position ``q``: ``[T]`` float64.

    ``c[q] = #{b : lengths[b] > q}``, from a histogram of the lengths in ``O(B + T)``.
    """
    histogram = torch.bincount(lengths.clamp(0, n_positions).long(), minlength=n_positions + 1)
    # c[q] = Σ_{n > q} histogram[n]: a suffix sum.
    suffix = histogram.flip(0).cumsum(0).flip(0)
    return suffix[1:].to(torch.float64)


def visible_key_counts(
    n_positions: int,
    window: int | None,
    excluded_keys: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Visible keys per query position of a window without padding: ``[T]`` float64.

    ``min(q + 1, w)`` minus the excluded keys in ``[max(0, q - w + 1), q]``, via a prefix
    sum of the excluded flags.
    """
    window = _effective_window(window, n_positions)
    excluded = _excluded_flags(n_positions, excluded_keys, device).to(torch.float64)
    before = torch.cat([excluded.new_zeros(1), excluded.cumsum(0)])  # before[n] = Σ_{k<n}
    query = torch.arange(n_positions, device=device)
    first = torch.zeros_like(query) if window is None else (query - window + 1).clamp_min(0)
    allowed = (query - first + 1).to(torch.float64)
    return allowed - (before[query + 1] - before[first])


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in page-locked memory where CUDA runs, so that its copies to the device are asynchronous
    (a copy from pageable memory waits for the device); the tensor itself elsewhere."""
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def _check_key_bins(
    key_bin: torch.Tensor | None, n_key_bins: int | None, n_positions: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``key_bin`` as a ``[T]`` long tensor of non-decreasing bins in ``[0, K)``, and ``K``.

    The values are checked where they are on the CPU. Bins already on an accelerator are taken as
    they are (their length is checked): reading them back would cost three device-to-host syncs
    per layer, and :class:`~equivariance_probe.statistics.attention.AttentionStatistics` checks its
    bins on the host (:func:`mask_counts`) before copying them to the device once per batch.
    """
    if key_bin is None:
        key_bin = torch.arange(n_positions, device=device)
    key_bin = torch.as_tensor(key_bin).long().reshape(-1)
    if key_bin.numel() != n_positions:
        raise InputError(f"key_bin has {key_bin.numel()} entries for {n_positions} key positions")
    if n_key_bins is None:
        n_key_bins = int(key_bin.max()) + 1 if n_positions else 0
    n_key_bins = int(n_key_bins)
    if n_positions and key_bin.device.type == "cpu":
        if int(key_bin.min()) < 0 or int(key_bin.max()) >= n_key_bins:
            raise InputError(f"key_bin values must lie in [0, {n_key_bins})")
        if n_positions > 1 and bool((key_bin[1:] < key_bin[:-1]).any()):
            raise InputError("key_bin must be non-decreasing (each bin a contiguous range of keys)")
    return key_bin.to(device=device, non_blocking=True), n_key_bins


def mask_counts(
    lengths: torch.Tensor,
    n_positions: int,
    *,
    window: int | None = None,
    excluded_keys: Sequence[int] = (),
    key_bin: torch.Tensor | None = None,
    n_key_bins: int | None = None,
    causal: bool = True,
) -> dict[str, torch.Tensor]:
    """The sums that depend on the mask alone, in closed form (per head, float64).

    With ``causal=False`` (a bidirectional encoder) see :func:`bidirectional_mask_counts`; the
    rest of this docstring is the causal mask's.

    No ``[T, T]`` mask is built: everything follows from ``c[q]`` (the number of windows
    covering position ``q``, :func:`windows_covering`), prefix sums of the excluded-key
    flags, of ``c`` and of ``c·u``, with ``u(q) = 1/|V(q)|`` the uniform prior
    (:func:`uniform_prior`; padding and exclusions do not change ``u``). Write ``E`` for
    the excluded keys, ``w`` for the window (``∞`` without one) and ``[·]`` for 1 if true.

    - ``query_count[q] = c[q]·(min(q + 1, w) - |E ∩ [q - w + 1, q]|)``: visible entries
      per query position, summed over windows.
    - ``doc_lag_count[b, dt] = [dt < min(w, L_b)]·(L_b - dt - |E ∩ [0, L_b - dt)|)``: the
      keys ``t ∉ E`` with ``t + dt < L_b``.
    - ``lag_count[dt] = Σ_b doc_lag_count[b, dt]``.
    - ``lag_prior_sum[dt] = [dt < w]·(Σ_{q >= dt} c[q]·u(q) - Σ_{e ∈ E} c[e + dt]·u(e + dt))``:
      ``Σ u(t + dt)`` over the same entries.
    - ``key_lag_count[κ, dt] = [dt < w]·Σ_{t ∈ bin κ, t ∉ E} c[t + dt]`` and
      ``key_lag_prior_sum[κ, dt] = [dt < w]·Σ_{t ∈ bin κ, t ∉ E} c[t + dt]·u(t + dt)``,
      each a difference of two prefix sums minus the excluded keys' terms.

    Cost ``O(B·T + (K + |E|)·T)``. Counts are exact (integers in float64), and the prior
    sums are exactly 0 wherever the counts are. Otherwise the prior sums carry the
    rounding of the prefix sums: about 1e-16 relative for ``lag_prior_sum`` (a suffix
    sum of positive terms) and up to about ``T·log(T)·1e-16`` relative for
    ``key_lag_prior_sum`` (a difference of two prefix sums; 1e-11 at ``T = 8192``).

    Args:
        lengths: ``[B]`` real tokens per window.
        n_positions: ``T``.
        window: sliding window width or ``None``.
        excluded_keys: key positions left out of the statistics.
        key_bin, n_key_bins: key bins as in :func:`attention_sums_from_qk`.

    Returns:
        float64 on ``lengths.device``: ``query_count: [T]``, ``doc_lag_count: [B, T]``,
        ``lag_count: [T]``, ``lag_prior_sum: [T]``, ``key_lag_count: [K, T]``,
        ``key_lag_prior_sum: [K, T]``, ``windows_covering: [T]``. All are per head:
        the head-summed ``key_lag_sum`` of the attention sums matches ``H·key_lag_count``.
    """
    if not causal:
        check_window_kind(_effective_window(window, n_positions), causal)
        return bidirectional_mask_counts(lengths, n_positions, excluded_keys=excluded_keys, key_bin=key_bin,
                                         n_key_bins=n_key_bins)
    device = lengths.device
    n = int(n_positions)
    lengths = lengths.long().reshape(-1)
    if bool(((lengths < 0) | (lengths > n)).any()):
        raise InputError(f"lengths must lie in [0, {n}]")
    window = _effective_window(window, n)
    key_bin, n_key_bins = _check_key_bins(key_bin, n_key_bins, n, device)
    excluded = sorted({int(k) for k in excluded_keys if 0 <= int(k) < n})
    return _causal_mask_counts(lengths, n, window, excluded, key_bin, n_key_bins)


def _causal_mask_counts(
    lengths: torch.Tensor, n: int, window: int | None, excluded: list[int], key_bin: torch.Tensor, n_key_bins: int
) -> dict[str, torch.Tensor]:
    """:func:`mask_counts` of a causal mask, from validated arguments (``excluded`` inside ``[0, T)``, sorted)."""
    device = lengths.device
    f64 = torch.float64
    lag = torch.arange(n, device=device)
    in_window = torch.ones(n, dtype=torch.bool, device=device) if window is None else lag < window

    covering = windows_covering(lengths, n)  # [T]
    prior = uniform_prior(n, window, device)
    weighted = covering * prior  # c[q]·u(q)
    out = {
        "windows_covering": covering,
        "query_count": covering * visible_key_counts(n, window, excluded, device),
    }

    # Per window and lag: keys t in [0, L_b - dt), minus the excluded ones among them.
    excluded_before = torch.cat(
        [torch.zeros(1, dtype=f64, device=device), _excluded_flags(n, excluded, device).to(f64).cumsum(0)]
    )
    span = (lengths.view(-1, 1) - lag.view(1, -1)).clamp(0, n)  # [B, T]: L_b - dt, at least 0
    doc_lag = (span.to(f64) - excluded_before[span]) * in_window.to(f64)
    out["doc_lag_count"] = doc_lag
    out["lag_count"] = doc_lag.sum(0)

    # The excluded keys' terms x[e + dt] (0 where e + dt >= T), one row per key: [|E|, T].
    excluded_index = torch.tensor(excluded, dtype=torch.long, device=device).view(-1, 1)
    shifted = excluded_index + lag.view(1, -1)
    outside = shifted >= n
    shifted = shifted.clamp(max=max(n - 1, 0))
    zero = torch.zeros((), dtype=f64, device=device)

    def excluded_terms(values: torch.Tensor) -> torch.Tensor:
        return torch.where(outside, zero, values[shifted])

    # Σ_{q >= dt} c[q]·u(q) by a suffix sum (positive terms, accurate). Where no entry
    # is left (every remaining key excluded) the subtraction would leave a rounding
    # residue instead of 0: the exact counts say where the sums are 0.
    lag_prior = weighted.flip(0).cumsum(0).flip(0) - excluded_terms(weighted).sum(0)
    out["lag_prior_sum"] = torch.where(in_window & (out["lag_count"] > 0), lag_prior.clamp_min(0), zero)

    # Key bins: Σ_{t=s}^{e-1} x[t + dt] = X[e + dt] - X[s + dt], X the prefix sum of x
    # padded with zeros beyond T (positions past the window hold no real query).
    starts = torch.searchsorted(key_bin, torch.arange(n_key_bins, device=device))
    ends = torch.searchsorted(key_bin, torch.arange(n_key_bins, device=device), right=True)

    def binned(values: torch.Tensor) -> torch.Tensor:
        prefix = torch.zeros(2 * n + 1, dtype=f64, device=device)
        prefix[1 : n + 1] = values.cumsum(0)
        prefix[n + 1 :] = prefix[n]
        totals = prefix[ends.view(-1, 1) + lag.view(1, -1)] - prefix[starts.view(-1, 1) + lag.view(1, -1)]
        totals.index_add_(0, key_bin[excluded_index.view(-1)], -excluded_terms(values))
        return torch.where(in_window.view(1, -1), totals, zero)

    out["key_lag_count"] = binned(covering)
    out["key_lag_prior_sum"] = torch.where(out["key_lag_count"] > 0, binned(weighted).clamp_min(0), zero)
    return out


def bidirectional_mask_counts(
    lengths: torch.Tensor,
    n_positions: int,
    *,
    excluded_keys: Sequence[int] = (),
    key_bin: torch.Tensor | None = None,
    n_key_bins: int | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`mask_counts` for a bidirectional encoder: every real token of a window sees every real one.

    Window ``b`` has ``L_b`` real tokens and ``n_b = L_b - |E ∩ [0, L_b)|`` visible keys per
    real query, whatever the query. Its uniform prior ``u_b = 1/L_b`` (a head spreading evenly
    over the keys the model lets it see; excluded keys stay in the model's softmax, as in the
    causal prior) does not depend on the query position. Lags are signed, ``dt ∈ [-(T-1), T-1]`` at index ``dt + T - 1``; the keys of
    lag ``dt`` in window ``b`` are ``k ∈ [max(0, -dt), min(L_b, L_b - dt))`` minus ``E``.

    - ``query_count[q] = Σ_b [q < L_b]·n_b``;
    - ``doc_lag_count[b, dt]`` = the keys above; ``lag_count[dt] = Σ_b doc_lag_count[b, dt]``;
    - ``lag_prior_sum[dt] = Σ_b doc_lag_count[b, dt]·u_b``;
    - ``key_lag_count[κ, dt]`` and ``key_lag_prior_sum[κ, dt]``: the same restricted to the keys
      of bin ``κ`` (without and with the weight ``u_b``), per distinct window length.

    Cost ``O(B·T + B'·K·T)`` with ``B'`` distinct lengths. Counts are exact integers in float64.

    Returns:
        float64 on ``lengths.device``: ``query_count: [T]``, ``doc_lag_count: [B, 2T-1]``,
        ``lag_count, lag_prior_sum: [2T-1]``, ``key_lag_count, key_lag_prior_sum: [K, 2T-1]``,
        ``windows_covering: [T]``, and ``visible_per_window: [B]`` (``n_b``).
    """
    device = lengths.device
    n = int(n_positions)
    lengths = lengths.long().reshape(-1)
    if bool(((lengths < 0) | (lengths > n)).any()):
        raise InputError(f"lengths must lie in [0, {n}]")
    key_bin, n_key_bins = _check_key_bins(key_bin, n_key_bins, n, device)
    excluded = sorted({int(k) for k in excluded_keys if 0 <= int(k) < n})
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=device)
    before = torch.cat([torch.zeros(1, dtype=f64, device=device), _excluded_flags(n, excluded, device).to(f64).cumsum(0)])

    def keys_between(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """Keys in ``[low, high)`` that are not excluded (0 for an empty range); any shapes."""
        low = low.clamp(0, n)
        high = torch.maximum(high.clamp(0, n), low)
        return (high - low).to(f64) - (before[high] - before[low])

    visible = keys_between(torch.zeros_like(lengths), lengths)  # n_b, [B]
    prior = torch.where(lengths > 0, 1.0 / lengths.clamp_min(1).to(f64), zero)  # u_b = 1/L_b
    covering = windows_covering(lengths, n)
    real = torch.arange(n, device=device).view(1, -1) < lengths.view(-1, 1)  # [B, T]
    dt = lag_values(n, causal=False).to(device).view(1, -1)  # [1, 2T-1]
    length = lengths.view(-1, 1)
    doc_lag = keys_between((-dt).clamp_min(0), torch.minimum(length, length - dt))  # [B, 2T-1]
    out = {
        "windows_covering": covering,
        "query_count": (real.to(f64) * visible.view(-1, 1)).sum(0),
        "doc_lag_count": doc_lag,
        "lag_count": doc_lag.sum(0),
        "lag_prior_sum": (doc_lag * prior.view(-1, 1)).sum(0),
        "visible_per_window": visible,
    }
    starts = torch.searchsorted(key_bin, torch.arange(n_key_bins, device=device)).view(-1, 1)  # [K, 1]
    ends = torch.searchsorted(key_bin, torch.arange(n_key_bins, device=device), right=True).view(-1, 1)
    key_count = torch.zeros((n_key_bins, dt.shape[1]), dtype=f64, device=device)
    key_prior = torch.zeros_like(key_count)
    distinct, multiplicity = torch.unique(lengths, return_counts=True)
    for size, times in zip(distinct.tolist(), multiplicity.tolist()):
        # Keys of bin κ with lag dt in a window of `size` tokens: [max(s_κ, -dt), min(e_κ, size, size - dt)).
        count = keys_between(torch.maximum(starts, (-dt).clamp_min(0)), torch.minimum(ends.clamp(max=size), size - dt))
        key_count += times * count
        if size > 0:
            key_prior += (times / size) * count
    out["key_lag_count"] = key_count
    out["key_lag_prior_sum"] = key_prior
    return out


def key_bin_edges(n_positions: int, n_bins: int) -> torch.Tensor:
    """Edges of ``n_bins`` contiguous key bins over ``[0, T)``: ``[n_bins + 1]`` long.

    ``round(linspace(0, T, n_bins + 1))``: bin ``i`` holds keys ``edges[i] <= t < edges[i+1]``
    (every bin non-empty when ``n_bins <= T``). With ``n_bins`` a multiple of ``b``, every ``b``-th
    edge is exactly the edge of ``b`` bins, so coarser bins are sums of stored ones.
    """
    return torch.linspace(0, n_positions, n_bins + 1, dtype=torch.float64).round().long()


def key_bins(n_positions: int, n_bins: int = KEY_BINS, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """The bin of every key position and the number of bins: ``([T] long, K)`` with ``K = min(T, n_bins)``."""
    count = max(1, min(int(n_positions), int(n_bins)))
    edges = key_bin_edges(n_positions, count).to(device)
    bins = torch.searchsorted(edges, torch.arange(n_positions, device=device), right=True) - 1
    return bins.clamp(0, count - 1), count
