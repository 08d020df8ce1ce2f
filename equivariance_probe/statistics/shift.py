"""The shift test's streaming sums: one segment's grid context by context, folded into additive sums.

Place in the seams: *statistics*, torch and numpy only. The probe's shift run
(:meth:`~equivariance_probe.EquivarianceProbe.shift`) places each segment (a text of ``m`` tokens) after
``s`` tokens of each context, hands every representation of the segment to a :class:`SegmentGrid`
window by window, and folds the finished segment into :class:`ShiftStatistics`; the decomposition
itself is :mod:`~equivariance_probe.maths.shift`'s.

Memory does not grow with the number of segments or contexts. While a segment runs, per representation,
layer, head and entry ``e`` it keeps ``S`` per-offset sums ``Σ_f Y[f, s, e]`` and four shifted sums
(Welford's shift: ``c_e``, the entry's first value, is subtracted before squaring, so no sum of squares
cancels): ``Σ (Y − c)``, ``Σ (Y − c)²``, the current context's ``Σ_s (Y − c)`` and ``Σ_f (Σ_s (Y − c))²``.
When the segment's grid is complete they give its exact :data:`~equivariance_probe.maths.shift.DECOMPOSITION_SUMS`,
which are added to the sums of the segment's interval group (``[group, layer, head]``). Predictions keep,
per offset, the latest context's next-token probabilities (``S·(m−1)·V`` float32, float64 for a
float64 model).

Every array is declared once, in :data:`SHIFT_ARRAYS`, as the attention statistics declare theirs
(:class:`~equivariance_probe.statistics.config.Sum`: its shape in letters of :meth:`ShiftConfig.sizes`,
its meaning and its merge rule, ``"add"`` for all of them), so allocating, merging, saving and loading
are loops over the table (:func:`~equivariance_probe.statistics.config.shapes_of`,
:func:`~equivariance_probe.statistics.config.merge_arrays`). Segments are fingerprinted
(:func:`~equivariance_probe.records.provenance.window_fingerprint` of their token ids, computed by the
caller) and a merge refuses a segment counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import IncompatibleResultsError, InputError
from .config import Sum, merge_arrays, shapes_of

__all__ = [
    "REPRESENTATIONS",
    "ATTENTION_REPRESENTATIONS",
    "DECOMPOSITION_SUMS",
    "PREDICTION_ARRAYS",
    "SHIFT_ARRAYS",
    "ShiftConfig",
    "ShiftStatistics",
    "SegmentGrid",
    "segment_entries",
    "segment_representations",
    "next_token_distribution",
    "jensen_shannon_from",
    "jensen_shannon_torch",
    "PREDICTION_CHUNK",
]

#: Attention among the segment's tokens (``[layer, head]``) and the residual stream (``[layer, 1]``).
ATTENTION_REPRESENTATIONS = ("centred_logits", "conditional_weights", "raw_weights")
REPRESENTATIONS = ATTENTION_REPRESENTATIONS + ("residual",)
#: Additive sums of the decomposition (the same names as :data:`~equivariance_probe.maths.shift.DECOMPOSITION_SUMS`).
DECOMPOSITION_SUMS = ("count", "total", "cell_square", "within", "offset", "context")
#: The predictions' sums: NLL of the segment's own next token by offset, Jensen–Shannon divergences between
#: offsets in one context (every pair ``s < s'``) and between consecutive contexts at one offset.
#: Shapes in letters of :meth:`ShiftConfig.sizes`: ``G`` interval groups, ``L`` layers, ``H`` query heads,
#: ``O`` offsets, ``1`` the residual stream's one "head".
PREDICTION_ARRAYS: dict[str, Sum] = {
    "nll_sum": Sum("G O", "Σ −log p(the segment's own next token), by offset"),
    "nll_count": Sum("G O", "positions behind nll_sum"),
    "js_offset_sum": Sum("G O O", "Σ JS(p_s, p_s') over contexts and positions, for offsets s < s' [s, s']"),
    "js_offset_count": Sum("G O O", "pairs behind js_offset_sum"),
    "js_context_sum": Sum("G O", "Σ JS between consecutive contexts at one offset, over positions"),
    "js_context_count": Sum("G O", "pairs behind js_context_sum"),
}
_DECOMPOSITION_MEANINGS = {
    "count": "entries (i, j) or (i, d) of every cell of the grid",
    "total": "Σ (Y − c)², c the entry's first value (Welford's shift)",
    "cell_square": "Σ over entries of F·S·(mean of the entry over the grid)², shifted",
    "within": "Σ over entries of Σ (Y − entry mean)²",
    "offset": "SS_offset: Σ over entries of F·Σ_s (offset mean − entry mean)²",
    "context": "SS_context: Σ over entries of S·Σ_f (context mean − entry mean)²",
}
#: Every array of the state, declared once (see :mod:`equivariance_probe.statistics`).
SHIFT_ARRAYS: dict[str, Sum] = {
    **{f"{rep}/{name}": Sum("G L 1" if rep == "residual" else "G L H", _DECOMPOSITION_MEANINGS[name])
       for rep in REPRESENTATIONS for name in DECOMPOSITION_SUMS},
    **PREDICTION_ARRAYS,
    "segments": Sum("G", "segments counted in each interval group"),
}


@dataclass(frozen=True)
class ShiftConfig:
    """What the sums were measured on; two states merge only with equal configs.

    Attributes:
        n_layers: the model's layers.
        n_heads: its query heads per layer.
        offsets: ``O``, the offsets ``s`` in the window's text (tokens of context before the segment).
        n_contexts: ``F`` (1 in ``"position_ids"`` mode).
        segment_length: ``m``.
        prefix_length: tokens of the tokenizer's special prefix before the context.
        mode: ``"text"`` (a context's first ``s`` tokens precede the segment) or ``"position_ids"`` (the
            prefix and segment alone, their position ids starting at ``s``).
        interval_groups: ``G``, groups of segments for the jackknife (1: no intervals).
        causal: whether the model is causal (rows see keys ``j ≤ i``).
        sliding_windows: per layer, ``None`` or the window width.
        predictions: whether next-token predictions were measured.
    """

    n_layers: int
    n_heads: int
    offsets: tuple[int, ...]
    n_contexts: int
    segment_length: int
    prefix_length: int = 0
    mode: str = "text"
    interval_groups: int = 1
    causal: bool = True
    sliding_windows: tuple[int | None, ...] = ()
    predictions: bool = True

    def sizes(self) -> dict[str, int]:
        """The letters of :data:`SHIFT_ARRAYS`' shapes."""
        return {"G": self.interval_groups, "L": self.n_layers, "H": self.n_heads, "O": len(self.offsets), "1": 1}

    def differences(self, other: ShiftConfig) -> list[str]:
        """``"field: mine vs theirs"`` for every field that differs (what a refused merge names)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{key}: {mine[key]!r} vs {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]

    def to_dict(self) -> dict[str, Any]:
        return {"n_layers": self.n_layers, "n_heads": self.n_heads, "offsets": list(self.offsets),
                "n_contexts": self.n_contexts, "segment_length": self.segment_length,
                "prefix_length": self.prefix_length, "mode": self.mode, "interval_groups": self.interval_groups,
                "causal": self.causal, "sliding_windows": list(self.sliding_windows), "predictions": self.predictions}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShiftConfig:
        return cls(**{**data, "offsets": tuple(data["offsets"]), "sliding_windows": tuple(data["sliding_windows"])})


def segment_entries(config: ShiftConfig, layer: int) -> torch.Tensor:
    """``[m, m]`` boolean: the entries ``(i, j)`` of the segment block that count at ``layer``: key ``j``
    visible to query ``i`` (causal: ``j ≤ i``; within a sliding window ``w``: ``i − j < w``), in rows
    with at least two such keys."""
    m = config.segment_length
    i = torch.arange(m).view(-1, 1)
    j = torch.arange(m).view(1, -1)
    visible = (j <= i) if config.causal else torch.ones(m, m, dtype=torch.bool)
    window = config.sliding_windows[layer] if config.sliding_windows else None
    if window is not None:
        visible = visible & ((i - j).abs() < window)
    return visible & (visible.sum(-1, keepdim=True) >= 2)


def segment_representations(scores: torch.Tensor, log_normaliser: torch.Tensor, entries: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three attention representations of a segment block, float64, at its counted entries.

    Args:
        scores: ``[head, m, m]`` pre-softmax scores among the segment's tokens (``softcap(q·kᵀ·scaling)``).
        log_normaliser: ``[head, m]`` ``log Σ_k exp(score_ik)`` over every key the row sees in the window
            (prefix, context and segment), so ``log a_ij = score_ij − log_normaliser_i``.
        entries: ``[m, m]`` boolean, :func:`segment_entries`.

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


#: Positions per chunk of the predictions' divergences: every temporary over the vocabulary is
#: ``chunk × vocab`` (8 MB for Gemma 3's 262,144 tokens in float32) rather than ``m × vocab``. Measured on one
#: CPU core at ``m = 64``, a pair of Gemma-sized distributions took 152 ms with whole-segment temporaries and
#: 44–62 ms in chunks of 8 positions (fewer pages to fault in, a smaller working set).
PREDICTION_CHUNK = 8


def _negentropy(probabilities: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
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

    Sums run in the probabilities' dtype (torch's pairwise summation): a float32 sum over a 262,144-token
    vocabulary is off by about 1e-7 of the entropy (so JS is resolved to about 1e-6 nats), and summing in
    float64 would cast every term first, which costs more than the rest of the divergence on a CPU."""
    probabilities = log_probs.exp()
    return probabilities, _negentropy(probabilities, log_probs)


