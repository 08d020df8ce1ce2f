"""The passes every analysis of attention starts from, as plans: each layer's pattern, or each layer's attention
call, handed over in layer order.

Place in the seams: *adapters*. These are the two plans the main probe and its checks run on any framework whose
binder gives ``"weights.{l}"`` or ``"qk.{l}"`` (:meth:`~equivariance_probe.adapters.base.Adapter.run_plan`), so a
new framework's binder is all it needs for them; an adapter whose framework reduces attention elsewhere (a remote
model) overrides :meth:`~equivariance_probe.adapters.base.Adapter.run_statistics` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import AttentionCaptureError, RemoteExecutionError
from .plan import Read, Stop

__all__ = ["pattern_pass", "call_pass", "encoder_mask", "check_layers_seen"]


def encoder_mask(adapter: Any, tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor | None:
    """``[batch, T]`` the real tokens of right-padded windows for an encoder (``None`` for a causal model, whose real
    queries never see a padding key, or without ``lengths``)."""
    if adapter.layout.causal or lengths is None:
        return None
    return (torch.arange(tokens.shape[1]).view(1, -1) < lengths.cpu().view(-1, 1)).long()


def pattern_pass(adapter: Any, tokens: torch.Tensor, on_pattern: Callable[[int, torch.Tensor], None],
                 lengths: torch.Tensor | None = None) -> None:
    """Run ``tokens: [batch, T]`` and call ``on_pattern(layer, pattern [batch, head, query, key])`` with each layer's
    post-softmax weights while the pass runs (eager attention where the framework chooses the kernel), stopping
    after the last layer's; ``lengths: [batch]`` real tokens per window, which an encoder's mask needs.

    Raises:
        RemoteExecutionError: a model whose batches are requests to a server: its patterns stay there (the main
            probe reduces them there, :meth:`~equivariance_probe.adapters.base.Adapter.run_statistics`).
        AttentionCaptureError: a layer whose pattern was not handed over.
    """
    if adapter.requests is not None:
        raise RemoteExecutionError(
            "patterns of a remote model cannot be streamed here (they would be gigabytes per document); "
            "EquivarianceProbe.run reduces them on the server (run_statistics), or pass remote=False")
    seen: list[int] = []
    last = adapter.layout.n_layers - 1

    def read(layer: int) -> Read:
        def hand_over(pattern: torch.Tensor) -> None:
            seen.append(layer)
            on_pattern(layer, pattern)
        return Read(hand_over)

    steps: list[tuple[str, Any]] = [(f"weights.{layer}", read(layer)) for layer in range(last + 1)]
    adapter.run_plan(tokens, adapter.plan([*steps, (f"weights.{last}", Stop())]),
                     attention_mask=encoder_mask(adapter, tokens, lengths))
    check_layers_seen(adapter, seen)


def call_pass(adapter: Any, tokens: torch.Tensor, on_call: Callable[[Any], None], *, eager: bool = False,
              keep_weights: bool = False, lengths: torch.Tensor | None = None) -> None:
    """Run ``tokens: [batch, T]`` with every attention call read at ``"qk.{l}"``: ``on_call(call)`` with an
    :class:`~equivariance_probe.adapters.internals.AttentionCall` per layer (its queries and keys as the attention
    function receives them, its scaling and soft cap), keeping no gradients and stopping after the last layer's
    call (nothing after it is read).

    Args:
        eager: run eager attention (its weights exist); else the model's own kernel, whose inputs alone are read.
        keep_weights: hand over the weights eager attention computed (``call.weights``; needs ``eager``).
        lengths: ``[batch]`` real tokens per window, which an encoder's mask needs.

    Raises:
        AttentionCaptureError: a layer whose call was not seen (``on_call`` may raise to stop the pass early; the
            layers it let run are then the ones checked).
    """
    seen: list[int] = []

    def hand_over(call: Any) -> None:
        seen.append(call.layer)
        on_call(call)

    layers = range(adapter.layout.n_layers)
    steps: list[tuple[str, Any]] = [(f"qk.{layer}", Read(hand_over)) for layer in layers]
    if keep_weights:
        steps += [(f"weights.{layer}", Read(lambda weights: None)) for layer in layers]
    steps.append((f"qk.{layers[-1]}", Stop()))
    adapter.run_plan(tokens, adapter.plan(steps, own_kernel=not eager),
                     attention_mask=encoder_mask(adapter, tokens, lengths))
    check_layers_seen(adapter, sorted(set(seen)))


def check_layers_seen(adapter: Any, seen: Sequence[int]) -> None:
    """Raise :class:`~equivariance_probe.errors.AttentionCaptureError` unless a forward pass handed over every layer of
    ``adapter``'s model exactly once (``seen``: the layers it handed over), with the framework's fix."""
    expected = list(range(adapter.layout.n_layers))
    if sorted(seen) != expected:
        missing = sorted(set(expected) - set(seen))
        raise AttentionCaptureError(
            f"the {adapter.framework} adapter captured attention from layers {sorted(set(seen))} "
            f"but the model has {adapter.layout.n_layers} layers (missing: {missing}). " + adapter.capture_fix)
