"""ShiftResult's core: the design, the decomposition's shares, the predictions, merging, the summary and display,
save and load.

Place in the seams: one part of :mod:`~equivariance_probe.shift_result`; the class mixes in
:class:`~equivariance_probe.shift_result.mechanisms.ShiftMechanisms` (attribution, sink mass, patching) and calls
:mod:`~equivariance_probe.shift_result.checks` for its built-in checks and its cells.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..analyses.results import SumsReadOnUse, missing_as, split_axis
from ..errors import (
    EmptyResultError,
    IncompatibleResultsError,
    IntervalUnavailableError,
    SupersededSumsError,
    UndefinedStatisticError,
    check_choice,
)
from ..markup import Markup
from ..maths import shift as decomposition
from ..maths.intervals import check_level, estimate_alone, jackknife_interval
from ..records.shift_file import ShiftFile, open_shift_file, write_shift_file
from ..sources.registry import display_name
from ..statistics.masks import layer_groups
from ..statistics.shift import REPRESENTATION_UNITS, REPRESENTATIONS, VECTOR_REPRESENTATIONS, ShiftStatistics
from .checks import (SHARE_BY, _at, _plain, attribution_check, check_verdict, measured_terms, number_cell,
                     shift_check)
from .mechanisms import ShiftMechanisms

__all__ = ["ShiftResult", "UNITS", "OFFSET_MEANING"]

#: Units of :meth:`ShiftResult.offset_rms`.
UNITS = REPRESENTATION_UNITS
OFFSET_MEANING = {
    "text": "the offset is the segment's position AND the amount of text before it (a text that ends the window "
            "cannot move without more or less text preceding it)",
    "position_ids": "the offset moves only the position ids of the prefix and segment; the tokens are the same",
}



def plain_numbers(value: Any) -> Any:
    """``value`` with every single number a Python ``float`` (a 0-d array or a numpy scalar becomes one), inside
    dictionaries too, so that a printed result shows ``0.0778`` and not ``array(0.0778)``; arrays stay arrays."""
    if isinstance(value, dict):
        return {key: plain_numbers(item) for key, item in value.items()}
    if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0:
        return value.item()  # float64 -> float, int64 -> int, bool_ -> bool
    return value

class ShiftResult(ShiftMechanisms, SumsReadOnUse):
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
        self._checks: dict[str, Any] | None = None

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
            return plain_numbers(estimate)
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
            return plain_numbers({group: decomposition.decomposition(value) for group, value in sums.items()})
        return plain_numbers(decomposition.decomposition(sums))

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
    def undefined(self) -> dict[str, str]:
        """Representations whose shares are undefined for the model, and why."""
        out: dict[str, str] = {}
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

    def paired_difference(self, baseline: ShiftResult, representation: str = "centred_logits", term: str = "offset",
                          by: str | None = None, level: float = 0.95) -> Any:
        """``η²_self − η²_baseline`` with its interval from paired jackknife replicates: both results must hold the
        same segments (the same fingerprints, so the same groups), e.g. a model and its random initialisation or
        its bfloat16 copy on one grid.

        ``by`` as in :meth:`share`. Where the segments fall into fewer than 2 groups (one segment), the
        difference comes without an interval: an :class:`~equivariance_probe.Interval` whose ends are NaN, which
        prints as ``0.0123 (no interval)``.

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
        if len(ids) < 2:  # no spread to measure: the differences alone, each printed as such
            difference = plain_numbers({group: pairs[0][group] - pairs[1][group] for group in pairs[0]}
                                       if by == "layer_group" else np.subtract(*pairs))
            if isinstance(difference, dict):
                return {group: estimate_alone(value, level=level, n_groups=len(ids)) for group, value in difference.items()}
            return estimate_alone(difference, level=level, n_groups=len(ids))
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

    def recorded_checks(self) -> dict[str, dict[str, Any] | None]:
        """The built-in checks the run recorded (``"check"``: :func:`~equivariance_probe.shift_result.shift_check`,
        ``"attribution"``: :func:`~equivariance_probe.shift_result.attribution_check`; ``None`` where it recorded
        none), as shown by :meth:`summary` and :meth:`table`. A loaded result's are recomputed from its arrays, never
        copied from its file's header (anyone who edits a file can write "passed" there); what no array holds is
        taken from the header: whether the model has rotary positions, its dtype (which sets the tolerance) and the
        largest difference between the heads' pieces and their attention's output, measured during the run."""
        if self._file is None:
            return {"check": self.metadata.get("check"), "attribution": self.metadata.get("attribution_check")}
        if self._checks is None:
            dtype = str((self.metadata.get("model") or {}).get("dtype", ""))
            stored, stored_attribution = self.metadata.get("check"), self.metadata.get("attribution_check")
            heads = stored_attribution.get("heads_max_difference") if isinstance(stored_attribution, dict) else None
            self._checks = {
                "check": (shift_check(self, has_rotary=stored.get("rotary") is True, dtype=dtype)
                          if isinstance(stored, dict) else None),
                "attribution": (attribution_check(self, dtype=dtype, heads_difference=heads if isinstance(
                    heads, (int, float)) and not isinstance(heads, bool) else None) if self.config.components else None),
            }
        return self._checks

    def __add__(self, other: ShiftResult) -> ShiftResult:
        return self.merge(other)

    # -- display ----------------------------------------------------------------------------------------
    def summary(self, level: float = 0.95, *, missing: Any = None) -> dict[str, Any]:
        """Headline numbers as plain JSON values: per representation the model's shares, the offset RMS and the
        shares by layer group (with intervals where there are at least two groups of segments), the predictions,
        the built-in check, and what the offset means. Undefined values are ``missing`` (``None``, JSON's
        ``null``; ``math.nan`` for NaN)."""
        level = check_level(level, "level")  # refused alike whether or not the run has intervals to give at it
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

        terms = measured_terms(self.mode, ("offset", "context", "pair"))
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
            "undefined": dict(self.undefined), "check": self.recorded_checks()["check"], "complete": self.complete,
        }
        out["sink_mass"] = self._sink_summary(number, with_interval)
        out["massive_activations"] = self._massive_summary(with_interval)
        if self.config.components:  # {term: {layer: {component: share with its interval}}}, and the identity check
            out["attribution"] = {
                "layers": list(self.attribution_layers()), "check": self.recorded_checks()["attribution"],
                **{term: {str(layer): shares for layer, shares in
                          (with_interval(lambda interval=None, t=term: self.attribution(None, t, interval=interval))
                           or {}).items()} for term in measured_terms(self.mode)}}
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
        massive = summary.get("massive_activations")
        if massive:
            layer = massive["peak_layer"]
            lines.append(f"  residual stream's largest magnitude over its median at the segment, block {layer} (where "
                         "it peaks), by offset:")
            lines.extend(f"    {offset}: first token {number_cell(_at(_at(massive['first_ratio'], layer), i))}, other tokens "
                         f"{number_cell(_at(_at(massive['rest_ratio'], layer), i))}" for i, offset in enumerate(summary["offsets"]))
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
        from ..analyses.tidy import shift_identity, shift_rows

        summary = self.summary(level)
        return shift_rows(summary, shift_identity(self.metadata, summary, self.model_name))

    def to_dataframe(self, level: float = 0.95) -> Any:
        """:meth:`to_rows` as a pandas ``DataFrame``.

        Raises:
            MissingDependencyError: pandas is not installed (the message gives ``pip install pandas``).
        """
        from ..analyses.tidy import rows_dataframe

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
