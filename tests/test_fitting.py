"""Fits recover the parameters of synthetic curves; R² is the plain definition."""

import numpy as np
import pytest

from equivariance_probe.maths.fitting import curve_r2, fit_exponential, fit_power, fit_prior


def test_power_fit_recovers_parameters():
    dt = np.arange(200.0)
    fit = fit_power(dt, 0.8 * (dt + 1) ** -1.3)
    assert fit.params["c"] == pytest.approx(0.8, rel=1e-6)
    assert fit.params["alpha"] == pytest.approx(1.3, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0, abs=1e-10)


def test_exponential_fit_recovers_parameters():
    dt = np.arange(100.0)
    fit = fit_exponential(dt, 0.5 * np.exp(-0.07 * dt))
    assert fit.params["c"] == pytest.approx(0.5, rel=1e-6)
    assert fit.params["lambda"] == pytest.approx(0.07, rel=1e-6)


def test_prior_fit_has_no_parameters_and_scores_its_own_curve_one():
    prior = 1.0 / np.arange(1.0, 50.0)
    assert fit_prior(prior, prior).r2 == 1.0 and fit_prior(prior, prior).params == {}
    assert fit_prior(prior, 2 * prior).r2 < 0


def test_curve_r2_definition():
    y = np.array([1.0, 2.0, 3.0])
    assert curve_r2(y, np.array([1.0, 2.0, 4.0])) == pytest.approx(1 - 1 / 2)
    assert np.isnan(curve_r2(np.ones(4), np.ones(4)))


def test_too_few_points_give_no_fit():
    fit = fit_power(np.array([0.0, 1.0]), np.array([1.0, 0.5]))
    assert np.isnan(fit.r2) and np.isnan(fit.params["alpha"])
