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

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..adapters.internals import ablate
from ..adapters.modules import find_attention_modules, hf_model_of, parent_layer, residual_width
from ..errors import InputError, check_integer
from ..maths.intervals import Interval
from ..maths.probing import fold_interval, grouped_folds, grouped_ridge_scores

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
    hf = hf_model_of(model)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long)
    if tokens.dim() != 2 or positions.dim() != 2 or positions.shape[0] != tokens.shape[0]:
        raise InputError(f"tokens [n_windows, T] and positions [n_windows, P] must share n_windows; got shapes "
                         f"{tuple(tokens.shape)} and {tuple(positions.shape)}")
    layers = [parent_layer(hf, module) for module in find_attention_modules(hf)]
    parameter = next(hf.parameters())
    dtype = torch.float64 if parameter.dtype == torch.float64 else torch.float32
    per_window = positions.shape[1]
    out = torch.empty(len(layers) + 1, tokens.shape[0] * per_window, residual_width(hf), dtype=dtype)
    current = {"rows": positions[:0]}  # the batch's positions, [batch, P]
    offset = {"row": 0}

    def keep(row: int, hidden: torch.Tensor) -> None:
        index = current["rows"].to(hidden.device)
        picked = torch.gather(hidden, 1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        start = offset["row"]
        out[row, start : start + picked.shape[0] * per_window] = picked.reshape(-1, hidden.shape[-1]).to("cpu", dtype)

    def entering(module, args, kwargs):
        keep(0, args[0] if args else kwargs["hidden_states"])

    def leaving(row: int):
        def record(module, args, output):
            keep(row, output[0] if isinstance(output, tuple) else output)

        return record

    handles = [layers[0].register_forward_pre_hook(entering, with_kwargs=True)]
    handles += [layer.register_forward_hook(leaving(i + 1)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad(), ablate(hf, ablation) if ablation not in (None, "none") else contextlib.nullcontext():
            for start in range(0, len(tokens), batch_size):
                batch = tokens[start : start + batch_size]
                current["rows"], offset["row"] = positions[start : start + batch_size], start * per_window
                hf.base_model(input_ids=batch.to(parameter.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return out


@dataclass
class PositionProbe:
    """Held-out scores of linear position probes, per target, layer and document fold.

    Attributes:
        r2: ``{target: [layer, fold]}`` held-out R² (:data:`PROBE_TARGETS`; layer 0 the embeddings).
        mae: ``{target: [layer, fold]}`` held-out mean absolute error in tokens.
        alpha: ``{target: [layer, fold]}`` the ridge penalty chosen on the fold's training rows.
        positions: ``[n_windows, P]`` the positions probed.
        groups: ``[n_windows]`` each window's document.
        window_fold: ``[n_windows]`` the fold that held each window out.
        context_length: ``T``.
        min_position: the first position the sample could draw.
        ablation: the ablation in force (``"none"``), as :func:`~equivariance_probe.adapters.internals.ablate`.
        level: the intervals' confidence level.
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

    def interval(self, target: str = "position", score: str = "r2") -> Interval:
        """``[layer]`` mean over folds ``± t_{k-1}·sd/√k`` of ``score`` (``"r2"``, clipped at 1, or ``"mae"``)."""
        if target not in PROBE_TARGETS or score not in ("r2", "mae"):
            raise InputError(f"target must be one of {list(PROBE_TARGETS)} and score 'r2' or 'mae'; got "
                             f"{target!r}, {score!r}")
        table = getattr(self, score)[target]
        return fold_interval(table, level=self.level, upper=1.0 if score == "r2" else None)

    def best_layer(self, target: str = "position") -> int:
        """The layer with the highest mean held-out R²."""
        return int(np.nanargmax(self.r2[target].mean(1)))

    def summary(self) -> dict[str, Any]:
        """Per target: the mean held-out R² and MAE by layer with their intervals, and the best layer."""
        out: dict[str, Any] = {"n_windows": self.n_windows, "n_documents": self.n_documents, "n_folds": self.n_folds,
                               "positions_per_window": int(self.positions.shape[1]),
                               "context_length": self.context_length, "min_position": self.min_position,
                               "ablation": self.ablation, "level": self.level}
        for target in PROBE_TARGETS:
            r2, mae = self.interval(target, "r2"), self.interval(target, "mae")
            best = self.best_layer(target)
            out[target] = {"r2": np.asarray(r2.estimate).tolist(), "r2_low": np.asarray(r2.low).tolist(),
                           "r2_high": np.asarray(r2.high).tolist(), "mae": np.asarray(mae.estimate).tolist(),
                           "mae_low": np.asarray(mae.low).tolist(), "mae_high": np.asarray(mae.high).tolist(),
                           "interval": r2.method, "best_layer": best,
                           "best_r2": float(np.asarray(r2.estimate)[best]), "best_mae": float(np.asarray(mae.estimate)[best])}
        return out

    def __repr__(self) -> str:
        best = self.best_layer()
        r2 = self.interval("position")
        return (f"PositionProbe({self.n_windows} windows of {self.context_length} tokens from {self.n_documents} documents, "
                f"{self.positions.shape[1]} positions each, {self.n_folds} folds; best layer {best}: held-out R² "
                f"{np.asarray(r2.estimate)[best]:.3f} [{np.asarray(r2.low)[best]:.3f}, {np.asarray(r2.high)[best]:.3f}], "
                f"MAE {self.mae['position'][best].mean():.1f} tokens)")

    def to_dict(self) -> dict[str, Any]:
        return {"r2": {k: v.tolist() for k, v in self.r2.items()}, "mae": {k: v.tolist() for k, v in self.mae.items()},
                "alpha": {k: v.tolist() for k, v in self.alpha.items()}, "positions": self.positions.tolist(),
                "groups": self.groups.tolist(), "window_fold": self.window_fold.tolist(),
                "context_length": self.context_length, "min_position": self.min_position, "ablation": self.ablation,
                "level": self.level, "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionProbe:
        tables = {key: {k: np.asarray(v, dtype=np.float64) for k, v in data[key].items()} for key in ("r2", "mae", "alpha")}
        return cls(**tables, positions=np.asarray(data["positions"], dtype=np.int64),
                   groups=np.asarray(data["groups"], dtype=np.int64),
                   window_fold=np.asarray(data["window_fold"], dtype=np.int64),
                   context_length=int(data["context_length"]), min_position=int(data["min_position"]),
                   ablation=str(data["ablation"]), level=float(data["level"]), metadata=dict(data.get("metadata", {})))

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
        """Held-out R² and MAE per target and layer with their intervals over folds, in long form
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
        """A plain-text table: one line per layer, held-out R² and MAE of each target with their intervals over
        folds (``level`` as in :meth:`to_rows`)."""
        from ..maths.intervals import format_interval

        rows = {(row["statistic"], row["layer"]): row for row in self.to_rows(level)}
        columns = [f"probe_{score}_{target}" for target in PROBE_TARGETS for score in ("r2", "mae")]
        lines = [f"Position probe on {self.model_name}: {self.n_windows} windows of {self.context_length} tokens from "
                 f"{self.n_documents} documents, {self.n_folds} folds, {self.level:.0%} intervals over folds",
                 f"  {'layer':<6}" + "".join(f"{name.removeprefix('probe_'):>30}" for name in columns)]
        for layer in range(self.n_layers):
            cells = (format_interval(rows[(name, layer)]["value"], rows[(name, layer)]["low"],
                                     rows[(name, layer)]["high"], 3) for name in columns)
            lines.append(f"  {layer:<6}" + "".join(f"{cell:>30}" for cell in cells))
        return "\n".join(lines)


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

    Returns:
        :class:`PositionProbe`.

    Example:
        >>> fitted = position_probe(model, windows.tokens, groups=windows.spans)   # doctest: +SKIP
        >>> fitted.interval("position").estimate                                     # doctest: +SKIP
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() != 2:
        raise InputError(f"tokens must be [n_windows, T], got shape {tuple(tokens.shape)}")
    n_windows, context_length = tokens.shape
    window_groups = (np.arange(n_windows) if groups is None
                     else np.asarray(torch.as_tensor(groups).cpu() if isinstance(groups, torch.Tensor) else groups))
    if window_groups.shape != (n_windows,):
        raise InputError(f"groups must give one document per window ({n_windows}), got shape {window_groups.shape}")
    positions = probe_positions(n_windows, context_length, positions_per_window, min_position=min_position, seed=seed)
    per_window = positions.shape[1]
    row_groups = np.repeat(window_groups, per_window)
    folds = grouped_folds(row_groups, n_folds)  # raises before any forward pass on too few documents
    features = residual_samples(model, tokens, positions, batch_size=batch_size, ablation=ablation)
    position = positions.reshape(-1).numpy().astype(np.float64)
    targets = np.stack([position, np.log1p(position)], axis=1)
    tables: dict[str, dict[str, list[np.ndarray]]] = {key: {t: [] for t in PROBE_TARGETS} for key in ("r2", "mae", "alpha")}
    for layer in range(features.shape[0]):
        scores = grouped_ridge_scores(features[layer].numpy(), targets, row_groups, n_folds=n_folds,
                                      inverse=(None, np.expm1))
        for key in tables:
            for column, target in enumerate(PROBE_TARGETS):
                tables[key][target].append(scores[key][column])
    window_fold = np.empty(n_windows, dtype=np.int64)
    for fold, (_, held_out) in enumerate(folds):
        window_fold[np.unique(held_out // per_window)] = fold
    arrays = {key: {t: np.stack(rows) for t, rows in table.items()} for key, table in tables.items()}
    return PositionProbe(**arrays, positions=positions.numpy(), groups=window_groups.astype(np.int64),
                         window_fold=window_fold, context_length=int(context_length), min_position=int(min_position),
                         ablation=str(ablation or "none"), level=float(level),
                         metadata={"feature_dtype": str(features.dtype).replace("torch.", ""),
                                   "hidden_size": int(features.shape[-1]),
                                   "feature_bytes": int(features.numel() * features.element_size())})
