"""What runs inside an nnsight trace (remotely: on an NDIF server), and talking to NDIF.

Place in the seams: *adapters*, beside :mod:`~equivariance_probe.adapters.nnsight`. A remote
model's patterns cannot come home (a Llama-3.1-70B layer at context 1024 is 64·1024² bf16
weights = 128 MiB per document, 10 GiB for its 80 layers), so the batch is reduced where the
model runs by :func:`reduce_batch_in_trace`, with the statistics' own torch-only kernels
(:mod:`~equivariance_probe.statistics.engines.in_trace`), and only float64 sums of
:func:`reply_nbytes` bytes come back. The shift test sums a segment's whole grid of windows in one
nnsight session (:func:`add_segment_windows_in_trace` in each of its traces, the running sums kept on
the server between them, with the statistics' own torch-only functions of
:mod:`~equivariance_probe.statistics.engines.shift_sums`), and only :func:`segment_reply_nbytes` bytes
come back per segment.

The in-trace functions (:data:`REMOTE_FUNCTIONS`) are shipped by value with the request
(cloudpickle's ``register_pickle_by_value``) and must use only torch, builtins and each other:
the server's sandbox refuses other imports (it allows torch, numpy, einops, math,
collections ...), and equivariance_probe is not installed there. No equivariance_probe
exception classes either (they would travel by value, with their module): in-trace failures
raise builtins and the adapter translates them (:func:`is_remote_failure`,
:func:`is_source_failure`).
"""

from __future__ import annotations

import collections
import os

import torch

from ..statistics.engines.in_trace import attention_scores, recompute_pattern, reduce_pattern, repeat_kv, visible_mask
from ..statistics.engines.shift_sums import (
    DECOMPOSITION_SUMS,
    PREDICTION_SUMS,
    REPRESENTATIONS,
    ATTRIBUTION_GRAMS,
    add_component_to_state,
    SINK_SUMS,
    MASSIVE_SUMS,
    add_prediction_sums,
    add_sink_sums,
    add_massive_sums,
    add_to_cell,
    component_grams,
    counted_entries,
    end_context_of_cell,
    end_context_of_components,
    grid_sums,
    new_component_state,
    new_prediction_sums,
    new_sink_sums,
    new_massive_sums,
    segment_representations,
)
from ..statistics.masks import KEY_BINS
from ..statistics.sums import STATISTICS, head_sums
from .segments import hidden_keys, segment_blocks_from_qk, segment_log_probs, segment_rows

__all__ = [
    "ATTENTION_CALL",
    "NO_WEIGHTS",
    "REMOTE_FUNCTIONS",
    "outside_mass",
    "layer_pattern",
    "reduce_batch_in_trace",
    "new_segment_state",
    "add_segment_windows_in_trace",
    "add_segment_predictions_in_trace",
    "end_segment_context",
    "segment_sums_in_trace",
    "segment_check_in_trace",
    "SEGMENT_FUNCTIONS",
    "SEGMENT_CHECK_FUNCTIONS",
    "reply_nbytes",
    "segment_reply_nbytes",
    "api_key",
    "configured_host",
    "is_public_host",
    "PUBLIC_HOST",
    "is_remote_failure",
    "remote_failure_kind",
    "is_source_failure",
    "REMOTE_MODULES",
    "PLAN_FUNCTIONS",
    "read_sites_in_trace",
    "attention_call_in_trace",
]


# -- code that runs inside the trace ----------------------------------------------------------
#: The operation of an attention module's forward whose inputs are
#: ``(module, query, key, value, attention_mask, **{scaling, softcap, sliding_window})``:
#: the call of ``attention_interface`` (its binding is ``attention_interface_0``).
#: Every ``transformers`` 4.48+ decoder (Llama, Mistral, Qwen, Gemma 1-3, GPT-2) has it.
ATTENTION_CALL = "attention_interface_1"


