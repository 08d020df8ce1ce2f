"""The shift test's segment cuts, the same for every framework.

Place in the seams: *adapters*. The shift test (:func:`~equivariance_probe.features.segments.segment_pass`) runs
right-padded windows whose last ``m`` real tokens are a segment. Each framework's binder hands over what it exposes
at a site (queries and keys at transformers' attention call, directly or inside an nnsight trace, at ``"qk.{l}"``; a
TransformerBridge's pre-softmax ``hook_attn_scores`` at ``"scores.{l}"``), and the functions here cut the
segment's part out of it, so that every framework gives the statistics the same tensors; they are torch alone, so
that a remote nnsight session runs them too:

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

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..statistics.engines.in_trace import attention_scores
from ..statistics.engines.shift_sums import PREDICTION_CHUNK
from ..errors import AttentionCaptureError
from .internals import AttentionCall, AttentionScores
from .modules import is_causal_lm

__all__ = ["Spans", "check_predicts", "segment_spans", "shifted_position_ids", "block_difference", "judged_recompute_check",
           "segment_block", "hidden_keys", "sink_weights", "segment_blocks", "segment_blocks_at",
           "segment_blocks_from_call", "segment_blocks_from_qk", "segment_rows", "segment_measure", "kept_positions", "segment_log_probs"]

#: ``(start, length)`` of each window's segment: positions ``start .. length − 1``.
Spans = Sequence[tuple[int, int]]


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


def segment_blocks_at(value: AttentionCall | AttentionScores, spans: Spans, window: int | None, causal: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`segment_blocks` of what a pass hands over at site ``"qk.{l}"`` (an attention call's queries and keys:
    :func:`segment_blocks_from_call`) or ``"scores.{l}"`` (scores a framework formed itself: their rows)."""
    if isinstance(value, AttentionScores):
        return segment_blocks([value.rows(b, start, length) for b, (start, length) in enumerate(spans)], spans,
                              window, causal)
    return segment_blocks_from_call(value, spans, window, causal)


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


def segment_measure(measure: Callable[[torch.Tensor], torch.Tensor], spans: Spans
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A plan's ``reduce``: ``measure`` of each window's segment rows of ``hidden: [batch, T, width]``, stacked
    ``[batch, ...]``. Torch alone, so that it runs where the model runs (a remote request ships it by value)."""
    def reduce(hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([measure(hidden[b, start:length]) for b, (start, length) in enumerate(spans)])
    return reduce


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
