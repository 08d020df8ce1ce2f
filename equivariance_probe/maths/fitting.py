"""Curve fits: persistence curves, TISA's positional kernel, and variance shrinkage.

Place in the seams: *maths*, pure functions of numpy arrays that import nothing of the
package but its errors.

* Persistence curves (docs/methods.md#persistence): power law, exponential, and the uniform prior.
  The two families are *decays*: each is least squares on the curve itself (raw scale) within
  the bounds ``c > 0``, ``α ≥ 0`` (``λ ≥ 0``), and its R² is ``1 - Σ(P - f)² / Σ(P - P̄)²`` over
  the lags fitted. Starting values come from a straight-line fit on the log scale, so the result
  does not depend on a guess. Every fit carries a status: ``"ok"``; ``"at_bound"`` when the rate
  ends on 0 (the best decay is a constant: the curve does not decay, e.g. where attention sinks
  make ``P(dt)`` rise at large ``dt``), reported with its R² but as no decay; or ``"failed"`` (too
  few lags, no convergence, a parameter at an absurd scale), with NaN parameters and R², never
  printed as a curve.
* TISA's positional scoring function ``f(k) = Σ_s a_s·exp(-|b_s|·(k - c_s)²)`` (Wennberg &
  Henter, "The Case for Translation-Invariant Self-Attention", eq. 9-12; docs/methods.md#toeplitz),
  fitted by variable projection.
* The shrinkage exponent ``γ`` of ``var(q) ≈ c·(q+1)^(-γ)`` (docs/methods.md#order).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = [
    "FIT_NAMES",
    "FIT_STATUSES",
    "CurveFit",
    "curve_r2",
    "residual_r2",
    "fit_power",
    "fit_exponential",
    "fit_prior",
    "KernelFit",
    "tisa_kernel",
    "fit_tisa_kernel",
    "fit_shrinkage_exponent",
]

#: The three fits of the study, in the order they are reported.
FIT_NAMES = ("power", "exponential", "prior")

#: What a fit can be: a decay within its bounds, a decay whose rate ends on its bound 0 (no decay),
#: or no fit at all.
FIT_STATUSES = ("ok", "at_bound", "failed")

#: A fitted scale ``c`` further than this factor from the curve's largest value is a failed fit:
#: a decay's ``c`` is its value at ``dt = 0`` and lies near the curve's values.
ABSURD_SCALE = 1e3


@dataclass(frozen=True)
class CurveFit:
    """One fitted curve.

    Attributes:
        name: ``"power"`` (``c·(dt+1)^(-alpha)``), ``"exponential"`` (``c·exp(-lam·dt)``)
            or ``"prior"`` (the parameter-free uniform prior ``1/|V(t+dt)|``).
        params: fitted parameters (empty for the prior; NaN for a failed fit).
        r2: R² of the fit on the curve (NaN for a failed fit).
        prediction: the fitted curve at the lags that were fitted (NaN for a failed fit).
        status: one of :data:`FIT_STATUSES`.
        note: why a fit is ``"at_bound"`` or ``"failed"``, in words (empty when ``"ok"``).
    """

    name: str
    params: dict[str, float]
    r2: float
    prediction: np.ndarray = field(repr=False)
    status: str = "ok"
    note: str = ""

    @property
    def described(self) -> str:
        """The status in words for a table cell: ``""`` when ok, else e.g. ``"at bound: α = 0, no decay"``."""
        if self.status == "ok":
            return ""
        return f"{self.status.replace('_', ' ')}: {self.note}" if self.note else self.status.replace("_", " ")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "params": dict(self.params), "r2": self.r2, "status": self.status, "note": self.note}


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
        # Also an empty curve: a key-position bin whose keys are all excluded has no points.
        return float(np.log(curve.max(initial=1e-12))), 0.0
    slope, intercept = np.polyfit(x[positive], np.log(curve[positive]), 1)
    return float(intercept), float(slope)


def _bounded_decay(
    name: str, model, x: np.ndarray, curve: np.ndarray, start: tuple[float, float], rate: str
) -> CurveFit:
    """Least squares of ``model(x, c, rate)`` within ``c >= 0``, ``rate >= 0``, with its status."""
    from scipy.optimize import curve_fit

    symbol = {"alpha": "α", "lambda": "λ"}[rate]

    def failed(note: str) -> CurveFit:
        return CurveFit(name, {"c": float("nan"), rate: float("nan")}, float("nan"), np.full(len(x), np.nan),
                        "failed", note)

    finite = np.isfinite(curve)
    if len(x) <= len(start) or finite.sum() <= len(start):
        # Two parameters cannot be fitted to two points or fewer: no fit, not a perfect one.
        return failed(f"{int(finite.sum())} lags, a decay needs at least 3")
    largest = float(np.max(np.abs(curve)))
    if not largest > 0:
        return failed("the curve is zero at every lag")
    # The start must lie inside the bounds: a rising log-linear start becomes a slow decay.
    c0 = float(np.clip(start[0], largest * 1e-6, largest * 10.0)) if np.isfinite(start[0]) else largest
    r0 = max(float(start[1]), 1e-6) if np.isfinite(start[1]) else 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            params, _ = curve_fit(model, x, curve, p0=(c0, r0), bounds=([0.0, 0.0], [np.inf, np.inf]),
                                  method="trf", maxfev=20000)
        except (RuntimeError, ValueError, TypeError) as error:
            return failed(f"no convergence ({type(error).__name__})")
    c, value = (float(v) for v in params)
    if not (np.isfinite(c) and np.isfinite(value)):
        return failed("no convergence (non-finite parameters)")
    if not largest / ABSURD_SCALE <= c <= largest * ABSURD_SCALE:
        return failed(f"c = {c:.3g} is at an absurd scale for a curve whose largest value is {largest:.3g}")
    prediction = model(x, c, value)
    # On the bound: the best decay is flat, or so nearly that over the lags fitted it falls by less
    # than 1e-4 of itself (the optimiser stops a hair inside the bound).
    if 1.0 - float(model(np.max(x), 1.0, value)) / float(model(np.min(x), 1.0, value)) < 1e-4:
        flat = float(np.mean(curve))  # the least-squares constant: the fit on its bound
        prediction = np.full(len(x), flat)
        return CurveFit(name, {"c": flat, rate: 0.0}, curve_r2(curve, prediction), prediction, "at_bound",
                        f"{symbol} = 0, no decay")
    return CurveFit(name, {"c": c, rate: value}, curve_r2(curve, prediction), prediction)


def _power(dt: np.ndarray, c: float, alpha: float) -> np.ndarray:
    return c * np.power(dt + 1.0, -alpha)


def _exponential(dt: np.ndarray, c: float, lam: float) -> np.ndarray:
    return c * np.exp(-lam * dt)


def fit_power(dt: np.ndarray, curve: np.ndarray) -> CurveFit:
    """Fit ``P(dt) ≈ c·(dt+1)^(-alpha)`` by least squares within ``c >= 0``, ``alpha >= 0``.

    Args:
        dt: lags ``[n]`` (``>= 0``).
        curve: mean attention at those lags ``[n]``.
    """
    dt = np.asarray(dt, dtype=np.float64)
    curve = np.asarray(curve, dtype=np.float64)
    intercept, slope = _loglinear_start(np.log(dt + 1.0), curve)
    return _bounded_decay("power", _power, dt, curve, (float(np.exp(intercept)), -slope), "alpha")


def fit_exponential(dt: np.ndarray, curve: np.ndarray) -> CurveFit:
    """Fit ``P(dt) ≈ c·exp(-lam·dt)`` by least squares within ``c >= 0``, ``lam >= 0``."""
    dt = np.asarray(dt, dtype=np.float64)
    curve = np.asarray(curve, dtype=np.float64)
    intercept, slope = _loglinear_start(dt, curve)
    return _bounded_decay("exponential", _exponential, dt, curve, (float(np.exp(intercept)), -slope), "lambda")


def fit_prior(curve: np.ndarray, prior: np.ndarray) -> CurveFit:
    """The uniform prior as a fit with no free parameter: its R² on the curve.

    Args:
        curve: mean attention by lag ``[n]``.
        prior: mean of ``u(t+dt) = 1/|V(t+dt)|`` over the same entries ``[n]``.
    """
    prior = np.asarray(prior, dtype=np.float64)
    return CurveFit("prior", {}, curve_r2(curve, prior), prior)


# -- TISA kernel fits ----------------------------------------------------------------------
# -- TISA's positional kernel ------------------------------------------------------------------
def tisa_kernel(lags: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``f(k) = Σ_s a_s·exp(-|b_s|·(k - c_s)²)`` at ``lags`` (``[K]``); parameters ``[S]``."""
    lags = np.asarray(lags, dtype=np.float64)[:, None]
    return (np.asarray(a)[None, :] * np.exp(-np.abs(np.asarray(b))[None, :] * (lags - np.asarray(c)[None, :]) ** 2)).sum(1)


