"""The one language every result speaks: the :class:`Result` protocol and the conventions behind it.

Place in the seams: *analyses*, below the probe's result (:class:`~equivariance_probe.result.ProbeResult`),
the shift test's (:class:`~equivariance_probe.shift_result.ShiftResult`) and the positional study
(:class:`~equivariance_probe.runs.positional.PositionalStudy`), which all import it; it imports nothing of
theirs. What one result means by a name, the others mean too:

* ``model_name``, ``complete``, ``config`` (how the numbers were measured), ``metadata``;
* ``undefined``: a property, ``{statistic: why}`` of the numbers this result has no value for;
* ``summary(level)``, ``table(level)``, ``to_rows(level)``: the headline numbers as plain JSON values,
  as text, and in long form. A missing or undefined number is ``None`` there (what JSON and the tidy
  rows hold); ``summary(level, missing=math.nan)`` gives NaN in its place instead. The number methods
  themselves (``query_position_r2``, ``share``, ...) return floats and numpy arrays, NaN where undefined,
  so that arithmetic on them needs no test for ``None``;
* ``by=`` is the split axis wherever it appears: ``None`` (or its synonym ``"total"``) for one number,
  ``"layer"``, ``"head"``, ``"layer_group"`` (and the few axes a number adds, e.g. ``"key_position"``);
* asking an empty result for a number raises :class:`~equivariance_probe.errors.EmptyResultError`
  (a :class:`~equivariance_probe.errors.NotRunError`);
* results of sums (:class:`MergeableResult`) also merge (``a + b``, ``merge(other,
  allow_duplicate_windows=...)``), split by ``layer_groups()`` and give ``a.paired_difference(b, ...)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from ..errors import check_choice

__all__ = ["Result", "MergeableResult", "SumsReadOnUse", "TOTAL", "split_axis", "missing_as"]

#: The synonym of ``by=None`` (one number over everything) every ``by=`` accepts.
TOTAL = "total"


@runtime_checkable
class Result(Protocol):
    """What every result of the package has (see the module docstring for the conventions)."""

    metadata: dict[str, Any]

    @property
    def model_name(self) -> str: ...

    @property
    def complete(self) -> bool: ...

    @property
    def config(self) -> Any: ...

    @property
    def undefined(self) -> Mapping[str, str]: ...

    def summary(self, level: float = 0.95, *, missing: Any = None) -> dict[str, Any]: ...

    def table(self, level: float = 0.95) -> str: ...

    def to_rows(self, level: float = 0.95) -> list[dict[str, Any]]: ...


@runtime_checkable
class MergeableResult(Result, Protocol):
    """A result of sums (the probe's, the shift test's): merges exactly and pairs with a baseline."""

    def layer_groups(self) -> dict[str, tuple[int, ...]]: ...

    def merge(self, other: Any, *, allow_duplicate_windows: bool = False) -> Any: ...

    def __add__(self, other: Any) -> Any: ...

    def paired_difference(self, baseline: Any, *args: Any, **kwargs: Any) -> Any: ...


class SumsReadOnUse:
    """The sums of a result of streamed sums (:class:`MergeableResult`), read from its file on first use: a loaded
    result opens its file and checks its header, and reads (and checks) the arrays only when a number needs them.

    A result keeps ``_statistics`` (``None`` until read) and ``_file`` (the opened file, ``None`` for sums made
    here); replacing the sums forgets the file, and what the result had derived from the file's sums
    (:meth:`_forget_stored`).
    """

    _statistics: Any
    _file: Any

    @property
    def statistics(self) -> Any:
        """The sums (a loaded result's arrays are read from its file now, once, each checked against its digest)."""
        if self._statistics is None:
            assert self._file is not None
            self._statistics = self._file.statistics()
        return self._statistics

    @statistics.setter
    def statistics(self, statistics: Any) -> None:
        self._statistics = statistics
        self._file = None
        self._forget_stored()

    def _forget_stored(self) -> None:
        """Forget what was derived from the file's sums (nothing, unless a result keeps such a thing)."""

    @property
    def integrity(self) -> str | None:
        """How a loaded result's arrays are checked when read (``None`` for a result not loaded from a file):
        ``"digests"`` (each array against its own sha256, stored when the file was written), ``"checksum"`` (a file
        written before per-array digests: one checksum over all arrays, so a mismatch names no array) or
        ``"unverified"`` (a probe result's format 1: nothing to check against)."""
        return None if self._file is None else self._file.integrity

    def verify(self) -> str | None:
        """Read a loaded result's arrays now and check them (see :attr:`integrity`, which it returns).

        Raises:
            ResultFileError: an array does not match its digest (the message names the file and the array).
        """
        self.statistics
        return self.integrity


def split_axis(by: Any, allowed: Iterable[Any]) -> Any:
    """``by`` checked against ``allowed`` (with ``"total"`` wherever ``None`` is allowed), ``"total"`` as ``None``.

    Raises:
        InputError: ``by`` is not allowed (the message lists the allowed values).
    """
    allowed = tuple(allowed)
    check_choice("by", by, allowed + ((TOTAL,) if None in allowed and TOTAL not in allowed else ()))
    return None if by == TOTAL else by


def missing_as(value: Any, missing: Any) -> Any:
    """``value`` (a summary: dicts, lists, numbers) with every missing number, ``None`` or NaN, as ``missing``."""
    if isinstance(value, dict):
        return {key: missing_as(item, missing) for key, item in value.items()}
    if isinstance(value, list):
        return [missing_as(item, missing) for item in value]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return value
