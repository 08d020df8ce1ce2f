"""Result files: format versions, the upgrade of older versions, and the schema check on load.

Place in the seams: *records*, below :mod:`equivariance_probe.result`, which turns a
:class:`~equivariance_probe.result.ProbeResult` into a dict and back with the helpers here.
This module knows the shape of that dict (which fields, which types) and how arrays are
encoded in it, not the statistics' maths.

Versions:

* **1** — ``{"format_version", "kind", "metadata", "statistics": {"config", "n_windows",
  "n_tokens", "arrays", "sample"}, "summary"}``; arrays are ``{"dtype": "float64", "shape",
  "data"}`` with ``data`` the base64 of the little-endian float64 bytes.
* **2** — adds ``"complete"`` (``false`` for the partial result of a run that stopped with an
  error or an interrupt, so a partial file never reads as a finished one) and ``"checksum"``
  (``"sha256:<hex>"`` over the statistics' encoded arrays and sample, see :func:`checksum`),
  verified on load, so a file that was edited or corrupted without being truncated is refused.

:func:`upgrade` turns any older version into the current one (a version-1 file is complete
unless its metadata says otherwise; it has no checksum to verify); :func:`check_schema`
checks every field the loader reads before it reads it, so a malformed file gets a
:class:`~equivariance_probe.errors.ResultFileError` naming the field, never a ``KeyError``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ResultFileError

__all__ = [
    "FORMAT_VERSION",
    "RESULT_KIND",
    "checksum",
    "upgrade",
    "check_schema",
    "write_json_atomically",
    "encode_array",
    "decode_array",
    "jsonable",
]

#: The version this equivariance_probe writes; it reads 1..FORMAT_VERSION.
FORMAT_VERSION = 2
#: The ``kind`` field of every result file.
RESULT_KIND = "equivariance_probe.ProbeResult"

#: config field -> accepted types (checked before an AttentionStatistics is built from it).
_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "n_layers": (int,),
    "n_heads": (int,),
    "n_positions": (int,),
    "windows": (list,),
    "log_floor": (float, int, type(None)),
    "excluded_keys": (list,),
    "keep_pattern": (bool,),
}


def write_json_atomically(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON to a temporary file, flush it to disk, then rename it over ``path``.

    A crash or SIGKILL at any moment leaves either the previous file or the new one, never a
    truncated or renamed-but-empty file.
    """
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return path


def checksum(statistics: dict[str, Any]) -> str:
    """``"sha256:<hex>"`` of a file's ``statistics`` block: counts, arrays and sample, in name order.

    Computed on the encoded (base64) arrays, so checking it needs no decoding.
    """
    digest = hashlib.sha256()

    def update(*parts: Any) -> None:
        # Piece by piece: the same bytes as hashing f"{a}|{b}|...|", without building a copy of
        # every (up to hundreds of MB) base64 string first.
        for part in parts:
            digest.update(str(part).encode())
            digest.update(b"|")

    update(statistics.get("n_windows"), statistics.get("n_tokens"))
    for name in sorted(statistics.get("arrays", {})):
        array = statistics["arrays"][name]
        update(name, array.get("shape"), array.get("data"))
    sample = statistics.get("sample")
    if sample is not None:
        update("sample", sample.get("size"))
        for name in sorted(sample.get("columns", {})):
            update(name, sample["columns"][name].get("data"))
    return "sha256:" + digest.hexdigest()


def upgrade(data: dict[str, Any], source: str = "result") -> dict[str, Any]:
    """The file's dict in the current format (a copy if it had to change).

    Raises:
        ResultFileError: not a result, or a version this code does not know (newer, or < 1).
    """
    if not isinstance(data, dict) or data.get("kind") != RESULT_KIND:
        raise ResultFileError(f"{source} is not an equivariance_probe result (no kind {RESULT_KIND!r})")
    version = data.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise ResultFileError(
            f"{source} has format_version {version!r}; this equivariance_probe reads versions 1..{FORMAT_VERSION}. "
            "Upgrade equivariance_probe to read newer files"
        )
    if version == 1:
        data = dict(data)
        metadata = data.get("metadata")
        data["complete"] = bool(metadata.get("complete", True)) if isinstance(metadata, dict) else True
        data.pop("checksum", None)  # version 1 wrote none, so there is nothing to verify
        data["format_version"] = 2
    return data