@dataclass
class KernelFit:
    """A TISA kernel fit ``f(k) = Σ_s a_s·exp(-|b_s|·(k - c_s)²)`` to one profile.

    Attributes:
        a, b, c: ``[S]`` amplitudes, inverse squared widths (``|b|`` is used), centres (in ``k``).
        r2: ``1 - RSS/TSS`` of the fit on the profile.
    """

    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    r2: float

    def predict(self, lags: np.ndarray) -> np.ndarray:
        return tisa_kernel(lags, self.a, self.b, self.c)

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a.tolist(), "b": self.b.tolist(), "c": self.c.tolist(), "r2": self.r2}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelFit:
        return cls(np.asarray(data["a"]), np.asarray(data["b"]), np.asarray(data["c"]), float(data["r2"]))


def _amplitudes(lags: np.ndarray, profile: np.ndarray, b: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For fixed widths and centres the amplitudes are linear: least squares gives them."""
    basis = np.exp(-np.abs(b)[None, :] * (lags[:, None] - c[None, :]) ** 2)
    a, *_ = np.linalg.lstsq(basis, profile, rcond=None)
    return a, profile - basis @ a


def fit_tisa_kernel(
    lags: np.ndarray,
    profile: np.ndarray,
    n_kernels: int = 5,
    *,
    restarts: int = 4,
    seed: int = 0,
    max_evaluations: int = 150,
) -> KernelFit:
    """Least-squares fit of TISA's kernel ``f(k) = Σ_s a_s·exp(-|b_s|·(k - c_s)²)`` to a profile.

    Variable projection: the amplitudes ``a`` are solved exactly for each trial of widths and
    centres, which are optimised with ``scipy.optimize.least_squares`` (widths through
    ``log b``, bounded). Starts: one greedy (add the kernel of a grid of centres and widths that
    best matches the residual, refine all, repeat ``S`` times) and ``restarts - 1`` random
    ones; the best fit is kept.

    Args:
        lags: ``[K]`` the lags ``k = q - key`` where the profile is defined.
        profile: ``[K]`` values (e.g. mean pre-softmax scores); NaNs are dropped.
        n_kernels: ``S`` (TISA's default 5).
        restarts: number of starts (the greedy one included).
        seed: seed of the random starts.
        max_evaluations: residual evaluations per start.

    Returns :class:`KernelFit`, its kernels sorted by centre.
    """
    from scipy.optimize import least_squares

    lags = np.asarray(lags, dtype=np.float64)
    profile = np.asarray(profile, dtype=np.float64)
    keep = np.isfinite(profile)
    x, y = lags[keep], profile[keep]
    if len(x) < 3 * n_kernels:
        raise InputError(f"a {n_kernels}-kernel fit needs at least {3 * n_kernels} finite profile points, got {len(x)}")
    span = max(float(x.max() - x.min()), 1.0)
    rng = np.random.default_rng(seed)
    # Widths between a tenth of a lag and ten times the lag range; centres within one range
    # of the data (a kernel centred outside can still shape an edge).
    lower_b, upper_b = np.log(1.0 / (10 * span) ** 2), np.log(100.0)
    lower_c, upper_c = x.min() - span, x.max() + span

    def refine(log_b: np.ndarray, c: np.ndarray) -> Any:
        n = len(c)

        def residual(theta: np.ndarray) -> np.ndarray:
            return _amplitudes(x, y, np.exp(theta[:n]), theta[n:])[1]

        lower = np.concatenate([np.full(n, lower_b), np.full(n, lower_c)])
        upper = np.concatenate([np.full(n, upper_b), np.full(n, upper_c)])
        start = np.clip(np.concatenate([log_b, c]), lower + 1e-9, upper - 1e-9)
        return least_squares(residual, start, bounds=(lower, upper), method="trf", max_nfev=max_evaluations)

    # Start 1, greedy: add the grid kernel that best explains what is left, refine all, repeat.
    grid_c = np.linspace(x.min(), x.max(), min(len(x), 64))
    grid_log_b = np.linspace(lower_b + np.log(100.0), upper_b - np.log(100.0), 16)
    candidates = np.exp(-np.exp(grid_log_b)[None, :, None] * (x[:, None, None] - grid_c[None, None, :]) ** 2)
    candidates = candidates.reshape(len(x), -1)
    candidates = candidates / np.linalg.norm(candidates, axis=0)
    log_b, centres = np.zeros(0), np.zeros(0)
    rest = y - y.mean()
    for _ in range(n_kernels):
        pick = int(np.argmax(np.abs(candidates.T @ rest)))
        log_b = np.append(log_b, grid_log_b[pick // len(grid_c)])
        centres = np.append(centres, grid_c[pick % len(grid_c)])
        solution = refine(log_b, centres)
        log_b, centres = solution.x[: len(centres)], solution.x[len(centres):]
        rest = _amplitudes(x, y, np.exp(log_b), centres)[1]
    best = solution
    # Further starts: centres drawn over the lags, widths log-uniform over the lag range.
    for _ in range(restarts - 1):
        widths = span * np.exp(rng.uniform(np.log(0.01), np.log(1.0), n_kernels))
        solution = refine(np.log(1.0 / widths**2), np.sort(rng.uniform(x.min(), x.max(), n_kernels)))
        if solution.cost < best.cost:
            best = solution
    b, c = np.exp(best.x[:n_kernels]), best.x[n_kernels:]
    a, rest = _amplitudes(x, y, b, c)
    r2 = residual_r2(y, rest)
    order = np.argsort(c)
    return KernelFit(a[order], b[order], c[order], r2)


# -- variance shrinkage -------------------------------------------------------------------------
def fit_shrinkage_exponent(variance: np.ndarray, q_min: int = 1) -> tuple[float, float, float]:
    """Fit ``var(q) ≈ c·(q+1)^(-γ)`` by least squares on ``log var`` vs ``log(q+1)`` over ``q >= q_min``.

    Returns:
        ``(γ, c, r2)`` with ``r2`` the R² of the line on the log scale.
    """
    variance = np.asarray(variance, dtype=np.float64)
    q = np.arange(len(variance))
    keep = (q >= q_min) & (variance > 0) & np.isfinite(variance)
    if keep.sum() < 3:
        return float("nan"), float("nan"), float("nan")
    x, y = np.log(q[keep] + 1.0), np.log(variance[keep])
    slope, intercept = np.polyfit(x, y, 1)
    return float(-slope), float(np.exp(intercept)), curve_r2(y, intercept + slope * x)
