"""CircuitsVis views of individual heads on one document, rendered offline.

For a document and a few heads, :func:`head_views` runs the document once through the
probe's adapter (:func:`~equivariance_probe.adapters.passes.pattern_pass` streams ``pattern: [batch, head, query, key]``
layer by layer; only the chosen heads are kept) and builds, over a window of positions
``start <= q, k < stop``:

* the attention ``a[q, k]`` of each head;
* the uniform prior for the same mask, ``u[q, k] = 1/|V(q)|`` on visible entries (full
  causal: ``1/(q+1)``; sliding window ``w``: ``1/min(q+1, w)``) and 0 elsewhere — one per
  distinct mask among the chosen heads' layers;
* the log-ratio ``log(max(a, eps) / u(q))`` on visible entries (0 elsewhere): attention minus
  what position alone predicts. Positive: the head attends there more than a uniform head
  would; negative: less.

Place in the seams: *display*. These are drawn with ``circuitsvis.attention.attention_heads``,
offline (:mod:`~equivariance_probe.display.circuitsvis`): :meth:`HeadViews.to_html` (and the
notebook ``_repr_html_``) carries CircuitsVis' inline bundle once for all of its figures, and a
report carries it once for all views (``circuitsvis_bundle_script`` plus
:meth:`HeadViews.body_html`).

Sizes: values are rounded to ``decimals`` (default 3) before they are written, and a window
of positions keeps long contexts usable (default: the first :data:`DEFAULT_VIEW_POSITIONS`).
Under a causal mask the rows ``q < stop`` do not depend on later tokens, so only the first
``stop`` tokens are run.

Long windows: ``overview=True`` runs the whole document (up to ``context_length``) once and adds a
:class:`~equivariance_probe.display.overview.BlockOverview` of the same heads over every position: their
attention summed over blocks of positions (at most 256 blocks per side by default), drawn on canvases, so
the page's size does not grow with the window. The CircuitsVis views then show the range
``start..stop`` in full, outlined on the overview. Only one layer's pattern is held at a time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..adapters.passes import pattern_pass
from ..analyses.heads import HeadRanking
from ..errors import InputError, ModelNotFoundError, check_index, check_integer, is_integer, option
from ..markup import Markup
from ..probe import EquivarianceProbe
from ..result import ProbeResult
from ..sources.corpus import load_corpus
from ..sources.models import load_model
from ..sources.registry import name_of_converted_copy
from ..statistics.engines.in_trace import default_log_floor, uniform_prior, visible_mask
from .circuitsvis import CircuitsVisFigure, attention_heads_figure, save_views_page, views_body_html, views_html
from .overview import BlockOverview, check_heads, overview_of

__all__ = [
    "HeadViews",
    "head_views",
    "capture_head_patterns",
    "prior_pattern",
    "log_ratio",
    "parse_heads",
    "default_view_heads",
    "views_for_result",
    "DEFAULT_VIEW_POSITIONS",
]

#: Positions shown when ``stop`` is not given: ``start .. start + 128``.
DEFAULT_VIEW_POSITIONS = 128
#: Colour range of the log-ratio view: ``±4`` is a factor of e⁴ ≈ 55 from the prior.
DEFAULT_LOG_RATIO_LIMIT = 4.0


# -- numbers ------------------------------------------------------------------------------------
def capture_head_patterns(adapter: Any, tokens: torch.Tensor, heads: Sequence[tuple[int, int]]) -> np.ndarray:
    """Attention of the chosen heads on one window.

    Args:
        adapter: an :class:`~equivariance_probe.adapters.base.Adapter` (``probe.adapter``).
        tokens: ``[T]`` token ids of one window.
        heads: ``(layer, head)`` pairs.

    Returns:
        ``pattern: [n_heads, query, key]`` float64 (rows sum to 1 over visible keys).
    """
    check_heads(adapter.layout, heads)
    wanted: dict[int, list[int]] = {}
    for index, (layer, _) in enumerate(heads):
        wanted.setdefault(layer, []).append(index)
    n = int(tokens.shape[-1])
    out = np.zeros((len(heads), n, n))

    def keep(layer: int, pattern: torch.Tensor) -> None:
        # Only the chosen heads leave the callback: a [1, head, T, T] layer is dropped at once.
        for index in wanted.get(layer, ()):
            out[index] = pattern[0, heads[index][1]].to("cpu", torch.float64).numpy()

    pattern_pass(adapter, tokens.reshape(1, -1), keep)
    return out


def prior_pattern(n_positions: int, window: int | None) -> np.ndarray:
    """The uniform prior as a pattern: ``u[q, k] = 1/|V(q)|`` where ``k`` is visible from ``q``.

    Returns:
        ``[query, key]`` float64; 0 on hidden entries (``k > q``, or ``q - k >= window``).
    """
    visible = visible_mask(n_positions, window, torch.tensor([n_positions]))[0]
    prior = uniform_prior(n_positions, window).view(-1, 1)
    return torch.where(visible, prior, torch.zeros((), dtype=torch.float64)).numpy()


def log_ratio(pattern: np.ndarray, prior: np.ndarray, log_floor: float) -> np.ndarray:
    """``log(max(a, eps) / u)`` on visible entries (``prior > 0``), 0 on hidden ones.

    Args:
        pattern: ``[..., query, key]`` attention.
        prior: ``[query, key]`` from :func:`prior_pattern` (broadcast over leading axes).
        log_floor: ``eps``, as in the log scale of the statistics.
    """
    visible = np.broadcast_to(prior > 0, pattern.shape)
    safe_prior = np.where(prior > 0, prior, 1.0)
    ratio = np.log(np.maximum(pattern, log_floor)) - np.log(safe_prior)
    return np.where(visible, ratio, 0.0)


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"L4H3,L5H1"`` (or ``"4.3,5.1"``) -> ``[(4, 3), (5, 1)]``."""
    heads = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"[Ll](\d+)[Hh](\d+)|(\d+)[.:](\d+)", part)
        if match is None:
            raise InputError(f"cannot read the head {part!r}; write heads as 'L4H3' or '4.3', separated by commas")
        numbers = [int(g) for g in match.groups() if g is not None]
        heads.append((numbers[0], numbers[1]))
    return heads


