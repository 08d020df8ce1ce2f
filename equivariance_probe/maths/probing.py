"""Linear probes: cross-validated ridge regression of a target on features, scored on held-out groups.

Place in the seams: *maths*, pure functions of numpy arrays (scikit-learn's GroupKFold imported when
used). :mod:`~equivariance_probe.analyses.position_probe` calls :func:`grouped_ridge_scores` once
per layer with the residual stream at sampled positions as features and the positions as targets
(docs/methods.md#probe; Haviv et al. 2022, "Transformer Language Models without Positional
Encodings Still Learn Positional Information", probe position from each layer this way).

For each of ``k`` folds of :class:`sklearn.model_selection.GroupKFold` (no group on both sides):

* each feature is standardised by the training rows' mean and standard deviation (scikit-learn's
  ``StandardScaler``); a feature whose spread is at the rounding level of the dtype it was computed
  in (:func:`constant_features`) is treated as constant and carries nothing;
* a ridge regression ``‖y - Zw - b‖² + α‖w‖²`` (intercept not penalised) is fitted with ``α``
  chosen per target from :data:`RIDGE_ALPHAS` by exact leave-one-out error on the training rows:
  scikit-learn's ``RidgeCV(alphas, alpha_per_target=True)``, computed by :func:`ridge_fold` from one
  eigendecomposition of the centred, standardised training rows that serves every penalty and
  every target;
* the held-out rows are predicted and scored: per fold ``R² = 1 - Σ(y - ŷ)² / Σ(y - ȳ)²`` (``ȳ`` the
  fold's own mean, scikit-learn's ``r2_score``) and the mean absolute error ``mean|y - ŷ|``.

Every row is held out by exactly one fold, so the folds give each row one held-out prediction.
The headline scores pool them (:func:`pooled_scores`): ``R² = 1 - Σ_i(y_i - ŷ_i)² / Σ_i(y_i - ȳ)²``
over all rows and ``MAE = mean_i |p_i - p̂_i|``, from their sums (:data:`SCORE_SUMS`). The
jackknife replicates (:func:`jackknife_scores`) delete one group of documents at a time
(:func:`document_groups`): its rows are neither scored nor, through the exact leave-a-group-out
update of :func:`ridge_fold`, used to fit the probes that score the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = ["RIDGE_ALPHAS", "ROUNDING_SPREAD", "SCORE_SUMS", "grouped_folds", "check_fold_targets",
           "constant_features", "ridge_fold", "grouped_ridge_scores", "document_groups", "score_sums",
           "pooled_scores", "jackknife_scores"]

#: The ridge penalties chosen from: ``10⁻⁶ .. 10⁵``, 23 values half a decade apart (the features are
#: standardised, so one grid serves every model's scale). The low end matters where residual
#: directions are nearly collinear (the smallest eigenvalues of ``ZᵀZ`` fall far below 1); with one
#: eigendecomposition per fold a penalty costs one ``[n, r]`` product, so the grid is not trimmed.
RIDGE_ALPHAS = tuple(float(a) for a in np.logspace(-6, 5, 23))
#: A feature whose standard deviation over the training rows is at most this many units of rounding
#: (``eps`` of the dtype it was computed in, times a typical feature's magnitude) is constant. Rounding
#: noise measured on a float32 rotary model fed one token everywhere: at most 1.2 such units.
ROUNDING_SPREAD = 16.0
#: The sums behind :func:`pooled_scores`, in this order on their last axis:
#: rows, ``Σy``, ``Σy²``, ``Σ(y - ŷ)²``, ``Σ|p - p̂|`` (the absolute error in the first target's units).
SCORE_SUMS = ("rows", "sum_y", "sum_y2", "sum_squared_error", "sum_absolute_error")


def grouped_folds(groups: Any, n_folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(train rows, held-out rows)`` of each of ``min(n_folds, G)`` GroupKFold folds over ``G`` groups.

    Raises:
        InputError: fewer than 2 groups, or ``n_folds < 2``.
    """
    from sklearn.model_selection import GroupKFold

    groups = np.asarray(groups)
    n_groups = len(np.unique(groups))
    if isinstance(n_folds, bool) or not isinstance(n_folds, (int, np.integer)) or n_folds < 2:
        raise InputError(f"n_folds={n_folds!r} must be an integer of at least 2, e.g. 5")
    if n_groups < 2:
        raise InputError(f"the rows fall into {n_groups} group(s) (documents); held-out scoring needs at least 2: "
                         "pass more documents")
    splitter = GroupKFold(n_splits=min(int(n_folds), n_groups))
    return list(splitter.split(np.zeros((len(groups), 1)), groups=groups))


