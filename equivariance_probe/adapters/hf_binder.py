"""The Hugging Face site binder: a :class:`~equivariance_probe.adapters.plan.Plan` run on a ``transformers`` model.

Place in the seams: *adapters* (the only code that registers hooks). Each site of the grammar
(:mod:`~equivariance_probe.adapters.sites`) is found once among the model's modules:

* ``"embedding"``: block 0's input (a forward pre-hook); ``"resid.{l}"``: block ``l``'s output;
  ``"attention_module.{l}"``: the output of its attention module (as every adapter finds it:
  :func:`~equivariance_probe.adapters.modules.find_attention_modules`);
* ``"attention.{l}"``, ``"mlp.{l}"``, ``"head.{l}.{h}"``: the outputs of
  :func:`~equivariance_probe.adapters.components.block_parts`' modules, and the head's columns of the output
  projection's input;
* ``"pieces.{l}"``: the output projection's input and (under a post-norm) the norm's input, handed over as a
  :class:`~equivariance_probe.adapters.components.HeadWrites` when the attention's output is known;
* ``"qk.{l}"``, ``"weights.{l}"``: the attention call, intercepted by
  :func:`~equivariance_probe.adapters.internals.ablate` (eager attention for the pass, as weights need), or, in a
  plan that asks for the model's own kernel, by
  :func:`~equivariance_probe.adapters.internals.intercept_attention` around that kernel;
* ``"final"``: the language-model head's input; ``"logits"``: the model's own logits (after any final soft cap).

A plan without ``"final"`` or ``"logits"`` runs the base model (no head), as the analyses always have.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..errors import AttentionCaptureError
from .components import (HeadWrites, block_input, block_parts, head_columns, output_tensor, post_norms_of,
                         with_output_tensor)
from .internals import AttentionCall, ablate, intercept_attention
from .modules import find_attention_modules, parent_layer
from .plan import Plan, apply
from .sites import Site

__all__ = ["run_hf_plan", "check_hf_plan", "intercepted_calls", "Stopped"]


class Stopped(Exception):
    """Raised from a hook to end the forward pass at a plan's :class:`~equivariance_probe.adapters.plan.Stop`."""


#: Site kinds found among :func:`~equivariance_probe.adapters.components.block_parts`' modules.
PART_KINDS = frozenset({"attention", "mlp", "head", "pieces"})


def check_hf_plan(model: Any, plan: Plan) -> list | None:
    """Refuse, before any pass, a plan that ``model`` cannot run: the head's sites on a model without a
    language-model head, or a block it cannot split into components.

    Returns:
        The model's :func:`~equivariance_probe.adapters.components.block_parts` where the plan's sites need them,
        else ``None``.

    Raises:
        AttentionCaptureError: the reason, naming the site.
    """
    if plan.needs_head() and model.get_output_embeddings() is None:
        raise AttentionCaptureError(
            f"{type(model).__name__} has no language-model head, so the plan's 'final'/'logits' sites do not exist; "
            "load the model with AutoModelForCausalLM")
    return block_parts(model) if plan.kinds() & PART_KINDS else None