# -- the views ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadViews:
    """Attention, uniform prior and log-ratio of a few heads over a window of one document.

    Attributes:
        tokens: ``[n]`` token strings of positions ``start .. stop``.
        heads: ``(layer, head)`` of each view.
        pattern: ``[n_heads, n, n]`` attention ``a[q, k]`` for ``start <= q, k < stop``.
        sliding_windows: per head, its layer's sliding window (``None``: full causal).
        start: first position shown (absolute, in the document).
        log_floor: ``eps`` of the log-ratio.
        decimals: values are rounded to this many decimals when rendered (``None``: not rounded).
        title: a caption (model, document).
        scores: per head, a short text of its ranking scores (may be empty).
        log_ratio_limit: colour range ``±limit`` of the log-ratio view.
        overview: the same heads over the whole document in blocks of positions, drawn above the views
            (``None``: none).
    """

    tokens: list[str]
    heads: list[tuple[int, int]]
    pattern: np.ndarray
    sliding_windows: list[int | None]
    start: int = 0
    log_floor: float = default_log_floor(torch.float32)
    decimals: int | None = 3
    title: str = ""
    scores: list[str] = field(default_factory=list)
    log_ratio_limit: float = DEFAULT_LOG_RATIO_LIMIT
    overview: BlockOverview | None = None

    @property
    def stop(self) -> int:
        return self.start + len(self.tokens)

    @property
    def labels(self) -> list[str]:
        return [f"L{layer}H{head}" for layer, head in self.heads]

    def _masks(self) -> list[int | None]:
        """Per head, its window as the shown positions see it: a window at least as wide as
        ``stop`` hides nothing there, so it is full causal (docs/methods.md#query-position-r2, η² groups)."""
        return [None if w is None or w >= self.stop else w for w in self.sliding_windows]

    def priors(self) -> dict[int | None, np.ndarray]:
        """``window -> u[q, k]`` over the shown positions, one per distinct mask of the heads."""
        return {w: prior_pattern(self.stop, w)[self.start :, self.start :] for w in dict.fromkeys(self._masks())}

    def log_ratios(self) -> np.ndarray:
        """``[n_heads, n, n]`` ``log(max(a, eps)/u(q))`` on visible entries, 0 elsewhere."""
        priors = self.priors()
        return np.stack([log_ratio(p, priors[w], self.log_floor) for p, w in zip(self.pattern, self._masks())])

    def _round(self, values: np.ndarray, decimals: int | None) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)  # float32 would print 17 digits after rounding
        return values if decimals is None else np.round(values, decimals) + 0.0  # + 0.0: no "-0.0"

    def _figures(self, decimals: int | None) -> list[tuple[str, CircuitsVisFigure]]:
        priors = self.priors()
        prior_names = [
            "uniform prior (full causal)" if w is None else f"uniform prior (window {w})" for w in priors
        ]
        attention = np.concatenate([self.pattern, np.stack(list(priors.values()))])
        first = attention_heads_figure(
            self._round(attention, decimals), self.tokens, [f"{label} attention" for label in self.labels] + prior_names,
            max_value=1.0, min_value=0.0, mask_upper_tri=True,
        )
        limit = self.log_ratio_limit
        second = attention_heads_figure(
            self._round(self.log_ratios(), decimals), self.tokens, [f"{label} log(a/u)" for label in self.labels],
            max_value=limit, min_value=-limit, positive_color="red", negative_color="blue", mask_upper_tri=True,
        )
        return [
            ("Attention a[q, k] of each head, and the uniform prior u(q) = 1/|V(q)| for the same mask", first),
            (f"Log-ratio log(a/u): red where the head attends more than position alone predicts, blue less "
             f"(colours saturate at ±{limit:g}; hidden entries 0)", second),
        ]

    def _caption(self, decimals: int | None) -> Markup:
        heads = ", ".join(
            label + (f" ({score})" if score else "")
            for label, score in zip(self.labels, self.scores or [""] * len(self.heads))
        )
        rounding = "not rounded" if decimals is None else f"rounded to {decimals} decimals"
        return Markup("<p>{} Positions {}..{} (queries and keys in this window only); heads {}; values {}; "
                      "log floor {}.</p>").format(self.title, self.start, self.stop - 1, heads, rounding, f"{self.log_floor:.3g}")

    def body_html(self, decimals: Any = ...) -> Markup:
        """The views without the CircuitsVis bundle: the page must already have run
        :func:`circuitsvis_bundle_script` (as the report does, once).

        ``decimals`` overrides :attr:`decimals` (``None``: not rounded)."""
        decimals = self.decimals if decimals is ... else decimals
        return self._overview_html() + views_body_html(self._caption(decimals), self._figures(decimals), "head-views")

    def to_html(self, decimals: Any = ...) -> Markup:
        """The views as one HTML fragment carrying the CircuitsVis bundle once (offline).

        ``decimals`` overrides :attr:`decimals` (``None``: not rounded)."""
        decimals = self.decimals if decimals is ... else decimals
        return self._overview_html() + views_html(self._caption(decimals), self._figures(decimals), "head-views")

    def _overview_html(self) -> Markup:
        # The overview's canvases are drawn by a plain script as the page is read, before CircuitsVis' module.
        return Markup("") if self.overview is None else self.overview.body_html()

    def _repr_html_(self) -> str:
        return self.to_html()

    def save(self, path: str | Path, decimals: Any = ...) -> Path:
        """Write a standalone, offline HTML page with the views, atomically.

        Raises:
            FileWriteError: the folder does not exist or is not writable, ``path`` is a folder, or the disk
                refused the write (nothing is left behind).
        """
        return save_views_page(path, "head views", self.to_html(decimals))

    def __repr__(self) -> str:
        return (
            f"HeadViews({', '.join(self.labels)}; positions {self.start}..{self.stop - 1}; "
            f"{'unrounded' if self.decimals is None else f'{self.decimals} decimals'}"
            f"{'' if self.overview is None else f'; overview of {self.overview.n_positions} positions'})"
        )