def check_fold_targets(target: Any, folds: list[tuple[np.ndarray, np.ndarray]], what: str = "position") -> None:
    """Refuse a design in which some held-out fold has fewer than two distinct target values.

    Such a fold has no variance to explain: its R² is ``0/0`` (scikit-learn scores a constant
    prediction of a constant ``1``) and its error says nothing about the probe.

    Raises:
        InputError: naming the fold and its one value.
    """
    target = np.asarray(target)
    for fold, (_, held_out) in enumerate(folds):
        values = np.unique(target[held_out])
        if len(values) < 2:
            raise InputError(f"held-out fold {fold} has {len(values)} distinct {what}(s) ({values.tolist()[:3]}); a "
                             f"probe's held-out score needs at least 2 in every fold: sample more {what}s per window "
                             "(positions_per_window) or use longer windows")


def constant_features(x: np.ndarray, eps: float) -> np.ndarray:
    """``[d]`` True where a feature is constant over the rows ``x`` ``[n, d]``, up to rounding.

    Constant: scikit-learn's ``StandardScaler`` rule in float64 (``var ≤ n·ε₆₄·var + (n·|mean|·ε₆₄)²``),
    or a standard deviation of at most :data:`ROUNDING_SPREAD` ``· eps · scale``, with ``eps`` the
    machine epsilon of the dtype the features were *computed* in and ``scale`` the median over
    features of their root-mean-square (a typical feature's magnitude, which a few massive
    coordinates do not move). A spread that small is that dtype's rounding noise: standardising it
    would stretch noise into a signal (a float32 rotary model fed the same token everywhere computes
    position-dependent rounding, which a standardised probe reads perfectly).
    """
    mean = x.mean(0)
    var = x.var(0)
    n = len(x)
    eps64 = np.finfo(np.float64).eps
    constant = var <= n * eps64 * var + (n * mean * eps64) ** 2
    scale = float(np.median(np.sqrt(np.mean(x * x, axis=0)))) if x.size else 0.0
    return constant | (np.sqrt(var) <= ROUNDING_SPREAD * float(eps) * scale)


