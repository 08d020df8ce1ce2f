"""What a shift result's sums must satisfy, checked when a file's arrays are read.

Place in the seams: *records*, beside :mod:`~equivariance_probe.records.shift_file`, which calls
:func:`check_shift_values` after the digests and the finiteness check. A digest proves only that the arrays are
the ones the header names, and anyone who edits a file can recompute it; these relations hold for every sum a run
writes, whatever the model, so a file that breaks one was edited or comes from a broken run, and a share read from
it would be wrong without a word (a negative sum of squares gives a negative η², a Gram matrix that is not
symmetric gives shares that do not add up to 1).

Each relation holds exactly in exact arithmetic; in float64 it holds to rounding of the sums it compares, so each
is checked with a relative tolerance of :data:`VALUE_TOLERANCE` of the magnitude involved:

* every sum of squares, count, divergence, loss, attention weight and magnitude sum is non-negative;
* per representation, ``SS_offset + SS_context ≤ SS_within`` (the offset and context effects are parts of each
  entry's variation about its own mean; the rest is their interaction, a sum of squares too), so the offset and
  context shares lie in ``[0, 1]``;
* a Jensen–Shannon divergence lies in ``[0, ln 2]``: each divergence sum is at most ``ln 2`` times its count;
* the attention the segment's rows put on the window's first key and on the text before the segment is at most
  one per row and head (to :data:`SINK_TOLERANCE`: the weights are rounded in the model's dtype);
* each attribution Gram matrix is symmetric with a non-negative diagonal.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import ResultFileError
from ..statistics.engines.shift_sums import MASSIVE_SUMS, REPRESENTATIONS, SINK_SUMS

__all__ = ["VALUE_TOLERANCE", "SINK_TOLERANCE", "check_shift_values"]

#: Relative tolerance of the relations: float64 sums over millions of terms carry rounding of about 1e-13 of
#: their magnitude; an edit that matters is far above this.
VALUE_TOLERANCE = 1e-9

#: Relative tolerance of the bound on the attention before the segment: a row's weights are the model's, rounded
#: in its dtype (bfloat16 keeps 8 bits, a relative 0.4 % per weight) before they are summed in float64.
SINK_TOLERANCE = 1e-2

#: Count of each bounded sum: a divergence sum is at most ``ln 2`` per pair it sums.
_DIVERGENCES = {"js_offset_sum": "js_offset_count", "js_context_sum": "js_context_count",
                "patch/js_sum": "patch/js_count"}
#: Sums that are non-negative term by term (besides the sums of squares, checked per representation).
_NON_NEGATIVE = ("nll_sum", "nll_count", *_DIVERGENCES, *_DIVERGENCES.values(), *SINK_SUMS,
                 *MASSIVE_SUMS, "patch/residual_offset", "segments")


def check_shift_values(arrays: Mapping[str, np.ndarray], source: str | os.PathLike) -> None:
    """Refuse sums that no run can write (see the module's list).

    Args:
        arrays: a shift result's arrays (:data:`~equivariance_probe.statistics.shift.SHIFT_ARRAYS`), each
            ``[group, ...]``; checked per interval group, as each group is a sum a run wrote.
        source: the file, for the message.

    Raises:
        ResultFileError: naming the file, the array, where and by how much the relation fails.
    """
    def refuse(name: str, what: str, where: tuple, value: float) -> None:
        raise ResultFileError(
            f"{source}: the array {name!r} {what} (at index {list(map(int, where))}: {value:.6g}), which no run writes: "
            "the file was edited (its digests recomputed) or comes from a broken run; use an intact copy, or run again")

    def non_negative(name: str, values: np.ndarray, scale: np.ndarray | float) -> None:
        bad = values < -VALUE_TOLERANCE * np.maximum(scale, 1e-300)
        if bad.any():
            where = tuple(np.argwhere(bad)[0])
            refuse(name, "holds a negative sum", where, float(values[where]))

    for name in _NON_NEGATIVE:
        if name in arrays and arrays[name].size:
            values = np.asarray(arrays[name], dtype=np.float64)
            non_negative(name, values, float(np.abs(values).max()))
    for rep in REPRESENTATIONS:
        sums = {part: np.asarray(arrays[f"{rep}/{part}"], dtype=np.float64)
                for part in ("count", "within", "offset", "context", "cell_square") if f"{rep}/{part}" in arrays}
        if len(sums) < 5:
            continue
        scale = np.abs(sums["within"]) + np.abs(sums["offset"]) + np.abs(sums["context"]) + np.abs(sums["cell_square"])
        for part in ("count", "within", "offset", "context", "cell_square"):
            non_negative(f"{rep}/{part}", sums[part], scale)
        excess = sums["offset"] + sums["context"] - sums["within"]
        bad = excess > VALUE_TOLERANCE * np.maximum(scale, 1e-300)
        if bad.any():
            where = tuple(np.argwhere(bad)[0])
            refuse(f"{rep}/offset", "with its context term exceeds the variation they are parts of "
                   "(SS_offset + SS_context > SS_within: a share above 1)", where, float(sums["offset"][where]))
    for name, count_name in _DIVERGENCES.items():
        if name in arrays and count_name in arrays and arrays[name].size:
            values, count = np.asarray(arrays[name]), np.asarray(arrays[count_name])
            bad = values > math.log(2.0) * count * (1 + VALUE_TOLERANCE) + VALUE_TOLERANCE
            if bad.any():
                where = tuple(np.argwhere(bad)[0])
                refuse(name, f"exceeds ln 2 per pair counted in {count_name!r} (a Jensen–Shannon divergence is at "
                       "most ln 2)", where, float(values[where]))
    _check_sinks(arrays, refuse)
    _check_grams(arrays, refuse)


def _check_sinks(arrays: Mapping[str, np.ndarray], refuse: Callable[..., None]) -> None:
    """The weight on the first key and on the text before the segment is at most 1 per row and head."""
    first, preceding, rows = SINK_SUMS
    if not all(name in arrays and arrays[name].size for name in SINK_SUMS):
        return
    mass = np.asarray(arrays[first]) + np.asarray(arrays[preceding])  # [G, L, H, O]
    limit = np.asarray(arrays[rows])[:, :, None, :]  # [G, L, 1, O]
    bad = mass > limit * (1 + SINK_TOLERANCE)
    if bad.any():
        where = tuple(np.argwhere(bad)[0])
        refuse(first, f"with {preceding!r} exceeds one attention weight per row counted in {rows!r}", where,
               float(mass[where]))


def _check_grams(arrays: Mapping[str, np.ndarray], refuse: Callable[..., None]) -> None:
    """Each attribution Gram matrix ``[G, C, C]`` is symmetric with a non-negative diagonal, to rounding of the
    whole: the context Gram is a difference of two sums over the grid (``Σ_f B_f·B_fᵀ / S − T·Tᵀ/(F·S)``), so where
    nothing moves with the context its diagonal is rounding of the residual stream's size, of either sign."""
    names = [name for name in ("attribution/offset_gram", "attribution/context_gram")
             if name in arrays and np.asarray(arrays[name]).size]
    if not names:
        return
    groups = np.asarray(arrays[names[0]]).shape[0]
    whole = np.zeros(groups)  # per group: the residual stream's largest sum of squares, and the Grams' diagonals
    if "residual/within" in arrays:
        within = np.abs(np.asarray(arrays["residual/within"], dtype=np.float64))
        whole = np.maximum(whole, within.reshape(groups, -1).max(-1) if within.size else 0.0)
    for name in names:
        whole = np.maximum(whole, np.abs(np.diagonal(np.asarray(arrays[name], dtype=np.float64), axis1=-2,
                                                     axis2=-1)).max(-1))
    scale = np.maximum(whole, 1e-300)[:, None, None]
    for name in names:
        gram = np.asarray(arrays[name], dtype=np.float64)
        diagonal = np.diagonal(gram, axis1=-2, axis2=-1)  # [G, C]
        bad = diagonal < -VALUE_TOLERANCE * scale[:, :, 0]
        if bad.any():
            where = tuple(np.argwhere(bad)[0])
            refuse(name, "has a negative diagonal entry (a component's sum of squares)", where, float(diagonal[where]))
        asymmetry = np.abs(gram - np.swapaxes(gram, -1, -2))
        bad = asymmetry > VALUE_TOLERANCE * scale
        if bad.any():
            where = tuple(np.argwhere(bad)[0])
            refuse(name, "is not symmetric (K[c, c'] ≠ K[c', c], an inner product)", where, float(gram[where]))
