"""The shift test's forward passes, as plans of named sites: one pass over windows whose last ``m`` real tokens are
a segment, and the loop that runs a segment's whole grid through it.

Place in the seams: *features*, above the adapters. :func:`segment_pass` says what the shift test reads of one pass
as a :class:`~equivariance_probe.adapters.plan.Plan` (:mod:`~equivariance_probe.adapters.sites`):

* each layer's attention at ``"qk.{l}"`` (the queries and keys the attention call receives, read around the model's
  own kernel) or, on a framework that forms its scores itself, ``"scores.{l}"``; the segment block, its row
  normalisers and the rows' weights on the text before the segment are cut from either the same way
  (:func:`~equivariance_probe.adapters.segments.segment_blocks_at`);
* the residual stream after each block at ``"resid.{l}"``;
* the attribution's components at ``"embedding"``, ``"attention.{l}"``, ``"mlp.{l}"``, and the heads' pieces at
  ``"pieces.{l}"`` (formed on the segment's rows);
* activation patching's components read and replaced at their own sites (a head: ``"head.{l}.{h}"``, its columns
  of the output projection's input), on the segment's rows only;
* the next-token log-probabilities from ``"logits"``, the head projecting only the last
  :func:`~equivariance_probe.adapters.segments.kept_positions` positions.

Each framework's binder finds these sites once; nothing here names a framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..adapters.base import SegmentBatch
from ..adapters.passes import check_layers_seen, encoder_mask
from ..adapters.components import ComponentRequest, parse_piece
from ..adapters.plan import Read, Replace, Stop
from ..adapters.segments import (Spans, kept_positions, segment_blocks_at, segment_log_probs, segment_rows,
                                 segment_spans, shifted_position_ids)
from ..errors import AttentionCaptureError
from ..statistics.engines.shift_sums import segment_representations
from ..statistics.shift import patch_parts

__all__ = ["segment_pass", "segment_steps", "capture_segment_grid", "capture_segment_batch", "read_mechanisms",
           "patch_segment_context",
           "patched_components", "only_offset", "without_offset", "HeadsCheck"]

#: ``(site, action)`` pairs that a caller adds to a segment pass, given each window's segment (:data:`Spans`).
MoreSteps = Callable[[Spans], Sequence[tuple[str, Any]]]


def segment_pass(adapter: Any, tokens: torch.Tensor, lengths: torch.Tensor, segment_length: int, *,
                 on_attention: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
                 on_residual: Callable[[int, torch.Tensor], None] | None = None,
                 position_start: torch.Tensor | None = None, predictions: bool = False,
                 components: Sequence[str] = (), on_component: Callable[[str, torch.Tensor], None] | None = None,
                 capture: Sequence[str] = (), on_capture: Callable[[str, torch.Tensor], None] | None = None,
                 patch: Mapping[str, torch.Tensor] | None = None, more: MoreSteps | None = None
                 ) -> torch.Tensor | None:
    """Run right-padded windows whose last ``segment_length`` real tokens are a segment, in one pass under a plan.

    Args:
        adapter: the model's adapter.
        tokens: ``[batch, T]`` token ids; window ``b`` has ``lengths[b]`` real tokens, and the segment is its
            positions ``lengths[b] − m .. lengths[b] − 1``.
        lengths: ``[batch]`` real tokens per window.
        segment_length: ``m``.
        on_attention: called once per layer as ``on_attention(layer, scores [batch, head, m, m], log_normaliser
            [batch, head, m], sink [batch, head, m, 2])``, computed in float32 (float64 for a float64 model), so that
            no weight underflows (``None``: attention is not read, as in activation patching's passes).
        on_residual: called once per layer with the residual stream after the block at the segment ``[batch, m, d]``.
        position_start: ``[batch]`` the first position id of each window (``None``: 0): the ``"position_ids"``
            mode of the shift test.
        predictions: also return the next-token log-probabilities at the segment.
        components: the attribution's components to read (names of :mod:`~equivariance_probe.adapters.components`;
            heads of a layer are read together).
        on_component: called with each of them at the segment ``[batch, m, d]``, and with ``"bias.{l}"`` where heads
            of layer ``l`` are read and its output projection has a bias.
        capture: components whose outputs at the segment go to ``on_capture(name, [batch, m, width])`` as ``patch``
            takes them back (a head: its columns of the output projection's input): activation patching's reference.
        on_capture: see ``capture``.
        patch: ``{component: [batch, m, width]}``: those components' outputs at each window's segment replaced with
            the given values; every position outside the segment, and every other component, runs as it would.
        more: ``more(spans)`` gives further ``(site, action)`` pairs to run in the same pass (a mechanism's reads).

    Returns:
        ``[batch, m, vocab]`` float32 (float64 for a float64 model) log-probabilities of the next token at each
        segment position, or ``None`` without ``predictions``.

    Raises:
        AttentionCaptureError: ``predictions`` on a model that makes none (an encoder, or no language-model head),
            or a pass that did not hand over every layer's attention.
    """
    layout = adapter.layout
    if predictions and not layout.causal:
        raise AttentionCaptureError(
            f"{adapter.model_name} is not a causal language model, so it makes no next-token predictions; run the "
            "shift test with predictions=False")
    spans = segment_spans(lengths, segment_length)
    width = int(tokens.shape[1])
    seen: list[int] = []
    kept: dict[str, torch.Tensor] = {}
    steps = segment_steps(adapter, spans, on_attention=on_attention, on_residual=on_residual, seen=seen,
                          components=components, on_component=on_component, capture=capture, on_capture=on_capture,
                          patch=patch or {})
    if predictions:
        steps.append(("logits", Read(lambda logits: kept.__setitem__("log_probs",
                                                                       segment_log_probs(logits, spans, width)))))
    else:
        steps.append((f"resid.{layout.n_layers - 1}", Stop()))  # nothing after the last block is read
    if more is not None:
        steps += list(more(spans))
    plan = adapter.plan(steps, logits_kept=kept_positions(spans, width) if predictions else 0,
                        own_kernel=adapter.score_site == "qk")
    adapter.run_plan(tokens, plan, position_ids=None if position_start is None
                     else shifted_position_ids(position_start, width),
                     attention_mask=encoder_mask(adapter, tokens, lengths))
    if on_attention is not None:
        check_layers_seen(adapter, sorted(set(seen)))
    return kept.get("log_probs")


def segment_steps(adapter: Any, spans: Spans, *, on_attention: Any = None, on_residual: Any = None,
                  seen: list[int] | None = None, components: Sequence[str] = (), on_component: Any = None,
                  capture: Sequence[str] = (), on_capture: Any = None,
                  patch: Mapping[str, torch.Tensor] | None = None) -> list[tuple[str, Any]]:
    """The ``(site, action)`` pairs of :func:`segment_pass` but its predictions and its stop (arguments as there;
    ``seen`` collects the layers whose attention was read)."""
    layout = adapter.layout
    steps: list[tuple[str, Any]] = []
    if on_attention is not None:
        def read_attention(value: Any) -> None:
            on_attention(value.layer, *segment_blocks_at(value, spans, layout.sliding_windows[value.layer],
                                                         layout.causal))
            if seen is not None:
                seen.append(value.layer)

        steps += [(f"{adapter.score_site}.{layer}", Read(read_attention)) for layer in range(layout.n_layers)]
    if on_residual is not None:
        steps += [(f"resid.{layer}", Read(_rows_to(on_residual, layer, spans))) for layer in range(layout.n_layers)]
    if components and on_component is not None:
        steps += _component_steps(components, spans, on_component, layout.n_heads)
    patch = patch or {}
    for name in dict.fromkeys([*capture, *patch]):
        if name in capture and on_capture is not None:
            steps.append((name, Read(lambda value, name=name: on_capture(name, segment_rows(value, spans)))))
        if name in patch:
            steps.append((name, Replace(_segment_writer(patch[name], spans))))
    return steps


def _rows_to(on_residual: Callable[[int, torch.Tensor], None], layer: int, spans: Spans) -> Callable:
    return lambda hidden: on_residual(layer, segment_rows(hidden, spans))


def _component_steps(components: Sequence[str], spans: Spans, on_component: Callable[[str, torch.Tensor], None],
                     n_heads: int) -> list[tuple[str, Any]]:
    """The attribution's reads: the embedding, each named layer's attention and MLP, and its heads' pieces (on the
    segment's rows, before the attention's own output, as the pass shows them)."""
    request = ComponentRequest.of(components)

    def read(name: str) -> Read:
        return Read(lambda value: on_component(name, segment_rows(value, spans)))

    def pieces(layer: int) -> Read:
        def split(writes: Any) -> None:
            values, bias = writes.pieces(lambda tensor: segment_rows(tensor, spans))
            for head in range(n_heads):
                on_component(f"head.{layer}.{head}", values[..., head, :])
            if bias is not None:
                on_component(f"bias.{layer}", bias)
        return Read(split)

    steps: list[tuple[str, Any]] = [("embedding", read("embedding"))] if request.embedding else []
    for layer in sorted(set(request.blocks) | set(request.heads)):
        if layer in request.heads:
            steps.append((f"pieces.{layer}", pieces(layer)))
        steps += [(f"attention.{layer}", read(f"attention.{layer}")), (f"mlp.{layer}", read(f"mlp.{layer}"))]
    return steps


def _segment_writer(values: torch.Tensor, spans: Spans) -> Callable[[torch.Tensor], torch.Tensor]:
    """A replacement that writes ``values: [batch, m, width]`` over each window's segment rows, in place, and leaves
    every other position as it was."""
    def write(hidden: torch.Tensor) -> torch.Tensor:
        for b, (start, length) in enumerate(spans):
            hidden[b, start:length] = values[b].to(device=hidden.device, dtype=hidden.dtype)
        return hidden
    return write


def capture_segment_grid(adapter: Any, contexts: Sequence[Sequence[Any]], grid: Any, entries: Sequence[torch.Tensor],
                         targets: torch.Tensor | None, mechanisms: Any = None) -> None:
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
        mechanisms: a :class:`~equivariance_probe.features.mechanisms.MechanismSums` read in the same passes, or
            ``None``.
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
                                  on_heads_difference=grid.add_heads_difference if components else None,
                                  more=None if mechanisms is None else mechanisms.steps(batch.offset_indices))
        if patched:
            window = next(only_offset(batch, reference) for batch in context if reference in batch.offset_indices)
            captured: dict[str, torch.Tensor] = {}  # each patched component's output at the segment, reference window
            segment_pass(adapter, window.tokens, window.lengths, config.segment_length,
                         position_start=window.position_start, capture=patched,
                         on_capture=lambda name, values: captured.__setitem__(name, values[0]))
            patch_segment_context(adapter, context, grid, captured, targets)
        grid.end_context()


def read_mechanisms(adapter: Any, contexts: Sequence[Sequence[Any]], segment_length: int, mechanisms: Any) -> None:
    """Read ``mechanisms`` (a :class:`~equivariance_probe.features.mechanisms.MechanismSums`) in passes of their own
    over a segment's grid: on a model whose grid is summed where it runs, the mechanisms' measures run there too (a
    plan's ``reduce``), one request per batch."""
    for context in contexts:
        for batch in context:
            segment_pass(adapter, batch.tokens, batch.lengths, segment_length, position_start=batch.position_start,
                         more=mechanisms.steps(batch.offset_indices))


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
        adapter: the model's adapter (:func:`segment_pass`'s ``patch``).
        context: the context's :class:`~equivariance_probe.adapters.base.SegmentBatch` es.
        grid: the segment's :class:`~equivariance_probe.statistics.shift.SegmentGrid`.
        captured: ``{component: [m, d]}`` (``[m, head_dim]`` for a head) at the reference offset.
        targets: ``[m − 1]`` the segment's own next tokens, or ``None`` to measure no predictions.
        mechanisms: a :class:`~equivariance_probe.features.mechanisms.MechanismSums` read in the same passes, or
            ``None``.
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

            log_probs = segment_pass(adapter, rest.tokens, rest.lengths, config.segment_length, on_residual=keep_last,
                                     position_start=rest.position_start, predictions=targets is not None, patch=patch)
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


def capture_segment_batch(adapter: Any, batch: Any, segment_length: int, entries: Sequence[torch.Tensor],
                          add: Callable[[str, int, int, torch.Tensor], None], *,
                          targets: torch.Tensor | None = None,
                          add_predictions: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                          add_sink: Callable[[int, int, torch.Tensor], None] | None = None,
                          components: Sequence[str] = (),
                          add_component: Callable[[str, int, torch.Tensor], None] | None = None,
                          on_heads_difference: Callable[[float], None] | None = None,
                          more: MoreSteps | None = None) -> None:
    """Run one forward pass of a segment's grid and hand over what the shift test measures of each window.

    The one capture loop of the shift test: the probe's run (into a
    :class:`~equivariance_probe.statistics.shift.SegmentGrid`) and the report's view of one head
    (:func:`~equivariance_probe.display.shift.shift_view`) both read the segment's representations through it.

    Args:
        adapter: the model's adapter.
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
        more: further reads of the same pass (:func:`segment_pass`).
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
    log_probs = segment_pass(adapter, batch.tokens, batch.lengths, segment_length, on_attention=on_attention,
                             on_residual=on_residual, position_start=batch.position_start,
                             predictions=targets is not None, more=more, **options)
    if options and on_heads_difference is not None and check.layers:
        on_heads_difference(check.difference())
    if targets is not None and add_predictions is not None:
        for b, index in enumerate(indices):
            add_predictions(index, log_probs[b, :-1], targets)


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


