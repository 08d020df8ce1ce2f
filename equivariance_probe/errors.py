"""One exception family for everything the probe refuses.

Every error says what was wrong and how to fix it. Catch
:class:`EquivarianceProbeError` to catch them all.
"""

from __future__ import annotations

__all__ = [
    "EquivarianceProbeError",
    "UnsupportedModelError",
    "AttentionCaptureError",
    "InputError",
    "EmptyCorpusError",
    "ContextLengthError",
    "NonFiniteAttentionError",
    "NotRunError",
    "IncompatibleResultsError",
    "ResultFileError",
    "ModelNotFoundError",
    "RemoteExecutionError",
    "MissingAPIKeyError",
    # issue 8: packaged-model registry and the comparison
    "ModelFileError",
    "InsufficientMemoryError",
    # issue 7: checkpoints
    "CheckpointError",
]


class EquivarianceProbeError(Exception):
    """Base class of every error raised by equivariance_probe."""


class UnsupportedModelError(EquivarianceProbeError, TypeError):
    """The object given as a model is of a type no adapter supports."""


class AttentionCaptureError(EquivarianceProbeError, RuntimeError):
    """Attention weights could not be captured (no hook point, non-eager attention, empty capture)."""


class InputError(EquivarianceProbeError, ValueError):
    """Documents or token ids that cannot be run (wrong dtype, shape, ids outside the vocabulary)."""


class EmptyCorpusError(InputError):
    """No document produced a single token."""


class ContextLengthError(InputError):
    """A window is longer than the model's maximum context."""


class NonFiniteAttentionError(EquivarianceProbeError, FloatingPointError):
    """The model produced NaN or infinite attention weights."""


class NotRunError(EquivarianceProbeError, RuntimeError):
    """Results were asked for before any data was run."""


class IncompatibleResultsError(EquivarianceProbeError, ValueError):
    """Two results (or statistics) that were measured differently cannot be merged."""


class ResultFileError(EquivarianceProbeError, ValueError):
    """A saved result file is truncated, malformed, or of an unknown format version."""


class ModelNotFoundError(InputError, FileNotFoundError):
    """A model name is neither packaged, nor a local folder, nor in the local Hugging Face cache."""


class RemoteExecutionError(EquivarianceProbeError, RuntimeError):
    """A remote (NDIF) run could not be started or did not complete."""


class MissingAPIKeyError(RemoteExecutionError):
    """``remote=True`` without an NDIF API key."""


# --- issue 8: packaged-model registry and the cross-model comparison


class ModelFileError(EquivarianceProbeError, ValueError):
    """A packaged model file has the wrong size or checksum (a damaged or partial install)."""


class InsufficientMemoryError(EquivarianceProbeError, MemoryError):
    """A model's estimated memory need exceeds the memory available; raised before loading it."""


# --- issue 7: checkpoints


class CheckpointError(EquivarianceProbeError, ValueError):
    """A study checkpoint cannot be used: made by another model, corpus or configuration,
    unreadable, or present where a fresh run would overwrite it."""
