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
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
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
from ..analyses.position_probe import PositionProbe, position_probe
from ..analyses.positional import (
    AttentionToeplitz,
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
from ..analyses.results import Undefined, missing_as
from ..errors import InputError, ResultFileError, is_integer
from ..records.container import file_kind, read_container, read_tensors, tensor_checksum, write_container
from ..records.fileformat import parse_json
from ..sources.baselines import random_init_like
from ..sources.corpus import load_corpus
from ..sources.packing import pack_documents, special_prefix
from ..probe import EquivarianceProbe, MeasurementOptions
from ..sources.registry import name_of_converted_copy

__all__ = ["ANALYSES", "PositionalStudy", "run_positional", "POSITIONAL_KIND", "POSITIONAL_FORMAT_VERSION"]

ANALYSES = ("gram", "attention_toeplitz", "positional_logits", "tisa", "permutation", "shrinkage", "correlation", "probe")
#: Analyses that need a causal language model with a decoder-layer stack.
_CAUSAL_ONLY = ("permutation", "shrinkage", "correlation")
#: The ``kind`` of a positional study's file header.
POSITIONAL_KIND = "equivariance_probe.PositionalStudy"
#: The version :meth:`PositionalStudy.save` writes: 2, safetensors arrays and a JSON header (1: one JSON file).
POSITIONAL_FORMAT_VERSION = 2
#: What version-1 JSON files call their format and version.
_JSON_FORMAT, _JSON_VERSION = "equivariance_probe.positional", 1
#: Every part a study may hold (an analysis, or its baseline's).
_PART_NAMES = ("gram", "attention_toeplitz", "positional_logits", "tisa", "permutation", "shrinkage",
               "shrinkage_baseline", "correlation", "correlation_baseline", "probe", "probe_baseline")
#: A JSON value that stands for a tensor of the file (``{"tensor": name}``).
_TENSOR = "tensor"


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
        return f"PositionalStudy(model={self.model_name!r}, analyses={sorted(self.parts)}, skipped={sorted(self.skipped)})"

    @property
    def model_name(self) -> str:
        """The model for display: a packaged model's registry name rather than its converted copy's
        path (``metadata["model"]`` keeps the path)."""
        name = str(self.metadata.get("model", "?"))
        return name_of_converted_copy(name) or name

    @property
    def complete(self) -> bool:
        """False for a study that stopped before its analyses ran (``metadata["complete"]``)."""
        return bool(self.metadata.get("complete", True))

    @property
    def config(self) -> dict[str, Any]:
        """How the analyses were run: ``metadata["settings"]`` (windows, context length, prompts, kernels,
        baseline, seed, ...)."""
        return dict(self.metadata.get("settings", {}))

    @property
    def undefined(self) -> Undefined:
        """The analyses that have no numbers for this model, and why (:attr:`skipped`)."""
        return Undefined(self.skipped)

    # -- numbers -------------------------------------------------------------------------
    def summary(self, level: float = 0.95, *, missing: Any = None) -> dict[str, Any]:
        """Headline numbers of every analysis that ran (plain numbers and lists), ``missing`` (``None``, JSON's
        ``null``; ``math.nan`` for NaN) where a number is undefined. ``level`` is accepted as every result's
        :meth:`summary` accepts it: the probe's intervals over folds are at the level it was run with."""
        return missing_as(self._summary(), missing)

    def _summary(self) -> dict[str, Any]:
        """The summary with NaN where a number is undefined, as the file's header keeps it."""
        out: dict[str, Any] = {}
        if "gram" in self.parts:
            gram = self.parts["gram"]
            out["gram"] = {"r2_whole": gram.r2_whole, "r2_off_diagonal": gram.r2_off_diagonal,
                           "n_positions": int(gram.gram.shape[0]), "offset": gram.offset}
        if "attention_toeplitz" in self.parts:
            part = self.parts["attention_toeplitz"]
            out["attention_toeplitz"] = {
                "mean_pattern": _describe(part.mean_pattern) | {"per_head": np.asarray(part.mean_pattern).tolist()},
                "per_window": _describe(part.per_window) | {"per_head": np.asarray(part.per_window).tolist()},
                "n_windows": part.n_windows, "context_length": part.context_length, "causal": part.causal,
            }
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
        for key in ("probe", "probe_baseline"):
            if key in self.parts:
                out[key] = self.parts[key].summary()
        return out

    def to_rows(self, level: float = 0.95) -> list[dict[str, Any]]:
        """The numbers in long form, one dict per statistic and split (model, layer, head), the random-init
        baseline's as variant ``random_init`` (:mod:`~equivariance_probe.analyses.tidy` lists the columns).
        Built from :meth:`summary`; needs no pandas. ``equivariance-probe show --csv`` prints these rows."""
        from ..analyses.tidy import positional_rows

        identity = {"kind": "positional", "model": self.model_name, "run_id": self.metadata.get("run_id")}
        return positional_rows(self._summary(), identity)

    def to_dataframe(self) -> Any:
        """:meth:`to_rows` as a pandas ``DataFrame``.

        Raises:
            MissingDependencyError: pandas is not installed (the message gives ``pip install pandas``).
        """
        from ..analyses.tidy import rows_dataframe

        return rows_dataframe(self.to_rows(), "PositionalStudy.to_dataframe()")

    def table(self, level: float = 0.95) -> str:
        """Markdown: one row per analysis that ran (its headline numbers) and one per analysis skipped (``level`` as
        in :meth:`summary`)."""
        summary = self._summary()

        def spread(values: Any) -> str:
            finite = [v for v in np.ravel(np.asarray(values, dtype=np.float64)) if np.isfinite(v)]
            return "n/a" if not finite else f"{min(finite):.3g} … {max(finite):.3g}"

        rows = []
        if "gram" in summary:
            gram = summary["gram"]
            rows.append(("gram", f"Toeplitz R² whole {gram['r2_whole']:.4f}, off-diagonal {gram['r2_off_diagonal']:.4f} "
                                 f"({gram['n_positions']} positions)"))
        if "attention_toeplitz" in summary:
            s = summary["attention_toeplitz"]["mean_pattern"]
            rows.append(("attention_toeplitz", f"attention Toeplitz R² per head (document-averaged pattern, "
                                               f"{summary['attention_toeplitz']['n_windows']} windows): median "
                                               f"{s['median']:.4g} (min {s['min']:.4g}, max {s['max']:.4g})"))
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
        for key, label in (("probe", "trained"), ("probe_baseline", "untrained")):
            if key in summary:
                best = summary[key]["position"]
                layer = best["best_layer"]
                rows.append((key, f"held-out R² of the position ({label}), best layer {layer}: {best['best_r2']:.3f} "
                                  f"[{best['r2_low'][layer]:.3f}, {best['r2_high'][layer]:.3f}], MAE "
                                  f"{best['best_mae']:.1f} tokens; by layer {spread(best['r2'])}"))
        rows += [(name, f"skipped: {reason}") for name, reason in self.skipped.items()]
        return "\n".join(["| analysis | result |", "|---|---|"] + [f"| {name} | {text} |" for name, text in rows])

    # -- files ---------------------------------------------------------------------------
    def _parts_dict(self) -> dict[str, Any]:
        """Every part as plain values (lists and numbers), as each analysis' ``to_dict`` writes it."""
        parts: dict[str, Any] = {}
        for name, part in self.parts.items():
            if name == "tisa":
                parts[name] = {"profile": part["profile"].to_dict(), "fits": part["fits"].to_dict()}
            elif name.startswith("correlation"):
                parts[name] = np.asarray(part)
            else:
                parts[name] = part.to_dict()
        return parts

    @classmethod
    def _from_parts(cls, parts_data: dict[str, Any], skipped: dict[str, str], metadata: dict[str, Any]) -> PositionalStudy:
        readers = {"gram": GramToeplitz.from_dict, "positional_logits": PositionalLogits.from_dict,
                   "attention_toeplitz": AttentionToeplitz.from_dict,
                   "permutation": PermutationSensitivity.from_dict, "shrinkage": VarianceShrinkage.from_dict,
                   "shrinkage_baseline": VarianceShrinkage.from_dict, "probe": PositionProbe.from_dict,
                   "probe_baseline": PositionProbe.from_dict}
        parts: dict[str, Any] = {}
        for name, value in parts_data.items():
            if name == "tisa":
                parts[name] = {"profile": ScoreProfile.from_dict(value["profile"]), "fits": ScoreProfileFits.from_dict(value["fits"])}
            elif name.startswith("correlation"):
                parts[name] = np.asarray(value, dtype=np.float64)
            else:
                parts[name] = readers[name](value)
        return cls(parts, dict(skipped), dict(metadata))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the study to ``path`` (a folder gets ``positional.safetensors``) atomically; returns the file.

        Every numeric array of every analysis is a safetensors tensor named by where it sits
        (``parts/gram/gram``, ``parts/correlation``, ...); the header (``__metadata__
        ["equivariance_probe"]``, JSON) holds ``kind``, ``format_version`` (2), ``checksum`` (of the
        tensors), ``metadata``, ``skipped``, ``summary`` and ``parts``, whose arrays are
        ``{"tensor": name}``. Written to a temporary file, flushed to disk, then renamed.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "positional.safetensors"
        tensors: dict[str, np.ndarray] = {}
        parts = _arrays_to_tensors(self._parts_dict(), "parts", tensors)
        header = {"kind": POSITIONAL_KIND, "format_version": POSITIONAL_FORMAT_VERSION,
                  "checksum": tensor_checksum(tensors), "metadata": self.metadata, "skipped": self.skipped,
                  "summary": self._summary(), "parts": parts}
        return write_container(path, tensors, json.loads(json.dumps(header, default=_plain)))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PositionalStudy:
        """Read a study written by :meth:`save` (``positional.safetensors``) or by earlier versions (``positional.json``).

        Raises:
            ResultFileError: unreadable, truncated, edited, or not a positional study.
        """
        path = Path(path)
        if file_kind(path) == "json":
            try:
                data = parse_json(path.read_bytes(), str(path))
            except OSError as error:
                raise ResultFileError(f"cannot read positional results {str(path)!r}: {error}") from None
            if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT or data.get("version") != _JSON_VERSION:
                raise ResultFileError(
                    f"{path} is not a positional results file (format={data.get('format') if isinstance(data, dict) else None!r}, "
                    f"version={data.get('version') if isinstance(data, dict) else None!r}); write it with "
                    "'equivariance-probe positional'"
                )
            return cls._checked_parts(path, data, data.get("parts"))
        container = read_container(path, POSITIONAL_KIND)
        header = container.header
        version = header.get("format_version")
        if is_integer(version, 1) and version > POSITIONAL_FORMAT_VERSION:
            raise ResultFileError(f"{path} is a positional study of format {version}, newer than this equivariance_probe "
                                  f"reads ({POSITIONAL_FORMAT_VERSION}); upgrade equivariance_probe (pip install -U "
                                  "equivariance_probe) to read it")
        if version != POSITIONAL_FORMAT_VERSION or not isinstance(header.get("parts"), dict):
            raise ResultFileError(f"{path}: a positional study must have format_version {POSITIONAL_FORMAT_VERSION} and "
                                  "'parts'; the file is malformed (was it edited?)")
        tensors = read_tensors(container)  # each array checked against its digest
        if tensor_checksum(tensors) != header.get("checksum"):
            raise ResultFileError(f"{path}: the checksum does not match the arrays (changed or corrupted after saving)")
        missing = sorted({name for name in _tensor_names(header["parts"]) if name not in tensors})
        if missing:
            raise ResultFileError(f"{path}: 'parts' names arrays the file does not hold: {missing}; the file was edited")
        return cls._checked_parts(path, header, _tensors_to_arrays(header["parts"], tensors))

    @classmethod
    def _checked_parts(cls, path: Path, data: dict[str, Any], parts: Any) -> PositionalStudy:
        """The study of a file's parsed ``parts``, every part known and complete, or the part named."""
        if not isinstance(parts, dict):
            raise ResultFileError(f"{path}: 'parts' is missing or not an object; the file is malformed (was it edited?)")
        unknown = sorted(set(parts) - set(_PART_NAMES))
        if unknown:
            raise ResultFileError(f"{path}: unknown part{'s' if len(unknown) > 1 else ''} {unknown}; a positional study "
                                  f"holds {list(_PART_NAMES)}. Written by a newer equivariance_probe? Upgrade it to read "
                                  "the file")
        for name in ("skipped", "metadata"):
            if not isinstance(data.get(name, {}), dict):
                raise ResultFileError(f"{path}: {name!r} must be an object, not {type(data[name]).__name__}")
        for name, value in parts.items():
            try:
                cls._from_parts({name: value}, {}, {})
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
                raise ResultFileError(f"{path}: the part {name!r} is missing a field or has a malformed one ({error!r}); "
                                      "the file was edited or damaged") from None
        return cls._from_parts(parts, data.get("skipped", {}), data.get("metadata", {}))


def _arrays_to_tensors(value: Any, name: str, tensors: dict[str, np.ndarray]) -> Any:
    """``value`` with every numeric array (or rectangular list of numbers) moved into ``tensors``
    under its path ``name`` and replaced by ``{"tensor": name}``."""
    if isinstance(value, dict):
        return {key: _arrays_to_tensors(item, f"{name}/{key}", tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            array = np.asarray(value)
        except ValueError:  # ragged: not an array
            array = None
        if array is not None and array.ndim >= 1 and array.dtype.kind in "biuf":
            tensors[name] = np.ascontiguousarray(array)
            return {_TENSOR: name}
        return [_arrays_to_tensors(item, f"{name}/{index}", tensors) for index, item in enumerate(value)]
    return value


def _tensor_names(value: Any) -> set[str]:
    """Every tensor name that ``{"tensor": name}`` values inside ``value`` refer to."""
    names, stack = set(), [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if set(item) == {_TENSOR}:
                names.add(str(item[_TENSOR]))
            else:
                stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return names


def _tensors_to_arrays(value: Any, tensors: dict[str, np.ndarray]) -> Any:
    """The inverse of :func:`_arrays_to_tensors`: ``{"tensor": name}`` back to the array."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        return {key: _tensors_to_arrays(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_tensors_to_arrays(item, tensors) for item in value]
    return value


def _plain(value: Any) -> Any:
    """numpy scalars and arrays left in the header as plain numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _mean_off_diagonal(correlation: np.ndarray) -> np.ndarray:
    """``[layer]`` mean of ``C[i, j]`` over ``i != j``, ignoring undefined entries (a position with
    no variance across documents, such as a BOS at position 0)."""
    context_length = correlation.shape[-1]
    off_diagonal = ~np.eye(context_length, dtype=bool)
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
        model: a ``transformers`` model, a TransformerBridge, an nnsight model or an
            :class:`~equivariance_probe.EquivarianceProbe` (the Hugging Face model inside is used).
        tokenizer: its tokenizer (default: the probe's or model's own).
        docs: strings or a LongTensor ``[n, T]`` (default: the packaged Wikipedia articles).
        analyses: a subset of ``ANALYSES``.
        n_docs: windows for ``attention_toeplitz``, ``tisa``, ``shrinkage``, ``correlation`` (documents for ``probe``).
        n_prompts, prompt_length, n_permutations: the permutation protocol's prompts, their tokens, and
            permutations per prompt.
        n_kernels: ``S`` of the TISA fits.
        baseline: ``"random_init"`` (shrinkage, correlations and the probe also on the model's own random
            initialisation) or ``None``.
        probe_positions, windows_per_doc, n_folds: the ``probe`` analysis' positions per window (a stratified
            sample of ``1 .. T-1``), consecutive windows per document, and ``k`` of its GroupKFold over documents.
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
    needs_windows = [a for a in ("attention_toeplitz", "tisa", "shrinkage", "correlation")
                     if a in analyses and a not in study.skipped]
    windows = token_windows(docs, tokenizer, context_length, n_docs) if needs_windows else None
    study.metadata.update({} if windows is None else {"windows": [int(windows.shape[0]), int(windows.shape[1])]})
    _pattern_parts(study, hf, tokenizer, windows, analyses, options, n_kernels, seed, say)
    if "permutation" in analyses and "permutation" not in study.skipped:
        study.parts["permutation"] = permutation_sensitivity(hf, token_windows(docs, tokenizer, prompt_length, n_prompts),
                                                             n_permutations=n_permutations, seed=seed)
        say("permutation: " + ", ".join(f"{k} KL {v['kl_mean']:.3g}" for k, v in study.parts["permutation"].summary().items()))
    untrained = random_init_like(hf, seed=seed) if baseline == "random_init" and (
        {"shrinkage", "correlation"} & set(needs_windows) or "probe" in analyses) else None
    subjects = {"": hf, "_baseline": untrained}
    if ("shrinkage" in needs_windows) or ("correlation" in needs_windows):
        for suffix, subject in subjects.items():
            study.parts.update(_representation_parts(subject, windows, analyses, batch_size, suffix) if subject else {})
        if "shrinkage" in study.parts:
            say(f"shrinkage: attention-output exponent per layer {np.round(study.parts['shrinkage'].exponent['attention'], 2)}")
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
        say(f"probe{suffix}: held-out R² of the position by layer {np.round(part.r2['position'].mean(1), 3)} "
            f"(best layer {best}, MAE {part.mae['position'][best].mean():.1f} tokens)")


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
