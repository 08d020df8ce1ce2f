"""The shift test on a remote nnsight model: a segment's whole grid summed on the server in one session, and the
check of the recomputed segment block (locally: the Hugging Face adapter's; a local model's segment passes are
plans, :mod:`~equivariance_probe.adapters.nnsight_binder`).

Place in the seams: *adapters*, beside :mod:`~equivariance_probe.adapters.nnsight`, whose adapter takes these
methods (:class:`NNsightSegments`); what runs inside the server's session is
:mod:`~equivariance_probe.adapters.nnsight_remote` and the shift sums' own functions
(:mod:`~equivariance_probe.statistics.engines.shift_sums`), shipped by value.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import Any

import torch

from ..errors import RemoteExecutionError
from .base import SegmentBatch
from .components import block_parts
from .internals import recompute_tolerance
from .request_sizes import plan_requests
from .segments import (
    check_predicts,
    judged_recompute_check,
    kept_positions,
    segment_spans,
    shifted_position_ids,
)
from .nnsight_remote import (
    add_segment_predictions_in_trace,
    add_segment_windows_in_trace,
    end_segment_context,
    new_segment_state,
    segment_check_in_trace,
    segment_sums_in_trace,
)

__all__ = ["NNsightSegments"]


class NNsightSegments:
    """The shift-test methods of :class:`~equivariance_probe.adapters.nnsight.NNsightAdapter` (a mixin: it reads the
    adapter's model, its envoys, its trace options and its error translation)."""

    @property
    def segment_capture(self) -> str:  # type: ignore[override]
        if self.remote:
            return ("segment-block scores recomputed from the queries and keys each attention call receives, read "
                    "inside nnsight traces on the server (its own kernel), one session per segment summing its whole "
                    "grid there; only float64 sums came back")
        return ("segment-block scores recomputed from the queries and keys each attention call receives, read "
                "inside a local nnsight trace (the model runs its own kernel); row normalisers over every "
                "visible key of the window")

    def _component_envoys(self) -> list[tuple[Any, Any]]:
        """Per layer, the envoys of :func:`~equivariance_probe.adapters.components.block_parts`' ``attention_out`` and
        ``mlp_out`` (what the attribution reads in a remote session)."""
        inner = self._hf.model
        paths = {id(module): name for name, module in inner.named_modules()}
        return [(self.model.get(paths[id(part.attention_out)]), self.model.get(paths[id(part.mlp_out)]))
                for part in block_parts(inner)]

    def check_segment_recompute(self, tokens: torch.Tensor, segment_length: int) -> dict[str, Any] | None:
        """:meth:`Adapter.check_segment_recompute`.

        Locally, on the wrapped transformers model outside any trace (as :func:`~equivariance_probe.adapters.passes.call_pass``): the
        queries and keys the trace reads are the ones its attention call receives, so the check of the model's
        attention is the Hugging Face adapter's (eager weights). Remotely the weights are on the server, which
        picks its own kernel (eager weights may not exist there): one trace of the window compares, in each
        layer, the attention output the recomputed weights give with the output the server's kernel returned
        (:func:`~equivariance_probe.adapters.nnsight_remote.segment_check_in_trace`), and only that ``[layer]``
        difference comes back; ``metadata["recompute_check"]["compared"]`` says which check ran.

        Raises:
            AttentionCaptureError: the recomputation differs from the model's own attention by more than the
                tolerance.
        """
        if not self.remote:
            return self._hf.check_segment_recompute(tokens, segment_length)
        import nnsight

        width = int(tokens.shape[1])
        plan = {"windows": list(self.layout.sliding_windows), "causal": True}
        span = (width - int(segment_length), width)
        model, attention = self.model, self._attention_envoys()
        differences = None
        with self._translate_errors("recompute"), self._shipped_by_value():
            with model.trace(tokens, use_cache=False, **self._trace_options()) as tracer:
                differences = segment_check_in_trace(attention, plan, span)
                nnsight.save(differences)
                tracer.stop()
        if not isinstance(differences, torch.Tensor):
            raise RemoteExecutionError(
                f"the remote check of the shift test's recomputation returned no differences (got "
                f"{type(differences).__name__}); nothing was measured. Run again; if it persists, report it with "
                "nnsight's version")
        return judged_recompute_check(
            float(differences.max()), recompute_tolerance(self.dtype), width,
            "the attention output of the segment rows from the recomputed weights against the server kernel's, "
            "relative to the largest value entry, in one trace on the server")

    @property
    def sums_segment_grid(self) -> bool:  # type: ignore[override]
        """Remote models (``"local"`` included) sum each segment's grid where the model runs."""
        return bool(self.remote)

    def segment_grid_sums(self, contexts: Sequence[Sequence[SegmentBatch]], config: Any,
                          targets: torch.Tensor | None) -> dict[str, Any]:
        """:meth:`Adapter.segment_grid_sums`: one nnsight session per segment (one request), with one trace per
        batch of windows; the running sums stay on the server between its traces, so neither blocks, residual
        streams nor vocabulary-sized distributions travel, only :func:`~equivariance_probe.adapters.nnsight_remote.
        segment_reply_nbytes` bytes of float64 sums. The functions the session runs are the statistics' own
        (:mod:`~equivariance_probe.statistics.engines.shift_sums`), shipped by value.

        Raises:
            AttentionCaptureError: ``targets`` (predictions) on a model without a language-model head.
            RemoteExecutionError (or a named subclass): the server failed, or ``config`` asks for activation
                patching (not run remotely: see the message); this segment was not added.
        """
        import nnsight

        if getattr(config, "patch_components", ()):
            raise RemoteExecutionError(
                f"activation patching does not run on a remote nnsight model (remote={self.remote!r}): a segment's "
                "whole grid is one request, which cannot be split (its sums are taken about the grid's own means), "
                f"and patching adds a forward pass per patched item at every offset but the reference: "
                f"{1 + len(config.patch_components) * (len(config.offsets) - 1) / len(config.offsets):.0f} times the "
                "grid's passes here, against a request planned to take a quarter of nnsight's 600 s read timeout; "
                "nothing was measured. Patch a model whose weights are here (remote=False, or the Hugging Face "
                "model), or run the remote shift test without patch")
        if targets is not None:
            check_predicts(self.hf_model)
        plan = {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_offsets": len(config.offsets),
                "segment_length": config.segment_length, "causal": True, "windows": list(self.layout.sliding_windows),
                "predictions": targets is not None, "hidden_size": config.sizes()["D"],
                "components": list(config.components)}
        if any(name.startswith("head.") for name in config.components):
            raise RemoteExecutionError(
                "the attribution's heads are formed from each head's output and the output projection's weights, "
                "which a remote session does not read; ask a remote model for the block-level attribution "
                "(attribution=True without attribution_heads), or run the heads on a local model")
        runs = [[self._segment_trace_inputs(batch, config.segment_length, targets is not None) for batch in context]
                for context in contexts]
        grid = (len(contexts), len(config.offsets), int(config.segment_length))
        if grid != self._segment_grid:
            self.segment_plan, self._segment_grid = None, grid
        self._refuse_if_planned(self.segment_plan, "segment")
        model, attention = self.model, self._attention_envoys()
        layers = [model.get(path) for path in self.layer_paths]
        parts = self._component_envoys() if config.components else None
        sums = None
        started = perf_counter()
        # The session's body reads only these locals, the shipped functions and nnsight: what the request carries.
        with self._translate_errors("recompute", "segment"), self._shipped_by_value():
            with model.session(**self._trace_options()):
                state = new_segment_state(plan)
                for context in runs:
                    for tokens, options, batch in context:
                        with model.trace(tokens, **options) as tracer:
                            add_segment_windows_in_trace(state, attention, layers, plan, batch, parts)
                            if plan["predictions"]:
                                add_segment_predictions_in_trace(state, model.output.logits, batch, targets)
                            else:
                                tracer.stop()  # nothing after the last block is read
                    end_segment_context(state)
                sums = segment_sums_in_trace(state, plan)
                nnsight.save(sums)
        if not isinstance(sums, dict):
            raise RemoteExecutionError(
                f"the {'remote ' if self.is_remote else ''}session returned no shift sums (got {type(sums).__name__}); "
                "this segment was not added, the segments before it are kept (probe.last_result). Run again; if it "
                "persists, report it with nnsight's version")
        if self.segment_plan is None:
            # One request is one segment's whole grid, which cannot be split: the decomposition's sums are about
            # the grid's own means (grid_sums: the offset and context sums of squares), which the sums of two
            # halves of the contexts do not give. So the plan only says whether the next segment may be sent.
            self.segment_plan = plan_requests(
                perf_counter() - started, 1, _nbytes(sums), self.request_limits, upper=1,
                unit="segment's grid", fix="fewer contexts or offsets (one request runs every context at every offset)")
        return {name: value.numpy() for name, value in sums.items()}

    @staticmethod
    def _segment_trace_inputs(batch: SegmentBatch, segment_length: int, predictions: bool
                              ) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
        """``(tokens, trace options, batch plan)`` of one trace of a segment's session."""
        spans = segment_spans(batch.lengths, segment_length)
        width = int(batch.tokens.shape[1])
        options: dict[str, Any] = {"use_cache": False}
        if batch.position_start is not None:
            options["position_ids"] = shifted_position_ids(batch.position_start, width)
        if predictions:
            options["logits_to_keep"] = kept_positions(spans, width)
        return batch.tokens, options, {"spans": spans, "offsets": list(batch.offset_indices), "width": width}


def _nbytes(sums: dict[str, torch.Tensor]) -> int:
    """Bytes of the float64 sums a request sent back (before nnsight's compression)."""
    return sum(int(value.numel()) * value.element_size() for value in sums.values() if isinstance(value, torch.Tensor))
