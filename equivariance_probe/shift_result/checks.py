"""The shift test's built-in checks, and how its numbers are written.

Place in the seams: one part of :mod:`~equivariance_probe.shift_result`, below its class: :func:`shift_check` (layer
0's offset η² under rotary positions) and :func:`attribution_check` (the components add up to the residual stream),
with their tolerances by dtype, both written into a finished run's metadata by :func:`record_checks`;
:func:`check_verdict` and :func:`number_cell` write them and the other numbers in a table. :data:`SHARE_BY`, the
split axes, is shared by the class's core and its mechanisms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import AttributionIdentityError
from ..maths.intervals import Interval, format_interval

__all__ = ["shift_check", "SHIFT_CHECK_TOLERANCE", "attribution_check", "attribution_failure", "record_checks", "ATTRIBUTION_TOLERANCE",
           "ATTRIBUTION_TERMS", "measured_terms", "HEADS_TOLERANCE", "check_verdict", "number_cell", "SHARE_BY"]


class CheckedResult(Protocol):
    """What the checks read of a :class:`~equivariance_probe.ShiftResult`: its design, its metadata and two of its
    numbers. Named here, below the class, so that the checks need nothing from the module that defines it."""

    metadata: dict[str, Any]

    @property
    def config(self) -> Any: ...

    @property
    def mode(self) -> str: ...

    def share(self, representation: str = ..., term: str = ..., by: str | None = ...,
              interval: float | None = ...) -> Any: ...

    def attribution_identity(self, term: str = ...) -> np.ndarray: ...


#: ``by`` choices of the shares (and of the sink mass).
SHARE_BY = (None, "layer", "head", "layer_group")


#: Largest layer-0 offset η² of the centred logits that counts as rounding, by the model's dtype: the logits are
#: computed from queries and keys in float32 (float64 for a float64 model); half precision rounds the keys.
SHIFT_CHECK_TOLERANCE = {"float64": 1e-12, "float32": 1e-8, "bfloat16": 1e-3, "float16": 1e-3}


def shift_check(result: CheckedResult, *, has_rotary: bool, dtype: str) -> dict[str, Any]:
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


def measured_terms(mode: str, terms: Sequence[str] = ATTRIBUTION_TERMS) -> list[str]:
    """The ``terms`` a run in ``mode`` measures: ``"position_ids"`` mode runs one context, so no ``"context"``."""
    return [term for term in terms if not (term == "context" and mode == "position_ids")]
#: Largest relative difference, by the model's dtype, between the components' sum of squares and the residual
#: stream's own that counts as rounding: the residual stream is the model's own sum of the components, rounded in
#: its dtype at every block, while the Gram adds them in float64. Half precision rounds each addition to about
#: 3 decimal digits, which the offset effect (a small part of the residual stream) does not survive: not judged.
ATTRIBUTION_TOLERANCE = {"float64": 1e-8, "float32": 1e-2}
#: Largest relative difference between the heads' pieces (with the projection's bias) and their attention's output.
HEADS_TOLERANCE = {"float64": 1e-6, "float32": 1e-3}


def attribution_check(result: CheckedResult, *, dtype: str, heads_difference: float | None = None) -> dict[str, Any]:
    """The attribution's built-in check: for every block and both terms, the components' sum of squares (from the
    Gram matrices) against the residual stream's own (from the blocks' outputs); and, where heads were read, that
    their pieces add up to their attention's output. Judged for float32 and float64 models."""
    by_term = {term: result.attribution_identity(term) for term in measured_terms(result.mode)}
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


def record_checks(result: CheckedResult, *, has_rotary: bool, dtype: str,
                  head_differences: Sequence[float | None] = ()) -> None:
    """Write a finished run's built-in checks into ``result.metadata``: ``"check"`` (:func:`shift_check`) and, for a
    run with attribution, ``"attribution_check"`` (:func:`attribution_check`, with the largest of
    ``head_differences``, one per segment, where heads were read).

    Raises:
        AttributionIdentityError: the attribution's check failed; the error keeps ``result``, its check marked.
    """
    result.metadata["check"] = shift_check(result, has_rotary=has_rotary, dtype=dtype)
    if not result.config.components:
        return
    with_heads = any(name.startswith("head.") for name in result.config.components)
    result.metadata["attribution_check"] = check = attribution_check(
        result, dtype=dtype,
        heads_difference=max((h for h in head_differences if h is not None), default=None) if with_heads else None)
    if check["passed"] is False:
        raise AttributionIdentityError(attribution_failure(check), result=result)


def attribution_failure(check: dict[str, Any]) -> str:
    """What a failed :func:`attribution_check` says."""
    return (f"the attribution's identity check failed: {check['description']} is {check['value']:.3g} (tolerance "
            f"{check['tolerance']}), heads against their attention {check.get('heads_max_difference')}; the residual "
            "stream is not the sum of the components this adapter reads (a norm after the residual addition, as in "
            "BERT's post-LN blocks, or a block it does not read whole), so the shares would be wrong. The run's sums "
            "are kept in the error's result (and probe.last_result); report the architecture")


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
