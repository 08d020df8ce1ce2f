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


def test_exact_decays_are_recovered_with_status_ok():
    dt = np.arange(300.0)
    power = fit_power(dt, 0.6 * (dt + 1) ** -0.9)
    exponential = fit_exponential(dt, 0.2 * np.exp(-0.01 * dt))
    assert (power.status, exponential.status) == ("ok", "ok") and power.described == ""
    assert power.params["alpha"] == pytest.approx(0.9, rel=1e-6) and exponential.params["lambda"] == pytest.approx(0.01, rel=1e-6)


@pytest.mark.parametrize("fit", [fit_power, fit_exponential])
def test_a_rising_curve_ends_on_the_bound_as_no_decay(fit):
    """Attention sinks make P(dt) rise at large dt: the best decay is then flat, said as such."""
    dt = np.arange(128.0)
    rising = 0.01 + 1e-4 * dt  # an unbounded fit would report a negative rate: a growth printed as a decay
    result = fit(dt, rising)
    rate = "alpha" if fit is fit_power else "lambda"
    assert result.status == "at_bound" and result.params[rate] == 0.0
    assert result.params["c"] == pytest.approx(rising.mean(), rel=1e-6)  # the flat curve closest to the data
    assert result.r2 == pytest.approx(0.0, abs=1e-9)  # the mean explains nothing
    assert result.described == ("at bound: α = 0, no decay" if fit is fit_power else "at bound: λ = 0, no decay")


def test_a_curve_rising_after_a_decay_keeps_a_nonnegative_rate():
    """The study's shape: a decay at short lags, the sink's upturn at the largest ones."""
    dt = np.arange(256.0)
    curve = 0.3 * (dt + 1) ** -1.0 + 1e-3 * np.exp((dt - 255) / 10)
    for fitted in (fit_power(dt, curve), fit_exponential(dt, curve)):
        assert fitted.status in ("ok", "at_bound")
        assert all(value >= 0 for value in fitted.params.values())
        assert fitted.params["c"] <= 10 * curve.max()


def test_failed_fits_have_no_numbers_and_say_why():
    too_short = fit_power(np.array([0.0, 1.0]), np.array([1.0, 0.5]))
    assert too_short.status == "failed" and "at least 3" in too_short.note
    assert np.isnan(too_short.r2) and np.isnan(too_short.params["c"]) and np.isnan(too_short.prediction).all()
    zero = fit_exponential(np.arange(5.0), np.zeros(5))
    assert zero.status == "failed" and "zero" in zero.described
    assert fit_power(np.arange(5.0), np.zeros(5)).to_dict()["status"] == "failed"
