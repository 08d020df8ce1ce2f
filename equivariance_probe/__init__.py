"""equivariance_probe: how much does attention depend on where a text sits in the window?

Table of contents (importing it imports no model framework, matplotlib or circuitsvis; each
part imports its own when used). The folders are the architecture, from the ground up:

* ``errors`` — one exception family; ``maths`` — pure functions from sums to numbers and fits;
  ``statistics`` — what streams and merges (float64 sums, torch-only kernels);
  ``adapters`` — which framework (TransformerLens, nnsight, Hugging Face);
  ``sources`` — models, packaged registry, corpora, devices, memory;
  ``records`` — file format, provenance, shards; ``analyses`` — head ranking and where order
  comes from; ``result`` and ``probe`` — the two core classes; ``runs`` — studies, comparisons,
  checkpoints; ``display`` — figures, CircuitsVis views, the HTML report; ``cli`` — the program.

Measure:

* :class:`EquivarianceProbe` — wrap a model, ``run`` documents, get a :class:`ProbeResult`;
  :class:`MeasurementOptions` — how a run measures, one value from the command line down to ``run``.
* :class:`ProbeResult` — query-position R², persistence curves and fits, Toeplitz R²;
  ``save``/``load``/``merge``; :class:`PersistenceCurves`.
* :class:`Interval`, :func:`paired_difference` — confidence intervals over windows (delete-a-group
  jackknife: ``interval=0.95`` on the result's methods) and paired differences of two results
  (``a.paired_difference(b, ...)`` on either kind of result).
* :class:`Result` / :class:`MergeableResult` — what every result shares (``model_name``, ``complete``,
  ``config``, ``undefined``, ``summary(level)``, ``table(level)``, ``to_rows(level)``; results of sums also
  ``merge`` / ``+``, ``layer_groups()``, ``paired_difference``).
* :class:`AttentionStatistics` — the streaming float64 sums behind every number.
* :meth:`EquivarianceProbe.shift` → :class:`ShiftResult` — the shift test: the same text moved through
  the window (:class:`ShiftOptions`, how it measures; :class:`ShiftGrid`, :class:`ShiftStatistics`;
  :func:`split_documents` cuts segments and
  contexts from a corpus): offset, context and pair shares of its
  attention and residual stream, and how its predictions change; on screen: :func:`shift_figures` (each figure
  also alone: :func:`shift_layers_figure`, :func:`shift_heads_figure`, :func:`shift_loss_figure`,
  :func:`shift_divergence_figure`, :func:`shift_sink_figure` with :func:`sink_layer_groups`,
  :func:`shift_massive_figure`,
  :func:`shift_attribution_figure`, :func:`shift_patching_figure`),
  :func:`shift_view` / :class:`ShiftView` (one head at two offsets, offline CircuitsVis); a mechanism of one's own,
  :class:`SegmentMechanism` (a site and a measure, read by offset: :func:`mechanism_by_offset`),
  :func:`shift_report_section`, :func:`render_shift_report`.
* :func:`get_adapter`, :class:`Adapter`, :class:`AttentionLayout`, :data:`SUPPORTED_MODELS` —
  the framework seam.

Models and documents: :class:`ModelSource` (which model a run measures and how it loads: framework, device,
dtype, kernel), :func:`load_model`, :func:`load_tokenizer`, :func:`random_init_like`,
:func:`zero_like`, :func:`load_corpus` (``pack=T``: :class:`PackedWindows`), :data:`REGISTRY` / :class:`ModelSpec` (the packaged
models), :func:`load_positional_model`.

Studies: :func:`run_study` / :class:`Study` (trained vs baselines; checkpoints, shards:
:class:`Shard`; :func:`window_fingerprint`, by which merges refuse a window counted twice), :func:`compare_models` / :class:`Comparison` (several models on the same
windows), :func:`scan_context_lengths` / :class:`ContextScan` (the same text at several context
lengths), :func:`run_positional` / :class:`PositionalStudy` (where order comes from),
:func:`run_shift_study` / :class:`ShiftStudy` (the shift test on a model and its baselines, checkpointed).

Heads and reports: :func:`rank_heads` / :class:`HeadRanking`, :func:`head_views` /
:class:`HeadViews` (offline CircuitsVis; ``overview=True`` adds a :class:`BlockOverview` of a long window), :func:`render_report` (a :class:`RenderedReport`: drawn in a notebook, ``save(path)`` in a script) /
:class:`ReportSection`; :func:`study_figures` (a study's figures) and :func:`save_figures` (any figures
as PNG, SVG or PDF files); :func:`save_comparison` (a comparison's table, figure and pages), :func:`save_scan` (a scan's),
:func:`positional_figures` and :func:`positional_report_section` (a positional study's figures and report section).

Further analyses: :func:`toeplitz_r2`, :func:`gram_toeplitz`, :func:`positional_logits`,
:func:`score_profile`, :func:`fit_tisa_kernel`, :func:`permutation_sensitivity`,
:func:`representation_sums`, :class:`VarianceShrinkage`, :func:`position_correlation`,
:func:`position_probe` / :class:`PositionProbe` (linear position probes on the residual stream),
:class:`MassiveActivationSums` (massive activations, Sun et al. 2024).

Errors: :class:`EquivarianceProbeError` and its subclasses (:mod:`equivariance_probe.errors`).
"""