#: What the in-trace code's ``ValueError`` says when an attention module returned no weights; the
#: adapter recognises it by this text (only builtins can be raised on the server).
NO_WEIGHTS = "the attention module returned no attention weights"


def outside_mass(pattern: torch.Tensor, window: int | None, lengths: torch.Tensor) -> torch.Tensor:
    """Largest attention mass a real query puts outside the reported mask: ``[]`` float64.

    The in-trace twin of :func:`~equivariance_probe.statistics.mask_check.outside_mass`: if it is not ~0, the model's
    real mask is not the one the adapter reported and every statistic would miss mass.
    """
    n_positions = pattern.shape[-1]
    model_mask = visible_mask(n_positions, window, lengths)  # [batch, query, key]
    real_rows = model_mask.any(-1, keepdim=True).unsqueeze(1)
    hidden = real_rows & ~model_mask.unsqueeze(1)
    outside = torch.where(hidden, pattern.abs().to(torch.float64), torch.zeros((), dtype=torch.float64, device=pattern.device))
    return outside.sum(-1).max() if outside.numel() else torch.zeros((), dtype=torch.float64)


def layer_pattern(attention: object, source: str, window: int | None) -> torch.Tensor:
    """One layer's ``[batch, head, query, key]`` pattern, read inside a trace.

    Args:
        attention: the attention module's envoy (e.g. ``model.model.layers[l].self_attn``).
        source: ``"weights"`` (its returned weights) or ``"recompute"`` (from its q, k).
        window: the layer's sliding window, for ``"recompute"``.
    """
    if source == "weights":
        weights = attention.output[1]
        if weights is None:
            # A builtin: equivariance_probe is not importable on the server.
            raise ValueError(NO_WEIGHTS + " (it does not run eager attention); use pattern_source='recompute'")
        return weights.detach()
    args, kwargs = attention.source.attention_interface_1.inputs
    return recompute_pattern(
        args[1].detach(), args[2].detach(), kwargs.get("scaling"), kwargs.get("softcap"), window
    )


def reduce_batch_in_trace(attention: list, lengths: torch.Tensor, plan: dict) -> dict[str, torch.Tensor]:
    """Reduce one batch's attention to float64 sums, layer by layer, inside the trace.

    Only one layer's pattern exists at a time. The caller stops the model run after it
    (the final norm and the projection to the vocabulary are not needed).

    Args:
        attention: per layer, the attention module's envoy.
        lengths: ``[batch]`` real tokens per window (right-padded).
        plan: plain values: ``source`` (``"weights"``/``"recompute"``), ``model_windows``
            (per layer, the model's sliding window or ``None``), and what
            :meth:`~equivariance_probe.statistics.AttentionStatistics.reduction_plan` gives:
            ``spec`` (the batch's reduction spec in plain form: ``excluded_keys``, ``log_floor``,
            ``keep_pattern``, ``key_bin``, ``n_key_bins``, ...), ``windows`` (the statistics' windows:
            ``None`` where the window covers the context) and ``check_mask``.

    Returns:
        float64 tensors for ``W`` = the batch's width and ``L`` layers:
        ``raw_sum, raw_sq, log_sum, log_sq, lag_sum: [L, head, W]``;
        ``floored, doc_toeplitz_sum, doc_toeplitz_count: [L, head]``;
        ``key_lag_sum: [K, W]`` (summed over layers); ``outside_mass: [L]``; if
        ``keep_pattern``, ``pattern_sum: [L, head, W, W]``; and, if ``keep_first_key``,
        ``first_key_sum: [L, head, W]`` and ``first_key_window: [L, batch, head]`` (each window's weight on its
        first token summed over its queries: the per-window sink rate's).
    """
    # No typing names in here: annotations would make the payload import `typing`.
    per_layer: dict[str, list[torch.Tensor]] = {}
    key_lag_total = None
    outside: list[torch.Tensor] = []
    masks: dict[int | None, torch.Tensor] = {}
    spec = plan["spec"]
    for layer, module in enumerate(attention):
        pattern = layer_pattern(module, plan["source"], plan["model_windows"][layer])
        device = pattern.device
        n_positions = pattern.shape[-1]
        lengths_here = lengths.to(device)
        window = plan["windows"][layer]
        if window not in masks:
            masks[window] = visible_mask(n_positions, window, lengths_here, spec["excluded_keys"])
        reduced = reduce_pattern(pattern, lengths_here, {**spec, "window": window}, masks[window])
        key_lag = reduced.pop("key_lag_sum")
        key_lag_total = key_lag if key_lag_total is None else key_lag_total + key_lag
        for name, value in reduced.items():
            per_layer.setdefault(name, []).append(value)
        if plan["check_mask"]:
            outside.append(outside_mass(pattern, window, lengths_here))
        else:
            outside.append(torch.zeros((), dtype=torch.float64, device=device))
        del pattern, reduced
    out = {name: torch.stack(values) for name, values in per_layer.items()}
    out["key_lag_sum"] = key_lag_total
    out["outside_mass"] = torch.stack(outside)
    # Sums come home on the CPU (the server would otherwise return CUDA tensors).
    return {name: value.cpu() for name, value in out.items()}