def _token_strings(adapter: Any, ids: list[int]) -> list[str]:
    tokenizer = adapter.tokenizer
    if tokenizer is None:
        return [str(i) for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def _document_ids(probe: EquivarianceProbe, document: Any, context_length: int | None) -> list[int]:
    if isinstance(document, str):
        ids = probe.adapter.encode(document)
    elif isinstance(document, torch.Tensor) and document.dim() == 1 and not document.is_floating_point():
        ids = document.tolist()
    elif isinstance(document, (list, tuple)) and all(is_integer(i) for i in document):
        ids = list(document)
    else:
        raise InputError(
            f"a document of type {type(document).__name__} cannot be viewed; pass one string, a 1-D integer "
            "tensor of token ids, or a list of int token ids"
        )
    if context_length is not None:
        ids = ids[:context_length]
    if not ids:
        raise InputError("the document has no tokens; pass a non-empty document")
    # The probe's own checks of token ids (integer dtype, ids inside the model's vocabulary).
    return next(probe._tensor_rows(torch.tensor(ids, dtype=torch.long), len(ids)))


def default_view_heads(ranking: HeadRanking, n_each: int = 2) -> list[tuple[int, int]]:
    """The ``n_each`` most and ``n_each`` least position-bound heads (most first, least last)."""
    top = ranking.top(n_each)
    bottom = [h for h in reversed(ranking.bottom(n_each)) if h not in top]
    return top + bottom


def head_views(
    model: Any,
    document: Any,
    *,
    heads: Sequence[tuple[int, int]] | str | None = None,
    result: ProbeResult | None = None,
    ranking: HeadRanking | None = None,
    start: int = 0,
    stop: int | None = None,
    context_length: int | None = None,
    decimals: int | None = 3,
    n_each: int = 2,
    tokenizer: Any | None = None,
    overview: bool = False,
    block_size: int | None = None,
) -> HeadViews:
    """Views of chosen heads on one document (see the module docstring).

    Args:
        model: an :class:`~equivariance_probe.probe.EquivarianceProbe`, or any model it accepts.
        document: one string (tokenised as the probe does: with special tokens, truncated to
            ``context_length``), or token ids (1-D tensor or list of int).
        heads: ``[(layer, head), ...]`` or ``"L4H3,L5H1"``. Default: the ``n_each`` most and least
            position-bound heads of ``ranking`` (or of ``result.rank_heads()``).
        result: the probe's result on a corpus; gives the default heads, the context length and
            the log floor.
        ranking: a :class:`~equivariance_probe.analyses.heads.HeadRanking` (default: ``result.rank_heads()``).
        start: the first position shown.
        stop: positions shown are ``start <= q, k < stop`` (default: ``start + 128``, capped at the
            document's length).
        context_length: truncate the document to this many tokens (default: the result's).
        decimals: round rendered values to this many decimals (``None``: full precision).
        n_each: how many of the most and of the least position-bound heads by default.
        tokenizer: for a plain Hugging Face model, its tokenizer.
        overview: also run the whole document (to ``context_length``) and draw an overview of the heads over
            every position in blocks (:class:`~equivariance_probe.display.overview.BlockOverview`); the
            CircuitsVis views keep ``start..stop``. For windows of thousands of positions.
        block_size: positions per block of the overview (default: ``ceil(T / 256)``; at most 512 blocks
            per side).

    Returns:
        :class:`HeadViews`; display it in a notebook, ``save`` it, or pass it to
        :func:`~equivariance_probe.display.report.render_report` (``render_report(result, views=views)``).

    Example:
        >>> views = head_views(probe, docs[0], result=result, stop=96)  # doctest: +SKIP
        >>> views.save("heads.html")  # doctest: +SKIP
        >>> long = head_views(probe, docs[0], heads="L4H3", overview=True, start=4000, stop=4096)  # doctest: +SKIP
    """
    probe = model if isinstance(model, EquivarianceProbe) else EquivarianceProbe(model, tokenizer=tokenizer)
    adapter = probe.adapter
    heads, ranking = _chosen_heads(heads, result, ranking, n_each)
    check_heads(adapter.layout, heads)  # before any lookup by layer (the sliding windows) or forward pass
    if context_length is None and result is not None:
        context_length = result.metadata.get("context_length")
    ids = _document_ids(probe, document, context_length)
    stop = _checked_range(start, stop, len(ids))
    log_floor = result.log_floor if result is not None and result.log_floor is not None else default_log_floor(adapter.dtype)
    sliding_windows = [adapter.layout.sliding_windows[layer] for layer, _ in heads]
    block_overview = None
    if overview:
        tokens = _token_strings(adapter, ids)
        block_overview, pattern = overview_of(adapter, ids, heads, tokens, block_size=block_size, detail=(start, stop),
                                              log_floor=log_floor, sliding_windows=sliding_windows)
    else:
        tokens = _token_strings(adapter, ids[start:stop])
        pattern = capture_head_patterns(adapter, torch.tensor(ids[:stop], dtype=torch.long), heads)[:, start:stop, start:stop]
    return HeadViews(
        tokens=tokens[start:stop] if overview else tokens,
        heads=heads,
        pattern=pattern.copy(),
        sliding_windows=sliding_windows,
        start=start,
        log_floor=log_floor,
        decimals=decimals,
        title=f"Model {_display_name(adapter.model_name)}, one document of {len(ids)} tokens.",
        scores=_rank_labels(ranking, heads),
        overview=block_overview,
    )


def _checked_range(start: int, stop: int | None, n_tokens: int) -> int:
    """The view's ``stop`` (default ``start + 128``, capped at the document), ``start..stop`` checked against it.

    Raises:
        InputError: the range does not fit the document's ``n_tokens`` tokens.
    """
    stop = min(n_tokens, start + DEFAULT_VIEW_POSITIONS) if stop is None else stop
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= n_tokens):
        raise InputError(
            f"positions start={start}, stop={stop} do not fit the document's {n_tokens} tokens; "
            f"pass 0 <= start < stop <= {n_tokens}"
        )
    return stop


