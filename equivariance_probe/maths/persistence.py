"""Persistence curves ``P(dt)`` and their fits, from lag sums (docs/methods.md#persistence).

Place in the seams: *maths*. :func:`persistence_curves` turns sums by lag (and counts, and
the uniform prior's sums over the same entries) into mean curves and fits each with
:mod:`~equivariance_probe.maths.fitting`; :class:`PersistenceCurves` holds them (and, when
asked, each fit's R² interval over windows). :func:`lag_curves` reads the statistics' lag sums
over all layers, per layer, per head or per group of layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import IntervalUnavailableError, check_choice
from . import fitting
from .intervals import Interval

__all__ = ["PersistenceCurves", "persistence_curves", "lag_curves"]


@dataclass
class PersistenceCurves:
    """Mean attention by distance, ``P(dt)``, with its three fits (docs/methods.md#persistence).

    ``P(dt)`` is the mean of ``a[l, h, t+dt, t]`` over windows, key positions ``t`` and
    (unless split) layers and heads. ``prior`` is the mean of ``u(t+dt) = 1/|V(t+dt)|`` over
    exactly the same entries, the curve a uniform head would give.

    Attributes:
        by: ``None``, ``"layer"``, ``"head"`` or ``"key_position"``.
        dt: lags ``[n_lag]``: ``0 .. T-1`` for a causal model, signed ``-(T-1) .. T-1`` for a
            bidirectional encoder (whose power and exponential fits read the distance ``|dt|``).
        curve: ``[*shape, n_lag]`` mean attention (NaN where no entry has that lag).
        prior: ``[*shape, n_lag]`` mean uniform prior over the same entries.
        count: ``[*shape, n_lag]`` entries behind each point.
        fits: ``[*shape]`` nested lists of ``{"power", "exponential", "prior"}`` → CurveFit.
        key_bins: for ``by="key_position"``, bin edges ``[n_bins + 1]`` (bin ``i`` holds
            keys ``key_bins[i] <= t < key_bins[i+1]``).
        intervals: each fit's R² interval over windows, ``{fit: Interval}``, when asked for
            (``ProbeResult.persistence(interval=0.95)``); read with :meth:`r2_interval`.
    """

    by: str | None
    dt: np.ndarray
    curve: np.ndarray
    prior: np.ndarray
    count: np.ndarray
    fits: Any
    key_bins: np.ndarray | None = None
    intervals: dict[str, Interval] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.curve.shape[:-1]

    def r2(self, fit: str) -> np.ndarray | float:
        """R² of ``fit`` (one of ``power``, ``exponential``, ``prior``) for every curve."""
        check_choice("fit", fit, fitting.FIT_NAMES)
        return self._collect(lambda fits: fits[fit].r2)

    def r2_interval(self, fit: str) -> Interval:
        """The interval of ``fit``'s R² over windows (the curves must have been made with ``interval=``).

        Raises:
            IntervalUnavailableError: the curves were made without ``interval=``.
        """
        check_choice("fit", fit, fitting.FIT_NAMES)
        if self.intervals is None:
            raise IntervalUnavailableError(
                "these curves carry no intervals; ask for them with result.persistence(interval=0.95)"
            )
        return self.intervals[fit]

    def status(self, fit: str) -> np.ndarray | str:
        """The status of ``fit`` for every curve: ``"ok"``, ``"at_bound"`` or ``"failed"`` (see
        :mod:`~equivariance_probe.maths.fitting`); an array of strings for split curves."""
        check_choice("fit", fit, fitting.FIT_NAMES)
        return self._collect(lambda fits: fits[fit].status, dtype=object)

    def params(self, fit: str, name: str) -> np.ndarray | float:
        """A fitted parameter (``c``, ``alpha`` for power; ``c``, ``lambda`` for exponential)."""
        check_choice("fit", fit, ("power", "exponential"))
        return self._collect(lambda fits: fits[fit].params[name])

    def _collect(self, get, dtype: Any = np.float64) -> Any:
        """``get(fits)`` of every curve: one value (a float for numbers), or an array ``[*shape]`` of ``dtype``."""
        if not self.shape:
            value = get(self.fits)
            return float(value) if dtype is np.float64 else value
        flat = [get(f) for f in np.asarray(self.fits, dtype=object).ravel()]
        return np.asarray(flat, dtype=dtype).reshape(self.shape)

    def summary(self) -> dict[str, Any]:
        """Fit parameters and R² of a single curve (``by=None``)."""
        if self.shape:
            return {name: self.r2(name) for name in fitting.FIT_NAMES}
        return {name: fit.to_dict() for name, fit in self.fits.items()}

    def __repr__(self) -> str:
        if not self.shape:
            parts = [f"{n} R²={self.fits[n].r2:.3f}" + ("" if self.intervals is None else f" [{self.intervals[n].low:.3f}, "
                                                         f"{self.intervals[n].high:.3f}]")
                     + (f" ({self.fits[n].described})" if self.fits[n].status != "ok" else "") for n in fitting.FIT_NAMES]
            return f"PersistenceCurves(lags={len(self.dt)}, " + ", ".join(parts) + ")"
        return f"PersistenceCurves(by={self.by!r}, curves={self.shape}, lags={len(self.dt)})"


def _fit_curve(dt: np.ndarray, curve: np.ndarray, prior: np.ndarray, count: np.ndarray) -> dict[str, fitting.CurveFit]:
    has = count > 0
    # Power and exponential decay are functions of the distance: signed lags (encoders) fit |dt|.
    x, y, p = np.abs(dt[has]), curve[has], prior[has]
    return {
        "power": fitting.fit_power(x, y),
        "exponential": fitting.fit_exponential(x, y),
        "prior": fitting.fit_prior(y, p),
    }


def persistence_curves(
    sums: np.ndarray,
    prior_sums: np.ndarray,
    counts: np.ndarray,
    by: str | None,
    key_bins: np.ndarray | None = None,
    dt: np.ndarray | None = None,
) -> PersistenceCurves:
    """Mean curves ``sums / counts`` by lag and their three fits.

    Args:
        sums: ``[*shape, lag]`` summed attention ``Σ a[t+dt, t]``.
        prior_sums: ``[*shape, lag]`` ``Σ u(t+dt)`` over the same entries.
        counts: ``[*shape, lag]`` entries behind each sum.
        by: what ``shape`` indexes (``None``, ``"layer"``, ``"head"``, ``"key_position"``).
        key_bins: bin edges when ``by="key_position"``.
        dt: the lag of each column (default ``0 .. n_lag - 1``; signed for encoders).
    """
    shape = sums.shape[:-1]
    n_lag = sums.shape[-1]
    dt = np.arange(n_lag, dtype=np.float64) if dt is None else np.asarray(dt, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        curve = np.where(counts > 0, sums / np.where(counts > 0, counts, 1), np.nan)
        prior = np.where(counts > 0, prior_sums / np.where(counts > 0, counts, 1), np.nan)
    if not shape:
        fits: Any = _fit_curve(dt, curve, prior, counts)
    else:
        flat = [
            _fit_curve(dt, c, p, n)
            for c, p, n in zip(curve.reshape(-1, n_lag), prior.reshape(-1, n_lag), counts.reshape(-1, n_lag))
        ]
        fits = np.empty(len(flat), dtype=object)
        fits[:] = flat
        fits = fits.reshape(shape).tolist()
    return PersistenceCurves(by, dt, curve, prior, counts, fits, key_bins)


def lag_curves(
    arrays: dict[str, np.ndarray], n_heads: int, by: str | None, layer_groups: dict[str, Any] | None = None,
    dt: np.ndarray | None = None,
) -> PersistenceCurves | dict[str, PersistenceCurves]:
    """``P(dt)`` over all layers and heads, per layer, per head or per group of layers, from lag sums.

    Args:
        arrays: ``lag_sum: [L, H', N]`` (``H' = H``, or 1 for sums over the heads), ``lag_count``
            and ``lag_prior_sum: [L, N]`` (per head: every head of a layer sees the same entries).
        n_heads: ``H``.
        by: ``None``, ``"layer"``, ``"head"`` (needs ``H' = H``) or ``"layer_group"``.
        layer_groups: ``{group: layers}`` for ``by="layer_group"``.
        dt: the lag of each of the ``N`` columns (default ``0 .. N-1``; signed for encoders).

    Returns:
        :class:`PersistenceCurves`, or ``{group: PersistenceCurves}`` for ``by="layer_group"``.
    """
    lag_sum, count, prior = arrays["lag_sum"], arrays["lag_count"], arrays["lag_prior_sum"]
    if by == "layer_group":
        return {
            group: persistence_curves(lag_sum[list(layers)].sum((0, 1)), n_heads * prior[list(layers)].sum(0),
                                      n_heads * count[list(layers)].sum(0), None, dt=dt)
            for group, layers in (layer_groups or {}).items()
        }
    if by == "head":
        counts = np.broadcast_to(count[:, None, :], lag_sum.shape)
        priors = np.broadcast_to(prior[:, None, :], lag_sum.shape)
        return persistence_curves(lag_sum, priors, counts, by, dt=dt)
    if by == "layer":
        return persistence_curves(lag_sum.sum(1), n_heads * prior, n_heads * count, by, dt=dt)
    check_choice("by", by, (None, "layer", "head", "layer_group"))
    return persistence_curves(lag_sum.sum((0, 1)), n_heads * prior.sum(0), n_heads * count.sum(0), None, dt=dt)