# -- the shift test: one segment's grid in one session ----------------------------------------
def new_segment_state(plan: dict) -> dict:
    """The running sums of one segment's grid on the server: ``cells`` (per ``(representation, layer)``,
    :func:`~equivariance_probe.statistics.engines.shift_sums.add_to_cell`), the prediction sums, each offset's
    latest distributions, the current context's, the contexts done, each layer's counted entries, the sink
    sums (:func:`~equivariance_probe.statistics.engines.shift_sums.new_sink_sums`) and the massive-activation sums
    (:func:`~equivariance_probe.statistics.engines.shift_sums.new_massive_sums`).

    ``plan`` holds plain values: ``n_layers``, ``n_heads``, ``n_offsets``, ``segment_length``, ``causal``,
    ``windows`` (per layer, the sliding window or ``None``), ``predictions`` and ``hidden_size`` (the residual
    stream's width, for its sums per hidden dimension), and ``components`` (the attribution's block-level components,
    empty for none: their running sums, :func:`~equivariance_probe.statistics.engines.shift_sums.new_component_state`)."""
    return {
        "components": new_component_state(plan.get("components", []), plan["n_offsets"]),
        "cells": {},
        "predictions": new_prediction_sums(plan["n_offsets"]),
        "latest": [None] * plan["n_offsets"],
        "current": {},
        "contexts": 0,
        "entries": [counted_entries(plan["segment_length"], plan["causal"], window) for window in plan["windows"]],
        "sink": new_sink_sums(plan["n_layers"], plan["n_heads"], plan["n_offsets"]),
        "massive": new_massive_sums(plan["n_layers"], plan["n_offsets"]),
    }


