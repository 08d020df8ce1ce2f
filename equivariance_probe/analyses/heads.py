"""Head ranking: which heads are the most (and least) position-bound.

Place in the seams: *analyses*. A pure function from a
:class:`~equivariance_probe.result.ProbeResult` to a table, one row per ``(layer, head)``; every
score is one the result already computes (docs/methods.md):

* ``log_prior``, ``log_fitted``, ``log_eta2``, ``raw_prior``, ``raw_fitted``, ``raw_eta2`` —
  query-position R² of the head in that scale and form (``result.query_position_r2(scale,
  form, by="head")``), e.g. ``log_eta2 = 1 - Σ(y - ȳ_q)²/Σ(y - ȳ)²`` with ``y = log max(a, eps)``
  over the head's visible entries, grouped by query position ``q``.
* ``toeplitz`` — Toeplitz R² of the head's document-averaged pattern (NaN when the run kept no
  summed pattern); ``toeplitz_per_doc`` — the mean of its per-window Toeplitz R².
* ``prior_fit`` — R² of the parameter-free uniform prior ``mean u(t+dt)`` on the head's
  persistence curve ``P(dt)`` (``result.persistence(by="head").r2("prior")``).

**Ordering.** Rows are sorted *most position-bound first* by one key (default ``log_eta2``,
the score behind ``ProbeResult.summary()``'s most/least position-bound head). For the
query-position R² and ``prior_fit`` a higher score is more position-bound (attention that
the query position, or the uniform prior alone, explains), so those sort descending; for
``toeplitz`` and ``toeplitz_per_doc`` a higher score means attention that depends on the
distance ``q - k`` alone (translation-equivariant), so those sort ascending. Ties keep
``(layer, head)`` order; heads whose key score is NaN come last.

**Stability.** A ranking also says, per head, in what share of the jackknife's replicates (the
same scores recomputed on every window but one group's, :mod:`~equivariance_probe.analyses.intervals`)
the head is among the ``top_k`` first (:func:`ranking_stability`): 1.0 for a head whose place at the
top does not hang on any group of windows. The scores without per-group state (``toeplitz``,
``prior_fit``) have none, and the ranking says why.

Nothing here imports a framework; pandas is imported by :meth:`HeadRanking.to_dataframe` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import EmptyResultError, InputError, IntervalUnavailableError, NotRunError, UndefinedStatisticError, check_integer
from ..markup import Markup
from ..maths.fitting import curve_r2
from ..maths.metrics import FORMS, SCALES
from .intervals import top_k_share


__all__ = [
    "HeadRanking",
    "rank_heads",
    "head_scores",
    "prior_fit_by_head",
    "RANKING_SCORES",
    "HIGHER_IS_MORE_POSITION_BOUND",
    "ranking_stability",
    "TOP_K",
]

#: Heads that count as the top of a ranking when its stability is reported.
TOP_K = 10


class RankableResult(Protocol):
    """What a ranking reads of a :class:`~equivariance_probe.result.ProbeResult` (a protocol, so that
    this module, which the result itself uses, needs no import of it)."""

    n_layers: int
    n_heads: int
    n_windows: int
    metadata: dict[str, Any]
    statistics: Any
    model_name: str

    def query_position_r2(self, scale: str = ..., form: str = ..., by: str | None = ...) -> Any: ...

    def toeplitz_r2(self, by: str | None = ..., interval: float | None = ..., *, estimator: str = ...) -> Any: ...

    def head_score_replicates(self, name: str) -> np.ndarray: ...

#: Score columns of a ranking, in display order, with what each one is.
RANKING_SCORES: dict[str, str] = {
    **{
        f"{scale}_{form}": f"query-position R² ({scale} scale, {form})"
        for scale in SCALES
        for form in reversed(FORMS)
    },
    "toeplitz": "Toeplitz R² of the document-averaged pattern",
    "toeplitz_per_doc": "mean per-window Toeplitz R²",
    "prior_fit": "R² of the uniform prior on the head's persistence curve P(dt)",
}

#: For each score: True if a higher value means a more position-bound head (sort descending).
HIGHER_IS_MORE_POSITION_BOUND: dict[str, bool] = {
    name: not name.startswith("toeplitz") for name in RANKING_SCORES
}


@dataclass(frozen=True)
class HeadRanking:
    """Heads ordered from the most to the least position-bound (see the module docstring).

    Attributes:
        layers: ``[n]`` layer of each row, in rank order.
        heads: ``[n]`` head of each row, in rank order.
        scores: score name -> ``[n]`` float64 values in rank order (keys of
            :data:`RANKING_SCORES`).
        key: the score the rows are sorted by.
        descending: whether ``key`` sorts descending (higher = more position-bound).
        model: the model's name, for display.
        top_k: the ``k`` of :attr:`stability` (``None``: not reported).
        stability: ``[n]`` in rank order, the share of the jackknife's replicates in which the head
            is among the ``top_k`` first by :attr:`key` (NaN where unavailable).
        stability_note: why there is no stability, where there is none.
    """

    layers: np.ndarray
    heads: np.ndarray
    scores: dict[str, np.ndarray]
    key: str
    descending: bool
    model: str = "?"
    top_k: int | None = None
    stability: np.ndarray | None = None
    stability_note: str | None = None

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def order(self) -> list[tuple[int, int]]:
        """``(layer, head)`` of every row, most position-bound first."""
        return [(int(layer), int(head)) for layer, head in zip(self.layers, self.heads)]

    def top(self, n: int = 1) -> list[tuple[int, int]]:
        """The ``n`` most position-bound heads (by :attr:`key`), most first."""
        return self._ranked_with_score()[:n]

    def bottom(self, n: int = 1) -> list[tuple[int, int]]:
        """The ``n`` least position-bound heads (by :attr:`key`), least first; NaN scores skipped."""
        return self._ranked_with_score()[::-1][:n]

    def _ranked_with_score(self) -> list[tuple[int, int]]:
        finite = np.isfinite(self.scores[self.key])
        return [pair for pair, keep in zip(self.order, finite) if keep]

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per row: ``rank`` (1 = most position-bound), ``layer``, ``head``, ``label``
        (``"L4H3"``), every score and, with :attr:`top_k`, ``in_top_k`` (the stability; ``None`` where NaN)."""
        records = []
        for row, (layer, head) in enumerate(self.order):
            record: dict[str, Any] = {"rank": row + 1, "layer": layer, "head": head, "label": f"L{layer}H{head}"}
            for name, values in self._columns().items():
                value = float(values[row])
                record[name] = value if np.isfinite(value) else None
            records.append(record)
        return records

    def _columns(self) -> dict[str, np.ndarray]:
        """The score columns, then the stability (``in_top_k``) when reported."""
        if self.top_k is None or self.stability is None:
            return dict(self.scores)
        return {**self.scores, "in_top_k": self.stability}

    def to_dataframe(self):
        """The ranking as a pandas ``DataFrame`` indexed by ``rank`` (pandas imported here).

        Raises:
            MissingDependencyError: pandas is not installed (the message gives ``pip install pandas``).
        """
        from .tidy import require_pandas

        pd = require_pandas("HeadRanking.to_dataframe()")
        frame = pd.DataFrame.from_records(self.to_records()).set_index("rank")
        return frame.astype({name: "float64" for name in self._columns()})

    def _rows(self, max_rows: int | None) -> list[int | None]:
        """Row indices to show; ``None`` marks the elided middle."""
        n = len(self)
        if max_rows is None or n <= max_rows:
            return list(range(n))
        head = (max_rows + 1) // 2
        return list(range(head)) + [None] + list(range(n - (max_rows - head), n))

    def _caption(self) -> str:
        direction = "descending" if self.descending else "ascending"
        caption = (
            f"heads of {self.model} ranked by {self.key} ({RANKING_SCORES[self.key]}, {direction}): "
            "most position-bound first"
        )
        if self.top_k is not None and self.stability_note:
            caption += f"; no in_top_k stability: {self.stability_note}"
        elif self.top_k is not None and self.stability is not None:
            caption += f"; in_top_k: share of the jackknife's replicates that rank the head among the {self.top_k} first"
        return caption

    def __repr__(self) -> str:
        return self.to_text(max_rows=10)

    def to_text(self, max_rows: int | None = None) -> str:
        """A plain-text table (``max_rows`` keeps the first and last rows)."""
        columns = self._columns()
        names = list(columns)
        width = max(10, *(len(name) for name in names))
        lines = [self._caption(), f"{'rank':>4} {'head':>7} " + " ".join(f"{n:>{width}}" for n in names)]
        for row in self._rows(max_rows):
            if row is None:
                lines.append(f"{'...':>4}")
                continue
            label = f"L{self.layers[row]}H{self.heads[row]}"
            cells = " ".join(f"{columns[n][row]:>{width}.4f}" for n in names)
            lines.append(f"{row + 1:>4} {label:>7} {cells}")
        return "\n".join(lines)

    def to_html(self, max_rows: int | None = None) -> Markup:
        """An HTML table (no script, no style sheet); ``max_rows`` keeps the first and last rows."""
        columns = self._columns()
        names = list(columns)
        titles = {**RANKING_SCORES, "in_top_k": f"share of the jackknife's replicates with the head among the {self.top_k} first"}
        header = Markup("<tr><th>rank</th><th>head</th>{}</tr>").format(Markup("").join(
            Markup('<th title="{}">{}</th>').format(titles[n], Markup("<u>{}</u>").format(n) if n == self.key else n)
            for n in names
        ))
        body = []
        for row in self._rows(max_rows):
            if row is None:
                body.append(Markup('<tr><td colspan="{}">…</td></tr>').format(len(names) + 2))
                continue
            cells = Markup("").join(Markup("<td>{}</td>").format(f"{columns[n][row]:.4f}") for n in names)
            body.append(Markup("<tr><td>{}</td><td>L{}H{}</td>{}</tr>").format(row + 1, self.layers[row], self.heads[row], cells))
        return Markup('<table class="head-ranking"><caption>{}</caption>{}{}</table>').format(
            self._caption(), header, Markup("").join(body))

    def _repr_html_(self) -> str:
        return self.to_html(max_rows=20)