def _chosen_heads(heads: Sequence[tuple[int, int]] | str | None, result: ProbeResult | None,
                  ranking: HeadRanking | None, n_each: int) -> tuple[list[tuple[int, int]], HeadRanking | None]:
    """``(heads, ranking)`` of a view: the heads asked for (parsed from ``"L4H3,L5H1"``), or the ``n_each`` most and
    least position-bound of the ranking (the result's own where none is given).

    Raises:
        InputError: no heads and nothing to rank them by, or an empty list.
    """
    if isinstance(heads, str):
        heads = parse_heads(heads)
    if heads is None:
        if ranking is None and result is None:
            raise InputError(
                "no heads to view: pass heads=[(layer, head), ...], or result= (or ranking=) to view the most "
                "and least position-bound heads"
            )
        ranking = ranking if ranking is not None else result.rank_heads()
        heads = default_view_heads(ranking, n_each)
    if ranking is None and result is not None:
        ranking = result.rank_heads()
    heads = [_head_pair(pair) for pair in heads]
    if not heads:
        raise InputError("heads is empty; pass at least one (layer, head)")
    return heads, ranking


def _head_pair(pair: Any) -> tuple[int, int]:
    """A ``(layer, head)`` pair as typed: two whole numbers (``(1.7, 0)`` is not the head L1H0, nor ``("1", 0)``)."""
    if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
        raise InputError(f"heads holds {pair!r}, which is not a (layer, head) pair; pass heads=[(4, 3), ...] or "
                         "heads='L4H3'")
    return check_index("heads", pair[0], example=[(4, 3)]), check_index("heads", pair[1], what="head", example=[(4, 3)])


