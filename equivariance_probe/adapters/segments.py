"""The shift test's segment capture, cut the same way by every adapter that runs it.

Place in the seams: *adapters*. :meth:`~equivariance_probe.adapters.base.Adapter.run_segment` runs right-padded
windows whose last ``m`` real tokens are a segment. Each adapter reads what its framework exposes (queries and keys
at transformers' attention call, directly or inside an nnsight trace; a TransformerBridge's pre-softmax
``hook_attn_scores``), and the functions here cut the segment's part out of it, so that every framework hands
the statistics the same tensors:

* the segment block of one layer's attention, ``scores: [batch, head, m, m]``, and each segment row's
  ``log_normaliser: [batch, head, m]``, the log-sum-exp over every key the row sees in its window (prefix,
  context and segment), taken under the layer's real mask (causal or not, sliding window);
* each segment row's attention weight on the text before the segment, ``sink: [batch, head, m, 2]``
  (:func:`sink_weights`): on the window's first key and on the rest of the text before the segment, under
  the same mask;
* the residual stream at the segment, ``[batch, m, d]``;
* for the attribution, the components that write into it (:mod:`~equivariance_probe.adapters.components`) at the
  segment, ``[batch, m, d]`` each, read from the modules :func:`~equivariance_probe.adapters.components.block_parts`
  finds (or the framework's hooks on the same tensors);
* the next-token log-probabilities at the segment, ``[batch, m, vocab]``, from logits that cover only the last
  :func:`kept_positions` positions of the batch (transformers' ``logits_to_keep``), so the projection to the
  vocabulary runs on the stretch from the earliest segment to the end, not on the whole window.

A window ``b`` is described by its span ``(start, length)``: the segment is positions ``start .. length − 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..statistics.engines.in_trace import attention_scores
from ..statistics.engines.shift_sums import PREDICTION_CHUNK, segment_representations
from ..statistics.shift import patch_parts
from ..errors import AttentionCaptureError
from .components import ComponentRequest, HeadPieces, block_input, output_tensor, parse_piece
from .base import SegmentBatch
from .internals import AttentionCall
from .modules import is_causal_lm

__all__ = ["check_predicts", "segment_spans", "shifted_position_ids", "block_difference", "judged_recompute_check", "segment_block", "hidden_keys", "sink_weights", "segment_blocks", "segment_blocks_from_call", "segment_blocks_from_qk",
           "segment_rows",
           "kept_positions", "segment_log_probs", "capture_segment_batch", "capture_segment_grid", "HeadsCheck",
           "hook_components", "touch_component", "component_toucher", "without_offset", "only_offset", "patched_components",
           "patch_segment_context"]

#: ``(start, length)`` of each window's segment: positions ``start .. length − 1``.
Spans = Sequence[tuple[int, int]]


def capture_segment_grid(adapter: Any, contexts: Sequence[Sequence[Any]], grid: Any, entries: Sequence[torch.Tensor],
                         targets: torch.Tensor | None) -> None:
    """Run one segment's whole grid here, context by context, into ``grid`` (a
    :class:`~equivariance_probe.statistics.shift.SegmentGrid`): what
    :meth:`~equivariance_probe.adapters.base.Adapter.segment_grid_sums` does where the model runs.

    Args:
        adapter: the model's adapter.
        contexts: per context, the forward passes that cover every offset
            (:class:`~equivariance_probe.adapters.base.SegmentBatch`).
        grid: the segment's running sums (``add``, ``add_predictions``, ``add_sink``, ``end_context``).
        entries: per layer, the ``[m, m]`` entries that count.
        targets: ``[m − 1]`` the segment's own next tokens, or ``None`` to measure no predictions.
    """
    config = grid.config
    components = config.components
    reference = config.patch_reference
    patched = patched_components(config.patch_components)
    for context in contexts:
        for batch in context:
            capture_segment_batch(adapter, batch, config.segment_length, entries, grid.add, targets=targets,
                                  add_predictions=grid.add_predictions, add_sink=grid.add_sink, components=components,
                                  add_component=grid.add_component if components else None,
                                  on_heads_difference=grid.add_heads_difference if components else None)
        if patched:
            window = next(only_offset(batch, reference) for batch in context if reference in batch.offset_indices)
            captured: dict[str, torch.Tensor] = {}  # each patched component's output at the segment, reference window
            adapter.run_segment(window.tokens, window.lengths, config.segment_length,
                                position_start=window.position_start, capture=patched,
                                on_capture=lambda name, values: captured.__setitem__(name, values[0]))
            patch_segment_context(adapter, context, grid, captured, targets)
        grid.end_context()


def patched_components(items: Sequence[str]) -> tuple[str, ...]:
    """Every component of the patched ``items`` once, in order of first mention."""
    return tuple(dict.fromkeys(name for item in items for name in patch_parts(item)))


def patch_segment_context(adapter: Any, context: Sequence[Any], grid: Any, captured: dict[str, torch.Tensor],
                          targets: torch.Tensor | None) -> None:
    """Activation patching of one context, after its clean windows: for each patched item, the context's windows
    at every offset but the reference, each batch as the clean run batched them less the reference window, run
    with the item's components replaced at the segment by ``captured`` (their outputs in the reference window);
    the patched predictions and last-block residual stream go to ``grid.add_patched``.

    Args:
        adapter: the model's adapter (:meth:`~equivariance_probe.adapters.base.Adapter.run_segment`'s ``patch``).
        context: the context's :class:`~equivariance_probe.adapters.base.SegmentBatch` es.
        grid: the segment's :class:`~equivariance_probe.statistics.shift.SegmentGrid`.
        captured: ``{component: [m, d]}`` (``[m, head_dim]`` for a head) at the reference offset.
        targets: ``[m − 1]`` the segment's own next tokens, or ``None`` to measure no predictions.
    """
    config = grid.config
    last = config.n_layers - 1
    for batch in context:
        rest = without_offset(batch, config.patch_reference)
        if rest is None:
            continue
        size = len(rest.offset_indices)
        for item, components in enumerate(config.patch_components):
            patch = {name: captured[name].expand(size, *captured[name].shape) for name in patch_parts(components)}
            residual: list[torch.Tensor] = []  # the last block's: the only one the patched sums read

            def keep_last(layer: int, hidden: torch.Tensor) -> None:
                if layer == last:
                    residual.append(hidden)

            log_probs = adapter.run_segment(rest.tokens, rest.lengths, config.segment_length, on_residual=keep_last,
                                            position_start=rest.position_start, predictions=targets is not None,
                                            patch=patch)
            for b, index in enumerate(rest.offset_indices):
                grid.add_patched(item, index, None if log_probs is None else log_probs[b, :-1], residual[-1][b])


def only_offset(batch: SegmentBatch, offset_index: int) -> SegmentBatch:
    """``batch``'s window at ``offset_index`` alone, its padding cut: the reference window whose components
    activation patching captures, in a pass of its own (so that the clean pass, and the attribution read in it,
    runs as it does without patching)."""
    return _rows_of(batch, [batch.offset_indices.index(offset_index)])


def without_offset(batch: SegmentBatch, offset_index: int) -> SegmentBatch | None:
    """``batch`` without its window at ``offset_index`` (``None`` if nothing is left), its padding cut to the
    longest window left."""
    keep = [b for b, index in enumerate(batch.offset_indices) if index != offset_index]
    if not keep:
        return None
    return batch if len(keep) == len(batch.offset_indices) else _rows_of(batch, keep)


def _rows_of(batch: SegmentBatch, keep: Sequence[int]) -> SegmentBatch:
    """The windows ``keep`` (row indices) of ``batch``, their padding cut to the longest of them."""
    rows = torch.tensor(keep)
    lengths = batch.lengths[rows]
    return SegmentBatch(batch.tokens[rows, : int(lengths.max())], lengths,
                        tuple(batch.offset_indices[b] for b in keep),
                        None if batch.position_start is None else batch.position_start[rows])


def touch_component(hidden: torch.Tensor, spans: Spans, name: str, columns: slice | None = None, *,
                    on_capture: Callable[[str, torch.Tensor], None] | None = None,
                    values: torch.Tensor | None = None) -> torch.Tensor:
    """Read and/or replace, in place, one component's output at each window's segment: what every adapter's
    ``capture`` and ``patch`` do at the tensor its framework exposes.

    Args:
        hidden: ``[batch, T, width]`` the component's output (for a head, the output projection's input).
        spans: each window's segment.
        name: the component (handed to ``on_capture``).
        columns: the head's columns of ``hidden`` (``None``: all).
        on_capture: called as ``on_capture(name, [batch, m, width'])`` with the segment's rows, before any replacement.
        values: ``[batch, m, width']`` written over the segment's rows.

    Returns:
        ``hidden`` (replaced in place).
    """
    part = hidden if columns is None else hidden[..., columns]
    if on_capture is not None:
        on_capture(name, segment_rows(part, spans))
    if values is not None:
        for b, (start, length) in enumerate(spans):
            part[b, start:length] = values[b].to(device=part.device, dtype=part.dtype)
    return hidden


def component_toucher(spans: Spans, capture: Sequence[str], on_capture: Callable[[str, torch.Tensor], None] | None,
                      patch: Mapping[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``touch(name, hidden, columns=None)``: :func:`touch_component` of component ``name`` in one pass, which
    captures it (where it is in ``capture``) and writes ``patch``'s values for it (where ``patch`` holds it): how
    every adapter binds a pass's ``capture``, ``on_capture`` and ``patch``."""
    def touch(name: str, hidden: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
        return touch_component(hidden, spans, name, columns, on_capture=on_capture if name in capture else None,
                               values=patch.get(name))

    return touch


def capture_segment_batch(adapter: Any, batch: Any, segment_length: int, entries: Sequence[torch.Tensor],
                          add: Callable[[str, int, int, torch.Tensor], None], *,
                          targets: torch.Tensor | None = None,
                          add_predictions: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                          add_sink: Callable[[int, int, torch.Tensor], None] | None = None,
                          components: Sequence[str] = (),
                          add_component: Callable[[str, int, torch.Tensor], None] | None = None,
                          on_heads_difference: Callable[[float], None] | None = None) -> None:
    """Run one forward pass of a segment's grid and hand over what the shift test measures of each window.

    The one capture loop of the shift test: the probe's run (into a
    :class:`~equivariance_probe.statistics.shift.SegmentGrid`) and the report's view of one head
    (:func:`~equivariance_probe.display.shift.shift_view`) both read the segment's representations through it.

    Args:
        adapter: the model's adapter (its :meth:`~equivariance_probe.adapters.base.Adapter.run_segment`).
        batch: a :class:`~equivariance_probe.adapters.base.SegmentBatch`.
        segment_length: ``m``.
        entries: per layer, the ``[m, m]`` entries that count
            (:func:`~equivariance_probe.statistics.shift.segment_entries`).
        add: called as ``add(representation, layer, offset_index, values)`` with ``values: [head, E]`` for every
            attention representation (:func:`~equivariance_probe.statistics.engines.shift_sums.segment_representations`)
            and ``[1, m·d]`` for the residual stream after each block.
        targets: ``[m − 1]`` the segment's own next tokens, or ``None`` to measure no predictions.
        add_predictions: called as ``add_predictions(offset_index, log_probs[m − 1, vocab], targets)`` per window.
        add_sink: called as ``add_sink(layer, offset_index, sink[head, m, 2])`` per window and layer: each segment
            row's weight on the window's first key and on the rest of the text before the segment
            (:func:`sink_weights`).
        components: the attribution's components (names of :mod:`~equivariance_probe.adapters.components`).
        add_component: called as ``add_component(name, offset_index, values[m, d])`` for each of ``components``.
        on_heads_difference: called with :meth:`HeadsCheck.difference` per forward pass, where heads are read.
    """
    indices = batch.offset_indices

    def on_attention(layer: int, scores: torch.Tensor, log_normaliser: torch.Tensor, sink: torch.Tensor) -> None:
        for b, index in enumerate(indices):
            for name, values in segment_representations(scores[b], log_normaliser[b], entries[layer]).items():
                add(name, layer, index, values)
            if add_sink is not None:
                add_sink(layer, index, sink[b])

    def on_residual(layer: int, hidden: torch.Tensor) -> None:
        for b, index in enumerate(indices):
            add("residual", layer, index, hidden[b].reshape(1, -1))

    options: dict[str, Any] = {}
    check = HeadsCheck(ComponentRequest.of(components).heads)
    if components and add_component is not None:
        declared = frozenset(components)

        def on_component(name: str, values: torch.Tensor) -> None:
            check.add(name, values)
            if name in declared:
                for b, index in enumerate(indices):
                    add_component(name, index, values[b])

        options = {"components": tuple(components), "on_component": on_component}
    log_probs = adapter.run_segment(batch.tokens, batch.lengths, segment_length, on_attention=on_attention,
                                    on_residual=on_residual, position_start=batch.position_start,
                                    predictions=targets is not None, **options)
    if options and on_heads_difference is not None and check.layers:
        on_heads_difference(check.difference())
    if targets is not None and add_predictions is not None:
        for b, index in enumerate(indices):
            add_predictions(index, log_probs[b, :-1], targets)


def hook_components(parts: Sequence[Any], n_heads: int, components: Sequence[str], spans: Spans,
                    on_component: Callable[[str, torch.Tensor], None]) -> list[Any]:
    """Register PyTorch hooks that hand ``on_component(name, values[batch, m, d])`` the attribution's components at
    the segment's tokens; returns the handles (remove them after the forward pass).

    The modules are :func:`~equivariance_probe.adapters.components.block_parts`' ``parts``: the embedding is block 0's
    input (a forward pre-hook with keywords), each attention's and MLP's output that of ``attention_out`` and
    ``mlp_out`` (the post-norms where the block has them), and a head's piece is formed from the output
    projection's input (a forward pre-hook) once the attention's output is known (:class:`HeadPieces`)."""
    request = ComponentRequest.of(components)
    heads = HeadPieces(parts, n_heads, request.heads, on_component)
    handles = []
    if request.embedding:
        def on_embedding(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            on_component("embedding", segment_rows(block_input(args, kwargs), spans))

        handles.append(parts[0].layer.register_forward_pre_hook(on_embedding, with_kwargs=True))

    def make_hook(name: str, layer: int, with_heads: bool):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if with_heads:
                heads.attention_output(layer, segment_rows(args[0], spans) if parts[layer].post_norms else None)
            on_component(name, segment_rows(output_tensor(output), spans))
        return hook

    def make_projection_hook(layer: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            heads.projection_input(layer, segment_rows(args[0], spans))
        return hook

    for layer in sorted(set(request.blocks) | set(request.heads)):
        part = parts[layer]
        handles.append(part.attention_out.register_forward_hook(
            make_hook(f"attention.{layer}", layer, layer in request.heads)))
        handles.append(part.mlp_out.register_forward_hook(make_hook(f"mlp.{layer}", layer, False)))
        if layer in request.heads:
            handles.append(part.projection.register_forward_pre_hook(make_projection_hook(layer)))
    return handles


class HeadsCheck:
    """Do the heads' pieces and the projection's bias add up to the attention's output? Per layer of ``layers``, the
    sum of what one forward pass handed over as ``"head.{l}.{h}"`` and ``"bias.{l}"`` against ``"attention.{l}"``."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = tuple(layers)
        self._sums: dict[int, torch.Tensor] = {}
        self._attention: dict[int, torch.Tensor] = {}

    def add(self, name: str, values: torch.Tensor) -> None:
        kind, layer, _ = parse_piece(name)
        if layer not in self.layers:
            return
        if kind == "attention":
            self._attention[layer] = values.detach().to(torch.float64)
        elif kind in ("head", "bias"):
            self._sums[layer] = self._sums.get(layer, 0) + values.detach().to(torch.float64)

    def difference(self) -> float:
        """``max |Σ_h piece_h + bias − attention| / max |attention|`` over the layers (NaN where a layer's attention
        or heads were not both seen)."""
        worst = 0.0
        for layer in self.layers:
            if layer not in self._sums or layer not in self._attention:
                return float("nan")
            attention = self._attention[layer]
            scale = float(attention.abs().max()) or 1.0
            worst = max(worst, float((self._sums[layer] - attention).abs().max()) / scale)
        return worst


def check_predicts(model: torch.nn.Module, causal: bool = True) -> None:
    """Raise :class:`~equivariance_probe.errors.AttentionCaptureError` unless ``model`` (a ``transformers`` model)
    is a causal language model with its head, which the shift test's ``predictions`` need."""
    if not (causal and is_causal_lm(model)):
        raise AttentionCaptureError(
            f"{type(model).__name__} is not a causal language model, so it makes no next-token predictions; run the "
            "shift test with predictions=False")


def segment_spans(lengths: torch.Tensor, segment_length: int) -> list[tuple[int, int]]:
    """``[(lengths[b] − m, lengths[b])]`` for right-padded windows of ``lengths: [batch]`` real tokens."""
    return [(int(length) - int(segment_length), int(length)) for length in lengths.tolist()]


def shifted_position_ids(position_start: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, width]`` position ids ``position_start[b] + 0 .. width − 1``: the shift test's ``"position_ids"``
    mode, where window ``b``'s first token sits at position ``position_start[b]``."""
    return position_start.view(-1, 1).to(torch.long) + torch.arange(width).view(1, -1)


def segment_block(scores: torch.Tensor, start: int, window: int | None, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One window's segment block from ``scores: [head, m, length]``, its segment rows' pre-softmax scores against
    every key of the window (entries the mask hides may hold anything, ``−inf`` included).

    Returns:
        ``(block [head, m, m], log_normaliser [head, m], sink [head, m, 2])``: the scores among the segment's own
        tokens; ``log Σ_k exp(score_ik)`` over the keys ``k`` that row ``i`` (position ``start + i``) sees:
        ``k ≤ start + i`` for a causal model, every key for an encoder, and ``|start + i − k| < window`` under a
        sliding window; and the row's attention weight on the text before the segment (:func:`sink_weights`).
    """
    length = scores.shape[-1]
    hidden = hidden_keys(start, length, window, causal, scores.device)
    log_normaliser = torch.logsumexp(scores.masked_fill(hidden, float("-inf")), -1)
    return scores[..., start:length], log_normaliser, sink_weights(scores, log_normaliser, hidden, start)


def sink_weights(scores: torch.Tensor, log_normaliser: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """``[head, m, 2]`` float64: each segment row's attention weight on the window's first key (position 0) and on
    the rest of the text before the segment (positions ``1 .. start − 1``), ``a_ik = exp(score_ik −
    log_normaliser_i)`` summed over those keys that the layer's mask shows it.

    Position 0 is the tokenizer's prefix token (BOS) where there is one, else the context's first token; a key the
    mask hides weighs 0 (under a sliding window ``w``, rows ``w`` or more positions after it). A window whose
    segment starts at position 0 has no text before it: both weights are 0.

    Args:
        scores: ``[head, m, length]`` the segment rows' scores against every key of the window.
        log_normaliser: ``[head, m]`` each row's log-sum-exp over the keys it sees.
        hidden: ``[m, length]`` the keys the mask hides (:func:`hidden_keys`).
        start: the segment's first position.
    """
    before = scores[..., :start].to(torch.float64) - log_normaliser.to(torch.float64).unsqueeze(-1)
    weights = torch.exp(before.masked_fill(hidden[:, :start], float("-inf")))  # [head, m, start]
    return torch.stack([weights[..., :1].sum(-1), weights[..., 1:].sum(-1)], -1)


def hidden_keys(start: int, length: int, window: int | None, causal: bool, device: torch.device) -> torch.Tensor:
    """``[length − start, length]`` boolean: the keys the layer's mask hides from the segment rows ``start .. length − 1``
    of a window of ``length`` tokens (later keys for a causal model; keys ``window`` or more away under a sliding
    window)."""
    position = torch.arange(start, length, device=device).view(-1, 1)
    key = torch.arange(length, device=device).view(1, -1)
    hidden = (key > position) if causal else torch.zeros_like(key > position)
    if window is not None:
        hidden = hidden | ((position - key).abs() >= window)
    return hidden


def block_difference(weights: torch.Tensor, own: torch.Tensor, window: int | None, causal: bool) -> float:
    """Largest ``|weights − own|`` over a segment block ``[head, m, m]``: ``weights`` derived from the captured
    scores (``exp(score − log_normaliser)``), ``own`` the model's. Entries the layer's mask hides count as 0 in
    ``weights``, so a mask other than the one the layout reports shows as a difference."""
    offset = torch.arange(own.shape[-1]).view(-1, 1) - torch.arange(own.shape[-1]).view(1, -1)
    visible = (offset >= 0) if causal else torch.ones_like(offset, dtype=torch.bool)
    if window is not None:
        visible &= offset.abs() < window
    return float((weights.masked_fill(~visible.to(weights.device), 0.0) - own.to(weights.dtype)).abs().max())


def judged_recompute_check(largest: float, tolerance: float, tokens: int, compared: str) -> dict[str, Any]:
    """``{"max_difference", "tolerance", "tokens", "passed", "compared"}`` of a passed check of the segment block's
    recomputation (``compared``: what was compared with what).

    Raises:
        AttentionCaptureError: ``largest`` is over ``tolerance`` (or NaN): the model's attention is not
            ``softmax(mask(softcap(q·kᵀ·scaling)))`` alone (ALiBi biases, sink logits), so the shift test's scores
            would be wrong.
    """
    if not largest <= tolerance:
        raise AttentionCaptureError(
            f"the segment block's weights recomputed from queries and keys differ from the model's own attention by up "
            f"to {largest:.3g} (tolerance {tolerance:g}; compared: {compared}): its attention is not softmax(mask("
            "softcap(q·kᵀ·scaling))) alone (ALiBi biases, sink logits, or a custom attention), which the shift test "
            "cannot read")
    return {"tokens": tokens, "tolerance": tolerance, "max_difference": largest, "passed": True, "compared": compared}


def segment_blocks(rows: Sequence[torch.Tensor], spans: Spans, window: int | None, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`segment_block` of each window, stacked: ``rows[b]: [head, m, length_b]`` (``spans[b]``), returns
    ``(scores [batch, head, m, m], log_normaliser [batch, head, m], sink [batch, head, m, 2])``."""
    blocks, normalisers, sinks = zip(*(segment_block(scores, start, window, causal)
                                       for scores, (start, _) in zip(rows, spans)))
    return torch.stack(blocks), torch.stack(normalisers), torch.stack(sinks)


def segment_blocks_from_call(call: AttentionCall, spans: Spans, window: int | None, causal: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`segment_blocks_from_qk` of one attention call's queries and keys."""
    return segment_blocks_from_qk(call.query, call.key, call.scaling, call.softcap, spans, window, causal)


def segment_blocks_from_qk(query: torch.Tensor, key: torch.Tensor, scaling: float | None, softcap: float | None,
                           spans: Spans, window: int | None, causal: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`segment_blocks` from queries ``[batch, head, T, d]`` and keys ``[batch, kv_head, T, d]``: the scores
    are ``softcap(q·kᵀ·scaling)`` in float32 (float64 for a float64 model,
    :func:`~equivariance_probe.statistics.engines.in_trace.attention_scores`), computed for the segment's
    queries only. Torch alone: it also runs inside a remote nnsight trace."""
    rows = [attention_scores(query[b : b + 1, :, start:length], key[b : b + 1, :, :length], scaling, softcap)[0]
            for b, (start, length) in enumerate(spans)]
    return segment_blocks(rows, spans, window, causal)


def segment_rows(hidden: torch.Tensor, spans: Spans) -> torch.Tensor:
    """``[batch, m, d]``: each window's segment positions of ``hidden: [batch, T, d]``, detached."""
    return torch.stack([hidden[b, start:length].detach() for b, (start, length) in enumerate(spans)])


def kept_positions(spans: Spans, width: int) -> int:
    """How many last positions of a batch of ``width`` tokens hold every window's segment: the
    ``logits_to_keep`` that spares the projection to the vocabulary the rest."""
    return width - min(start for start, _ in spans)


def segment_log_probs(logits: torch.Tensor, spans: Spans, width: int) -> torch.Tensor:
    """``[batch, m, vocab]`` next-token log-probabilities at each window's segment, in float32 (float64 for a
    float64 model), from ``logits: [batch, keep, vocab]`` for the batch's last ``keep`` positions of ``width``.

    Float32 and float64 logits are turned into log-probabilities *in place* (``logit − logsumexp``): the caller
    hands over the model's output, which nothing reads afterwards, and a Gemma-sized segment's logits are
    67 MB, so a copy would add that much to the run's peak memory (and so would ``logsumexp``'s own
    temporary over a whole segment, hence ``PREDICTION_CHUNK`` positions at a time). Lower precisions are
    converted first."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.detach().to(dtype)
    first = width - logits.shape[1]
    rows = [logits[b, start - first : length - first] for b, (start, length) in enumerate(spans)]
    for row in rows:  # a few positions at a time: logsumexp's own temporary is as large as its input
        for chunk in row.split(PREDICTION_CHUNK):
            chunk.sub_(torch.logsumexp(chunk, -1, keepdim=True))
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)