def head_scores(result: RankableResult) -> dict[str, np.ndarray]:
    """Every score of :data:`RANKING_SCORES` as a ``[layer, head]`` array (NaN ``toeplitz`` when
    the run kept no summed pattern, NaN for a query-position form the result names as undefined:
    ``result.undefined``)."""
    scores: dict[str, np.ndarray] = {}
    for name in RANKING_SCORES:
        if name in ("toeplitz", "toeplitz_per_doc", "prior_fit"):
            continue
        scale, form = name.split("_")
        try:
            scores[name] = np.asarray(result.query_position_r2(scale, form, by="head"), dtype=np.float64)
        except UndefinedStatisticError:  # a form the result names as undefined (an encoder's prior forms)
            scores[name] = np.full((result.n_layers, result.n_heads), np.nan)
    try:
        scores["toeplitz"] = result.toeplitz_r2("head")
    except NotRunError:  # the run kept no summed pattern: only the per-window score exists
        scores["toeplitz"] = np.full((result.n_layers, result.n_heads), np.nan)
    scores["toeplitz_per_doc"] = result.toeplitz_r2("head", estimator="per_doc")
    scores["prior_fit"] = prior_fit_by_head(result)
    return {name: scores[name] for name in RANKING_SCORES}


def prior_fit_by_head(result: RankableResult) -> np.ndarray:
    """``[layer, head]`` R² of the uniform prior on each head's persistence curve.

    The same number as ``result.persistence(by="head").r2("prior")`` (a test checks it), without
    the power and exponential fits of every head, which take seconds at long contexts:
    ``P(dt) = lag_sum / lag_count`` and the prior curve ``lag_prior_sum / lag_count`` over the
    lags that have entries, scored with :func:`~equivariance_probe.maths.fitting.curve_r2`.
    """
    arrays = result.statistics.numpy()
    count, prior_sum = arrays["lag_count"], arrays["lag_prior_sum"]  # [layer, lag]: shared by the heads
    out = np.full((result.n_layers, result.n_heads), np.nan)
    for layer in range(result.n_layers):
        has = count[layer] > 0
        prior = prior_sum[layer, has] / count[layer, has]
        for head in range(result.n_heads):
            out[layer, head] = curve_r2(arrays["lag_sum"][layer, head, has] / count[layer, has], prior)
    return out