def add_segment_windows_in_trace(state: dict, attention: list, layers: list, plan: dict, batch: dict,
                                 parts: list | None = None) -> None:
    """Inside one trace of the session: add every layer's segment block (its three representations) and residual
    stream, for each window of the batch, to ``state``'s cells, and its rows' weights on the text before the
    segment to ``state``'s sink sums; with ``parts``, the attribution's block-level components too (block 0's
    input, and per layer the attention's and the MLP's outputs, or their post-norms'), read in the order the model
    runs them.

    Args:
        attention: per layer, the attention module's envoy (its queries and keys are read at ``ATTENTION_CALL``).
        layers: per layer, the decoder layer's envoy (its output is the residual stream after the block).
        batch: ``spans`` (each window's segment ``(start, length)``) and ``offsets`` (each window's offset index).
        parts: per layer, ``(attention_out, mlp_out)`` envoys
            (:func:`~equivariance_probe.adapters.components.block_parts`), or ``None`` without attribution.
    """
    components = state["components"]

    def add_component(name: str, output: object) -> None:
        hidden = segment_rows(output[0] if isinstance(output, tuple) else output, batch["spans"])
        for b, index in enumerate(batch["offsets"]):
            add_component_to_state(components, name, index, hidden[b])

    if parts is not None:
        args, kwargs = layers[0].inputs
        add_component("embedding", args[0] if args else kwargs["hidden_states"])
    for layer, module in enumerate(attention):
        args, kwargs = getattr(module.source, ATTENTION_CALL).inputs
        scores, normaliser, sink = segment_blocks_from_qk(args[1].detach(), args[2].detach(), kwargs.get("scaling"),
                                                          kwargs.get("softcap"), batch["spans"],
                                                          plan["windows"][layer], plan["causal"])
        for b, index in enumerate(batch["offsets"]):
            for name, values in segment_representations(scores[b], normaliser[b], state["entries"][layer]).items():
                add_to_cell(state["cells"].setdefault((name, layer), {}), values, index, plan["n_offsets"])
            add_sink_sums(state["sink"], layer, index, sink[b])
        if parts is not None:
            add_component(f"attention.{layer}", parts[layer][0].output)
            add_component(f"mlp.{layer}", parts[layer][1].output)
        output = layers[layer].output
        hidden = segment_rows(output[0] if isinstance(output, tuple) else output, batch["spans"])
        for b, index in enumerate(batch["offsets"]):
            add_to_cell(state["cells"].setdefault(("residual", layer), {}), hidden[b].reshape(1, -1), index,
                        plan["n_offsets"])
            add_massive_sums(state["massive"], layer, index, hidden[b])
        del scores, normaliser, sink, hidden


def add_segment_predictions_in_trace(state: dict, logits: torch.Tensor, batch: dict, targets: torch.Tensor) -> None:
    """Add the batch's next-token predictions: ``logits: [batch, keep, vocab]`` for its last ``keep`` positions
    (``logits_to_keep``), ``batch["width"]`` tokens wide; ``targets: [m − 1]`` the segment's own next tokens."""
    log_probs = segment_log_probs(logits.detach(), batch["spans"], batch["width"])
    for b, index in enumerate(batch["offsets"]):
        add_prediction_sums(state["predictions"], state["latest"], state["current"], index, log_probs[b, :-1], targets)


def end_segment_context(state: dict) -> None:
    """Between the session's traces: close a context of the grid (every offset of it has run)."""
    for cell in state["cells"].values():
        end_context_of_cell(cell)
    end_context_of_components(state["components"])
    state["current"].clear()
    state["contexts"] += 1


def segment_sums_in_trace(state: dict, plan: dict) -> dict:
    """What comes back from the server: the segment's decomposition sums (``"{representation}/{name}": [layer,
    head]``), sink sums (``[layer, head, offset]``, ``[layer, offset]``) and prediction sums (``[offset]``,
    ``[offset, offset]``), float64 on the CPU."""
    sums = grid_sums(state["cells"], plan["n_layers"], plan["n_heads"], state["contexts"], plan["n_offsets"],
                     plan["hidden_size"])
    sums.update(state["sink"])
    sums.update(state["massive"])
    if plan["predictions"]:
        sums.update(state["predictions"])
    if plan.get("components"):
        grams = component_grams(state["components"])
        for term in ATTRIBUTION_GRAMS:
            sums["attribution/" + term + "_gram"] = grams[term]
    return sums


