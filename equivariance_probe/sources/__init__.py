"""Where models and documents come from, offline, and what a run may use.

Place in the seams: above the adapters (whose unwrapping it uses), below the probe.

* :mod:`~equivariance_probe.sources.models` — ``load_model`` and friends; packaged models are
  listed in :mod:`~equivariance_probe.sources.registry` and converted once by
  :mod:`~equivariance_probe.sources.conversion`.
* :mod:`~equivariance_probe.sources.baselines` — the untrained baselines (random init, zero).
* :mod:`~equivariance_probe.sources.corpus` — documents; the packaged Wikipedia articles are read by
  :mod:`~equivariance_probe.sources.wikipedia`; :mod:`~equivariance_probe.sources.packing` packs
  documents into windows of exactly ``T`` tokens.
* :mod:`~equivariance_probe.sources.padding` — padded token batches.
* :mod:`~equivariance_probe.sources.devices` and :mod:`~equivariance_probe.sources.resources` —
  device and dtype names, memory estimates and measurements.
"""
