"""Shards: a deterministic slice of the corpus per process, and the checks that merge them.

Place in the seams: *records*. ``Shard(index, count)`` takes the
contiguous block ``docs[index·N//count : (index+1)·N//count]`` of the ``N`` documents; the
blocks of ``count`` shards are disjoint and cover the corpus, so the merged statistics of
all shards equal those of one run over every document (the sums add).

Each sharded result records in ``metadata["shards"]`` which documents it holds (``indices``,
``ranges``, ``count``) and the fingerprint of the *whole* corpus; each result records its
``run_ids``. :func:`merged_provenance` refuses to merge the same run twice, a shard twice,
overlapping ranges, shards of different corpora or shard counts, and results of different
models or configurations (:mod:`equivariance_probe.records.provenance`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import IncompatibleResultsError, InputError, option

__all__ = ["Shard", "merged_provenance", "shard_metadata"]

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (zero-based: ``Shard(0, 4)`` … ``Shard(3, 4)``).

    Example:
        >>> Shard.parse("1/4").bounds(10)
        (2, 5)
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int) and 0 <= self.index < self.count):
            raise InputError(
                f"shard {self.index}/{self.count} does not exist: use i/n with 0 <= i < n "
                f"(e.g. {option('shard', '0/4')} ... {option('shard', '3/4')}, or RANK/WORLD_SIZE under torchrun)"
            )

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"i/n"`` → ``Shard(i, n)``."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if match is None:
            raise InputError(f"{option('shard')} expects i/n such as 0/4 (shard i of n, zero-based), got {text!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    @classmethod
    def from_environment(cls) -> Shard:
        """``Shard(RANK, WORLD_SIZE)`` from the variables torchrun, accelerate and most launchers set."""
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if rank is None or world is None:
            raise InputError(
                f"{option('shard', 'auto')} reads RANK and WORLD_SIZE, which are not set; launch with torchrun or "
                f"accelerate, or pass {option('shard', 'i/n')}"
            )
        return cls.parse(f"{rank}/{world}")

    def bounds(self, n_docs: int) -> tuple[int, int]:
        """``(start, stop)``: this shard's documents are ``docs[start:stop]``."""
        return self.index * n_docs // self.count, (self.index + 1) * n_docs // self.count

    def select(self, docs: Sequence[T]) -> list[T]:
        start, stop = self.bounds(len(docs))
        return list(docs[start:stop])

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def shard_metadata(shard: Shard, n_docs: int, corpus_sha256: str) -> dict[str, Any]:
    """``metadata["shards"]`` of one shard's result."""
    start, stop = shard.bounds(n_docs)
    return {"count": shard.count, "indices": [shard.index], "ranges": [[start, stop]],
            "n_docs": n_docs, "corpus_sha256": corpus_sha256}


def _run_ids(metadata: dict[str, Any]) -> list[str]:
    if "run_ids" in metadata:
        return list(metadata["run_ids"])
    return [metadata["run_id"]] if metadata.get("run_id") else []


def _check_same(a: dict[str, Any], b: dict[str, Any], key: str, what: str, fix: str) -> None:
    if key in a and key in b and a[key] != b[key]:
        raise IncompatibleResultsError(f"cannot merge results of different {what} ({a[key]!r} vs {b[key]!r}); {fix}")


def merged_provenance(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The ``run_ids`` and ``shards`` metadata of ``a`` merged with ``b``, after checking they may merge.

    Raises:
        IncompatibleResultsError: the same run or shard twice, overlapping shards, shards of
            different corpora or counts, different model weights or study configurations.
    """
    ids_a, ids_b = _run_ids(a), _run_ids(b)
    repeated = sorted(set(ids_a) & set(ids_b))
    if repeated:
        raise IncompatibleResultsError(
            f"both results contain run {repeated[0]}: the same documents would be counted twice; "
            "merge each result file once"
        )
    _check_same(a, b, "label", "study variants", "merge the same variant (e.g. results.json) of every shard")
    prov_a, prov_b = a.get("provenance", {}), b.get("provenance", {})
    _check_same(prov_a.get("model", {}), prov_b.get("model", {}), "weights_sha256", "model weights",
                "merge results of one model only")
    _check_same(prov_a, prov_b, "config_sha256", "study configurations (backend, context length, excluded keys, seed)",
                f"run every shard with the same options except {option('shard')}")
    out: dict[str, Any] = {"run_ids": ids_a + ids_b}
    shards_a, shards_b = a.get("shards"), b.get("shards")
    if shards_a is None and shards_b is None:
        return out
    if shards_a is None or shards_b is None:
        raise IncompatibleResultsError(
            "cannot merge a shard with a result that is not a shard of the same corpus; merge the shards of one run"
        )
    _check_same(shards_a, shards_b, "corpus_sha256", "corpora", f"shards must come from the same corpus and {option('n_docs')}")
    _check_same(shards_a, shards_b, "count", "shard counts", f"run every shard with the same total n of {option('shard', 'i/n')}")
    twice = sorted(set(shards_a["indices"]) & set(shards_b["indices"]))
    if twice:
        raise IncompatibleResultsError(f"shard {twice[0]}/{shards_a['count']} appears in both results; merge each shard once")
    for start, stop in shards_a["ranges"]:
        for other_start, other_stop in shards_b["ranges"]:
            if start < other_stop and other_start < stop:
                raise IncompatibleResultsError(
                    f"shards overlap: documents {start}..{stop - 1} and {other_start}..{other_stop - 1}; "
                    "merge disjoint shards of one run"
                )
    pairs = sorted(zip(shards_a["indices"] + shards_b["indices"], shards_a["ranges"] + shards_b["ranges"]))
    out["shards"] = {**shards_a, "indices": [i for i, _ in pairs], "ranges": [r for _, r in pairs]}
    return out