def segment_check_in_trace(attention: list, plan: dict, span: tuple) -> torch.Tensor:
    """Inside a trace of one window (batch 1, its segment ``span = (start, length)``): per layer, how far the
    attention output that the segment's recomputed weights give is from the output the model's own kernel
    returned, ``max |Σ_k a_ik·v_k − o_i| / max |v|`` over the segment's rows, heads and dimensions: ``[layer]``
    float64.

    The kernel's output exists whatever attention implementation the server runs (its weights only under eager),
    and the difference is at most the largest row's ``Σ_k |a_ik − a'_ik|``: a softmax that sees more than the
    scores (ALiBi biases, sink logits) shows as a difference of the weights' size."""
    start, length = span
    differences = []
    for layer, module in enumerate(attention):
        call = getattr(module.source, ATTENTION_CALL)
        args, kwargs = call.inputs
        query, key, value = args[1].detach(), args[2].detach(), args[3].detach()
        scores = attention_scores(query[:1, :, start:length], key[:1, :, :length], kwargs.get("scaling"),
                                  kwargs.get("softcap"))[0]
        hidden = hidden_keys(start, length, plan["windows"][layer], plan["causal"], scores.device)
        weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
        value = repeat_kv(value[0, :, :length], weights.shape[0]).to(weights.dtype)
        own = call.output[0].detach()[0, start:length].transpose(0, 1).to(weights.dtype)  # [head, m, d]
        scale = value.abs().max().clamp_min(1e-30)
        differences.append(((torch.matmul(weights, value) - own).abs().max() / scale).to(torch.float64).cpu())
    return torch.stack(differences)


def attention_call_in_trace(attention: object, layer: int, window: int | None) -> tuple:
    """Inside a trace, what the attention module's call of transformers' attention function (``ATTENTION_CALL``)
    receives, with the fields of :class:`~equivariance_probe.adapters.internals.AttentionCall` (a named tuple: the
    class itself is not on the server; no weights): ``layer``, ``query`` ``[batch, head, T, d]``, ``key``
    ``[batch, kv_head, T, d]``, ``attention_mask``, ``scaling``, ``softcap``.

    A kernel that masks causally itself (sdpa's ``is_causal``, flash attention's window) receives no mask; the
    mask is then the causal one, within the layer's sliding ``window``, as a boolean ``[1, 1, T, T]``.
    """
    args, kwargs = getattr(attention.source, ATTENTION_CALL).inputs
    query, key = args[1].detach(), args[2].detach()
    mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
    if mask is None:
        n_positions = query.shape[-2]
        mask = visible_mask(n_positions, window, torch.full((1,), n_positions, device=query.device)).unsqueeze(1)
    call = collections.namedtuple("AttentionCall", ["layer", "query", "key", "attention_mask", "scaling", "softcap"])
    return call(layer, query, key, mask.detach(), kwargs.get("scaling"), kwargs.get("softcap"))


def read_sites_in_trace(reads: list) -> list:
    """Inside a trace, each read site's value, reduced where the model runs.

    Args:
        reads: per site, in the order the forward pass reaches them, ``(envoy, place, columns, last_row,
            reducers)``: the module's envoy; ``"input"`` or ``"output"`` (the site is the module's),
            ``("weights", window)`` (the attention module's post-softmax weights, recomputed from the queries
            and keys its attention call receives: :func:`layer_pattern`, whatever kernel the server runs), or
            ``("call", layer, window)`` (that call itself: :func:`attention_call_in_trace`); the
            site's ``(start, stop)`` columns or ``None``; whether to keep the last position only; and one
            function (or ``None``: the value itself) per read of the site.

    Returns:
        Per site, the list of what its reducers returned.
    """
    values = []
    for envoy, place, columns, last_row, reducers in reads:
        if isinstance(place, tuple) and place[0] == "call":
            call = attention_call_in_trace(envoy, place[1], place[2])
            values.append([call if reduce is None else reduce(call) for reduce in reducers])
            continue
        if isinstance(place, tuple):
            value = layer_pattern(envoy, "recompute", place[1])
        elif place == "input":
            args, kwargs = envoy.inputs
            value = args[0] if len(args) > 0 else kwargs["hidden_states"]
        else:
            value = envoy.output
            if isinstance(value, tuple):
                value = value[0]
        if columns is not None:
            value = value[..., columns[0]:columns[1]]
        if last_row and value.shape[-2] != 1:
            value = value[..., -1:, :]
        value = value.detach()
        values.append([value if reduce is None else reduce(value) for reduce in reducers])
    return values


