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
which are added to the sums of the segment's interval group (``[group, layer, head]``). The arithmetic is
:mod:`~equivariance_probe.statistics.engines.shift_sums`' torch-only functions, which a remote model's
segment runs on the server, so :meth:`ShiftStatistics.add_segment_sums` adds sums from there exactly as
from here. Predictions keep, per offset, the latest context's next-token probabilities (``S·(m−1)·V``
float32, float64 for a float64 model; each window's overwrite the previous context's at its offset). The sink
mass adds, per layer, head and offset, the sums of the rows' attention weights on the window's first key and on
the rest of the text before the segment (:data:`SINK_ARRAYS`); the massive activations add, per layer and offset,
the residual stream's largest magnitude at the segment's first token and at its other tokens, and its median
magnitude (:data:`MASSIVE_ARRAYS`).

With attribution (:attr:`ShiftConfig.components`), a segment also keeps per component ``c`` (the embedding,
each block's attention and MLP, chosen heads) ``Σ_f (c − c₀)`` per offset and the current context's
``Σ_s (c − c₀)`` (``C·(S + 2)·m·D`` float64 values in all), and at its end two Gram matrices ``[C, C]``
(:data:`ATTRIBUTION_ARRAYS`), from which every component's share of the residual stream's offset and context
sums of squares follows (:mod:`~equivariance_probe.maths.shift`).

Every array is declared once, in :data:`SHIFT_ARRAYS`, as the attention statistics declare theirs
(:class:`~equivariance_probe.statistics.config.Sum`: its shape in letters of :meth:`ShiftConfig.sizes`,
its meaning and its merge rule, ``"add"`` for all of them), so allocating, merging, saving and loading
are loops over the table (:func:`~equivariance_probe.statistics.config.shapes_of`,
:func:`~equivariance_probe.statistics.config.merge_arrays`). Segments are fingerprinted
(:func:`~equivariance_probe.records.provenance.window_fingerprint` of their token ids, computed by the
caller) and a merge refuses a segment counted twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import IncompatibleResultsError, InputError, check_choice, is_integer
from .config import Sum, merge_arrays, shapes_of
from .engines.shift_sums import (
    ATTENTION_REPRESENTATIONS,
    ATTRIBUTION_GRAMS,
    DECOMPOSITION_SUMS,
    REPRESENTATION_LABELS,
    REPRESENTATION_UNITS,
    REPRESENTATIONS,
    TOTAL_BY_DIM,
    VECTOR_REPRESENTATIONS,
    SINK_SUMS,
    MASSIVE_SUMS,
    add_component_to_state,
    add_massive_sums,
    add_prediction_sums,
    add_sink_sums,
    add_to_cell,
    component_grams,
    counted_entries,
    end_context_of_cell,
    end_context_of_components,
    grid_sums,
    jensen_shannon_from,
    jensen_shannon_sum_to,
    new_component_state,
    new_massive_sums,
    new_sink_sums,
    next_token_distribution,
    segment_representations,
)

__all__ = [
    "REPRESENTATIONS",
    "REPRESENTATION_UNITS",
    "REPRESENTATION_LABELS",
    "ATTENTION_REPRESENTATIONS",
    "VECTOR_REPRESENTATIONS",
    "RESIDUAL_CENTRES",
    "DECOMPOSITION_SUMS",
    "PREDICTION_ARRAYS",
    "SINK_ARRAYS",
    "MASSIVE_ARRAYS",
    "ATTRIBUTION_ARRAYS",
    "SHIFT_ARRAYS",
    "ShiftConfig",
    "ShiftStatistics",
    "SegmentGrid",
    "segment_entries",
    "counted_entries",
    "segment_representations",
    "next_token_distribution",
    "jensen_shannon_from",
    "jensen_shannon_torch",
    "PATCH_ARRAYS",
    "PATCH_SEPARATOR",
    "patch_parts",
]

#: The predictions' sums: NLL of the segment's own next token by offset, Jensen–Shannon divergences between
#: offsets in one context (every pair ``s < s'``) and between consecutive contexts at one offset.
#: Shapes in letters of :meth:`ShiftConfig.sizes`: ``G`` interval groups, ``L`` layers, ``H`` query heads,
#: ``O`` offsets, ``1`` the residual stream's one "head", ``D`` its hidden dimensions.
PREDICTION_ARRAYS: dict[str, Sum] = {
    "nll_sum": Sum("G O", "Σ −log p(the segment's own next token), by offset"),
    "nll_count": Sum("G O", "positions behind nll_sum"),
    "js_offset_sum": Sum("G O O", "Σ JS(p_s, p_s') over contexts and positions, for offsets s < s' [s, s']"),
    "js_offset_count": Sum("G O O", "pairs behind js_offset_sum"),
    "js_context_sum": Sum("G O", "Σ JS between consecutive contexts at one offset, over positions"),
    "js_context_count": Sum("G O", "pairs behind js_context_sum"),
}
#: The attention the segment's rows put before the segment, by offset (the sink mass): sums over contexts and the
#: segment's rows (:func:`~equivariance_probe.statistics.engines.shift_sums.add_sink_sums`).
SINK_ARRAYS: dict[str, Sum] = dict(zip(SINK_SUMS, (
    Sum("G L H O", "Σ attention weight on the window's first key (the prefix token, else the context's first)"),
    Sum("G L H O", "Σ attention weight on the rest of the text before the segment (positions 1 .. start − 1)"),
    Sum("G L O", "segment rows behind the sink sums"),
)))
#: The residual stream's largest magnitudes at the segment, by offset (Sun et al. 2024's massive activations): sums
#: over contexts of each window's values (:func:`~equivariance_probe.statistics.engines.shift_sums.add_massive_sums`).
MASSIVE_ARRAYS: dict[str, Sum] = dict(zip(MASSIVE_SUMS, (
    Sum("G L O", "Σ max_d |h[0, d]|: the largest magnitude at the segment's first token, per window"),
    Sum("G L O", "Σ max over the segment's other tokens and d of |h|, per window (0 for a one-token segment)"),
    Sum("G L O", "Σ median |h| over the segment's m·d residual coordinates, per window"),
    Sum("G L O", "windows behind the massive-activation sums"),
)))
_DECOMPOSITION_MEANINGS = {
    "count": "entries (i, j) or (i, d) of every cell of the grid",
    "total": "Σ Y over every entry and cell of the grid",
    "cell_square": "Σ over entries of F·S·(mean of the entry over the grid)²",
    "within": "Σ over entries of Σ (Y − entry mean)²",
    "offset": "SS_offset: Σ over entries of F·Σ_s (offset mean − entry mean)²",
    "context": "SS_context: Σ over entries of S·Σ_f (context mean − entry mean)²",
}
#: The attribution's Gram matrices over the components (``C`` of them, :attr:`ShiftConfig.components`; 0 when no
#: attribution was asked for, so a plain run's arrays are empty): additive over segments, and every component's
#: share of the residual stream's offset (context) sum of squares is a sum of their entries
#: (:func:`~equivariance_probe.maths.shift.component_contributions`).
ATTRIBUTION_ARRAYS: dict[str, Sum] = {
    f"attribution/{term}_gram": Sum("G C C", f"K[c, c'] = {factor}·Σ ⟨δ_{index}(c), δ_{index}(c')⟩ over segment tokens "
                                    f"and {what}: the components' {term} effects' inner products")
    for term, factor, index, what in (("offset", "F", "s", "offsets"), ("context", "S", "f", "contexts"))
}
#: Activation patching's sums (``P`` patched items, 0 where patching was not asked for): for each item ``p``
#: (one component, or several joined by :data:`PATCH_SEPARATOR` and patched together) and offset ``s``, the
#: window at ``s`` runs with ``p``'s output at the segment's tokens replaced by its output in the window at the
#: reference offset ``s₀`` of the same context.
PATCH_ARRAYS: dict[str, Sum] = {
    "patch/js_sum": Sum("G P O", "Σ JS(patched p_s, clean p_s₀) over contexts and positions (row s₀: 0, never patched)"),
    "patch/js_count": Sum("G P O", "positions behind patch/js_sum"),
    "patch/residual_offset": Sum("G P", "SS_offset of the last block's residual stream on the patched grid (s₀ clean, "
                                        "every other offset patched): F·Σ over entries and offsets of (offset mean − "
                                        "entry mean)², per segment's grid"),
}
#: Joins the components of one patched item (``"attention.3+mlp.3"``: both replaced in the same pass).
PATCH_SEPARATOR = "+"
#: Every array of the state, declared once (see :mod:`equivariance_probe.statistics`).
SHIFT_ARRAYS: dict[str, Sum] = {
    **{f"{rep}/{name}": Sum("G L 1" if rep in VECTOR_REPRESENTATIONS else "G L H", _DECOMPOSITION_MEANINGS[name])
       for rep in REPRESENTATIONS for name in DECOMPOSITION_SUMS},
    **{f"{rep}/{TOTAL_BY_DIM}": Sum("G L D", "Σ Y per hidden dimension: the mean vector about which the sums of "
                                    "squares are taken (empty in a file of the grand-mean definition)")
       for rep in VECTOR_REPRESENTATIONS},
    **PREDICTION_ARRAYS,
    **SINK_ARRAYS,
    **MASSIVE_ARRAYS,
    **ATTRIBUTION_ARRAYS,
    **PATCH_ARRAYS,
    "segments": Sum("G", "segments counted in each interval group"),
}


#: How a vector-valued representation's sums of squares are centred: ``"mean_vector"`` (one mean per hidden
#: dimension; invariant to a shift of the origin and to a rotation of the hidden basis) or ``"grand_mean"`` (one
#: mean over tokens and dimensions: files written before the mean vector, whose residual-stream shares cannot be
#: recovered from their sums).
RESIDUAL_CENTRES = ("mean_vector", "grand_mean")
#: What a file's configuration without a key meant when it was written (before the mean vector was kept).
_FILE_DEFAULTS = {"hidden_size": 0, "residual_centre": "grand_mean", "components": (), "patch_components": (),
                  "patch_reference": 0}


def patch_parts(item: str) -> tuple[str, ...]:
    """The component names of one patched item (``"attention.3+mlp.3"`` -> ``("attention.3", "mlp.3")``)."""
    return tuple(item.split(PATCH_SEPARATOR))


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
        interval_groups: ``G``, groups of segments for the jackknife; 0 for none (the sums in one row, as with 1,
            but the result says that no intervals were asked for).
        causal: whether the model is causal (rows see keys ``j ≤ i``).
        sliding_windows: per layer, ``None`` or the window width.
        predictions: whether next-token predictions were measured.
        hidden_size: ``D``, the residual stream's width (0 where the per-dimension sums were not kept).
        residual_centre: one of :data:`RESIDUAL_CENTRES`: about what the residual stream's sums of squares
            were taken.
        components: the attribution's components (``"embedding"``, ``"attention.{l}"``, ``"mlp.{l}"``,
            ``"head.{l}.{h}"``), the rows and columns of its Gram matrices; empty without attribution.
        patch_components: the patched items (``P``), each a component name
            (:mod:`~equivariance_probe.adapters.components`) or several joined by :data:`PATCH_SEPARATOR`;
            empty without patching.
        patch_reference: the index of the reference offset ``s₀`` in ``offsets``.
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
    hidden_size: int = 0
    residual_centre: str = "mean_vector"
    components: tuple[str, ...] = ()
    patch_components: tuple[str, ...] = ()
    patch_reference: int = 0

    def __post_init__(self) -> None:
        check_choice("residual_centre", self.residual_centre, RESIDUAL_CENTRES)
        if not (is_integer(self.patch_reference, 0) and self.patch_reference < len(self.offsets)):
            raise InputError(f"patch_reference={self.patch_reference!r} must index one of the {len(self.offsets)} "
                             f"offsets {list(self.offsets)}; pass an integer from 0 to {len(self.offsets) - 1}")
        if self.patch_components and self.residual_centre != "mean_vector":
            raise InputError("patching measures the residual stream on the patched grid, which needs its width; "
                             "pass hidden_size and residual_centre='mean_vector'")
        if self.residual_centre == "mean_vector" and not (is_integer(self.hidden_size, 1)):
            raise InputError(f"hidden_size={self.hidden_size!r}: the residual stream's sums about its mean vector need "
                             "its width; pass the model's hidden size (a positive integer)")

    def sizes(self) -> dict[str, int]:
        """The letters of :data:`SHIFT_ARRAYS`' shapes."""
        return {"G": self.rows, "L": self.n_layers, "H": self.n_heads, "O": len(self.offsets), "1": 1,
                "D": self.hidden_size if self.residual_centre == "mean_vector" else 0, "C": len(self.components),
                "P": len(self.patch_components)}

    @property
    def rows(self) -> int:
        """Rows of the group sums: ``G``, or one (the totals) without interval groups."""
        return max(1, self.interval_groups)

    def differences(self, other: ShiftConfig) -> list[str]:
        """``"field: mine vs theirs"`` for every field that differs (what a refused merge names)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{key}: {mine[key]!r} vs {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]

    def to_dict(self) -> dict[str, Any]:
        return {"n_layers": self.n_layers, "n_heads": self.n_heads, "offsets": list(self.offsets),
                "n_contexts": self.n_contexts, "segment_length": self.segment_length,
                "prefix_length": self.prefix_length, "mode": self.mode, "interval_groups": self.interval_groups,
                "causal": self.causal, "sliding_windows": list(self.sliding_windows), "predictions": self.predictions,
                "hidden_size": self.hidden_size, "residual_centre": self.residual_centre,
                "components": list(self.components), "patch_components": list(self.patch_components),
                "patch_reference": self.patch_reference}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShiftConfig:
        """The configuration of :meth:`to_dict`; a key a file lacks takes what it meant when the file was written
        (:data:`_FILE_DEFAULTS`)."""
        return cls(**{**_FILE_DEFAULTS, **data, "offsets": tuple(data["offsets"]),
                      "sliding_windows": tuple(data["sliding_windows"]),
                      "components": tuple(data.get("components", ())),
                      "patch_components": tuple(data.get("patch_components", ()))})


def segment_entries(config: ShiftConfig, layer: int) -> torch.Tensor:
    """``[m, m]`` boolean: the entries ``(i, j)`` of the segment block that count at ``layer``
    (:func:`~equivariance_probe.statistics.engines.shift_sums.counted_entries` of the layer's mask)."""
    window = config.sliding_windows[layer] if config.sliding_windows else None
    return counted_entries(config.segment_length, config.causal, window)


def jensen_shannon_torch(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``JS(p, q)`` in nats over the last axis (:func:`~equivariance_probe.maths.shift.jensen_shannon`) of
    ``[n, vocab]`` log-probabilities, computed as the streaming run computes it."""
    return jensen_shannon_from(next_token_distribution(log_p), next_token_distribution(log_q))


class SegmentGrid:
    """The running sums of one segment while its ``F × S`` grid is measured, context by context.

    Call :meth:`add` for every (representation, layer, offset) of a context, then :meth:`end_context`;
    after the last context :meth:`sums` gives the segment's decomposition sums. The sums are
    :mod:`~equivariance_probe.statistics.engines.shift_sums`' functions, which a remote model's grid runs on the
    server (only :meth:`sums`' arrays come back).
    """

    def __init__(self, config: ShiftConfig) -> None:
        self.config = config
        self.contexts_done = 0
        #: ``[(representation, layer)]``: the running sums of one cell (see ``shift_sums``), filled on first use.
        self._cells: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._seen: set[tuple[str, int, int]] = set()
        #: Per offset, the latest context's next-token distributions (:func:`next_token_distribution`).
        self.distributions: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(config.offsets)
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: The attribution's running sums over the components (``shift_sums.new_component_state``).
        self._components = new_component_state(list(config.components), len(config.offsets))
        self._known_components = frozenset(config.components)
        #: The largest relative difference between the heads' pieces (with the bias) and their attention's output.
        self.heads_difference = 0.0
        # One segment's predictions: the shapes without the group letter.
        self.predictions = {name: np.zeros(shape[1:])
                            for name, shape in shapes_of(PREDICTION_ARRAYS, config.sizes(), config).items()}
        #: The attention before the segment, by offset (:data:`SINK_ARRAYS` without the group letter).
        self.sink = new_sink_sums(config.n_layers, config.n_heads, len(config.offsets))
        #: The residual stream's largest magnitudes at the segment, by offset (:data:`MASSIVE_ARRAYS` without the
        #: group letter).
        self.massive = new_massive_sums(config.n_layers, len(config.offsets))
        # Patching: one segment's divergences ([P, O]) and, per item and offset, Σ_f of the last block's residual
        # stream on the patched grid ([P, O, m·d], filled on first use; the reference offset's column is the clean
        # run's, read from the residual cell when the grid is complete).
        self.patched = {name: np.zeros(shape[1:]) for name, shape in shapes_of(PATCH_ARRAYS, config.sizes(), config).items()
                        if name != "patch/residual_offset"}
        self._patched_by_offset: torch.Tensor | None = None
        self._patched_seen: set[tuple[int, int]] = set()

    def add(self, representation: str, layer: int, offset_index: int, values: torch.Tensor) -> None:
        """``values: [head, E]`` (``[1, E]`` for the residual stream) of the current context at one offset."""
        key = (representation, layer, offset_index)
        if key in self._seen:
            raise InputError(f"{representation} of layer {layer} at offset index {offset_index} was added twice in one context")
        self._seen.add(key)
        add_to_cell(self._cells.setdefault((representation, layer), {}), values, offset_index, len(self.config.offsets))
        if representation == "residual":
            width = self.config.hidden_size or values.shape[-1] // self.config.segment_length  # [1, m·d] -> [m, d]
            add_massive_sums(self.massive, layer, offset_index, values.reshape(-1, width))

    def add_component(self, name: str, offset_index: int, values: torch.Tensor) -> None:
        """``values: [m, d]``: component ``name`` (one of :attr:`ShiftConfig.components`) at the segment's tokens,
        for the current context at one offset."""
        if name not in self._known_components:
            raise InputError(f"component {name!r} is not one of this run's components ({len(self._known_components)} "
                             "declared in ShiftConfig.components)")
        if (name, offset_index) in self._components["seen"]:
            raise InputError(f"component {name} at offset index {offset_index} was added twice in one context")
        add_component_to_state(self._components, name, offset_index, values)

    def add_heads_difference(self, value: float) -> None:
        """Note one forward pass's :class:`~equivariance_probe.features.segments.HeadsCheck` difference (the largest
        is kept in :attr:`heads_difference`; a NaN, heads that were not all seen, is kept for good)."""
        if not math.isnan(self.heads_difference):
            self.heads_difference = value if math.isnan(value) else max(self.heads_difference, value)

    def add_predictions(self, offset_index: int, log_probs: torch.Tensor, targets: torch.Tensor) -> None:
        """``log_probs: [m − 1, vocab]`` next-token log-probabilities at the segment's positions but the last,
        ``targets: [m − 1]`` the segment's own next tokens, for the current context at one offset
        (:func:`~equivariance_probe.statistics.engines.shift_sums.add_prediction_sums`, into this grid's arrays)."""
        sums = {name: torch.from_numpy(value) for name, value in self.predictions.items()}  # views: added in place
        add_prediction_sums(sums, self.distributions, self._current, offset_index, log_probs, targets)

    def add_sink(self, layer: int, offset_index: int, sink: torch.Tensor) -> None:
        """``sink: [head, m, 2]``, each segment row's attention weight on the window's first key and on the rest of
        the text before the segment, for the current context at one offset
        (:func:`~equivariance_probe.statistics.engines.shift_sums.add_sink_sums`)."""
        add_sink_sums(self.sink, layer, offset_index, sink)

    def add_patched(self, item: int, offset_index: int, log_probs: torch.Tensor | None,
                    last_residual: torch.Tensor) -> None:
        """One patched window of the current context, after the context's clean windows: patched item ``item``
        (an index into ``config.patch_components``) at offset ``offset_index`` (not the reference).

        Args:
            item: the patched item's index.
            offset_index: the window's offset.
            log_probs: ``[m − 1, vocab]`` the patched window's next-token log-probabilities at the segment's
                positions but the last (``None`` without predictions); paired with the clean reference window's
                distributions of the same context (:func:`jensen_shannon_sum_to`, as ``js_offset_sum`` pairs them).
            last_residual: ``[m, d]`` the patched window's residual stream after the last block at the segment.
        """
        config = self.config
        reference = config.patch_reference
        key = (item, offset_index)
        if not 0 <= item < len(config.patch_components) or offset_index == reference or key in self._patched_seen:
            raise InputError(f"patched window (item {item}, offset index {offset_index}) is not one of this context's "
                             f"{len(config.patch_components)} items at the offsets other than the reference "
                             f"{reference}, or was added twice")
        self._patched_seen.add(key)
        if log_probs is not None:
            clean = self._current.get(reference)
            if clean is None:
                raise InputError("a patched window came before the clean window at the reference offset of its "
                                 "context; run the context's clean windows first")
            self.patched["patch/js_sum"][item, offset_index] += jensen_shannon_sum_to(clean, log_probs)
            self.patched["patch/js_count"][item, offset_index] += log_probs.shape[0]
        values = last_residual.detach().to(torch.float64).reshape(-1)
        if self._patched_by_offset is None:
            self._patched_by_offset = torch.zeros((len(config.patch_components), len(config.offsets), values.numel()),
                                                  dtype=torch.float64, device=values.device)
        self._patched_by_offset[item, offset_index] += values

    def end_context(self) -> None:
        """Close the current context: every (representation, layer, offset) must have been added, and with
        patching every (item, offset other than the reference)."""
        expected = {(rep, layer, s) for rep, layer in self._cells for s in range(len(self.config.offsets))}
        if self._seen != expected:
            missing = sorted(expected - self._seen)[:3]
            raise InputError(f"a context of the segment's grid is incomplete (missing {missing}); every offset must run")
        if self.config.components:
            expected_components = len(self.config.components) * len(self.config.offsets)
            if len(self._components["seen"]) != expected_components:
                raise InputError(f"a context of the segment's grid holds {len(self._components['seen'])} of its "
                                 f"{expected_components} component values; every component must be added at every offset")
            end_context_of_components(self._components)
        patched = {(p, s) for p in range(len(self.config.patch_components)) for s in range(len(self.config.offsets))
                   if s != self.config.patch_reference}
        if self._patched_seen != patched:
            missing = sorted(patched - self._patched_seen)[:3]
            raise InputError(f"a context's patched windows are incomplete (missing (item, offset index) {missing})")
        self._patched_seen.clear()
        for cell in self._cells.values():
            end_context_of_cell(cell)
        self._seen.clear()
        self._current = {}
        self.contexts_done += 1

    def sums(self) -> dict[str, np.ndarray]:
        """The segment's :data:`DECOMPOSITION_SUMS` per representation (``"{rep}/{name}": [layer, head]``), its
        prediction sums (``[offset]``, ``[offset, offset]``), its sink sums (:data:`SINK_ARRAYS`) and its
        massive-activation sums (:data:`MASSIVE_ARRAYS`)."""
        if self.contexts_done != self.config.n_contexts:
            raise InputError(f"the segment's grid has {self.contexts_done} contexts done of {self.config.n_contexts}")
        sums = grid_sums(self._cells, self.config.n_layers, self.config.n_heads, self.contexts_done,
                         len(self.config.offsets), self.config.sizes()["D"])
        sums = ({name: value.numpy() for name, value in sums.items()} | self.predictions
                | {name: value.numpy() for name, value in (self.sink | self.massive).items()} | self._patch_sums())
        if self.config.components:
            grams = component_grams(self._components)
            sums |= {f"attribution/{term}_gram": grams[term].numpy() for term in ATTRIBUTION_GRAMS}
        return sums

    def _patch_sums(self) -> dict[str, np.ndarray]:
        """The segment's patching sums: the divergences, and ``SS_offset = F·Σ_{s,e} (Ȳ_se − Ȳ_e)²`` of the last
        block's residual stream on each item's patched grid (the reference offset's column the clean run's)."""
        config = self.config
        items = len(config.patch_components)
        if not items:
            return dict(self.patched) | {"patch/residual_offset": np.zeros(0)}
        by_offset = self._patched_by_offset.clone()
        clean = self._cells[("residual", config.n_layers - 1)]["by_offset"][0, config.patch_reference]
        by_offset[:, config.patch_reference] = clean
        means = by_offset / self.contexts_done                                  # [P, S, E]: Ȳ_se
        deviation = means - means.mean(1, keepdim=True)
        offset = self.contexts_done * (deviation * deviation).sum((1, 2))
        return dict(self.patched) | {"patch/residual_offset": offset.cpu().numpy()}


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
            if name not in data["arrays"] and 0 in statistics.shapes[name]:
                continue  # an array the file's definition does not keep (empty): written before it existed
            array = np.asarray(data["arrays"][name], dtype=np.float64)
            if array.shape != statistics.shapes[name]:
                raise IncompatibleResultsError(f"shift array {name!r} has shape {array.shape}, expected {statistics.shapes[name]}")
            statistics.arrays[name] = array
        statistics.segment_fingerprints = np.asarray(data["segment_fingerprints"], dtype=np.uint64)
        return statistics
