"""Where order comes from, in one call: the positional analyses on one model, saved as one file.

Place in the seams: *runs*, orchestration like :mod:`~equivariance_probe.runs.study` (the CLI's
``positional`` command and ``run --analyses``). It picks windows from the corpus, runs the
analyses of :mod:`~equivariance_probe.analyses.positional` and
:mod:`~equivariance_probe.analyses.order` (docs/methods.md#toeplitz and #order), and keeps their results
in a
:class:`PositionalStudy` that saves to and loads from one file of the result format family
(``positional.safetensors``: every array a safetensors tensor, the rest JSON in the header, see
:mod:`~equivariance_probe.records.container`; the ``positional.json`` of earlier versions still
loads); its figures and HTML section are drawn by :mod:`~equivariance_probe.display.positional`.

Analyses (``ANALYSES``):

* ``gram`` — Gram matrix of learned absolute position embeddings, Toeplitz R² whole and
  off-diagonal (models without them, e.g. Gemma 3, record why they were skipped).
* ``attention_toeplitz`` — each head's attention Toeplitz R² on the same windows (the probe,
  keeping the summed pattern; encoders both ways), to read beside the Gram matrix's: whether
  attention is as translation-invariant as the position code it starts from.
* ``positional_logits`` — layer-0 positional logits per head (TISA eq. 9-12), Toeplitz R².
* ``tisa`` — per-head diagonal profiles of mean pre-softmax scores and TISA kernel fits.
* ``permutation`` — permutation sensitivity under no ablation, ``no_mask``, ``no_positions``
  and both (causal LMs only).
* ``shrinkage`` — variance by position and its exponent, for the model and (with a baseline)
  its random initialisation.
* ``correlation`` — per-layer position correlation matrices of the residual stream.
* ``probe`` — linear position probes (docs/methods.md#probe): per layer, held-out R² and mean
  absolute error of a ridge regression from the residual stream at sampled positions to the
  position, over GroupKFold folds of documents, for the model and (with a baseline) its random
  initialisation. Its windows are ``windows_per_doc`` consecutive windows of each document
  (``pack_documents(..., protocol="document_prefixes")``), so that folds hold documents out, not
  windows; token tensors are used as given, each row its own document.
* ``massive`` — massive activations (Sun et al. 2024; docs/methods.md#massive-activations): per
  layer, the three largest residual-stream magnitudes and the median magnitude, averaged over the
  windows, their ratio, and the position and hidden dimension where the largest sits, from the
  same passes as ``shrinkage`` and ``correlation``, for the model and its random initialisation
  (causal LMs only).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..adapters.internals import position_embedding_modules
from ..adapters.modules import find_attention_modules, hf_model_of, is_causal_lm, residual_width
from ..analyses.order import (
    VarianceShrinkage,
    permutation_sensitivity,
    position_correlation,
    representation_sums,
    token_windows,
)
from ..analyses.position_probe import position_probe
from ..analyses.positional import (
    AttentionToeplitz,
    fit_score_profiles,
    gram_toeplitz,
    position_embedding_table,
    positional_logits,
    score_profile,
)
from ..errors import InputError
from ..sources.baselines import random_init_like
from ..statistics.massive import MassiveActivationSums
from ..sources.corpus import load_corpus
from ..sources.packing import pack_documents, special_prefix
from ..probe import EquivarianceProbe, MeasurementOptions

from .positional_study import POSITIONAL_FORMAT_VERSION, POSITIONAL_KIND, PositionalStudy

__all__ = ["ANALYSES", "PositionalStudy", "run_positional", "POSITIONAL_KIND", "POSITIONAL_FORMAT_VERSION"]

ANALYSES = ("gram", "attention_toeplitz", "positional_logits", "tisa", "permutation", "shrinkage", "correlation", "probe",
            "massive")
#: Analyses that need a causal language model with a decoder-layer stack.
_CAUSAL_ONLY = ("permutation", "shrinkage", "correlation", "massive")
#: Analyses read from :func:`~equivariance_probe.analyses.order.representation_sums`' passes.
_REPRESENTATION = ("shrinkage", "correlation", "massive")


def _representation_parts(model: Any, tokens: torch.Tensor, analyses: tuple[str, ...], batch_size: int, suffix: str) -> dict[str, Any]:
    massive = None
    if "massive" in analyses:
        hf = hf_model_of(model)
        massive = MassiveActivationSums.empty(len(find_attention_modules(hf)), tokens.shape[-1], residual_width(hf))
    sums = representation_sums(model, tokens, batch_size=batch_size, massive=massive)
    parts: dict[str, Any] = {} if massive is None else {"massive" + suffix: massive}
    if "shrinkage" in analyses:
        parts["shrinkage" + suffix] = VarianceShrinkage.from_sums(sums)
    if "correlation" in analyses:
        parts["correlation" + suffix] = position_correlation(sums)
    return parts


#: The windows the positional analyses measure unless told otherwise: 256 tokens, 4 per forward pass.
POSITIONAL_MEASUREMENT = MeasurementOptions(context_length=256)


def run_positional(
    model: Any,
    tokenizer: Any | None = None,
    *,
    docs: Any = None,
    analyses: tuple[str, ...] | list[str] = ANALYSES,
    n_docs: int = 8,
    n_prompts: int = 4,
    prompt_length: int = 64,
    n_permutations: int = 8,
    n_kernels: int = 5,
    baseline: str | None = "random_init",
    probe_positions: int = 32,
    windows_per_doc: int = 2,
    n_folds: int = 5,
    seed: int = 0,
    options: MeasurementOptions | None = None,
    progress: bool = True,
    **measurement: Any,
) -> PositionalStudy:
    """Run the positional analyses (docs/methods.md#toeplitz and #order) on a model.

    Args:
        model: a Hugging Face, TransformerLens or nnsight model, or a probe (the Hugging Face model inside is used).
        tokenizer: its tokenizer (default: the probe's or model's own).
        docs: strings or a LongTensor ``[n, T]`` (default: the packaged Wikipedia articles).
        analyses: a subset of ``ANALYSES``.
        n_docs: windows for ``attention_toeplitz``, ``tisa``, ``shrinkage``, ``correlation`` (documents for ``probe``).
        n_prompts: prompts of the permutation protocol.
        prompt_length: tokens per prompt.
        n_permutations: permutations per prompt.
        n_kernels: ``S`` of the TISA fits.
        baseline: ``"random_init"`` (shrinkage, correlations and the probe also on the model's own random
            initialisation) or ``None``.
        probe_positions: positions per window of ``probe`` (a stratified sample of ``1 .. T-1``).
        windows_per_doc: consecutive windows per document of ``probe``.
        n_folds: ``k`` of the probe's GroupKFold over documents.
        seed: seed of the permutations, the baseline and the probes' folds.
        options: a :class:`~equivariance_probe.probe.MeasurementOptions` (default ``context_length=256``), of which
            ``context_length``, ``batch_size`` and ``exclude_keys`` (left out of the ``tisa`` profiles and the
            attention Toeplitz R²) are read; ``**measurement`` sets any of its fields by name.
        progress: print one line per analysis.
    """
    options, analyses = _checked_arguments(options, measurement, analyses, baseline)
    context_length, batch_size, exclude_keys = options.context_length, options.batch_size, options.exclude_keys
    hf = hf_model_of(model)
    # A probe's adapter knows the tokenizer; TransformerLens and nnsight models carry one.
    if tokenizer is None:
        tokenizer = getattr(getattr(model, "adapter", None), "tokenizer", None) or getattr(model, "tokenizer", None)
    docs = load_corpus() if docs is None else docs
    study = PositionalStudy(metadata=_study_metadata(hf, analyses, {
        "n_docs": n_docs, "context_length": context_length, "n_prompts": n_prompts, "prompt_length": prompt_length,
        "n_permutations": n_permutations, "n_kernels": n_kernels, "baseline": baseline, "seed": seed,
        "exclude_keys": list(exclude_keys), "probe_positions": probe_positions, "windows_per_doc": windows_per_doc,
        "n_folds": n_folds}))
    say = _reporter(progress)
    study.skipped.update({name: f"needs a causal language model; {type(hf).__name__} is not one"
                          for name in analyses if name in _CAUSAL_ONLY and not is_causal_lm(hf)})
    _embedding_parts(study, hf, analyses, context_length, say)
    needs_windows = [a for a in ("attention_toeplitz", "tisa", *_REPRESENTATION)
                     if a in analyses and a not in study.skipped]
    windows = token_windows(docs, tokenizer, context_length, n_docs) if needs_windows else None
    study.metadata.update({} if windows is None else {"windows": [int(windows.shape[0]), int(windows.shape[1])]})
    _pattern_parts(study, hf, tokenizer, windows, analyses, options, n_kernels, seed, say)
    if "permutation" in analyses and "permutation" not in study.skipped:
        study.parts["permutation"] = permutation_sensitivity(hf, token_windows(docs, tokenizer, prompt_length, n_prompts),
                                                             n_permutations=n_permutations, seed=seed)
        say("permutation: " + ", ".join(f"{k} KL {v['kl_mean']:.3g}" for k, v in study.parts["permutation"].summary().items()))
    untrained = random_init_like(hf, seed=seed) if baseline == "random_init" and (
        set(_REPRESENTATION) & set(needs_windows) or "probe" in analyses) else None
    subjects = {"": hf, "_baseline": untrained}
    if set(_REPRESENTATION) & set(needs_windows):
        for suffix, subject in subjects.items():
            study.parts.update(_representation_parts(subject, windows, analyses, batch_size, suffix) if subject else {})
        if "shrinkage" in study.parts:
            say(f"shrinkage: attention-output exponent per layer {np.round(study.parts['shrinkage'].exponent['attention'], 2)}")
        if "massive" in study.parts:
            massive = study.parts["massive"].summary()
            layer = int(np.nanargmax(massive["ratio"]))
            say(f"massive: largest |h| / median by layer {np.round(massive['ratio'], 1)} (highest at layer {layer}: "
                f"position {massive['position'][layer]}, dimension {massive['dimension'][layer]})")
    if "probe" in analyses:
        _probe_parts(study, subjects, docs, tokenizer, context_length, n_docs, windows_per_doc, probe_positions, n_folds,
                     batch_size, seed, say)
    return study


def _reporter(progress: bool) -> Callable[[str], None]:
    """What the study says of each analysis as it ends: a printed line, or nothing."""
    def say(message: str) -> None:
        if progress:
            print(f"[positional] {message}", flush=True)
    return say


def _checked_arguments(options: MeasurementOptions | None, measurement: dict[str, Any], analyses: Any,
                       baseline: str | None) -> tuple[MeasurementOptions, tuple[str, ...]]:
    """The study's measurement options (the positional defaults, ``context_length`` 256) and its analyses, checked."""
    options = MeasurementOptions.of(POSITIONAL_MEASUREMENT if options is None else options, **measurement)
    if options.context_length is None:
        options = options.replace(context_length=POSITIONAL_MEASUREMENT.context_length)
    analyses = tuple(analyses)
    unknown = [a for a in analyses if a not in ANALYSES]
    if unknown:
        raise InputError(f"unknown analyses {unknown}; choose from {list(ANALYSES)}")
    if baseline not in (None, "none", "random_init"):
        raise InputError(f"baseline must be 'random_init' or None, got {baseline!r}")
    return options, analyses


def _study_metadata(hf: Any, analyses: tuple[str, ...], settings: dict[str, Any]) -> dict[str, Any]:
    """What a positional study records of its model, analyses and settings."""
    return {
        "model": str(getattr(hf.config, "_name_or_path", "") or type(hf).__name__),
        "architecture": type(hf).__name__,
        "analyses": list(analyses),
        "settings": settings,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "conventions": "lag k = query - key position; Toeplitz R² 'whole' includes the main diagonal, "
                       "'off_diagonal' excludes it; permutations keep the first token and the last",
    }


def _embedding_parts(study: PositionalStudy, hf: Any, analyses: tuple[str, ...], context_length: int,
                     say: Callable[[str], None]) -> None:
    """The analyses of a learned absolute position table (``gram``, ``positional_logits``), or why they are skipped."""
    if not any(a in analyses for a in ("gram", "positional_logits")):
        return
    if not position_embedding_modules(hf):
        for name in ("gram", "positional_logits"):
            if name in analyses:
                study.skipped[name] = (
                    f"{type(hf).__name__} has no learned absolute position embeddings (no nn.Embedding named "
                    "wpe, position_embeddings or embed_positions)"
                )
        return
    table, offset = position_embedding_table(hf)
    if "gram" in analyses:
        study.parts["gram"] = gram_toeplitz(table, offset)
        say(f"gram: Toeplitz R² whole {study.parts['gram'].r2_whole:.4f}, off-diagonal {study.parts['gram'].r2_off_diagonal:.4f}")
    if "positional_logits" in analyses:
        study.parts["positional_logits"] = positional_logits(hf, min(context_length, len(table)))
        say(f"positional logits: Toeplitz R² per head {np.round(study.parts['positional_logits'].toeplitz_r2, 3)}")


def _pattern_parts(study: PositionalStudy, hf: Any, tokenizer: Any, windows: Any, analyses: tuple[str, ...],
                   options: MeasurementOptions, n_kernels: int, seed: int, say: Callable[[str], None]) -> None:
    """The analyses of the attention in the windows: ``attention_toeplitz`` and the ``tisa`` score profiles' fits."""
    if "attention_toeplitz" in analyses:
        result = EquivarianceProbe(hf, tokenizer=tokenizer).run(windows, options.replace(keep_pattern=True), progress=False)
        study.parts["attention_toeplitz"] = AttentionToeplitz(
            result.toeplitz_r2("head"), result.toeplitz_r2("head", estimator="per_doc"), result.n_windows,
            int(windows.shape[1]), result.causal)
        say(f"attention toeplitz: per-head R² of the document-averaged pattern, median "
            f"{np.nanmedian(study.parts['attention_toeplitz'].mean_pattern):.3f}")
    if "tisa" in analyses:
        profile = score_profile(hf, windows, batch_size=options.batch_size, exclude_keys=options.exclude_keys)
        fits = fit_score_profiles(profile, n_kernels, seed=seed)
        study.parts["tisa"] = {"profile": profile, "fits": fits}
        say(f"tisa: kernel fit R² median {np.nanmedian(fits.r2()):.3f} over {fits.r2().size} heads")


def _probe_parts(study: PositionalStudy, subjects: dict[str, Any], docs: Any, tokenizer: Any, context_length: int,
                 n_docs: int, windows_per_doc: int, probe_positions: int, n_folds: int, batch_size: int, seed: int,
                 say: Callable[[str], None]) -> None:
    """The linear position probes of the model (and of its random initialisation, suffix ``_baseline``)."""
    tokens, groups = _probe_windows(docs, tokenizer, context_length, n_docs, windows_per_doc)
    study.metadata["probe_windows"] = [int(tokens.shape[0]), int(tokens.shape[1]), int(len(np.unique(groups)))]
    for suffix, subject in subjects.items():
        if subject is None:
            continue
        part = position_probe(subject, tokens, groups=groups, positions_per_window=probe_positions,
                              n_folds=n_folds, batch_size=batch_size, seed=seed)
        study.parts["probe" + suffix] = part
        best = part.best_layer()
        say(f"probe{suffix}: held-out R² of the position by layer {np.round(part.score('position'), 3)} "
            f"(best layer {best}, mean |error| {part.score('position', 'mae')[best]:.1f} tokens)")


def _probe_windows(docs: Any, tokenizer: Any, context_length: int, n_docs: int,
                   windows_per_doc: int) -> tuple[torch.Tensor, np.ndarray]:
    """The probe's windows ``[n, T]`` and each one's document: ``windows_per_doc`` consecutive windows of
    each of the first ``n_docs`` documents long enough (each after the special prefix), or token rows as
    given, each its own document."""
    if isinstance(docs, torch.Tensor):
        tokens = token_windows(docs, tokenizer, context_length, n_docs * windows_per_doc)
        return tokens, np.arange(len(tokens))
    if tokenizer is None:
        raise InputError("strings need a tokenizer; pass tokenizer=..., or token ids as a LongTensor [n, T]")
    windows = pack_documents(docs, tokenizer, context_length, protocol="document_prefixes", max_spans=n_docs,
                             span_tokens=windows_per_doc * (context_length - len(special_prefix(tokenizer))))
    return windows.tokens, windows.spans.numpy()