def _rank_labels(ranking: HeadRanking | None, heads: list[tuple[int, int]]) -> list[str]:
    """Each head's rank and score in ``ranking``, as its view's caption says them (none without a ranking)."""
    if ranking is None:
        return []
    rows = {pair: row for row, pair in enumerate(ranking.order)}
    return [f"rank {rows[h] + 1}, {ranking.key} {ranking.scores[ranking.key][rows[h]]:.3f}" if h in rows else ""
            for h in heads]


def views_for_result(
    result: ProbeResult,
    *,
    heads: Sequence[tuple[int, int]] | str | None = None,
    document: int = 0,
    corpus: Any = None,
    start: int = 0,
    stop: int | None = None,
    decimals: int | None = 3,
    cache_dir: Any = None,
    overview: bool = False,
    block_size: int | None = None,
) -> tuple[HeadViews, str]:
    """Views for a saved result: reload its model and one document of its corpus.

    The model is the one the result's metadata names (the study's ``model`` argument, else
    the adapter's model name: a packaged name or a local folder), loaded offline with
    :func:`~equivariance_probe.sources.models.load_model`. The document is number ``document`` of
    ``corpus`` (default: the corpus the study recorded, else the packaged default corpus). ``overview`` and
    ``block_size`` are :func:`head_views`' (the overview covers the study's context length).

    Returns:
        ``(views, note)`` where ``note`` says which model and document were used.

    Raises:
        ModelNotFoundError: the model named in the metadata cannot be loaded here.
        InputError: no model is named, or the document does not exist.
    """
    study = result.metadata.get("study", {})
    name = study.get("model") or result.metadata.get("model", {}).get("name")
    if not name:
        raise ModelNotFoundError(
            "the result names no model, so its heads cannot be viewed; use head_views(model, document) from Python"
        )
    if corpus is None:
        corpus = study.get("corpus", "default")
        if corpus is None:
            raise InputError(
                f"the study's documents were passed in memory and are not in the result; pass {option('corpus', '...')} "
                "(a path) to choose the document to view"
            )
    source = None if corpus == "default" else corpus
    check_integer("document", document, minimum=0,
                  message=f"document must be a non-negative index into the corpus, got {document!r}")
    docs = load_corpus(source, n_docs=document + 1)
    if len(docs) <= document:
        raise InputError(f"the corpus has {len(docs)} documents, so there is no document {document}; pass a smaller index")
    model, tokenizer = load_model(str(name), cache_dir=cache_dir)
    views = head_views(
        model, docs[document], tokenizer=tokenizer, heads=heads, result=result, start=start, stop=stop, decimals=decimals,
        overview=overview, block_size=block_size,
    )
    corpus_name = "the packaged corpus" if source is None else str(source)
    return views, f"views of {', '.join(views.labels)} on document {document} of {corpus_name} with model {name}"


def _display_name(name: str) -> str:
    """A packaged model's registry name rather than its converted copy's path."""
    return name_of_converted_copy(name) or name
