"""Linear position probes: can a token's absolute position be read linearly from its residual stream?

Place in the seams: *analyses*, beside :mod:`~equivariance_probe.analyses.order` (whose
:func:`~equivariance_probe.analyses.order.representation_sums` hooks the same decoder layers). It
runs windows through a Hugging Face model (or the one inside a TransformerBridge, nnsight model or
probe), keeps each layer's residual stream at a bounded sample of positions per window, and fits
the ridge probes of :mod:`~equivariance_probe.maths.probing` on them, scored on held-out documents
(docs/methods.md#probe). Haviv et al. 2022 ("Transformer Language Models without Positional
Encodings Still Learn Positional Information") decode position from each layer this way; the
shift test's residual-stream offset η² (docs/methods.md#shift-representations) is the variance
view of the same question, a probe the decoding view.

* **Layers.** Row ``0`` is the residual stream entering the first block (the embeddings, position
  embeddings added where the model has them), row ``l ≥ 1`` the output of block ``l - 1``: the
  numbering of ``transformers``' ``hidden_states``, without the final norm some models apply to
  the last entry.
* **Positions.** Per window, ``P`` positions, one drawn uniformly in each of ``P`` equal bins of
  ``min_position .. T-1`` (stratified: every window covers the range evenly); every position when
  ``P`` is at least the range. Only those rows are kept, so memory is
  ``(L+1)·n_windows·P·d`` numbers, whatever ``T`` (:func:`probe_feature_bytes`).
* **Targets.** The position ``p`` and ``log(1 + p)``; the second's absolute error is taken after
  ``exp(ŷ) - 1``, in tokens.
* **Groups.** The rows of a window, and the windows of one document, share a group: no document is
  both fitted and scored.
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
from ..errors import InputError, IntervalUnavailableError, NonFiniteActivationError, check_integer
from ..maths.intervals import Interval, check_level, format_interval, jackknife_interval
from ..maths.probing import check_fold_targets, grouped_folds, grouped_ridge_scores, jackknife_scores, pooled_scores
from ..statistics.groups import DEFAULT_INTERVAL_GROUPS
from ..statistics.options import token_id_tensor

__all__ = [
    "PROBE_TARGETS",
    "PositionProbe",
    "position_probe",
    "probe_positions",
    "residual_samples",
    "probe_feature_bytes",
]

#: What the probes predict: the position ``p`` and ``log(1 + p)``.
PROBE_TARGETS = ("position", "log1p_position")


def probe_positions(n_windows: int, context_length: int, per_window: int, *, min_position: int = 1,
                    seed: int = 0) -> torch.Tensor:
    """``[n_windows, P]`` sorted positions: one uniform draw in each of ``P`` equal bins of ``min_position .. T-1``.

    ``P = min(per_window, T - min_position)``; with ``P = T - min_position`` every position is taken.
    """
    check_integer("per_window", per_window, minimum=1,
                  message=f"positions per window must be a positive integer, got {per_window!r}")
    if not 0 <= min_position < context_length:
        raise InputError(f"min_position={min_position!r} must lie in 0..{context_length - 1} (the window's positions)")
    span = context_length - min_position
    count = min(int(per_window), span)
    if count == span:
        return torch.arange(min_position, context_length).expand(n_windows, -1).clone()
    edges = min_position + np.floor(np.linspace(0, span, count + 1)).astype(np.int64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(edges[:-1], edges[1:], size=(n_windows, count))  # bins are non-empty: span > count
    return torch.as_tensor(draws, dtype=torch.long)


def probe_feature_bytes(n_layers: int, n_windows: int, per_window: int, hidden_size: int, bytes_per_number: int = 4) -> int:
    """Bytes of the probe's kept residual streams: ``(n_layers + 1)·n_windows·P·d·bytes``.

    ``n_layers`` counts blocks (the embeddings' row is the ``+ 1``). Float32 unless the model
    computes in float64. The forward passes' own activations (``batch·T·d`` per layer, and the
    attention scores where the kernel is eager) come on top, as in any run.
    """
    return (int(n_layers) + 1) * int(n_windows) * int(per_window) * int(hidden_size) * int(bytes_per_number)


def residual_samples(model: Any, tokens: torch.Tensor, positions: torch.Tensor, *, batch_size: int = 4,
                     ablation: str | None = None) -> torch.Tensor:
    """The residual stream at the given positions of each window, every layer: ``[L+1, n_windows·P, d]``.

    Args:
        model: a ``transformers`` model (causal LM or encoder; or wrapped, see the module docstring).
        tokens: ``[n_windows, T]`` token ids.
        positions: ``[n_windows, P]`` positions to keep (:func:`probe_positions`); row ``w·P + j``
            of the result is window ``w`` at ``positions[w, j]``.
        batch_size: windows per forward pass.
        ablation: ``None``, or an ablation of :func:`~equivariance_probe.adapters.internals.ablate`
            (``"no_positions"``, ``"no_mask"``, ``"no_mask+no_positions"``) in force during the passes.

    Returns:
        float32 (float64 where the model computes in float64), on the CPU.
    """
    adapter = adapter_of(model)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long)
    if tokens.dim() != 2 or positions.dim() != 2 or positions.shape[0] != tokens.shape[0]:
        raise InputError(f"tokens [n_windows, T] and positions [n_windows, P] must share n_windows; got shapes "
                         f"{tuple(tokens.shape)} and {tuple(positions.shape)}")
    n_layers = adapter.layout.n_layers
    dtype = torch.float64 if adapter.dtype == torch.float64 else torch.float32
    per_window = positions.shape[1]

    def plan_for(rows: torch.Tensor, first: int) -> Any:
        """Reads of the residual stream entering block 0 and after every block, at ``rows: [batch, P]``; the
        rows are picked where the model runs, so a remote model sends back ``P × d`` per window and layer."""
        def picked(hidden: torch.Tensor, index: torch.Tensor = rows) -> torch.Tensor:
            index = index.to(hidden.device)
            return torch.gather(hidden, 1, index[..., None].expand(-1, -1, hidden.shape[-1]))

        def keep(row: int):
            def store(values: torch.Tensor) -> None:
                out[row, first : first + values.shape[0] * per_window] = values.reshape(-1, values.shape[-1]).to("cpu", dtype)
            return Read(store, reduce=picked)

        # Nothing after the last block is needed.
        return adapter.plan([("embedding", keep(0)), *((f"resid.{layer}", keep(layer + 1)) for layer in range(n_layers)),
                             (f"resid.{n_layers - 1}", Stop())], ablation=ablation)

    adapter.check_plan(plan_for(positions[:0], 0))  # what the framework cannot run is refused before any pass
    out = torch.empty(n_layers + 1, tokens.shape[0] * per_window, residual_width(adapter.model), dtype=dtype)
    for start in range(0, len(tokens), batch_size):
        adapter.run_plan(tokens[start : start + batch_size], plan_for(positions[start : start + batch_size], start * per_window))
    return out


@dataclass
class PositionProbe:
    """Held-out scores of linear position probes, per target and layer, with their intervals.

    Attributes:
        r2: ``{target: [layer, fold]}`` held-out R² of each fold (:data:`PROBE_TARGETS`; layer 0 the embeddings).
        mae: ``{target: [layer, fold]}`` held-out mean absolute error in tokens of each fold.
        alpha: ``{target: [layer, fold]}`` the ridge penalty chosen on the fold's training rows.
        positions: ``[n_windows, P]`` the positions probed.
        groups: ``[n_windows]`` each window's document.
        window_fold: ``[n_windows]`` the fold that held each window out.
        context_length: ``T``.
        min_position: the first position the sample could draw.
        ablation: the ablation in force (``"none"``), as :func:`~equivariance_probe.adapters.internals.ablate`.
        level: the intervals' confidence level.
        sums: ``{target: [layer, 5]}`` the :data:`~equivariance_probe.maths.probing.SCORE_SUMS` of every
            row's held-out prediction (the pooled scores follow); ``None`` in results written before
            they were kept (no intervals).
        replicate_sums: ``{target: [layer, G, 5]}`` the same for each jackknife replicate (the rows of
            every group of documents but ``g``, predicted by probes refitted without them).
        constant: ``[layer, fold]`` features treated as constant (spread at rounding level,
            :func:`~equivariance_probe.maths.probing.constant_features`); ``None`` in older results.
        interval_groups: ``G``, the groups of documents the jackknife deletes one at a time.
    """

    r2: dict[str, np.ndarray]
    mae: dict[str, np.ndarray]
    alpha: dict[str, np.ndarray]
    positions: np.ndarray
    groups: np.ndarray
    window_fold: np.ndarray
    context_length: int
    min_position: int = 1
    ablation: str = "none"
    level: float = 0.95
    metadata: dict[str, Any] = field(default_factory=dict)
    sums: dict[str, np.ndarray] | None = None
    replicate_sums: dict[str, np.ndarray] | None = None
    constant: np.ndarray | None = None
    interval_groups: int = DEFAULT_INTERVAL_GROUPS

    @property
    def n_layers(self) -> int:
        """Residual-stream rows: blocks + 1."""
        return int(next(iter(self.r2.values())).shape[0])

    @property
    def n_folds(self) -> int:
        return int(next(iter(self.r2.values())).shape[1])

    @property
    def n_windows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_documents(self) -> int:
        return int(len(np.unique(self.groups)))

    def score(self, target: str = "position", score: str = "r2") -> np.ndarray:
        """``[layer]`` the pooled held-out ``score`` (``"r2"`` or ``"mae"``) of every row's held-out prediction
        (docs/methods.md#probe); the mean over folds in results written before the sums were kept."""
        _check_score(target, score)
        if self.sums is None:
            return getattr(self, score)[target].mean(1)
        return pooled_scores(self.sums[target])[0 if score == "r2" else 1]

    def interval(self, target: str = "position", score: str = "r2") -> Interval:
        """``[layer]`` the pooled held-out ``score`` (``"r2"``, clipped at 1, or ``"mae"`` in tokens) with its
        delete-a-group jackknife interval over groups of documents (:func:`~equivariance_probe.maths.probing.jackknife_scores`).

        Raises:
            IntervalUnavailableError: a result written before the per-document sums were kept (run it
                again), or fewer than two documents.
        """
        _check_score(target, score)
        if self.sums is None or self.replicate_sums is None:
            raise IntervalUnavailableError(
                "this position probe was written before its per-document sums were kept, and the interval over "
                "folds it had is not valid (the folds share their training rows); run the probe again")
        estimate, replicates = jackknife_scores(self.sums[target], self.replicate_sums[target])[score]
        return jackknife_interval(estimate, replicates, level=self.level, upper=1.0 if score == "r2" else None)

    def best_layer(self, target: str = "position") -> int:
        """The layer with the highest pooled held-out R²."""
        return int(np.nanargmax(self.score(target, "r2")))

    def summary(self) -> dict[str, Any]:
        """Per target: the pooled held-out R² and MAE by layer with their intervals, and the best layer."""
        out: dict[str, Any] = {"n_windows": self.n_windows, "n_documents": self.n_documents, "n_folds": self.n_folds,
                               "positions_per_window": int(self.positions.shape[1]),
                               "context_length": self.context_length, "min_position": self.min_position,
                               "ablation": self.ablation, "level": self.level, "interval_groups": self.interval_groups}
        if self.constant is not None:
            out["constant_features"] = self.constant.max(1).astype(int).tolist()
        for target in PROBE_TARGETS:
            best = self.best_layer(target)
            part: dict[str, Any] = {"best_layer": best}
            for score in ("r2", "mae"):
                estimate = self.score(target, score)
                try:
                    found = self.interval(target, score)
                    low, high, method = np.asarray(found.low), np.asarray(found.high), found.method
                except IntervalUnavailableError as error:
                    low = high = np.full_like(estimate, np.nan)
                    method = f"unavailable: {error}"
                part["interval" if score == "r2" else "mae_interval"] = method
                part |= {score: estimate.tolist(), f"{score}_low": low.tolist(), f"{score}_high": high.tolist(),
                         f"best_{score}": float(estimate[best])}
            out[target] = part
        return out

    def __repr__(self) -> str:
        best = self.best_layer()
        r2 = self.summary()["position"]
        return (f"PositionProbe({self.n_windows} windows of {self.context_length} tokens from {self.n_documents} documents, "
                f"{self.positions.shape[1]} positions each, {self.n_folds} folds; best layer {best}: held-out R² "
                f"{format_interval(r2['r2'][best], r2['r2_low'][best], r2['r2_high'][best], 3)}, mean |error| "
                f"{format_interval(r2['mae'][best], r2['mae_low'][best], r2['mae_high'][best], 1)} tokens)")

    def to_dict(self) -> dict[str, Any]:
        out = {"r2": {k: v.tolist() for k, v in self.r2.items()}, "mae": {k: v.tolist() for k, v in self.mae.items()},
               "alpha": {k: v.tolist() for k, v in self.alpha.items()}, "positions": self.positions.tolist(),
               "groups": self.groups.tolist(), "window_fold": self.window_fold.tolist(),
               "context_length": self.context_length, "min_position": self.min_position, "ablation": self.ablation,
               "level": self.level, "metadata": self.metadata, "interval_groups": self.interval_groups}
        for name in ("sums", "replicate_sums"):
            if getattr(self, name) is not None:
                out[name] = {k: v.tolist() for k, v in getattr(self, name).items()}
        if self.constant is not None:
            out["constant"] = self.constant.tolist()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionProbe:
        tables = {key: {k: np.asarray(v, dtype=np.float64) for k, v in data[key].items()} for key in ("r2", "mae", "alpha")}
        sums = {name: None if data.get(name) is None else {k: np.asarray(v, dtype=np.float64) for k, v in data[name].items()}
                for name in ("sums", "replicate_sums")}
        return cls(**tables, positions=np.asarray(data["positions"], dtype=np.int64),
                   groups=np.asarray(data["groups"], dtype=np.int64),
                   window_fold=np.asarray(data["window_fold"], dtype=np.int64),
                   context_length=int(data["context_length"]), min_position=int(data["min_position"]),
                   ablation=str(data["ablation"]), level=float(data["level"]), metadata=dict(data.get("metadata", {})),
                   **sums,
                   constant=None if data.get("constant") is None else np.asarray(data["constant"], dtype=np.int64),
                   interval_groups=int(data.get("interval_groups", DEFAULT_INTERVAL_GROUPS)))


    # -- the Result protocol: every number as rows, a table and a data frame ----------------------
    @property
    def model_name(self) -> str:
        """The model probed, as its study names it (``metadata["model"]``), else ``"?"``."""
        return str(self.metadata.get("model", "?"))

    @property
    def complete(self) -> bool:
        """A probe is computed whole: always ``True``."""
        return True

    @property
    def config(self) -> dict[str, Any]:
        """How the probe was run: context length, first position, ablation, folds and interval level."""
        return {"context_length": self.context_length, "min_position": self.min_position, "ablation": self.ablation,
                "n_folds": self.n_folds, "level": self.level}

    @property
    def undefined(self) -> dict[str, str]:
        """No number of a probe is undefined by construction: ``{}``."""
        return {}

    def to_rows(self, level: float = 0.95) -> list[dict[str, Any]]:
        """Pooled held-out R² and mean absolute distance per target and layer with their jackknife intervals over
        groups of documents, in long form
        (:func:`~equivariance_probe.analyses.tidy.position_probe_rows`; ``level`` is accepted as every result
        accepts it: the intervals are at the level the probe was run with, :attr:`level`)."""
        from .tidy import position_probe_rows

        return position_probe_rows(self, {"kind": "position_probe", "model": self.model_name,
                                          "mode": self.ablation})

    def to_dataframe(self) -> Any:
        """:meth:`to_rows` as a pandas ``DataFrame``.

        Raises:
            MissingDependencyError: pandas is not installed (the message gives ``pip install pandas``).
        """
        from .tidy import rows_dataframe

        return rows_dataframe(self.to_rows(), "PositionProbe.to_dataframe()")

    def table(self, level: float = 0.95) -> str:
        """A plain-text table: one line per layer, held-out R² and mean absolute distance of each target with their
        jackknife intervals (``level`` as in :meth:`to_rows`)."""
        from ..maths.intervals import format_interval

        rows = {(row["statistic"], row["layer"]): row for row in self.to_rows(level)}
        columns = [f"probe_{score}_{target}" for target in PROBE_TARGETS for score in ("r2", "mae")]
        lines = [f"Position probe on {self.model_name}: {self.n_windows} windows of {self.context_length} tokens from "
                 f"{self.n_documents} documents, {self.n_folds} folds, {self.level:.0%} jackknife intervals over "
                 "groups of documents",
                 f"  {'layer':<6}" + "".join(f"{name.removeprefix('probe_'):>30}" for name in columns)]
        for layer in range(self.n_layers):
            cells = (format_interval(rows[(name, layer)]["value"], rows[(name, layer)]["low"],
                                     rows[(name, layer)]["high"], 3) for name in columns)
            lines.append(f"  {layer:<6}" + "".join(f"{cell:>30}" for cell in cells))
        return "\n".join(lines)


def _check_score(target: str, score: str) -> None:
    if target not in PROBE_TARGETS or score not in ("r2", "mae"):
        raise InputError(f"target must be one of {list(PROBE_TARGETS)} and score 'r2' or 'mae'; got {target!r}, {score!r}")


def _check_finite(features: torch.Tensor) -> None:
    """Name the layers whose kept residual stream holds NaN or infinity, before any fit."""
    bad = [layer for layer in range(features.shape[0]) if not bool(torch.isfinite(features[layer]).all())]
    if bad:
        rows = int((~torch.isfinite(features[bad[0]])).any(-1).sum())
        raise NonFiniteActivationError(
            f"the residual stream holds NaN or infinity at layer(s) {bad} (layer 0: the embeddings; {rows} of "
            f"{features.shape[1]} kept rows at layer {bad[0]}); the model's weights or its dtype overflow: check the "
            "weights for NaN, or load it in float32")


def position_probe(
    model: Any,
    tokens: torch.Tensor,
    *,
    groups: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    positions_per_window: int = 32,
    min_position: int = 1,
    n_folds: int = 5,
    batch_size: int = 4,
    ablation: str | None = None,
    level: float = 0.95,
    seed: int = 0,
    interval_groups: int = DEFAULT_INTERVAL_GROUPS,
) -> PositionProbe:
    """Fit linear position probes to every layer's residual stream, scored on held-out documents.

    Per layer, a standardised ridge regression (:func:`~equivariance_probe.maths.probing.grouped_ridge_scores`)
    predicts each sampled token's position and ``log(1 + position)`` from its residual stream;
    GroupKFold by document holds documents out.

    Args:
        model: a ``transformers`` causal LM or encoder (or a TransformerBridge, nnsight model or
            :class:`~equivariance_probe.EquivarianceProbe`: the Hugging Face model inside runs).
        tokens: ``[n_windows, T]`` token ids (e.g. :func:`~equivariance_probe.sources.packing.pack_documents`
            with ``protocol="document_prefixes"``: several windows per document).
        groups: ``[n_windows]`` document of each window (e.g. ``PackedWindows.spans``); ``None``:
            every window its own document.
        positions_per_window: ``P``, positions kept per window.
        min_position: first position drawn (1 leaves out position 0, which holds a BOS, and so
            the same token, in every window of many models).
        n_folds: ``k`` of GroupKFold (at most the number of documents).
        batch_size: windows per forward pass.
        ablation: an ablation in force during the passes (``"no_positions"``: rotary and learned
            position tables removed; ``"no_mask"``; both), or ``None``.
        level: the intervals' confidence level.
        seed: seed of the position sample.
        interval_groups: ``G``, the groups of documents the intervals' jackknife deletes one at a time
            (document ``i`` in sorted order in group ``i mod G``; every document its own group when
            there are at most ``G``).

    Returns:
        :class:`PositionProbe`.

    Raises:
        InputError: bad tokens or groups, fewer than two documents, or a held-out fold with fewer than
            two distinct positions (all before any forward pass).
        NonFiniteActivationError: a layer's residual stream holds NaN or infinity (named, before any fit).

    Example:
        >>> fitted = position_probe(model, windows.tokens, groups=windows.spans)   # doctest: +SKIP
        >>> fitted.interval("position").estimate                                     # doctest: +SKIP
    """
    tokens = token_id_tensor(tokens)  # a float id is refused, not truncated to another token
    level = check_level(level, "level")  # before any pass, not when the first interval is asked for
    if tokens.dim() != 2:
        raise InputError(f"tokens must be [n_windows, T], got shape {tuple(tokens.shape)}")
    n_windows, context_length = tokens.shape
    window_groups = (np.arange(n_windows) if groups is None
                     else np.asarray(torch.as_tensor(groups).cpu() if isinstance(groups, torch.Tensor) else groups))
    if window_groups.shape != (n_windows,):
        raise InputError(f"groups must give one document per window ({n_windows}), got shape {window_groups.shape}")
    check_integer("interval_groups", interval_groups, minimum=2,
                  message=f"interval_groups={interval_groups!r} must be an integer of at least 2, e.g. 20")
    positions = probe_positions(n_windows, context_length, positions_per_window, min_position=min_position, seed=seed)
    per_window = positions.shape[1]
    row_groups = np.repeat(window_groups, per_window)
    position = positions.reshape(-1).numpy().astype(np.float64)
    folds = grouped_folds(row_groups, n_folds)  # raises before any forward pass on too few documents
    check_fold_targets(position, folds)  # and on a fold with one position
    adapter = adapter_of(model)  # built once: the samples run through it, and it says the dtype without local weights
    features = residual_samples(adapter, tokens, positions, batch_size=batch_size, ablation=ablation)
    _check_finite(features)
    computed = adapter.dtype
    eps = float(torch.finfo(computed).eps) if computed.is_floating_point else float(torch.finfo(features.dtype).eps)
    targets = np.stack([position, np.log1p(position)], axis=1)
    keys = ("r2", "mae", "alpha", "sums", "replicate_sums")
    tables: dict[str, dict[str, list[np.ndarray]]] = {key: {t: [] for t in PROBE_TARGETS} for key in keys}
    constant = []
    for layer in range(features.shape[0]):
        scores = grouped_ridge_scores(features[layer].numpy(), targets, row_groups, n_folds=n_folds,
                                      inverse=(None, np.expm1), eps=eps, n_groups=interval_groups)
        for key in keys:
            for column, target in enumerate(PROBE_TARGETS):
                tables[key][target].append(scores[key][column])
        constant.append(scores["constant"])
    window_fold = np.empty(n_windows, dtype=np.int64)
    for fold, (_, held_out) in enumerate(folds):
        window_fold[np.unique(held_out // per_window)] = fold
    arrays = {key: {t: np.stack(rows) for t, rows in table.items()} for key, table in tables.items()}
    return PositionProbe(**arrays, positions=positions.numpy(), groups=window_groups.astype(np.int64),
                         window_fold=window_fold, context_length=int(context_length), min_position=int(min_position),
                         ablation=str(ablation or "none"), level=float(check_level(level)), constant=np.stack(constant),
                         interval_groups=int(interval_groups),
                         metadata={"feature_dtype": str(features.dtype).replace("torch.", ""),
                                   "compute_dtype": str(computed).replace("torch.", ""),
                                   "hidden_size": int(features.shape[-1]),
                                   "feature_bytes": int(features.numel() * features.element_size())})
