"""The Triton engine: the per-window attention sums of one layer in one fused kernel launch (CUDA).

Place in the seams: *statistics*, the CUDA engine beside the torch one, under the dispatcher of
:mod:`~equivariance_probe.statistics.engines`. It is imported only when a run is on CUDA (or by
its tests), so importing the package never imports Triton. :func:`attention_sums_triton`
computes the same dict as :func:`~equivariance_probe.statistics.engines.torch_blocks.attention_sums_from_qk`
from the same :class:`~equivariance_probe.statistics.engines.spec.ReductionSpec`, never writing
a score or a weight to memory; the kernel and its precision are described in
:mod:`~equivariance_probe.statistics.engines.triton_kernel`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import InputError
from .spec import ReductionSpec, check_qk, empty_sums, layout
from .torch_blocks import pattern_sum_from_qk
from .triton_kernel import (  # noqa: F401 - the import state and the kernel, read here and by the tests
    _TRITON_IMPORT_ERROR,
    MIN_TRITON_VERSION,
    _attention_sums_kernel,
    _import_triton,
    _interpreting,
    _tanh64,
    _triton_version_problem,
    tl,
    triton,
    triton_available,
)

__all__ = ["MIN_TRITON_VERSION", "attention_sums_triton", "triton_available"]


#: The float64 ``(scaling, softcap, log eps)`` tensors the kernel reads, by value and device.
_PARAMETERS: dict[tuple[float, float, float, torch.device], torch.Tensor] = {}


def _kernel_parameters(scaling: float, softcap: float | None, log_eps: float, device: torch.device) -> torch.Tensor:
    """``[scaling, softcap (1 without one), log eps]`` float64 on ``device``, made once per distinct value.

    They go through memory, not as scalar arguments, because Triton passes Python floats as
    float32, which would round the scaling of float64 inputs. Every layer of a model shares
    them, so one host-to-device copy serves the whole run instead of one per layer call.
    """
    values = (float(scaling), 1.0 if softcap is None else float(softcap), float(log_eps), torch.device(device))
    if values not in _PARAMETERS:
        _PARAMETERS[values] = torch.tensor(values[:3], dtype=torch.float64, device=device)
    return _PARAMETERS[values]


def _dot_dtype(dtype: torch.dtype, key_dtype: torch.dtype | None = None):
    """The dtype in which query (``dtype``) and key tiles enter ``tl.dot`` (see the module docstring).

    bf16 and fp16 stay in the model's dtype (tensor cores, float32 accumulation) when queries
    and keys share it, float64 queries make it float64 (the work dtype, as on the torch path),
    anything else is upcast to float32 (IEEE products), so keys of another dtype are never
    rounded to a half-precision one. Triton's CPU interpreter multiplies bf16 tiles as their
    raw 16-bit patterns (it stores bf16 as uint16 and ``np.matmul``s that; measured with
    Triton 3.9), so there bf16 tiles are upcast to float32: the products are exact either way
    and only the accumulation order differs.
    """
    if dtype == torch.float64:
        return tl.float64
    if key_dtype is not None and key_dtype != dtype:
        return tl.float32
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not _interpreting():
        return tl.bfloat16
    return tl.float32


#: Default query rows (and keys) per tile, and warps per program for tiles of 32 rows or more.
#: Compiled for sm_90 (H100) by Triton 3.9 without a GPU, ``ptxas`` allots 32-row tiles with 8
#: warps no spill (at most 8 bytes of stack at head_dim 256) for every input dtype and head
#: dimension up to 256, while 64-row tiles spill 0.2-2.8 KB per thread (4 or 8 warps). Not
#: timed on a GPU: chosen from register use, not tuned for speed.
DEFAULT_TILE = 32
WARPS = 8


def _tile_size(block_size: int | None) -> int:
    """Query rows (and keys) per tile: ``DEFAULT_TILE`` or ``block_size`` rounded up to a power of two of at
    least 16 (``tl.dot``'s minimum)."""
    if block_size is None:
        return DEFAULT_TILE
    return max(16, triton.next_power_of_2(int(block_size)))


def attention_sums_triton(
    query: torch.Tensor, key: torch.Tensor, spec: ReductionSpec | None = None, /, **options: Any
) -> dict[str, torch.Tensor]:
    """:func:`~equivariance_probe.statistics.engines.torch_blocks.attention_sums_from_qk` as one fused Triton
    kernel (CUDA), causal masks only.

    Same arguments and the same dict, except that ``block_size`` is the kernel's tile
    (query rows per program and keys per tile; rounded up to a power of two of at least
    16), ``compile_blocks`` is ignored (the kernel is fused already), and ``pattern_sum``
    (``keep_pattern=True``) comes from the torch helper
    :func:`~equivariance_probe.statistics.engines.torch_blocks.pattern_sum_from_qk`. Results agree with the
    torch path to float32 rounding of the scores and weights (relative 2e-6 in the tests; bf16/fp16 scores
    come from the tensor cores, see the kernel's module); sums assembled from float64
    atomic adds (``lag_sum``, ``key_lag_sum``) may differ between runs in the last float64
    bits.

    Raises:
        InputError: Triton cannot be imported, or the tensors are not on a CUDA device (outside the Triton
            interpreter, ``TRITON_INTERPRET=1``, which runs kernels on CPU tensors).
    """
    spec = ReductionSpec.of(spec, **options)
    if triton is None:
        raise InputError(
            f"attention_sums_triton needs Triton, which cannot be imported here ({_TRITON_IMPORT_ERROR!r}); "
            "use attention_sums_from_qk, or the engines' dispatcher, which picks the torch path without it"
        )
    if not query.is_cuda and not _interpreting():
        raise InputError(
            f"attention_sums_triton runs on CUDA tensors, got {query.device}; use attention_sums_from_qk "
            "(or engine='auto'), or set TRITON_INTERPRET=1 to run the kernel in Triton's CPU interpreter"
        )
    if not spec.causal:
        raise InputError("the Triton engine computes causal attention only; use engine='auto' or 'torch' for an encoder")
    batch, heads, kv_heads, n_positions, dim = check_qk(query, key)
    laid_out = layout(spec, batch=batch, heads=heads, n_positions=n_positions, device=query.device,
                      input_dtype=query.dtype)
    out = empty_sums(laid_out, keep_pattern=False, keep_first_key=spec.keep_first_key)
    n_real = max(laid_out.host_lengths, default=0)
    if n_real > 0:
        use_fp64 = query.dtype == torch.float64
        q = query if query.stride(-1) == 1 else query.contiguous()
        k = key if key.stride(-1) == 1 else key.contiguous()
        tile = _tile_size(spec.block_size)
        block_d = max(16, triton.next_power_of_2(dim))
        scale = float(dim**-0.5 if spec.scaling is None else spec.scaling)
        params = _kernel_parameters(scale, spec.softcap, math.log(laid_out.log_floor), query.device)
        floored_rows = torch.zeros((batch, heads, n_positions), dtype=torch.float64, device=query.device)
        grid = (triton.cdiv(n_real, tile), batch * heads)
        _attention_sums_kernel[grid](
            q, k, laid_out.lengths, laid_out.key_keep.to(torch.int8), laid_out.key_bin, params,
            out["raw_sum"], out["raw_sq"], out["log_sum"], out["log_sq"], floored_rows,
            out["lag_sum"], out["key_lag_sum"], out.get("first_key_sum", floored_rows),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            heads, heads // kv_heads, n_positions, 0 if laid_out.window is None else laid_out.window,
            HEAD_DIM=dim,
            BLOCK_D=block_d,
            BLOCK=tile,
            DTYPE=tl.float64 if use_fp64 else tl.float32,
            DOT_DTYPE=_dot_dtype(query.dtype, key.dtype),
            HAS_WINDOW=laid_out.window is not None,
            HAS_SOFTCAP=spec.softcap is not None,
            HAS_EXCLUDED=bool(laid_out.excluded),
            HAS_FIRST_KEY=spec.keep_first_key,
            num_warps=WARPS if tile >= 32 else 4,
        )
        out["floored"] = floored_rows.sum(-1)
    if spec.keep_pattern:
        out["pattern_sum"] = pattern_sum_from_qk(query, key, spec)
    return out
