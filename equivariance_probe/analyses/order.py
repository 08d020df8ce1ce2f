"""Order without position codes: permutation sensitivity, variance shrinkage, position correlations.

Place in the seams: *analyses*. Tensor maths (:func:`distribution_change`), the mergeable
:class:`~equivariance_probe.statistics.representation.RepresentationSums`, the shrinkage fit of
:mod:`~equivariance_probe.maths.fitting`, and thin functions that run a Hugging Face model (or
a TransformerBridge, nnsight model or probe) as plans of named sites
(:mod:`~equivariance_probe.adapters.plan`), under the ablations of :mod:`~equivariance_probe.adapters.internals`. docs/methods.md#order: "Breaking
Symmetry When Training Transformers" and "Latent Positional Information is in the
Self-Attention Variance of Transformer Language Models Without Positional Embeddings".

* **Permutation sensitivity.** A window ``t_0 .. t_{n-1}``; the tokens after the first
  ``keep_first`` (default 1: a BOS stays in front) and before the last are permuted at random,
  the last token is kept. For each permutation: ``KL(p ‖ p_π)`` and total variation
  ``½·Σ|p - p_π|`` of the next-token distributions at the last position, and the relative
  change ``‖h_π - h‖ / ‖h‖`` of the last position's final hidden state. Without a mask and
  without position encodings the last position's output is a function of the multiset of
  tokens, so all three are 0 up to floating-point rounding.
* **Variance shrinkage.** Per layer ``l`` and position ``q``, with ``x[doc, q, d]`` the attention
  output (the attention module's output, before any residual add or post-norm: site ``"attention_module.{l}"``)
  or the residual stream (the layer's output):
  ``var_docs[l, q] = mean_d Var_doc(x[doc, q, d])`` (variance across documents, averaged over
  hidden dimensions) and ``var_dims[l, q] = mean_doc Var_d(x[doc, q, d])`` (variance across
  hidden dimensions within a document, averaged over documents; the Latent Positional study's).
  The exponent ``γ`` is the slope of the least-squares line ``log var ≈ log c - γ·log(q+1)``
  over ``q >= q_min`` (default 1: position 0 often holds a BOS / attention sink). Uniform
  attention over ``q+1`` i.i.d. values gives ``var_docs ∝ 1/(q+1)``, ``γ = 1``.
* **Position correlations.** Per layer, over documents and hidden dimensions, centred per
  position and dimension over documents:
  ``C[i, j] = Σ_d cov_doc(x_i,d, x_j,d) / sqrt(Σ_d var_doc(x_i,d) · Σ_d var_doc(x_j,d))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..adapters import adapter_of
from ..adapters.modules import residual_width
from ..adapters.plan import Read, Stop
from ..errors import AttentionCaptureError, InputError
from ..maths.fitting import fit_shrinkage_exponent
from ..statistics.massive import MassiveActivationSums
from ..statistics.representation import RepresentationSums, variance_or_zero

__all__ = [
    "PermutationSensitivity",
    "permutation_sensitivity",
    "permute_middle",
    "distribution_change",
    "representation_sums",
    "VarianceShrinkage",
    "position_correlation",
    "token_windows",
]

DEFAULT_ABLATIONS = ("none", "no_mask", "no_positions", "no_mask+no_positions")


def token_windows(docs: Any, tokenizer: Any, length: int, n_windows: int | None = None) -> torch.Tensor:
    """Equal-length token windows ``[n, length]``: each document's first ``length`` tokens.

    Strings are tokenised with the tokenizer's special tokens (as the probe does); documents
    shorter than ``length`` are skipped (these analyses compare positions across documents,
    so every window must have every position). A LongTensor is used as given.
    """
    if isinstance(docs, torch.Tensor):
        tokens = docs.long()
        if tokens.dim() != 2:
            raise InputError(f"token windows must be [n_windows, n_tokens], got shape {tuple(tokens.shape)}")
        return tokens[:n_windows, :length]
    if tokenizer is None:
        raise InputError("strings need a tokenizer; pass tokenizer=..., or token ids as a LongTensor [n, T]")
    rows = []
    for text in docs:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        if len(ids) >= length:
            rows.append(ids[:length])
        if n_windows is not None and len(rows) >= n_windows:
            break
    if not rows:
        raise InputError(f"no document has {length} tokens; pass longer documents or a shorter length")
    return torch.tensor(rows, dtype=torch.long)


# -- permutation sensitivity ----------------------------------------------------------------
def permute_middle(tokens: torch.Tensor, n_permutations: int, *, keep_first: int = 1, seed: int = 0) -> torch.Tensor:
    """``[n_permutations, n]`` copies of ``tokens: [n]`` with positions ``keep_first .. n-2`` shuffled."""
    n = tokens.shape[-1]
    if n - 1 - keep_first < 2:
        raise InputError(f"a window of {n} tokens with keep_first={keep_first} leaves fewer than 2 tokens to permute")
    generator = torch.Generator().manual_seed(seed)
    out = tokens.repeat(n_permutations, 1)
    for row in range(n_permutations):
        order = torch.randperm(n - 1 - keep_first, generator=generator) + keep_first
        out[row, keep_first : n - 1] = tokens[order]
    return out


def distribution_change(logits: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``KL(p ‖ q)`` and total variation ``½Σ|p - q|`` between ``softmax`` of two ``[..., vocab]`` logits (float64)."""
    log_p = torch.log_softmax(logits.to(torch.float64), -1)
    log_q = torch.log_softmax(other.to(torch.float64), -1)
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(-1).clamp_min(0.0)
    tv = 0.5 * (p - log_q.exp()).abs().sum(-1)
    return kl, tv


