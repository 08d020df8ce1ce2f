"""equivariance_probe: how much does attention depend on where a text sits in the window?

Table of contents (imports no model framework; each adapter imports its own when used):

* :class:`EquivarianceProbe` — wrap a model, ``run`` documents, get a :class:`ProbeResult`.
* :class:`ProbeResult` — query-position R², persistence curves and fits, Toeplitz R²;
  ``save``/``load``/``merge``.
* :class:`AttentionStatistics` — the streaming float64 sums behind every number.
* :func:`get_adapter` and :class:`Adapter` — the framework seam.
* :mod:`equivariance_probe.metrics`, :mod:`equivariance_probe.fitting` — pure functions.
* :mod:`equivariance_probe.errors` — the exception family.
"""

from __future__ import annotations

from .adapters import SUPPORTED_MODELS, Adapter, AttentionLayout, get_adapter
from .errors import (
    AttentionCaptureError,
    ContextLengthError,
    EmptyCorpusError,
    EquivarianceProbeError,
    IncompatibleResultsError,
    InputError,
    MissingAPIKeyError,
    ModelNotFoundError,
    NonFiniteAttentionError,
    NotRunError,
    RemoteExecutionError,
    ResultFileError,
    UnsupportedModelError,
)
from .metrics import toeplitz_r2
from .probe import EquivarianceProbe
from .result import PersistenceCurves, ProbeResult
from .stats import AttentionStatistics

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "EquivarianceProbe",
    "ProbeResult",
    "PersistenceCurves",
    "AttentionStatistics",
    "Adapter",
    "AttentionLayout",
    "get_adapter",
    "SUPPORTED_MODELS",
    "toeplitz_r2",
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
]
