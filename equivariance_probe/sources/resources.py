"""Memory: what a run of the probe will need, what the machine has, and what a run used.

Place in the seams: *sources*, a helper of the orchestration (:mod:`equivariance_probe.runs.compare`,
:mod:`equivariance_probe.runs.scan`), independent of the statistics' code. The estimate is what lets a
comparison or a context-length scan refuse a model or a length that does not fit *before* loading
anything; the peak measurement is the per-model cost reported next to the numbers. It imports
``torch`` only; ``transformers`` to read a model's config (:func:`model_size`).

The estimate follows the engine (docs/guide/engine.md): the model runs its own attention kernel
(sdpa by default, which never holds a ``[T, T]`` pattern per head), and the statistics recompute
attention from its queries and keys in query blocks whose temporaries are bounded by
:data:`~equivariance_probe.statistics.engines.torch_blocks.DEFAULT_BLOCK_MEMORY`. So memory grows with ``B·T``
(the forward's activations) and only by one byte per ``[query, key]`` pair of each window with
``B·T²`` (the boolean masks transformers builds for sdpa), not with ``B·H·T²`` weights.

Example:
    >>> from equivariance_probe.sources.resources import estimate_memory_of, available_memory
    >>> need = estimate_memory_of("gemma-3-270m", context_length=8192, batch_size=1)
    >>> need.total <= (available_memory() or float("inf"))
    True
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InsufficientMemoryError
from ..statistics.engines.torch_blocks import DEFAULT_BLOCK_MEMORY

__all__ = [
    "MemoryEstimate",
    "ModelSize",
    "PeakMemory",
    "available_memory",
    "check_fits",
    "count_parameters",
    "estimate_memory",
    "estimate_memory_of",
    "model_size",
    "ACTIVATION_WIDTHS",
    "BASE_BYTES",
]

#: Activations of the forward pass held at its peak, in values per token per unit of width: the
#: residual stream and its normed copy, the MLP's gate, up and product (``intermediate_size`` wide)
#: and the queries, keys, values and attention output (``heads × head_dim`` wide) of one layer at a
#: time, plus what the allocator keeps between layers. Calibrated on measured peaks
#: (``benchmarks/memory_estimate.py``; docs/guide/cost.md): Gemma 3 270M's run peak rises by about
#: 66 KB per token of a batch (0.60 → 0.94 GiB above the loaded model from 2,048 to 8,192
#: tokens), against 73 KB here (6·640 + 4·2048 + 6·1024 float32 values).
ACTIVATION_WIDTHS = {"hidden": 6.0, "intermediate": 4.0, "attention": 6.0}
#: Interpreter, torch, transformers, tokenizers and corpus before a model is loaded (measured:
#: 0.22 GiB), the probe's own fixed cost beyond the query blocks (0.1-0.3 GiB measured), and heap
#: the allocator may keep from an earlier model of a comparison.
BASE_BYTES = 3 * 2**28
#: Bytes per entry of a query block's temporaries (float32 work; ``statistics.engines.torch_blocks``), for the
#: one-row blocks of very wide batches where even one row exceeds the block budget.
_BLOCK_ENTRY_BYTES = 96


@dataclass(frozen=True)
class ModelSize:
    """What the memory estimate needs to know of a model, read from its config (nothing loaded).

    Attributes:
        n_parameters: parameters of the model as loaded.
        n_layers, n_heads: attention layers and query heads per layer.
        hidden_size, intermediate_size: widths of the residual stream and of the MLP.
        attention_width: ``n_heads × head_dim``, the width of the queries.
        max_context: the longest window the model accepts (``None``: unbounded).
        mask_kinds: distinct attention masks (1, or 2 for models with sliding-window and global layers).
    """

    n_parameters: int
    n_layers: int
    n_heads: int
    hidden_size: int
    intermediate_size: int
    attention_width: int
    max_context: int | None
    mask_kinds: int = 1


@dataclass(frozen=True)
class MemoryEstimate:
    """What one model's study needs at its peak, in bytes.

    ``total = weights + activations + attention + statistics + base`` with, for ``B`` windows of
    ``T`` tokens per forward pass:

    * ``weights = n_parameters × dtype bytes × copies`` (the trained model stays loaded while a
      baseline is built and run: 2 copies with baselines, 1 without);
    * ``activations = B·T × dtype bytes × (6·hidden + 4·intermediate + 6·heads·head_dim)``
      (:data:`ACTIVATION_WIDTHS`; one layer at a time, the projection to the vocabulary skipped);
    * ``attention = mask_kinds × B·T²`` (one boolean sdpa mask per kind of layer)
      ``+ max(block budget, B·H·T × 96 B)`` (one query block's temporaries, 96 MiB by default);
    * ``statistics = 8 × (6·L·H·T + 6·L·H·B·T + 2·L·T + 3·64·T)`` (the float64 sums, the first
      token's among them, and one batch's per-window sums) ``+ 8·L·H·T²`` with ``keep_pattern`` (the
      summed pattern);
    * ``base``: the interpreter, the libraries and the probe's fixed cost (:data:`BASE_BYTES`, 0.75 GiB).

    Every weight counts as resident. Weights read from a memory-mapped file that the run never
    touches (the untouched rows of an embedding table, an untied output layer the probe skips)
    stay out of resident memory, so measured peaks are lower: by 25-45 % for the packaged models
    (docs/guide/cost.md).
    """

    n_parameters: int
    weights: int
    activations: int
    attention: int
    statistics: int
    base: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.attention + self.statistics + self.base

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.total / gib:.2f} GiB = weights {self.weights / gib:.2f} GiB ({self.n_parameters:,} parameters) "
            f"+ activations {self.activations / gib:.2f} GiB + attention masks and query blocks "
            f"{self.attention / gib:.2f} GiB + statistics {self.statistics / gib:.2f} GiB "
            f"+ libraries {self.base / gib:.2f} GiB"
        )


def estimate_memory(
    *,
    n_parameters: int,
    n_heads: int,
    context_length: int,
    batch_size: int,
    n_layers: int = 1,
    hidden_size: int = 0,
    intermediate_size: int = 0,
    attention_width: int = 0,
    mask_kinds: int = 1,
    dtype: torch.dtype = torch.float32,
    copies: int = 2,
    keep_pattern: bool = False,
    block_memory: int = DEFAULT_BLOCK_MEMORY,
) -> MemoryEstimate:
    """Estimate the peak memory of a study on one model (see :class:`MemoryEstimate`).

    Args:
        n_parameters: parameters of the model.
        n_heads: query heads per layer.
        context_length: tokens per window ``T``.
        batch_size: windows per forward pass ``B``.
        n_layers: layers ``L``.
        hidden_size, intermediate_size, attention_width: widths of the residual stream, the MLP
            and the queries (``heads × head_dim``); 0 leaves that part of the activations out.
        mask_kinds: distinct attention masks (2 for sliding-window and global layers).
        dtype: parameter dtype.
        copies: models in memory at once (2: trained and a baseline).
        keep_pattern: the run keeps the window-summed pattern (``8·L·H·T²`` bytes).
        block_memory: the query blocks' budget (the engine's default).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    tokens = batch_size * context_length
    widths = (ACTIVATION_WIDTHS["hidden"] * hidden_size + ACTIVATION_WIDTHS["intermediate"] * intermediate_size
              + ACTIVATION_WIDTHS["attention"] * attention_width)
    per_layer_sums = 6 * n_layers * n_heads * context_length  # raw, log (Σ and Σ²), lag and first-token sums
    return MemoryEstimate(
        n_parameters=int(n_parameters),
        weights=int(n_parameters) * itemsize * copies,
        activations=int(tokens * itemsize * widths),
        attention=mask_kinds * tokens * context_length
        + max(block_memory, batch_size * n_heads * context_length * _BLOCK_ENTRY_BYTES),
        statistics=8 * (per_layer_sums * (1 + batch_size) + 2 * n_layers * context_length + 3 * 64 * context_length)
        + (8 * n_layers * n_heads * context_length**2 if keep_pattern else 0),
        base=BASE_BYTES,
    )


