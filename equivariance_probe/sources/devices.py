"""Where and in which precision a study runs: device and dtype names.

Place in the seams: *sources*, in front of the model loader. ``"auto"`` picks CUDA when torch
sees a GPU (``cuda:LOCAL_RANK`` under torchrun or accelerate) and the CPU otherwise; the probe
keeps its float64 sums on the model's device while a chunk of documents streams and moves them
to the CPU at the end of each chunk (see :mod:`equivariance_probe.runs.checkpoint`). bf16/fp16 models are probed as they are: their
attention is upcast to float32 before the reduction, and the log floor defaults to the
smallest normal number of the attention dtype (1.2e-38 for bf16, 6.1e-5 for fp16, where
entries below it are floored and counted: ``result.floored()``).
"""

from __future__ import annotations

import os

import torch

from ..errors import InputError, option

__all__ = ["resolve_device", "parse_dtype", "DTYPES", "set_threads", "check_threads"]

#: Names accepted for the model's parameter dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or ``None``) → ``cuda`` (``cuda:LOCAL_RANK`` if set) if available, else ``cpu``; other names are checked.

    Raises:
        InputError: an unknown device name, or CUDA asked for where torch sees no GPU.
    """
    if device is None or str(device) == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # One process per GPU under torchrun / accelerate: each takes the GPU of its local rank.
        local_rank = os.environ.get("LOCAL_RANK")
        return torch.device(f"cuda:{int(local_rank)}" if local_rank is not None else "cuda")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InputError(f"device {device!r} is not a torch device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InputError(
            f"device {device!r} was asked for but torch sees no CUDA GPU (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}); use {option('device', 'cpu')} or 'auto', or install a CUDA build "
            "of torch"
        )
    return resolved


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or a torch dtype) → the torch dtype; ``None`` → float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def check_threads(threads: object, where: str = "threads") -> int | None:
    """``threads`` as a positive ``int``, or ``None`` (torch's own choice: one thread per core).

    Raises:
        InputError: anything but a positive integer or ``None``, named with ``where``.
    """
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InputError(f"{where}={threads!r} must be a positive number of CPU threads (e.g. 1 on a machine "
                         "another job also uses), or None for torch's default of one per core")
    return threads


def set_threads(threads: int | None) -> None:
    """Run torch's CPU operations on ``threads`` threads (``torch.set_num_threads``: the intra-op pool, for the whole
    process); ``None`` leaves torch's default, one per core. On cores another process also keeps busy, torch's
    default oversubscribes them: each operation's threads wait for one another at every barrier, and a run slows
    far more than the shared cores alone explain (measured in docs/guide/cost.md).

    Raises:
        InputError: not a positive integer or ``None``.
    """
    threads = check_threads(threads)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
