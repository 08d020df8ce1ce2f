"""How a run measures: the options of :meth:`~equivariance_probe.EquivarianceProbe.run`, as one value.

Place in the seams: *statistics*. :class:`MeasurementOptions` is passed whole from the command line through
studies, comparisons and scans down to the probe, which builds its
:class:`~equivariance_probe.statistics.AttentionStatistics` from it; it names the statistics' settings (the key
bins, the engine, the interval groups, the log floor, the sample) beside the windows' (their length, their batch,
which are skipped). The shift test's options are :class:`~equivariance_probe.sources.shift_grid.ShiftOptions`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import InputError, check_integer, option
from .groups import DEFAULT_INTERVAL_GROUPS
from .masks import KEY_BINS

__all__ = ["Options", "MeasurementOptions", "MEASUREMENT_FIELDS", "check_measurement_values", "token_id_tensor"]


class Options:
    """What the probe's two option values share (:class:`MeasurementOptions` for ``run``,
    :class:`~equivariance_probe.sources.shift_grid.ShiftOptions` for ``shift``): a frozen dataclass copied with
    changes, and combined with single keywords the same way.

    A subclass names what one of its fields is called in messages (``_option``) and an example keyword.
    """

    _option: ClassVar[str] = "option"
    _example: ClassVar[str] = ""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the fields, in order."""
        return tuple(field.name for field in dataclasses.fields(cls))  # type: ignore[arg-type]

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (field name -> value).

        Raises:
            TypeError: a name that is not an option (listing those that are).
        """
        names = self.field_names()
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"{', '.join(unknown)} {f'is not a {self._option}' if len(unknown) == 1 else f'are not {self._option}s'}; "
                            f"the options are {', '.join(names)}")
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[type-var]

    @classmethod
    def of(cls, options: Any = None, /, **changes: Any) -> Any:
        """``options`` (default: the defaults) with ``changes``: how a function that takes both an options object
        and single keywords combines them (the keywords win).

        Raises:
            TypeError: ``options`` is not of this class (e.g. a value given by position: pass it by name), or a
                change is not an option.
        """
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a {cls.__name__}, not {type(options).__name__} ({options!r}); "
                            f"pass single options by name, e.g. {cls._example}")
        return (cls() if options is None else options).replace(**changes)


@dataclass(frozen=True)
class MeasurementOptions(Options):
    """How a run measures: one value passed whole from the command line through studies,
    comparisons and scans down to :meth:`EquivarianceProbe.run`.

    Every field has the default :meth:`EquivarianceProbe.run` uses; a study or a scan starts from its
    own defaults and sets what it decides (:meth:`replace`). The probe checks the values against the
    model when it runs (a context length longer than the model's maximum, excluded keys outside the
    window), so building one never fails on a value.

    Attributes:
        context_length: window length ``T`` in tokens (``None``: 1024, capped at the model's maximum;
            for a tensor, its width).
        batch_size: windows per forward pass. Results do not depend on it.
        exclude_keys: key positions left out of every statistic (e.g. ``(0,)``, the first token,
            which many heads use as an attention sink).
        log_floor: ``eps`` of the log scale, ``log max(a, eps)``; default the smallest normal number
            of the attention dtype (1.2e-38 for float32 and bfloat16).
        keep_pattern: also keep the pattern summed over windows (``8·L·H·T²`` bytes: 600 MB for
            Gemma 3 270M at T = 1024, in memory and in the result file), which only
            ``toeplitz_r2(by="head")``, ``mean_pattern`` and the ``toeplitz`` ranking score read.
        min_tokens: windows with fewer tokens are skipped (and counted).
        max_windows: stop after this many windows (``None``: no limit).
        sample_size: also keep a uniform sample of this many visible entries (for the
            attention-vs-prior scatter plot); 0 keeps none.
        sample_seed: seed of that sample (use different seeds for shards to be merged).
        device: where the float64 sums live (``None``: the model's device).
        key_bins: key-position bins of the key-conditioned persistence curves (the study's
            Figure 1c): one per key up to this many positions, equal-width bins beyond.
        engine: how attention recomputed from queries and keys is reduced: ``"auto"`` (a fused
            Triton kernel on CUDA where Triton imports, else torch in query blocks), ``"torch"`` or
            ``"triton"``.
        interval_groups: ``G``, groups of windows for the intervals over windows (the
            delete-a-group jackknife); 0 for none. Each group keeps ``8·(2·L·H·T + 4·L·H + L·T + T + 1)``
            bytes (1.2 MB for Gemma 3 270M at T = 1024); only groups that hold windows are kept.

    Example:
        >>> options = MeasurementOptions(context_length=256, exclude_keys=[0])
        >>> options.replace(batch_size=8).batch_size, options.exclude_keys
        (8, (0,))
    """

    context_length: int | None = None
    batch_size: int = 4
    exclude_keys: tuple[int, ...] = ()
    log_floor: float | None = None
    keep_pattern: bool = False
    min_tokens: int = 2
    max_windows: int | None = None
    sample_size: int = 0
    sample_seed: int | None = None
    device: str | torch.device | None = None
    key_bins: int = KEY_BINS
    engine: str = "auto"
    interval_groups: int = DEFAULT_INTERVAL_GROUPS

    _option: ClassVar[str] = "measurement option"
    _example: ClassVar[str] = "context_length=1024"

    def __post_init__(self) -> None:
        # Any iterable of positions is accepted, kept as a tuple so that the options stay hashable and
        # frozen; the probe checks the positions against the window when it runs.
        keys = self.exclude_keys
        if not isinstance(keys, tuple) and isinstance(keys, Iterable) and not isinstance(keys, (str, bytes)):
            object.__setattr__(self, "exclude_keys", tuple(keys))


#: The names of :class:`MeasurementOptions`' fields, in order.
MEASUREMENT_FIELDS: tuple[str, ...] = MeasurementOptions.field_names()


def check_measurement_values(options: MeasurementOptions) -> None:
    """Refuse, as typed, the options whose values would otherwise be coerced (``int(1.5)`` key positions, a
    fractional sample size) or fail deep inside (a log floor given as text)."""
    keys = options.exclude_keys
    if not isinstance(keys, tuple):
        raise InputError(f"exclude_keys must be a list of key positions, not {keys!r}; pass e.g. {option('exclude_keys', [0])}")
    for key in keys:  # numpy's integers are integers too (numbers.Integral); bool and float are not
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
            raise InputError(f"exclude_keys must be non-negative integer key positions; {key!r} is not one (of "
                             f"{list(keys)!r}); pass e.g. {option('exclude_keys', [0])}")
    check_integer("sample_size", options.sample_size, minimum=0, message=(
        f"sample_size must be a non-negative integer (0: no sample), not {options.sample_size!r}"))
    floor = options.log_floor
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not math.isfinite(floor)
                              or floor <= 0):
        raise InputError(f"log_floor must be a positive finite number or None (the dtype's smallest normal number), "
                         f"not {floor!r}; pass e.g. {option('log_floor', 1e-6)}")


def token_id_tensor(tokens: Any, name: str = "tokens") -> torch.Tensor:
    """``tokens`` as a ``long`` tensor, refused rather than converted where a value is not a whole token id: a
    float tensor or array (``torch.as_tensor(..., dtype=torch.long)`` would truncate 3.7 to the token 3), a bool,
    complex values, or text.

    Raises:
        InputError: naming the dtype (or the first value that is no integer) and the fix.
    """
    if isinstance(tokens, (str, bytes)):
        raise InputError(f"{name} is a string; pass token ids (the tokenizer's input_ids), not text")
    try:
        as_tensor = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(f"{name} cannot be read as a tensor of token ids ({error}); pass integer token ids "
                         f"[n_windows, T]") from None
    if as_tensor.is_floating_point() or as_tensor.is_complex() or as_tensor.dtype == torch.bool:
        raise InputError(f"{name} holds token ids as {as_tensor.dtype}; token ids are integers (a float id would be "
                         f"truncated to another token): convert with .long() where the values are whole numbers")
    return as_tensor.to(torch.long)