def model_size(model_or_config: Any) -> ModelSize:
    """:class:`ModelSize` of a loaded model (Hugging Face, TransformerBridge or nnsight) or of a
    Hugging Face config (parameters counted on the meta device: nothing is allocated)."""
    from ..adapters.modules import config_max_context, layer_windows, text_config, unwrap_model

    if isinstance(model_or_config, torch.nn.Module) or not hasattr(model_or_config, "to_dict"):
        hf_model = unwrap_model(model_or_config)[0]
        config, n_parameters = hf_model.config, count_parameters(hf_model)
    else:
        config, n_parameters = model_or_config, count_parameters(model_or_config)
    text = text_config(config)
    n_layers = int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer"))
    n_heads = int(getattr(text, "num_attention_heads", None) or getattr(text, "n_head"))
    hidden = int(getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0) or 0)
    head_dim = getattr(text, "head_dim", None) or (hidden // n_heads if n_heads else 0)
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    max_context = config_max_context(text)
    return ModelSize(n_parameters=int(n_parameters), n_layers=n_layers, n_heads=n_heads, hidden_size=hidden,
                     intermediate_size=int(intermediate), attention_width=int(n_heads * head_dim),
                     max_context=max_context,
                     mask_kinds=len(set(layer_windows(config, n_layers))))


def estimate_memory_of(
    model: Any,
    *,
    context_length: int,
    batch_size: int,
    copies: int = 2,
    dtype: torch.dtype = torch.float32,
    keep_pattern: bool = False,
    cache_dir: Any = None,
) -> MemoryEstimate:
    """:func:`estimate_memory` of a model given by name (its config read, nothing loaded; see
    :func:`~equivariance_probe.sources.models.load_config`), config, or loaded object."""
    if isinstance(model, (str, os.PathLike)):
        from .models import load_config

        model = load_config(str(model), cache_dir=cache_dir)
    size = model if isinstance(model, ModelSize) else model_size(model)
    return estimate_memory(n_parameters=size.n_parameters, n_heads=size.n_heads, n_layers=size.n_layers,
                           hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
                           attention_width=size.attention_width, mask_kinds=size.mask_kinds,
                           context_length=context_length, batch_size=batch_size, copies=copies, dtype=dtype,
                           keep_pattern=keep_pattern)


def check_fits(
    estimates: Mapping[Any, MemoryEstimate],
    memory_limit: int | None,
    *,
    what: str,
    fix: str,
    name: Callable[[Any], str] = str,
) -> None:
    """Refuse, naming each estimate, the items whose estimated need exceeds the limit.

    Args:
        estimates: item (a model's label, a context length) -> its estimate.
        memory_limit: bytes; ``None``: the memory available now (:func:`available_memory`).
        what: what the items are, for the message (``"context lengths "``; ``""`` for models' labels).
        fix: the sentence that says what to change.
        name: how an item is named beside its estimate.

    Raises:
        InsufficientMemoryError: ``not enough memory for {what}[items] (L GiB available): item: estimate; ... {fix}``.
    """
    limit = memory_limit if memory_limit is not None else available_memory()
    too_big = {item: e for item, e in estimates.items() if limit is not None and e.total > limit}
    if too_big:
        details = "; ".join(f"{name(item)}: {e.describe()}" for item, e in too_big.items())
        raise InsufficientMemoryError(
            f"not enough memory for {what}{sorted(too_big)} ({limit / 2**30:.2f} GiB available): {details}. {fix}"
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
