"""The shift test's two-way decomposition and divergences: pure functions of float64 sums.

Place in the seams: *maths*, numpy only. The sums come from
:class:`~equivariance_probe.statistics.shift.ShiftStatistics`; :class:`~equivariance_probe.ShiftResult`
turns them into shares with intervals.

The design (docs/methods.md#shift-design): segment ``g`` (a text of ``m`` tokens) is placed after the
first ``s`` tokens of context ``f``, for every ``f`` of ``F`` contexts and ``s`` of ``S`` offsets (a balanced
grid). For one layer and head, ``Y[g, f, s, e]`` is a representation at entry ``e`` of the segment
(a pair of segment tokens ``(i, j)`` for attention, ``(i, d)`` for the residual stream). With
``Ȳ_ge`` the entry's mean over the grid, ``Ȳ_ges·`` its mean over contexts at offset ``s``, ``Ȳ_ge·f``
its mean over offsets in context ``f`` and ``Ȳ`` the mean of everything:

* ``SS_all     = Σ (Y − Ȳ)²``
* ``SS_pair    = Σ_{g,e} F·S·(Ȳ_ge − Ȳ)²``              (what depends only on the entry: equivariant)
* ``SS_offset  = Σ_{g,e} F·Σ_s (Ȳ_ges· − Ȳ_ge)²``
* ``SS_context = Σ_{g,e} S·Σ_f (Ȳ_ge·f − Ȳ_ge)²``
* ``SS_residual = SS_all − SS_pair − SS_offset − SS_context = Σ (Y − Ȳ_ges· − Ȳ_ge·f + Ȳ_ge)²``

Streaming form. Per segment the sums :data:`DECOMPOSITION_SUMS` are formed with the entry means of that
segment (exactly: the segment's grid is complete before they are taken), so they add over segments:
``count = Σ F·S`` (values), ``total = Σ Y``, ``cell_square = Σ_{g,e} F·S·Ȳ_ge²``,
``within = Σ (Y − Ȳ_ge)²``, ``offset`` and ``context`` as above. Then
``SS_pair = cell_square − total²/count`` and ``SS_all = within + SS_pair``. The one cancellation is in
``SS_pair``, across entries, whose spread is the content structure itself (large); centred logits have
``Ȳ = 0`` in exact arithmetic, so there is none.

A vector-valued representation (the residual stream, entries ``(i, d)``) is centred on its mean *vector*:
``Ȳ`` above is replaced by ``Ȳ_d``, the mean of hidden dimension ``d`` over the grid and the segment's tokens,
so ``SS_all = Σ ‖Y − Ȳ_·‖²`` and ``SS_pair = Σ_{g,i} F·S·‖Ȳ_gi − Ȳ_·‖²``, as multivariate analysis of
variance takes them (the offset and context terms are deviations within an entry already, and unchanged).
One grand mean over tokens *and* dimensions would add ``N_d·Σ_d (Ȳ_d − Ȳ)²`` to both, the spread of the mean
vector's coordinates: a constant of the basis that nothing in the grid moves, which a shift of the origin or a
rotation of the hidden basis changes. In sums: with ``total_by_dim = Σ Y`` per dimension and ``n_d = count/D``
values per dimension, ``centre_square = Σ_d total_d²/n_d`` (:func:`centre_about_mean_vector`) takes the place of
``total²/count`` in ``SS_pair``.

Shares: ``η²_X = SS_X / SS_all``. An aggregate (a layer, a layer group, the model) sums the SS of its heads
first: a ratio of sums, never a mean of ratios. Where ``SS_all`` is zero (every value equal: all-zero
weights) or below float64 cancellation of the values' second moment, the shares are undefined: NaN here,
``None`` with a reason in the result's tables. The size of the offset effect, in the representation's own
unit (nats for logits), is its root mean square ``√(SS_offset / count)`` over ``(g, e, s)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import InputError, check_choice

__all__ = [
    "DECOMPOSITION_SUMS",
    "TERMS",
    "SHARES",
    "decomposition_sums",
    "vector_decomposition_sums",
    "centre_about_mean_vector",
    "decomposition",
    "shares",
    "offset_rms",
    "aggregate",
    "jensen_shannon",
    "SINK_PARTS",
    "sink_mass",
    "MASSIVE_PARTS",
    "massive_activations",
    "UNDEFINED_TOLERANCE",
    "component_grams_reference",
    "component_contributions",
    "gram_sum_of_squares",
    "component_shares",
    "identity_difference",
    "IDENTITY_FLOOR",
]

#: The additive sums behind the decomposition (each ``[..., layer, head]``), in the order they are stored.
DECOMPOSITION_SUMS = ("count", "total", "cell_square", "within", "offset", "context")
#: The terms of the decomposition.
TERMS = ("all", "pair", "offset", "context", "residual")
#: The shares ``η²`` a result reports (each ``SS_X / SS_all``).
SHARES = ("offset", "context", "pair", "residual")
#: ``SS_all`` at or below this fraction of ``Σ Y²`` is float64 cancellation, not spread: the shares are undefined.
UNDEFINED_TOLERANCE = 1e-13


def decomposition_sums(values: np.ndarray) -> dict[str, np.ndarray]:
    """The additive sums of one or more segments' complete grids, by brute force.

    Args:
        values: ``[G, F, S, ..., E]`` the representation of ``G`` segments on the ``F × S`` grid, any
            axes (layer, head) between the grid and the entries ``E``.

    Returns:
        :data:`DECOMPOSITION_SUMS`, each ``[...]`` (summed over segments and entries).
    """
    y = np.asarray(values, dtype=np.float64)
    if y.ndim < 4:
        raise InputError(f"values must be [segment, context, offset, ..., entry], got shape {y.shape}")
    n_contexts, n_offsets = y.shape[1], y.shape[2]
    cell = y.mean(axis=(1, 2))                       # [G, ..., E]
    by_offset = y.mean(axis=1)                       # [G, S, ..., E]
    by_context = y.mean(axis=2)                      # [G, F, ..., E]
    weight = n_contexts * n_offsets
    sum_entries = lambda x, lead: x.sum(axis=tuple(range(lead))).sum(-1)  # noqa: E731
    return {
        "count": np.full(cell.shape[1:-1], float(weight * y.shape[0] * y.shape[-1])),
        "total": sum_entries(y, 3),
        "cell_square": weight * sum_entries(cell * cell, 1),
        "within": sum_entries((y - cell[:, None, None]) ** 2, 3),
        "offset": n_contexts * sum_entries((by_offset - cell[:, None]) ** 2, 2),
        "context": n_offsets * sum_entries((by_context - cell[:, None]) ** 2, 2),
    }


def vector_decomposition_sums(values: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`decomposition_sums` of a vector-valued representation, by brute force, with ``total_by_dim``.

    Args:
        values: ``[G, F, S, ..., I, D]``: ``I`` tokens, each a vector of ``D`` hidden dimensions.

    Returns:
        :data:`DECOMPOSITION_SUMS` over the entries ``(i, d)``, each ``[...]``, and ``"total_by_dim": [..., D]``.
    """
    y = np.asarray(values, dtype=np.float64)
    if y.ndim < 5:
        raise InputError(f"values must be [segment, context, offset, ..., token, dimension], got shape {y.shape}")
    sums = decomposition_sums(y.reshape(*y.shape[:-2], -1))
    sums["total_by_dim"] = y.sum(axis=(0, 1, 2)).sum(-2)
    return sums


