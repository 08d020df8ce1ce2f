"""ShiftResult: what changes when the same text sits elsewhere in the window, with intervals over segments.

Place in the seams: beside :mod:`~equivariance_probe.result` (the probe's other result), above the
statistics (:class:`~equivariance_probe.statistics.shift.ShiftStatistics`, the sums), the maths
(:mod:`~equivariance_probe.maths.shift`, the decomposition) and the records (one safetensors file).

Numbers (docs/methods.md#shift-test; ``representation`` one of
:data:`~equivariance_probe.statistics.shift.REPRESENTATIONS`):

* :meth:`ShiftResult.share` — ``η²`` of the offset, the context, the pair (the equivariant part) or the
  residual, by head, layer, layer group (sliding/global) or for the model: ratios of summed sums of squares.
* :meth:`ShiftResult.offset_rms` — the root mean square of the offset effect, in the representation's unit.
* :meth:`ShiftResult.attribution` — each component's share of the residual stream's offset (or context) sum of
  squares after a block: ``C_c(l) / SS(r_l)``, from the attribution's Gram matrices (a run with
  ``attribution=True``), and :meth:`ShiftResult.attribution_rows` the same in long form.
* :meth:`ShiftResult.loss_by_offset` and :meth:`ShiftResult.divergence` — the segment's next-token loss per
  offset, the mean Jensen–Shannon divergence between offsets in one context and between consecutive contexts
  at one offset, and their ratio.
* :meth:`ShiftResult.sink_mass` — per offset, the mean attention weight the segment's rows put on the window's
  first key (the BOS sink), on the rest of the text before the segment, and on the segment itself.
* :meth:`ShiftResult.patching` — activation patching (a run with ``patch``): per patched component, the share
  of the prediction change and of the last block's residual offset sum of squares that goes away when its
  output at the segment is the reference offset's.

Every number takes ``interval=0.95``: the delete-a-group jackknife over groups of segments (segments fall
into groups by their fingerprint, as windows do in :class:`~equivariance_probe.ProbeResult`).

The class is cut along its seams:

* :mod:`.core` — the design, the decomposition's shares and offset RMS, the predictions, merging, the summary
  and display, the file glue;
* :mod:`.mechanisms` — what carries the offset effect: attribution, the sink mass, activation patching;
* :mod:`.checks` — the built-in checks (rotary layer 0, the attribution's identity), their tolerances, and how a
  number is written in a table.
"""

# SHARE_BY, UNITS, OFFSET_MEANING and HEADS_TOLERANCE are importable from here too, outside __all__.
from ..records.shift_file import SHIFT_FORMAT_VERSION, SHIFT_KIND
from .checks import (ATTRIBUTION_TERMS, ATTRIBUTION_TOLERANCE, HEADS_TOLERANCE, SHARE_BY, SHIFT_CHECK_TOLERANCE,
                     attribution_check, attribution_failure, check_verdict, measured_terms, number_cell, record_checks,
                     shift_check)  # noqa: F401
from .core import OFFSET_MEANING, UNITS, ShiftResult  # noqa: F401

__all__ = ["ShiftResult", "SHIFT_KIND", "SHIFT_FORMAT_VERSION", "shift_check", "SHIFT_CHECK_TOLERANCE", "number_cell",
           "check_verdict", "attribution_check", "attribution_failure", "ATTRIBUTION_TOLERANCE", "ATTRIBUTION_TERMS"]