#: The function of a plan's reads that runs on the server (by value), with the reducers the plan carries.
PLAN_FUNCTIONS = (
    "equivariance_probe.adapters.nnsight_remote.read_sites_in_trace",
    "equivariance_probe.adapters.nnsight_remote.layer_pattern",
    "equivariance_probe.adapters.nnsight_remote.attention_call_in_trace",
    "equivariance_probe.statistics.engines.in_trace.recompute_pattern",
    "equivariance_probe.statistics.engines.in_trace.attention_scores",
    "equivariance_probe.statistics.engines.in_trace.repeat_kv",
    "equivariance_probe.statistics.engines.in_trace.visible_mask",
)


#: The functions of the shift test that run on the server, in one session per segment (by value).
SEGMENT_FUNCTIONS = (
    "equivariance_probe.adapters.nnsight_remote.new_segment_state",
    "equivariance_probe.adapters.nnsight_remote.add_segment_windows_in_trace",
    "equivariance_probe.adapters.nnsight_remote.add_segment_predictions_in_trace",
    "equivariance_probe.adapters.nnsight_remote.end_segment_context",
    "equivariance_probe.adapters.nnsight_remote.segment_sums_in_trace",
    "equivariance_probe.adapters.segments.segment_blocks_from_qk",
    "equivariance_probe.adapters.segments.segment_blocks",
    "equivariance_probe.adapters.segments.segment_block",
    "equivariance_probe.adapters.segments.sink_weights",
    "equivariance_probe.adapters.segments.hidden_keys",
    "equivariance_probe.adapters.segments.segment_rows",
    "equivariance_probe.adapters.segments.segment_log_probs",
    "equivariance_probe.statistics.engines.in_trace.attention_scores",
    "equivariance_probe.statistics.engines.in_trace.repeat_kv",
    "equivariance_probe.statistics.engines.shift_sums.counted_entries",
    "equivariance_probe.statistics.engines.shift_sums.segment_representations",
    "equivariance_probe.statistics.engines.shift_sums.add_to_cell",
    "equivariance_probe.statistics.engines.shift_sums.end_context_of_cell",
    "equivariance_probe.statistics.engines.shift_sums.grid_sums",
    "equivariance_probe.statistics.engines.shift_sums.new_prediction_sums",
    "equivariance_probe.statistics.engines.shift_sums.negentropy",
    "equivariance_probe.statistics.engines.shift_sums.next_token_distribution",
    "equivariance_probe.statistics.engines.shift_sums.middle_negentropy",
    "equivariance_probe.statistics.engines.shift_sums.jensen_shannon_from",
    "equivariance_probe.statistics.engines.shift_sums.prediction_log_probs",
    "equivariance_probe.statistics.engines.shift_sums.add_prediction_sums",
    "equivariance_probe.statistics.engines.shift_sums.new_component_state",
    "equivariance_probe.statistics.engines.shift_sums.add_component_to_state",
    "equivariance_probe.statistics.engines.shift_sums.end_context_of_components",
    "equivariance_probe.statistics.engines.shift_sums.component_grams",
    "equivariance_probe.statistics.engines.shift_sums.new_sink_sums",
    "equivariance_probe.statistics.engines.shift_sums.add_sink_sums",
    "equivariance_probe.statistics.engines.shift_sums.new_massive_sums",
    "equivariance_probe.statistics.engines.shift_sums.add_massive_sums",
)
#: The functions of the shift test's check of the recomputation, run on the server in one trace (by value).
SEGMENT_CHECK_FUNCTIONS = (
    "equivariance_probe.adapters.nnsight_remote.segment_check_in_trace",
    "equivariance_probe.adapters.segments.hidden_keys",
    "equivariance_probe.statistics.engines.in_trace.attention_scores",
    "equivariance_probe.statistics.engines.in_trace.repeat_kv",
)


