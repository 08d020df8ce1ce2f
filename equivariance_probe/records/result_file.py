"""Result files, format version 3: the sums as safetensors tensors, the rest as a JSON header.

Place in the seams: *records*, below :mod:`equivariance_probe.result`, whose ``save`` and ``load``
call :func:`write_result_file` and :func:`open_result_file`. It knows which tensors and header
fields a result file holds and checks them, not the statistics' maths.

One file per result (:mod:`~equivariance_probe.records.container`):

* tensors — every array of :class:`~equivariance_probe.statistics.AttentionStatistics`
  (``query_count``, ``log_sum``, ... as in :data:`~equivariance_probe.statistics.STATISTICS`,
  float64, under their own names); the entry sample's columns as ``sample/<column>`` (float64);
  the windows' fingerprints as ``window_fingerprints`` (uint64, sorted: see
  :func:`~equivariance_probe.records.provenance.window_fingerprint`); with interval groups
  (config ``interval_groups > 0``), the occupied groups' sums as ``groups/<name>`` (float64, one
  row per occupied group, :data:`~equivariance_probe.statistics.groups.GROUP_SUMS`) and their ids as
  ``groups/index`` (int64, sorted); with per-window first-token weights (config ``keep_window_sinks``),
  ``window_sinks/alpha`` (float64 ``[n_windows, L, H]``) and ``window_sinks/keys`` (uint64, each window's
  interval-group key, :mod:`~equivariance_probe.statistics.window_sinks`);
* header (``__metadata__["equivariance_probe"]``, JSON) — ``kind``, ``format_version`` (3),
  ``complete``, ``checksum`` (:func:`~equivariance_probe.records.container.tensor_checksum` of
  every tensor with the counts ``n_windows``, ``n_tokens`` first), ``statistics`` (``config``,
  ``n_windows``, ``n_tokens``, ``sample_size``, and with interval groups ``groups``:
  ``occupied``, ``keys``, ``unavailable``), ``metadata`` (the run's), ``summary`` (the
  headline numbers, :meth:`~equivariance_probe.result.ProbeResult.summary`), ``digests`` (one per
  tensor) and ``header_checksum``.

When things are checked: :func:`open_result_file` reads the header alone and checks it (kind,
version, header checksum, every field, and the name, dtype and shape of every tensor against
the statistics' configuration) before anything else is read; :meth:`ResultFile.statistics`
reads the tensors on first use and checks each against its digest then (the header's
``digests``, :mod:`~equivariance_probe.records.container`), and all of them with the counts
against ``checksum`` (which also ties the header's counts to the arrays; files written before
digests have this check alone). A summary
therefore costs one header read, and a file whose numbers were changed is refused, naming the
array, as soon as they are used.

Versions 1 and 2 (JSON, :mod:`~equivariance_probe.records.fileformat`) are read by the same
:func:`open_result_file`, which tells the formats apart by their first bytes. Version-3 files
written before interval groups (a config without ``interval_groups``) read as results without
them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ResultFileError, is_integer
from ..statistics import AttentionStatistics, EntrySample
from ..statistics.sample import COLUMNS as SAMPLE_COLUMNS
from .container import Container, check_finite, file_kind, read_container, read_tensors, tensor_checksum, write_container
from .layouts import current_layout
from .fileformat import NEWEST_FORMAT_VERSION, RESULT_KIND, check_config, check_version, jsonable, parse_json, read_json_result, require

__all__ = [
    "FORMAT_VERSION",
    "RESULT_SUFFIX",
    "ResultFile",
    "write_result_file",
    "open_result_file",
    "result_tensors",
]

#: The version :func:`write_result_file` writes.
FORMAT_VERSION = NEWEST_FORMAT_VERSION
#: The file name ending the study, the command line and checkpoints use.
RESULT_SUFFIX = ".safetensors"
#: Tensor names besides the statistics' arrays.
FINGERPRINTS = "window_fingerprints"
SAMPLE_PREFIX = "sample/"
GROUPS_PREFIX = "groups/"
WINDOW_SINKS_PREFIX = "window_sinks/"


def result_tensors(statistics: AttentionStatistics) -> dict[str, np.ndarray]:
    """Every tensor a result file holds for ``statistics`` (numpy views of the sums, no copies on the CPU)."""
    tensors = {name: value.detach().cpu().numpy() for name, value in statistics.arrays.items()}
    if statistics.sample is not None:
        for column, values in statistics.sample.to_arrays().items():
            tensors[SAMPLE_PREFIX + column] = np.asarray(values, dtype=np.float64)
    tensors[FINGERPRINTS] = np.asarray(statistics.window_fingerprints, dtype=np.uint64)
    if statistics.groups is not None:
        tensors.update({GROUPS_PREFIX + name: value for name, value in statistics.groups.tensors().items()})
    if statistics.window_sinks is not None:
        tensors.update({WINDOW_SINKS_PREFIX + name: value for name, value in statistics.window_sinks.tensors().items()})
    return tensors


def write_result_file(
    path: str | os.PathLike,
    statistics: AttentionStatistics,
    metadata: dict[str, Any],
    *,
    complete: bool,
    summary: dict[str, Any],
) -> Path:
    """Write one result (format 3) atomically: a temporary file, flushed to disk, then renamed.

    Args:
        path: the file (any name; ``.safetensors`` is the convention).
        statistics: the sums.
        metadata: the run's metadata (made JSON: NaN becomes ``null``).
        complete: ``False`` for the partial result of a run that stopped.
        summary: the headline numbers, stored so that they can be read without the arrays.
    """
    tensors = result_tensors(statistics)
    header = {
        "kind": RESULT_KIND,
        "format_version": FORMAT_VERSION,
        "complete": bool(complete),
        "checksum": tensor_checksum(tensors, (statistics.n_windows, statistics.n_tokens)),
        "statistics": {
            "config": statistics.config(),
            "n_windows": statistics.n_windows,
            "n_tokens": statistics.n_tokens,
            "sample_size": None if statistics.sample is None else statistics.sample.size,
            **({} if statistics.groups is None else {"groups": statistics.groups.describe()}),
        },
        "metadata": jsonable(metadata),
        "summary": jsonable(summary),
    }
    return write_container(path, tensors, header)


@dataclass
class ResultFile:
    """A result file, opened and checked; its arrays load with :meth:`statistics`.

    Attributes:
        path: the file.
        format_version: as written (1, 2 or 3).
        complete: ``False`` for the partial result of a run that stopped.
        metadata: the run's metadata.
        config: the statistics' configuration (:meth:`AttentionStatistics.config`).
        n_windows, n_tokens: what the sums rest on.
        summary: the stored headline numbers (format 3), or ``None`` (formats 1-2: compute them
            from the arrays, which older versions summarised with fewer numbers).
    """

    path: Path
    format_version: int
    complete: bool
    metadata: dict[str, Any]
    config: dict[str, Any]
    n_windows: int
    n_tokens: int
    summary: dict[str, Any] | None
    _container: Container | None = None
    _statistics: AttentionStatistics | None = None

    @property
    def integrity(self) -> str:
        """How the file's arrays are checked when they are read: ``"digests"`` (every array against
        its own digest, so a mismatch names the array), ``"checksum"`` (files written before
        digests, formats 2 and 3: one checksum over every array, which cannot say which changed)
        or ``"unverified"`` (format 1: nothing to check against)."""
        if self._container is not None:
            return "checksum" if self._container.digests is None else "digests"
        return "checksum" if self.format_version >= 2 else "unverified"

    def statistics(self) -> AttentionStatistics:
        """The sums, read from the file (format 3: now, each array checked against its digest, or
        files written before digests against their checksum; formats 1-2: already read and checked).

        Raises:
            ResultFileError: an array does not match its digest (naming it), or the arrays do not
                match the checksum (changed after saving).
        """
        if self._statistics is not None:
            return self._statistics
        assert self._container is not None
        tensors = read_tensors(self._container, self._container.tensors)  # each array checked against its digest
        # The checksum also covers the counts, which are in the header alone: a header edited and
        # re-signed (its header checksum recomputed) still fails here.
        if tensor_checksum(tensors, (self.n_windows, self.n_tokens)) != self._container.header["checksum"]:
            raise ResultFileError(
                f"{self.path}: the checksum does not match the arrays (the numbers were changed or corrupted after "
                "saving); use an intact copy"
            )
        # A file whose digests were recomputed after its numbers were changed passes both checks above.
        check_finite(tensors, self.path)
        sample = None
        sample_size = self._container.header["statistics"]["sample_size"]
        if sample_size is not None:
            sample = EntrySample.from_arrays(sample_size, {c: tensors[SAMPLE_PREFIX + c] for c in SAMPLE_COLUMNS})
        arrays = {name: torch.from_numpy(tensors[name]) for name in AttentionStatistics.array_shapes(self.config)}
        groups = {name[len(GROUPS_PREFIX):]: value for name, value in tensors.items() if name.startswith(GROUPS_PREFIX)}
        window_sinks = {name[len(WINDOW_SINKS_PREFIX):]: value for name, value in tensors.items()
                        if name.startswith(WINDOW_SINKS_PREFIX)}
        config, arrays = current_layout(self.config, arrays)
        return AttentionStatistics.from_arrays(
            config, arrays, n_windows=self.n_windows, n_tokens=self.n_tokens,
            window_fingerprints=tensors[FINGERPRINTS], sample=sample,
            groups=groups or None, groups_described=self._container.header["statistics"].get("groups"),
            window_sinks=window_sinks or None,
        )


def open_result_file(path: str | os.PathLike) -> ResultFile:
    """Open a result file of any version, telling JSON (1, 2) from safetensors (3) by its first bytes.

    Format 3: reads and checks the header only. Formats 1-2: reads and checks the whole file.

    Raises:
        ResultFileError: unreadable, truncated, not a result, a version this code does not know,
            or a malformed field (named).
    """
    path = Path(path)
    kind = file_kind(path)
    if kind == "json":
        return _open_json(path)
    if kind == "unknown":
        raise ResultFileError(
            f"{path} is not an equivariance_probe result: neither a safetensors file (format 3) nor JSON "
            "(formats 1-2); truncated, or another program's file?"
        )
    container = read_container(path, RESULT_KIND)
    header = container.header
    source = str(path)
    version = header.get("format_version")
    check_version(version, source)
    require(version == FORMAT_VERSION, source, f"a safetensors result must have format_version {FORMAT_VERSION}, not {version!r}")
    require(isinstance(header.get("complete"), bool), source, "'complete' must be true or false")
    require(isinstance(header.get("checksum"), str) and header["checksum"].startswith("sha256:"), source,
             "'checksum' must be 'sha256:<hex>'")
    require(isinstance(header.get("metadata"), dict), source, "'metadata' must be an object")
    check_metadata(header["metadata"], source)
    require(isinstance(header.get("summary"), dict), source, "'summary' must be an object")
    statistics = header.get("statistics")
    require(isinstance(statistics, dict), source, "'statistics' is missing or not an object")
    check_config(statistics, source)
    sample_size = statistics.get("sample_size")
    require(sample_size is None or is_integer(sample_size, 1),
             source, "'statistics.sample_size' must be a positive integer or null")
    _check_tensors(container, statistics, source)
    _check_summary(header["summary"], statistics, source)
    metadata = study_keys(dict(header["metadata"]))
    metadata["complete"] = header["complete"]
    return ResultFile(path, version, header["complete"], metadata, statistics["config"], statistics["n_windows"],
                      statistics["n_tokens"], header["summary"], _container=container)


def check_metadata(metadata: dict[str, Any], source: str) -> None:
    """The fields of a run's metadata that are read as objects (the model's and the study's records)."""
    for name in ("model", "study", "windows", "engine"):
        value = metadata.get(name)
        require(value is None or isinstance(value, dict), source,
                f"'metadata.{name}' must be an object, not {type(value).__name__}")


