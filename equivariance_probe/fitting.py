"""Curve fits of persistence curves: power law, exponential, and the uniform prior.

Pure functions of numpy arrays (METHODS.md section 2). Each fit is least squares on the
curve itself (raw scale), and its R² is ``1 - Σ(P - f)² / Σ(P - P̄)²`` over the lags
fitted. Starting values come from a straight-line fit on the log scale, so the result
does not depend on a guess.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CurveFit", "curve_r2", "fit_power", "fit_exponential", "fit_prior", "FIT_NAMES"]

#: The three fits of the study, in the order they are reported.
FIT_NAMES = ("power", "exponential", "prior")


@dataclass(frozen=True)
class CurveFit:
    """One fitted curve.

    Attributes:
        name: ``"power"`` (``c·(dt+1)^(-alpha)``), ``"exponential"`` (``c·exp(-lam·dt)``)
            or ``"prior"`` (the parameter-free uniform prior ``1/|V(t+dt)|``).
        params: fitted parameters (empty for the prior).
        r2: R² of the fit on the curve.
        prediction: the fitted curve at the lags that were fitted.
    """

    name: str
    params: dict[str, float]
    r2: float
    prediction: np.ndarray = field(repr=False)

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "params": dict(self.params), "r2": self.r2}


def curve_r2(curve: np.ndarray, prediction: np.ndarray) -> float:
    """``1 - Σ(y - ŷ)² / Σ(y - ȳ)²``; NaN if the curve is constant or has < 2 points."""
    curve = np.asarray(curve, dtype=np.float64)
    return residual_r2(curve, curve - np.asarray(prediction, dtype=np.float64))


def residual_r2(curve: np.ndarray, residual: np.ndarray) -> float:
    """``1 - Σr² / Σ(y - ȳ)²`` from the residuals ``r = y - ŷ`` of a fit (for fits that already
    have them); NaN if the curve is constant or has < 2 points."""
    curve = np.asarray(curve, dtype=np.float64)
    if curve.size < 2:
        return float("nan")
    total = float(np.sum((curve - curve.mean()) ** 2))
    if total <= 0.0:
        return float("nan")
    return 1.0 - float(np.sum(np.asarray(residual, dtype=np.float64) ** 2)) / total


def _loglinear_start(x: np.ndarray, curve: np.ndarray) -> tuple[float, float]:
    """Intercept and slope of ``log y ≈ a + b·x`` over the positive points."""
    positive = curve > 0
    if positive.sum() < 2:
        return float(np.log(max(curve.max(), 1e-12))), 0.0
    slope, intercept = np.polyfit(x[positive], np.log(curve[positive]), 1)
    return float(intercept), float(slope)


def _least_squares(model, x: np.ndarray, curve: np.ndarray, start: tuple[float, float]) -> np.ndarray:
    from scipy.optimize import curve_fit

    if len(x) <= len(start):
        # Two parameters cannot be fitted to two points or fewer: no fit, not a perfect one.
        return np.full(len(start), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            params, _ = curve_fit(model, x, curve, p0=start, maxfev=20000)
        except (RuntimeError, ValueError, TypeError):
            params = np.asarray(start, dtype=np.float64)
    return np.asarray(params, dtype=np.float64)


def _power(dt: np.ndarray, c: float, alpha: float) -> np.ndarray:
    return c * np.power(dt + 1.0, -alpha)


def _exponential(dt: np.ndarray, c: float, lam: float) -> np.ndarray:
    return c * np.exp(-lam * dt)


def fit_power(dt: np.ndarray, curve: np.ndarray) -> CurveFit:
    """Fit ``P(dt) ≈ c·(dt+1)^(-alpha)`` by least squares.

    Args:
        dt: lags ``[n]`` (``>= 0``).
        curve: mean attention at those lags ``[n]``.
    """
    dt = np.asarray(dt, dtype=np.float64)
    curve = np.asarray(curve, dtype=np.float64)
    intercept, slope = _loglinear_start(np.log(dt + 1.0), curve)
    c, alpha = _least_squares(_power, dt, curve, (float(np.exp(intercept)), -slope))
    prediction = _power(dt, c, alpha)
    return CurveFit("power", {"c": float(c), "alpha": float(alpha)}, curve_r2(curve, prediction), prediction)


def fit_exponential(dt: np.ndarray, curve: np.ndarray) -> CurveFit:
    """Fit ``P(dt) ≈ c·exp(-lam·dt)`` by least squares."""
    dt = np.asarray(dt, dtype=np.float64)
    curve = np.asarray(curve, dtype=np.float64)
    intercept, slope = _loglinear_start(dt, curve)
    c, lam = _least_squares(_exponential, dt, curve, (float(np.exp(intercept)), -slope))
    prediction = _exponential(dt, c, lam)
    return CurveFit("exponential", {"c": float(c), "lambda": float(lam)}, curve_r2(curve, prediction), prediction)


def fit_prior(curve: np.ndarray, prior: np.ndarray) -> CurveFit:
    """The uniform prior as a fit with no free parameter: its R² on the curve.

    Args:
        curve: mean attention by lag ``[n]``.
        prior: mean of ``u(t+dt) = 1/|V(t+dt)|`` over the same entries ``[n]``.
    """
    prior = np.asarray(prior, dtype=np.float64)
    return CurveFit("prior", {}, curve_r2(curve, prior), prior)
