"""Features: what the analyses measure in a model, each a plan of named sites and an accumulator.

Place in the seams: between the analyses and the *adapters*. A feature says what one forward pass reads and
replaces as a :class:`~equivariance_probe.adapters.plan.Plan` of sites
(:mod:`~equivariance_probe.adapters.sites`) and hands it to
:meth:`~equivariance_probe.adapters.base.Adapter.run_plan`; it never names a framework, so it runs on every
framework whose binder gives its sites (an import contract keeps the binders out of reach).

* :mod:`~equivariance_probe.features.segments`: the shift test's pass over windows whose last tokens are a
  segment (attention blocks, residual streams, predictions, the attribution's components, activation patching),
  and the loop that runs a segment's grid through it.
"""