def study_keys(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with its study record read in today's keys: a study written while the framework was
    called the backend (``metadata["study"]["backend"]``) also says ``"framework"``; the old key stays."""
    study = metadata.get("study")
    if isinstance(study, dict) and "backend" in study and "framework" not in study:
        metadata["study"] = {**study, "framework": study["backend"]}
    return metadata


#: The types of a number as JSON reads one back (``None``: ``null``, an undefined number).
_NUMBER_TYPES = {int, float, type(None)}


def _is_number(value: Any) -> bool:
    """A number as JSON stores one (``null`` for an undefined one, which reads back as NaN)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _check_summary(summary: dict[str, Any], statistics: dict[str, Any], source: str) -> None:
    """The stored headline numbers that a result shows without its arrays (``repr``, ``_repr_html_``, ``show``,
    the head ranking): each of its type and, for the head scores, of the configuration's shape."""
    from ..maths.metrics import FORMS, SCALES

    if not summary:  # a partial result of a run that stopped before any window has none
        return
    for name in ("most_position_bound_head", "least_position_bound_head"):
        require(isinstance(summary.get(name), str), source, f"'summary.{name}' must be a string (a head such as 'L0H1')")
    require(is_integer(summary.get("floored_entries"), 0), source, "'summary.floored_entries' must be a non-negative integer")
    table = summary.get("query_position_r2")
    require(isinstance(table, dict) and all(isinstance(table.get(s), dict) and all(_is_number(table[s].get(f)) for f in FORMS)
                                            for s in SCALES), source,
            f"'summary.query_position_r2' must hold a number (or null) for every scale {SCALES} and form {FORMS}")
    scores = summary.get("head_scores")
    if scores is not None:
        config = statistics["config"]
        shape = (config["n_layers"], config["n_heads"])
        require(isinstance(scores, dict) and all(
            isinstance(rows, list) and len(rows) == shape[0]
            and all(isinstance(row, list) and len(row) == shape[1] for row in rows)
            and {type(value) for row in rows for value in row} <= _NUMBER_TYPES
            for rows in scores.values()), source,
            f"'summary.head_scores' must map each score to a [layer][head] list of numbers of shape {list(shape)}")


def _check_tensors(container: Container, statistics: dict[str, Any], source: str) -> None:
    """Every tensor the header promises, with its dtype and shape, and nothing else."""
    try:
        expected = {name: ("F64", shape) for name, shape in AttentionStatistics.array_shapes(statistics["config"]).items()}
    except (TypeError, ValueError) as error:
        raise ResultFileError(f"{source}: 'statistics.config' describes no statistics ({error})") from None
    tensors = container.tensors
    for name, (dtype, shape) in expected.items():
        require(name in tensors, source, f"the array {name!r} is missing")
        require(tensors[name] == (dtype, shape), source,
                 f"the array {name!r} is {tensors[name][0]} {list(tensors[name][1])}, expected {dtype} {list(shape)}")
    require(FINGERPRINTS in tensors and tensors[FINGERPRINTS][0] == "U64" and len(tensors[FINGERPRINTS][1]) == 1,
             source, f"the array {FINGERPRINTS!r} must be a 1-D uint64 array")
    require(tensors[FINGERPRINTS][1][0] <= statistics["n_windows"], source,
             f"{FINGERPRINTS!r} holds more fingerprints than 'statistics.n_windows'")
    names = set(expected) | {FINGERPRINTS} | _check_group_tensors(container, statistics, source)
    names |= _check_window_sink_tensors(container, statistics, source)
    if statistics.get("sample_size") is not None:
        lengths = set()
        for column in SAMPLE_COLUMNS:
            name = SAMPLE_PREFIX + column
            require(name in tensors and tensors[name][0] == "F64" and len(tensors[name][1]) == 1, source,
                     f"the sample column {name!r} must be a 1-D float64 array")
            lengths.add(tensors[name][1][0])
            names.add(name)
        require(len(lengths) == 1 and lengths.pop() <= statistics["sample_size"], source,
                 "the sample's columns differ in length or exceed 'statistics.sample_size'")
    unknown = sorted(set(tensors) - names)
    require(not unknown, source, f"unknown arrays {unknown}")


def _check_group_tensors(container: Container, statistics: dict[str, Any], source: str) -> set[str]:
    """The interval groups' tensors the header promises (none for a config without ``interval_groups``); their names."""
    config = statistics["config"]
    if not config.get("interval_groups"):
        return set()
    groups = statistics.get("groups")
    require(isinstance(groups, dict) and isinstance(groups.get("occupied"), int) and groups["occupied"] >= 0, source,
             "'statistics.groups.occupied' must be a non-negative integer for a config with interval_groups")
    empty = AttentionStatistics.from_config(config, device="meta").groups
    names = set()
    for name, shape in empty.array_shapes(groups["occupied"]).items():
        dtype = "I64" if name == "index" else "F64"
        tensor = GROUPS_PREFIX + name
        require(container.tensors.get(tensor) == (dtype, shape), source,
                 f"the interval groups' array {tensor!r} must be {dtype} {list(shape)}, not {container.tensors.get(tensor)}")
        names.add(tensor)
    return names


def _check_window_sink_tensors(container: Container, statistics: dict[str, Any], source: str) -> set[str]:
    """The per-window first-token weights the header promises (none for a config without ``keep_window_sinks``):
    one row per window; their names."""
    window_sinks = AttentionStatistics.from_config(statistics["config"], device="meta").window_sinks
    if window_sinks is None:
        return set()
    names = set()
    for name, (shape, dtype) in window_sinks.array_shapes(statistics["n_windows"]).items():
        tensor = WINDOW_SINKS_PREFIX + name
        require(container.tensors.get(tensor) == (dtype, shape), source,
                f"the per-window first-token weights {tensor!r} must be {dtype} {list(shape)}, not "
                f"{container.tensors.get(tensor)}")
        names.add(tensor)
    return names


def _open_json(path: Path) -> ResultFile:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ResultFileError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    data = parse_json(raw, str(path))
    version = data.get("format_version") if isinstance(data, dict) else None
    data, statistics = read_json_result(data, source=str(path))
    check_metadata(data.get("metadata", {}), str(path))
    metadata = study_keys(dict(data.get("metadata", {})))
    metadata["complete"] = data["complete"]
    return ResultFile(path, version, data["complete"], metadata, statistics.config(),
                      statistics.n_windows, statistics.n_tokens, None, _statistics=statistics)
