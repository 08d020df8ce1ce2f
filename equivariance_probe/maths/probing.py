"""Linear probes: cross-validated ridge regression of a target on features, scored on held-out groups.

Place in the seams: *maths*, pure functions of numpy arrays (scikit-learn and scipy imported when
used). :mod:`~equivariance_probe.analyses.position_probe` calls :func:`grouped_ridge_scores` once
per layer with the residual stream at sampled positions as features and the positions as targets
(docs/methods.md#probe; Haviv et al. 2022, "Transformer Language Models without Positional
Encodings Still Learn Positional Information", probe position from each layer this way).

For each of ``k`` folds of :class:`sklearn.model_selection.GroupKFold` (no group on both sides):

* a :class:`~sklearn.pipeline.Pipeline` of :class:`~sklearn.preprocessing.StandardScaler` (each
  feature centred and scaled by the training rows' mean and standard deviation) and
  :class:`~sklearn.linear_model.RidgeCV` is fitted on the training rows. RidgeCV minimises
  ``‖y - Xw - b‖² + α‖w‖²`` with ``α`` chosen per target from :data:`RIDGE_ALPHAS` by efficient
  leave-one-out on the training rows;
* the held-out rows are scored: ``R² = 1 - Σ(y - ŷ)² / Σ(y - ȳ)²`` with ``ȳ`` the held-out rows'
  own mean (scikit-learn's ``r2_score``: a prediction no better than that mean scores ``≤ 0``), and
  the mean absolute error ``mean|y - ŷ|``.

The ``k`` fold scores ``s_1..s_k`` give :func:`fold_interval`: ``s̄ ± t_{k-1,(1+level)/2}·sd/√k``
(``sd`` the sample standard deviation, ``ddof = 1``), an R²'s upper end clipped at 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError
from .intervals import Interval, check_level

__all__ = ["RIDGE_ALPHAS", "FOLD_T", "FOLD_T_CLIPPED", "grouped_folds", "grouped_ridge_scores", "fold_interval"]

#: The ridge penalties RidgeCV chooses from: 10⁻³ .. 10⁵ (standardised features, so one grid serves
#: every model's scale), 17 values a half-decade apart.
RIDGE_ALPHAS = tuple(float(a) for a in np.logspace(-6, 5, 23))
#: ``Interval.method`` of :func:`fold_interval`.
FOLD_T = "mean ± t·sd/√k over the k held-out folds"
#: ``Interval.method`` of :func:`fold_interval` with the upper end clipped at 1 (an R²).
FOLD_T_CLIPPED = FOLD_T + ", clipped at R² = 1"


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


def grouped_ridge_scores(
    features: Any,
    targets: Any,
    groups: Any,
    *,
    n_folds: int = 5,
    alphas: tuple[float, ...] = RIDGE_ALPHAS,
    inverse: tuple[Any, ...] | None = None,
) -> dict[str, np.ndarray]:
    """Held-out R² and mean absolute error of a standardised ridge probe, fold by fold (module docstring).

    Args:
        features: ``[n, d]`` (cast to float64).
        targets: ``[n, m]``, one column per target (e.g. position and ``log(1 + position)``).
        groups: ``[n]``, the group (document) of each row: no group is on both sides of a fold.
        n_folds: ``k`` (at most the number of groups).
        alphas: the ridge penalties to choose from.
        inverse: per target, ``None`` or a function taking predictions back to the first target's
            units before the absolute error is taken (``np.expm1`` for ``log(1 + position)``: the
            error in tokens).

    Returns:
        ``{"r2": [m, k], "mae": [m, k], "alpha": [m, k], "held_out": [k]}`` (rows held out per fold).
    """
    from sklearn.linear_model import RidgeCV
    from sklearn.metrics import r2_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(targets, dtype=np.float64)
    if y.ndim == 1:
        y = y[:, None]
    if x.ndim != 2 or len(x) != len(y) or len(y) != len(np.asarray(groups)):
        raise InputError(f"features [n, d], targets [n, m] and groups [n] must share n; got shapes {x.shape}, "
                         f"{y.shape} and {np.shape(groups)}")
    inverse = inverse or (None,) * y.shape[1]
    folds = grouped_folds(groups, n_folds)
    r2 = np.empty((y.shape[1], len(folds)))
    mae = np.empty_like(r2)
    alpha = np.empty_like(r2)
    for fold, (train, test) in enumerate(folds):
        pipeline = make_pipeline(StandardScaler(), RidgeCV(alphas=alphas, alpha_per_target=True))
        pipeline.fit(x[train], y[train])
        predicted = pipeline.predict(x[test]).reshape(len(test), -1)
        for column in range(y.shape[1]):
            r2[column, fold] = r2_score(y[test, column], predicted[:, column])
            back = inverse[column]
            truth, guess = ((y[test, 0], back(predicted[:, column])) if back is not None
                            else (y[test, column], predicted[:, column]))
            mae[column, fold] = float(np.mean(np.abs(truth - guess)))
        alpha[:, fold] = np.broadcast_to(pipeline[-1].alpha_, (y.shape[1],))
    return {"r2": r2, "mae": mae, "alpha": alpha, "held_out": np.array([len(test) for _, test in folds])}


def fold_interval(scores: Any, *, level: float = 0.95, upper: float | None = None) -> Interval:
    """``s̄ ± t_{k-1}·sd/√k`` over the last axis of ``scores`` (``[..., k]`` fold scores).

    Args:
        scores: per fold, the held-out score (last axis: the ``k`` folds).
        level: confidence level.
        upper: the score's bound (1 for R²): an end above it is clipped to it, and the method says so.

    Returns:
        :class:`~equivariance_probe.maths.intervals.Interval` with ``n_groups = k`` and
        ``standard_error = sd/√k``.

    Raises:
        InputError: fewer than 2 folds.
    """
    from scipy.stats import t

    level = check_level(level)
    scores = np.asarray(scores, dtype=np.float64)
    k = scores.shape[-1] if scores.ndim else 0
    if k < 2:
        raise InputError(f"an interval over folds needs at least 2 folds, got {k}")
    mean = scores.mean(-1)
    standard_error = scores.std(-1, ddof=1) / np.sqrt(k)
    half = float(t.ppf((1.0 + level) / 2.0, k - 1)) * standard_error
    low, high = mean - half, mean + half
    method = FOLD_T
    if upper is not None and bool(np.any(high > upper)):
        low, high, method = np.minimum(low, upper), np.minimum(high, upper), FOLD_T_CLIPPED
    if mean.ndim == 0:
        return Interval(float(mean), float(low), float(high), level, k, float(standard_error), method)
    return Interval(mean, low, high, level, k, standard_error, method)