def _ranked(values: np.ndarray, descending: bool) -> np.ndarray:
    """Flat indices of ``[layer, head]`` scores, most position-bound first: NaN last, ties in ``(layer, head)`` order."""
    layers, heads = np.meshgrid(np.arange(values.shape[0]), np.arange(values.shape[1]), indexing="ij")
    key = values.ravel()
    # lexsort sorts ascending by its last key first: NaN last, then the score, then (layer, head).
    signed = np.where(np.isnan(key), 0.0, -key if descending else key)
    return np.lexsort((heads.ravel(), layers.ravel(), signed, np.isnan(key)))


def ranking_stability(result: RankableResult, score: str = "log_eta2", top_k: int = TOP_K) -> dict[str, Any]:
    """In what share of the jackknife's replicates each head is among the ``top_k`` first by ``score``.

    Each replicate recomputes the score on every window but one group's and ranks the heads by the
    same rule as :func:`rank_heads`; a head's share is the fraction of replicates that put it in
    their top ``k``.

    Returns:
        ``{"key": score, "top_k": k, "share": [layer][head] lists}``, or ``{"key", "top_k", "unavailable":
        why}`` (what :meth:`ProbeResult.summary` stores).
    """
    check_integer("top_k", top_k, message=f"top_k={top_k!r} must be a positive number of heads, e.g. 10")
    try:
        replicates = result.head_score_replicates(score)
    except IntervalUnavailableError as error:
        return {"key": score, "top_k": top_k, "unavailable": str(error)}
    share = top_k_share(replicates, top_k, lambda values: _ranked(values, HIGHER_IS_MORE_POSITION_BOUND[score]))
    return {"key": score, "top_k": top_k, "share": share.tolist()}


