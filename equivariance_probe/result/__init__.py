"""The result of a probe run: statistics plus how they were measured.

Place in the seams: above the statistics, the maths and the records, on the floor of
:mod:`~equivariance_probe.shift_result`. A :class:`ProbeResult` holds the float64 sums of
:class:`~equivariance_probe.statistics.AttentionStatistics` and the metadata of the run; every
number is computed on demand from the sums, so results merge exactly (``a + b``), and save and
load without the model (:mod:`~equivariance_probe.records.result_file` holds the file format).
It speaks the :class:`~equivariance_probe.analyses.results.Result` protocol that every result shares.

The class is cut along its seams:

* :mod:`.probe_result` — the facts of the run, merging, the summary and display, the file glue;
* :mod:`.numbers` — query-position R², persistence, Toeplitz R², attention sinks;
* :mod:`.intervals` — intervals over windows: the statistics keep per-group sums of the windows
  (:mod:`~equivariance_probe.statistics.groups`), every number with an interval
  (:data:`~equivariance_probe.analyses.intervals.INTERVAL_STATISTICS`) is recomputed on every window
  but one group's (:mod:`~equivariance_probe.analyses.intervals`), and the delete-a-group jackknife
  turns the replicates into an :class:`~equivariance_probe.maths.intervals.Interval` (``interval=0.95``
  on the methods, :meth:`ProbeResult.interval`, :meth:`ProbeResult.paired_difference`).
"""

from ..maths.intervals import Interval
from ..maths.persistence import PersistenceCurves
from ..records.result_file import FORMAT_VERSION
from .intervals import (DIFFERENCE_STATISTICS, SUMMARY_LEVEL, TARGET_HALF_WIDTH, paired_difference,
                        paired_differences)
from .numbers import TOEPLITZ_ESTIMATORS
from .probe_result import BIDIRECTIONAL_PRIOR, SUMMARY_KEY_BINS, ProbeResult

__all__ = [
    "ProbeResult",
    "PersistenceCurves",
    "Interval",
    "FORMAT_VERSION",
    "paired_difference",
    "paired_differences",
    "DIFFERENCE_STATISTICS",
    "TOEPLITZ_ESTIMATORS",
    "SUMMARY_LEVEL",
    "SUMMARY_KEY_BINS",
    "TARGET_HALF_WIDTH",
    "BIDIRECTIONAL_PRIOR",
]
