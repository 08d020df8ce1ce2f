"""What carries the shift test's offset effect: attribution to components, the attention before the segment, and
activation patching.

Place in the seams: one part of :class:`~equivariance_probe.shift_result.ShiftResult` (the class mixes it in). Each
method reads a run's optional sums (``attribution=True``, the sink mass every run keeps since format 3, ``patch``)
through the class's :meth:`~equivariance_probe.shift_result.ShiftResult._number`, so every number takes
``interval=0.95`` as the shares do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..analyses.results import split_axis
from ..adapters.components import component_layer, components_up_to, parse_component
from ..errors import IntervalUnavailableError, UndefinedStatisticError, check_choice, check_indices
from ..maths import shift as decomposition
from ..maths.intervals import Interval
from .checks import ATTRIBUTION_TERMS, SHARE_BY, _plain, check_verdict, measured_terms, number_cell

__all__ = ["ShiftMechanisms", "patched_kind"]


class ShiftMechanisms:
    """Attribution, sink mass and patching of a :class:`~equivariance_probe.shift_result.ShiftResult`."""

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
        rows = [i for i, name in enumerate(names) if component_layer(name) <= layer]
        return rows, components_up_to(names, layer)

    def attribution(self, layer: int | Sequence[int] | None = None, term: str = "offset",
                    interval: float | None = None) -> dict[int, dict[str, Any]]:
        """Each component's share of the residual stream's ``term`` sum of squares after block ``layer``:
        ``C_c(l) / SS(r_l)`` with ``C_c(l) = Σ_{c' ≤ l} K[c, c']`` (docs/methods.md#shift-attribution).

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
            InputError: ``layer`` is not a layer of the model, or a list of them (a text, a bool, a float).
        """
        check_choice("term", term, ATTRIBUTION_TERMS)
        self._check_term(term)
        self._require_attribution()
        layers = self.attribution_layers() if layer is None else check_indices("layer", layer, self.config.n_layers)
        out = {}
        for target in layers:
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
        rows = []
        for term in measured_terms(self.mode):
            try:
                numbers = self.attribution(layer, term, interval=level)
            except IntervalUnavailableError:
                numbers = self.attribution(layer, term)
            for target, shares in numbers.items():
                for name, share in shares.items():
                    kind, own_layer, head = parse_component(name)
                    item = share.to_dict() if isinstance(share, Interval) else {"estimate": share}
                    rows.append({"term": term, "layer": target, "component": name, "kind": kind,
                                 "component_layer": own_layer, "head": head,
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
        check = self.recorded_checks()["attribution"]
        if isinstance(check, dict):
            lines.append(f"  check: {check.get('description')}: {number_cell(check.get('value'))} "
                         f"({check_verdict(check)}; tolerance {check.get('tolerance')})")
        return "\n".join(lines)

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
        self._require_counted("sink/rows", self.config.segment_length, "sink mass", "the attention before the segment",
                              "it", 2)

    def _require_counted(self, name: str, per_context: int, what: str, kept: str, pronoun: str, older: int) -> None:
        """Refuse ``what`` unless count array ``name`` holds ``per_context`` per context of every segment at every
        cell: a file written before it was kept (format ``older`` or older) has none, and a merge with such a file
        only some."""
        counted = self.statistics.totals()[name]
        if np.all(counted == self.n_segments * self.config.n_contexts * per_context):
            return
        which = (f"it was written before the shift test kept {kept} (a file of format "
                 f"{self._file.format_version if self._file else f'{older} or older'})" if not counted.any() else
                 f"some of its segments come from a file written before the shift test kept {pronoun} (a merge with an "
                 "older file), so a mean over the rest would pass for one over every segment")
        raise UndefinedStatisticError(f"this result holds no {what}: {which}; run the shift test again with this "
                                      f"version for {pronoun}")

    # -- massive activations ------------------------------------------------------------------------------
    def massive(self, part: str = "first_ratio", interval: float | None = None) -> Any:
        """The residual stream's largest magnitudes at the segment's tokens, per layer and offset (Sun et al. 2024's
        massive activations, read where the segment sits).

        For each window (one context at one offset) and block ``l``, with ``h`` the residual stream after the block
        at the segment's ``m`` tokens: ``max_d |h[0, d]|`` at the segment's first token, ``max_{i ≥ 1, d} |h[i, d]|``
        at its other tokens, and the median of the ``m·d`` magnitudes. At offset 0 the segment's first token is the
        window's first token only without a special prefix (``config.prefix_length == 0``); with one (BOS) the
        window's first token is the prefix, whose residual stream the test does not read. So ``first`` falling as
        the offset grows says the first token's massive activation belongs to the window's first position, not to
        the text's first token.

        Args:
            part: one of :data:`~equivariance_probe.maths.shift.MASSIVE_PARTS`: ``"first"``, ``"rest"``,
                ``"median"`` (means over contexts and segments) or ``"first_ratio"``, ``"rest_ratio"`` (each mean
                largest over the mean median).
            interval: a confidence level (0.95) for an :class:`~equivariance_probe.Interval` over segments.

        Returns:
            ``[layer, offset]``.

        Raises:
            UndefinedStatisticError: a file written before the massive activations were kept (format 3 or older),
                or merged with one.
        """
        check_choice("part", part, decomposition.MASSIVE_PARTS)
        self._require_data()
        self._require_counted("massive/windows", 1, "massive activations", "them", "them", 3)

        def value(arrays: dict[str, np.ndarray]) -> np.ndarray:
            return decomposition.massive_activations(arrays["massive/first"], arrays["massive/rest"],
                                                     arrays["massive/median"], arrays["massive/windows"], part)

        return self._number(value, interval)

    def _massive_summary(self, with_interval: Callable[..., Any]) -> dict[str, Any] | None:
        """:meth:`summary`'s massive activations: every part by layer and offset (with intervals where there are
        groups), and the layer where the largest over the median peaks; ``None`` for a file written before them."""
        try:
            ratio = np.fmax(self.massive("first_ratio"), self.massive("rest_ratio"))
        except UndefinedStatisticError:
            return None
        peak = int(np.nanargmax(np.nanmax(ratio, axis=1))) if np.isfinite(ratio).any() else 0
        return {"peak_layer": peak, **{part: with_interval(lambda interval=None, p=part: self.massive(p, interval))
                                       for part in decomposition.MASSIVE_PARTS}}

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
            kind, layer, head = patched_kind(item)
            rows.append({"component": item, "kind": kind, "layer": layer, "head": head,
                         **{measure: _plain(numbers[measure][item]) for measure in measures}})
        return rows

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


def _interval_item(interval: Interval, index: int) -> Interval:
    """Entry ``index`` of an array-valued :class:`~equivariance_probe.Interval`."""
    def item(value: Any) -> Any:
        return None if value is None else float(np.asarray(value)[index])

    return Interval(item(interval.estimate), item(interval.low), item(interval.high), interval.level,
                    interval.n_groups, item(interval.standard_error), interval.method)


def patched_kind(item: str) -> tuple[str, int | None, int | None]:
    """``(kind, layer, head)`` of a patched item: its component's, or ``("combined", None, None)`` for several."""
    if "+" in item:
        return "combined", None, None
    return parse_component(item)