from __future__ import annotations

from .adapters import SUPPORTED_MODELS, Adapter, AttentionLayout, get_adapter
from .adapters.request_sizes import RequestLimits, RequestPlan
from .analyses.heads import HeadRanking, rank_heads
from .analyses.order import VarianceShrinkage, permutation_sensitivity, position_correlation, representation_sums
from .analyses.position_probe import PositionProbe, position_probe
from .statistics.massive import MassiveActivationSums
from .analyses.positional import gram_toeplitz, positional_logits, score_profile
from .analyses.results import MergeableResult, Result
from .display.comparison import save_comparison
from .display.figures import save_figures, study_figures
from .display.positional import positional_figures, positional_report_section
from .display.scan import save_scan
from .display.report import RenderedReport, ReportSection, render_report
from .display.shift import (
    ShiftView,
    render_shift_report,
    shift_attribution_figure,
    shift_divergence_figure,
    shift_figures,
    shift_heads_figure,
    shift_layers_figure,
    shift_loss_figure,
    shift_massive_figure,
    shift_patching_figure,
    shift_report_section,
    shift_sink_figure,
    shift_view,
    sink_layer_groups,
)
from .display.overview import BlockOverview
from .display.views import HeadViews, head_views
from .errors import (
    AttentionCaptureError,
    CheckpointError,
    FigureError,
    StopRequested,
    ContextLengthError,
    SiteError,
    EmptyCorpusError,
    EmptyResultError,
    EquivarianceProbeError,
    IncompatibleResultsError,
    InputError,
    InsufficientMemoryError,
    IntervalUnavailableError,
    MissingDependencyError,
    MissingAPIKeyError,
    ModelFileError,
    MissingExtraError,
    ModelNotFoundError,
    NonFiniteAttentionError,
    ReplacedAttentionFunctionError,
    NonFiniteActivationError,
    EngineCheckError,
    AttributionIdentityError,
    NotRunError,
    RemoteExecutionError,
    RemoteResultTooLargeError,
    RemoteVersionError,
    RemoteTimeoutError,
    RequestTooLongError,
    ModelNotDeployedError,
    ServerUnreachableError,
    ResultFileError,
    FileWriteError,
    UndefinedStatisticError,
    SupersededSumsError,
    UnsupportedModelError,
)
from .maths.fitting import fit_tisa_kernel
from .maths.metrics import toeplitz_r2
from .probe import EquivarianceProbe, MeasurementOptions
from .records.provenance import window_fingerprint
from .records.sharding import Shard
from .maths.intervals import Interval
from .result import PersistenceCurves, ProbeResult, paired_difference
from .features.mechanisms import SegmentMechanism, mechanism_by_offset
from .shift_result import ShiftResult
from .sources.shift_grid import ShiftGrid, ShiftOptions, split_documents
from .statistics.shift import ShiftStatistics
from .runs.compare import Comparison, compare_models
from .runs.positional import PositionalStudy, run_positional
from .runs.scan import ContextScan, scan_context_lengths
from .runs.shift import ShiftStudy, run_shift_study
from .runs.study import Study, run_study
from .sources.baselines import random_init_like, zero_like
from .sources.corpus import load_corpus
from .sources.packing import PackedWindows
from .sources.model_source import ModelSource
from .sources.models import load_model, load_positional_model, load_tokenizer
from .sources.registry import REGISTRY, ModelSpec
from .statistics import AttentionStatistics

