"""The result of a probe run: statistics plus how they were measured.

Place in the seams: above the statistics, the maths and the records. A :class:`ProbeResult`
holds the float64 sums of :class:`~equivariance_probe.statistics.AttentionStatistics` and the
metadata of the run (model, adapter, context length, log floor, excluded keys, library
versions). Every number is computed on demand from the sums by
:mod:`~equivariance_probe.maths`, so results merge exactly (``a + b``), and save and load
without the model (:mod:`~equivariance_probe.records.fileformat` holds the file format).
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .analyses.heads import HeadRanking, rank_heads
from .errors import IncompatibleResultsError, InputError, NotRunError, ResultFileError, check_choice
from .maths import fitting, metrics
from .maths.persistence import PersistenceCurves, persistence_curves
from .records.fileformat import (
    FORMAT_VERSION,
    RESULT_KIND,
    check_schema,
    checksum,
    decode_array,
    encode_array,
    jsonable,
    upgrade,
    write_json_atomically,
)
from .records.sharding import merged_provenance
from .statistics import STATISTICS, AttentionStatistics, EntrySample

__all__ = ["ProbeResult", "PersistenceCurves", "FORMAT_VERSION"]


@dataclass
class ProbeResult:
    """Attention statistics of a model over a corpus, and every metric computed from them.

    Build one with :meth:`EquivarianceProbe.run`; combine with ``a + b`` (or
    :meth:`merge`); save with :meth:`save` and load with :meth:`load`.

    Example:
        >>> result.query_position_r2(scale="log", form="fitted")  # doctest: +SKIP
        0.41
    """

    statistics: AttentionStatistics
    metadata: dict[str, Any] = field(default_factory=dict)

    # -- basic facts --------------------------------------------------------------------
    @property
    def n_windows(self) -> int:
        return self.statistics.n_windows

    @property
    def n_tokens(self) -> int:
        return self.statistics.n_tokens

    @property
    def n_layers(self) -> int:
        return self.statistics.n_layers

    @property
    def n_heads(self) -> int:
        return self.statistics.n_heads

    @property
    def log_floor(self) -> float | None:
        """``eps`` of the log scale: ``y = log max(a, eps)``."""
        return self.statistics.log_floor

    @property
    def excluded_keys(self) -> tuple[int, ...]:
        return self.statistics.excluded_keys

    @property
    def complete(self) -> bool:
        """False for the partial result of a run that stopped (``metadata["complete"]``)."""
        return bool(self.metadata.get("complete", True))

    def _require_data(self) -> dict[str, np.ndarray]:
        if self.statistics.n_windows == 0:
            raise NotRunError(
                "this result holds no windows yet: call EquivarianceProbe(model).run(docs) first "
                "(or merge in a result that has data)"
            )
        return self.statistics.numpy()

    # -- query-position R² ------------------------------------------------------------------
    def query_position_r2(self, scale: str = "log", form: str = "fitted", by: str | None = None) -> Any:
        """How much of the variance of attention the query position alone explains.

        Args:
            scale: ``"log"`` (``y = log max(a, eps)``, ``x = log u(q)``) or ``"raw"`` (``y = a``,
                ``x = u(q)``), with ``u(q) = 1/|V(q)|``.
            form: ``"prior"`` (``1 - Σ(y-x)²/Σ(y-ȳ)²``, no free parameter), ``"fitted"``
                (R² of ``y ≈ α + βx``) or ``"eta2"`` (``1 - Σ(y-ȳ_g)²/Σ(y-ȳ)²``, groups = query
                position and visible key set).
            by: ``None`` for one number over all entries, ``"layer"`` for ``[layer]``,
                ``"head"`` for ``[layer, head]``.
        """
        check_choice("scale", scale, metrics.SCALES)
        check_choice("form", form, metrics.FORMS)
        check_choice("by", by, (None, "total", "layer", "head"))
        arrays = self._require_data()
        prefix = "log" if scale == "log" else "raw"
        values = metrics.query_position_r2(
            arrays["query_count"],
            arrays[f"{prefix}_sum"],
            arrays[f"{prefix}_sq"],
            self.statistics.visible_keys().numpy(),
            scale=scale,
            by=None if by == "total" else by,
        )
        value = values[form]
        return float(value) if np.ndim(value) == 0 else value

    def query_position_table(self) -> dict[str, dict[str, float]]:
        """Every form on every scale over all entries: ``{scale: {form: R²}}``."""
        return {s: {f: self.query_position_r2(scale=s, form=f) for f in metrics.FORMS} for s in metrics.SCALES}

    def floored(self, by: str | None = None) -> Any:
        """Visible entries below ``eps`` (floored on the log scale): total, ``[layer]`` or ``[layer, head]``."""
        check_choice("by", by, (None, "layer", "head"))
        floored = self._require_data()["floored"]
        if by == "head":
            return floored.astype(np.int64)
        if by == "layer":
            return floored.sum(1).astype(np.int64)
        return int(floored.sum())

    def n_entries(self) -> int:
        """Visible entries ``(window, layer, head, q, k)`` behind the query-position R²."""
        return int(self._require_data()["query_count"].sum() * self.n_heads)

    # -- persistence -------------------------------------------------------------------------
    def persistence(self, by: str | None = None, bins: int = 16) -> PersistenceCurves:
        """Mean attention by distance ``P(dt)`` with power, exponential and uniform-prior fits.

        Args:
            by: ``None`` (over all layers and heads), ``"layer"``, ``"head"``, or
                ``"key_position"`` (the study's Figure 1c: ``P_t(dt)`` for key positions ``t``
                grouped into ``bins`` equal-width bins).
            bins: number of key-position bins for ``by="key_position"``.
        """
        check_choice("by", by, (None, "layer", "head", "key_position"))
        arrays = self._require_data()
        heads = self.n_heads
        if by == "head":
            counts = np.broadcast_to(arrays["lag_count"][:, None, :], arrays["lag_sum"].shape)
            priors = np.broadcast_to(arrays["lag_prior_sum"][:, None, :], arrays["lag_sum"].shape)
            return persistence_curves(arrays["lag_sum"], priors, counts, by)
        if by == "layer":
            return persistence_curves(arrays["lag_sum"].sum(1), heads * arrays["lag_prior_sum"], heads * arrays["lag_count"], by)
        if by == "key_position":
            n_positions = self.statistics.n_positions
            if not isinstance(bins, int) or not 1 <= bins <= n_positions:
                raise InputError(f"bins={bins!r} must be an integer from 1 to the context length {n_positions}")
            edges = np.unique(np.linspace(0, n_positions, bins + 1).round().astype(np.int64))
            which = np.searchsorted(edges, np.arange(n_positions), side="right") - 1
            def binned(name: str) -> np.ndarray:
                out = np.zeros((len(edges) - 1, n_positions))
                np.add.at(out, which, arrays[name])
                return out
            return persistence_curves(binned("key_lag_sum"), binned("key_lag_prior_sum"), binned("key_lag_count"), by, edges)
        return persistence_curves(
            arrays["lag_sum"].sum((0, 1)), heads * arrays["lag_prior_sum"].sum(0), heads * arrays["lag_count"].sum(0), None
        )

    # -- Toeplitz --------------------------------------------------------------------------------
    def toeplitz_r2(self, by: str = "head") -> np.ndarray:
        """Toeplitz R² per head ``[layer, head]`` (TISA appendix B), over visible entries.

        Args:
            by: ``"head"`` on the document-averaged pattern (needs ``keep_pattern``), or
                ``"head_per_doc"`` for the mean of per-window scores.
        """
        check_choice("by", by, ("head", "head_per_doc"))
        arrays = self._require_data()
        if by == "head_per_doc":
            with np.errstate(invalid="ignore", divide="ignore"):
                count = arrays["doc_toeplitz_count"]
                return np.where(count > 0, arrays["doc_toeplitz_sum"] / np.where(count > 0, count, 1), np.nan)
        if "pattern_sum" not in arrays:
            raise NotRunError(
                "the Toeplitz R² of the document-averaged pattern needs the summed pattern, which this run did "
                "not keep; run with keep_pattern=True, or use toeplitz_r2(by='head_per_doc')"
            )
        covering = arrays["windows_covering"]
        mean = metrics.mean_pattern_key_lag(arrays["pattern_sum"], covering)
        out = np.empty((self.n_layers, self.n_heads))
        for layer, window in enumerate(self.statistics.sliding_windows):
            visible = metrics.key_lag_visible(self.statistics.n_positions, window, covering, self.excluded_keys)
            out[layer] = metrics.toeplitz_r2_key_lag(mean[layer], visible)
        return out

    def entry_sample(self) -> dict[str, np.ndarray]:
        """The uniform sample of visible entries kept during the run (``sample_size``).

        Returns:
            columns ``attention``, ``prior`` (``u(q)``), ``layer``, ``head``, ``query``,
            ``key_position``, each ``[n_sampled]``.
        """
        sample = self.statistics.sample
        if sample is None or len(sample) == 0:
            raise NotRunError("this run kept no entry sample; run with sample_size=20000 (for example)")
        return {c: v for c, v in sample.to_arrays().items() if c != "key"}

    def mean_pattern(self, layer: int, head: int) -> np.ndarray:
        """The document-averaged pattern of one head as a ``[query, key]`` matrix (0 where hidden)."""
        arrays = self._require_data()
        if "pattern_sum" not in arrays:
            raise NotRunError("this run did not keep the summed pattern; run with keep_pattern=True")
        n = self.statistics.n_positions
        key_lag = metrics.mean_pattern_key_lag(arrays["pattern_sum"][layer, head], arrays["windows_covering"])
        visible = metrics.key_lag_visible(n, self.statistics.sliding_windows[layer], arrays["windows_covering"], self.excluded_keys)
        out = np.zeros((n, n))
        t, dt = np.nonzero(visible)
        out[t + dt, t] = key_lag[t, dt]
        return out

    # -- merging -----------------------------------------------------------------------------------
    def merge(self, other: ProbeResult, *, allow_duplicate_windows: bool = False) -> ProbeResult:
        """The result of both runs' windows together (exact: the sums add).

        Args:
            other: another result of the same model, measured the same way.
            allow_duplicate_windows: merge even if both hold the same windows (the same token
                ids, recognised by the 64-bit fingerprint every result keeps of each window),
                counting them twice. Only for users who weight windows twice on purpose.

        Raises:
            IncompatibleResultsError: the runs differ in model, layout, context, log floor,
                excluded keys or kept pattern; they share windows (the message says how many);
                they are the same run, or overlapping shards.
        """
        if not isinstance(other, ProbeResult):
            raise IncompatibleResultsError(f"can only merge a ProbeResult with another ProbeResult, not a {type(other).__name__}")
        mine, theirs = self.metadata.get("model", {}), other.metadata.get("model", {})
        if mine.get("name") and theirs.get("name") and mine.get("name") != theirs.get("name"):
            raise IncompatibleResultsError(
                f"cannot merge results of different models ({mine.get('name')!r} and {theirs.get('name')!r})"
            )
        provenance = merged_provenance(self.metadata, other.metadata)  # refuses duplicates, other shards' corpora
        statistics = self.statistics.merge(other.statistics, allow_duplicate_windows=allow_duplicate_windows)
        metadata = dict(self.metadata)
        metadata["merged_from"] = [self.metadata.get("run_id"), other.metadata.get("run_id")]
        metadata.update(provenance)
        metadata["complete"] = self.complete and other.complete
        return ProbeResult(statistics, metadata)

    def __add__(self, other: ProbeResult) -> ProbeResult:
        return self.merge(other)

    # -- summary and display -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Headline numbers, as saved in the result file."""
        if self.n_windows == 0:
            return {"n_windows": 0}
        eta2_head = self.query_position_r2("log", "eta2", by="head")
        persistence = self.persistence()
        return {
            "n_windows": self.n_windows,
            "n_tokens": self.n_tokens,
            "n_entries": self.n_entries(),
            "floored_entries": self.floored(),
            "log_floor": self.log_floor,
            "excluded_keys": list(self.excluded_keys),
            "query_position_r2": self.query_position_table(),
            "persistence_fit_r2": {name: persistence.fits[name].r2 for name in fitting.FIT_NAMES},
            "toeplitz_r2_per_doc_mean": float(np.nanmean(self.toeplitz_r2("head_per_doc"))),
            "most_position_bound_head": _head_label(eta2_head, np.nanargmax),
            "least_position_bound_head": _head_label(eta2_head, np.nanargmin),
        }

    def __repr__(self) -> str:
        model = self.metadata.get("model", {}).get("name", "?")
        if self.n_windows == 0:
            return f"ProbeResult(model={model!r}, empty)"
        table = self.query_position_table()
        eta2 = self.query_position_r2("log", "eta2", by="head")
        cells = ", ".join(
            f"{s}: " + " ".join(f"{f}={table[s][f]:.3f}" for f in metrics.FORMS) for s in metrics.SCALES
        )
        excluded = f", excluded keys {list(self.excluded_keys)}" if self.excluded_keys else ""
        return (
            f"ProbeResult(model={model!r}, windows={self.n_windows}, tokens={self.n_tokens}{excluded}; "
            f"query-position R² {cells}; most position-bound head {_head_label(eta2, np.nanargmax)}, "
            f"least {_head_label(eta2, np.nanargmin)} (log η²))"
        )

    def _repr_html_(self) -> str:
        model = html.escape(str(self.metadata.get("model", {}).get("name", "?")))
        if self.n_windows == 0:
            return f"<b>ProbeResult</b> for <code>{model}</code>: no data yet"
        table = self.query_position_table()
        rows = "".join(
            f"<tr><th>{s}</th>" + "".join(f"<td>{table[s][f]:.4f}</td>" for f in metrics.FORMS) + "</tr>"
            for s in metrics.SCALES
        )
        eta2 = self.query_position_r2("log", "eta2", by="head")
        return (
            f"<div><b>ProbeResult</b> for <code>{model}</code>: {self.n_windows} windows, {self.n_tokens} tokens, "
            f"log floor {self.log_floor:.3g} ({self.floored()} entries floored), excluded keys "
            f"{list(self.excluded_keys) or 'none'}<table><tr><th>scale</th>"
            + "".join(f"<th>{f}</th>" for f in metrics.FORMS)
            + f"</tr>{rows}</table>Query-position R² over all visible entries. Most position-bound head "
            f"{_head_label(eta2, np.nanargmax)}, least {_head_label(eta2, np.nanargmin)} (log η²)."
            + self.rank_heads().to_html(max_rows=10)
            + "</div>"
        )

    # -- heads ------------------------------------------------------------------------------------------
    def rank_heads(self, by: str = "log_eta2", scores: Any = None) -> HeadRanking:
        """Heads from the most to the least position-bound: a
        :class:`~equivariance_probe.analyses.heads.HeadRanking` (``to_dataframe()``, ``to_records()``).

        ``by`` is the ordering key (default ``"log_eta2"``); query-position R² and the prior
        fit sort descending, Toeplitz R² ascending (see :mod:`equivariance_probe.analyses.heads`).
        """
        return rank_heads(self, by=by, scores=scores)

    # -- files -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        statistics = self.statistics
        data = {
            "format_version": FORMAT_VERSION,
            "kind": RESULT_KIND,
            "complete": self.complete,
            "metadata": self.metadata,
            "statistics": {
                "config": statistics.config(),
                "n_windows": statistics.n_windows,
                "n_tokens": statistics.n_tokens,
                "arrays": {name: encode_array(value) for name, value in statistics.arrays.items()},
                "sample": None
                if statistics.sample is None
                else {
                    "size": statistics.sample.size,
                    "columns": {c: encode_array(torch.from_numpy(v)) for c, v in statistics.sample.to_arrays().items()},
                },
            },
            "summary": jsonable(self.summary()),
        }
        data["checksum"] = checksum(data["statistics"])
        return data

    def save(self, path: str | os.PathLike) -> Path:
        """Write the result as JSON (exact float64 sums); written to a temporary file, then renamed."""
        return write_json_atomically(path, jsonable(self.to_dict()))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "result") -> ProbeResult:
        data = upgrade(data, source)
        check_schema(data, source)
        try:
            stats_data = data["statistics"]
            config = stats_data["config"]
            statistics = AttentionStatistics(
                n_layers=config["n_layers"],
                n_heads=config["n_heads"],
                n_positions=config["n_positions"],
                sliding_windows=config["windows"],
                log_floor=config["log_floor"],
                excluded_keys=config["excluded_keys"],
                keep_pattern=config["keep_pattern"],
            )
            for name, expected in statistics.arrays.items():
                array = decode_array(stats_data["arrays"][name])
                if tuple(array.shape) != tuple(expected.shape):
                    raise ResultFileError(
                        f"{source}: array {name!r} has shape {tuple(array.shape)}, expected {tuple(expected.shape)}"
                    )
                statistics.arrays[name] = array
            unknown = set(stats_data["arrays"]) - set(STATISTICS)
            if unknown:
                raise ResultFileError(f"{source}: unknown statistics {sorted(unknown)}")
            sample = stats_data.get("sample")
            if sample is not None:
                columns = {c: decode_array(v).numpy() for c, v in sample["columns"].items()}
                statistics.sample = EntrySample.from_arrays(int(sample["size"]), columns)
            statistics.n_windows = int(stats_data["n_windows"])
            statistics.n_tokens = int(stats_data["n_tokens"])
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, ResultFileError):
                raise
            raise ResultFileError(f"{source} is missing or has a malformed field: {error!r}") from error
        metadata = dict(data.get("metadata", {}))
        metadata["complete"] = data["complete"]
        return cls(statistics, metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeResult:
        """Read a result written by :meth:`save`.

        Raises:
            ResultFileError: the file is truncated, not a result, or from a newer format.
        """
        path = Path(path)
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except json.JSONDecodeError as error:
            raise ResultFileError(f"{path} is not valid JSON (truncated or corrupted?): {error}") from error
        return cls.from_dict(data, source=str(path))


def _head_label(values: np.ndarray, pick) -> str:
    if np.all(np.isnan(values)):
        return "n/a"
    layer, head = np.unravel_index(pick(values), values.shape)
    return f"L{layer}H{head} ({values[layer, head]:.3f})"

