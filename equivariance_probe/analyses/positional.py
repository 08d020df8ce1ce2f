"""Where position enters attention: position-embedding Gram matrices, positional logits, TISA kernels.

Place in the seams: *analyses*. Tensor maths (:func:`gram_toeplitz`,
:func:`diagonal_profile_sums`, a torch-only kernel of :mod:`~equivariance_probe.statistics.engines.in_trace`) on
top of :mod:`~equivariance_probe.maths` (Toeplitz R², TISA's kernel fit), plus thin functions that read a Hugging
Face model's weights (raw: TransformerLens bridges and nnsight models are unwrapped, so no TransformerLens weight
processing, whose centring would change the Gram matrix) through :mod:`~equivariance_probe.adapters.internals`;
:func:`score_profile` reads attention calls through a plan (site ``"qk.{l}"``), so it runs on every framework.
docs/methods.md#toeplitz;
Wennberg & Henter, "The Case for Translation-Invariant Self-Attention" (TISA), Fig. 1-2,
eq. 9-12 and appendix B.

Conventions:

* Toeplitz R² is :func:`equivariance_probe.maths.metrics.toeplitz_r2`; for a Gram matrix it is
  reported **whole** (every entry, diagonal included) and **off-diagonal** (the main
  diagonal, which holds the squared norms ``|e_i|²``, excluded).
* Lag ``k = q - key`` (query position minus key position): ``k = 0`` on the main diagonal,
  ``k > 0`` for keys before the query (the only ones a causal model sees), ``k < 0`` after
  it (encoders). TISA's kernel ``f(k) = Σ_s a_s·exp(-|b_s|·(k - c_s)²)`` is fitted in this
  ``k``; a code base that indexes relative positions from 1 instead of 0 has every centre
  ``c_s`` larger by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..adapters.internals import intercept_attention, position_embedding_modules
from ..adapters import adapter_of
from ..adapters.modules import hf_model_of
from ..adapters.plan import Read
from ..errors import InputError, UnsupportedModelError
from ..maths.fitting import KernelFit, fit_tisa_kernel
from ..maths.metrics import toeplitz_r2
from ..statistics.engines.in_trace import attention_scores, diagonal_profile_sums, visible_from_mask

__all__ = [
    "AttentionToeplitz",
    "GramToeplitz",
    "PositionalLogits",
    "ScoreProfile",
    "ScoreProfileFits",
    "sinusoidal_position_embeddings",
    "position_embedding_table",
    "gram_toeplitz",
    "positional_logits",
    "diagonal_profile_sums",
    "score_profile",
    "fit_score_profiles",
]


# -- position-embedding Gram matrices ------------------------------------------------------
def sinusoidal_position_embeddings(n_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al.'s sinusoidal table ``[n_positions, dim]`` (float64).

    ``E[i, 2m] = sin(i·ω_m)``, ``E[i, 2m+1] = cos(i·ω_m)``, ``ω_m = base^(-2m/dim)``; its Gram
    matrix ``Σ_m cos((i - j)·ω_m)`` depends on ``i - j`` only (exactly Toeplitz).
    """
    if dim % 2:
        raise InputError(f"sinusoidal embeddings need an even dim, got {dim}")
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    omega = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * omega)
    table[:, 1::2] = torch.cos(position * omega)
    return table


def position_embedding_table(model: Any) -> tuple[torch.Tensor, int]:
    """The learned absolute position embeddings of a model, raw, without offset rows.

    Looks for an ``nn.Embedding`` named ``wpe`` (GPT-2), ``position_embeddings`` (BERT,
    RoBERTa) or ``embed_positions`` (OPT). Rows before the first real position are dropped:
    OPT's table has an ``offset`` (2); RoBERTa numbers positions from ``padding_idx + 1``.

    Args:
        model: a ``transformers`` model, TransformerLens bridge, nnsight model or probe.

    Returns:
        ``(E_P [n_positions, d_model] float64, offset)``, row ``i`` the embedding of position ``i``.

    Raises:
        UnsupportedModelError: the model has no learned absolute position embeddings (rotary
            models such as Gemma 3 and Llama).
    """
    hf = hf_model_of(model)
    tables = position_embedding_modules(hf)
    if not tables:
        raise UnsupportedModelError(
            f"{type(hf).__name__} has no learned absolute position embeddings (no nn.Embedding named wpe, "
            "position_embeddings or embed_positions); rotary models (Gemma, Llama) encode position inside "
            "attention: use score_profile / fit_score_profiles for them"
        )
    table = tables[0]
    offset = getattr(table, "offset", None)
    if offset is None:
        offset = table.padding_idx + 1 if table.padding_idx is not None else 0
    weight = table.weight.detach().to(torch.float64).cpu()
    return weight[int(offset):], int(offset)