def _middle_negentropy(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
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
    middle = torch.cat([_middle_negentropy(p[0][a : a + chunk], q[0][a : a + chunk])
                        for a in range(0, p[0].shape[0], chunk)]) if p[0].shape[0] else p[1].new_zeros(0)
    return (0.5 * (p[1] + q[1]) - middle).clamp(0.0, float(np.log(2.0)))


def jensen_shannon_torch(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``JS(p, q)`` in nats over the last axis (:func:`~equivariance_probe.maths.shift.jensen_shannon`) of
    ``[n, vocab]`` log-probabilities, computed as the streaming run computes it."""
    return jensen_shannon_from(next_token_distribution(log_p), next_token_distribution(log_q))


@dataclass
class _Shifted:
    """One representation's running sums over a segment's grid (``[layer][head, S or 1, E]``)."""

    shift: list[torch.Tensor | None]
    by_offset: list[torch.Tensor | None]
    deviation: list[torch.Tensor | None]
    square: list[torch.Tensor | None]
    context_row: list[torch.Tensor | None]
    context_square: list[torch.Tensor | None]


class SegmentGrid:
    """The running sums of one segment while its ``F × S`` grid is measured, context by context.

    Call :meth:`add` for every (representation, layer, offset) of a context, then :meth:`end_context`;
    after the last context :meth:`sums` gives the segment's decomposition sums.
    """

    def __init__(self, config: ShiftConfig) -> None:
        self.config = config
        self.contexts_done = 0
        self._sums = {rep: _Shifted(*([None] * config.n_layers for _ in range(6))) for rep in REPRESENTATIONS}
        self._seen: set[tuple[str, int, int]] = set()
        #: Per offset, the latest context's next-token distributions (:func:`next_token_distribution`).
        self.distributions: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(config.offsets)
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # One segment's predictions: the shapes without the group letter.
        self.predictions = {name: np.zeros(shape[1:])
                            for name, shape in shapes_of(PREDICTION_ARRAYS, config.sizes(), config).items()}

    def add(self, representation: str, layer: int, offset_index: int, values: torch.Tensor) -> None:
        """``values: [head, E]`` (``[1, E]`` for the residual stream) of the current context at one offset."""
        key = (representation, layer, offset_index)
        if key in self._seen:
            raise InputError(f"{representation} of layer {layer} at offset index {offset_index} was added twice in one context")
        self._seen.add(key)
        y = values.detach().to(torch.float64)
        sums = self._sums[representation]
        if sums.shift[layer] is None:
            n_offsets = len(self.config.offsets)
            sums.shift[layer] = y.clone()
            sums.by_offset[layer] = torch.zeros((y.shape[0], n_offsets, y.shape[1]), dtype=torch.float64, device=y.device)
            for name in ("deviation", "square", "context_row", "context_square"):
                getattr(sums, name)[layer] = torch.zeros_like(y)
        centred = y - sums.shift[layer]
        sums.by_offset[layer][:, offset_index] += y
        sums.deviation[layer] += centred
        sums.square[layer] += centred * centred
        sums.context_row[layer] += centred

    def add_predictions(self, offset_index: int, log_probs: torch.Tensor, targets: torch.Tensor) -> None:
        """``log_probs: [m − 1, vocab]`` next-token log-probabilities at the segment's positions but the last,
        ``targets: [m − 1]`` the segment's own next tokens, for the current context at one offset.

        Runs :data:`PREDICTION_CHUNK` positions at a time: each chunk's probabilities are paired with the previous
        context's at this offset and with the current context's at the offsets already added, then written over
        the previous context's chunk, which no later pair needs. So the state holds ``S`` distributions, never
        ``S + 1``, and no temporary spans more than a chunk of the vocabulary."""
        log_probs = log_probs.detach()
        if log_probs.dtype != torch.float64:
            log_probs = log_probs.to(torch.float32)
        n_positions = int(targets.numel())
        nll = -log_probs.gather(-1, targets.to(log_probs.device).view(-1, 1)).to(torch.float64).sum()
        self.predictions["nll_sum"][offset_index] += float(nll)
        self.predictions["nll_count"][offset_index] += n_positions
        previous = self.distributions[offset_index]  # the previous context at this offset: a consecutive pair
        kept = (torch.empty_like(log_probs), torch.empty(log_probs.shape[:-1], dtype=torch.float64,
                                                         device=log_probs.device)) if previous is None else previous
        others = sorted(self._current.items())
        context_sum = 0.0
        offset_sums = [0.0] * len(others)
        for first in range(0, n_positions, PREDICTION_CHUNK):
            rows = slice(first, first + PREDICTION_CHUNK)
            mine = next_token_distribution(log_probs[rows])
            if previous is not None:
                context_sum += float(jensen_shannon_from((previous[0][rows], previous[1][rows]), mine).sum())
            for k, (_, theirs) in enumerate(others):
                offset_sums[k] += float(jensen_shannon_from((theirs[0][rows], theirs[1][rows]), mine).sum())
            kept[0][rows].copy_(mine[0])
            kept[1][rows] = mine[1]
        if previous is not None:
            self.predictions["js_context_sum"][offset_index] += context_sum
            self.predictions["js_context_count"][offset_index] += n_positions
        for (other, _), value in zip(others, offset_sums):
            low, high = min(other, offset_index), max(other, offset_index)
            self.predictions["js_offset_sum"][low, high] += value
            self.predictions["js_offset_count"][low, high] += n_positions
        self._current[offset_index] = kept
        self.distributions[offset_index] = kept

    def end_context(self) -> None:
        """Close the current context: every (representation, layer, offset) must have been added."""
        expected = {(rep, layer, s) for rep, sums in self._sums.items() for layer in range(self.config.n_layers)
                    for s in range(len(self.config.offsets)) if sums.shift[layer] is not None}
        if self._seen != expected:
            missing = sorted(expected - self._seen)[:3]
            raise InputError(f"a context of the segment's grid is incomplete (missing {missing}); every offset must run")
        for sums in self._sums.values():
            for layer, row in enumerate(sums.context_row):
                if row is not None:
                    sums.context_square[layer] += row * row
                    row.zero_()
        self._seen.clear()
        self._current = {}
        self.contexts_done += 1

    def sums(self) -> dict[str, np.ndarray]:
        """The segment's :data:`DECOMPOSITION_SUMS` per representation (``"{rep}/{name}": [layer, head]``) and
        its prediction sums (``[offset]``, ``[offset, offset]``)."""
        n_contexts, n_offsets = self.contexts_done, len(self.config.offsets)
        if n_contexts != self.config.n_contexts:
            raise InputError(f"the segment's grid has {n_contexts} contexts done of {self.config.n_contexts}")
        cells = n_contexts * n_offsets
        out: dict[str, np.ndarray] = {}
        for rep, sums in self._sums.items():
            heads = 1 if rep == "residual" else self.config.n_heads
            values = {name: np.zeros((self.config.n_layers, heads)) for name in DECOMPOSITION_SUMS}
            for layer in range(self.config.n_layers):
                if sums.shift[layer] is None:
                    continue
                delta = sums.deviation[layer] / cells            # [head, E]: Ȳ_ge − c_e
                mean = sums.shift[layer] + delta                 # Ȳ_ge
                entries = mean.shape[-1]
                values["count"][layer] = cells * entries
                values["total"][layer] = (cells * mean).sum(-1).cpu().numpy()
                values["cell_square"][layer] = (cells * mean * mean).sum(-1).cpu().numpy()
                values["within"][layer] = (sums.square[layer] - cells * delta * delta).clamp_min(0).sum(-1).cpu().numpy()
                offset_means = sums.by_offset[layer] / n_contexts - mean.unsqueeze(1)  # [head, S, E]
                values["offset"][layer] = (n_contexts * (offset_means * offset_means).sum((1, 2))).cpu().numpy()
                context = (sums.context_square[layer] - n_contexts * n_offsets**2 * delta * delta).clamp_min(0)
                values["context"][layer] = (context.sum(-1) / n_offsets).cpu().numpy()
            out.update({f"{rep}/{name}": value for name, value in values.items()})
        return out | self.predictions


class ShiftStatistics:
    """Float64 sums of the shift test per interval group of segments; merge by adding.

    Args:
        config: :class:`ShiftConfig`.

    Attributes:
        arrays: every array of :data:`SHIFT_ARRAYS`, numpy float64, ``[group, ...]``.
        segment_fingerprints: ``[n]`` uint64, one per segment counted (a merge refuses a repeated one).
    """

    def __init__(self, config: ShiftConfig) -> None:
        self.config = config
        self.shapes = shapes_of(SHIFT_ARRAYS, config.sizes(), config)
        self.arrays = {name: np.zeros(shape) for name, shape in self.shapes.items()}
        self.segment_fingerprints = np.zeros(0, dtype=np.uint64)

    @property
    def n_segments(self) -> int:
        return int(self.segment_fingerprints.size)

    def new_segment(self, fingerprint: int) -> SegmentGrid:
        """A :class:`SegmentGrid` for the segment of this fingerprint (refused if it was counted already)."""
        if np.isin(np.uint64(fingerprint), self.segment_fingerprints):
            raise IncompatibleResultsError(
                f"segment fingerprint {fingerprint:#x} is counted already: the same segment would count twice; "
                "pass each segment once")
        return SegmentGrid(self.config)

    def add_segment(self, fingerprint: int, group: int, grid: SegmentGrid) -> None:
        """Fold a finished segment into interval group ``group`` (``0 <= group < G``)."""
        self.add_segment_sums(fingerprint, group, grid.sums())  # sums() refuses an incomplete grid first

    def add_segment_sums(self, fingerprint: int, group: int, sums: dict[str, np.ndarray]) -> None:
        """Add one segment's :meth:`SegmentGrid.sums` (computed here, or where the model runs and shipped back)."""
        if np.isin(np.uint64(fingerprint), self.segment_fingerprints):
            raise IncompatibleResultsError(f"segment fingerprint {fingerprint:#x} is counted already")
        for name, value in sums.items():
            self.arrays[name][group] += value
        self.arrays["segments"][group] += 1
        self.segment_fingerprints = np.append(self.segment_fingerprints, np.uint64(fingerprint))

    def totals(self) -> dict[str, np.ndarray]:
        """Every array summed over the groups."""
        return {name: value.sum(0) for name, value in self.arrays.items()}

    def replicates(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``(group ids, {name: [R, ...]})``: for each of the ``R`` groups holding segments, every array summed
        over all other groups (the delete-a-group jackknife's replicates)."""
        occupied = np.flatnonzero(self.arrays["segments"] > 0)
        totals = self.totals()
        return occupied, {name: totals[name][None] - value[occupied] for name, value in self.arrays.items()}

    def merge(self, other: ShiftStatistics) -> ShiftStatistics:
        """The sums of both runs; refused for other configurations or a segment in both."""
        if self.config != other.config:
            raise IncompatibleResultsError(
                f"cannot merge shift statistics measured differently ({'; '.join(self.config.differences(other.config))}); "
                "run every part with "
                "the same model, offsets, contexts, segment length and interval groups")
        shared = np.intersect1d(self.segment_fingerprints, other.segment_fingerprints)
        if shared.size:
            raise IncompatibleResultsError(
                f"{shared.size} segment(s) appear in both results (first fingerprint {int(shared[0]):#x}): they would "
                "count twice; merge results over disjoint segments")
        merged = ShiftStatistics(self.config)
        merged.arrays = merge_arrays(self.arrays, other.arrays, SHIFT_ARRAYS)
        merged.segment_fingerprints = np.concatenate([self.segment_fingerprints, other.segment_fingerprints])
        return merged

    __add__ = merge

    def to_dict(self) -> dict[str, Any]:
        """``{"config": {...}, "arrays": {name: ndarray}, "segment_fingerprints": ndarray}``."""
        return {"config": self.config.to_dict(), "arrays": dict(self.arrays),
                "segment_fingerprints": self.segment_fingerprints}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShiftStatistics:
        statistics = cls(ShiftConfig.from_dict(data["config"]))
        for name in SHIFT_ARRAYS:
            array = np.asarray(data["arrays"][name], dtype=np.float64)
            if array.shape != statistics.shapes[name]:
                raise IncompatibleResultsError(f"shift array {name!r} has shape {array.shape}, expected {statistics.shapes[name]}")
            statistics.arrays[name] = array
        statistics.segment_fingerprints = np.asarray(data["segment_fingerprints"], dtype=np.uint64)
        return statistics