def run_hf_plan(model: Any, tokens: torch.Tensor, plan: Plan, *, n_heads: int, modules: list | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Run ``tokens: [batch, T]`` through ``model`` (in eval mode, put back as it was) under ``plan``, without
    gradients, with ``position_ids`` and an ``attention_mask`` where given; ``modules``: the attention modules in
    layer order where the caller has found them once (else found here).

    Returns:
        What the ablation recorded (:func:`~equivariance_probe.adapters.internals.ablate`'s dict: how often the
        ablated modules ran), ``{"ablation": ()}`` without interception.
    """
    parts = check_hf_plan(model, plan)
    handles = []
    modules = modules if modules is not None else find_attention_modules(model)
    layers = [parent_layer(model, module) for module in modules]
    writes = _WritesOf(parts, plan, n_heads) if "pieces" in plan.kinds() else None
    was_training = model.training
    try:
        for site in plan.sites():
            if site.kind not in ("qk", "weights", "logits"):
                handles += _hooks(model, modules, layers, parts, writes, site, plan, n_heads)
        model.eval()
        with torch.no_grad(), intercepted_calls(model, plan, modules) as record:
            try:
                _forward(model, tokens, plan, position_ids, attention_mask)
            except Stopped:
                pass
        return record
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


class _WritesOf:
    """The :class:`~equivariance_probe.adapters.components.HeadWrites` of a pass: each ``"pieces.{l}"`` layer's
    output-projection input, kept from its pre-hook until the attention's output is known."""

    def __init__(self, parts: Any, plan: Plan, n_heads: int) -> None:
        layers = [site.layer for site in plan.sites() if site.kind == "pieces"]
        self.parts, self.n_heads, self.norms = parts, n_heads, post_norms_of(parts, layers)
        self.z: dict[int, torch.Tensor] = {}

    def keep(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.z[layer] = args[0]
        return hook

    def of(self, layer: int, attention_args: tuple) -> HeadWrites:
        part = self.parts[layer]
        return HeadWrites(layer, self.z.pop(layer), attention_args[0] if part.post_norms else None, part.projection,
                          self.norms.get(layer), self.n_heads)


def _hooks(model: Any, modules: list, layers: list, parts: Any, writes: _WritesOf | None, site: Site, plan: Plan,
           n_heads: int) -> list[Any]:
    """The hook handles that run ``plan``'s actions at ``site``."""
    actions = plan.actions(site)
    rows = plan.logits_kept if site.kind == "final" else 0

    def after(value: Any) -> Any:
        value, replaced, stop = apply(actions, value, head_rows=rows)
        if stop:
            raise Stopped
        return value if replaced else None

    if site.kind == "embedding":
        return [layers[0].register_forward_pre_hook(_input_hook(after), with_kwargs=True)]
    if site.kind == "resid":
        return [layers[site.layer].register_forward_hook(_output_hook(after))]
    if site.kind == "attention_module":
        return [modules[site.layer].register_forward_hook(_output_hook(after))]
    if site.kind in ("attention", "mlp"):
        part = parts[site.layer]
        return [(part.attention_out if site.kind == "attention" else part.mlp_out).register_forward_hook(
            _output_hook(after))]
    if site.kind == "head":
        return [parts[site.layer].projection.register_forward_pre_hook(_head_hook(after, site.head, n_heads))]
    if site.kind == "pieces":
        def on_attention(module: torch.nn.Module, args: tuple, output: Any) -> None:
            after(writes.of(site.layer, args))
        return [parts[site.layer].projection.register_forward_pre_hook(writes.keep(site.layer)),
                parts[site.layer].attention_out.register_forward_hook(on_attention)]
    return [model.get_output_embeddings().register_forward_pre_hook(_input_hook(after), with_kwargs=True)]


def _output_hook(after: Callable[[Any], Any]) -> Callable:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        new = after(output_tensor(output))
        return None if new is None else with_output_tensor(output, new)
    return hook


def _input_hook(after: Callable[[Any], Any]) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        new = after(block_input(args, kwargs))
        if new is None:
            return None
        return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})
    return hook


def _head_hook(after: Callable[[Any], Any], head: int, n_heads: int) -> Callable:
    def hook(module: torch.nn.Module, args: tuple) -> Any:
        z = args[0]
        columns = head_columns(z.shape[-1], n_heads, head)
        new = after(z[..., columns])
        if new is None:
            return None
        z = z.clone()
        z[..., columns] = new
        return (z, *args[1:])
    return hook


@contextlib.contextmanager
def intercepted_calls(model: Any, plan: Plan, modules: list | None = None):
    """The attention calls of ``model`` intercepted where the plan reads them (``"qk.{l}"``, ``"weights.{l}"``) or
    an ablation is in force, else nothing; a :class:`~equivariance_probe.adapters.plan.Stop` there raises
    :class:`Stopped`. Under the plan's ``own_kernel`` the model runs its own attention kernel and only its inputs
    are read (``modules``: the attention modules in layer order). Yields
    :func:`~equivariance_probe.adapters.internals.ablate`'s record."""
    calls = [site for site in plan.sites() if site.kind in ("qk", "weights")]
    if not calls and not plan.ablation:
        yield {"ablation": ()}
        return
    by_layer = {(site.kind, site.layer): plan.actions(site) for site in calls}

    def on_call(call: AttentionCall) -> None:
        stop = False
        if ("qk", call.layer) in by_layer:
            stop |= apply(by_layer[("qk", call.layer)], call)[2]
        if ("weights", call.layer) in by_layer and call.weights is not None:
            stop |= apply(by_layer[("weights", call.layer)], call.weights)[2]
        if stop:
            raise Stopped

    if plan.own_kernel:
        with intercept_attention(model, on_call, eager=False, layers=modules):
            yield {"ablation": ()}
        return
    keep = any(site.kind == "weights" for site in calls)
    with ablate(model, "+".join(plan.ablation) or None, on_call if calls else None, keep_weights=keep) as record:
        yield record


def _forward(model: Any, tokens: torch.Tensor, plan: Plan, position_ids: torch.Tensor | None,
             attention_mask: torch.Tensor | None) -> None:
    """The base model's pass, or the whole model's where the plan needs its head (the last
    :attr:`~equivariance_probe.adapters.plan.Plan.logits_kept` positions only where the plan asks and the model
    takes ``logits_to_keep``); the actions at ``"logits"`` run on the model's own logits."""
    device = next(model.parameters()).device
    inputs = {"input_ids": tokens.to(device), "use_cache": False}
    if position_ids is not None:
        inputs["position_ids"] = position_ids.to(device)
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask.to(device)
    if not plan.needs_head():
        model.base_model(**inputs)
        return
    if plan.logits_kept and "logits_to_keep" in inspect.signature(model.forward).parameters:
        inputs["logits_to_keep"] = plan.logits_kept
    logits = model(**inputs).logits
    actions = plan.actions(Site("logits"))
    if actions and apply(actions, logits, head_rows=plan.logits_kept)[2]:
        raise Stopped