def _require(condition: bool, source: str, what: str) -> None:
    if not condition:
        raise ResultFileError(f"{source}: {what}; the file is malformed (was it edited, or written by another program?)")


def check_schema(data: dict[str, Any], source: str = "result") -> None:
    """Check the fields :meth:`ProbeResult.from_dict` reads, after :func:`upgrade`.

    Raises:
        ResultFileError: naming the first missing or ill-typed field, or a checksum mismatch.
    """
    _require(isinstance(data.get("metadata", {}), dict), source, "'metadata' must be an object")
    _require(isinstance(data.get("complete"), bool), source, "'complete' must be true or false")
    statistics = data.get("statistics")
    _require(isinstance(statistics, dict), source, "'statistics' is missing or not an object")
    config = statistics.get("config")
    _require(isinstance(config, dict), source, "'statistics.config' is missing or not an object")
    for name, types in _CONFIG_TYPES.items():
        value = config.get(name)
        _require(
            name in config and isinstance(value, types) and not (isinstance(value, bool) and bool not in types),
            source,
            f"'statistics.config.{name}' is missing or has the wrong type ({type(value).__name__})",
        )
    _require(len(config["windows"]) == config["n_layers"], source, "'statistics.config.windows' needs one entry per layer")
    for name in ("n_windows", "n_tokens"):
        value = statistics.get(name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, source,
                 f"'statistics.{name}' must be a non-negative integer")
    arrays = statistics.get("arrays")
    _require(isinstance(arrays, dict), source, "'statistics.arrays' is missing or not an object")
    for name, array in arrays.items():
        _require(isinstance(array, dict) and {"dtype", "shape", "data"} <= set(array), source,
                 f"array {name!r} needs dtype, shape and data")
    sample = statistics.get("sample")
    if sample is not None:
        _require(isinstance(sample, dict) and isinstance(sample.get("columns"), dict), source,
                 "'statistics.sample' needs columns")
        lengths = {tuple(c.get("shape", ())) for c in sample["columns"].values() if isinstance(c, dict)}
        _require(len(lengths) <= 1, source, "the sample's columns differ in length")
    if "checksum" in data:
        _require(data["checksum"] == checksum(statistics), source,
                 "the checksum does not match the statistics (the numbers were changed or corrupted after saving)")


def encode_array(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype": "float64", "shape", "data"}`` with ``data`` the base64 of the little-endian float64 bytes."""
    # No copies of float64 arrays before base64 (a Gemma-sized summed pattern is 600 MB).
    array = np.ascontiguousarray(tensor.detach().cpu().numpy(), dtype="<f8")
    return {"dtype": "float64", "shape": list(array.shape), "data": base64.b64encode(memoryview(array)).decode("ascii")}


def decode_array(encoded: dict[str, Any]) -> torch.Tensor:
    """The float64 tensor of :func:`encode_array`'s dict (a copy: writable).

    Raises:
        ResultFileError: another dtype, or data that does not match the shape.
    """
    if encoded.get("dtype") != "float64":
        raise ResultFileError(f"unsupported array dtype {encoded.get('dtype')!r}")
    raw = base64.b64decode(encoded["data"], validate=True)
    shape = tuple(int(s) for s in encoded["shape"])
    if len(raw) != 8 * math.prod(shape):
        raise ResultFileError(f"array data of {len(raw)} bytes does not match shape {shape}")
    return torch.from_numpy(np.frombuffer(raw, dtype="<f8").reshape(shape).copy())


def jsonable(value: Any) -> Any:
    """Replace NaN/inf (not valid JSON) with None and numpy scalars with Python ones."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value