#: The functions that run inside the trace, and so on the server (by value).
REMOTE_FUNCTIONS = (
    "equivariance_probe.adapters.nnsight_remote.outside_mass",
    "equivariance_probe.adapters.nnsight_remote.layer_pattern",
    "equivariance_probe.adapters.nnsight_remote.reduce_batch_in_trace",
    "equivariance_probe.statistics.engines.in_trace.attention_scores",
    "equivariance_probe.statistics.engines.in_trace.repeat_kv",
    "equivariance_probe.statistics.engines.in_trace.recompute_pattern",
    "equivariance_probe.statistics.engines.in_trace.visible_mask",
    "equivariance_probe.statistics.engines.in_trace.reduce_layer",
    "equivariance_probe.statistics.engines.in_trace.reduce_pattern",
    "equivariance_probe.statistics.engines.in_trace.entry_moments",
    "equivariance_probe.statistics.engines.in_trace.diagonal_sums",
    "equivariance_probe.statistics.engines.block_maths.row_moments",
    "equivariance_probe.statistics.engines.block_maths.toeplitz_r2_per_window",
)

#: Modules whose functions are shipped by value with a remote request.
REMOTE_MODULES = (
    "equivariance_probe.adapters.nnsight_remote",
    "equivariance_probe.adapters.segments",
    "equivariance_probe.statistics.engines.in_trace",
    "equivariance_probe.statistics.engines.block_maths",
    "equivariance_probe.statistics.engines.shift_sums",
)


# -- outside the trace: sizes, the API key, and failures ---------------------------------------
def reply_nbytes(n_layers: int, n_heads: int, n_positions: int, keep_pattern: bool = False, key_bins: int = KEY_BINS,
                 keep_first_key: bool = True, windows: int = 1) -> int:
    """Bytes of float64 sums one trace of ``windows`` windows sends back, from the shapes alone.

    ``8·(L·((5 + f)·H·T + 3·H + 1) + K·T + f·L·B·H)`` with ``K = min(T, key_bins)`` key bins, ``B`` the
    batch's windows and ``f = 1`` with ``keep_first_key`` (the first token's weights, summed over the batch
    and, ``L·B·H`` of them, per window for the per-window sink rate), plus ``8·L·H·T²`` with
    ``keep_pattern``; only the per-window weights grow with the batch. For comparison, the bf16 patterns
    of one window are ``2·L·H·T²`` bytes.
    """
    # Per layer, from the table of sums: H·W per row or lag sum, H·W² for the pattern, H per head sum, and the
    # outside mass; the key-lag sums once, summed over layers.
    kept = {"keep_first_key": keep_first_key, "keep_pattern": keep_pattern}
    cells = {"B H T": n_heads * n_positions, "B H D": n_heads * n_positions, "H T T": n_heads * n_positions**2}
    per_layer = sum(cells.get(entry.window, 0) for entry in STATISTICS.values()
                    if entry.kept_if is None or kept[entry.kept_if])
    per_layer += len(head_sums()) * n_heads + 1
    per_window = n_layers * n_heads * windows if keep_first_key else 0
    return 8 * (n_layers * per_layer + min(n_positions, key_bins) * n_positions + per_window)


def segment_reply_nbytes(n_layers: int, n_heads: int, n_offsets: int, predictions: bool = True,
                         hidden_size: int = 0, components: int = 0) -> int:
    """Bytes of float64 sums one segment's session sends back, from the shapes alone:
    ``8·(|DECOMPOSITION_SUMS|·L·(3·H + 1) + L·d + L·O·(2·H + 5) + predictions·(4·O + 2·O²) + 2·C²)`` (``d`` the
    residual stream's width, for its sums per hidden dimension; ``L·O·(2·H + 1)`` the sink sums and ``4·L·O`` the
    massive-activation sums; ``C`` the
    attribution's components, for its two Gram matrices), whatever the number of contexts, the segment's length,
    the window or the vocabulary."""
    n = len(DECOMPOSITION_SUMS) * n_layers * ((len(REPRESENTATIONS) - 1) * n_heads + 1) + n_layers * hidden_size
    n += n_layers * n_offsets * ((len(SINK_SUMS) - 1) * n_heads + 1 + len(MASSIVE_SUMS))
    n += len(ATTRIBUTION_GRAMS) * components**2
    if predictions:
        n += sum(n_offsets**rank for _, rank in PREDICTION_SUMS)
    return 8 * n


