"""The shift test's sums as torch-only functions: one implementation for a segment summed here or where the model runs.

Place in the seams: *statistics*, beside :mod:`~.in_trace`. :class:`~equivariance_probe.statistics.shift.SegmentGrid`
calls these functions for a segment whose blocks come back window by window; a remote nnsight model's whole
``F × S`` grid is summed by the same functions inside one nnsight session on the server
(:mod:`~equivariance_probe.adapters.nnsight_remote`), which ships them by value. So they use torch, math and
builtins alone, and their state is plain dicts, lists and tensors.

The state of one segment's grid, for one representation and layer (a *cell*), keeps for every entry ``e``
(Welford's shift: ``c_e``, the entry's first value, is subtracted before squaring, so no sum of squares
cancels): ``shift = c [head, E]``, ``by_offset = Σ_f Y[f, s, e] [head, S, E]``, ``deviation = Σ (Y − c)``,
``square = Σ (Y − c)²``, ``context_row`` (the current context's ``Σ_s (Y − c)``) and
``context_square = Σ_f (Σ_s (Y − c))²``. :func:`grid_sums` turns the cells into the segment's
:data:`DECOMPOSITION_SUMS` (and, for the residual stream, its sums per hidden dimension);
:func:`add_prediction_sums` adds one window's next-token predictions; :func:`add_sink_sums` adds one window's
attention weights on the text before the segment (the sink mass by offset); :func:`add_massive_sums` adds one
window's largest residual-stream magnitudes at the segment (massive activations by offset).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "Representation",
    "DECLARED_REPRESENTATIONS",
    "REPRESENTATION_UNITS",
    "REPRESENTATION_LABELS",
    "ATTENTION_REPRESENTATIONS",
    "VECTOR_REPRESENTATIONS",
    "REPRESENTATIONS",
    "TOTAL_BY_DIM",
    "DECOMPOSITION_SUMS",
    "PREDICTION_SUMS",
    "counted_entries",
    "segment_representations",
    "add_to_cell",
    "end_context_of_cell",
    "grid_sums",
    "new_prediction_sums",
    "negentropy",
    "next_token_distribution",
    "middle_negentropy",
    "jensen_shannon_from",
    "add_prediction_sums",
    "prediction_log_probs",
    "jensen_shannon_sum_to",
    "PREDICTION_CHUNK",
    "SINK_SUMS",
    "MASSIVE_SUMS",
    "new_massive_sums",
    "add_massive_sums",
    "new_sink_sums",
    "add_sink_sums",
    "ATTRIBUTION_GRAMS",
    "new_component_state",
    "add_component_to_state",
    "end_context_of_components",
    "component_grams",
]

class Representation(NamedTuple):
    """One representation of the segment whose variance the shift test decomposes.

    Attributes:
        name: its key in results, files and options.
        unit: the unit of its values (of :meth:`~equivariance_probe.shift_result.ShiftResult.offset_rms`).
        label: its name in figures and tables.
        vector: whether it is vector-valued (the residual stream): its entries are ``(token, hidden dimension)``,
            and its sums of squares are taken about the mean vector (one mean per hidden dimension), as
            multivariate analysis of variance takes them, so that no share depends on the origin or the
            orientation of the hidden basis. Otherwise it is attention among the segment's tokens
            (``[layer, head]``), computed by :func:`segment_representations`.
    """

    name: str
    unit: str
    label: str
    vector: bool = False


#: Every representation, declared once; the name tuples below (plain strings, which the functions shipped into a
#: remote trace read) and the units and labels are read from it.
DECLARED_REPRESENTATIONS = (
    Representation("centred_logits", "nats", "centred logits"),
    Representation("conditional_weights", "weight", "conditional weights"),
    Representation("raw_weights", "weight", "raw weights"),
    Representation("residual", "residual-stream units", "residual stream", vector=True),
)
#: Attention among the segment's tokens (``[layer, head]``).
ATTENTION_REPRESENTATIONS = tuple(entry.name for entry in DECLARED_REPRESENTATIONS if not entry.vector)
#: Vector-valued representations (``[layer, 1]``): the residual stream.
VECTOR_REPRESENTATIONS = tuple(entry.name for entry in DECLARED_REPRESENTATIONS if entry.vector)
REPRESENTATIONS = ATTENTION_REPRESENTATIONS + VECTOR_REPRESENTATIONS
#: Each representation's unit and label.
REPRESENTATION_UNITS = {entry.name: entry.unit for entry in DECLARED_REPRESENTATIONS}
REPRESENTATION_LABELS = {entry.name: entry.label for entry in DECLARED_REPRESENTATIONS}
#: The extra sum of a vector-valued representation: ``Σ Y`` per ``[layer, hidden dimension]``.
TOTAL_BY_DIM = "total_by_dim"
#: Additive sums of the decomposition (the same names as :data:`~equivariance_probe.maths.shift.DECOMPOSITION_SUMS`).
DECOMPOSITION_SUMS = ("count", "total", "cell_square", "within", "offset", "context")
#: One segment's prediction sums and their shapes in offsets (``1``: ``[O]``, ``2``: ``[O, O]``).
PREDICTION_SUMS = (("nll_sum", 1), ("nll_count", 1), ("js_offset_sum", 2), ("js_offset_count", 2),
                   ("js_context_sum", 1), ("js_context_count", 1))


def counted_entries(segment_length: int, causal: bool, window: int | None) -> torch.Tensor:
    """``[m, m]`` boolean: the entries ``(i, j)`` of the segment block that count: key ``j`` visible to query ``i``
    (causal: ``j ≤ i``; within a sliding window ``w``: ``|i − j| < w``), in rows with at least two such keys."""
    i = torch.arange(segment_length).view(-1, 1)
    j = torch.arange(segment_length).view(1, -1)
    visible = (j <= i) if causal else torch.ones(segment_length, segment_length, dtype=torch.bool)
    if window is not None:
        visible = visible & ((i - j).abs() < window)
    return visible & (visible.sum(-1, keepdim=True) >= 2)


def segment_representations(scores: torch.Tensor, log_normaliser: torch.Tensor, entries: torch.Tensor) -> dict:
    """The three attention representations of a segment block, float64, at its counted entries.

    Args:
        scores: ``[head, m, m]`` pre-softmax scores among the segment's tokens (``softcap(q·kᵀ·scaling)``).
        log_normaliser: ``[head, m]`` ``log Σ_k exp(score_ik)`` over every key the row sees in the window
            (prefix, context and segment), so ``log a_ij = score_ij − log_normaliser_i``.
        entries: ``[m, m]`` boolean, :func:`counted_entries`.

    Returns:
        ``{"centred_logits", "conditional_weights", "raw_weights"}``, each ``[head, E]``:
        ``score_ij − mean_{j'} score_ij'`` (over the row's counted keys; equal to ``log a_ij`` minus its row
        mean, and free of underflow), ``a_ij / Σ_{j'} a_ij'`` and ``a_ij``.
    """
    scores = scores.to(torch.float64)
    mask = entries.to(scores.device)
    hidden = ~mask
    in_row = mask.sum(-1).clamp_min(1).to(torch.float64)
    row_mean = scores.masked_fill(hidden, 0.0).sum(-1) / in_row
    centred = scores - row_mean.unsqueeze(-1)
    conditional = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1).nan_to_num(0.0)
    raw = torch.exp(scores - log_normaliser.to(torch.float64).unsqueeze(-1))
    return {"centred_logits": centred[:, mask], "conditional_weights": conditional[:, mask], "raw_weights": raw[:, mask]}


def add_to_cell(cell: dict, values: torch.Tensor, offset_index: int, n_offsets: int) -> None:
    """Add ``values: [head, E]`` of the current context at one offset to ``cell`` (empty before the first: the
    values become its shift ``c``)."""
    y = values.detach().to(torch.float64)
    if not cell:
        cell["shift"] = y.clone()
        cell["by_offset"] = torch.zeros((y.shape[0], n_offsets, y.shape[1]), dtype=torch.float64, device=y.device)
        for name in ("deviation", "square", "context_row", "context_square"):
            cell[name] = torch.zeros_like(y)
    centred = y - cell["shift"]
    cell["by_offset"][:, offset_index] += y
    cell["deviation"] += centred
    cell["square"] += centred * centred
    cell["context_row"] += centred


def end_context_of_cell(cell: dict) -> None:
    """Close the current context of ``cell``: ``context_square += context_row²``, and a new row."""
    if cell:
        cell["context_square"] += cell["context_row"] * cell["context_row"]
        cell["context_row"].zero_()


def grid_sums(cells: dict, n_layers: int, n_heads: int, n_contexts: int, n_offsets: int,
              hidden_size: int = 0) -> dict:
    """A finished grid's :data:`DECOMPOSITION_SUMS` from its cells (``cells[(representation, layer)]``).

    Returns:
        ``{"{representation}/{name}": [layer, head]}`` float64 on the CPU (``[layer, 1]`` for the residual
        stream; zeros for a layer without a cell), with ``F`` contexts and ``S`` offsets, ``N = F·S`` cells and
        ``Ȳ_e`` the entry's mean: ``count = N·E``, ``total = Σ_e N·Ȳ_e``, ``cell_square = Σ_e N·Ȳ_e²``,
        ``within = Σ (Y − Ȳ_e)²``, ``offset = F·Σ_{e,s} (Ȳ_es − Ȳ_e)²`` and ``context = S·Σ_{e,f} (Ȳ_ef − Ȳ_e)²``.
        With ``hidden_size = d > 0`` also ``"residual/total_by_dim": [layer, d]``, ``Σ_i N·Ȳ_(i, d)``: the
        residual stream's entries ``(i, d)`` summed per hidden dimension, which its sums of squares about the
        mean vector need (:data:`VECTOR_REPRESENTATIONS`).
    """
    cells_in_grid = n_contexts * n_offsets
    out = {}
    for representation in REPRESENTATIONS:
        heads = 1 if representation in VECTOR_REPRESENTATIONS else n_heads
        values = {name: torch.zeros((n_layers, heads), dtype=torch.float64) for name in DECOMPOSITION_SUMS}
        by_dim = (torch.zeros((n_layers, hidden_size), dtype=torch.float64)
                  if representation in VECTOR_REPRESENTATIONS and hidden_size > 0 else None)
        for layer in range(n_layers):
            cell = cells.get((representation, layer))
            if not cell:
                continue
            delta = cell["deviation"] / cells_in_grid              # [head, E]: Ȳ_ge − c_e
            mean = cell["shift"] + delta                          # Ȳ_ge
            values["count"][layer] = cells_in_grid * mean.shape[-1]
            values["total"][layer] = (cells_in_grid * mean).sum(-1).cpu()
            values["cell_square"][layer] = (cells_in_grid * mean * mean).sum(-1).cpu()
            values["within"][layer] = (cell["square"] - cells_in_grid * delta * delta).clamp_min(0).sum(-1).cpu()
            offset_means = cell["by_offset"] / n_contexts - mean.unsqueeze(1)  # [head, S, E]
            values["offset"][layer] = (n_contexts * (offset_means * offset_means).sum((1, 2))).cpu()
            context = (cell["context_square"] - n_contexts * n_offsets**2 * delta * delta).clamp_min(0)
            values["context"][layer] = (context.sum(-1) / n_offsets).cpu()
            if by_dim is not None:  # entries (i, d) flattened with d fastest: [1, m·d] -> [m, d]
                by_dim[layer] = (cells_in_grid * mean.reshape(-1, hidden_size)).sum(0).cpu()
        for name, value in values.items():
            out[representation + "/" + name] = value
        if by_dim is not None:
            out[representation + "/" + TOTAL_BY_DIM] = by_dim
    return out


#: One segment's sums of the attention its rows put before the segment, by offset: ``sink/first_key`` and
#: ``sink/preceding`` (``[layer, head, offset]``: Σ over contexts and segment rows of the weight on the window's
#: first key, and on the rest of the text before the segment) and ``sink/rows`` (``[layer, offset]``: the rows
#: behind them).
SINK_SUMS = ("sink/first_key", "sink/preceding", "sink/rows")


def new_sink_sums(n_layers: int, n_heads: int, n_offsets: int) -> dict:
    """One segment's :data:`SINK_SUMS`, zero, float64 on the CPU."""
    first_key, preceding, rows = SINK_SUMS
    return {first_key: torch.zeros((n_layers, n_heads, n_offsets), dtype=torch.float64),
            preceding: torch.zeros((n_layers, n_heads, n_offsets), dtype=torch.float64),
            rows: torch.zeros((n_layers, n_offsets), dtype=torch.float64)}


def add_sink_sums(sums: dict, layer: int, offset_index: int, sink: torch.Tensor) -> None:
    """Add one window's ``sink: [head, m, 2]`` (each segment row's weight on the window's first key and on the
    rest of the text before the segment) at ``layer`` and one offset to :func:`new_sink_sums`' ``sums``."""
    first_key, preceding, rows = SINK_SUMS
    totals = sink.detach().to(torch.float64).sum(1).cpu()  # [head, 2]
    sums[first_key][layer, :, offset_index] += totals[:, 0]
    sums[preceding][layer, :, offset_index] += totals[:, 1]
    sums[rows][layer, offset_index] += sink.shape[1]


#: One segment's sums of the residual stream's largest magnitudes at its tokens, by offset (Sun et al. 2024's
#: massive activations, read where the segment sits): for each window (one context at one offset) and layer, with
#: ``h`` the residual stream after the block at the segment's ``m`` tokens (``[m, d]``), ``massive/first`` sums
#: ``max_d |h[0, d]|`` (the segment's first token), ``massive/rest`` sums ``max_{i ≥ 1, d} |h[i, d]|`` (its other
#: tokens; 0 for a segment of one token), ``massive/median`` sums the median of the ``m·d`` magnitudes (the mean of
#: the two middle ones when ``m·d`` is even) and ``massive/windows`` counts the windows (``[layer, offset]`` each).
MASSIVE_SUMS = ("massive/first", "massive/rest", "massive/median", "massive/windows")


def new_massive_sums(n_layers: int, n_offsets: int) -> dict:
    """One segment's :data:`MASSIVE_SUMS`, zero, float64 on the CPU."""
    return {name: torch.zeros((n_layers, n_offsets), dtype=torch.float64) for name in MASSIVE_SUMS}


def add_massive_sums(sums: dict, layer: int, offset_index: int, hidden: torch.Tensor) -> None:
    """Add one window's residual stream after block ``layer`` at the segment's tokens (``hidden: [m, d]``) at one
    offset to :func:`new_massive_sums`' ``sums``."""
    first, rest, median, windows = MASSIVE_SUMS
    magnitude = hidden.detach().to(torch.float64).abs()
    sums[first][layer, offset_index] += float(magnitude[0].max())
    sums[rest][layer, offset_index] += float(magnitude[1:].max()) if magnitude.shape[0] > 1 else 0.0
    sums[median][layer, offset_index] += float(torch.quantile(magnitude.reshape(-1), 0.5))
    sums[windows][layer, offset_index] += 1


def new_prediction_sums(n_offsets: int) -> dict:
    """One segment's :data:`PREDICTION_SUMS`, zero, float64 on the CPU."""
    return {name: torch.zeros((n_offsets,) * rank, dtype=torch.float64) for name, rank in PREDICTION_SUMS}


#: Positions per chunk of the predictions' divergences: every temporary over the vocabulary is
#: ``chunk × vocab`` (8 MB for Gemma 3's 262,144 tokens in float32) rather than ``m × vocab``. Measured on one
#: CPU core at ``m = 64``, a pair of Gemma-sized distributions took 152 ms with whole-segment temporaries and
#: 44–62 ms in chunks of 8 positions (fewer pages to fault in, a smaller working set).
PREDICTION_CHUNK = 8


def negentropy(probabilities: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """``Σ p log p`` over the last axis as float64 ``[...]``, from both forms of one distribution: a dot product
    (one pass). A ``−inf`` log-probability (a logit the model masks) makes ``0 · −inf`` NaN there; those rows are
    summed again with ``xlogy``, which counts ``0 · log 0`` as 0."""
    value = torch.linalg.vecdot(probabilities, log_probs)
    broken = value.isnan()
    if bool(broken.any()):
        value[broken] = torch.special.xlogy(probabilities[broken], probabilities[broken]).sum(-1)
    return value.to(torch.float64)


def next_token_distribution(log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, Σ p·log p)`` of ``log_probs: [..., vocab]``: the probabilities in their dtype (float32, or float64
    for a float64 model) and the negative entropy per distribution, as float64.

    Sums run in the probabilities' dtype: a float32 sum over a 262,144-token vocabulary is off by about 1e-7 of
    the entropy (so JS is resolved to about 1e-6 nats), and summing in float64 would cast every term first,
    which costs more than the rest of the divergence on a CPU."""
    probabilities = log_probs.exp()
    return probabilities, negentropy(probabilities, log_probs)


def middle_negentropy(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``Σ m log m`` with ``m = (p + q)/2`` over the last axis, float64 ``[...]``: the only term of a Jensen–Shannon
    divergence that needs both distributions. ``m`` is clamped to the dtype's smallest normal number inside the
    logarithm only, so a vocabulary entry where both are 0 adds ``0 · log(tiny) = 0``."""
    middle = torch.add(p, q).mul_(0.5)
    log_middle = middle.clamp_min(torch.finfo(middle.dtype).tiny).log_()
    return torch.linalg.vecdot(middle, log_middle).to(torch.float64)


def jensen_shannon_from(p: tuple[torch.Tensor, torch.Tensor], q: tuple[torch.Tensor, torch.Tensor],
                        chunk: int = PREDICTION_CHUNK) -> torch.Tensor:
    """``JS(p, q) = ½·Σ p log p + ½·Σ q log q − Σ m log m``, ``m = (p + q)/2`` (the same as ``½·KL(p‖m) + ½·KL(q‖m)``),
    from two :func:`next_token_distribution` ``([n, vocab], [n])``: one logarithm per vocabulary entry and pair,
    since each distribution's own ``Σ p log p`` is computed once; ``chunk`` rows at a time
    (:data:`PREDICTION_CHUNK`). Float64 ``[n]`` in ``[0, log 2]``."""
    rows = p[0].shape[0]
    middle = (torch.cat([middle_negentropy(p[0][a : a + chunk], q[0][a : a + chunk]) for a in range(0, rows, chunk)])
              if rows else p[1].new_zeros(0))
    return (0.5 * (p[1] + q[1]) - middle).clamp(0.0, math.log(2.0))


def prediction_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """``log_probs`` as the divergences read them: detached, in float32 (float64 kept for a float64 model)."""
    log_probs = log_probs.detach()
    return log_probs if log_probs.dtype == torch.float64 else log_probs.to(torch.float32)


def jensen_shannon_sum_to(reference: tuple[torch.Tensor, torch.Tensor], log_probs: torch.Tensor) -> float:
    """``Σ_i JS(reference_i, p_i)`` over the positions of ``log_probs: [n, vocab]`` against a
    :func:`next_token_distribution` ``reference`` of the same positions, :data:`PREDICTION_CHUNK` positions at a
    time (no temporary spans more than a chunk of the vocabulary)."""
    log_probs = prediction_log_probs(log_probs)
    total = 0.0
    for first in range(0, log_probs.shape[0], PREDICTION_CHUNK):
        rows = slice(first, first + PREDICTION_CHUNK)
        total += float(jensen_shannon_from((reference[0][rows], reference[1][rows]),
                                           next_token_distribution(log_probs[rows])).sum())
    return total


def add_prediction_sums(sums: dict, latest: list, current: dict, offset_index: int, log_probs: torch.Tensor,
                        targets: torch.Tensor) -> None:
    """Add one window's next-token predictions to a segment's prediction sums.

    Runs :data:`PREDICTION_CHUNK` positions at a time: each chunk's probabilities are paired with the previous
    context's at this offset and with the current context's at the offsets already added, then written over the
    previous context's chunk, which no later pair needs. So a segment holds ``S`` distributions, never ``S + 1``,
    and no temporary spans more than a chunk of the vocabulary.

    Args:
        sums: :func:`new_prediction_sums` (tensors; updated in place).
        latest: per offset, the latest context's :func:`next_token_distribution` or ``None`` (updated; its
            tensors are overwritten in place).
        current: ``{offset index: distribution}`` of the current context's offsets so far (updated).
        offset_index: the window's offset.
        log_probs: ``[m − 1, vocab]`` next-token log-probabilities at the segment's positions but the last.
        targets: ``[m − 1]`` the segment's own next tokens.
    """
    log_probs = prediction_log_probs(log_probs)
    n = int(targets.numel())
    nll = -log_probs.gather(-1, targets.to(log_probs.device).view(-1, 1)).to(torch.float64).sum()
    sums["nll_sum"][offset_index] += float(nll)
    sums["nll_count"][offset_index] += n
    previous = latest[offset_index]  # the previous context at this offset: a consecutive pair of contexts
    kept = previous if previous is not None else (
        torch.empty_like(log_probs), torch.empty(log_probs.shape[:-1], dtype=torch.float64, device=log_probs.device))
    others = sorted(current.items())
    context_sum = 0.0
    offset_sums = [0.0] * len(others)
    for first in range(0, n, PREDICTION_CHUNK):
        rows = slice(first, first + PREDICTION_CHUNK)
        mine = next_token_distribution(log_probs[rows])
        if previous is not None:
            context_sum += float(jensen_shannon_from((previous[0][rows], previous[1][rows]), mine).sum())
        for k, (_, theirs) in enumerate(others):
            offset_sums[k] += float(jensen_shannon_from((theirs[0][rows], theirs[1][rows]), mine).sum())
        kept[0][rows].copy_(mine[0])
        kept[1][rows] = mine[1]
    if previous is not None:
        sums["js_context_sum"][offset_index] += context_sum
        sums["js_context_count"][offset_index] += n
    for (other, _), value in zip(others, offset_sums):
        low, high = min(other, offset_index), max(other, offset_index)
        sums["js_offset_sum"][low, high] += value
        sums["js_offset_count"][low, high] += n
    current[offset_index] = kept
    latest[offset_index] = kept


#: The attribution's Gram matrices of one segment, ``[C, C]`` over its components: ``"offset"``
#: ``K_off[c, c'] = F·Σ_{s,i} ⟨δ_s(c), δ_s(c')⟩`` and ``"context"`` ``K_ctx[c, c'] = S·Σ_{f,i} ⟨δ_f(c), δ_f(c')⟩``.
ATTRIBUTION_GRAMS = ("offset", "context")


#: Entries per block of the offset Gram's product: ``C × chunk`` float64 values are copied at a time.
GRAM_CHUNK = 1 << 16


def new_component_state(names: list, n_offsets: int) -> dict:
    """The running sums of one segment's grid for the attribution's components ``names`` (empty cells, filled on
    first use): per component ``shift = c`` (its first value, ``[E]``: Welford's shift, so no Gram term cancels),
    ``by_offset = Σ_f (Y − c) [S, E]`` and ``context_row`` (the current context's ``Σ_s (Y − c)``, ``[E]``);
    for the whole set ``context_gram = Σ_f ⟨B_f(c), B_f(c')⟩ [C, C]``, ``B_f`` the context rows. Memory:
    ``C·(S + 2)·E`` float64 values, ``E = m·d``."""
    return {"names": list(names), "n_offsets": n_offsets, "cells": {}, "seen": [], "context_gram": None,
            "contexts": 0}


def add_component_to_state(state: dict, name: str, offset_index: int, values: torch.Tensor) -> None:
    """Add component ``name``'s ``values`` (``[m, d]``, any shape: flattened) at one offset of the current context."""
    y = values.detach().reshape(-1).to(torch.float64)
    cell = state["cells"].get(name)
    if cell is None:
        cell = {"shift": y.clone(),
                "by_offset": torch.zeros((state["n_offsets"], y.shape[0]), dtype=torch.float64, device=y.device),
                "context_row": torch.zeros_like(y)}
        state["cells"][name] = cell
    centred = y - cell["shift"]
    cell["by_offset"][offset_index] += centred
    cell["context_row"] += centred
    state["seen"].append((name, offset_index))


def end_context_of_components(state: dict) -> None:
    """Close the current context: ``context_gram += R·Rᵀ`` with ``R [C, E]`` the components' context rows
    (in the order of ``state["names"]``), and new rows."""
    cells = state["cells"]
    if not cells:
        return
    rows = torch.stack([cells[name]["context_row"] for name in state["names"]])
    gram = rows @ rows.T
    state["context_gram"] = gram if state["context_gram"] is None else state["context_gram"] + gram
    for name in state["names"]:
        cells[name]["context_row"].zero_()
    state["seen"] = []
    state["contexts"] += 1


def component_grams(state: dict) -> dict:
    """A finished grid's Gram matrices (:data:`ATTRIBUTION_GRAMS`), float64 ``[C, C]`` on the CPU.

    With ``b_s = Σ_f (Y_fs − c)``, ``T = Σ_s b_s`` and ``B_f`` the context rows (``F`` contexts, ``S`` offsets):
    ``δ_s = b_s/F − T/(F·S)`` (the shift ``c`` cancels), ``K_off = F·Σ_s δ_s·δ_sᵀ`` and
    ``K_ctx = Σ_f B_f·B_fᵀ / S − T·Tᵀ/(F·S)``. The offset term is formed from the offset means themselves (no
    difference of large sums). Each component's ``by_offset`` is overwritten by its ``δ`` (the grid is finished;
    no copy of the state is made), so a state gives its Grams once."""
    names, cells = state["names"], state["cells"]
    n = len(names)
    if not cells or n == 0:
        zeros = torch.zeros((n, n), dtype=torch.float64)
        return {"offset": zeros, "context": zeros.clone()}
    contexts, offsets = state["contexts"], state["n_offsets"]
    totals = torch.stack([cells[name]["by_offset"].sum(0) for name in names])          # [C, E]: T
    context = state["context_gram"] / offsets - (totals @ totals.T) / (contexts * offsets)
    deltas = []
    for k, name in enumerate(names):
        delta = cells[name]["by_offset"]
        delta.div_(contexts).sub_(totals[k] / (contexts * offsets))                    # [S, E]: δ_s
        deltas.append(delta.reshape(-1))
    offset = torch.zeros((n, n), dtype=torch.float64, device=totals.device)
    width = deltas[0].shape[0]
    for first in range(0, width, GRAM_CHUNK):  # a [C, chunk] copy at a time, not a second copy of the state
        block = torch.stack([delta[first : first + GRAM_CHUNK] for delta in deltas])
        offset += block @ block.T
    return {"offset": (contexts * offset).cpu(), "context": context.cpu()}
