"""The TransformerLens site binder: a :class:`~equivariance_probe.adapters.plan.Plan` run through a
TransformerBridge's own hook points, in one ``run_with_hooks`` pass.

Place in the seams: *adapters*. Each site is one hook point (:data:`SITE_HOOKS`; the components' hooks are the
bridge adapter's :meth:`~equivariance_probe.adapters.transformer_lens.TransformerBridgeAdapter.component_hook`).
The numbers are the bridge's own: its attention components compute the scores themselves, so ``"qk.{l}"`` (the
call of transformers' attention function) does not exist here, nor do the ablations, which act on that call
and on the Hugging Face model's position modules; both are refused before any pass.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AttentionCaptureError
from .components import head_columns
from .plan import Plan, apply
from .sites import Site

__all__ = ["SITE_HOOKS", "run_bridge_plan", "bridge_hook"]

#: The bridge's hook point of each site kind that is not a component of the residual stream.
SITE_HOOKS = {"embedding": "blocks.0.hook_resid_pre", "resid": "blocks.{layer}.hook_resid_post",
              "attention_module": "blocks.{layer}.attn.hook_out",
              "weights": "blocks.{layer}.attn.hook_pattern", "final": "unembed.hook_in", "logits": "unembed.hook_out"}


class _Stopped(Exception):
    """Raised from a hook to end the pass at a plan's :class:`~equivariance_probe.adapters.plan.Stop`."""


def bridge_hook(adapter: Any, site: Site) -> tuple[str, int | None]:
    """``(hook point, head)`` of ``site`` on the bridge ``adapter.model``.

    Raises:
        AttentionCaptureError: ``"qk.{l}"`` (the bridge replaces the attention modules), or a hook point the
            bridge lacks.
    """
    if site.kind == "qk":
        raise AttentionCaptureError(
            f"site {site.name!r}: the TransformerBridge replaces the attention modules with its own, which bypass "
            "transformers' attention functions, so the queries and keys as that call receives them do not exist "
            "here; run the Hugging Face model inside (bridge.original_model) or an nnsight model")
    if site.kind in ("attention", "mlp", "head"):
        return adapter.component_hook(site.name)
    name = SITE_HOOKS[site.kind].format(layer=site.layer)
    if name not in adapter.model.hook_dict:
        raise AttentionCaptureError(f"this TransformerBridge has no hook point {name!r} for site {site.name!r}; "
                                    "run the Hugging Face model itself (framework huggingface)")
    return name, None


def check_bridge_plan(adapter: Any, plan: Plan) -> None:
    """Refuse, before any pass, what the bridge cannot bind: an ablation, ``"qk.{l}"``, a missing hook point.

    Raises:
        AttentionCaptureError: naming the site or the ablation.
    """
    if plan.ablation:
        raise AttentionCaptureError(
            f"ablation {'+'.join(plan.ablation)!r} acts on transformers' attention call and position modules, which "
            "the TransformerBridge replaces with its own; run the Hugging Face model inside (bridge.original_model), "
            "or an nnsight model, for ablations")
    for site in plan.sites():
        bridge_hook(adapter, site)


def run_bridge_plan(adapter: Any, tokens: torch.Tensor, plan: Plan) -> dict[str, Any]:
    """Run ``tokens: [batch, T]`` through the bridge ``adapter.model`` under ``plan``, without gradients.

    Returns:
        ``{"ablation": ()}`` (nothing was ablated).
    """
    check_bridge_plan(adapter, plan)
    hooks = []
    for site in plan.sites():
        name, head = bridge_hook(adapter, site)
        hooks.append((name, _hook(plan, site, head, adapter.layout.n_heads)))
    with adapter._eval(), torch.no_grad():
        try:
            adapter.model.run_with_hooks(tokens.to(adapter.device), return_type=None, fwd_hooks=hooks)
        except _Stopped:
            pass
    return {"ablation": ()}


def _hook(plan: Plan, site: Site, head: int | None, n_heads: int) -> Any:
    actions = plan.actions(site)
    rows = plan.last_position_logits and site.kind in ("final", "logits")

    def hook(value: torch.Tensor, hook: Any) -> torch.Tensor | None:
        if head is not None and value.dim() == 4:  # [batch, position, head, head_dim] (Gemma 3's bridge)
            part, columns = value[:, :, head], None
        else:
            columns = None if head is None else head_columns(value.shape[-1], n_heads, head)
            part = value if columns is None else value[..., columns]
        new, replaced, stop = apply(actions, part, head_rows=rows)
        if replaced:
            value = value.clone()
            if head is not None and value.dim() == 4:
                value[:, :, head] = new
            elif columns is not None:
                value[..., columns] = new
            else:
                value = new
        if stop:
            raise _Stopped
        return value if replaced else None

    return hook