def rank_heads(
    result: RankableResult,
    score: str = "log_eta2",
    scores: Sequence[str] | None = None,
    *,
    known_scores: Mapping[str, np.ndarray] | None = None,
    top_k: int | None = TOP_K,
    known_stability: Mapping[str, Any] | None = None,
) -> HeadRanking:
    """Order the heads of ``result`` from the most to the least position-bound.

    Args:
        result: a :class:`ProbeResult` with data.
        score: the ordering key, one of :data:`RANKING_SCORES` (default ``"log_eta2"``). Sorted
            descending unless it is a Toeplitz score (see the module docstring).
        scores: which score columns to keep (default: all); ``score`` is always kept.
        known_scores: every score as a ``[layer, head]`` array when already known (a loaded
            result's stored summary); default: computed from ``result``.
        top_k: report each head's share of replicates that rank it among the ``top_k`` first
            (:func:`ranking_stability`); ``None``: not.
        known_stability: :func:`ranking_stability`'s dict when already known (a stored summary's),
            used when its key and ``k`` are these.

    Returns:
        A :class:`HeadRanking` with ``n_layers * n_heads`` rows.

    Raises:
        InputError: ``score`` or a name in ``scores`` is not a known score, or a bad ``top_k``.
        EmptyResultError: the result holds no data (a :class:`~equivariance_probe.errors.NotRunError`).

    Example:
        >>> ranking = rank_heads(result)  # doctest: +SKIP
        >>> ranking.top(2), ranking.bottom(2)  # doctest: +SKIP
        ([(4, 3), (2, 0)], [(5, 1), (7, 2)])
    """
    if score not in RANKING_SCORES:
        raise InputError(f"score={score!r} is not a ranking score; choose one of {list(RANKING_SCORES)}")
    keep = list(RANKING_SCORES) if scores is None else list(scores)
    unknown = [name for name in keep if name not in RANKING_SCORES]
    if unknown:
        raise InputError(f"unknown scores {unknown}; choose from {list(RANKING_SCORES)}")
    if score not in keep:
        keep.insert(0, score)
    if result.n_windows == 0:
        raise EmptyResultError("this result holds no windows yet: call EquivarianceProbe(model).run(docs) first")
    grids = head_scores(result) if known_scores is None else {name: np.asarray(known_scores[name]) for name in RANKING_SCORES}
    layers, heads = np.meshgrid(np.arange(result.n_layers), np.arange(result.n_heads), indexing="ij")
    descending = HIGHER_IS_MORE_POSITION_BOUND[score]
    order = _ranked(grids[score], descending)
    stability, note = None, None
    if top_k is not None:
        known = dict(known_stability or {})
        found = known if (known.get("key"), known.get("top_k")) == (score, top_k) else ranking_stability(result, score, top_k)
        note = found.get("unavailable")
        share = found.get("share")
        stability = (np.full(len(order), np.nan) if not isinstance(share, list)
                     else np.asarray(share, dtype=np.float64).ravel()[order])
    return HeadRanking(
        layers=layers.ravel()[order],
        heads=heads.ravel()[order],
        scores={name: grids[name].ravel()[order] for name in RANKING_SCORES if name in keep},
        key=score,
        descending=descending,
        model=result.model_name,
        top_k=top_k,
        stability=stability,
        stability_note=note,
    )
