"""equivariance_probe: how much does attention depend on where a text sits in the window?

Table of contents (imports no model framework; each adapter imports its own when used):

* :class:`EquivarianceProbe` — wrap a model, ``run`` documents, get a :class:`ProbeResult`.
* :class:`ProbeResult` — query-position R², persistence curves and fits, Toeplitz R²;
  ``save``/``load``/``merge``.
* :class:`AttentionStatistics` — the streaming float64 sums behind every number.
* :func:`get_adapter` and :class:`Adapter` — the framework seam.
* :func:`load_model`, :func:`random_init_like`, :func:`zero_like` — the packaged Gemma 3
  270M (or any local model) and its untrained baselines; :func:`load_corpus` — documents.
* :func:`run_study` / :class:`Study` — trained vs baselines in one call (the CLI's ``run``).
* :func:`rank_heads` / :class:`HeadRanking` — heads from the most to the least position-bound;
  :func:`head_views` / :class:`HeadViews` — offline CircuitsVis views of heads on one document;
  :class:`ReportSection` — a section of the HTML report (issue 5).
* :func:`compare_models` / :class:`Comparison` — the study on several models over the same
  windows, one table (the CLI's ``compare``); :data:`REGISTRY` / :class:`ModelSpec` — the
  packaged models (Gemma 3 270M, SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct).
* :mod:`equivariance_probe.metrics`, :mod:`equivariance_probe.fitting` — pure functions.
* :mod:`equivariance_probe.errors` — the exception family.
* :func:`run_positional` / :class:`PositionalStudy` — where order comes from (issue 6):
  position-embedding Gram matrices, positional logits, TISA kernel fits
  (:mod:`~equivariance_probe.positional`), permutation sensitivity, variance shrinkage and
  position correlations (:mod:`~equivariance_probe.order`).
"""

from __future__ import annotations

from .adapters import SUPPORTED_MODELS, Adapter, AttentionLayout, get_adapter
from .errors import (
    AttentionCaptureError,
    CheckpointError,
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
from .corpus import load_corpus
from .metrics import toeplitz_r2
from .models import load_model, random_init_like, zero_like
from .probe import EquivarianceProbe
from .result import PersistenceCurves, ProbeResult
from .sharding import Shard
from .stats import AttentionStatistics
from .study import Study, run_study
# Looking at heads (issue 5); circuitsvis and pandas are imported when used.
from .heads import HeadRanking, rank_heads
from .report import ReportSection
from .views import HeadViews, head_views

# issue 8: packaged-model registry and the comparison across models
from .compare import Comparison, compare_models
from .errors import InsufficientMemoryError, ModelFileError
from .models import load_tokenizer
from .registry import REGISTRY, ModelSpec
# issue 6: where order comes from
from .order import permutation_sensitivity, position_correlation, representation_sums, VarianceShrinkage
from .positional import fit_tisa_kernel, gram_toeplitz, positional_logits, score_profile
from .positional_study import PositionalStudy, load_positional_model, run_positional

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "EquivarianceProbe",
    "ProbeResult",
    "PersistenceCurves",
    "AttentionStatistics",
    "load_model",
    "random_init_like",
    "zero_like",
    "load_corpus",
    "run_study",
    "Study",
    "Adapter",
    "AttentionLayout",
    "get_adapter",
    "SUPPORTED_MODELS",
    "toeplitz_r2",
    "rank_heads",
    "HeadRanking",
    "head_views",
    "HeadViews",
    "ReportSection",
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
    # issue 8
    "compare_models",
    "Comparison",
    "REGISTRY",
    "ModelSpec",
    "load_tokenizer",
    "ModelFileError",
    "InsufficientMemoryError",
    # issue 6
    "run_positional",
    "PositionalStudy",
    "load_positional_model",
    "gram_toeplitz",
    "positional_logits",
    "score_profile",
    "fit_tisa_kernel",
    "permutation_sensitivity",
    "representation_sums",
    "VarianceShrinkage",
    "position_correlation",
    # issue 7: runs that survive
    "CheckpointError",
    "Shard",
]
