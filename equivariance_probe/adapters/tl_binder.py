"""The TransformerLens site binder: a :class:`~equivariance_probe.adapters.plan.Plan` run through a
TransformerBridge's own hook points, in one ``run_with_hooks`` pass.

Place in the seams: *adapters*. Each site is one hook point (:data:`SITE_HOOKS`; the components' hooks are the
bridge adapter's :meth:`~equivariance_probe.adapters.transformer_lens.TransformerBridgeAdapter.component_hook`).
The numbers are the bridge's own: its attention components compute the scores themselves, bypassing transformers'
attention function. ``"qk.{l}"`` is what that function would receive, formed from the bridge's own hook points
(:data:`QK_HOOKS`): the rotated queries and keys of a rotary attention (``hook_rot_q``/``hook_rot_k``, after a
Gemma 3 q/k-norm, before the keys' heads are repeated), the projections of a joint-QKV one (GPT-2), the mask
the bridge added to the scores (read at ``hook_attn_scores``, as transformers' additive mask), and the Hugging Face
module's ``scaling`` and ``attn_logit_softcapping``; an attention component whose hooks do not give that call
exactly is refused by name. The ablations act on transformers' call and on the Hugging Face model's position
modules, which the bridge replaces, so they are refused before any pass. The scores are also
``"scores.{l}"`` (``hook_attn_scores``, an :class:`~equivariance_probe.adapters.internals.AttentionScores`);
``"pieces.{l}"`` is formed from ``attn.o.hook_in`` with the projection's weights, and the post-norm's input where
the block has one; ``"logits"`` is what ``run_with_hooks`` returns, for the last positions the plan keeps
(``logits_to_keep`` and ``position_ids`` go through the bridge to the Hugging Face model it runs).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import AttentionCaptureError
from .components import HeadWrites, block_parts, head_columns, post_norms_of
from .internals import AttentionCall, AttentionScores
from .plan import Plan, apply
from .sites import Site

__all__ = ["SITE_HOOKS", "QK_HOOKS", "run_bridge_plan", "bridge_hook"]

#: The bridge's hook point of each site kind that is not a component of the residual stream.
SITE_HOOKS = {"embedding": "blocks.0.hook_resid_pre", "resid": "blocks.{layer}.hook_resid_post",
              "attention_module": "blocks.{layer}.attn.hook_out",
              "scores": "blocks.{layer}.attn.hook_attn_scores", "weights": "blocks.{layer}.attn.hook_pattern",
              "final": "unembed.hook_in", "logits": "unembed.hook_out"}

#: Per attention component of the bridge, the hook points of the queries and keys transformers' attention function
#: would receive: after rotary embeddings (and a q/k-norm before them) where the component applies them itself.
QK_HOOKS = {"PositionEmbeddingsAttentionBridge": ("hook_rot_q", "hook_rot_k"),
            "JointQKVAttentionBridge": ("hook_q", "hook_k")}


class _Stopped(Exception):
    """Raised from a hook to end the pass at a plan's :class:`~equivariance_probe.adapters.plan.Stop`."""


