"""Pure functions from float64 sums to the numbers of docs/methods.md, and the fits behind them.

Place in the seams: the floor above the errors; it imports nothing else of the package and no
framework (numpy and scipy only).

* :mod:`~equivariance_probe.maths.metrics` — query-position R² in three forms and two scales,
  Toeplitz R².
* :mod:`~equivariance_probe.maths.persistence` — persistence curves ``P(dt)`` from lag sums.
* :mod:`~equivariance_probe.maths.fitting` — power, exponential and uniform-prior fits, TISA's
  kernel fit, the variance-shrinkage exponent.
"""