@dataclass
class GramToeplitz:
    """Gram matrix ``P = E_P E_Pᵀ`` of position embeddings and its Toeplitz R².

    Attributes:
        gram: ``[position, position]``.
        r2_whole: Toeplitz R² over every entry, the diagonal ``|e_i|²`` included.
        r2_off_diagonal: Toeplitz R² with the main diagonal excluded.
        offset: rows dropped from the model's table before position 0.
    """

    gram: np.ndarray
    r2_whole: float
    r2_off_diagonal: float
    offset: int = 0

    def to_dict(self, include_matrix: bool = True) -> dict[str, Any]:
        out = {"r2_whole": self.r2_whole, "r2_off_diagonal": self.r2_off_diagonal, "offset": self.offset,
               "n_positions": int(self.gram.shape[0])}
        if include_matrix:
            out["gram"] = self.gram.tolist()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GramToeplitz:
        return cls(np.asarray(data["gram"], dtype=np.float64), data["r2_whole"], data["r2_off_diagonal"], data["offset"])


def gram_toeplitz(embeddings: torch.Tensor | np.ndarray, offset: int = 0) -> GramToeplitz:
    """Gram matrix of position embeddings ``[n_positions, d]`` and its Toeplitz R² (whole and off-diagonal)."""
    table = np.asarray(embeddings, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 3:
        raise InputError(f"embeddings must be [n_positions >= 3, d], got shape {table.shape}")
    gram = table @ table.T
    off_diagonal = ~np.eye(len(gram), dtype=bool)
    return GramToeplitz(gram, toeplitz_r2(gram), toeplitz_r2(gram, off_diagonal), offset)


@dataclass
class AttentionToeplitz:
    """Toeplitz R² of each head's attention (TISA appendix B), to set beside the Gram matrix's.

    Computed by the probe (:meth:`~equivariance_probe.ProbeResult.toeplitz_r2`) over every visible
    entry: causal for decoders, both ways (signed lags) for encoders.

    Attributes:
        mean_pattern: ``[layer, head]`` R² of the document-averaged pattern.
        per_window: ``[layer, head]`` mean of the per-window R².
        n_windows, context_length: what they rest on.
        causal: whether the model's attention is causal (``False``: a bidirectional encoder).
    """

    mean_pattern: np.ndarray
    per_window: np.ndarray
    n_windows: int
    context_length: int
    causal: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"mean_pattern": np.asarray(self.mean_pattern).tolist(), "per_window": np.asarray(self.per_window).tolist(),
                "n_windows": int(self.n_windows), "context_length": int(self.context_length), "causal": bool(self.causal)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionToeplitz:
        return cls(np.asarray(data["mean_pattern"], dtype=np.float64), np.asarray(data["per_window"], dtype=np.float64),
                   int(data["n_windows"]), int(data["context_length"]), bool(data.get("causal", True)))


# -- positional logits (TISA eq. 9-12) -------------------------------------------------------
@dataclass
class PositionalLogits:
    """The positional part of one layer's attention logits, per head.

    Attributes:
        scores: ``[head, query, key]`` pre-softmax scores of inputs whose word embeddings are
            all the vocabulary mean, so that only position varies.
        visible: ``[query, key]`` entries the model's mask lets through.
        toeplitz_r2: ``[head]`` Toeplitz R² of each head's scores over visible entries.
        layer: the layer.
    """

    scores: np.ndarray
    visible: np.ndarray
    toeplitz_r2: np.ndarray
    layer: int = 0

    def to_dict(self, include_matrix: bool = True) -> dict[str, Any]:
        out = {"toeplitz_r2": self.toeplitz_r2.tolist(), "layer": self.layer}
        if include_matrix:
            out["scores"] = self.scores.tolist()
            out["visible"] = self.visible.tolist()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionalLogits:
        return cls(np.asarray(data["scores"]), np.asarray(data["visible"], dtype=bool),
                   np.asarray(data["toeplitz_r2"], dtype=np.float64), data["layer"])


def positional_logits(model: Any, n_positions: int | None = None, layer: int = 0) -> PositionalLogits:
    """Positional attention logits with word embeddings replaced by the vocabulary mean (TISA eq. 9-12).

    The model runs on ``inputs_embeds = ē`` (the mean of its input-embedding rows) at every
    position, so its embedding layer adds the position embeddings (and, for BERT, token type
    0 and LayerNorm) to a constant: what layer ``layer`` scores then differs between entries
    only through position. Scores are ``softcap(q·kᵀ·scaling)`` as the model computes them.

    Args:
        model: a model with learned absolute position embeddings (GPT-2, BERT-style).
        n_positions: window length (default: every position of the table, at most 512).
        layer: whose attention to read (0: where position embeddings enter directly).

    Returns:
        :class:`PositionalLogits`.
    """
    hf = hf_model_of(model)
    table, _ = position_embedding_table(hf)
    n_positions = min(len(table), 512) if n_positions is None else int(n_positions)
    if not 2 <= n_positions <= len(table):
        raise InputError(f"n_positions must be between 2 and {len(table)} (the model's positions), got {n_positions}")
    words = hf.get_input_embeddings().weight.detach()
    mean_word = words.mean(0)
    inputs_embeds = mean_word.expand(1, n_positions, -1).clone()
    captured: dict[int, Any] = {}
    with intercept_attention(hf, lambda call: captured.setdefault(call.layer, call)), torch.no_grad():
        hf(inputs_embeds=inputs_embeds)
    if layer not in captured:
        raise InputError(f"layer {layer} is out of range: the model ran {len(captured)} attention layers")
    call = captured[layer]
    scores = call.scores()[0].to(torch.float64).cpu().numpy()
    visible = visible_from_mask(call.attention_mask, (1, 1, n_positions, n_positions))[0, 0].cpu().numpy()
    r2 = np.array([toeplitz_r2(head, visible) for head in scores])
    return PositionalLogits(scores, visible, r2, layer)


# -- diagonal profiles of mean pre-softmax scores ------------------------------------------
@dataclass
class ScoreProfile:
    """Mean pre-softmax score per layer, head and lag ``k = q - key``, over documents and positions.

    Attributes:
        lags: ``[K]`` the lags ``k``, ascending.
        sums: ``[layer, head, K]`` float64 sums of visible scores.
        counts: ``[layer, head, K]`` float64 numbers of visible entries.
    """

    lags: np.ndarray
    sums: np.ndarray
    counts: np.ndarray

    def mean(self) -> np.ndarray:
        """``[layer, head, K]`` mean score per lag (NaN where no entry was visible)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.counts > 0, self.sums / np.where(self.counts > 0, self.counts, 1), np.nan)

    def to_dict(self) -> dict[str, Any]:
        return {"lags": self.lags.tolist(), "sums": self.sums.tolist(), "counts": self.counts.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScoreProfile:
        return cls(*(np.asarray(data[name], dtype=np.float64) for name in ("lags", "sums", "counts")))


def score_profile(
    model: Any, tokens: torch.Tensor, *, batch_size: int = 4, exclude_keys: Sequence[int] = ()
) -> ScoreProfile:
    """Diagonal profiles of each head's mean pre-softmax scores over token windows.

    Each layer's attention call (site ``"qk.{l}"``) is reduced to its sums and counts by lag where the model runs,
    so a remote nnsight model sends back ``2·H·(2T − 1)`` numbers per layer and batch.

    Args:
        model: a ``transformers`` model, a TransformerBridge, an nnsight model (local or remote) or a probe.
        tokens: ``[n_windows, T]`` token ids (equal-length windows, no padding).
        batch_size: windows per forward pass.
        exclude_keys: key positions left out (e.g. ``[0]``: a BOS attention sink, which
            otherwise is the only key at the largest lags).

    Returns:
        :class:`ScoreProfile` over lags ``k = -(T-1) .. T-1`` (a causal model has counts only
        for ``k >= 0``, and a sliding-window layer only for ``k < w``).
    """
    adapter = adapter_of(model)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_positions = tokens.shape[-1]
    per_layer: dict[int, list[torch.Tensor]] = {}
    excluded = tuple(int(k) for k in exclude_keys)

    def profile(call, excluded=excluded):
        # Runs where the model runs (a remote request ships it by value, with the torch-only kernels it calls), so
        # only [layer, (head, 2T − 1) sums and counts] travel: no annotations, nothing but torch and the kernels.
        scores = attention_scores(call.query, call.key, call.scaling, call.softcap)
        visible = visible_from_mask(call.attention_mask, scores.shape).to(scores.device)
        if excluded:
            keep = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
            keep[[k for k in excluded if 0 <= k < scores.shape[-1]]] = False
            visible = visible & keep
        return call.layer, diagonal_profile_sums(scores, visible)

    def add(reduced: tuple[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        layer, (sums, counts) = reduced
        if layer in per_layer:
            per_layer[layer][0] += sums
            per_layer[layer][1] += counts
        else:
            per_layer[layer] = [sums, counts]

    # The queries and keys as every layer's attention call receives them, with its mask.
    plan = adapter.plan([(f"qk.{layer}", Read(add, reduce=profile)) for layer in range(adapter.layout.n_layers)])
    adapter.check_plan(plan)
    for start in range(0, len(tokens), batch_size):
        adapter.run_plan(tokens[start : start + batch_size], plan)
    layers = sorted(per_layer)
    sums = torch.stack([per_layer[layer][0] for layer in layers]).numpy()
    counts = torch.stack([per_layer[layer][1] for layer in layers]).numpy()
    return ScoreProfile(np.arange(-(n_positions - 1), n_positions, dtype=np.float64), sums, counts)


@dataclass
class ScoreProfileFits:
    """Per layer and head, a TISA kernel fit to the mean-score profile.

    Attributes:
        fits: ``fits[layer][head]``.
        n_kernels: ``S``.
    """

    fits: list[list[KernelFit]] = field(default_factory=list)
    n_kernels: int = 5

    def r2(self) -> np.ndarray:
        """``[layer, head]`` fit R²."""
        return np.array([[fit.r2 for fit in layer] for layer in self.fits])

    def to_dict(self) -> dict[str, Any]:
        return {"n_kernels": self.n_kernels, "fits": [[fit.to_dict() for fit in layer] for layer in self.fits]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScoreProfileFits:
        return cls([[KernelFit.from_dict(f) for f in layer] for layer in data["fits"]], data["n_kernels"])


def fit_score_profiles(profile: ScoreProfile, n_kernels: int = 5, *, restarts: int = 4, seed: int = 0) -> ScoreProfileFits:
    """Fit TISA's kernel to every head's mean-score profile (visible lags only)."""
    means = profile.mean()

    def fit(curve: np.ndarray) -> KernelFit:
        if np.isfinite(curve).sum() < 3 * n_kernels:
            # A sliding window narrower than 3·S lags: too few points for S kernels.
            nan = np.full(n_kernels, np.nan)
            return KernelFit(nan, nan, nan, float("nan"))
        return fit_tisa_kernel(profile.lags, curve, n_kernels, restarts=restarts, seed=seed)

    fits = [[fit(means[layer, head]) for head in range(means.shape[1])] for layer in range(means.shape[0])]
    return ScoreProfileFits(fits, n_kernels)
