"""The HookedTransformer site binder: a :class:`~equivariance_probe.adapters.plan.Plan` run through a TransformerLens
``HookedTransformer``'s hook points (TransformerLens 2.x, and 3.9's, which SAELens' ``HookedSAETransformer`` extends),
in one ``run_with_hooks`` pass.

Place in the seams: *adapters*. Each site is one hook point (:data:`HOOKED_SITES`); the hooks run the plan's
actions as the bridge's binder does (:mod:`~equivariance_probe.adapters.tl_binder`). A ``HookedTransformer``
computes attention itself, from its own weights (no transformers module inside), so there is no attention call
(``"qk.{l}"``), no output-projection module to split a block's attention by head (``"pieces.{l}"``), no
``attention_module`` distinct from the attention's output, and no ablation; its forward takes no position ids.
Each of these is refused before any pass, by name.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AttentionCaptureError
from .internals import AttentionScores
from .plan import Plan, apply
from .sites import Site
from .tl_binder import _hook, _Stopped, run_with_hooks

__all__ = ["HOOKED_SITES", "check_hooked_plan", "run_hooked_plan"]

#: The hook point of each site kind on a ``HookedTransformer`` (``"logits"`` is what ``run_with_hooks`` returns).
HOOKED_SITES = {"embedding": "blocks.0.hook_resid_pre", "resid": "blocks.{layer}.hook_resid_post",
                "attention": "blocks.{layer}.hook_attn_out", "mlp": "blocks.{layer}.hook_mlp_out",
                "head": "blocks.{layer}.attn.hook_z", "scores": "blocks.{layer}.attn.hook_attn_scores",
                "weights": "blocks.{layer}.attn.hook_pattern", "final": "ln_final.hook_normalized"}


def check_hooked_plan(adapter: Any, plan: Plan, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> None:
    """Refuse, before any pass, what a ``HookedTransformer`` cannot bind.

    Raises:
        AttentionCaptureError: an ablation, position ids, an attention mask, or a site it does not have, named.
    """
    fix = "load the model as a Hugging Face model or a TransformerBridge (TransformerLens 4), which give it"
    if plan.ablation:
        raise AttentionCaptureError(f"ablation {'+'.join(plan.ablation)!r} acts on transformers' attention call and "
                                    f"position modules, which a HookedTransformer does not have; {fix}")
    if position_ids is not None or attention_mask is not None:
        raise AttentionCaptureError("a HookedTransformer's forward takes no position ids or attention mask (the "
                                    f"shift test's position_ids mode, an encoder); {fix}")
    for site in plan.sites():
        if site.kind != "logits" and site.kind not in HOOKED_SITES:
            raise AttentionCaptureError(f"site {site.name!r} does not exist on a HookedTransformer, which computes "
                                        f"attention from its own weights; {fix}")
        name = HOOKED_SITES.get(site.kind, "").format(layer=site.layer)
        if site.kind != "logits" and name not in adapter.model.hook_dict:
            raise AttentionCaptureError(f"this HookedTransformer has no hook point {name!r} for site {site.name!r}")


def run_hooked_plan(adapter: Any, tokens: torch.Tensor, plan: Plan, *, position_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Run ``tokens: [batch, T]`` through ``adapter.model`` under ``plan``, without gradients.

    Returns:
        ``{"ablation": ()}`` (nothing was ablated).
    """
    check_hooked_plan(adapter, plan, position_ids, attention_mask)
    hooks = []
    for site in plan.sites():
        if site.kind == "logits":
            continue
        name = HOOKED_SITES[site.kind].format(layer=site.layer)
        hooks.append((name, _scores(adapter, plan, site) if site.kind == "scores"
                      else _hook(plan, site, site.head, adapter.layout.n_heads)))
    return run_with_hooks(adapter, tokens, plan, hooks)


def _scores(adapter: Any, plan: Plan, site: Site) -> Any:
    """The hook on ``hook_attn_scores`` (pre-softmax, masked entries ``−inf``) that hands the plan an
    :class:`~equivariance_probe.adapters.internals.AttentionScores`."""
    actions = plan.actions(site)

    def rows(scores: torch.Tensor, b: int, start: int, length: int) -> torch.Tensor:
        dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
        return scores[b, :, start:length, :length].detach().to(dtype)

    def hook(scores: torch.Tensor, hook: Any) -> None:
        value = AttentionScores(site.layer, scores, lambda b, start, length: rows(scores, b, start, length))
        if apply(actions, value)[2]:
            raise _Stopped

    return hook