def api_key() -> str | None:
    """The NDIF API key nnsight would send: its config (``NDIF_API_KEY`` wins at import)."""
    try:
        from nnsight import CONFIG

        key = CONFIG.API.APIKEY
    except Exception:  # noqa: BLE001 - an nnsight without CONFIG: fall back to the variable
        key = None
    # Set after nnsight was imported, the variable is not in CONFIG yet; nnsight reads
    # CONFIG when it sends, so the adapter passes it on (see _trace_options).
    return key or os.environ.get("NDIF_API_KEY") or None


#: The host of NDIF's public service (nnsight's default ``CONFIG.API.HOST``).
PUBLIC_HOST = "api.ndif.us"


def is_public_host(host: str) -> bool:
    """Whether ``host`` (a URL) is NDIF's public service rather than a self-hosted server."""
    from urllib.parse import urlparse

    return (urlparse(host).hostname or host).endswith("ndif.us")


def configured_host() -> str:
    try:
        from nnsight import CONFIG

        return CONFIG.API.HOST
    except Exception:  # noqa: BLE001
        return "NDIF"


def is_remote_failure(error: BaseException) -> bool:
    """Whether ``error`` comes from talking to the server (not from our own code)."""
    if isinstance(error, (OSError, ConnectionError, TimeoutError)):
        return True
    module = type(error).__module__ or ""
    return module.split(".")[0] in ("nnsight", "httpx", "httpcore", "websocket", "huggingface_hub", "requests")


def is_source_failure(error: BaseException) -> bool:
    name = type(error).__name__
    return "SourceNotAvailable" in name or (isinstance(error, AttributeError) and ATTENTION_CALL in str(error))


def remote_failure_kind(error: BaseException) -> tuple[str | None, str]:
    """Which failure a remote user met, from nnsight's error and the server's words, and its fix.

    Returns ``(kind, fix)`` with ``kind`` one of ``"unreachable"``, ``"not_deployed"``,
    ``"timeout"``, ``"too_large"`` or ``None`` (anything else). The server's words are ndif's
    (0.1.x): ``exceeded the execution timeout``, ``Could not deploy this model``, and an
    object-store upload failing for a result over the inline (Redis pub/sub) cap.
    """
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
    lowered = text.lower()
    if "exceeded the execution timeout" in lowered:
        return "timeout", ("the server stopped the request at its execution timeout; send less per request "
                           "(a smaller batch_size or context_length), or ask the server for a longer timeout")
    if "could not deploy" in lowered or "not deployed" in lowered or "no gpu nodes" in lowered:
        return "not_deployed", ("the server does not run this model (not deployed, and it could not deploy it); "
                                "check nnsight.is_model_running(hub_id) or deploy it on your server (ndif deploy)")
    if "endpoint url" in lowered or "object store" in lowered or "objectstore" in lowered or "s3" in lowered.split():
        return "too_large", ("the reply was over the size the server returns inline (Redis pub/sub) and the "
                             "server could not stage it in its object store; keep_pattern=False, a shorter "
                             "context_length, or an object store on the server (NDIF_OBJECT_STORE_URL)")
    connect = ("connection refused", "connecterror", "connection reset", "remotedisconnected",
               "connectionclosed", "name or service not known", "failed to send request")
    if isinstance(error, (ConnectionError, OSError)) or any(word in lowered for word in connect):
        return "unreachable", ("the server cannot be reached (down, a wrong host, or the connection dropped); "
                               "check the host (nnsight.CONFIG.API.HOST or remote=URL) and the server status")
    return None, ""