#: The package's version, its one source: setuptools reads it for the distribution's metadata, ``--version`` prints it,
#: and CHANGELOG.md's newest entry names it.
__version__ = "0.1.0"

__all__ = [
    "__version__",
    # measure
    "EquivarianceProbe",
    "MeasurementOptions",
    "ModelSource",
    "ProbeResult",
    "PersistenceCurves",
    "Interval",
    "paired_difference",
    "Result",
    "MergeableResult",
    "AttentionStatistics",
    "ShiftResult",
    "ShiftGrid",
    "ShiftOptions",
    "split_documents",
    "ShiftStatistics",
    "Adapter",
    "AttentionLayout",
    "get_adapter",
    "SUPPORTED_MODELS",
    # models and documents
    "load_model",
    "load_tokenizer",
    "random_init_like",
    "zero_like",
    "load_corpus",
    "PackedWindows",
    "REGISTRY",
    "ModelSpec",
    "load_positional_model",
    # studies
    "run_study",
    "RequestLimits",
    "RequestPlan",
    "Study",
    "run_shift_study",
    "ShiftStudy",
    "Shard",
    "window_fingerprint",
    "compare_models",
    "Comparison",
    "scan_context_lengths",
    "ContextScan",
    "run_positional",
    "PositionalStudy",
    # heads and reports
    "rank_heads",
    "HeadRanking",
    "head_views",
    "HeadViews",
    "BlockOverview",
    "render_report",
    "RenderedReport",
    "ReportSection",
    "study_figures",
    "save_figures",
    "save_comparison",
    "save_scan",
    "positional_figures",
    "positional_report_section",
    "shift_view",
    "ShiftView",
    "shift_figures",
    "shift_layers_figure",
    "shift_heads_figure",
    "shift_loss_figure",
    "shift_divergence_figure",
    "shift_sink_figure",
    "sink_layer_groups",
    "shift_massive_figure",
    "shift_attribution_figure",
    "shift_patching_figure",
    "SegmentMechanism",
    "mechanism_by_offset",
    "shift_report_section",
    "render_shift_report",
    # further analyses
    "toeplitz_r2",
    "gram_toeplitz",
    "positional_logits",
    "score_profile",
    "fit_tisa_kernel",
    "permutation_sensitivity",
    "representation_sums",
    "VarianceShrinkage",
    "position_correlation",
    "position_probe",
    "PositionProbe",
    "MassiveActivationSums",
    # errors
    "EquivarianceProbeError",
    "InputError",
    "EmptyCorpusError",
    "ContextLengthError",
    "SiteError",
    "UnsupportedModelError",
    "ModelNotFoundError",
    "ModelFileError",
    "MissingExtraError",
    "AttentionCaptureError",
    "ReplacedAttentionFunctionError",
    "NonFiniteAttentionError",
    "NonFiniteActivationError",
    "EngineCheckError",
    "AttributionIdentityError",
    "InsufficientMemoryError",
    "MissingDependencyError",
    "RemoteExecutionError",
    "RemoteResultTooLargeError",
    "RemoteVersionError",
    "RemoteTimeoutError",
    "RequestTooLongError",
    "ModelNotDeployedError",
    "ServerUnreachableError",
    "MissingAPIKeyError",
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
    "StopRequested",
]
