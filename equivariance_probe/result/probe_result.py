"""The result of a probe run: statistics plus how they were measured.

Place in the seams: above the statistics, the maths and the records. A :class:`ProbeResult`
holds the float64 sums of :class:`~equivariance_probe.statistics.AttentionStatistics` and the
metadata of the run (model, adapter, context length, log floor, excluded keys, library
versions). Every number is computed on demand from the sums by
:mod:`~equivariance_probe.maths`, so results merge exactly (``a + b``), and save and load
without the model (:mod:`~equivariance_probe.records.result_file` holds the file format).
The class is assembled from its seams: the numbers (:mod:`.numbers`), the intervals over windows
and paired differences (:mod:`.intervals`), and here the facts, merging, the summary and display,
and the file glue. It speaks the :class:`~equivariance_probe.analyses.results.Result` protocol.

A loaded result is lazy: :meth:`ProbeResult.load` reads the file's header (metadata and the
headline numbers of :meth:`ProbeResult.summary`), and the sums load, each array checked against
the digest stored when it was written, the first time a number needs them (every merge, and
:meth:`ProbeResult.verify`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..analyses import intervals as resampling
from ..analyses.heads import TOP_K, HeadRanking, rank_heads
from ..analyses.results import SumsReadOnUse, missing_as
from ..analyses.summary import head_label, result_summary, stored_sink_summary
from ..errors import EmptyResultError, IncompatibleResultsError, InputError
from ..markup import Markup
from ..maths import metrics
from ..maths.intervals import check_level, is_undefined
from ..maths.sinks import SINK_EPSILON, check_epsilon
from ..records.result_file import ResultFile, open_result_file, write_result_file
from ..records.sharding import merged_provenance
from ..sources.packing import merged_first_token, merged_windows_record
from ..sources.registry import display_name
from ..statistics import AttentionStatistics
from ..statistics.masks import layer_groups
from .intervals import SUMMARY_LEVEL, ProbeIntervals
from .numbers import ProbeNumbers

__all__ = ["ProbeResult", "SUMMARY_KEY_BINS", "BIDIRECTIONAL_PRIOR"]

#: Key-position bins of the Figure 1c numbers in :meth:`ProbeResult.summary`.
SUMMARY_KEY_BINS = 16

#: Why the prior and fitted query-position R² have no value for a bidirectional encoder.
BIDIRECTIONAL_PRIOR = (
    "undefined for a bidirectional encoder: every query of a window sees the same keys, so the uniform prior "
    "1/|V(q)| is the same for every query position and there is no query-position variance for it to explain "
    "(form='eta2', the query position as a categorical factor, is defined)"
)


class ProbeResult(SumsReadOnUse, ProbeNumbers, ProbeIntervals):
    """Attention statistics of a model over a corpus, and every metric computed from them.

    Build one with :meth:`EquivarianceProbe.run`; combine with ``a + b`` (or
    :meth:`merge`); save with :meth:`save` and load with :meth:`load`.

    Args:
        statistics: the sums (``None`` with ``file``).
        metadata: how they were measured (model, context, versions, study, ...).
        file: an opened result file (:func:`~equivariance_probe.records.result_file.open_result_file`)
            whose sums load the first time a number needs them, instead of ``statistics``.

    Example:
        >>> result.query_position_r2(scale="log", form="fitted")  # doctest: +SKIP
        0.41
    """

    def __init__(self, statistics: AttentionStatistics | None = None, metadata: dict[str, Any] | None = None, *,
                 file: ResultFile | None = None) -> None:
        if (statistics is None) == (file is None):
            raise InputError("a ProbeResult holds either statistics or an opened result file (file=...), one of the two")
        self._statistics: AttentionStatistics | None = statistics
        self.metadata: dict[str, Any] = {} if metadata is None else metadata
        # A loaded result: the opened file (arrays not read yet) and the summary its header holds.
        self._file: ResultFile | None = file
        self._stored_summary: dict[str, Any] | None = None if file is None else file.summary
        # The last computed summary and the state it describes (statistics object, windows, tokens):
        # a run adds windows to its statistics in place, so a summary of fewer windows is stale.
        self._computed_summary: tuple[tuple[int, int, int], dict[str, Any]] | None = None
        # The jackknife's replicates and the state they describe.
        self._replicates: tuple[tuple[int, int, int], resampling.Replicates] | None = None

    def _forget_stored(self) -> None:
        self._stored_summary = None  # the stored numbers were those of the file's sums

    @property
    def config(self) -> dict[str, Any]:
        """How the sums were laid out and measured (``n_layers``, ``n_heads``, ``n_positions``, ``log_floor``,
        ``excluded_keys``, ``causal``, ...), from the file's header while the sums are not loaded."""
        if self._statistics is None and self._file is not None:
            return self._file.config
        return self.statistics.config()

    # -- basic facts --------------------------------------------------------------------
    @property
    def n_windows(self) -> int:
        return self._file.n_windows if self._statistics is None and self._file else self.statistics.n_windows

    @property
    def n_tokens(self) -> int:
        return self._file.n_tokens if self._statistics is None and self._file else self.statistics.n_tokens

    @property
    def n_layers(self) -> int:
        return int(self.config["n_layers"])

    @property
    def n_heads(self) -> int:
        return int(self.config["n_heads"])

    @property
    def log_floor(self) -> float | None:
        """``eps`` of the log scale: ``y = log max(a, eps)``."""
        return self.config["log_floor"]

    @property
    def excluded_keys(self) -> tuple[int, ...]:
        return tuple(self.config["excluded_keys"])

    @property
    def model_name(self) -> str:
        """The model as the user named it, for display: the study's ``model`` argument (a packaged
        name such as ``gemma-3-270m``, or the path as given), else the packaged name of a converted
        copy, else the name the model carries. ``metadata["model"]["name"]`` keeps where the
        weights were loaded from (for a packaged model, its converted copy in the cache)."""
        return display_name(self.metadata)

    @property
    def context_length(self) -> int:
        """``T``, the window length the statistics are laid out for (the file's ``statistics.config.n_positions``;
        a window that was shorter fills only its first positions)."""
        return int(self.config["n_positions"])

    @property
    def causal(self) -> bool:
        """``False`` for a bidirectional encoder's statistics (signed lags, no query-position prior)."""
        return bool(self.config.get("causal", True))

    @property
    def undefined(self) -> dict[str, str]:
        """Statistics this result has no value for, each with the reason (``{"query_position_r2.prior": why}``)."""
        if self.causal:
            return {}
        return {f"query_position_r2.{form}": BIDIRECTIONAL_PRIOR for form in ("prior", "fitted")}

    @property
    def complete(self) -> bool:
        """False for the partial result of a run that stopped (``metadata["complete"]``)."""
        return bool(self.metadata.get("complete", True))

    def _require_data(self) -> dict[str, np.ndarray]:
        if self.statistics.n_windows == 0:
            raise EmptyResultError(
                "this result holds no windows yet: call EquivarianceProbe(model).run(docs) first "
                "(or merge in a result that has data)"
            )
        return self.statistics.numpy()

    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """Layers by the kind of mask the model declares: ``{"all": ...}``, plus ``"sliding"`` and
        ``"global"`` for a model with both kinds (Gemma 2 and 3: sliding-window and global layers).

        The kinds are the model's (``metadata["layout"]["windows"]``), whatever the context length:
        at ``T <= w`` a sliding layer sees what a global one sees, but stays in its group
        (:func:`~equivariance_probe.statistics.masks.layer_groups`).
        """
        declared = self.metadata.get("layout", {}).get("windows")
        if declared is None or len(declared) != self.n_layers:
            declared = self.statistics.sliding_windows
        return layer_groups(declared)

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
                f"cannot merge results of different models ({mine.get('name')!r} and {theirs.get('name')!r}): "
                "the sums of one model's attention do not add to another's; merge only results of one model "
                "(compare two models with compare_models, or side by side with equivariance-probe report)"
            )
        provenance = merged_provenance(self.metadata, other.metadata)  # refuses duplicates, other shards' corpora
        weights = (mine.get("weights_sha256"), theirs.get("weights_sha256"))
        if all(weights) and weights[0] != weights[1]:
            raise IncompatibleResultsError(
                f"cannot merge results of model {mine.get('name')!r} with weights sha256 {weights[0][:12]}… and "
                f"of model {theirs.get('name')!r} with weights sha256 {weights[1][:12]}… (metadata['model']"
                "['weights_sha256']): the same model name with other weights (a fine-tune, another checkpoint, a "
                "random_init_like copy, another dtype) measures other attention; merge only results of the same "
                "weights, and run the remaining windows on the weights the first result used"
            )
        statistics = self.statistics.merge(other.statistics, allow_duplicate_windows=allow_duplicate_windows)
        metadata = dict(self.metadata)
        metadata["merged_from"] = [self.metadata.get("run_id"), other.metadata.get("run_id")]
        if "windows" in self.metadata or "windows" in other.metadata:  # the windows of both parts, as measured
            metadata["windows"] = merged_windows_record(self.metadata.get("windows"), other.metadata.get("windows"))
        if "first_token" in self.metadata or "first_token" in other.metadata:  # what the sink numbers weighed, in both
            metadata["first_token"] = merged_first_token(self.metadata.get("first_token"), other.metadata.get("first_token"))
        metadata.update(provenance)
        metadata["complete"] = self.complete and other.complete
        return ProbeResult(statistics, metadata)

    def __add__(self, other: ProbeResult) -> ProbeResult:
        return self.merge(other)

    # -- summary and display -------------------------------------------------------------------------
    def summary(self, level: float = SUMMARY_LEVEL, *, missing: Any = None,
                epsilon: float = SINK_EPSILON) -> dict[str, Any]:
        """Headline numbers, as stored in the result file's header.

        Keys: ``n_windows``, ``n_tokens``, ``n_entries``, ``floored_entries``, ``log_floor``,
        ``excluded_keys``; ``query_position_r2`` (``{scale: {form: R²}}``, every form and scale);
        ``persistence_fit_r2`` (``{fit: R²}``) and ``persistence_fits`` (``{fit: {"params", "r2", "status", "note"}}``: status ``ok``, ``at_bound`` or ``failed``)
        of ``P(dt)``; ``fit_r2_by_key_position`` (Figure 1c: ``key_bins`` edges and each fit's R²
        per bin, 16 bins); ``toeplitz_r2_per_doc_mean`` and ``toeplitz_r2_mean_pattern_mean``
        (undefined without ``keep_pattern``); ``most_position_bound_head`` /
        ``least_position_bound_head`` (log η²); ``head_scores`` (every score of
        :data:`~equivariance_probe.analyses.heads.RANKING_SCORES` as ``[layer][head]`` lists);
        ``layer_groups`` (for models with sliding-window and global layers: per group its
        ``layers``, ``query_position_r2`` and ``persistence_fit_r2``; empty otherwise); ``sinks`` (the
        attention-sink rates at ``epsilon``, Gu et al.'s per-window one and the pooled one, with their
        intervals, per layer, and the first token's weight per head:
        :func:`~equivariance_probe.analyses.summary.sink_summary`); ``intervals`` (each number's
        ``[low, high]`` at ``level``).

        Args:
            level: the confidence level of the intervals (a file stores them at 0.95; another level
                reads the arrays and computes them).
            missing: what stands where a number is undefined: ``None`` (JSON's ``null``, as every
                result's summary and the tidy rows hold it), or ``math.nan`` for NaN.
            epsilon: the sink rates' threshold ``ε`` (a file stores them at
                :data:`~equivariance_probe.maths.sinks.SINK_EPSILON`; another threshold reads the arrays).

        A loaded result returns the numbers stored in its file without reading any array.
        """
        level, epsilon = check_level(level, "level"), check_epsilon(epsilon)
        stored = self._stored_summary
        if (stored is not None and (stored.get("intervals") or {}).get("level", SUMMARY_LEVEL) == level
                and (stored.get("sinks") or {}).get("epsilon", SINK_EPSILON) == epsilon):
            if "sinks" in stored:  # the pooled rate of a file written before the per-window one, by its own name
                stored = {**stored, "sinks": stored_sink_summary(stored["sinks"])}
            return missing_as(stored, missing)  # rebuilds every dict and list: a copy already
        if self.n_windows == 0:
            return {"n_windows": 0}
        state = (id(self.statistics), self.statistics.n_windows, self.statistics.n_tokens, level, epsilon)
        if self._computed_summary is None or self._computed_summary[0] != state:
            self._computed_summary = (state, result_summary(self, key_bins=SUMMARY_KEY_BINS, level=level,
                                                            epsilon=epsilon))
        return missing_as(self._computed_summary[1], missing)

    def table(self, level: float = SUMMARY_LEVEL) -> str:
        """A plain-text table of :meth:`summary`: the run, the query-position R² in every form and scale with
        its interval at ``level`` where the result has one, the persistence fits, and the most and least
        position-bound heads."""
        summary = self.summary(level)
        if not summary.get("n_windows"):
            return f"ProbeResult(model={self.model_name!r}): no windows"
        bounds = summary.get("intervals") or {}
        state = "" if self.complete else "; PARTIAL: the run stopped before every window was measured"
        lines = [f"Probe result on {self.model_name}: {summary['n_windows']} windows, {summary['n_tokens']} tokens, "
                 f"log floor {summary['log_floor']:.3g}, excluded keys {summary['excluded_keys'] or 'none'}{state}",
                 f"  {'scale':<6}" + "".join(f"{form:>28}" for form in metrics.FORMS)]
        for scale in metrics.SCALES:
            cells = (_cell(summary["query_position_r2"][scale][form],
                           ((bounds.get("query_position_r2") or {}).get(scale) or {}).get(form)) for form in metrics.FORMS)
            lines.append(f"  {scale:<6}" + "".join(f"{cell:>28}" for cell in cells))
        lines.append("  persistence fit R²: " + ", ".join(
            f"{fit} {_cell(value, (bounds.get('persistence_fit_r2') or {}).get(fit))}"
            for fit, value in summary["persistence_fit_r2"].items()))
        lines.append(f"  most position-bound head {summary['most_position_bound_head']}, least "
                     f"{summary['least_position_bound_head']} (log η²)")
        lines += self._sink_lines(level)
        if summary.get("undefined"):
            lines.append("  undefined: " + "; ".join(f"{name} ({why})" for name, why in summary["undefined"].items()))
        return "\n".join(lines)

    def _sink_lines(self, level: float) -> list[str]:
        """The table's attention-sink line: Gu et al.'s per-window sink rate and the pooled one, each with its
        interval where the result has one (a file written before each window's weight was kept has the pooled one
        alone), and the mean first-token weight (none for a result without first-token sums)."""
        from ..analyses.tidy import sink_rows
        from ..maths.sinks import SINK_EPSILON

        rows = {row["statistic"]: row for row in sink_rows(self.summary(level).get("sinks"), {}, level)
                if row["split"] == "model"}
        if not rows:
            return []
        rates = [f"{label} {_cell(row['value'], [row['low'], row['high']] if row['low'] is not None else None)}"
                 for label, row in (("sink rate (per window, Gu et al.)", rows.get("sink_rate")),
                                    ("pooled", rows.get("pooled_sink_rate"))) if row is not None]
        return [f"  attention sinks at α₁ > {SINK_EPSILON:g}: {', '.join(rates)}, "
                f"mean first-token weight α₁ {rows['first_token_weight']['value']:.4f}"]

    def to_rows(self, level: float = SUMMARY_LEVEL) -> list[dict[str, Any]]:
        """The numbers in long form, one dict per statistic and split (model, layer group, layer, head), with
        their intervals and the run's model, variant, run id and window protocol
        (:mod:`~equivariance_probe.analyses.tidy` lists the columns). Built from :meth:`summary` (a loaded
        result reads no array for it) and the attention-sink numbers (:meth:`sink_rate`, :meth:`first_token_weight`,
        from the first token's small sums); needs no pandas. ``equivariance-probe show --csv`` prints these rows.

        Example:
            >>> rows = result.to_rows()
            >>> next(r for r in rows if r["statistic"] == "log_eta2" and r["split"] == "model")["value"]
            0.0283...
        """
        from ..analyses.tidy import probe_identity, probe_rows, sink_rows

        identity = probe_identity(self.metadata, self.model_name)
        summary = self.summary(level)
        return probe_rows(summary, identity) + sink_rows(summary.get("sinks"), identity, level)

    def to_dataframe(self) -> Any:
        """:meth:`to_rows` as a pandas ``DataFrame`` (one row per statistic and split): runs concatenate
        with ``pandas.concat`` for plotting.

        Raises:
            MissingDependencyError: pandas is not installed (the message gives ``pip install pandas``).
        """
        from ..analyses.tidy import rows_dataframe

        return rows_dataframe(self.to_rows(), "ProbeResult.to_dataframe()")

    def _headline(self) -> tuple[dict[str, dict[str, float]], str, str]:
        """Query-position R² table and the most/least position-bound heads (from the header when loaded)."""
        if self._stored_summary is not None:
            summary = self.summary()
            return summary["query_position_r2"], summary["most_position_bound_head"], summary["least_position_bound_head"]
        eta2 = self.query_position_r2("log", "eta2", by="head")
        return self.query_position_table(), head_label(eta2, np.nanargmax), head_label(eta2, np.nanargmin)

    def __repr__(self) -> str:
        model = self.model_name
        if self.n_windows == 0:
            return f"ProbeResult(model={model!r}, empty)"
        table, most, least = self._headline()
        cells = ", ".join(
            f"{s}: " + " ".join(f"{f}={_formatted(table[s][f], 3)}" for f in metrics.FORMS) for s in metrics.SCALES
        )
        excluded = f", excluded keys {list(self.excluded_keys)}" if self.excluded_keys else ""
        return (
            f"ProbeResult(model={model!r}, windows={self.n_windows}, tokens={self.n_tokens}{excluded}; "
            f"query-position R² {cells}; most position-bound head {most}, least {least} (log η²))"
        )

    def _repr_html_(self) -> str:
        # Every value below may come from a file's header (someone else's file, opened in a notebook):
        # Markup.format escapes each one; only the ranking's own Markup passes as it is.
        if self.n_windows == 0:
            return Markup("<b>ProbeResult</b> for <code>{}</code>: no data yet").format(self.model_name)
        table, most, least = self._headline()
        cell = Markup("<td>{}</td>")
        rows = Markup("").join(
            Markup("<tr><th>{}</th>{}</tr>").format(s, Markup("").join(cell.format(_formatted(table[s][f], 4)) for f in metrics.FORMS))
            for s in metrics.SCALES
        )
        floored = self.summary()["floored_entries"] if self._stored_summary is not None else self.floored()
        return Markup(
            "<div><b>ProbeResult</b> for <code>{model}</code>: {windows} windows, {tokens} tokens, log floor {floor} "
            "({floored} entries floored), excluded keys {excluded}<table><tr><th>scale</th>{forms}</tr>{rows}</table>"
            "Query-position R² over all visible entries. Most position-bound head {most}, least {least} (log η²)."
            "{ranking}</div>"
        ).format(
            model=self.model_name, windows=self.n_windows, tokens=self.n_tokens, floor=f"{self.log_floor:.3g}",
            floored=floored, excluded=list(self.excluded_keys) or "none",
            forms=Markup("").join(Markup("<th>{}</th>").format(f) for f in metrics.FORMS), rows=rows,
            most=most, least=least, ranking=self.rank_heads().to_html(max_rows=10),
        )

    # -- heads ------------------------------------------------------------------------------------------
    def rank_heads(self, score: str = "log_eta2", scores: Any = None, *, top_k: int | None = TOP_K) -> HeadRanking:
        """Heads from the most to the least position-bound: a
        :class:`~equivariance_probe.analyses.heads.HeadRanking` (``to_dataframe()``, ``to_records()``).

        ``score`` is the ordering key (default ``"log_eta2"``); query-position R² and the prior
        fit sort descending, Toeplitz R² ascending (see :mod:`equivariance_probe.analyses.heads`).
        ``top_k``: also report, per head, in what share of the jackknife's replicates it is among
        the ``top_k`` first (``None``: not).
        """
        known = None
        stability = None
        if self._stored_summary is not None and "head_scores" in self._stored_summary:
            summary = self.summary()
            known = {name: np.asarray(v, dtype=np.float64) for name, v in summary["head_scores"].items()}
            stability = summary.get("head_stability")
        return rank_heads(self, score, scores, known_scores=known, top_k=top_k, known_stability=stability)

    # -- files -------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the result file (format 3; any name, ``.safetensors`` by convention), atomically.

        The float64 sums (bitwise), the entry sample and the window fingerprints are safetensors
        tensors; the metadata and :meth:`summary` are JSON in the header, so that the headline
        numbers read back without the arrays. Written to a temporary file, flushed to disk, then
        renamed (:mod:`~equivariance_probe.records.result_file`).
        """
        return write_result_file(path, self.statistics, self.metadata, complete=self.complete, summary=self.summary())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeResult:
        """Read a result file of any version (1, 2: JSON; 3: safetensors), told apart by its first bytes.

        Version 3 is read lazily: the header now (checked field by field, so :meth:`summary`, the
        metadata and the counts cost one header read), the arrays the first time a number needs
        them, when their checksum is verified.

        Raises:
            ResultFileError: the file is truncated, edited, not a result, or from a newer format.
        """
        opened = open_result_file(path)
        return cls(metadata=opened.metadata, file=opened)


def _formatted(value: Any, digits: int) -> str:
    """A headline number, or ``undefined`` (a form the result names in :meth:`ProbeResult.undefined`)."""
    return "undefined" if is_undefined(value) else f"{value:.{digits}f}"


def _cell(value: Any, bounds: Any) -> str:
    """A summary's number with its stored ``[low, high]``, or ``undefined``."""
    if is_undefined(value):
        return "undefined"
    if isinstance(bounds, list) and len(bounds) == 2 and not any(is_undefined(b) for b in bounds):
        return f"{value:.4f} [{bounds[0]:.4f}, {bounds[1]:.4f}]"
    return f"{value:.4f}"