def centre_about_mean_vector(sums: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``sums`` of a vector-valued representation (each of ``count``'s shape, and ``total_by_dim`` of as many
    values times ``D``: ``[..., layer, 1]`` and ``[..., layer, D]`` as a run streams them) with
    ``centre_square = Σ_d total_d² / n_d`` (``count``'s shape, ``n_d = count / D``) in place of
    ``total_by_dim``, so that :func:`decomposition` takes ``SS_pair`` and ``SS_all`` about the mean vector of each
    layer; added up over layers by :func:`aggregate` like every other sum, since each layer has its own mean."""
    by_dim = np.asarray(sums["total_by_dim"], dtype=np.float64)
    count = np.asarray(sums["count"], dtype=np.float64)
    per_dim = count / max(by_dim.shape[-1], 1)
    square = (by_dim * by_dim).sum(-1).reshape(count.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        centre = np.where(per_dim > 0, square / np.where(per_dim > 0, per_dim, 1.0), 0.0)
    return {**{name: value for name, value in sums.items() if name != "total_by_dim"}, "centre_square": centre}


def decomposition(sums: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{"all", "pair", "offset", "context", "residual"}`` sums of squares from :data:`DECOMPOSITION_SUMS`
    (any shape, elementwise); ``SS_all = SS_pair + SS_offset + SS_context + SS_residual`` exactly. With
    ``centre_square`` among the sums (:func:`centre_about_mean_vector`), ``SS_pair`` is taken about the mean
    vector; otherwise about the grand mean ``total / count``."""
    count = np.asarray(sums["count"], dtype=np.float64)
    total = np.asarray(sums["total"], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        centre = (np.asarray(sums["centre_square"], dtype=np.float64) if "centre_square" in sums
                  else total * total / np.where(count > 0, count, 1.0))
        pair = np.where(count > 0, sums["cell_square"] - centre, 0.0)
    pair = np.maximum(pair, 0.0)
    everything = np.asarray(sums["within"], dtype=np.float64) + pair
    offset = np.asarray(sums["offset"], dtype=np.float64)
    context = np.asarray(sums["context"], dtype=np.float64)
    return {"all": everything, "pair": pair, "offset": offset, "context": context,
            "residual": everything - pair - offset - context}


def _defined(sums: Mapping[str, np.ndarray], everything: np.ndarray) -> np.ndarray:
    """Where the shares are defined: ``SS_all`` above float64 cancellation of ``Σ Y² = cell_square + within``."""
    scale = np.asarray(sums["cell_square"], dtype=np.float64) + np.asarray(sums["within"], dtype=np.float64)
    return everything > UNDEFINED_TOLERANCE * scale


def shares(sums: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``η²`` of each term of :data:`SHARES` (elementwise over the sums' shape), NaN where undefined."""
    terms = decomposition(sums)
    defined = _defined(sums, terms["all"])
    denominator = np.where(defined, terms["all"], 1.0)
    return {name: np.where(defined, terms[name] / denominator, np.nan) for name in SHARES}


def offset_rms(sums: Mapping[str, np.ndarray]) -> np.ndarray:
    """``√(SS_offset / count)``: the root mean square of the offset effect ``Ȳ_ges· − Ȳ_ge`` over
    ``(g, e, s)``, in the representation's own unit; NaN where nothing was counted."""
    count = np.asarray(sums["count"], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, np.sqrt(np.asarray(sums["offset"]) / np.where(count > 0, count, 1.0)), np.nan)


def aggregate(sums: Mapping[str, np.ndarray], by: str | None,
              layer_groups: Mapping[str, Sequence[int]] | None = None) -> dict[str, np.ndarray] | dict[str, dict[str, np.ndarray]]:
    """Sums ``[..., layer, head]`` summed to ``by``: ``"head"`` (as given), ``"layer"`` (``[..., layer]``),
    ``None`` (``[...]``, the model) or ``"layer_group"`` (``{group: sums [...]}``)."""
    check_choice("by", by, ("head", "layer", None, "layer_group"))
    if by == "head":
        return {name: np.asarray(value) for name, value in sums.items()}
    if by == "layer":
        return {name: np.asarray(value).sum(-1) for name, value in sums.items()}
    if by is None:
        return {name: np.asarray(value).sum((-2, -1)) for name, value in sums.items()}
    if not layer_groups:
        raise InputError("by='layer_group' needs the model's layer groups")
    return {group: {name: np.asarray(value)[..., list(layers), :].sum((-2, -1)) for name, value in sums.items()}
            for group, layers in layer_groups.items()}


def jensen_shannon(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """``JS(p, q) = ½·KL(p ‖ m) + ½·KL(q ‖ m)``, ``m = (p + q)/2``, in nats, over the last axis.

    Args:
        log_p, log_q: ``[..., vocab]`` log-probabilities (normalised; ``-inf`` for zero mass).

    Returns:
        ``[...]``, in ``[0, log 2]``; 0 for equal distributions.
    """
    log_p = np.asarray(log_p, dtype=np.float64)
    log_q = np.asarray(log_q, dtype=np.float64)
    log_m = np.logaddexp(log_p, log_q) - np.log(2.0)
    p, q = np.exp(log_p), np.exp(log_q)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (log_p - log_m), 0.0) + np.where(q > 0, q * (log_q - log_m), 0.0)
    return np.clip(0.5 * terms.sum(-1), 0.0, np.log(2.0))


#: The parts of a segment row's attention that :func:`sink_mass` reports: on the window's first key, on the rest of
#: the text before the segment, and on the segment itself (``1 −`` the other two).
SINK_PARTS = ("first_key", "preceding", "segment")


def sink_mass(first_key: np.ndarray, preceding: np.ndarray, rows: np.ndarray, part: str, by: str | None,
              layer_groups: Mapping[str, Sequence[int]] | None = None) -> np.ndarray | dict[str, np.ndarray]:
    """The mean attention weight of the segment's rows on one part of the window, per offset.

    With ``a_ik`` row ``i``'s weight on key ``k`` and the segment starting at position ``t``:
    ``first_key = mean a_i0`` (0 where ``t = 0``), ``preceding = mean Σ_{0<k<t} a_ik`` and
    ``segment = 1 − first_key − preceding``, the mean over contexts, segments, the segment's rows and the heads
    of the aggregate (every head counts once per row).

    Args:
        first_key, preceding: ``[..., layer, head, offset]`` the sums of the rows' weights on the first key and
            on the rest of the text before the segment.
        rows: ``[..., layer, offset]`` the rows behind them.
        part: one of :data:`SINK_PARTS`.
        by: ``"head"`` (``[..., layer, head, offset]``), ``"layer"`` (``[..., layer, offset]``), ``None``
            (``[..., offset]``: every layer and head) or ``"layer_group"`` (``{group: [..., offset]}``).
        layer_groups: ``{group: layer indices}`` for ``"layer_group"``.

    Returns:
        The means; NaN where no row was counted.
    """
    check_choice("part", part, SINK_PARTS)
    check_choice("by", by, ("head", "layer", None, "layer_group"))
    if by == "layer_group":
        if not layer_groups:
            raise InputError("by='layer_group' needs the model's layer groups")
        return {group: _sink_mean(first_key[..., list(layers), :, :], preceding[..., list(layers), :, :],
                                  rows[..., list(layers), :], part, None) for group, layers in layer_groups.items()}
    return _sink_mean(first_key, preceding, rows, part, by)


def _sink_mean(first_key: np.ndarray, preceding: np.ndarray, rows: np.ndarray, part: str, by: str | None
               ) -> np.ndarray:
    heads = first_key.shape[-2]
    if by == "head":
        weights, count = {"first_key": first_key, "preceding": preceding}, rows[..., None, :]
    elif by == "layer":
        weights, count = {"first_key": first_key.sum(-2), "preceding": preceding.sum(-2)}, heads * rows
    else:
        weights, count = ({"first_key": first_key.sum((-3, -2)), "preceding": preceding.sum((-3, -2))},
                          heads * rows.sum(-2))
    with np.errstate(invalid="ignore", divide="ignore"):
        means = {name: value / count for name, value in weights.items()}
    return 1.0 - means["first_key"] - means["preceding"] if part == "segment" else means[part]
def component_grams_reference(values: np.ndarray) -> dict[str, np.ndarray]:
    """The attribution's Gram matrices of one segment's grid, by brute force (the reference the streaming sums
    are tested against).

    Args:
        values: ``[C, F, S, m, d]``: component ``c`` at context ``f``, offset ``s``, segment token ``i``.

    Returns:
        ``{"offset": K_off, "context": K_ctx}``, each ``[C, C]``: with ``δ_s(c) = mean_f c[f, s] − mean_{f,s} c`` and
        ``δ_f(c) = mean_s c[f, s] − mean_{f,s} c`` (vectors over ``(i, d)``),
        ``K_off[c, c'] = F·Σ_s ⟨δ_s(c), δ_s(c')⟩`` and ``K_ctx[c, c'] = S·Σ_f ⟨δ_f(c), δ_f(c')⟩``.
    """
    values = np.asarray(values, dtype=np.float64)
    n, contexts, offsets = values.shape[:3]
    flat = values.reshape(n, contexts, offsets, -1)
    grand = flat.mean((1, 2), keepdims=True)
    by_offset = (flat.mean(1, keepdims=True) - grand)[:, 0].reshape(n, -1)       # [C, S·E]
    by_context = (flat.mean(2, keepdims=True) - grand)[:, :, 0].reshape(n, -1)   # [C, F·E]
    return {"offset": contexts * by_offset @ by_offset.T, "context": offsets * by_context @ by_context.T}


def component_contributions(gram: np.ndarray, rows: Sequence[int], columns: Sequence[int]) -> np.ndarray:
    """``C_c = Σ_{c' ∈ columns} K[c, c']`` for each ``c`` of ``rows``: ``[..., len(rows)]`` of ``gram [..., C, C]``.

    When ``columns`` are the components whose sum is the residual stream after a block (the embedding and every
    attention and MLP up to it), ``C_c`` is component ``c``'s part of the residual stream's offset (context) sum
    of squares: ``SS(r) = Σ ⟨δ(r), δ(r)⟩ = Σ_c ⟨δ(c), δ(r)⟩`` because ``δ`` is linear and ``r = Σ_c c``. A head is
    a part of its attention (the heads' pieces and the output projection's bias, which does not move, add up to
    it), so its row gives its part of the attention's."""
    gram = np.asarray(gram, dtype=np.float64)
    return gram[..., list(rows), :][..., list(columns)].sum(-1)


def gram_sum_of_squares(gram: np.ndarray, columns: Sequence[int]) -> np.ndarray:
    """``SS(r) = Σ_{c, c' ∈ columns} K[c, c']``: the sum of squares of the sum of the ``columns`` components."""
    return component_contributions(gram, columns, columns).sum(-1)


def component_shares(gram: np.ndarray, rows: Sequence[int], columns: Sequence[int]) -> np.ndarray:
    """``C_c / SS(r)`` (:func:`component_contributions`, :func:`gram_sum_of_squares`): each component's share of
    the residual stream's sum of squares, ``[..., len(rows)]``; the block-level components' shares sum to 1, and a
    share can be negative (a component that cancels what the others write). NaN where ``SS(r)`` is 0."""
    total = gram_sum_of_squares(gram, columns)
    parts = component_contributions(gram, rows, columns)
    defined = np.asarray(total) > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(defined[..., None], parts / np.where(defined, total, 1.0)[..., None], np.nan)


#: The identity check's floor on its scale, as a fraction of the residual stream's whole sum of squares: a term
#: smaller than this (nothing moves: the context term of a model whose contexts are all one token) is judged
#: against it, since the context Gram's streaming form (a difference of two sums over the grid) carries float64
#: rounding of the offset's size, measured at 4e-16 of the whole on such a tiny GPT-2.
IDENTITY_FLOOR = 1e-6


def identity_difference(gram: np.ndarray, columns: Sequence[int], sum_of_squares: float, total: float = 0.0) -> float:
    """``|Σ_c C_c − SS| / max(SS, Σ_c K[c, c], IDENTITY_FLOOR·SS_all)``: how far the components' contributions (from
    the Gram matrix) are from the residual stream's own sum of squares ``SS`` (measured from the block's output).

    The scale is the larger of ``SS`` and the components' own sums of squares, since rounding grows with the
    components (where they cancel, ``SS`` is small and its rounding is theirs), but at least
    :data:`IDENTITY_FLOOR` of ``total``, the residual stream's whole sum of squares ``SS_all``: a term that
    nothing moves is rounding, and so is its difference. 0 where every scale is 0 and so is the difference. Beyond
    rounding it says the residual stream is not the sum of the components (a norm after the addition, as in BERT's
    blocks)."""
    gram = np.asarray(gram, dtype=np.float64)
    columns = list(columns)
    found = float(gram_sum_of_squares(gram, columns))
    scale = max(abs(float(sum_of_squares)), float(np.trace(gram[np.ix_(columns, columns)])),
                IDENTITY_FLOOR * abs(float(total)))
    if scale == 0:
        return 0.0 if found == float(sum_of_squares) else float("inf")
    return abs(found - float(sum_of_squares)) / scale


#: What :func:`massive_activations` reports: the mean over windows of the largest residual magnitude at the segment's
#: first token (``first``) and at its other tokens (``rest``), the mean median magnitude (``median``), and each
#: largest over the median (``first_ratio``, ``rest_ratio``: ratios of the means, as Sun et al. 2024 report them).
MASSIVE_PARTS = ("first", "rest", "median", "first_ratio", "rest_ratio")


def massive_activations(first: np.ndarray, rest: np.ndarray, median: np.ndarray, windows: np.ndarray, part: str
                        ) -> np.ndarray:
    """One part of the residual stream's largest magnitudes at the segment, per layer and offset.

    Args:
        first, rest, median: ``[..., layer, offset]`` the sums over windows of ``max_d |h[0, d]|``, of
            ``max_{i ≥ 1, d} |h[i, d]|`` and of the median ``|h|`` at the segment's tokens.
        windows: ``[..., layer, offset]`` the windows behind them.
        part: one of :data:`MASSIVE_PARTS`.

    Returns:
        ``[..., layer, offset]``; NaN where no window (or a zero median) was counted.
    """
    check_choice("part", part, MASSIVE_PARTS)
    sums = {"first": first, "rest": rest, "median": median}
    with np.errstate(invalid="ignore", divide="ignore"):
        if part.endswith("_ratio"):
            numerator = sums[part.removesuffix("_ratio")]
            return np.where(median > 0, numerator / np.where(median > 0, median, 1.0), np.nan)
        return np.where(windows > 0, sums[part] / np.where(windows > 0, windows, 1.0), np.nan)