def ridge_fold(train: np.ndarray, y: np.ndarray, test: np.ndarray, alphas: tuple[float, ...] = RIDGE_ALPHAS,
               *, constant: np.ndarray | None = None,
               delete: tuple[np.ndarray, ...] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standardise on ``train``, choose ``α`` per target by exact leave-one-out, predict ``test``.

    With ``Z`` the standardised, centred training rows (constant features left out) and one
    eigendecomposition ``ZᵀZ = V·diag(s)·Vᵀ`` (or ``ZZᵀ = U·diag(s)·Uᵀ`` when rows are fewer than
    features), every penalty's hat matrix is ``H_α = 11ᵀ/n + Q·diag(1/(s + α))·Qᵀ`` with ``Q = ZV``
    (``Q = U·diag(s)^½``), so the leave-one-out residuals ``(y_i - ŷ_i)/(1 - H_α,ii)`` of all
    penalties and targets cost ``[n, r]`` products. The chosen ``α`` minimises their mean square
    (the first on ties), as scikit-learn's ``RidgeCV`` chooses.

    Leaving a set ``S`` of training rows out (the same standardisation and ``α``) moves the test
    predictions by exactly ``-(1ᵀc/n + Q_t·diag(1/(s + α))·Q_Sᵀc)`` with ``(I - H_SS)·c = r_S``, ``r_S``
    the rows' training residuals: the leave-a-group-out identity of a linear smoother, at the cost
    of one ``|S|×|S|`` solve.

    Args:
        train: ``[n, d]`` training rows (float64).
        y: ``[n, m]`` training targets.
        test: ``[t, d]`` rows to predict.
        alphas: the penalties.
        constant: ``[d]`` features to leave out (default: :func:`constant_features` with float64's eps).
        delete: sets of training rows (indices into ``train``) to leave out, one at a time.

    Returns:
        ``(predictions [t, m], chosen α [m], shifts [len(delete), t, m])``.
    """
    if constant is None:
        constant = constant_features(train, np.finfo(np.float64).eps)
    keep = ~constant
    mean, std = train[:, keep].mean(0), train[:, keep].std(0)
    z = (train[:, keep] - mean) / std
    centre = z.mean(0)
    z -= centre
    zt = (test[:, keep] - mean) / std - centre
    y_mean = y.mean(0)
    yc = y - y_mean
    alphas_array = np.asarray(alphas, dtype=np.float64)
    shifts = np.zeros((len(delete), len(test), y.shape[1]))
    if z.shape[1] == 0:  # nothing to read: every penalty predicts the training mean
        for g, rows in enumerate(delete):  # the training mean without the rows
            shifts[g] = -yc[rows].sum(0) / max(len(z) - len(rows), 1)
        return np.broadcast_to(y_mean, (len(test), y.shape[1])).copy(), np.full(y.shape[1], alphas_array[0]), shifts
    q, qt, s = _eigen_basis(z, zt)
    inverse = 1.0 / (s[None, :] + alphas_array[:, None])  # [A, r]
    leverage = 1.0 / len(z) + (q * q) @ inverse.T  # [n, A]
    projected = q.T @ yc  # [r, m]
    errors = np.empty((len(alphas_array), y.shape[1]))
    for a in range(len(alphas_array)):
        fitted = q @ (inverse[a][:, None] * projected)
        errors[a] = np.mean(((yc - fitted) / (1.0 - leverage[:, a : a + 1])) ** 2, axis=0)
    chosen = np.argmin(errors, axis=0)  # [m]
    predictions = y_mean + np.stack([qt @ (inverse[a] * projected[:, j]) for j, a in enumerate(chosen)], axis=1)
    for j, a in enumerate(chosen):
        residual = yc[:, j] - q @ (inverse[a] * projected[:, j])
        for g, rows in enumerate(delete):
            if len(rows):
                block = q[rows]
                hat = 1.0 / len(z) + (block * inverse[a]) @ block.T
                c = np.linalg.solve(np.eye(len(rows)) - hat, residual[rows])
                shifts[g, :, j] = -(c.sum() / len(z) + qt @ (inverse[a] * (block.T @ c)))
    return predictions, alphas_array[chosen], shifts


def _eigen_basis(z: np.ndarray, zt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(Q [n, r], Q_t [t, r], s [r])``: training and test rows in one eigenbasis of the smaller of ``ZᵀZ``
    and ``ZZᵀ`` (eigenvalues ``s``), so that ``Z(ZᵀZ + α)⁻¹Zᵀ = Q·diag(1/(s + α))·Qᵀ`` and
    ``Z_t(ZᵀZ + α)⁻¹Zᵀ = Q_t·diag(1/(s + α))·Qᵀ``."""
    if z.shape[0] >= z.shape[1]:
        s, basis = np.linalg.eigh(z.T @ z)
        return z @ basis, zt @ basis, np.clip(s, 0.0, None)
    s, u = np.linalg.eigh(z @ z.T)
    s = np.clip(s, 0.0, None)
    root = np.sqrt(s)
    qt = np.divide((zt @ z.T) @ u, root, out=np.zeros((len(zt), len(s))), where=root > 0)
    return u * root, qt, s


def grouped_ridge_scores(
    features: Any,
    targets: Any,
    groups: Any,
    *,
    n_folds: int = 5,
    alphas: tuple[float, ...] = RIDGE_ALPHAS,
    inverse: tuple[Callable[[np.ndarray], np.ndarray] | None, ...] | None = None,
    eps: float | None = None,
    n_groups: int = 20,
) -> dict[str, np.ndarray]:
    """Held-out R² and mean absolute error of a standardised ridge probe, fold by fold and pooled.

    Args:
        features: ``[n, d]`` (cast to float64).
        targets: ``[n, m]``, one column per target (e.g. position and ``log(1 + position)``).
        groups: ``[n]``, the group (document) of each row: no group is on both sides of a fold.
        n_folds: ``k`` (at most the number of groups).
        alphas: the ridge penalties to choose from.
        inverse: per target, ``None`` or a function taking predictions back to the first target's
            units before the absolute error is taken (``np.expm1`` for ``log(1 + position)``: the
            error in tokens).
        eps: machine epsilon of the dtype the features were computed in (default: the features' own
            dtype's, float64 for integers): a feature with no more spread than that dtype's rounding
            is constant (:func:`constant_features`).
        n_groups: ``G``, the groups of documents of the jackknife (:func:`document_groups`).

    Returns:
        ``{"r2": [m, k], "mae": [m, k], "alpha": [m, k], "held_out": [k], "constant": [k]`` (features
        treated as constant per fold), ``"predicted": [n, m]`` (each row's held-out prediction, in
        the target's units), ``"sums": [m, 5]`` (:data:`SCORE_SUMS` of every held-out prediction) and
        ``"replicate_sums": [m, G, 5]`` (the same without group ``g``'s rows, every probe refitted
        without them: replicate ``g`` of :func:`jackknife_scores`)``}``.

    Raises:
        InputError: shapes that disagree, non-finite features or targets, or a held-out fold with
            fewer than two distinct values of the first target (:func:`check_fold_targets`).
    """
    raw = np.asarray(features)
    x = raw.astype(np.float64, copy=False)
    y = np.asarray(targets, dtype=np.float64)
    if y.ndim == 1:
        y = y[:, None]
    if x.ndim != 2 or len(x) != len(y) or len(y) != len(np.asarray(groups)):
        raise InputError(f"features [n, d], targets [n, m] and groups [n] must share n; got shapes {x.shape}, "
                         f"{y.shape} and {np.shape(groups)}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise InputError(f"{int((~np.isfinite(x)).any(1).sum())} feature row(s) and {int((~np.isfinite(y)).any(1).sum())} "
                         "target row(s) hold NaN or infinity; a probe needs finite numbers")
    if eps is None:
        eps = float(np.finfo(raw.dtype).eps) if np.issubdtype(raw.dtype, np.floating) else float(np.finfo(np.float64).eps)
    inverse = inverse or (None,) * y.shape[1]
    folds = grouped_folds(groups, n_folds)
    check_fold_targets(y[:, 0], folds)
    out = {key: np.empty((y.shape[1], len(folds))) for key in ("r2", "mae", "alpha")}
    out["constant"] = np.empty(len(folds), dtype=np.int64)
    membership = document_groups(groups, n_groups)
    count = int(membership.max()) + 1
    predicted = np.empty_like(y)
    replicates = np.empty((count, len(y), y.shape[1]))  # each replicate's held-out predictions
    for fold, (train, test) in enumerate(folds):
        constant = constant_features(x[train], eps)
        delete = tuple(np.flatnonzero(membership[train] == g) for g in range(count))
        predicted[test], out["alpha"][:, fold], shifts = ridge_fold(x[train], y[train], x[test], alphas,
                                                                    constant=constant, delete=delete)
        replicates[:, test] = predicted[test][None] + shifts
        out["constant"][fold] = int(constant.sum())
    for fold, (_, test) in enumerate(folds):
        for column, back in enumerate(inverse):
            residual = y[test, column] - predicted[test, column]
            spread = y[test, column] - y[test, column].mean()
            out["r2"][column, fold] = 1.0 - float(residual @ residual) / float(spread @ spread)
            truth, guess = _in_units(y, predicted, column, back)
            out["mae"][column, fold] = float(np.mean(np.abs(truth[test] - guess[test])))
    out["held_out"] = np.array([len(test) for _, test in folds])
    out["predicted"] = predicted
    out["sums"] = np.stack([score_sums(y[:, c], predicted[:, c], np.abs(np.subtract(*_in_units(y, predicted, c, back))))
                            for c, back in enumerate(inverse)])
    out["replicate_sums"] = np.empty((y.shape[1], count, len(SCORE_SUMS)))
    for g in range(count):
        kept = membership != g
        for c, back in enumerate(inverse):
            truth, guess = _in_units(y[kept], replicates[g, kept], c, back)
            out["replicate_sums"][c, g] = score_sums(y[kept, c], replicates[g, kept, c], np.abs(truth - guess))
    return out


def _in_units(y: np.ndarray, predicted: np.ndarray, column: int, back: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(truth, prediction)`` of target ``column`` in the first target's units (``back`` applied)."""
    return (y[:, column], predicted[:, column]) if back is None else (y[:, 0], back(predicted[:, column]))


def document_groups(groups: Any, n_groups: int) -> np.ndarray:
    """``[n]`` each row's jackknife group: its document's rank among the sorted documents, modulo
    ``G = min(n_groups, documents)`` (every document its own group when there are at most ``n_groups``)."""
    _, rank = np.unique(np.asarray(groups), return_inverse=True)
    return rank.reshape(-1) % max(1, min(int(n_groups), int(rank.max()) + 1))


def score_sums(y: Any, predicted: Any, absolute_error: Any) -> np.ndarray:
    """``[5]`` the :data:`SCORE_SUMS` of held-out predictions.

    Args:
        y: ``[n]`` the target.
        predicted: ``[n]`` each row's held-out prediction of it.
        absolute_error: ``[n]`` ``|p - p̂|`` in the first target's units (tokens).
    """
    y, predicted = np.asarray(y, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    return np.array([len(y), y.sum(), y @ y, float(((y - predicted) ** 2).sum()),
                     float(np.sum(absolute_error))])


def pooled_scores(sums: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(R², MAE)`` of held-out predictions from their :data:`SCORE_SUMS` ``[..., 5]`` (summed over groups first).

    ``R² = 1 - Σ(y - ŷ)² / (Σy² - (Σy)²/n)`` and ``MAE = Σ|p - p̂| / n``: the scores of every held-out
    prediction at once, ``ȳ`` the mean over all of them. NaN where the rows have no spread.
    """
    sums = np.asarray(sums, dtype=np.float64)
    rows, sum_y, sum_y2, squared, absolute = np.moveaxis(sums, -1, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        total = sum_y2 - sum_y * sum_y / rows
        r2 = np.where(total > 0, 1.0 - squared / total, np.nan)
        return r2, absolute / rows


def jackknife_scores(sums: Any, replicate_sums: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The pooled scores and their delete-a-group jackknife replicates over groups of documents.

    Replicate ``g`` is :func:`pooled_scores` of the held-out predictions of every row but group
    ``g``'s, each made by its fold's probe refitted without group ``g``'s training rows (the fold's
    standardisation and penalty kept: :func:`ridge_fold`), so that the replicates vary both with
    which documents are scored and with which trained the probes.

    Args:
        sums: ``[..., 5]`` of every held-out prediction.
        replicate_sums: ``[..., G, 5]`` of each replicate.

    Returns:
        ``{"r2": (estimate [...], replicates [G, ...]), "mae": (...)}``.
    """
    r2, mae = pooled_scores(sums)
    r2_replicates, mae_replicates = pooled_scores(np.moveaxis(np.asarray(replicate_sums, dtype=np.float64), -2, 0))
    return {"r2": (r2, r2_replicates), "mae": (mae, mae_replicates)}
