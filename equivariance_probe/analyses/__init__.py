"""Further analyses: which heads are position-bound, and where order comes from.

Place in the seams: above the adapters, the statistics and the maths, below the result (which
ranks its own heads with :mod:`~equivariance_probe.analyses.heads`).

* :mod:`~equivariance_probe.analyses.heads` — heads ranked from the most to the least
  position-bound.
* :mod:`~equivariance_probe.analyses.positional` — position-embedding Gram matrices, positional
  logits, TISA score profiles (docs/methods.md#toeplitz).
* :mod:`~equivariance_probe.analyses.order` — permutation sensitivity, variance shrinkage,
  position correlations (docs/methods.md#order).
"""
