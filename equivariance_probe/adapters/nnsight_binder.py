"""The nnsight site binder: a :class:`~equivariance_probe.adapters.plan.Plan` run in one local trace.

Place in the seams: *adapters*. The tensor sites are envoys of the modules the Hugging Face binder hooks (the
wrapped model's own module tree), read and assigned inside ``model.trace`` in the order the forward pass reaches
them: ``"embedding"`` is block 0's input, ``"resid.{l}"`` block ``l``'s output, ``"attention_module.{l}"`` its
attention module's output, ``"attention.{l}"`` and
``"mlp.{l}"`` the outputs of :func:`~equivariance_probe.adapters.components.block_parts`' modules,
``"head.{l}.{h}"`` the head's columns of the output projection's input, ``"pieces.{l}"`` that input with the
post-norm's input where the block has one (a :class:`~equivariance_probe.adapters.components.HeadWrites`),
``"final"`` the head's input and ``"logits"`` the trace's own logits. The attention call (``"qk.{l}"``, ``"weights.{l}"``) and the ablations are the Hugging Face
interception of the wrapped model (:func:`~equivariance_probe.adapters.internals.ablate`), which runs inside the
trace, so both frameworks hand a feature the same call, mask included. On a remote model a plan reads sites in one
trace, each read reduced on the server (:func:`_run_remote`; ``"qk.{l}"`` is the attention call's inputs read there,
:func:`~equivariance_probe.adapters.nnsight_remote.attention_call_in_trace`); replacements and ablations are refused
before any request.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import RemoteExecutionError
from .components import (HeadWrites, block_input, block_parts, head_columns, output_tensor, post_norms_of,
                         with_output_tensor)
from .hf_binder import PART_KINDS, Stopped, check_hf_plan, intercepted_calls
from .nnsight_remote import read_sites_in_trace
from .plan import Plan, Read, Replace, Stop, apply
from .sites import Site

__all__ = ["run_nnsight_plan", "check_nnsight_plan"]


def check_nnsight_plan(adapter: Any, plan: Plan) -> list | None:
    """Refuse, before any pass, a plan the nnsight model cannot run here.

    Returns:
        The wrapped model's block parts where the plan's sites need them (as
        :func:`~equivariance_probe.adapters.hf_binder.check_hf_plan`).

    Raises:
        RemoteExecutionError: on a remote model, an ablation, a replacement, ``"pieces.{l}"`` (formed with the
            output projection's weights, which stay on the server), or a read of ``"qk.{l}"`` without a
            ``reduce`` (a remote request reads sites and reduces them where the model runs; it does not change the
            model, and a layer's queries and keys do not travel whole; ``"weights.{l}"`` is recomputed there from
            them).
        AttentionCaptureError: as :func:`~equivariance_probe.adapters.hf_binder.check_hf_plan`.
    """
    parts = check_hf_plan(adapter.hf_model, plan)
    if not adapter.remote:
        return parts
    if plan.ablation:
        raise RemoteExecutionError(
            f"ablation {'+'.join(plan.ablation)!r} changes the model's modules, which a remote model's server "
            "does not let a request do; run the analysis on a local nnsight model (remote=False) or the Hugging "
            "Face model")
    for site in plan.sites():
        if site.kind == "pieces":
            raise RemoteExecutionError(
                f"site {site.name!r} is formed with the output projection's weights, which a remote model keeps on "
                f"its server (remote={adapter.remote!r}); read 'attention.<l>' remotely, or run the heads on a local "
                "nnsight model (remote=False) or the Hugging Face model")
    for site, action in plan.steps:
        if isinstance(action, Replace):
            raise RemoteExecutionError(
                f"a remote model's plan (remote={adapter.remote!r}) reads sites only; {type(action).__name__} "
                f"at site {site.name!r} needs the model here: run the analysis on a local nnsight model (remote=False) or the Hugging "
                "Face model")
        if site.kind == "qk" and isinstance(action, Read) and action.reduce is None:
            raise RemoteExecutionError(
                f"a remote model's plan (remote={adapter.remote!r}) reads site {site.name!r} (every query and key of "
                "the layer) only through a reduce that runs on the server: give Read(fn, reduce=...), a torch-only "
                "function of the attention call that returns what fn needs, or run the analysis on a local nnsight "
                "model (remote=False) or the Hugging Face model")


def run_nnsight_plan(adapter: Any, tokens: torch.Tensor, plan: Plan, *, position_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Run ``tokens: [batch, T]`` through the nnsight model ``adapter.model`` under ``plan``, without gradients,
    ``position_ids`` and an ``attention_mask`` passed to the trace where given.

    Returns:
        What the ablation recorded, as :func:`~equivariance_probe.adapters.hf_binder.run_hf_plan`.
    """
    parts = check_nnsight_plan(adapter, plan)
    if adapter.remote:
        return _run_remote(adapter, tokens, plan, _trace_inputs(adapter.hf_model, plan, position_ids, attention_mask,
                                                                 "cpu"))
    hf = adapter.hf_model
    paths = {id(module): name for name, module in hf.named_modules()}
    envoys = _EnvoysOf(adapter, paths, parts)
    if "pieces" in plan.kinds():
        envoys.norms = post_norms_of(parts, [site.layer for site in plan.sites() if site.kind == "pieces"])
    options = _trace_inputs(hf, plan, position_ids, attention_mask, adapter.device)
    sites = [site for site in plan.sites() if site.kind not in ("qk", "weights", "logits")]
    logits = plan.actions(Site("logits"))
    with adapter._local_run("recompute"), intercepted_calls(hf, plan, adapter._hf.attention_modules) as record:
        try:
            with adapter.model.trace(tokens.to(adapter.device), **options) as tracer:
                stopped = False
                for site in sites:
                    if _visit(envoys, site, plan, adapter.layout.n_heads):
                        stopped = True
                        tracer.stop()
                        break
                if logits and not stopped:
                    apply(logits, adapter.model.output.logits, head_rows=plan.logits_kept)
        except Stopped:
            pass
    return record


def _trace_inputs(hf: Any, plan: Plan, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                  device: Any) -> dict[str, Any]:
    """The keyword inputs of a local trace: the position ids, the attention mask, and ``logits_to_keep`` where the
    plan keeps the last positions only and the model takes it."""
    options: dict[str, Any] = {"use_cache": False}
    if position_ids is not None:
        options["position_ids"] = position_ids.to(device)
    if attention_mask is not None:
        options["attention_mask"] = attention_mask.to(device)
    if plan.needs_head() and plan.logits_kept and "logits_to_keep" in inspect.signature(hf.forward).parameters:
        options["logits_to_keep"] = plan.logits_kept
    return options


class _EnvoysOf:
    """The envoys of a plan's sites."""

    def __init__(self, adapter: Any, paths: dict[int, str], parts: Any) -> None:
        self.adapter, self.paths, self.parts = adapter, paths, parts
        #: ``(w_eff, ε)`` of each ``"pieces.{l}"`` layer's post-norm, read before the trace.
        self.norms: dict[int, Any] = {}

    def of(self, module: torch.nn.Module) -> Any:
        return self.adapter.model.get(self.paths[id(module)])

    def layer(self, index: int) -> Any:
        return self.adapter.model.get(self.adapter.layer_paths[index])

    def attention(self, index: int) -> Any:
        return self.adapter.model.get(self.adapter.attention_paths[index])

    def head(self) -> Any:
        return self.of(self.adapter.hf_model.get_output_embeddings())


def _run_remote(adapter: Any, tokens: torch.Tensor, plan: Plan, options: dict[str, Any]) -> dict[str, Any]:
    """A plan of reads in one remote trace: each read's ``reduce`` runs on the server
    (:func:`~equivariance_probe.adapters.nnsight_remote.read_sites_in_trace`), only what it returns comes back, and
    each ``fn`` is called here with it; the trace stops after the last read (or the plan's first stop)."""
    import nnsight

    hf = adapter.hf_model
    paths = {id(module): name for name, module in hf.named_modules()}
    envoys = _EnvoysOf(adapter, paths, block_parts(hf) if plan.kinds() & PART_KINDS else None)
    reads, fns = [], []
    for site in plan.sites():
        actions = plan.actions(site)
        kept = [action for action in actions if isinstance(action, Read)]
        envoy, place, columns = _place(envoys, site, adapter.layout.n_heads)
        if kept:
            reads.append((envoy, place, columns, plan.logits_kept == 1 and site.kind in ("final", "logits"),
                          [action.reduce for action in kept]))
            fns.append([action.fn for action in kept])
        if any(isinstance(action, Stop) for action in actions):
            break
    options = {**options, **adapter._trace_options()}
    values = None
    with adapter._translate_errors("recompute"), adapter._shipped_by_value():
        # The block reads only these locals, the shipped function and nnsight.
        with adapter.model.trace(tokens, **options) as tracer:
            values = read_sites_in_trace(reads)
            nnsight.save(values)
            tracer.stop()
    if not isinstance(values, list) or len(values) != len(fns):
        raise RemoteExecutionError(f"the remote trace returned no reads (got {type(values).__name__}); run again; "
                                   "if it persists, report it with nnsight's version")
    for site_fns, site_values in zip(fns, values):
        for fn, value in zip(site_fns, site_values):
            fn(value)
    return {"ablation": ()}


def _place(envoys: _EnvoysOf, site: Site, n_heads: int) -> tuple[Any, Any, tuple[int, int] | None]:
    """``(envoy, place, (start, stop) columns or None)`` of a site read remotely
    (:func:`~equivariance_probe.adapters.nnsight_remote.read_sites_in_trace`)."""
    if site.kind in ("embedding", "final"):
        return (envoys.layer(0) if site.kind == "embedding" else envoys.head()), "input", None
    if site.kind == "head":
        projection = envoys.parts[site.layer].projection
        width = getattr(projection, "in_features", None) or getattr(projection, "nx", None)
        columns = head_columns(int(width), n_heads, site.head)
        return envoys.of(projection), "input", (columns.start, columns.stop)
    if site.kind in ("weights", "qk"):
        window = envoys.adapter.layout.sliding_windows[site.layer]
        return envoys.attention(site.layer), ("weights", window) if site.kind == "weights" else \
            ("call", site.layer, window), None
    if site.kind in ("resid", "attention_module"):
        return (envoys.layer if site.kind == "resid" else envoys.attention)(site.layer), "output", None
    if site.kind == "logits":
        return envoys.head(), "output", None
    part = envoys.parts[site.layer]
    return envoys.of(part.attention_out if site.kind == "attention" else part.mlp_out), "output", None


def _visit(envoys: _EnvoysOf, site: Site, plan: Plan, n_heads: int) -> bool:
    """Run the plan's actions at ``site`` inside the trace; whether to stop after it."""
    actions = plan.actions(site)
    rows = plan.logits_kept if site.kind == "final" else 0
    if site.kind == "pieces":
        part = envoys.parts[site.layer]
        z = envoys.of(part.projection).input
        norm_input = envoys.of(part.attention_out).input if part.post_norms else None
        return apply(actions, HeadWrites(site.layer, z, norm_input, part.projection, envoys.norms.get(site.layer),
                                         n_heads))[2]
    if site.kind in ("embedding", "final", "head"):
        envoy = envoys.layer(0) if site.kind == "embedding" else envoys.head() if site.kind == "final" \
            else envoys.of(envoys.parts[site.layer].projection)
        args, kwargs = envoy.inputs
        value = block_input(args, kwargs)
        columns = head_columns(value.shape[-1], n_heads, site.head) if site.kind == "head" else None
        new, replaced, stop = apply(actions, value if columns is None else value[..., columns], head_rows=rows)
        if replaced:
            if columns is not None:
                whole = value.clone()
                whole[..., columns] = new
                new = whole
            envoy.inputs = ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})
        return stop
    if site.kind == "resid":
        envoy = envoys.layer(site.layer)
    elif site.kind == "attention_module":
        envoy = envoys.attention(site.layer)
    elif site.kind == "logits":
        envoy = envoys.head()
    else:
        part = envoys.parts[site.layer]
        envoy = envoys.of(part.attention_out if site.kind == "attention" else part.mlp_out)
    output = envoy.output
    new, replaced, stop = apply(actions, output_tensor(output), head_rows=rows)
    if replaced:
        envoy.output = with_output_tensor(output, new)
    return stop
