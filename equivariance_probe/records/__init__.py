"""What a result is and where it came from: its file format, fingerprints, and shards.

Place in the seams: above the adapters and the statistics, below the result.

* :mod:`~equivariance_probe.records.result_file` — result files (format 3: safetensors arrays and a
  JSON header), opened by content whatever their version, checked before they are read.
* :mod:`~equivariance_probe.records.shift_file` — shift result files: read lazily, each array against its
  digest, and what each format version added declared once, so older files load.
* :mod:`~equivariance_probe.records.container` — the file family: safetensors tensors plus one JSON
  header, header and tensor checksums, telling a file's format by its first bytes.
* :mod:`~equivariance_probe.records.fileformat` — result files of versions 1-2 (JSON), schema checks,
  and the one atomic writer of every file.
* :mod:`~equivariance_probe.records.provenance` — fingerprints of model, corpus and configuration,
  the 64-bit fingerprint of each window, and what a run's result records of itself.
* :mod:`~equivariance_probe.records.sharding` — ``Shard`` and the checks that merge shards.
"""
