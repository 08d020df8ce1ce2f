"""The first batch's checks of an adapter that reduces queries and keys: one home, run by the probe.

Place in the seams: *adapters*, between an adapter and the statistics. An adapter whose attention
the statistics recompute from queries and keys (:meth:`AttentionSource.checks
<equivariance_probe.adapters.base.AttentionSource.checks>` is not empty) is checked on the
first batch of a run, before the batch is reduced: the first window's first :data:`CHECK_TOKENS`
tokens run once more under eager attention (:func:`~equivariance_probe.adapters.passes.call_pass`),
and every layer's call is checked twice:

* ``"source"``: the weights recomputed from the call's queries and keys
  (:func:`~equivariance_probe.adapters.internals.eager_weights`) must equal the model's own to
  :func:`~equivariance_probe.adapters.internals.recompute_tolerance`; where they do not, the
  attention is not ``softmax(mask(softcap(q·kᵀ·scaling)))`` alone (ALiBi, sink logits), and an
  adapter with ``pattern_source="auto"`` takes the model's weights instead (with a warning), while
  ``"recompute"`` is refused;
* ``"engine"``: the engine that will run must give the sums of a float64 reduction of the model's
  own weights (:class:`~equivariance_probe.statistics.engine_check.EngineCheck`).

:func:`run_first_batch_checks` returns both outcomes as :class:`FirstBatchChecks`, which the probe
keeps and writes into ``metadata["engine"]``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AttentionCaptureError, EquivarianceProbeError, ReplacedAttentionFunctionError
from ..statistics.engine_check import EngineCheck
from .base import Adapter
from .internals import AttentionCall, eager_weights, recompute_tolerance
from .passes import call_pass

__all__ = ["CHECK_TOKENS", "FirstBatchChecks", "run_first_batch_checks"]

#: Tokens of the first window that run under eager attention, on the first batch, to check that
#: recomputing the weights from queries and keys gives the model's own, and that the engine's sums
#: equal a float64 reduction of those weights: enough for several of the Triton kernel's 32-row
#: tiles and key-bin edges inside a tile, few enough that eager attention costs little.
CHECK_TOKENS = 256


@dataclass
class FirstBatchChecks:
    """The outcomes of the first batch's checks.

    Attributes:
        source: the source decision ``{"source", "reason", "max_difference", "tolerance", "tokens"}``
            (empty where the adapter's source is not decided by the check).
        engine: the engine's comparison (:meth:`~equivariance_probe.statistics.engine_check.EngineCheck.finish`),
            empty where the engine was not compared (the weights are not the recomputation's).
    """

    source: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)

    def covers(self, engine: str, source: str) -> bool:
        """Whether these checks still hold for a run with ``engine`` whose attention comes from ``source``:
        a run that recomputes is checked again for another engine option."""
        return source != "recompute" or self.engine.get("option") == engine


def run_first_batch_checks(adapter: Adapter, tokens: torch.Tensor, statistics: Any) -> FirstBatchChecks:
    """Check the recomputation and the engine on the first window of a batch (see the module docstring).

    Args:
        adapter: the run's adapter; what it wants checked is :meth:`~.base.AttentionSource.checks`.
        tokens: the batch, ``[batch, query]``.
        statistics: the run's ``AttentionStatistics``, inside ``begin_batch`` (their configuration and
            engine are those checked).

    Raises:
        AttentionCaptureError: ``pattern_source="recompute"`` and the recomputation is not the model's attention.
        EngineCheckError: the engine's sums differ from the reference's.
    """
    wanted = adapter.source.checks()
    decides = "source" in wanted
    length = int(statistics.batch_lengths[0]) if statistics.batch_lengths is not None else tokens.shape[1]
    sample = tokens[:1, : max(2, min(length, CHECK_TOKENS))]
    windows, causal = adapter.layout.sliding_windows, adapter.layout.causal
    differences: list[float] = []
    engine_check = EngineCheck(statistics, sample.shape[1], adapter.dtype)
    engine_failure: list[EquivarianceProbeError] = []

    def on_call(call: AttentionCall) -> None:
        if call.weights is None:
            raise AttentionCaptureError(f"layer {call.layer} returned no attention weights under eager attention")
        recomputed = eager_weights(call, windows[call.layer], causal)
        differences.append(float((recomputed.float() - call.weights.float()).abs().max()))
        if not engine_failure:
            try:
                engine_check.add_layer(call.layer, call.query, call.key, call.weights,
                                       scaling=call.scaling, softcap=call.softcap)
            except EquivarianceProbeError as error:  # judged below, once the source is decided
                engine_failure.append(error)

    required = decides and adapter.source.asked == "recompute"
    tolerance = recompute_tolerance(adapter.dtype)
    decision: dict[str, Any] = {"tokens": int(sample.shape[1]), "tolerance": tolerance}
    try:
        call_pass(adapter, sample, on_call, eager=True, keep_weights=True)
    except ReplacedAttentionFunctionError:
        raise  # the weights path would run the same replacement: nothing here measures the model transformers ships
    except AttentionCaptureError as error:
        if required:
            raise
        decision.update(source="weights", reason=f"its queries and keys cannot be read ({error})")
        return _decided(adapter, decides, decision)
    except (ValueError, ImportError, NotImplementedError) as error:
        # transformers refuses eager attention for this model: nothing to compare with, but the
        # recomputation needs no eager kernel (and neither weights path could run).
        decision.update(source="recompute", max_difference=None,
                        reason=f"not checked: the model cannot run eager attention ({error!s:.200})")
        return _decided(adapter, decides, decision)
    # Python's max skips a NaN that is not first; a NaN anywhere means the weights are not finite.
    largest = math.nan if any(map(math.isnan, differences)) else max(differences, default=0.0)
    decision["max_difference"] = largest
    if math.isnan(largest):
        # Non-finite weights are the model's, whichever way they are read: the statistics refuse them.
        decision.update(source="recompute", reason="the model's attention weights are not finite")
        return _decided(adapter, decides, decision)
    if largest <= tolerance:
        # The weights are the recomputation's; now the engine that reduces them must match too.
        if engine_failure:
            raise engine_failure[0]
        decision.update(source="recompute", reason="recomputed weights equal the model's own")
        return _decided(adapter, decides, decision, engine_check.finish())
    reason = (
        f"weights recomputed from its queries and keys differ from its own eager weights by up to {largest:.3g} "
        f"(tolerance {tolerance:g}): its attention is not softmax(mask(softcap(q·kᵀ·scaling))) alone "
        "(ALiBi biases, sink logits, or a custom attention)"
    )
    if required:
        raise AttentionCaptureError(f"{reason}; use pattern_source='weights' or 'auto'")
    decision.update(source="weights", reason=reason)
    return _decided(adapter, decides, decision)


def _decided(adapter: Adapter, decides: bool, decision: dict[str, Any],
             engine: dict[str, Any] | None = None) -> FirstBatchChecks:
    """The checks' outcome; where the check decides the adapter's source, the adapter takes it."""
    if not decides:
        return FirstBatchChecks(engine=engine or {})
    adapter.source.use(decision["source"])
    if decision["source"] == "weights":
        warnings.warn(
            f"{type(adapter.model).__name__}: {decision['reason']}; its statistics come from eager "
            "attention weights instead (pattern_source='weights')", stacklevel=5,
        )
    return FirstBatchChecks(source=decision, engine=engine or {})