@dataclass
class PermutationSensitivity:
    """Change of the last position's prediction under permutations, per ablation.

    Attributes:
        kl, total_variation, hidden_change: per ablation, ``[prompt, permutation]``.
        effect: per ablation, the largest change of the unpermuted last-position logits
            against no ablation (``> 0`` shows that the ablation took effect).
        upper_mass: per ablation, the largest attention mass any query put on later keys
            (``> 0`` only without a mask).
        keep_first, n_tokens: the protocol.
    """

    kl: dict[str, np.ndarray]
    total_variation: dict[str, np.ndarray]
    hidden_change: dict[str, np.ndarray]
    effect: dict[str, float] = field(default_factory=dict)
    upper_mass: dict[str, float] = field(default_factory=dict)
    keep_first: int = 1
    n_tokens: int = 0

    def summary(self) -> dict[str, dict[str, float]]:
        """Per ablation: mean and max KL, mean TV, mean relative hidden change."""
        return {
            name: {
                "kl_mean": float(self.kl[name].mean()),
                "kl_max": float(self.kl[name].max()),
                "tv_mean": float(self.total_variation[name].mean()),
                "hidden_change_mean": float(self.hidden_change[name].mean()),
                "effect": float(self.effect.get(name, 0.0)),
                "upper_mass": float(self.upper_mass.get(name, 0.0)),
            }
            for name in self.kl
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "kl": {k: v.tolist() for k, v in self.kl.items()},
            "total_variation": {k: v.tolist() for k, v in self.total_variation.items()},
            "hidden_change": {k: v.tolist() for k, v in self.hidden_change.items()},
            "effect": self.effect, "upper_mass": self.upper_mass,
            "keep_first": self.keep_first, "n_tokens": self.n_tokens, "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PermutationSensitivity:
        arrays = {key: {k: np.asarray(v) for k, v in data[key].items()} for key in ("kl", "total_variation", "hidden_change")}
        return cls(**arrays, effect=data["effect"], upper_mass=data["upper_mass"],
                   keep_first=data["keep_first"], n_tokens=data["n_tokens"])


def _last_plan(adapter: Any, got: dict[str, torch.Tensor], *, ablation: str | None = None,
               on_weights: Any = None) -> Any:
    """The plan of one pass that puts the last position's final hidden state and logits in ``got`` (the
    language-model head projects the last position only), under ``ablation``, every layer's largest attention mass
    on later keys handed to ``on_weights`` where given."""
    def upper_mass(weights: torch.Tensor) -> torch.Tensor:
        # Computed where the model runs (a remote request ships this function by value): one number per layer.
        return weights.float().triu(1).sum(-1).max()

    steps: list[tuple[str, Any]] = [("final", Read(lambda value: got.__setitem__("final", value[:, -1]))),
                                    ("logits", Read(lambda value: got.__setitem__("logits", value[:, -1])))]
    if on_weights is not None:
        steps += [(f"weights.{layer}", Read(on_weights, reduce=upper_mass)) for layer in range(adapter.layout.n_layers)]
    return adapter.plan(steps, ablation=ablation, last_position_logits=True)


def permutation_sensitivity(
    model: Any,
    tokens: torch.Tensor,
    *,
    n_permutations: int = 8,
    ablations: Sequence[str] = DEFAULT_ABLATIONS,
    keep_first: int = 1,
    seed: int = 0,
) -> PermutationSensitivity:
    """Permutation sensitivity of a causal LM's next-token prediction, with and without ablations.

    Args:
        model: a ``transformers`` causal LM (or wrapped; TransformerLens/nnsight/probe).
        tokens: ``[n_prompts, n]`` token windows.
        n_permutations: random permutations per prompt (the same ones under every ablation).
        ablations: names for :func:`~equivariance_probe.adapters.internals.ablate`
            (``"none"``, ``"no_mask"``, ``"no_positions"``, ``"no_mask+no_positions"``).
        keep_first: leading tokens that stay in place (1 keeps a BOS).
        seed: seed of the permutations.

    Raises:
        AttentionCaptureError: an ablation changed nothing (e.g. ``no_positions`` on a model
            whose position code this module does not know).
    """
    adapter = adapter_of(model)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    kl: dict[str, list] = {}
    tv: dict[str, list] = {}
    hidden: dict[str, list] = {}
    effect: dict[str, float] = {}
    upper: dict[str, float] = {}
    got: dict[str, torch.Tensor] = {}
    for name in ablations:  # what the framework cannot run is refused before any pass
        adapter.check_plan(_last_plan(adapter, got, ablation=name, on_weights=len))
    # Unpermuted, unablated last-position logits: an ablation that leaves them unchanged did nothing.
    reference = []
    for window in tokens:
        adapter.run_plan(window[None], _last_plan(adapter, got))
        reference.append(got["logits"][0])
    for name in ablations:
        largest_upper = [0.0]

        def on_weights(mass: torch.Tensor) -> None:
            largest_upper[0] = max(largest_upper[0], float(mass))

        rows_kl, rows_tv, rows_hidden, deltas = [], [], [], []
        plan, calls = _last_plan(adapter, got, ablation=name, on_weights=on_weights), 0
        for prompt, window in enumerate(tokens):
            batch = torch.cat([window[None], permute_middle(window, n_permutations, keep_first=keep_first, seed=seed + prompt)])
            record = adapter.run_plan(batch, plan)
            logits, states = got["logits"], got["final"]
            calls += record.get("rotary_calls", 0) + record.get("position_table_calls", 0)
            change_kl, change_tv = distribution_change(logits[:1], logits[1:])
            rows_kl.append(change_kl.cpu().numpy())
            rows_tv.append(change_tv.cpu().numpy())
            base = states[:1].to(torch.float64)
            rows_hidden.append(((states[1:].to(torch.float64) - base).norm(dim=-1) / base.norm(dim=-1)).cpu().numpy())
            deltas.append(float((logits[0] - reference[prompt]).abs().max()))
        if "no_positions" in plan.ablation and calls == 0:
            raise AttentionCaptureError(
                f"ablation {name!r}: found no rotary embedding and no position-embedding table to remove in "
                f"{adapter.model_name}; if the model has no position encoding, leave 'no_positions' out"
            )
        if plan.ablation and max(deltas) == 0.0:
            raise AttentionCaptureError(f"ablation {name!r} did not change the model's output: it did not take effect")
        kl[name], tv[name], hidden[name] = np.stack(rows_kl), np.stack(rows_tv), np.stack(rows_hidden)
        effect[name] = max(deltas)
        upper[name] = largest_upper[0]
    return PermutationSensitivity(kl, tv, hidden, effect, upper, keep_first, int(tokens.shape[-1]))


def representation_sums(model: Any, tokens: torch.Tensor, *, batch_size: int = 4,
                        massive: MassiveActivationSums | None = None) -> RepresentationSums:
    """Run windows ``[n, T]`` through a causal LM and sum its attention outputs and residual streams.

    The attention output of block ``l`` is site ``"attention_module.{l}"``, the output of its attention module
    (:mod:`~equivariance_probe.adapters.sites`; before any post-norm, which would rescale each token and hide the
    shrinkage); the residual stream is ``"resid.{l}"``, the block's output. With ``massive``
    (:meth:`MassiveActivationSums.empty(L, T, d) <equivariance_probe.statistics.massive.MassiveActivationSums.empty>`),
    the same residual streams also feed its largest and median magnitudes, in the same passes.
    """
    adapter = adapter_of(model)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_layers = adapter.layout.n_layers

    def add(stream: int, layer: int):
        def record(hidden: torch.Tensor) -> None:
            sums.add(stream, layer, hidden)
            if massive is not None and stream == 1:
                massive.add(layer, hidden)

        return Read(record)

    plan = adapter.plan([step for layer in range(n_layers)
                         for step in ((f"attention_module.{layer}", add(0, layer)), (f"resid.{layer}", add(1, layer)))]
                        + [(f"resid.{n_layers - 1}", Stop())])
    adapter.check_plan(plan)
    sums = RepresentationSums.empty(n_layers, tokens.shape[-1], residual_width(adapter.model))
    for start in range(0, len(tokens), batch_size):
        batch = tokens[start : start + batch_size]
        adapter.run_plan(batch, plan)
        sums.add_documents(len(batch))
        if massive is not None:
            massive.add_windows(len(batch))
    return sums


@dataclass
class VarianceShrinkage:
    """Variance by position per layer and its fitted exponent ``γ`` (see the module docstring).

    Attributes:
        across_documents, across_dimensions: ``{stream: [layer, position]}``.
        exponent, exponent_r2: ``{stream: [layer]}``, fitted on ``across_documents``.
        exponent_dims: ``{stream: [layer]}``, fitted on ``across_dimensions``.
        q_min: first position of the fit.
        n_documents: documents summed.
    """

    across_documents: dict[str, np.ndarray]
    across_dimensions: dict[str, np.ndarray]
    exponent: dict[str, np.ndarray]
    exponent_r2: dict[str, np.ndarray]
    exponent_dims: dict[str, np.ndarray]
    q_min: int = 1
    n_documents: int = 0

    @classmethod
    def from_sums(cls, sums: RepresentationSums, q_min: int = 1) -> VarianceShrinkage:
        docs, dims = sums.variance_across_documents(), sums.variance_across_dimensions()
        across_docs = {name: docs[i] for i, name in enumerate(sums.streams)}
        across_dims = {name: dims[i] for i, name in enumerate(sums.streams)}

        def exponents(table: dict[str, np.ndarray], part: int) -> dict[str, np.ndarray]:
            return {name: np.array([fit_shrinkage_exponent(row, q_min)[part] for row in value]) for name, value in table.items()}

        return cls(across_docs, across_dims, exponents(across_docs, 0), exponents(across_docs, 2),
                   exponents(across_dims, 0), q_min, sums.count)

    def to_dict(self) -> dict[str, Any]:
        return {
            key: {name: value.tolist() for name, value in getattr(self, key).items()}
            for key in ("across_documents", "across_dimensions", "exponent", "exponent_r2", "exponent_dims")
        } | {"q_min": self.q_min, "n_documents": self.n_documents}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VarianceShrinkage:
        tables = {
            key: {name: np.asarray(value, dtype=np.float64) for name, value in data[key].items()}
            for key in ("across_documents", "across_dimensions", "exponent", "exponent_r2", "exponent_dims")
        }
        return cls(**tables, q_min=data["q_min"], n_documents=data["n_documents"])


def position_correlation(sums: RepresentationSums) -> np.ndarray:
    """``[layer, position, position]`` correlation across documents of the residual stream (module docstring).

    NaN in the rows and columns of positions without variance across documents (undefined).
    """
    n = sums.count
    if n < 2:
        raise InputError("position correlations need at least 2 documents")
    mean = sums.sum[1] / n  # [layer, position, dim]
    covariance = sums.cross / n - torch.einsum("lid,ljd->lij", mean, mean)
    second = torch.diagonal(sums.cross / n, dim1=-2, dim2=-1)
    variance = variance_or_zero(second, second - torch.diagonal(covariance, dim1=-2, dim2=-1))
    scale = torch.sqrt(variance[:, :, None] * variance[:, None, :])
    return torch.where(scale > 0, covariance / torch.where(scale > 0, scale, 1.0), torch.nan).numpy()
