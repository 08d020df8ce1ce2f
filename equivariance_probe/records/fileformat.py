"""Result files of format versions 1 and 2 (JSON), and the one atomic writer of every file.

Place in the seams: *records*, below :mod:`equivariance_probe.result`. Results are written in
format 3 (:mod:`~equivariance_probe.records.result_file`: safetensors arrays and a JSON header);
this module reads the JSON files that earlier versions wrote, and writes every file of the
package (results, checkpoint state, positional studies) through :func:`write_atomically`. It
knows the shape of a version-1/2 dict (which fields, which types) and how arrays are encoded in
it, not the statistics' maths.

Versions:

* **1** — ``{"format_version", "kind", "metadata", "statistics": {"config", "n_windows",
  "n_tokens", "arrays", "sample"}, "summary"}``; arrays are ``{"dtype": "float64", "shape",
  "data"}`` with ``data`` the base64 of the little-endian float64 bytes.
* **2** — adds ``"complete"`` (``false`` for the partial result of a run that stopped with an
  error or an interrupt, so a partial file never reads as a finished one) and ``"checksum"``
  (``"sha256:<hex>"`` over the statistics' encoded arrays and sample, see :func:`checksum`),
  verified on load, so a file that was edited or corrupted without being truncated is refused.

* **3** — safetensors, see :mod:`~equivariance_probe.records.result_file`.

:func:`upgrade` turns a version-1 dict into a version-2 one (a version-1 file is complete
unless its metadata says otherwise; it has no checksum to verify); :func:`check_schema`
checks every field the loader reads before it reads it, so a malformed file gets a
:class:`~equivariance_probe.errors.ResultFileError` naming the field, never a ``KeyError``;
:func:`read_json_result` reads a version-1/2 file into statistics.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import EquivarianceProbeError, FileWriteError, ResultFileError, is_integer
from ..statistics import STATISTICS, AttentionStatistics, EntrySample
from .layouts import current_layout

__all__ = [
    "JSON_FORMAT_VERSION",
    "NEWEST_FORMAT_VERSION",
    "RESULT_KIND",
    "checksum",
    "upgrade",
    "check_schema",
    "check_config",
    "check_version",
    "read_json_result",
    "write_atomically",
    "write_json_atomically",
    "write_text_atomically",
    "write_bytes_atomically",
    "make_folder",
    "encode_array",
    "decode_array",
    "jsonable",
    "MAX_JSON_DEPTH",
    "parse_json",
    "check_depth",
    "check_finite",
]

#: How deeply a file's JSON may nest (objects and lists). The package writes headers a few levels deep
#: (metadata -> study -> ...); a file nested deeper was crafted, and Python's parser and every
#: recursive walk over it would end in a bare RecursionError (its limit is about 1000 frames).
MAX_JSON_DEPTH = 64

#: The last version written as JSON (1 and 2 are read here).
JSON_FORMAT_VERSION = 2
#: The newest version this equivariance_probe reads (and writes: :mod:`~equivariance_probe.records.result_file`).
NEWEST_FORMAT_VERSION = 3
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


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None], *, size: int | None = None) -> Path:
    """Write ``path`` through ``write(temporary)``, flush the temporary file to disk, then rename it over ``path``.

    A crash or SIGKILL at any moment leaves either the previous file or the new one, never a
    truncated or renamed-but-empty file (a kill may leave ``<name>.tmp`` beside it). An error in
    ``write`` or in the rename removes the temporary file and leaves ``path`` as it was.

    Args:
        path: the file.
        write: writes the whole file to the path it is given.
        size: the file's size in bytes where it is known beforehand, for the message of a full disk.

    Raises:
        FileWriteError: the folder does not exist or is not writable, ``path`` is a folder, or the
            file system refused the write (a full disk says how much space the file needed and how
            much is free; the original ``OSError`` is its cause).
    """
    path = Path(path)
    # Refused before anything is written, in the words of the OSError the write would raise.
    if path.is_dir():
        raise FileWriteError(_write_failure(path, IsADirectoryError()))
    if not path.parent.is_dir():
        raise FileWriteError(_write_failure(path, FileNotFoundError()))
    temporary = path.with_name(path.name + ".tmp")
    try:
        write(temporary)
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException as error:
        if size is None:  # at least what was written before the failure
            with contextlib.suppress(OSError):
                size = temporary.stat().st_size
        # The clean-up must not replace the error it cleans up after: on a read-only file system the
        # temporary file was never created, and removing it fails too (EROFS, not ENOENT).
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError) and not isinstance(error, EquivarianceProbeError):
            raise FileWriteError(_write_failure(path, error, size=size)) from error
        raise
    return path


def make_folder(folder: str | os.PathLike) -> Path:
    """Create ``folder`` and its parents where missing (a folder that results and checkpoints go into).

    Raises:
        FileWriteError: the file system refused (not writable, a file in the way, a full disk).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise FileWriteError(f"cannot create the folder {str(folder)!r}: {type(error).__name__}: "
                             f"{error.strerror or error}; check the disk has space and its parent is writable") from error
    return folder


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` through :func:`write_atomically` (a figure, a report)."""
    return write_atomically(path, lambda temporary: temporary.write_bytes(data), size=len(data))


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as UTF-8 through :func:`write_atomically`."""
    return write_bytes_atomically(path, text.encode("utf-8"))


def write_json_atomically(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON through :func:`write_atomically`."""
    return write_text_atomically(path, json.dumps(data))


def _write_failure(path: Path, error: OSError, *, size: int | None = None) -> str:
    """What went wrong writing ``path`` and how to fix it (``size``: the bytes the file needs, or at
    least needed, for the message of a full disk)."""
    if isinstance(error, PermissionError):
        return (f"cannot write {str(path)!r}: the folder {str(path.parent)!r} is not writable by this user "
                f"({error.strerror}); write into a folder you can write to, or change its permissions")
    if isinstance(error, IsADirectoryError):
        return (f"cannot write {str(path)!r}: it is a folder; give a file name inside it, e.g. "
                f"{str(path / 'result.safetensors')!r}")
    if isinstance(error, FileNotFoundError):
        return (f"cannot write {str(path)!r}: the folder {str(path.parent)!r} does not exist; create it first "
                "(mkdir -p) or write into an existing folder")
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{_megabytes(shutil.disk_usage(path.parent).free)} are free there"
        except OSError:
            free = "the free space is unknown"
        needed = "" if size is None else f"; the file needs {_megabytes(size)}"
        what = "no space left on the device" if error.errno == errno.ENOSPC else "the disk quota is exceeded"
        return (f"cannot write {str(path)!r}: {what} ({error.strerror}){needed} and {free}; free that much space "
                "(or write to another disk), then run again")
    return (f"cannot write {str(path)!r}: {type(error).__name__}: {error.strerror or error}; check the disk has "
            "space and the folder is writable, then save again")


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.2f} MB ({size} bytes)"


def parse_json(text: str | bytes, source: str, what: str = "its JSON") -> Any:
    """``text`` parsed as JSON (bytes must be UTF-8), nested at most :data:`MAX_JSON_DEPTH` deep.

    Raises:
        ResultFileError: naming ``source`` and ``what``: not UTF-8, not JSON, or nested too deeply.
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as error:
        raise ResultFileError(f"{source}: {what} is not valid UTF-8 (byte {error.start}: {error.reason}); the file is "
                              "damaged or not one of equivariance_probe; use an intact copy") from None
    except json.JSONDecodeError as error:
        raise ResultFileError(f"{source}: {what} is not valid JSON ({error}); truncated, corrupted or edited? "
                              "Use an intact copy") from None
    except RecursionError:
        raise ResultFileError(f"{source}: {what} is nested deeper than Python's parser reads (more than "
                              f"{MAX_JSON_DEPTH} levels are never written); the file was crafted or damaged") from None
    check_depth(data, source, what)
    return data


def check_depth(data: Any, source: str, what: str = "its JSON", limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON data nested more than ``limit`` levels (walked without recursion, so that any depth is refused
    by name rather than by a RecursionError).

    Raises:
        ResultFileError: naming ``source``, ``what``, the depth reached and the limit.
    """
    level = [data] if isinstance(data, (dict, list)) else []
    depth = 0
    while level:  # one level at a time, containers only: a header's thousands of numbers are never pushed
        depth += 1
        if depth > limit:
            raise ResultFileError(f"{source}: {what} is nested more than {limit} levels deep (the package writes a "
                                  "few); the file was crafted or damaged: use an intact copy")
        level = [item for value in level for item in (value.values() if isinstance(value, dict) else value)
                 if isinstance(item, (dict, list))]


def check_finite(tensors: Mapping[str, np.ndarray], source: str | os.PathLike, names: Iterable[str] | None = None) -> None:
    """Refuse float arrays holding NaN or infinity: sums the package writes are finite, so such a value comes
    from a broken run or an edited file, and a number computed from it would look like any other.

    Raises:
        ResultFileError: naming ``source``, every such array, and how many values of each are not finite.
    """
    bad = []
    for name in (tensors if names is None else names):
        array = tensors[name]
        if array.dtype.kind == "f":
            count = int(array.size - np.count_nonzero(np.isfinite(array)))
            if count:
                bad.append(f"{name!r} ({count} of {array.size})")
    if bad:
        raise ResultFileError(
            f"{source}: non-finite values (NaN or infinity) in the array{'s' if len(bad) > 1 else ''} {', '.join(bad)}; "
            "the sums a run writes are finite, so the file comes from a broken run or was edited (its digests were "
            "recomputed): use an intact copy, or run again"
        )


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


def check_version(version: Any, source: str) -> None:
    """Raise :class:`ResultFileError` unless ``version`` is one this code reads (1..newest)."""
    if not is_integer(version, 1) or version > NEWEST_FORMAT_VERSION:
        raise ResultFileError(
            f"{source} has format_version {version!r}; this equivariance_probe reads versions "
            f"1..{NEWEST_FORMAT_VERSION}. Upgrade equivariance_probe to read newer files"
        )


def upgrade(data: dict[str, Any], source: str = "result") -> dict[str, Any]:
    """A version-1 or -2 file's dict in version 2 (a copy if it had to change).

    Raises:
        ResultFileError: not a result, or a version this code does not know (newer, or < 1),
            or version 3 in a JSON file (version 3 is a safetensors file).
    """
    if not isinstance(data, dict) or data.get("kind") != RESULT_KIND:
        raise ResultFileError(f"{source} is not an equivariance_probe result (no kind {RESULT_KIND!r})")
    version = data.get("format_version")
    check_version(version, source)
    if version > JSON_FORMAT_VERSION:
        raise ResultFileError(
            f"{source} is JSON but says format_version {version}, which is a safetensors file; the file is "
            "malformed (was it edited, or written by another program?)"
        )
    if version == 1:
        data = dict(data)
        metadata = data.get("metadata")
        data["complete"] = bool(metadata.get("complete", True)) if isinstance(metadata, dict) else True
        data.pop("checksum", None)  # version 1 wrote none, so there is nothing to verify
        data["format_version"] = 2
    return data


def require(condition: bool, source: str, what: str) -> None:
    """Refuse a malformed result file: :class:`ResultFileError` naming ``what`` unless ``condition``."""
    if not condition:
        raise ResultFileError(f"{source}: {what}; the file is malformed (was it edited, or written by another program?)")


def check_config(statistics: dict[str, Any], source: str) -> None:
    """Check a file's ``statistics`` block: its ``config`` (every field the statistics are built
    from, with its type) and the counts ``n_windows`` and ``n_tokens``.

    Raises:
        ResultFileError: naming the first missing or ill-typed field.
    """
    config = statistics.get("config")
    require(isinstance(config, dict), source, "'statistics.config' is missing or not an object")
    for name, types in _CONFIG_TYPES.items():
        value = config.get(name)
        require(
            name in config and isinstance(value, types) and not (isinstance(value, bool) and bool not in types),
            source,
            f"'statistics.config.{name}' is missing or has the wrong type ({type(value).__name__})",
        )
    require(len(config["windows"]) == config["n_layers"], source, "'statistics.config.windows' needs one entry per layer")
    for name in ("n_layers", "n_heads", "n_positions"):
        require(config[name] >= 1, source, f"'statistics.config.{name}' must be positive")
    for name in ("n_windows", "n_tokens"):
        value = statistics.get(name)
        require(is_integer(value, 0), source,
                 f"'statistics.{name}' must be a non-negative integer")


def check_schema(data: dict[str, Any], source: str = "result") -> None:
    """Check the fields of a version-2 dict (after :func:`upgrade`) before any is read.

    Raises:
        ResultFileError: naming the first missing or ill-typed field, or a checksum mismatch.
    """
    require(isinstance(data.get("metadata", {}), dict), source, "'metadata' must be an object")
    require(isinstance(data.get("complete"), bool), source, "'complete' must be true or false")
    statistics = data.get("statistics")
    require(isinstance(statistics, dict), source, "'statistics' is missing or not an object")
    check_config(statistics, source)
    arrays = statistics.get("arrays")
    require(isinstance(arrays, dict), source, "'statistics.arrays' is missing or not an object")
    for name, array in arrays.items():
        require(isinstance(array, dict) and {"dtype", "shape", "data"} <= set(array), source,
                 f"array {name!r} needs dtype, shape and data")
    sample = statistics.get("sample")
    if sample is not None:
        require(isinstance(sample, dict) and isinstance(sample.get("columns"), dict), source,
                 "'statistics.sample' needs columns")
        lengths = {tuple(c.get("shape", ())) for c in sample["columns"].values() if isinstance(c, dict)}
        require(len(lengths) <= 1, source, "the sample's columns differ in length")
    if "checksum" in data:
        require(data["checksum"] == checksum(statistics), source,
                 "the checksum does not match the statistics (the numbers were changed or corrupted after saving)")


def read_json_result(data: dict[str, Any], source: str = "result") -> tuple[dict[str, Any], AttentionStatistics]:
    """The version-2 dict (after :func:`upgrade` and :func:`check_schema`) and the statistics of a
    version-1/2 file's parsed JSON. Such files carry no window fingerprints.

    Raises:
        ResultFileError: not a result, an unknown version, a malformed field or a checksum mismatch.
    """
    data = upgrade(data, source)
    check_schema(data, source)
    try:
        stats_data = data["statistics"]
        config = stats_data["config"]
        expected = AttentionStatistics.array_shapes(config)
        unknown = set(stats_data["arrays"]) - set(STATISTICS)
        if unknown:
            raise ResultFileError(f"{source}: unknown statistics {sorted(unknown)}")
        arrays = {}
        for name, shape in expected.items():
            array = decode_array(stats_data["arrays"][name])
            if tuple(array.shape) != shape:
                raise ResultFileError(f"{source}: array {name!r} has shape {tuple(array.shape)}, expected {shape}")
            arrays[name] = array
        check_finite({name: array.numpy() for name, array in arrays.items()}, source)
        sample = stats_data.get("sample")
        if sample is not None:
            columns = {c: decode_array(v).numpy() for c, v in sample["columns"].items()}
            sample = EntrySample.from_arrays(int(sample["size"]), columns)
        config, arrays = current_layout(config, arrays)
        statistics = AttentionStatistics.from_arrays(
            config, arrays, n_windows=stats_data["n_windows"], n_tokens=stats_data["n_tokens"], sample=sample
        )
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, ResultFileError):
            raise
        raise ResultFileError(f"{source} is missing or has a malformed field: {error!r}") from error
    return data, statistics


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