def bridge_hook(adapter: Any, site: Site) -> tuple[str, int | None]:
    """``(hook point, head)`` of ``site`` on the bridge ``adapter.model``.

    Raises:
        AttentionCaptureError: ``"qk.{l}"`` on an attention component that does not give transformers' call
            (:func:`qk_hooks`), or a hook point the bridge lacks.
    """
    if site.kind == "qk":
        return qk_hooks(adapter, site)[0], None
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
    """Refuse, before any pass, what the bridge cannot bind: an ablation, a ``"qk.{l}"`` that its attention component
    does not give, a missing hook point.

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
        elif site.kind == "qk":
            hooks += _qk_hooks(adapter, plan, site)
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
    return run_with_hooks(adapter, tokens, plan, hooks, **options)


def run_with_hooks(adapter: Any, tokens: torch.Tensor, plan: Plan, hooks: list, **options: Any) -> dict[str, Any]:
    """One ``run_with_hooks`` pass of a TransformerLens model under ``hooks`` (the plan's sites bound), in eval mode
    and without gradients, the plan's ``"logits"`` actions run on the logits it returns and a
    :class:`~equivariance_probe.adapters.plan.Stop` ending it. Returns ``{"ablation": ()}``."""
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


def qk_hooks(adapter: Any, site: Site) -> tuple[str, str, Any]:
    """``(query hook, key hook, Hugging Face attention module)`` of site ``"qk.{l}"`` on the bridge ``adapter.model``.

    Raises:
        AttentionCaptureError: an attention component whose hooks do not carry the queries and keys transformers'
            call would receive (not in :data:`QK_HOOKS`, a q/k-norm after the rotation, a scale or soft cap of its
            own), naming it.
    """
    attention = adapter.model.blocks[site.layer].attn
    kind, module = type(attention).__name__, getattr(attention, "original_component", None)
    names = QK_HOOKS.get(kind)
    hooks = None if names is None else tuple(f"blocks.{site.layer}.attn.{name}" for name in names)
    why = None
    if hooks is None or module is None or any(name not in adapter.model.hook_dict for name in hooks):
        why = "its hooks do not carry the queries and keys as transformers' attention call receives them"
    elif getattr(attention.config, "qk_norm_after_rope", False) and "q_norm" in attention.submodules:
        why = "it normalises the queries and keys after hook_rot_q/hook_rot_k"
    elif kind == "JointQKVAttentionBridge" and (getattr(module, "attn_logit_softcapping", None) is not None
                                                or not math.isclose(_joint_scale(attention, module), module.scaling)):
        why = "its scores use a scale or soft cap of its own, not the Hugging Face module's"
    if why is not None:
        raise AttentionCaptureError(
            f"site {site.name!r}: this TransformerBridge's attention component {kind} replaces transformers' "
            f"attention call, and {why}; read 'scores.{site.layer}' (hook_attn_scores), or run the Hugging Face "
            "model inside (bridge.original_model) or an nnsight model")
    return hooks[0], hooks[1], module


def _joint_scale(attention: Any, module: Any) -> float:
    """The score scale a joint-QKV bridge component applies itself: ``d_head^(-1/2)``, over ``l + 1`` where the
    config scales by the inverse layer index (as TransformerLens' ``_reconstruct_attention``)."""
    scale = float(module.head_dim) ** -0.5
    if getattr(attention.config, "scale_attn_by_inverse_layer_idx", False) and attention._layer_idx is not None:
        scale /= float(attention._layer_idx + 1)
    return scale


def _qk_hooks(adapter: Any, plan: Plan, site: Site) -> list[tuple[str, Any]]:
    """The hooks that hand the plan block ``l``'s :class:`~equivariance_probe.adapters.internals.AttentionCall`:
    the queries and keys kept (the bridge's hooks carry ``[batch, position, head, d_head]``; transformers' call
    takes ``[batch, head, position, d_head]``), then handed over at ``hook_attn_scores`` with the mask the bridge
    added there, as transformers' additive mask ``[batch, 1, query, key]`` (0 where visible, the dtype's minimum
    where hidden)."""
    query_hook, key_hook, module = qk_hooks(adapter, site)
    actions, kept = plan.actions(site), {}
    scaling, softcap = float(module.scaling), getattr(module, "attn_logit_softcapping", None)

    def keep(name: str) -> Any:
        def hook(value: torch.Tensor, hook: Any) -> None:
            heads = value.unflatten(-1, (-1, int(module.head_dim))) if value.dim() == 3 else value
            kept[name] = heads.transpose(1, 2).detach()
        return hook

    def hand_over(scores: torch.Tensor, hook: Any) -> None:
        minimum = torch.finfo(scores.dtype).min
        zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
        mask = torch.where(scores[:, :1] > minimum / 2, zero, zero + minimum)
        call = AttentionCall(site.layer, kept.pop("query"), kept.pop("key"), mask, scaling, softcap)
        if apply(actions, call)[2]:
            raise _Stopped

    return [(query_hook, keep("query")), (key_hook, keep("key")),
            (SITE_HOOKS["scores"].format(layer=site.layer), hand_over)]


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
