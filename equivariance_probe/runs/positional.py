"""Where order comes from, in one call: the positional analyses on one model, saved as one file.

Place in the seams: *runs*, orchestration like :mod:`~equivariance_probe.runs.study` (the CLI's
``positional`` command and ``run --analyses``). It picks windows from the corpus, runs the
analyses of :mod:`~equivariance_probe.analyses.positional` and
:mod:`~equivariance_probe.analyses.order` (METHODS.md sections 3-4), and keeps their results in a
:class:`PositionalStudy` that saves to and loads from JSON (``positional.json``); its figures and
HTML section are drawn by :mod:`~equivariance_probe.display.positional`.

Analyses (``ANALYSES``):

* ``gram`` — Gram matrix of learned absolute position embeddings, Toeplitz R² whole and
  off-diagonal (models without them, e.g. Gemma 3, record why they were skipped).
* ``positional_logits`` — layer-0 positional logits per head (TISA eq. 9-12), Toeplitz R².
* ``tisa`` — per-head diagonal profiles of mean pre-softmax scores and TISA kernel fits.
* ``permutation`` — permutation sensitivity under no ablation, ``no_mask``, ``no_positions``
  and both (causal LMs only).
* ``shrinkage`` — variance by position and its exponent, for the model and (with a baseline)
  its random initialisation.
* ``correlation`` — per-layer position correlation matrices of the residual stream.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..adapters.internals import position_embedding_modules
from ..adapters.modules import hf_model_of, is_causal_lm
from ..analyses.order import (
    PermutationSensitivity,
    VarianceShrinkage,
    permutation_sensitivity,
    position_correlation,
    representation_sums,
    token_windows,
)
from ..analyses.positional import (
    GramToeplitz,
    PositionalLogits,
    ScoreProfile,
    ScoreProfileFits,
    fit_score_profiles,
    gram_toeplitz,
    position_embedding_table,
    positional_logits,
    score_profile,
)
from ..errors import InputError, ResultFileError
from ..sources.baselines import random_init_like
from ..sources.corpus import load_corpus

__all__ = ["ANALYSES", "PositionalStudy", "run_positional"]

ANALYSES = ("gram", "positional_logits", "tisa", "permutation", "shrinkage", "correlation")
#: Analyses that need a causal language model with a decoder-layer stack.
_CAUSAL_ONLY = ("permutation", "shrinkage", "correlation")
FORMAT_VERSION = 1


@dataclass
class PositionalStudy:
    """Results of the analyses on one model (and its baseline), with save and load.

    Attributes:
        parts: analysis name to its result object (see ``ANALYSES``); ``"shrinkage_baseline"``
            and ``"correlation_baseline"`` hold the random-init baseline's.
        skipped: analysis name to the reason it did not run.
        metadata: model name, settings, versions, date.
    """

    parts: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"PositionalStudy(model={self.metadata.get('model')!r}, analyses={sorted(self.parts)}, skipped={sorted(self.skipped)})"

    # -- numbers -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Headline numbers of every analysis that ran (plain floats and lists)."""
        out: dict[str, Any] = {}
        if "gram" in self.parts:
            gram = self.parts["gram"]
            out["gram"] = {"r2_whole": gram.r2_whole, "r2_off_diagonal": gram.r2_off_diagonal,
                           "n_positions": int(gram.gram.shape[0]), "offset": gram.offset}
        if "positional_logits" in self.parts:
            r2 = self.parts["positional_logits"].toeplitz_r2
            out["positional_logits"] = _describe(r2) | {"per_head": r2.tolist()}
        if "tisa" in self.parts:
            r2 = self.parts["tisa"]["fits"].r2()
            out["tisa"] = _describe(r2) | {"n_kernels": self.parts["tisa"]["fits"].n_kernels}
        if "permutation" in self.parts:
            out["permutation"] = self.parts["permutation"].summary()
        for key in ("shrinkage", "shrinkage_baseline"):
            if key in self.parts:
                out[key] = {stream: values.tolist() for stream, values in self.parts[key].exponent.items()}
        for key in ("correlation", "correlation_baseline"):
            if key in self.parts:
                out[key] = {"mean_off_diagonal_by_layer": _mean_off_diagonal(self.parts[key]).tolist()}
        return out

    def table(self) -> str:
        """Markdown: one row per analysis that ran (its headline numbers) and one per analysis skipped."""
        summary = self.summary()

        def spread(values: Any) -> str:
            finite = [v for v in np.ravel(np.asarray(values, dtype=np.float64)) if np.isfinite(v)]
            return "n/a" if not finite else f"{min(finite):.3g} … {max(finite):.3g}"

        rows = []
        if "gram" in summary:
            gram = summary["gram"]
            rows.append(("gram", f"Toeplitz R² whole {gram['r2_whole']:.4f}, off-diagonal {gram['r2_off_diagonal']:.4f} "
                                 f"({gram['n_positions']} positions)"))
        for key, what in (("positional_logits", "layer-0 positional-logit Toeplitz R² per head"),
                          ("tisa", "TISA kernel-fit R² per head")):
            if key in summary:
                s = summary[key]
                rows.append((key, f"{what}: median {s['median']:.4g} (min {s['min']:.4g}, max {s['max']:.4g})"))
        if "permutation" in summary:
            rows.append(("permutation", "mean KL: " + ", ".join(f"{name} {v['kl_mean']:.3g}"
                                                                   for name, v in summary["permutation"].items())))
        for key, label in (("shrinkage", "trained"), ("shrinkage_baseline", "untrained")):
            if key in summary:
                rows.append((key, f"γ by layer ({label}): " + "; ".join(f"{stream} {spread(values)}"
                                                                        for stream, values in summary[key].items())))
        for key, label in (("correlation", "trained"), ("correlation_baseline", "untrained")):
            if key in summary:
                rows.append((key, f"mean correlation over i ≠ j by layer ({label}): "
                                  f"{spread(summary[key]['mean_off_diagonal_by_layer'])}"))
        rows += [(name, f"skipped: {reason}") for name, reason in self.skipped.items()]
        return "\n".join(["| analysis | result |", "|---|---|"] + [f"| {name} | {text} |" for name, text in rows])

    # -- files ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        parts: dict[str, Any] = {}
        for name, part in self.parts.items():
            if name == "tisa":
                parts[name] = {"profile": part["profile"].to_dict(), "fits": part["fits"].to_dict()}
            elif name.startswith("correlation"):
                parts[name] = np.asarray(part).tolist()
            else:
                parts[name] = part.to_dict()
        return {"format": "equivariance_probe.positional", "version": FORMAT_VERSION, "metadata": self.metadata,
                "skipped": self.skipped, "summary": self.summary(), "parts": parts}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionalStudy:
        if data.get("format") != "equivariance_probe.positional" or data.get("version") != FORMAT_VERSION:
            raise ResultFileError(
                f"not a positional results file of version {FORMAT_VERSION} (format={data.get('format')!r}, "
                f"version={data.get('version')!r}); write it with 'equivariance-probe positional'"
            )
        readers = {"gram": GramToeplitz.from_dict, "positional_logits": PositionalLogits.from_dict,
                   "permutation": PermutationSensitivity.from_dict, "shrinkage": VarianceShrinkage.from_dict,
                   "shrinkage_baseline": VarianceShrinkage.from_dict}
        parts: dict[str, Any] = {}
        for name, value in data["parts"].items():
            if name == "tisa":
                parts[name] = {"profile": ScoreProfile.from_dict(value["profile"]), "fits": ScoreProfileFits.from_dict(value["fits"])}
            elif name.startswith("correlation"):
                parts[name] = np.asarray(value, dtype=np.float64)
            else:
                parts[name] = readers[name](value)
        return cls(parts, dict(data.get("skipped", {})), dict(data.get("metadata", {})))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write JSON to ``path`` (a folder gets ``positional.json``); returns the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "positional.json"
        path.write_text(json.dumps(self.to_dict(), allow_nan=True) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PositionalStudy:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ResultFileError(f"cannot read positional results {str(path)!r}: {error}") from None
        return cls.from_dict(data)


def _mean_off_diagonal(correlation: np.ndarray) -> np.ndarray:
    """``[layer]`` mean of ``C[i, j]`` over ``i != j``, ignoring undefined entries (a position with
    no variance across documents, such as a BOS at position 0)."""
    n_positions = correlation.shape[-1]
    off_diagonal = ~np.eye(n_positions, dtype=bool)
    with np.errstate(invalid="ignore"):
        return np.array([np.nanmean(layer[off_diagonal]) if np.isfinite(layer[off_diagonal]).any() else np.nan
                         for layer in correlation])


def _describe(values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {"mean": float("nan"), "median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"mean": float(finite.mean()), "median": float(np.median(finite)),
            "min": float(finite.min()), "max": float(finite.max())}


def _representation_parts(model: Any, tokens: torch.Tensor, analyses: tuple[str, ...], batch_size: int, suffix: str) -> dict[str, Any]:
    sums = representation_sums(model, tokens, batch_size=batch_size)
    parts: dict[str, Any] = {}
    if "shrinkage" in analyses:
        parts["shrinkage" + suffix] = VarianceShrinkage.from_sums(sums)
    if "correlation" in analyses:
        parts["correlation" + suffix] = position_correlation(sums)
    return parts


def run_positional(
    model: Any,
    tokenizer: Any | None = None,
    *,
    docs: Any = None,
    analyses: tuple[str, ...] | list[str] = ANALYSES,
    n_docs: int = 8,
    context_length: int = 256,
    n_prompts: int = 4,
    prompt_length: int = 64,
    n_permutations: int = 8,
    n_kernels: int = 5,
    baseline: str | None = "random_init",
    batch_size: int = 4,
    exclude_keys: tuple[int, ...] | list[int] = (),
    seed: int = 0,
    progress: bool = True,
) -> PositionalStudy:
    """Run the positional analyses (METHODS.md sections 3-4) on a model.

    Args:
        model: a ``transformers`` model, a TransformerBridge, an nnsight model or an
            :class:`~equivariance_probe.EquivarianceProbe` (the Hugging Face model inside is used).
        tokenizer: its tokenizer (default: the probe's or model's own).
        docs: strings or a LongTensor ``[n, T]`` (default: the packaged Wikipedia articles).
        analyses: a subset of ``ANALYSES``.
        n_docs, context_length: windows for ``tisa``, ``shrinkage`` and ``correlation``.
        n_prompts, prompt_length, n_permutations: the permutation protocol.
        n_kernels: ``S`` of the TISA fits.
        baseline: ``"random_init"`` (shrinkage and correlations also on the model's own random
            initialisation, seed ``seed``) or ``None``.
        batch_size: windows per forward pass.
        exclude_keys: key positions left out of the ``tisa`` profiles (e.g. ``[0]``, a BOS sink).
        seed: seed of permutations and baseline.
        progress: print one line per analysis.

    Returns:
        :class:`PositionalStudy`.
    """
    analyses = tuple(analyses)
    unknown = [a for a in analyses if a not in ANALYSES]
    if unknown:
        raise InputError(f"unknown analyses {unknown}; choose from {list(ANALYSES)}")
    if baseline not in (None, "none", "random_init"):
        raise InputError(f"baseline must be 'random_init' or None, got {baseline!r}")
    hf = hf_model_of(model)
    if tokenizer is None:  # a probe's adapter knows the tokenizer; TransformerLens and nnsight models carry one
        tokenizer = getattr(getattr(model, "adapter", None), "tokenizer", None) or getattr(model, "tokenizer", None)
    if docs is None:
        docs = load_corpus()
    study = PositionalStudy(metadata={
        "model": str(getattr(hf.config, "_name_or_path", "") or type(hf).__name__),
        "architecture": type(hf).__name__,
        "analyses": list(analyses),
        "settings": {"n_docs": n_docs, "context_length": context_length, "n_prompts": n_prompts,
                     "prompt_length": prompt_length, "n_permutations": n_permutations, "n_kernels": n_kernels,
                     "baseline": baseline, "seed": seed, "exclude_keys": list(exclude_keys)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "conventions": "lag k = query - key position; Toeplitz R² 'whole' includes the main diagonal, "
                       "'off_diagonal' excludes it; permutations keep the first token and the last",
    })

    def say(message: str) -> None:
        if progress:
            print(f"[positional] {message}", flush=True)

    for name in analyses:
        if name in _CAUSAL_ONLY and not is_causal_lm(hf):
            study.skipped[name] = f"needs a causal language model; {type(hf).__name__} is not one"
    if any(a in analyses for a in ("gram", "positional_logits")):
        if not position_embedding_modules(hf):
            for name in ("gram", "positional_logits"):
                if name in analyses:
                    study.skipped[name] = (
                        f"{type(hf).__name__} has no learned absolute position embeddings (no nn.Embedding named "
                        "wpe, position_embeddings or embed_positions)"
                    )
        else:
            table, offset = position_embedding_table(hf)
            if "gram" in analyses:
                study.parts["gram"] = gram_toeplitz(table, offset)
                say(f"gram: Toeplitz R² whole {study.parts['gram'].r2_whole:.4f}, off-diagonal {study.parts['gram'].r2_off_diagonal:.4f}")
            if "positional_logits" in analyses:
                study.parts["positional_logits"] = positional_logits(hf, min(context_length, len(table)))
                say(f"positional logits: Toeplitz R² per head {np.round(study.parts['positional_logits'].toeplitz_r2, 3)}")
    needs_windows = [a for a in ("tisa", "shrinkage", "correlation") if a in analyses and a not in study.skipped]
    windows = token_windows(docs, tokenizer, context_length, n_docs) if needs_windows else None
    if windows is not None:
        study.metadata["windows"] = [int(windows.shape[0]), int(windows.shape[1])]
    if "tisa" in analyses:
        profile = score_profile(hf, windows, batch_size=batch_size, exclude_keys=exclude_keys)
        fits = fit_score_profiles(profile, n_kernels, seed=seed)
        study.parts["tisa"] = {"profile": profile, "fits": fits}
        say(f"tisa: kernel fit R² median {np.nanmedian(fits.r2()):.3f} over {fits.r2().size} heads")
    if "permutation" in analyses and "permutation" not in study.skipped:
        prompts = token_windows(docs, tokenizer, prompt_length, n_prompts)
        study.parts["permutation"] = permutation_sensitivity(hf, prompts, n_permutations=n_permutations, seed=seed)
        say("permutation: " + ", ".join(f"{k} KL {v['kl_mean']:.3g}" for k, v in study.parts["permutation"].summary().items()))
    if ("shrinkage" in needs_windows) or ("correlation" in needs_windows):
        study.parts.update(_representation_parts(hf, windows, analyses, batch_size, ""))
        if baseline == "random_init":
            untrained = random_init_like(hf, seed=seed)
            study.parts.update(_representation_parts(untrained, windows, analyses, batch_size, "_baseline"))
            del untrained
        if "shrinkage" in study.parts:
            say(f"shrinkage: attention-output exponent per layer {np.round(study.parts['shrinkage'].exponent['attention'], 2)}")
    return study
