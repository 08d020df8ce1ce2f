"""The TransformerLens site binder: a :class:`~equivariance_probe.adapters.plan.Plan` run through a
TransformerBridge's own hook points, in one ``run_with_hooks`` pass.

Place in the seams: *adapters*. Each site is one hook point (:data:`SITE_HOOKS`; the components' hooks are the
bridge adapter's :meth:`~equivariance_probe.adapters.transformer_lens.TransformerBridgeAdapter.component_hook`).
The numbers are the bridge's own: its attention components compute the scores themselves, so ``"qk.{l}"`` (the
call of transformers' attention function) does not exist here, nor do the ablations, which act on that call
and on the Hugging Face model's position modules; both are refused before any pass. The scores are
``"scores.{l}"`` instead (``hook_attn_scores``, an :class:`~equivariance_probe.adapters.internals.AttentionScores`);
``"pieces.{l}"`` is formed from ``attn.o.hook_in`` with the projection's weights, and the post-norm's input where
the block has one; ``"logits"`` is what ``run_with_hooks`` returns, for the last positions the plan keeps
(``logits_to_keep`` and ``position_ids`` go through the bridge to the Hugging Face model it runs).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AttentionCaptureError
from .components import HeadWrites, block_parts, head_columns, post_norms_of
from .internals import AttentionScores
from .plan import Plan, apply
from .sites import Site

__all__ = ["SITE_HOOKS", "run_bridge_plan", "bridge_hook"]

#: The bridge's hook point of each site kind that is not a component of the residual stream.
SITE_HOOKS = {"embedding": "blocks.0.hook_resid_pre", "resid": "blocks.{layer}.hook_resid_post",
              "attention_module": "blocks.{layer}.attn.hook_out",
              "scores": "blocks.{layer}.attn.hook_attn_scores", "weights": "blocks.{layer}.attn.hook_pattern",
              "final": "unembed.hook_in", "logits": "unembed.hook_out"}


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
    if site.kind == "pieces":
        return adapter.component_hook(f"head.{site.layer}.0")[0], None
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


def run_bridge_plan(adapter: Any, tokens: torch.Tensor, plan: Plan, *, position_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Run ``tokens: [batch, T]`` through the bridge ``adapter.model`` under ``plan``, without gradients.

    Returns:
        ``{"ablation": ()}`` (nothing was ablated).

    Raises:
        AttentionCaptureError: an ``attention_mask`` (the bridge runs causal decoders, which need none).
    """
    check_bridge_plan(adapter, plan)
    if attention_mask is not None:
        raise AttentionCaptureError("a TransformerBridge runs causal decoders, which take no attention mask here; "
                                    "run an encoder as a Hugging Face model")
    hooks = []
    for site in plan.sites():
        if site.kind == "scores":
            hooks.append((SITE_HOOKS["scores"].format(layer=site.layer), _scores_hook(adapter, plan, site)))
        elif site.kind == "pieces":
            hooks += _pieces_hooks(adapter, plan, site)
        elif site.kind != "logits":
            name, head = bridge_hook(adapter, site)
            hooks.append((name, _hook(plan, site, head, adapter.layout.n_heads)))
    options: dict[str, Any] = {"use_cache": False}
    if position_ids is not None:
        options["position_ids"] = position_ids.to(adapter.device)
    if plan.needs_head() and plan.logits_kept:
        options["logits_to_keep"] = plan.logits_kept
    logits_actions = plan.actions(Site("logits"))
    with adapter._eval(), torch.no_grad():
        try:
            logits = adapter.model.run_with_hooks(tokens.to(adapter.device), fwd_hooks=hooks,
                                                  return_type="logits" if logits_actions else None, **options)
            if logits_actions:
                apply(logits_actions, logits, head_rows=plan.logits_kept)
        except _Stopped:
            pass
    return {"ablation": ()}


def _scores_hook(adapter: Any, plan: Plan, site: Site) -> Any:
    """The hook on ``hook_attn_scores`` that hands the plan an
    :class:`~equivariance_probe.adapters.internals.AttentionScores` (rows as the bridge adapter reads them:
    the scores, or the logarithm of the weights where the hook carries weights)."""
    actions = plan.actions(site)

    def hook(scores: torch.Tensor, hook: Any) -> None:
        value = AttentionScores(site.layer, scores, lambda b, start, length: adapter._segment_rows(
            scores, site.layer, b, start, length))
        if apply(actions, value)[2]:
            raise _Stopped

    return hook


def _pieces_hooks(adapter: Any, plan: Plan, site: Site) -> list[tuple[str, Any]]:
    """The hooks that hand the plan block ``l``'s :class:`~equivariance_probe.adapters.components.HeadWrites`: the
    output projection's input kept (flattened where the bridge hands the heads as ``[batch, T, head, d_head]``),
    then handed over at the attention's output, or under a post-norm at the norm's input."""
    layer, actions = site.layer, plan.actions(site)
    parts = block_parts(adapter.model.original_model)
    part, norms = parts[layer], post_norms_of(parts, [layer])
    kept: dict[str, torch.Tensor] = {}
    projection_in, _ = adapter.component_hook(f"head.{layer}.0")
    attention_out, _ = adapter.component_hook(f"attention.{layer}")

    def keep(z: torch.Tensor, hook: Any) -> None:
        kept["z"] = z.flatten(2) if z.dim() == 4 else z

    def hand_over(hidden: torch.Tensor, hook: Any) -> None:
        writes = HeadWrites(layer, kept.pop("z"), hidden if part.post_norms else None, part.projection,
                            norms.get(layer), adapter.layout.n_heads)
        if apply(actions, writes)[2]:
            raise _Stopped

    where = attention_out.replace(".hook_out", ".hook_in") if part.post_norms else attention_out
    return [(projection_in, keep), (where, hand_over)]


def _hook(plan: Plan, site: Site, head: int | None, n_heads: int) -> Any:
    actions = plan.actions(site)
    rows = plan.logits_kept if site.kind == "final" else 0

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
