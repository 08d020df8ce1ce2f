"""ShiftResult: what changes when the same text sits elsewhere in the window, with intervals over segments.

Place in the seams: beside :mod:`~equivariance_probe.result` (the probe's other result), above the
statistics (:class:`~equivariance_probe.statistics.shift.ShiftStatistics`, the sums), the maths
(:mod:`~equivariance_probe.maths.shift`, the decomposition) and the records (one safetensors file).

Numbers (docs/methods.md#shift-test; ``representation`` one of
:data:`~equivariance_probe.statistics.shift.REPRESENTATIONS`):

* :meth:`ShiftResult.share` — ``η²`` of the offset, the context, the pair (the equivariant part) or the
  residual, by head, layer, layer group (sliding/global) or for the model: ratios of summed sums of squares.
* :meth:`ShiftResult.offset_rms` — the root mean square of the offset effect, in the representation's unit.
* :meth:`ShiftResult.attribution` — each component's share of the residual stream's offset (or context) sum of
  squares after a block: ``C_c(l) / SS(r_l)``, from the attribution's Gram matrices (a run with
  ``attribution=True``), and :meth:`ShiftResult.attribution_rows` the same in long form.
* :meth:`ShiftResult.loss_by_offset` and :meth:`ShiftResult.divergence` — the segment's next-token loss per
  offset, the mean Jensen–Shannon divergence between offsets in one context and between consecutive contexts
  at one offset, and their ratio.
* :meth:`ShiftResult.sink_mass` — per offset, the mean attention weight the segment's rows put on the window's
  first key (the BOS sink), on the rest of the text before the segment, and on the segment itself.
* :meth:`ShiftResult.patching` — activation patching (a run with ``patch``): per patched component, the share
  of the prediction change and of the last block's residual offset sum of squares that goes away when its
  output at the segment is the reference offset's.

Every number takes ``interval=0.95``: the delete-a-group jackknife over groups of segments (segments fall
into groups by their fingerprint, as windows do in :class:`~equivariance_probe.ProbeResult`).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .analyses.results import SumsReadOnUse, Undefined, missing_as, split_axis
from .errors import (
    EmptyResultError,
    InputError,
    IncompatibleResultsError,
    IntervalUnavailableError,
    SupersededSumsError,
    UndefinedStatisticError,
    check_choice,
)
from .adapters.components import components_up_to, parse_component
from .markup import Markup
from .maths import shift as decomposition
from .maths.intervals import Interval, format_interval, jackknife_interval
from .records.shift_file import SHIFT_FORMAT_VERSION, SHIFT_KIND, ShiftFile, open_shift_file, write_shift_file
from .sources.registry import display_name
from .statistics.masks import layer_groups
from .statistics.shift import REPRESENTATION_UNITS, REPRESENTATIONS, VECTOR_REPRESENTATIONS, ShiftStatistics

__all__ = ["ShiftResult", "SHIFT_KIND", "SHIFT_FORMAT_VERSION", "shift_check", "SHIFT_CHECK_TOLERANCE", "number_cell",
           "check_verdict", "attribution_check", "attribution_failure", "ATTRIBUTION_TOLERANCE", "ATTRIBUTION_TERMS"]

#: ``by`` choices of the shares.
SHARE_BY = (None, "layer", "head", "layer_group")
#: Units of :meth:`ShiftResult.offset_rms`.
UNITS = REPRESENTATION_UNITS
OFFSET_MEANING = {
    "text": "the offset is the segment's position AND the amount of text before it (a text that ends the window "
            "cannot move without more or less text preceding it)",
    "position_ids": "the offset moves only the position ids of the prefix and segment; the tokens are the same",
}


class ShiftResult(SumsReadOnUse):
    """The shift test's sums and the numbers they give; merges over disjoint segments.

    Args:
        statistics: the :class:`~equivariance_probe.statistics.shift.ShiftStatistics`.
        metadata: model, design, check, versions.

    Example:
        >>> result = probe.shift(segments, contexts, offsets=[0, 256, 512])  # doctest: +SKIP
        >>> result.share("centred_logits", "offset", by="layer", interval=0.95)  # doctest: +SKIP
    """

    def __init__(self, statistics: ShiftStatistics | None, metadata: dict[str, Any] | None = None, *,
                 file: ShiftFile | None = None) -> None:
        if statistics is None and file is None:
            raise TypeError("ShiftResult needs statistics (or an opened file: ShiftResult.load)")
        self._statistics = statistics
        self._file = file
        self.metadata = dict(metadata or {})

    # -- the design ---------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self._file.config if self._statistics is None and self._file is not None else self.statistics.config

    @property
    def n_segments(self) -> int:
        return self._file.n_segments if self._statistics is None and self._file is not None else self.statistics.n_segments

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.config.offsets

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def complete(self) -> bool:
        return bool(self.metadata.get("complete", True))

    @property
    def model_name(self) -> str:
        """The model as the user named it (:func:`~equivariance_probe.sources.registry.display_name`: the command's
        ``--model``, else a packaged model's name rather than its converted copy's path)."""
        return display_name(self.metadata)

    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """``{"all": ...}``, plus ``"sliding"`` and ``"global"`` for a model with both kinds of layer."""
        windows = self.config.sliding_windows or (None,) * self.config.n_layers
        return layer_groups(windows)

    # -- numbers ------------------------------------------------------------------------------------
    def _sums(self, arrays: dict[str, np.ndarray], representation: str) -> dict[str, np.ndarray]:
        """The decomposition sums of ``representation`` in ``arrays`` (the totals, or the jackknife's replicates);
        a vector-valued one's centred on its mean vector (:func:`~equivariance_probe.maths.shift.centre_about_mean_vector`)."""
        check_choice("representation", representation, REPRESENTATIONS)
        sums = {name: arrays[f"{representation}/{name}"] for name in decomposition.DECOMPOSITION_SUMS}
        if representation in VECTOR_REPRESENTATIONS and self.config.residual_centre == "mean_vector":
            sums = decomposition.centre_about_mean_vector({**sums, "total_by_dim": arrays[f"{representation}/total_by_dim"]})
        return sums

    def _require_shares(self, representation: str) -> None:
        """Refuse the shares of a vector-valued representation whose sums were taken about one grand mean."""
        if representation in VECTOR_REPRESENTATIONS and self.config.residual_centre != "mean_vector":
            raise SupersededSumsError(
                f"this result's {representation} sums were taken about one grand mean over tokens and hidden "
                "dimensions (a file written before the mean vector was kept), which adds the spread of the mean "
                "vector's coordinates, a constant of the basis, to every sum of squares; the shares about the mean "
                "vector cannot be recovered from them. Run the shift test again with this version for the "
                f"{representation}'s shares; every other number of this result is unaffected")

    def _check_term(self, term: str) -> None:
        check_choice("term", term, decomposition.SHARES)
        if term == "context" and self.mode == "position_ids":
            raise UndefinedStatisticError(
                "position_ids mode runs one context (the prefix), so there is no context share; run mode='text' "
                "with contexts for it")

    def _number(self, function: Callable[[dict[str, np.ndarray]], Any], interval: float | None,
                upper: float | None = None) -> Any:
        """``function(totals)``, or its jackknife interval over groups of segments."""
        self._require_data()
        estimate = function(self.statistics.totals())
        if interval is None:
            return estimate
        if self.config.interval_groups == 0:
            raise IntervalUnavailableError(
                "this shift run kept no interval groups (interval_groups=0), so it has no intervals; run it again with "
                "interval_groups=20 (--interval-groups 20) for them")
        ids, replicates = self.statistics.replicates()
        if len(ids) < 2:
            raise IntervalUnavailableError(
                f"the {self.n_segments} segments fall into {len(ids)} interval group(s); a jackknife interval needs "
                "segments in at least 2 groups: run more segments (or interval_groups > 1)")
        values = function(replicates)
        if isinstance(estimate, dict):
            return {key: jackknife_interval(estimate[key], values[key], level=interval, upper=upper) for key in estimate}
        return jackknife_interval(estimate, values, level=interval, upper=upper)

    def _require_data(self) -> None:
        if self.n_segments == 0:
            raise EmptyResultError("this shift result holds no segment yet; run probe.shift(...) first")

    def decomposition(self, representation: str = "centred_logits", by: str | None = None) -> Any:
        """``{"all", "pair", "offset", "context", "residual"}`` sums of squares, summed to ``by``."""
        by = split_axis(by, SHARE_BY)
        self._require_shares(representation)
        sums = decomposition.aggregate(self._sums(self.statistics.totals(), representation), by or None,
                                       self.layer_groups())
        if by == "layer_group":
            return {group: decomposition.decomposition(value) for group, value in sums.items()}
        return decomposition.decomposition(sums)

    def share(self, representation: str = "centred_logits", term: str = "offset", by: str | None = None,
              interval: float | None = None) -> Any:
        """``η² = SS_term / SS_all`` of a representation.

        Args:
            representation: ``"centred_logits"``, ``"conditional_weights"``, ``"raw_weights"`` or ``"residual"``
                (the residual stream's sums of squares are taken about its mean vector: invariant to a shift of
                the origin and a rotation of the hidden basis).
            term: ``"offset"``, ``"context"``, ``"pair"`` (the equivariant part) or ``"residual"``.
            by: ``None`` (the model), ``"layer"`` (``[L]``), ``"head"`` (``[L, H]``; ``[L, 1]`` for the residual
                stream) or ``"layer_group"`` (``{group: value}``). Aggregates sum the SS first.
            interval: a confidence level (0.95) for an :class:`~equivariance_probe.Interval` over segments.

        Returns:
            A float or array, NaN where every value was equal (all-zero weights: undefined, see :attr:`undefined`).

        Raises:
            SupersededSumsError: the residual stream's shares of a file written before its sums were taken about
                the mean vector (run again for them).
        """
        self._check_term(term)
        by = split_axis(by, SHARE_BY)
        self._require_shares(representation)

        def value(arrays: dict[str, np.ndarray]) -> Any:
            result = self._share_of(arrays, representation, term, by)
            return result if isinstance(result, dict) or np.ndim(result) else float(result)

        return self._number(value, interval, upper=1.0)

    def _share_of(self, arrays: dict[str, np.ndarray], representation: str, term: str, by: str | None) -> Any:
        """The share ``term`` of ``representation`` in ``arrays`` (the totals, or the jackknife's replicates)."""
        sums = decomposition.aggregate(self._sums(arrays, representation), by, self.layer_groups())
        if by == "layer_group":
            return {group: decomposition.shares(part)[term] for group, part in sums.items()}
        return decomposition.shares(sums)[term]

    def offset_rms(self, representation: str = "centred_logits", by: str | None = None,
                   interval: float | None = None) -> Any:
        """``√(SS_offset / count)``: how far the offset moves the representation, in its own unit
        (:data:`UNITS`: nats for centred logits)."""
        by = split_axis(by, SHARE_BY)
        groups = self.layer_groups()

        def value(arrays: dict[str, np.ndarray]) -> Any:
            sums = decomposition.aggregate(self._sums(arrays, representation), by, groups)
            if by == "layer_group":
                return {group: decomposition.offset_rms(part) for group, part in sums.items()}
            result = decomposition.offset_rms(sums)
            return float(result) if np.ndim(result) == 0 else result

        return self._number(value, interval)

    @property
    def undefined(self) -> Undefined:
        """Representations whose shares are undefined for the model, and why."""
        out = Undefined()
        for representation in REPRESENTATIONS if self.n_segments else ():
            try:
                pair = self.share(representation, "pair")
            except SupersededSumsError as error:
                out[representation] = str(error)
                continue
            if math.isnan(pair):
                out[representation] = ("every value is the same at every entry, offset and context (e.g. all-zero "
                                       "weights, or a residual stream that is one constant vector), so there is no "
                                       "variance to share out")
        return out

    # -- attribution ----------------------------------------------------------------------------------
    def _require_attribution(self) -> None:
        if not self.config.components:
            raise UndefinedStatisticError(
                "this shift run split nothing into components; run it with attribution=True (--attribution), and "
                "attribution_heads=[...] (--attribution-heads 5,6,7) for heads")

    def attribution_layers(self) -> tuple[int, ...]:
        """The default target layers of :meth:`attribution`: the layer where the residual stream's offset η² peaks,
        and the last block (before the final norm)."""
        self._require_data()
        by_layer = np.asarray(self.share("residual", "offset", by="layer"), dtype=np.float64)
        peak = int(np.nanargmax(by_layer)) if np.isfinite(by_layer).any() else self.config.n_layers - 1
        return tuple(sorted({peak, self.config.n_layers - 1}))

    def _attribution_indices(self, layer: int) -> tuple[list[int], list[int]]:
        """``(rows, columns)`` of the Gram for block ``layer``: the components up to it (heads of layers up to it
        included) and the block-level ones whose sum is the residual stream after it."""
        names = self.config.components
        rows = [i for i, name in enumerate(names) if (parse_component(name)[1] or 0) <= layer]
        return rows, components_up_to(names, layer)

    def attribution(self, layer: int | Sequence[int] | None = None, term: str = "offset",
                    interval: float | None = None) -> dict[int, dict[str, Any]]:
        """Each component's share of the residual stream's ``term`` sum of squares after block ``layer``:
        ``C_c(l) / SS(r_l)`` with ``C_c(l) = Σ_{c' ≤ l} K[c, c']`` (docs/methods.md#attribution).

        The block-level shares (the embedding, each attention and MLP up to ``l``) sum to 1; a share can be
        negative (a component that cancels what the others write); a head's share is its part of its attention's.

        Args:
            layer: a block, several, or ``None`` for :meth:`attribution_layers`.
            term: ``"offset"`` or ``"context"``.
            interval: a confidence level (0.95) for jackknife intervals over groups of segments (each replicate a
                ratio of summed Gram entries).

        Returns:
            ``{layer: {component: share or Interval}}``, components in the order they write into the residual stream.

        Raises:
            UndefinedStatisticError: the run measured no attribution, or ``term="context"`` in ``position_ids`` mode.
        """
        check_choice("term", term, ATTRIBUTION_TERMS)
        self._check_term(term)
        self._require_attribution()
        layers = self.attribution_layers() if layer is None else (
            (layer,) if isinstance(layer, (int, np.integer)) else tuple(layer))
        out = {}
        for target in layers:
            if not 0 <= int(target) < self.config.n_layers:
                raise InputError(f"layer={target!r}: the model has {self.config.n_layers} layers (0 to "
                                 f"{self.config.n_layers - 1})")
            rows, columns = self._attribution_indices(int(target))

            def value(arrays: dict[str, np.ndarray], rows: list[int] = rows, columns: list[int] = columns) -> Any:
                return decomposition.component_shares(arrays[f"attribution/{term}_gram"], rows, columns)

            shares = self._number(value, interval)
            names = [self.config.components[i] for i in rows]
            if interval is None:
                out[int(target)] = {name: float(share) for name, share in zip(names, shares)}
            else:
                out[int(target)] = {name: _interval_item(shares, k) for k, name in enumerate(names)}
        return out

    def attribution_identity(self, term: str = "offset") -> np.ndarray:
        """``[L]`` per block, ``|Σ_c C_c(l) − SS(r_l)| / max(SS(r_l), Σ_c K[c, c], 1e-6·SS_all(r_l))``
        (:func:`~equivariance_probe.maths.shift.identity_difference`): the components' sum of squares (from the
        Gram) against the residual stream's own, measured from the blocks' outputs (rounding level when the residual
        stream is the sum of the components)."""
        check_choice("term", term, ATTRIBUTION_TERMS)
        self._require_attribution()
        totals = self.statistics.totals()
        gram = totals[f"attribution/{term}_gram"]
        residual = totals[f"residual/{term}"].sum(-1)
        everything = decomposition.decomposition(decomposition.aggregate(self._sums(totals, "residual"), "layer"))["all"]
        return np.array([decomposition.identity_difference(gram, components_up_to(self.config.components, layer),
                                                           float(residual[layer]), float(everything[layer]))
                         for layer in range(self.config.n_layers)])

    def attribution_rows(self, level: float | None = 0.95, layer: int | Sequence[int] | None = None) -> list[dict[str, Any]]:
        """:meth:`attribution` in long form: one dict per term, target layer and component (``term``, ``layer``,
        ``component``, ``kind``, ``component_layer``, ``head``, ``share``, ``low``, ``high``); intervals where
        the run has at least two groups of segments (else ``low`` and ``high`` are ``None``)."""
        terms = [t for t in ATTRIBUTION_TERMS if not (t == "context" and self.mode == "position_ids")]
        rows = []
        for term in terms:
            try:
                numbers = self.attribution(layer, term, interval=level)
            except IntervalUnavailableError:
                numbers = self.attribution(layer, term)
            for target, shares in numbers.items():
                for name, share in shares.items():
                    kind, component_layer, head = parse_component(name)
                    item = share.to_dict() if isinstance(share, Interval) else {"estimate": share}
                    rows.append({"term": term, "layer": target, "component": name, "kind": kind,
                                 "component_layer": component_layer, "head": head,
                                 "share": _plain(item.get("estimate")), "low": _plain(item.get("low")),
                                 "high": _plain(item.get("high"))})
        return rows

    def attribution_table(self, level: float | None = 0.95, layer: int | Sequence[int] | None = None,
                          smallest: float = 0.01) -> str:
        """A plain-text table of :meth:`attribution_rows`: per term and target layer, the components whose share
        is at least ``smallest`` in size, largest first, and the identity check."""
        rows = self.attribution_rows(level, layer)
        lines = [f"Attribution of the residual stream's sums of squares ({self.model_name}; shares of SS after the "
                 "block, block-level components sum to 1)"]
        for (term, target) in dict.fromkeys((row["term"], row["layer"]) for row in rows):
            chosen = sorted((row for row in rows if row["term"] == term and row["layer"] == target
                             and row["share"] is not None and abs(row["share"]) >= smallest),
                            key=lambda row: -abs(row["share"]))
            lines.append(f"  {term} SS after block {target}:")
            for row in chosen:
                cell = number_cell({"estimate": row["share"], "low": row["low"], "high": row["high"]}
                                   if row["low"] is not None else row["share"])
                lines.append(f"    {row['component']:<16}{cell:>32}")
        check = self.metadata.get("attribution_check")
        if isinstance(check, dict):
            lines.append(f"  check: {check.get('description')}: {number_cell(check.get('value'))} "
                         f"({check_verdict(check)}; tolerance {check.get('tolerance')})")
        return "\n".join(lines)

    def _require_predictions(self) -> None:
        if not self.config.predictions:
            raise UndefinedStatisticError("this run measured no next-token predictions (an encoder, or "
                                          "predictions=False); run a causal language model with predictions=True")

    def loss_by_offset(self, interval: float | None = None) -> Any:
        """``[S]`` the mean negative log-likelihood (nats) of the segment's own next tokens at each offset, over
        segments, contexts and the segment's positions but the last."""
        self._require_predictions()
        return self._number(lambda a: a["nll_sum"] / np.maximum(a["nll_count"], 1), interval)

    def divergence(self, kind: str = "offset", interval: float | None = None) -> Any:
        """The mean Jensen–Shannon divergence (nats) of the segment's next-token distributions: ``"offset"``,
        between two offsets in the same context (every pair of offsets), ``"context"``, between two contexts at
        the same offset (consecutive contexts in the given order: an unbiased estimate of the mean over all
        pairs of exchangeable contexts, with memory for one context), or ``"ratio"``, offset over context: how
        many times as much moving the text changes its predictions as changing what precedes it."""
        check_choice("kind", kind, ("offset", "context", "ratio"))
        self._require_predictions()
        if kind != "offset" and self.mode == "position_ids":
            raise UndefinedStatisticError("position_ids mode runs one context: no context divergence")

        def mean(arrays: dict[str, np.ndarray], name: str, axes: tuple[int, ...]) -> Any:
            with np.errstate(invalid="ignore", divide="ignore"):
                return arrays[f"{name}_sum"].sum(axes) / arrays[f"{name}_count"].sum(axes)

        def value(arrays: dict[str, np.ndarray]) -> Any:
            offset = mean(arrays, "js_offset", (-2, -1))
            if kind == "offset":
                return offset
            context = mean(arrays, "js_context", (-1,))
            with np.errstate(invalid="ignore", divide="ignore"):
                return context if kind == "context" else offset / context

        return self._number(value, interval)

    def sink_mass(self, part: str = "first_key", by: str | None = None, interval: float | None = None, *,
                  layer_groups: dict[str, Any] | None = None) -> Any:
        """The mean attention weight of the segment's rows on one part of the window, at each offset.

        Args:
            part: ``"first_key"`` (the window's first key: the tokenizer's prefix token, such as BOS, else the
                context's first token; 0 where nothing precedes the segment), ``"preceding"`` (the rest of the text
                before the segment, positions ``1 .. start − 1``, as a whole) or ``"segment"`` (the segment's own
                tokens: ``1 −`` the other two). Weights are under the layer's real mask: a sliding-window layer
                gives 0 to keys a window or more behind the row.
            by: ``None`` (every layer and head: ``[S]``), ``"layer"`` (``[L, S]``), ``"head"`` (``[L, H, S]``) or
                ``"layer_group"`` (``{group: [S]}``, the groups of :meth:`layer_groups` or ``layer_groups``).
            interval: a confidence level (0.95) for an :class:`~equivariance_probe.Interval` over segments.
            layer_groups: ``{name: layer indices}`` for ``by="layer_group"`` (default: :meth:`layer_groups`).

        Returns:
            Means over contexts, segments, the segment's rows and the heads of each aggregate (a head counts once
            per row), per offset: ``mean_i a_i0`` for the first key, ``mean_i Σ_{0<k<t} a_ik`` for the preceding
            text (``t`` the segment's first position).

        Raises:
            UndefinedStatisticError: a file written before the sink mass was kept (format 2 or older).
        """
        check_choice("part", part, decomposition.SINK_PARTS)
        by = split_axis(by, SHARE_BY)
        self._require_data()
        self._require_sink_mass()
        groups = (layer_groups or self.layer_groups()) if by == "layer_group" else None

        def value(arrays: dict[str, np.ndarray]) -> Any:
            return decomposition.sink_mass(arrays["sink/first_key"], arrays["sink/preceding"], arrays["sink/rows"],
                                           part, by, groups)

        return self._number(value, interval, upper=1.0)

    def _require_sink_mass(self) -> None:
        """Refuse the sink mass unless every segment's rows are in its sums (``F·m`` rows per segment, layer and
        offset): a file written before it was kept has none, and a merge with such a file only some."""
        rows = self.statistics.totals()["sink/rows"]
        if np.all(rows == self.n_segments * self.config.n_contexts * self.config.segment_length):
            return
        which = ("it was written before the shift test kept the attention before the segment (a file of format "
                 f"{self._file.format_version if self._file else '2 or older'})" if not rows.any() else
                 "some of its segments come from a file written before the shift test kept it (a merge with an "
                 "older file), so a mean over the rest would pass for one over every segment")
        raise UndefinedStatisticError(f"this result holds no sink mass: {which}; run the shift test again with this "
                                      "version for it")
    # -- activation patching -------------------------------------------------------------------------------
    #: What :meth:`patching` measures: the share of the prediction change that patching removes, and the share
    #: of the last block's residual offset sum of squares.
    PATCH_MEASURES = ("recovered", "residual_removed")

    def patching(self, measure: str = "recovered", interval: float | None = None) -> dict[str, Any]:
        """Per patched item (a component, or components joined by ``+``; ``config.patch_components``), how much of
        what the offset changes goes away when the item's output at the segment is the reference offset's ``s₀``.

        * ``"recovered"``: ``1 − Σ JS(patched_s, clean_s₀) / Σ JS(clean_s, clean_s₀)``, the sums over segments,
          contexts, offsets ``s ≠ s₀`` and the segment's positions (a ratio of sums): 0 where the item carries
          none of the offset into the predictions, 1 where patching it makes them the reference's.
        * ``"residual_removed"``: ``1 − SS_offset(patched) / SS_offset(clean)`` of the residual stream after the
          last block (before the final norm), both taken on each segment's grid about its own means (negative
          where patching moves the stream more).

        Args:
            measure: one of :data:`PATCH_MEASURES`.
            interval: a confidence level for jackknife intervals over groups of segments.

        Returns:
            ``{item: value}`` (NaN where the clean divergence or offset sum of squares is 0).

        Raises:
            UndefinedStatisticError: the run patched nothing (``patch=True`` / ``--patch`` patches), or
                ``"recovered"`` without predictions.
        """
        check_choice("measure", measure, self.PATCH_MEASURES)
        items = self.config.patch_components
        if not items:
            raise UndefinedStatisticError("this shift run patched nothing; run probe.shift(..., patch=True) "
                                          "(equivariance-probe shift --patch) for activation patching")
        if measure == "recovered":
            self._require_predictions()
        reference = self.config.patch_reference
        others = [s for s in range(len(self.offsets)) if s != reference]

        def value(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
            with np.errstate(invalid="ignore", divide="ignore"):
                if measure == "recovered":
                    patched = arrays["patch/js_sum"][..., others].sum(-1)
                    clean = sum(arrays["js_offset_sum"][..., min(s, reference), max(s, reference)] for s in others)
                else:
                    patched = arrays["patch/residual_offset"]
                    clean = arrays["residual/offset"][..., -1, 0]
                shares = 1.0 - patched / np.asarray(clean)[..., None]
            return {item: (float(shares[p]) if shares.ndim == 1 else shares[..., p]) for p, item in enumerate(items)}

        return self._number(value, interval)

    def patching_rows(self, level: float | None = 0.95) -> list[dict[str, Any]]:
        """:meth:`patching`'s numbers as one dict per item: ``component``, ``kind`` (``attention``, ``mlp``, ``head``,
        ``embedding`` or ``combined``), ``layer``, ``head``, ``recovered`` and ``residual_removed`` (an
        :class:`~equivariance_probe.Interval`'s dict with ``level``, where there are at least two groups of
        segments; else the estimate)."""
        measures = [m for m in self.PATCH_MEASURES if m != "recovered" or self.config.predictions]
        numbers = {}
        for measure in measures:
            try:
                numbers[measure] = self.patching(measure, interval=level) if level is not None else self.patching(measure)
            except IntervalUnavailableError:
                numbers[measure] = self.patching(measure)
        rows = []
        for item in self.config.patch_components:
            kind, layer, head = _patched_kind(item)
            rows.append({"component": item, "kind": kind, "layer": layer, "head": head,
                         **{measure: _plain(numbers[measure][item]) for measure in measures}})
        return rows

    def paired_difference(self, baseline: ShiftResult, representation: str = "centred_logits", term: str = "offset",
                          by: str | None = None, level: float = 0.95) -> Any:
        """``η²_self − η²_baseline`` with its interval from paired jackknife replicates: both results must hold the
        same segments (the same fingerprints, so the same groups), e.g. a model and its random initialisation or
        its bfloat16 copy on one grid.

        ``by`` as in :meth:`share`.

        Raises:
            IncompatibleResultsError: other segments, or another design.
        """
        by = split_axis(by, SHARE_BY)
        mine, theirs = np.sort(self.statistics.segment_fingerprints), np.sort(baseline.statistics.segment_fingerprints)
        if not np.array_equal(mine, theirs) or self.config != baseline.config:
            differences = self.config.differences(baseline.config)
            if not np.array_equal(mine, theirs):
                differences.append(f"segments: {mine.size} vs {theirs.size}, {np.intersect1d(mine, theirs).size} in both")
            raise IncompatibleResultsError(
                f"a paired difference needs both results on the same segments, contexts, offsets and interval groups "
                f"({'; '.join(differences)}); run the baseline on the same grid")
        pairs = (self.share(representation, term, by), baseline.share(representation, term, by))
        ids, a = self.statistics.replicates()
        _, b = baseline.statistics.replicates()
        if len(ids) < 2:
            raise IntervalUnavailableError("the segments fall into fewer than 2 interval groups: run more segments")
        replicates_a, replicates_b = (self._share_of(arrays, representation, term, by) for arrays in (a, b))
        if by == "layer_group":
            return {group: jackknife_interval(pairs[0][group] - pairs[1][group],
                                              replicates_a[group] - replicates_b[group], level=level)
                    for group in pairs[0]}
        return jackknife_interval(np.subtract(*pairs), replicates_a - replicates_b, level=level)

    # -- merging --------------------------------------------------------------------------------------
    def merge(self, other: ShiftResult, *, allow_duplicate_windows: bool = False) -> ShiftResult:
        """Both results' segments together (exact: the sums add); refused for results measured differently
        (another model, offsets, contexts or segment length), and for a segment in both unless
        ``allow_duplicate_windows`` (the probe's name for the same choice: a segment in both then counts
        twice, for users who weight segments twice on purpose)."""
        if not isinstance(other, ShiftResult):
            raise IncompatibleResultsError(f"can only merge a ShiftResult with another ShiftResult, not a "
                                           f"{type(other).__name__}")
        mine, theirs = self.metadata.get("model", {}), other.metadata.get("model", {})
        differences = self.config.differences(other.config)
        if mine.get("weights_sha256") != theirs.get("weights_sha256"):
            differences.insert(0, f"model: {self.model_name!r} (weights {str(mine.get('weights_sha256'))[:12]}) vs "
                                  f"{other.model_name!r} (weights {str(theirs.get('weights_sha256'))[:12]})")
        if self.metadata.get("contexts_sha256") != other.metadata.get("contexts_sha256"):
            differences.append(f"contexts: sha256 {str(self.metadata.get('contexts_sha256'))[:12]} vs "
                               f"{str(other.metadata.get('contexts_sha256'))[:12]}")
        if differences:
            raise IncompatibleResultsError(
                f"cannot merge shift results measured differently ({'; '.join(differences)}); merge the parts of one "
                "model run with the same contexts, offsets, mode, segment length and interval groups")
        metadata = {**self.metadata, "complete": self.complete and other.complete,
                    "run_ids": list(self.metadata.get("run_ids", [self.metadata.get("run_id")]))
                    + list(other.metadata.get("run_ids", [other.metadata.get("run_id")]))}
        theirs = other.statistics
        if allow_duplicate_windows:  # the sums add as they are; the fingerprints are both parts' after the merge
            theirs = copy.copy(theirs)
            theirs.segment_fingerprints = np.empty(0, dtype=np.uint64)
        statistics = self.statistics.merge(theirs)
        statistics.segment_fingerprints = np.concatenate([self.statistics.segment_fingerprints,
                                                          other.statistics.segment_fingerprints])
        merged = ShiftResult(statistics, metadata)
        if isinstance(self.metadata.get("attribution_check"), dict):
            checks = [self.metadata["attribution_check"], other.metadata.get("attribution_check") or {}]
            heads = [check.get("heads_max_difference") for check in checks if check.get("heads_max_difference") is not None]
            merged.metadata["attribution_check"] = attribution_check(
                merged, dtype=str(self.metadata.get("model", {}).get("dtype", "")),
                heads_difference=max(heads) if heads else None)
        if isinstance(self.metadata.get("check"), dict):
            merged.metadata["check"] = shift_check(merged, has_rotary=bool(self.metadata["check"].get("rotary")),
                                                   dtype=str(self.metadata.get("model", {}).get("dtype", "")))
        return merged

    def __add__(self, other: ShiftResult) -> ShiftResult:
        return self.merge(other)

    # -- display ----------------------------------------------------------------------------------------
    def summary(self, level: float = 0.95, *, missing: Any = None) -> dict[str, Any]:
        """Headline numbers as plain JSON values: per representation the model's shares, the offset RMS and the
        shares by layer group (with intervals where there are at least two groups of segments), the predictions,
        the built-in check, and what the offset means. Undefined values are ``missing`` (``None``, JSON's
        ``null``; ``math.nan`` for NaN)."""
        if self.n_segments == 0:
            return {"n_segments": 0}

        def number(function: Callable[[], Any]) -> Any:
            try:
                found = function()
            except UndefinedStatisticError:
                return None
            return _plain(found)

        def with_interval(function: Callable[..., Any]) -> Any:
            try:
                return _plain(function(interval=level))
            except IntervalUnavailableError:
                return number(function)
            except UndefinedStatisticError:
                return None

        terms = [t for t in ("offset", "context", "pair") if not (t == "context" and self.mode == "position_ids")]
        representations = {}
        for rep in REPRESENTATIONS:
            representations[rep] = {
                **{f"{term}_eta2": with_interval(lambda interval=None, t=term: self.share(rep, t, interval=interval))
                   for term in terms},
                "offset_rms": with_interval(lambda interval=None: self.offset_rms(rep, interval=interval)),
                "unit": UNITS[rep],
                "offset_eta2_by_layer": number(lambda: self.share(rep, "offset", by="layer")),
                "offset_eta2_by_layer_group": number(lambda: self.share(rep, "offset", by="layer_group")),
            }
        out = {
            "model": self.model_name, "mode": self.mode, "offset_means": OFFSET_MEANING[self.mode],
            "n_segments": self.n_segments, "n_contexts": self.config.n_contexts, "offsets": list(self.offsets),
            "segment_length": self.config.segment_length, "representations": representations,
            "undefined": dict(self.undefined), "check": self.metadata.get("check"), "complete": self.complete,
        }
        out["sink_mass"] = self._sink_summary(number, with_interval)
        if self.config.components:  # {term: {layer: {component: share with its interval}}}, and the identity check
            terms = [t for t in ATTRIBUTION_TERMS if not (t == "context" and self.mode == "position_ids")]
            out["attribution"] = {
                "layers": list(self.attribution_layers()), "check": self.metadata.get("attribution_check"),
                **{term: {str(layer): shares for layer, shares in
                          (with_interval(lambda interval=None, t=term: self.attribution(None, t, interval=interval))
                           or {}).items()} for term in terms}}
        if self.config.patch_components:
            out["patching"] = {"reference_offset": self.offsets[self.config.patch_reference],
                               "items": self.patching_rows(level)}
        if self.config.predictions:
            out["predictions"] = {
                "loss_by_offset": with_interval(self.loss_by_offset),
                "js_offset": with_interval(lambda interval=None: self.divergence("offset", interval)),
                "js_context": with_interval(lambda interval=None: self.divergence("context", interval)),
                "js_ratio": with_interval(lambda interval=None: self.divergence("ratio", interval)),
            }
        return missing_as(out, missing) if missing is not None else out

    def _sink_summary(self, number: Callable[..., Any], with_interval: Callable[..., Any]) -> dict[str, Any] | None:
        """:meth:`summary`'s sink mass: per part the model's mean by offset (with its interval), and by layer group
        where the model has more than one; ``None`` where the result holds none (a file written before it)."""
        try:
            self.sink_mass()
        except UndefinedStatisticError:
            return None
        groups = self.layer_groups()
        return {
            **{part: with_interval(lambda interval=None, p=part: self.sink_mass(p, interval=interval))
               for part in decomposition.SINK_PARTS},
            "by_layer_group": {part: {group: value for group, value in
                                      number(lambda p=part: self.sink_mass(p, by="layer_group")).items()
                                      if group != "all"} if len(groups) > 1 else {}
                               for part in decomposition.SINK_PARTS},
        }

    def table(self, level: float = 0.95) -> str:
        """A plain-text table of :meth:`summary` (and :meth:`attribution_table` for a run with attribution)."""
        summary = self.summary(level)
        if summary["n_segments"] == 0:
            return "ShiftResult: no segments"
        lines = [f"Shift test ({summary['mode']} mode) on {summary['model']}: {summary['n_segments']} segments of "
                 f"{summary['segment_length']} tokens, {summary['n_contexts']} context(s), offsets {summary['offsets']}",
                 f"  {summary['offset_means']}"]
        terms = [key for key in summary["representations"]["centred_logits"] if key.endswith("_eta2")]
        header = f"  {'representation':<20}" + "".join(f"{t.replace('_eta2', ' η²'):>32}" for t in terms) + f"{'offset RMS':>32}"
        lines.append(header)
        for rep, numbers in summary["representations"].items():
            cells = "".join(f"{number_cell(numbers[t]):>32}" for t in terms + ["offset_rms"])
            lines.append(f"  {rep:<20}{cells}  {numbers['unit']}")
        for rep, numbers in summary["representations"].items():
            groups = numbers["offset_eta2_by_layer_group"] or {}
            if len(groups) > 1:
                lines.append(f"  {rep} offset η² by layer group: "
                             + ", ".join(f"{g} {number_cell(v)}" for g, v in groups.items()))
        if summary["undefined"]:
            lines.append("  undefined: " + "; ".join(f"{rep} ({why})" for rep, why in summary["undefined"].items()))
        predictions = summary.get("predictions")
        if predictions:
            loss = predictions["loss_by_offset"]
            estimates = loss["estimate"] if isinstance(loss, dict) else loss
            lines.append("  next-token loss by offset (nats): "
                         + ", ".join(f"{s}: {v:.3f}" for s, v in zip(summary["offsets"], estimates)))
            lines.append(f"  Jensen–Shannon between offsets {number_cell(predictions['js_offset'])}, between contexts "
                         f"{number_cell(predictions['js_context'])}, ratio {number_cell(predictions['js_ratio'])}")
        sink = summary.get("sink_mass")
        if sink:
            lines.append("  attention before the segment (mean weight of its rows over layers and heads), by offset:")
            lines.extend(f"    {offset}: first key {number_cell(_at(sink['first_key'], i))}, preceding text "
                         f"{number_cell(_at(sink['preceding'], i))}" for i, offset in enumerate(summary["offsets"]))
        patching = summary.get("patching")
        if patching:
            lines.append(f"  activation patching (reference offset {patching['reference_offset']}): "
                         "recovered share of the prediction change, share of the last block's residual offset SS removed")
            for row in patching["items"]:
                lines.append(f"    {row['component']:<24}{number_cell(row.get('recovered')):>32}"
                             f"{number_cell(row.get('residual_removed')):>32}")
        check = summary.get("check") or {}
        if check:
            lines.append(f"  check: {check.get('description', '')}: {number_cell(check.get('value'))} ({check_verdict(check)}; "
                         f"{check.get('expected')}; tolerance {check.get('tolerance')})")
        if not summary["complete"]:
            lines.append("  PARTIAL: the run stopped before every segment was measured")
        if self.config.components:
            lines.append(self.attribution_table(level))
        return "\n".join(lines)

    def to_rows(self, level: float = 0.95) -> list[dict[str, Any]]:
        """The numbers in long form, one dict per statistic, representation and split (model, layer group,
        layer; the loss per offset), with their intervals, units and the run's model, variant, run id and
        mode (:mod:`~equivariance_probe.analyses.tidy` lists the columns). Built from :meth:`summary`;
        needs no pandas. ``equivariance-probe show --csv`` prints these rows."""
        from .analyses.tidy import shift_identity, shift_rows

        summary = self.summary(level)
        return shift_rows(summary, shift_identity(self.metadata, summary, self.model_name))

    def to_dataframe(self, level: float = 0.95) -> Any:
        """:meth:`to_rows` as a pandas ``DataFrame``.

        Raises:
            MissingDependencyError: pandas is not installed (the message gives ``pip install pandas``).
        """
        from .analyses.tidy import rows_dataframe

        return rows_dataframe(self.to_rows(level), "ShiftResult.to_dataframe()")

    def __repr__(self) -> str:
        if self.n_segments == 0:
            return f"ShiftResult(model={self.model_name!r}, empty)"
        eta = self.share("centred_logits", "offset")
        pair = self.share("centred_logits", "pair")
        try:
            residual = self.share("residual", "offset")
        except SupersededSumsError:
            residual = None
        return (f"ShiftResult(model={self.model_name!r}, {self.mode} mode, {self.n_segments} segments × "
                f"{self.config.n_contexts} contexts × {len(self.offsets)} offsets; centred logits: offset η²="
                f"{number_cell(eta)}, pair η²={number_cell(pair)}; residual offset η²={number_cell(residual)})")

    def _repr_html_(self) -> str:
        return Markup("<div><b>ShiftResult</b><pre>{}</pre></div>").format(self.table())

    # -- files ------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the sums (safetensors tensors, bitwise) and metadata and :meth:`summary` (JSON header), atomically
        (:mod:`~equivariance_probe.records.shift_file`)."""
        return write_shift_file(path, self.statistics, self.metadata, self.summary())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ShiftResult:
        """Read a file written by :meth:`save` (any version): the header now, checked field by field; the arrays
        the first time a number needs them, each checked against its digest then (:meth:`verify` reads them now).

        Raises:
            ResultFileError: truncated, edited, not a shift result, or from a newer format.
        """
        opened = open_shift_file(path)
        return cls(None, opened.metadata, file=opened)


#: Largest layer-0 offset η² of the centred logits that counts as rounding, by the model's dtype: the logits are
#: computed from queries and keys in float32 (float64 for a float64 model); half precision rounds the keys.
SHIFT_CHECK_TOLERANCE = {"float64": 1e-12, "float32": 1e-8, "bfloat16": 1e-3, "float16": 1e-3}


def shift_check(result: ShiftResult, *, has_rotary: bool, dtype: str) -> dict[str, Any]:
    """The built-in check of a shift run: with rotary positions, layer 0's scores depend on ``i − j`` alone, so its
    offset η² of the centred logits is at rounding level (any mode). Recorded for every model; judged for rotary ones."""
    value = result.share("centred_logits", "offset", by="layer")[0]
    value = None if not math.isfinite(float(value)) else float(value)
    check: dict[str, Any] = {"description": "layer-0 offset η² of the centred logits", "value": value,
                             "rotary": has_rotary}
    if has_rotary and value is None:
        check.update(tolerance=None, passed=None, expected="undefined: layer 0's centred logits do not vary (e.g. "
                     "all-zero weights)")
    elif has_rotary:
        tolerance = SHIFT_CHECK_TOLERANCE.get(dtype, 1e-3)
        check.update(tolerance=tolerance, passed=value <= tolerance,
                     expected="rounding level: rotary positions make layer 0's scores depend on i − j alone")
    else:
        check.update(tolerance=None, passed=None, expected="no expectation: the model has no rotary positions")
    return check


#: The attribution's terms (the residual stream's sums of squares it splits).
ATTRIBUTION_TERMS = ("offset", "context")
#: Largest relative difference, by the model's dtype, between the components' sum of squares and the residual
#: stream's own that counts as rounding: the residual stream is the model's own sum of the components, rounded in
#: its dtype at every block, while the Gram adds them in float64. Half precision rounds each addition to about
#: 3 decimal digits, which the offset effect (a small part of the residual stream) does not survive: not judged.
ATTRIBUTION_TOLERANCE = {"float64": 1e-8, "float32": 1e-2}
#: Largest relative difference between the heads' pieces (with the projection's bias) and their attention's output.
HEADS_TOLERANCE = {"float64": 1e-6, "float32": 1e-3}


def attribution_check(result: ShiftResult, *, dtype: str, heads_difference: float | None = None) -> dict[str, Any]:
    """The attribution's built-in check: for every block and both terms, the components' sum of squares (from the
    Gram matrices) against the residual stream's own (from the blocks' outputs); and, where heads were read, that
    their pieces add up to their attention's output. Judged for float32 and float64 models."""
    terms = [t for t in ATTRIBUTION_TERMS if not (t == "context" and result.mode == "position_ids")]
    by_term = {term: result.attribution_identity(term) for term in terms}
    value = max(float(np.max(values)) for values in by_term.values())
    tolerance = ATTRIBUTION_TOLERANCE.get(dtype)
    check: dict[str, Any] = {
        "description": "max over blocks of |Σ_c C_c(l) − SS(r_l)| / max(SS(r_l), Σ_c K[c, c], 1e-6·SS_all(r_l)), offset and context",
        "value": value, "by_layer": {term: [float(v) for v in values] for term, values in by_term.items()},
        "tolerance": tolerance, "passed": None if tolerance is None else bool(value <= tolerance),
        "expected": "rounding level: the residual stream after a block is the sum of the embedding and every "
                    "attention and MLP output up to it" if tolerance is not None else
                    f"not judged in {dtype}: the model's own additions round the offset effect",
    }
    if heads_difference is not None:
        heads_tolerance = HEADS_TOLERANCE.get(dtype)
        check["heads_max_difference"] = heads_difference
        check["heads_tolerance"] = heads_tolerance
        if heads_tolerance is not None and check["passed"] is not False:
            check["passed"] = bool(heads_difference <= heads_tolerance)
    return check


def attribution_failure(check: dict[str, Any]) -> str:
    """What a failed :func:`attribution_check` says."""
    return (f"the attribution's identity check failed: {check['description']} is {check['value']:.3g} (tolerance "
            f"{check['tolerance']}), heads against their attention {check.get('heads_max_difference')}; the residual "
            "stream is not the sum of the components this adapter reads (a norm after the residual addition, as in "
            "BERT's post-LN blocks, or a block it does not read whole), so the shares would be wrong. The run's sums "
            "are kept in the error's result (and probe.last_result); report the architecture")


def _interval_item(interval: Interval, index: int) -> Interval:
    """Entry ``index`` of an array-valued :class:`~equivariance_probe.Interval`."""
    def item(value: Any) -> Any:
        return None if value is None else float(np.asarray(value)[index])

    return Interval(item(interval.estimate), item(interval.low), item(interval.high), interval.level,
                    interval.n_groups, item(interval.standard_error), interval.method)
def _patched_kind(item: str) -> tuple[str, int | None, int | None]:
    """``(kind, layer, head)`` of a patched item: its component's, or ``("combined", None, None)`` for several."""
    if "+" in item:
        return "combined", None, None
    kind, _, rest = item.partition(".")
    numbers = [int(part) for part in rest.split(".")] if rest else []
    return kind, (numbers[0] if numbers else None), (numbers[1] if len(numbers) > 1 else None)


def _plain(value: Any) -> Any:
    if isinstance(value, Interval):
        value = value.to_dict()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = float(value)
    if isinstance(value, np.ndarray):
        return [None if not np.isfinite(v) else float(v) for v in value.ravel()] if value.ndim == 1 else \
            [_plain(row) for row in value]
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(float(value)) else float(value)
    return value


def _at(value: Any, index: int) -> Any:
    """Element ``index`` of a summary's per-offset number (a list, or an interval's dict of lists)."""
    if isinstance(value, dict):
        return {key: item[index] if isinstance(item, list) else item for key, item in value.items()}
    return value[index] if isinstance(value, list) else value


def check_verdict(check: dict[str, Any]) -> str:
    """``"passed"``, ``"NOT passed"`` or ``"not judged"``: a result's built-in check (:func:`shift_check`) in words."""
    return {True: "passed", False: "NOT passed", None: "not judged"}[check.get("passed")]


def number_cell(value: Any) -> str:
    """A number, ``number [low, high]``, or ``undefined``."""
    if isinstance(value, Interval):
        value = value.to_dict()
    if isinstance(value, dict) and "estimate" in value:
        if value["estimate"] is None:
            return "undefined"
        if 0 < abs(value["estimate"]) < 1e-3:  # rounding-level shares (position ids under rotary positions)
            return "{} [{}, {}]".format(*(f"{v:.2e}" if v is not None else "n/a"
                                          for v in (value["estimate"], value["low"], value["high"])))
        return format_interval(value["estimate"], value["low"], value["high"])
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "undefined"
    return f"{float(value):.4f}" if abs(float(value)) >= 1e-3 or value == 0 else f"{float(value):.2e}"

