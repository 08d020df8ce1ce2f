"""The engines that reduce one layer's attention of one batch to per-window sums, and the one dispatcher.

Place in the seams: *statistics*, below :class:`~equivariance_probe.statistics.AttentionStatistics`,
which builds a :class:`~.spec.ReductionSpec` per batch and layer and hands it here. Every engine is
a function of the layer's tensors and the spec that returns the same dict of sums:

* :mod:`~.torch_blocks` — torch, in query blocks (any device; from queries and keys, or from
  captured weights);
* :mod:`~.triton` — one fused Triton kernel (CUDA, causal masks), imported only when it may run;
* :mod:`~.in_trace` — whole-pattern torch reductions that run inside a remote nnsight trace,
  reading the spec's plain form (:meth:`~.spec.ReductionSpec.plain`).

:func:`reduce_scores` holds every rule that picks between them (:data:`ENGINES`): the fused kernel
only for causal masks, only on CUDA (or in Triton's interpreter when asked by name), and never
again in this process once it failed to compile or launch under ``"auto"``.
"""

from __future__ import annotations

import os
import warnings

import torch

from ...errors import EquivarianceProbeError, InputError, check_choice
from .block_maths import BlockWorkspace
from .spec import ReductionSpec
from .torch_blocks import attention_sums_from_qk, attention_sums_from_weights

__all__ = ["ENGINES", "ReductionSpec", "reduce_scores", "reduce_weights", "warn_triton_unavailable"]

#: How the sums of a layer recomputed from queries and keys are computed: ``"auto"`` (the fused
#: Triton kernel on CUDA where Triton imports, else torch), ``"torch"``, ``"triton"``.
ENGINES = ("auto", "torch", "triton")

#: Why the fused kernel failed to compile or launch in this process (``engine="auto"`` then stays on the
#: torch path), or ``None``.
_TRITON_FAILURE: Exception | None = None
_warned_triton_unavailable = False


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def reduce_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    spec: ReductionSpec,
    *,
    engine: str = "auto",
    workspace: BlockWorkspace | None = None,
) -> tuple[dict[str, torch.Tensor], str]:
    """One layer's per-window sums from its queries and keys, by the engine the rules pick, and which ran.

    Args:
        query: ``[B, H, T, d]``; key: ``[B, H_kv, T, d]`` (see
            :func:`~.torch_blocks.attention_sums_from_qk`).
        spec: the batch's and layer's :class:`~.spec.ReductionSpec`.
        engine: one of :data:`ENGINES`. ``"triton"`` raises where the kernel cannot run (no CUDA
            tensors outside Triton's interpreter, a bidirectional mask, no Triton); ``"auto"`` takes it
            for causal CUDA tensors where Triton imports and has not failed in this process.
        workspace: the torch engine's reused temporaries.

    Returns:
        ``(sums, path)``: the dict of sums (the same keys and shapes on every path) and ``"triton"`` or
        ``"torch"``, beside the dict so that the dict holds tensors only.
    """
    global _TRITON_FAILURE
    check_choice("engine", engine, ENGINES)
    if engine == "triton" and not query.is_cuda and not _interpreting():
        raise InputError(f"engine='triton' needs CUDA tensors, got queries on {query.device}; use engine='auto'")
    if engine == "triton" or (engine == "auto" and spec.causal and query.is_cuda and _TRITON_FAILURE is None):
        from . import triton  # imported where it may run only: Triton is heavy, and absent on CPU installs

        if engine == "triton" or triton.triton_available():
            try:
                return triton.attention_sums_triton(query, key, spec), "triton"
            except EquivarianceProbeError:
                raise
            except Exception as error:  # noqa: BLE001 - a kernel that cannot compile or launch here: torch path
                if engine == "triton":
                    raise
                _TRITON_FAILURE = error
    if engine == "auto" and spec.causal and query.is_cuda:
        warn_triton_unavailable()
    return attention_sums_from_qk(query, key, spec, workspace=workspace), "torch"


def reduce_weights(
    pattern: torch.Tensor, spec: ReductionSpec, *, workspace: BlockWorkspace | None = None
) -> dict[str, torch.Tensor]:
    """One layer's per-window sums from captured post-softmax weights ``[B, H, T, T]`` (the torch engine)."""
    return attention_sums_from_weights(pattern, spec, workspace=workspace)


def warn_triton_unavailable() -> None:
    """Say once per process, naming the error, that CUDA tensors go through the torch path because the
    fused kernel cannot run here (Triton absent, too old, broken, or the kernel failed to compile or
    launch): the numbers are the same, only slower, but a user who installed Triton should know."""
    global _warned_triton_unavailable
    if _warned_triton_unavailable:
        return
    _warned_triton_unavailable = True
    from .triton_kernel import _TRITON_IMPORT_ERROR, MIN_TRITON_VERSION

    why = _TRITON_FAILURE if _TRITON_FAILURE is not None else _TRITON_IMPORT_ERROR
    warnings.warn(
        f"the fused Triton kernel cannot run here ({type(why).__name__}: {why}); attention on CUDA is reduced by the "
        "torch path in query blocks instead (the same sums, slower). Install a Triton that imports "
        f"(pip install 'triton>={'.'.join(map(str, MIN_TRITON_VERSION))}') for the fused kernel",
        RuntimeWarning,
        stacklevel=2,
    )
