"""The pieces every shift figure shares: the variants drawn side by side, numbers with their jackknife
intervals as error bars, and titles that say whether the bars are intervals and what the offset means.

Place in the seams: *display*, below :mod:`~equivariance_probe.display.shift` and
:mod:`~equivariance_probe.display.shift_mechanisms`, which both draw with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import IntervalUnavailableError
from ..maths.intervals import Interval
from ..shift_result import ShiftResult
from .figures import _axes_title, figure_title, variants_of

__all__ = ["INTERVAL_LEVEL"]

#: The confidence level of every interval drawn.
INTERVAL_LEVEL = 0.95


def _variants(results: ShiftResult | Mapping[str, ShiftResult], baselines: Mapping[str, ShiftResult] | None = None,
              *, where: str) -> dict[str, ShiftResult]:
    """``{name: result}`` as every shift figure takes its variants: one result (named by its study variant, else
    its model) and its baselines, or one mapping of variants.

    Raises:
        InputError: anything but shift results, or a mapping of variants beside ``baselines``; ``where`` names the
            figure function in the message.
    """
    return variants_of(results, baselines, ShiftResult, where=where)


def _with_interval(number: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """``(estimate, [2, ...] distances to the interval's ends)`` for matplotlib's ``yerr`` (``None``: no interval)."""
    if not isinstance(number, Interval):
        return np.asarray(number, dtype=np.float64), None
    estimate = np.asarray(number.estimate, dtype=np.float64)
    low, high = np.asarray(number.low, dtype=np.float64), np.asarray(number.high, dtype=np.float64)
    return estimate, np.stack([np.maximum(estimate - low, 0.0), np.maximum(high - estimate, 0.0)])


def _number(method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method(..., interval=0.95)``, or the estimate alone where the segments fall into fewer than two groups."""
    try:
        return method(*args, interval=INTERVAL_LEVEL, **kwargs)
    except IntervalUnavailableError:
        return method(*args, **kwargs)


def _interval_note(results: Mapping[str, ShiftResult]) -> str:
    groups = {name: result.statistics.replicates()[0] for name, result in results.items()}
    if all(len(ids) >= 2 for ids in groups.values()):
        return f"bars: {INTERVAL_LEVEL:.0%} intervals over segments (jackknife)"
    return "no intervals: fewer than 2 groups of segments"


def _titled(fig: Any, ax: Any, text: str, variants: Mapping[str, ShiftResult], after: str = "") -> Any:
    """``fig`` with ``text`` and whether its bars are intervals as its title (``ax``'s when given), laid out."""
    title = f"{text} ({_interval_note(variants)}){after}"
    if ax is None:
        figure_title(fig, title)
    else:
        _axes_title(ax, title)
    fig.tight_layout()
    return fig


def _offset_meaning(result: ShiftResult) -> str:
    return ("offset = position and amount of preceding text" if result.mode == "text"
            else "offset = position ids only")
