"""Memory: what a run of the probe will need, what the machine has, and what a run used.

Place in the seams: *sources*, a helper of the orchestration (:mod:`equivariance_probe.runs.compare`),
independent of the statistics and the adapters. The estimate is what lets a
comparison refuse a model that does not fit *before* loading it; the peak measurement is the
per-model cost reported next to the numbers. It imports ``torch`` only; ``transformers`` only
to count a config's parameters.

Example:
    >>> from equivariance_probe.sources.resources import estimate_memory, available_memory
    >>> need = estimate_memory(n_parameters=268_098_176, n_heads=4, context_length=512, batch_size=4)
    >>> need.total <= (available_memory() or float("inf"))
    True
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MemoryEstimate",
    "PeakMemory",
    "available_memory",
    "count_parameters",
    "estimate_memory",
    "ENTRY_BYTES",
    "PATTERN_SUM_LIMIT",
]

#: Bytes of working memory per attention entry ``[batch, head, query, key]`` while one layer
#: is captured and reduced: the eager scores and weights (float32) and the reduction's
#: temporaries (weights, log weights, squares, masks, key-lag copies), plus what the allocator
#: keeps between layers. Calibrated on the packaged models at T = 512, batch 4: the probe's
#: peak rose by about 100 B per entry above weights and statistics (README, "Across architectures").
ENTRY_BYTES = 128
#: The estimate counts the window-summed pattern (``8·L·H·T²`` bytes) up to this size. Runs keep
#: it only with ``keep_pattern=True`` (``--keep-pattern``), so without it the estimate errs high
#: by at most this much, on the safe side.
PATTERN_SUM_LIMIT = 2**30
#: Interpreter, torch, transformers, tokenizers and corpus before a model is loaded (measured:
#: 0.4 GiB), plus heap the allocator keeps from earlier models of a comparison (up to ~0.8 GiB).
BASE_BYTES = 5 * 2**28


@dataclass(frozen=True)
class MemoryEstimate:
    """What one model's study needs at its peak, in bytes.

    ``total = weights + attention + statistics + base`` with

    * ``weights = n_parameters × dtype bytes × copies`` (the trained model stays loaded while a
      baseline is built and run: 2 copies with baselines, 1 without);
    * ``attention = batch × n_heads × T² × ENTRY_BYTES`` (one layer at a time);
    * ``statistics = 3 × 8·T²`` (key-lag sums) ``+ min(8·L·H·T², 1 GiB)`` (summed pattern);
    * ``base``: the interpreter and libraries.
    """

    n_parameters: int
    weights: int
    attention: int
    statistics: int
    base: int

    @property
    def total(self) -> int:
        return self.weights + self.attention + self.statistics + self.base

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.total / gib:.2f} GiB = weights {self.weights / gib:.2f} GiB ({self.n_parameters:,} parameters) "
            f"+ attention working set {self.attention / gib:.2f} GiB + statistics {self.statistics / gib:.2f} GiB "
            f"+ libraries {self.base / gib:.2f} GiB"
        )


def estimate_memory(
    *,
    n_parameters: int,
    n_heads: int,
    context_length: int,
    batch_size: int,
    n_layers: int = 1,
    dtype: torch.dtype = torch.float32,
    copies: int = 2,
) -> MemoryEstimate:
    """Estimate the peak memory of a study on one model (see :class:`MemoryEstimate`).

    Args:
        n_parameters: parameters of the model.
        n_heads: query heads per layer.
        context_length: tokens per window ``T``.
        batch_size: windows per forward pass.
        n_layers: layers (for the summed pattern the probe keeps).
        dtype: parameter dtype.
        copies: models in memory at once (2: trained and a baseline).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    squares = context_length * context_length
    return MemoryEstimate(
        n_parameters=int(n_parameters),
        weights=int(n_parameters) * itemsize * copies,
        attention=batch_size * n_heads * squares * ENTRY_BYTES,
        statistics=3 * 8 * squares + min(8 * n_layers * n_heads * squares, PATTERN_SUM_LIMIT),
        base=BASE_BYTES,
    )


def count_parameters(model_or_config: Any) -> int:
    """Parameters of a model, or of the model a Hugging Face config describes (built on the meta
    device: no memory is allocated)."""
    if isinstance(model_or_config, torch.nn.Module):
        return sum(p.numel() for p in model_or_config.parameters())
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_or_config)
    return sum(p.numel() for p in model.parameters())


def available_memory() -> int | None:
    """Memory available to a new allocation, in bytes (Linux ``MemAvailable``); ``None`` if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as stream:
            for line in stream:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak resident memory of this process over a ``with`` block, in bytes.

    On Linux the kernel's high-water mark (``VmHWM``) is reset at entry (writing ``5`` to
    ``/proc/self/clear_refs``) and read at exit, so the peak belongs to the block alone
    (``method = "VmHWM"``). Where that cannot be reset the peak is the process's since it
    started (``ru_maxrss``, ``method = "process peak"``), an upper bound for the block.

    Example:
        >>> with PeakMemory() as peak:
        ...     block = bytearray(2**26)
        >>> peak.bytes >= 2**26
        True
    """

    def __init__(self) -> None:
        self.bytes: int | None = None
        self.method = "VmHWM"

    def __enter__(self) -> PeakMemory:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as stream:
                stream.write("5")
        except OSError:
            self.method = "process peak"
        if _read_status("VmHWM") is None:
            self.method = "process peak"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.method == "VmHWM":
            self.bytes = _read_status("VmHWM")
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.bytes = peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
