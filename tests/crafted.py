"""Crafted files, as someone who edits a file of the package (and re-signs it) would write them.

The header checksum is a plain sha256 of the header: anyone who edits a header can recompute it, and
anyone who changes an array can recompute its digest. :func:`resign` does exactly that, so a test of
what the loaders check beyond the checksums starts from a file whose every checksum matches.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from equivariance_probe.records.container import HEADER_KEY, header_checksum, tensor_checksum, tensor_digest

#: Strings a hostile file or a careless label would carry into a page.
HOSTILE = [
    "<script>window.PWNED=1</script>",
    "<img src=x onerror=PWNED()>",
    '"><svg onload=PWNED()>',
    "<a href=\"javascript:PWNED()\">x</a>",
    "<!--<script>",
    "</script><script>PWNED()</script>",
    "&lt;script&gt; & </style>",
]


def read(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A file of the family's header and tensors."""
    with safe_open(str(path), framework="np") as handle:
        header = json.loads(handle.metadata()[HEADER_KEY])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return header, tensors


def resign(
    path: str | Path,
    edit_header: Callable[[dict[str, Any]], None] | None = None,
    edit_tensors: Callable[[dict[str, np.ndarray]], None] | None = None,
    *,
    counts: Callable[[dict[str, Any]], tuple] | None = None,
    out: str | Path | None = None,
) -> Path:
    """Edit a file's header and tensors and re-sign it: digests, ``checksum`` (with ``counts(header)`` as
    the counts it covers; omitted: the checksum is left as it was) and the header checksum recomputed."""
    header, tensors = read(path)
    if edit_tensors is not None:
        edit_tensors(tensors)
    if edit_header is not None:
        edit_header(header)
    header["digests"] = {name: tensor_digest(name, array) for name, array in sorted(tensors.items())}
    if counts is not None:
        header["checksum"] = tensor_checksum(tensors, counts(header))
    header["header_checksum"] = header_checksum(header)
    out = Path(out or path)
    save_file(tensors, str(out), metadata={HEADER_KEY: json.dumps(header)})
    return out


def resign_with_raw(path: str | Path, field: str, raw_json: str, *, out: str | Path | None = None) -> Path:
    """Put ``raw_json`` (JSON text that Python's own writer could not produce, such as metadata nested a
    hundred thousand levels deep) at ``header["metadata"][field]`` with every checksum valid."""
    header, tensors = read(path)
    marker = "@@RAW@@"
    header["metadata"][field] = marker
    header.pop("header_checksum", None)
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).replace(json.dumps(marker), raw_json)
    header["header_checksum"] = "sha256:" + hashlib.sha256(body.encode("utf-8")).hexdigest()
    text = json.dumps(header).replace(json.dumps(marker), raw_json)
    out = Path(out or path)
    save_file(tensors, str(out), metadata={HEADER_KEY: text})
    return out
