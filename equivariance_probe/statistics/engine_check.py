"""The run-time check of the engine: its sums on a slice against a float64 reduction of the model's own weights.

Place in the seams: *statistics*. The sums that :meth:`AttentionStatistics.update_from_scores`
adds come from an engine that recomputes the weights from queries and keys (torch query blocks,
or the fused Triton kernel on CUDA). Its tests run on CPU, and the Triton kernel's in Triton's
interpreter; on a GPU, a Triton release or a shape they never met, nothing else would notice a
kernel that computes wrong sums. So on the first batch an adapter that can read both the queries
and keys *and* the model's own attention weights (eager attention on a slice of the first window)
hands every layer of that slice to :class:`EngineCheck`, which reduces it twice:

* with the engine that will run (same device, same ``engine`` option, same dtype of queries and
  keys), through :meth:`~equivariance_probe.statistics.attention.AttentionStatistics.update_from_scores`;
* with the torch reduction, in float64 on the CPU, of reference weights, through
  :meth:`~equivariance_probe.statistics.attention.AttentionStatistics.update`: the model's own
  eager weights, upcast, for float32 and float64 models; for bf16 and fp16 models the float64
  softmax of the model's own queries and keys (same mask, scale and soft cap). Their eager weights
  come from scores rounded to the model's dtype (measured on a GPT-2 with peaked heads in bf16:
  sums of squares 5 % away from those of float32 scores), which the model's sdpa and flash kernels,
  with float32 accumulation, never round, and neither does the engine; that the model's eager
  weights are this softmax at the model's precision is the adapter's own first-batch check;

and compares every weight-dependent sum, layer by layer (:data:`CHECKED_SUMS`).

The difference of a sum is ``max |engine − reference|`` over the layer's entries divided by the
largest ``|reference|`` of that layer's array (a sum's own scale: an entry near 0 beside large ones
does not blow the ratio up); for ``floored``, a count, it is the difference in entries over the
layer's visible entries. :func:`engine_tolerance` states what is allowed for the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from ..errors import EngineCheckError, option
from .attention import AttentionStatistics
from .engines.in_trace import attention_scores, visible_mask
from .masks import default_log_floor
from .sums import checked_sums

__all__ = ["CHECKED_SUMS", "EngineCheck", "engine_tolerance"]

#: The sums that depend on the attention weights (the others are the mask's counts and prior).
CHECKED_SUMS = checked_sums()


def engine_tolerance(dtype: torch.dtype) -> float:
    """Largest relative difference allowed between the engine's sums and the reference's, for a model of ``dtype``.

    1e-4 for every dtype: the engine's float32 weights (float64 for float64 models) differ from the
    reference's by float32 rounding of the same scores (measured on CPU: below 3e-7 for float32,
    bf16 and fp16 models; the GPU's approximate ``exp`` and division add about 1e-6). A wrong lag,
    key bin, mask or normaliser moves a sum by far more (one weight of a query is ``1/n`` of its row).
    """
    return 1e-4


class EngineCheck:
    """Reduces one slice of the first batch with the run's engine and from the model's own weights.

    Args:
        statistics: the run's statistics (their configuration, ``engine`` and device are copied).
        n_tokens: the slice's length: one window of this many tokens.
        dtype: the model's dtype (it sets the log floor where the run has not chosen one yet and the
            tolerance).

    Call :meth:`add_layer` once per layer with the slice's queries, keys and the model's weights,
    then :meth:`finish`, which returns the comparison (saved in ``metadata["engine"]``) or raises
    :class:`~equivariance_probe.errors.EngineCheckError`.
    """

    def __init__(self, statistics: AttentionStatistics, n_tokens: int, dtype: torch.dtype) -> None:
        settings = statistics.settings
        settings = replace(
            settings, n_positions=int(n_tokens), keep_pattern=False, interval_groups=0,
            log_floor=default_log_floor(dtype) if settings.log_floor is None else settings.log_floor,
            excluded_keys=tuple(k for k in settings.excluded_keys if k < n_tokens),
        )
        self.dtype = dtype
        #: The slice reduced by the run's engine, and by the reference.
        self.checked = AttentionStatistics.from_settings(settings, device=statistics.device, engine=statistics.engine)
        self.reference = AttentionStatistics.from_settings(settings, device="cpu", engine="torch")
        lengths = torch.tensor([int(n_tokens)])
        self.checked.begin_batch(lengths)
        self.reference.begin_batch(lengths)
        self.n_tokens = int(n_tokens)
        #: What the engine's sums are compared with (see the module docstring).
        self.reference_kind = (
            "the model's own attention weights in float64" if dtype in (torch.float32, torch.float64)
            else "a float64 softmax of the model's own queries and keys"
        )
        self.device = str(statistics.device)

    def add_layer(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        *,
        scaling: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """One layer of the slice: ``query: [1, head, n, d]``, ``key: [1, kv_head, n, d]`` as the model hands
        them to its attention function, ``weights: [1, head, n, n]`` the model's own."""
        self.device = str(query.device)
        self.checked.update_from_scores(layer, query, key, scaling=scaling, softcap=softcap)
        if self.dtype in (torch.float32, torch.float64):
            reference = weights.detach().to("cpu", torch.float64)
        else:
            reference = self._float64_weights(layer, query, key, scaling, softcap)
        self.reference.update(layer, reference)

    def _float64_weights(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None, softcap: float | None
    ) -> torch.Tensor:
        """``softmax(mask(softcap(q·kᵀ·scaling)))`` in float64 from the model's queries and keys: ``[1, head, n, n]``."""
        scores = attention_scores(query.detach().to("cpu", torch.float64), key.detach().to("cpu", torch.float64),
                                  scaling, softcap)
        if self.reference.causal:
            n = scores.shape[-1]
            allowed = visible_mask(n, self.reference.sliding_windows[layer], torch.tensor([n]))  # [1, query, key]
            scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        return torch.softmax(scores, dim=-1)

    def finish(self) -> dict[str, Any]:
        """Compare every checked sum, layer by layer; the comparison, or :class:`EngineCheckError` on a mismatch.

        Returns ``{"engine" (the path that ran), "option" (the ``engine`` asked for), "device", "dtype", "tokens", "tolerance", "max_difference", "worst": {sum:
        difference}, "worst_layer", "worst_sum", "passed"}``.
        """
        self.checked.end_batch()
        self.reference.end_batch()
        path = "+".join(sorted(self.checked.paths)) or "none"
        tolerance = engine_tolerance(self.dtype)
        engine_arrays = {name: value.to("cpu") for name, value in self.checked.arrays.items()}
        reference_arrays = self.reference.arrays
        visible = reference_arrays["query_count"].sum(dim=-1)  # [L]: visible entries per head
        worst: dict[str, float] = {}
        worst_at: tuple[float, int, str] = (0.0, -1, "")
        for name in CHECKED_SUMS:
            if name not in reference_arrays:  # an optional sum these statistics do not keep
                continue
            got, want = engine_arrays[name], reference_arrays[name]
            if name == "key_lag_sum":  # summed over layers and heads: one comparison
                got, want = got.unsqueeze(0), want.unsqueeze(0)
            differences = []
            for layer in range(got.shape[0]):
                difference = (got[layer] - want[layer]).abs().max()
                scale = visible[layer] if name == "floored" else want[layer].abs().max()
                relative = float(difference / scale) if float(scale) > 0 else float(difference)
                relative = math.inf if math.isnan(relative) else relative
                differences.append(relative)
                if relative > worst_at[0]:
                    worst_at = (relative, -1 if name == "key_lag_sum" else layer, name)
            worst[name] = max(differences)
        largest, layer, name = worst_at
        comparison = {
            "engine": path,
            "option": self.checked.engine,
            "device": self.device,
            "dtype": str(self.dtype).replace("torch.", ""),
            "tokens": self.n_tokens,
            "tolerance": tolerance,
            "reference": self.reference_kind,
            "max_difference": largest,
            "worst": worst,
            "worst_layer": layer,
            "worst_sum": name,
            "passed": bool(largest <= tolerance),
        }
        if not comparison["passed"]:
            where = "every layer's key-bin lag sums" if layer < 0 else f"layer {layer}'s {name}"
            fix = (
                f"pass {option('engine', 'torch')} to reduce on the torch path"
                if path != "torch"
                else f"pass {option('pattern_source', 'weights')} to reduce the model's own weights, and report it"
            )
            raise EngineCheckError(
                f"the {path} engine's sums differ from those of {self.reference_kind} on the first {self.n_tokens} "
                f"tokens of the first window: {where} by {largest:.3g} relative (tolerance {tolerance:g} for "
                f"{comparison['dtype']}); nothing was added. {fix[0].upper()}{fix[1:]}",
                comparison=comparison,
            )
        return comparison
