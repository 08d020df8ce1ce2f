"""The positional study's result: the analyses' parts, their summary and table, and its file.

Place in the seams: *runs*, beside :mod:`~equivariance_probe.runs.positional` (which runs the analyses into a
:class:`PositionalStudy`). The study saves to and loads from one file of the result format family
(``positional.safetensors``: every array a safetensors tensor, the rest JSON in the header, see
:mod:`~equivariance_probe.records.container`; the ``positional.json`` of earlier versions still loads); its
figures and HTML section are drawn by :mod:`~equivariance_probe.display.positional`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..analyses.order import PermutationSensitivity, VarianceShrinkage
from ..analyses.position_probe import PositionProbe
from ..analyses.positional import AttentionToeplitz, GramToeplitz, PositionalLogits, ScoreProfile, ScoreProfileFits
from ..analyses.results import missing_as
from ..statistics.massive import MassiveActivationSums
from ..errors import ResultFileError, is_integer
from ..maths.intervals import check_level
from ..records.container import file_kind, read_container, read_tensors, tensor_checksum, write_container
from ..records.fileformat import parse_json
from ..sources.registry import name_of_converted_copy

__all__ = ["PositionalStudy", "POSITIONAL_KIND", "POSITIONAL_FORMAT_VERSION"]

#: The ``kind`` of a positional study's file header.
POSITIONAL_KIND = "equivariance_probe.PositionalStudy"
#: The version :meth:`PositionalStudy.save` writes: 2, safetensors arrays and a JSON header (1: one JSON file).
POSITIONAL_FORMAT_VERSION = 2
#: What version-1 JSON files call their format and version.
_JSON_FORMAT, _JSON_VERSION = "equivariance_probe.positional", 1
#: Every part a study may hold (an analysis, or its baseline's).
_PART_NAMES = ("gram", "attention_toeplitz", "positional_logits", "tisa", "permutation", "shrinkage",
               "shrinkage_baseline", "correlation", "correlation_baseline", "probe", "probe_baseline", "massive", "massive_baseline")
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
    def undefined(self) -> dict[str, str]:
        """The analyses that have no numbers for this model, and why (:attr:`skipped`)."""
        return dict(self.skipped)

    # -- numbers -------------------------------------------------------------------------
    def summary(self, level: float = 0.95, *, missing: Any = None) -> dict[str, Any]:
        """Headline numbers of every analysis that ran (plain numbers and lists), ``missing`` (``None``, JSON's
        ``null``; ``math.nan`` for NaN) where a number is undefined. ``level`` is accepted as every result's
        :meth:`summary` accepts it (and refused as they refuse it, when it is no level): the probe's jackknife
        intervals are at the level it was run with."""
        check_level(level, "level")
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
        for key in ("probe", "probe_baseline", "massive", "massive_baseline"):
            if key in self.parts:
                out[key] = self.parts[key].summary()
        return out

    def to_rows(self, level: float = 0.95) -> list[dict[str, Any]]:
        """The numbers in long form, one dict per statistic and split (model, layer, head), the random-init
        baseline's as variant ``random_init`` (:mod:`~equivariance_probe.analyses.tidy` lists the columns).
        Built from :meth:`summary`, and the position probes' from their intervals over folds; needs no pandas. ``equivariance-probe show --csv`` prints these rows."""
        from ..analyses.tidy import position_probe_rows, positional_rows

        check_level(level, "level")
        identity = {"kind": "positional", "model": self.model_name, "run_id": self.metadata.get("run_id")}
        probes = [position_probe_rows(self.parts[key], {**identity, "variant": variant})
                  for key, variant in (("probe", "trained"), ("probe_baseline", "random_init")) if key in self.parts]
        return positional_rows(self._summary(), identity) + [row for rows in probes for row in rows]

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
        check_level(level, "level")
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
                                  f"[{best['r2_low'][layer]:.3f}, {best['r2_high'][layer]:.3f}], mean distance "
                                  f"{best['best_mae']:.1f} [{best['mae_low'][layer]:.1f}, {best['mae_high'][layer]:.1f}] "
                                  f"tokens; by layer {spread(best['r2'])}"))
        for key, label in (("massive", "trained"), ("massive_baseline", "untrained")):
            if key in summary:
                part = summary[key]
                layer = int(np.nanargmax(part["ratio"]))
                rows.append((key, f"massive activations ({label}): largest |h| / median at most "
                                  f"{part['ratio'][layer]:.4g} (layer {layer}, largest {part['top'][layer][0]:.4g}, median "
                                  f"{part['median'][layer]:.4g}; position {part['position'][layer]} in "
                                  f"{part['position_share'][layer]:.0%} of windows, dimension {part['dimension'][layer]}); "
                                  f"by layer {spread(part['ratio'])}"))
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
                   "probe_baseline": PositionProbe.from_dict, "massive": MassiveActivationSums.from_dict,
                   "massive_baseline": MassiveActivationSums.from_dict}
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
