"""What a result is and where it came from: its file format, fingerprints, and shards.

Place in the seams: above the adapters and the statistics, below the result.

* :mod:`~equivariance_probe.records.fileformat` — result file versions, schema checks, checksums,
  atomic writes.
* :mod:`~equivariance_probe.records.provenance` — fingerprints of model, corpus and configuration.
* :mod:`~equivariance_probe.records.sharding` — ``Shard`` and the checks that merge shards.
"""
