"""Orchestration: studies, comparisons, scans, the positional study, checkpoints, and their text tables.

Place in the seams: above the probe and the result; runs return data, and the display layer
(or the command line) draws it.

* :mod:`~equivariance_probe.runs.study` — one model, trained vs its baselines.
* :mod:`~equivariance_probe.runs.shift` — the shift test on one model and its baselines, checkpointed.
* :mod:`~equivariance_probe.runs.compare` — several models over the same windows.
* :mod:`~equivariance_probe.runs.scan` — one model over the same text at several context lengths.
* :mod:`~equivariance_probe.runs.positional` — where order comes from, in one call.
* :mod:`~equivariance_probe.runs.checkpoint` — chunked runs that resume bitwise-exactly, and the output
  folder's lock.
* :mod:`~equivariance_probe.runs.tables` — headline numbers side by side, paired differences,
  windows needed (markdown from results' summaries).
"""
