"""The package's file family: arrays as safetensors tensors, everything else as JSON in the header.

Place in the seams: *records*. Result files (:mod:`~equivariance_probe.records.result_file`) and
positional studies (:class:`~equivariance_probe.runs.positional.PositionalStudy`) are written
here. Each is one `safetensors <https://huggingface.co/docs/safetensors>`_ file:

* **tensors** — name → array (float64 sums, uint64 window fingerprints, ...), the raw
  little-endian bytes, readable with ``safetensors.numpy.load_file(path)`` or ``safe_open``;
* **header** — the safetensors ``__metadata__`` holds one entry, ``"equivariance_probe"``, a JSON
  object with at least ``kind``, ``format_version``, ``digests`` and ``header_checksum`` (the
  sha256 of that object without this field, as JSON with sorted keys and no spaces), so that an
  edited header is refused when the file is opened. ``digests`` maps every tensor's name to its
  own ``"sha256:<hex>"`` (:func:`tensor_digest`), computed from the arrays in memory as they are
  written; :func:`read_tensors` checks each array it reads against it, so a byte changed on disk
  or in a copy is refused naming the file and the array. safetensors itself checks only the
  header's structure and the tensors' offsets, never the data. Files written before digests have
  none and read as before (their kind's own whole-file checksum, where it has one, is checked).

Why safetensors rather than ``.npz`` + JSON: one file, a header that is read without touching
the arrays (``safe_open(path).metadata()``, so summaries cost milliseconds whatever the size),
no pickle, memory-mapped reads, readers in Python, Rust and JavaScript, and the format this
ecosystem already uses for model and SAE weights (``safetensors`` is already a dependency of
transformers). ``.npz`` is a zip archive whose members must be read to list their shapes, and
whose metadata would need a pickled object or a second file.

:func:`file_kind` tells a file of this family from a JSON file by its first bytes, never by its
name; every write goes through :func:`~equivariance_probe.records.fileformat.write_atomically`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ResultFileError
from .fileformat import check_finite, parse_json, write_atomically

__all__ = [
    "HEADER_KEY",
    "Container",
    "file_kind",
    "header_kind",
    "write_container",
    "read_container",
    "read_tensors",
    "tensor_checksum",
    "tensor_digest",
    "header_checksum",
    "check_finite",
]

#: The one ``__metadata__`` entry of the package's files: the JSON header.
HEADER_KEY = "equivariance_probe"


def file_kind(path: str | os.PathLike) -> str:
    """``"safetensors"``, ``"json"``, or ``"unknown"``, from the file's first bytes.

    A safetensors file starts with the length ``n`` of its JSON header as an 8-byte little-endian
    integer, then ``{``; a JSON file starts with ``{`` (after any whitespace). Eight bytes of text
    read as an integer are far beyond any file's size, so the two cannot be confused.

    Raises:
        ResultFileError: the file cannot be read, or is a safetensors file cut inside its header.
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            head = handle.read(64)
            size = os.fstat(handle.fileno()).st_size
    except OSError as error:
        raise ResultFileError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    if len(head) > 8 and head[8:9] == b"{":
        length = int.from_bytes(head[:8], "little")
        if 2 <= length <= size - 8:
            return "safetensors"
        if length < 2**32:
            raise ResultFileError(
                f"{path} is a safetensors file cut inside its header ({size} bytes, the header alone needs "
                f"{length + 8}): truncated by an interrupted copy or download? Copy or write it again"
            )
    if head.lstrip()[:1] in (b"{", b"["):
        return "json"
    return "unknown"


def header_kind(path: str | os.PathLike) -> str | None:
    """The ``kind`` a file of the family names in its header (``"equivariance_probe.ShiftResult"`` ...), read from
    the header alone; ``None`` for any other file. Nothing is checked: :func:`read_container` does that."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as handle:
            kind = json.loads((handle.metadata() or {}).get(HEADER_KEY, "{}")).get("kind")
    except Exception:  # noqa: BLE001 - any file that is not ours has no kind; reading it properly names the fault
        return None
    return kind if isinstance(kind, str) else None


def header_checksum(header: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of ``header`` without its ``header_checksum`` field, as compact JSON with sorted keys."""
    body = {key: value for key, value in header.items() if key != "header_checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def tensor_checksum(tensors: Mapping[str, np.ndarray], counts: Iterable[Any] = ()) -> str:
    """``"sha256:<hex>"`` over ``counts`` and every tensor in name order.

    The hashed bytes are, for each of ``counts``, ``str(count)`` followed by ``|``; then for each
    tensor, ``name|dtype|shape|`` (dtype as numpy spells it, e.g. ``float64``; shape as a Python
    tuple) followed by the tensor's raw little-endian bytes. The arrays are hashed in place, without
    copies.
    """
    digest = hashlib.sha256()
    for count in counts:
        digest.update(f"{count}|".encode())
    for name in sorted(tensors):
        _hash_tensor(digest, name, tensors[name])
    return "sha256:" + digest.hexdigest()


def tensor_digest(name: str, array: np.ndarray) -> str:
    """``"sha256:<hex>"`` of one tensor: the bytes ``name|dtype|shape|`` (as :func:`tensor_checksum`
    spells them) followed by the tensor's raw little-endian bytes, so that a changed shape or dtype
    changes the digest as a changed byte does."""
    return "sha256:" + _hash_tensor(hashlib.sha256(), name, array).hexdigest()


def _hash_tensor(digest: Any, name: str, array: np.ndarray) -> Any:
    """``digest`` updated with ``name|dtype|shape|`` and the array's bytes, hashed in place (no copy)."""
    array = _little_endian(array)
    digest.update(f"{name}|{array.dtype.name}|{tuple(array.shape)}|".encode())
    digest.update(memoryview(array).cast("B"))
    return digest


def _little_endian(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    return array if array.dtype.byteorder != ">" else array.astype(array.dtype.newbyteorder("<"))


def write_container(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], header: Mapping[str, Any]) -> Path:
    """Write ``tensors`` and the JSON ``header`` (with ``digests`` and ``header_checksum`` added) atomically.

    ``header`` must be JSON; NaN and infinities are written as Python's ``json`` writes them
    (``NaN``, ``Infinity``), which ``json.loads`` reads back. Result files have none
    (:func:`~equivariance_probe.records.fileformat.jsonable` writes them as ``null``).
    """
    from safetensors.numpy import save_file

    arrays = {name: _little_endian(value) for name, value in tensors.items()}
    header = dict(header)
    header["digests"] = {name: tensor_digest(name, array) for name, array in sorted(arrays.items())}
    header["header_checksum"] = header_checksum(header)
    text = json.dumps(header)
    # The file's size as safetensors lays it out (8-byte length, header of about 100 bytes a
    # tensor, data), for the message of a full disk.
    size = 8 + len(text) + 100 * len(arrays) + sum(array.nbytes for array in arrays.values())

    def write(temporary: Path) -> None:
        # safetensors makes its files readable by their owner only; a result file gets the
        # permissions of any file the user writes (the umask's), read from a file created here first.
        open(temporary, "wb").close()
        mode = os.stat(temporary).st_mode & 0o777
        try:
            save_file(arrays, str(temporary), metadata={HEADER_KEY: text})
        except OSError:
            raise
        except Exception as error:  # noqa: BLE001 - safetensors' own error type wraps the OSError of a failed write
            raise _os_error_of(error, temporary) from error
        os.chmod(temporary, mode)

    return write_atomically(path, write, size=size)


def _os_error_of(error: Exception, path: Path) -> Exception:
    """The ``OSError`` inside a safetensors ``SafetensorError`` ("I/O error: No space left on device
    (os error 28)", Rust's ``io::Error`` as it prints itself), so that a full disk reads as one;
    ``error`` itself when it holds none."""
    match = re.search(r"\(os error (\d+)\)", str(error))
    if match is None:
        return error
    number = int(match.group(1))
    return OSError(number, os.strerror(number), str(path))


@dataclass(frozen=True)
class Container:
    """One file of the family, opened: its header and the dtype and shape of every tensor.

    Attributes:
        path: the file.
        header: the JSON header (``header_checksum`` verified).
        tensors: name → ``(dtype, shape)``, dtype as safetensors spells it (``"F64"``, ``"U64"``, ...).
    """

    path: Path
    header: dict[str, Any]
    tensors: dict[str, tuple[str, tuple[int, ...]]]

    @property
    def digests(self) -> dict[str, str] | None:
        """name → ``"sha256:<hex>"`` of every tensor, or ``None`` for a file written before digests."""
        return self.header.get("digests")


def read_container(path: str | os.PathLike, kind: str) -> Container:
    """Open a file of the family and read its header only (no tensor data is read).

    Args:
        path: the file.
        kind: the ``kind`` its header must have (e.g. ``"equivariance_probe.ProbeResult"``).

    Raises:
        ResultFileError: not a complete safetensors file, no header of this package, another
            kind, or an edited header.
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="np") as handle:
            metadata = handle.metadata() or {}
            tensors = {
                name: (handle.get_slice(name).get_dtype(), tuple(handle.get_slice(name).get_shape()))
                for name in handle.keys()
            }
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type (and OSError) on bad files
        raise ResultFileError(
            f"{path} is not a complete safetensors file ({error}); truncated or corrupted? Copy or write it again"
        ) from None
    if HEADER_KEY not in metadata:
        raise ResultFileError(
            f"{path} is a safetensors file but not one of equivariance_probe (no {HEADER_KEY!r} entry in its "
            "metadata): model weights, or a file of another program?"
        )
    header = parse_json(metadata[HEADER_KEY], str(path), f"its {HEADER_KEY!r} header")
    if not isinstance(header, dict):
        raise ResultFileError(f"{path}: its {HEADER_KEY!r} header is not a JSON object; the file was edited")
    if header.get("kind") != kind:
        raise ResultFileError(
            f"{path} holds {_shown(header.get('kind'))}, not {kind!r}"
            + (f"; read it with {str(header['kind']).rsplit('.', 1)[-1]}.load" if isinstance(header.get("kind"), str) else "")
        )
    if header.get("header_checksum") != header_checksum(header):
        raise ResultFileError(
            f"{path}: the header checksum does not match its header (the header was edited or corrupted after saving)"
        )
    digests = header.get("digests")
    if digests is not None and not (isinstance(digests, dict) and all(isinstance(value, str) for value in digests.values())):
        raise ResultFileError(f"{path}: its 'digests' must map array names to 'sha256:<hex>'; the file was edited")
    return Container(path, header, tensors)


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a crafted file's field can be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def read_tensors(container: Container, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The tensors ``names`` (default: all) of an opened file, as numpy arrays (read once, writable),
    each checked against its digest where the file has digests.

    Raises:
        ResultFileError: the file cannot be read as safetensors (changed since it was opened?), or
            an array does not match its digest (naming the file and every such array).
    """
    from safetensors import safe_open

    path = container.path
    try:
        with safe_open(str(path), framework="np") as handle:
            tensors = {name: handle.get_tensor(name) for name in (handle.keys() if names is None else names)}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type (and OSError) on bad files
        raise ResultFileError(f"cannot read the arrays of {path} ({error}); was it changed or truncated?") from None
    digests = container.digests
    if digests is not None:
        changed = [name for name, array in tensors.items() if tensor_digest(name, array) != digests.get(name)]
        if changed:
            raise ResultFileError(
                f"{path}: the array{'s' if len(changed) > 1 else ''} {', '.join(map(repr, changed))} "
                f"{'do' if len(changed) > 1 else 'does'} not match {'their digests' if len(changed) > 1 else 'its digest'} "
                "(the bytes changed after saving: a fault on disk, in memory or in a copy); use an intact copy"
            )
    return tensors
