"""Shift result files: the shift test's sums as safetensors tensors, the rest as a JSON header.

Place in the seams: *records*, below :mod:`equivariance_probe.shift_result`, whose ``save`` and ``load`` call
:func:`write_shift_file` and :func:`open_shift_file`, as the probe's result calls
:mod:`~equivariance_probe.records.result_file`. It knows which tensors and header fields a shift file holds and
checks them, not the decomposition's maths.

One file per result (:mod:`~equivariance_probe.records.container`):

* tensors — every array of :data:`~equivariance_probe.statistics.shift.SHIFT_ARRAYS` (float64, ``[group, ...]``,
  under its own name; one that the configuration keeps empty is not written) and the segments' fingerprints as ``segment_fingerprints`` (uint64);
* header — ``kind`` (:data:`SHIFT_KIND`), ``format_version``, ``checksum``
  (:func:`~equivariance_probe.records.container.tensor_checksum` of every tensor), ``config``
  (:meth:`~equivariance_probe.statistics.shift.ShiftConfig.to_dict`), ``metadata`` (the run's), ``summary`` (the
  headline numbers), and the container's ``digests`` (one per tensor) and ``header_checksum``.

When things are checked: :func:`open_shift_file` reads the header alone and checks it (kind, version, header
checksum, every configuration field, and every tensor's dtype and shape against the configuration) before any
array is read or allocated; :meth:`ShiftFile.statistics` reads the arrays on first use, each against its digest
(so a changed byte is refused naming the array), all of them against ``checksum``, and refuses non-finite sums.

Versions: **1** — without the residual stream's sums per hidden dimension (its sums of squares were taken about
one grand mean); **2** — adds ``residual/total_by_dim`` and the configuration's ``hidden_size`` and
``residual_centre``; **3** — adds the sink sums (``sink/first_key``, ``sink/preceding``, ``sink/rows``: the
attention the segment's rows put on the window's first key and on the rest of the text before the segment, by
offset), and the attribution's Gram matrices (``attribution/offset_gram``, ``attribution/context_gram``,
``[group, C, C]``) with the configuration's ``components`` (empty, and the arrays ``[group, 0, 0]`` and not
written, for a run without attribution), and activation patching's ``patch/*`` arrays with the configuration's
``patch_components`` and ``patch_reference`` (likewise empty and not written without patching); **4** — adds the
massive-activation sums (``massive/first``, ``massive/rest``, ``massive/median``, ``massive/windows``: the residual
stream's largest magnitude at the segment's first token and at its other tokens, and its median, by offset). What each version added is declared once, in :data:`SHIFT_ADDED`: an array that a file's
version predates is filled in as that table says (an empty array of the older definition, or zeros that leave
a representation the file never measured undefined), never read as missing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..adapters.components import parse_component
from ..errors import InputError, ResultFileError, is_integer
from ..statistics.config import shapes_of
from ..statistics.shift import SHIFT_ARRAYS, ShiftConfig, ShiftStatistics
from .container import Container, check_finite, read_container, read_tensors, tensor_checksum, write_container
from .fileformat import jsonable
from .shift_values import check_shift_values

__all__ = ["SHIFT_KIND", "SHIFT_FORMAT_VERSION", "SHIFT_FORMAT_VERSIONS", "SHIFT_ADDED", "Added", "ShiftFile",
           "write_shift_file", "open_shift_file"]

#: The ``kind`` of a shift result file's header.
SHIFT_KIND = "equivariance_probe.ShiftResult"
#: The version :func:`write_shift_file` writes.
SHIFT_FORMAT_VERSION = 4
#: The format versions this package reads.
SHIFT_FORMAT_VERSIONS = (1, 2, 3, 4)
#: The tensor of the segments' fingerprints.
FINGERPRINTS = "segment_fingerprints"


class Added(NamedTuple):
    """An array (or every array of a representation) that a format version added, and how older files read."""

    #: The first format version whose files hold it.
    since: int
    #: What an older file's array reads as: zeros of its shape (empty where the file's configuration keeps
    #: none, as for the grand-mean residual sums; otherwise counts of zero, so that the representation's
    #: shares are undefined rather than made up).
    why: str


#: What each format version added, by array name or by ``"<representation>/"`` (every array of one
#: representation). Adding a representation to the shift test means: raise :data:`SHIFT_FORMAT_VERSION`, add the
#: version to :data:`SHIFT_FORMAT_VERSIONS`, and declare the representation here, so that every file written
#: before it loads with that representation undefined and every other number unchanged.
SHIFT_ADDED: dict[str, Added] = {
    "residual/total_by_dim": Added(2, "the residual stream's sums per hidden dimension (files of version 1 took its "
                                      "sums of squares about one grand mean)"),
    "sink/": Added(3, "the attention the segment's rows put before the segment, by offset (zero rows: the sink "
                      "mass of a file written before it was kept is undefined)"),
    **{f"attribution/{term}_gram": Added(3, f"the attribution's {term} Gram matrix over the components (files of "
                                            "versions 1 and 2 split nothing into components: no components, empty)")
       for term in ("offset", "context")},
    "patch/": Added(3, "activation patching's sums (files before version 3 patched nothing: no items, empty arrays)"),
    "massive/": Added(4, "the residual stream's largest magnitudes at the segment, by offset (zero windows: the "
                         "massive activations of a file written before they were kept are undefined)"),
}


def _added(name: str) -> Added | None:
    """The :data:`SHIFT_ADDED` entry of array ``name`` (its own, else its representation's)."""
    return SHIFT_ADDED.get(name) or SHIFT_ADDED.get(name.split("/")[0] + "/")


def write_shift_file(path: str | os.PathLike, statistics: ShiftStatistics, metadata: dict[str, Any],
                     summary: dict[str, Any]) -> Path:
    """Write one shift result atomically (the sums bitwise, the metadata and ``summary`` as JSON)."""
    # An empty array (the attribution's Grams of a run without it) is not written: a file's reader fills in every
    # array its configuration keeps empty (_checked_header), and safetensors' bytes of nothing have no use.
    tensors = {name: np.ascontiguousarray(value) for name, value in statistics.arrays.items() if value.size}
    tensors[FINGERPRINTS] = statistics.segment_fingerprints
    header = {"kind": SHIFT_KIND, "format_version": SHIFT_FORMAT_VERSION, "checksum": tensor_checksum(tensors),
              "config": statistics.config.to_dict(), "metadata": metadata, "summary": summary}
    return write_container(path, tensors, json.loads(json.dumps(jsonable(header))))


@dataclass
class ShiftFile:
    """A shift result file, opened and its header checked; its arrays load with :meth:`statistics`.

    Attributes:
        path: the file.
        format_version: as written (:data:`SHIFT_FORMAT_VERSIONS`).
        config: the statistics' :class:`~equivariance_probe.statistics.shift.ShiftConfig`.
        metadata: the run's metadata.
        n_segments: segments the sums hold (from the header alone).
        filled: arrays the file's version predates, each with what it is (:data:`SHIFT_ADDED`): read as zeros.
    """

    path: Path
    format_version: int
    config: ShiftConfig
    metadata: dict[str, Any]
    n_segments: int
    filled: dict[str, str]
    _container: Container
    _statistics: ShiftStatistics | None = None

    @property
    def integrity(self) -> str:
        """How the arrays are checked when read: ``"digests"`` (each against its own, naming a changed one) or
        ``"checksum"`` (one over every array, for a file written without digests)."""
        return "checksum" if self._container.digests is None else "digests"

    def statistics(self) -> ShiftStatistics:
        """The sums, read now (each array against its digest, all against the checksum) and kept.

        Raises:
            ResultFileError: an array does not match its digest (naming it), the arrays do not match the checksum,
                a sum is not finite, or sums break a relation every run's sums satisfy
                (:func:`~equivariance_probe.records.shift_values.check_shift_values`).
        """
        if self._statistics is not None:
            return self._statistics
        container = self._container
        tensors = read_tensors(container, container.tensors)
        if tensor_checksum(tensors) != container.header.get("checksum"):
            raise ResultFileError(f"{self.path}: the checksum does not match the arrays (changed or corrupted after "
                                  "saving); use an intact copy")
        check_finite(tensors, self.path)
        check_shift_values(tensors, self.path)
        shapes = shapes_of(SHIFT_ARRAYS, self.config.sizes(), self.config)
        arrays = {name: tensors[name] if name in tensors else np.zeros(shapes[name]) for name in SHIFT_ARRAYS}
        statistics = ShiftStatistics(self.config)
        statistics.arrays = arrays
        statistics.segment_fingerprints = np.asarray(tensors[FINGERPRINTS], dtype=np.uint64)
        self._statistics = statistics
        return statistics


def open_shift_file(path: str | os.PathLike) -> ShiftFile:
    """Open a shift result file and check its header; no array is read.

    Raises:
        ResultFileError: truncated, edited, not a shift result, a version this code does not read, or a malformed
            field (named).
    """
    container = read_container(path, SHIFT_KIND)
    config, filled = _checked_header(container, str(path))
    header = container.header
    return ShiftFile(Path(path), header["format_version"], config, dict(header.get("metadata", {})),
                     int(container.tensors[FINGERPRINTS][1][0]), filled, container)


#: A shift configuration's integer fields and the least value each may take.
_CONFIG_INTEGERS = {"n_layers": 1, "n_heads": 1, "n_contexts": 1, "segment_length": 1, "prefix_length": 0,
                    "interval_groups": 0}


def _checked_header(container: Container, source: str) -> tuple[ShiftConfig, dict[str, str]]:
    """A shift result file's header checked against its schema, from the header alone: version, every
    configuration field's type, sign and allowed values, the metadata's type, and every array's dtype and
    shape against the configuration (which ties the sizes the configuration claims to the file's own bytes,
    so that no absurd size is ever allocated). Returns the configuration and the arrays to fill in.

    Raises:
        ResultFileError: naming the file, the field, its value and what was expected.
    """
    header = container.header

    def require(condition: bool, what: str) -> None:
        if not condition:
            raise ResultFileError(f"{source}: {what}; the file is malformed (edited, or written by another program?)")

    version = header.get("format_version")
    if is_integer(version, 1) and version > SHIFT_FORMAT_VERSION:
        raise ResultFileError(f"{source} is a shift result of format {version}, newer than this equivariance_probe "
                              f"reads ({SHIFT_FORMAT_VERSION}); upgrade equivariance_probe (pip install -U "
                              "equivariance_probe) to read it")
    require(version in SHIFT_FORMAT_VERSIONS,
            f"'format_version' must be one of {list(SHIFT_FORMAT_VERSIONS)}, not {version!r}")
    require(isinstance(header.get("metadata", {}), dict), "'metadata' must be an object")
    config = header.get("config")
    require(isinstance(config, dict), "'config' is missing or not an object")
    _check_config(config, require)
    try:
        described = ShiftConfig.from_dict(config)
        shapes = shapes_of(SHIFT_ARRAYS, described.sizes(), described)
    except (KeyError, TypeError, ValueError) as error:
        raise ResultFileError(f"{source}: 'config' describes no shift statistics ({error!r})") from None
    tensors = container.tensors
    filled = {}
    for name, shape in shapes.items():
        added = _added(name)
        if name not in tensors and (0 in shape or (added is not None and version < added.since)):
            filled[name] = added.why if added is not None else "kept by a later definition: empty in this file"
            continue
        require(tensors.get(name) == ("F64", shape), f"the array {name!r} must be F64 {list(shape)}, not {tensors.get(name)}")
    fingerprints = tensors.get(FINGERPRINTS)
    require(fingerprints is not None and fingerprints[0] == "U64" and len(fingerprints[1]) == 1,
            f"the array {FINGERPRINTS!r} must be a 1-D U64 array, not {fingerprints}")
    unknown = sorted(set(tensors) - set(shapes) - {FINGERPRINTS})
    require(not unknown, f"unknown arrays {unknown}")
    return described, filled


def _check_config(config: dict[str, Any], require: Any) -> None:
    """Every configuration field's type, sign and allowed values (before a configuration is built from them)."""
    for name, minimum in _CONFIG_INTEGERS.items():
        require(is_integer(config.get(name), minimum),
                f"'config.{name}' must be an integer of at least {minimum}, not {config.get(name)!r}")
    offsets = config.get("offsets")
    require(isinstance(offsets, list) and len(offsets) >= 2 and all(is_integer(o, 0) for o in offsets)
            and len(set(offsets)) == len(offsets),
            f"'config.offsets' must be a list of at least two distinct non-negative integers, not {offsets!r}")
    require(config.get("mode") in ("text", "position_ids"),
            f"'config.mode' must be 'text' or 'position_ids', not {config.get('mode')!r}")
    for name in ("causal", "predictions"):
        require(isinstance(config.get(name), bool), f"'config.{name}' must be true or false, not {config.get(name)!r}")
    windows = config.get("sliding_windows")
    require(isinstance(windows, list) and len(windows) in (0, config["n_layers"])
            and all(w is None or is_integer(w, 1) for w in windows),
            f"'config.sliding_windows' must be a list of null or positive widths, one per layer, not {windows!r}")
    n_layers, n_heads = config["n_layers"], config["n_heads"]
    names = (f"component names of its {n_layers} layers and {n_heads} heads ('embedding', 'attention.<layer>', "
             f"'mlp.<layer>', 'head.<layer>.<head>')")
    components = config.get("components", [])
    require(isinstance(components, list) and all(_is_component(name, n_layers, n_heads) for name in components)
            and len(set(components)) == len(components),
            f"'config.components' must be a list of distinct {names}, not {components!r}")
    if "patch_components" in config:
        items = config["patch_components"]
        require(isinstance(items, list) and all(isinstance(item, str) and item and all(
                    _is_component(part, n_layers, n_heads) for part in item.split("+")) for item in items),
                f"'config.patch_components' must be a list of {names}, or several joined by '+', not {items!r}")
    if "patch_reference" in config:
        require(is_integer(config["patch_reference"], 0) and config["patch_reference"] < len(offsets),
                f"'config.patch_reference' must index one of the offsets, not {config['patch_reference']!r}")
    if "hidden_size" in config:
        require(is_integer(config["hidden_size"], 0),
                f"'config.hidden_size' must be an integer of at least 0, not {config['hidden_size']!r}")


def _is_component(name: Any, n_layers: int, n_heads: int) -> bool:
    """Whether ``name`` is a component of a model of ``n_layers`` layers of ``n_heads`` heads."""
    try:
        _, layer, head = parse_component(name)
    except InputError:
        return False
    return (layer is None or layer < n_layers) and (head is None or head < n_heads)
