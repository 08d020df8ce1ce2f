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
from collections.abc import Mapping, Sequence
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
                f"(e.g. {option('shard', '0/4')} ... {option('shard', '3/4')}, or {option('shard', 'auto')} under "
                "torchrun or sbatch --array)"
            )

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"i/n"`` → ``Shard(i, n)``."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if match is None:
            raise InputError(f"{option('shard')} expects i/n such as 0/4 (shard i of n, zero-based), got {text!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Shard:
        """The shard a launcher assigned to this process, from its environment variables.

        * torchrun, accelerate and most launchers: ``Shard(RANK, WORLD_SIZE)``;
        * a Slurm job array (``sbatch --array=0-3``): ``Shard(SLURM_ARRAY_TASK_ID −
          SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_COUNT)``, the task IDs divided by
          ``SLURM_ARRAY_TASK_STEP`` where Slurm sets one (``--array=0-15:4``). The IDs must be
          one contiguous range (``--array=1,3,7`` is refused): a shard is a slice of documents
          and every slice must be run.

        Both at once (torchrun inside an array task) are refused: which processes share a slice
        is then the user's choice, to pass as ``--shard i/n``.

        Raises:
            InputError: neither set, both set, a value that is not a whole number, or a task ID
                outside the range its array's minimum, count (and maximum) describe; the message
                names the variable and its value.

        Example:
            >>> Shard.from_environment({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4",
            ...                         "SLURM_ARRAY_TASK_COUNT": "4"})
            Shard(index=1, count=4)
        """
        environ = os.environ if environ is None else environ
        rank, world = environ.get("RANK"), environ.get("WORLD_SIZE")
        array = environ.get("SLURM_ARRAY_TASK_ID")
        if array is not None and (rank is not None or world is not None):
            raise InputError(
                f"{option('shard', 'auto')} found both a Slurm array task (SLURM_ARRAY_TASK_ID={array}) and a "
                f"torchrun/accelerate rank (RANK={rank}, WORLD_SIZE={world}); pass the shard of this process "
                f"explicitly with {option('shard', 'i/n')}"
            )
        if array is not None:
            return cls._from_slurm_array(environ)
        if rank is None or world is None:
            raise InputError(
                f"{option('shard', 'auto')} reads RANK and WORLD_SIZE (torchrun, accelerate) or SLURM_ARRAY_TASK_ID, "
                f"SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_COUNT (sbatch --array), which are not set; launch with "
                f"one of them, or pass {option('shard', 'i/n')}"
            )
        values = f"RANK={rank!r}, WORLD_SIZE={world!r}"
        for name, text in (("WORLD_SIZE", world), ("RANK", rank)):
            if not text.strip().isdigit():
                raise InputError(
                    f"{option('shard', 'auto')} reads this process's shard from RANK and WORLD_SIZE ({values}), but "
                    f"{name} is not a whole number; launch with torchrun or accelerate (which set both), or pass "
                    f"{option('shard', 'i/n')}")
        if not 0 <= int(rank) < int(world):
            raise InputError(
                f"{option('shard', 'auto')} reads this process's shard from RANK and WORLD_SIZE ({values}), but RANK "
                f"must lie in 0..WORLD_SIZE-1 (0..{int(world) - 1}) and WORLD_SIZE must be at least 1; check the "
                f"launcher's --nproc-per-node and --nnodes, or pass {option('shard', 'i/n')}")
        return cls(int(rank), int(world))

    @classmethod
    def _from_slurm_array(cls, environ: Mapping[str, str]) -> Shard:
        def whole(name: str, default: int | None = None) -> int:
            text = environ.get(name)
            if text is None and default is not None:
                return default
            if text is None or not text.strip().isdigit():
                given = "is not set" if text is None else f"is {text!r}, not a whole number"
                raise InputError(
                    f"{option('shard', 'auto')} in a Slurm job array needs {name}, which {given}; submit with "
                    f"sbatch --array=0-N (Slurm sets it for every array task), or pass {option('shard', 'i/n')}"
                )
            return int(text)

        task, low, count = whole("SLURM_ARRAY_TASK_ID"), whole("SLURM_ARRAY_TASK_MIN"), whole("SLURM_ARRAY_TASK_COUNT")
        step = whole("SLURM_ARRAY_TASK_STEP", 1) or 1
        high = whole("SLURM_ARRAY_TASK_MAX", low + (count - 1) * step)
        values = (f"SLURM_ARRAY_TASK_ID={task}, SLURM_ARRAY_TASK_MIN={low}, SLURM_ARRAY_TASK_MAX={high}, "
                  f"SLURM_ARRAY_TASK_STEP={step}, SLURM_ARRAY_TASK_COUNT={count}")
        if count < 1 or high != low + (count - 1) * step:
            raise InputError(
                f"{option('shard', 'auto')} needs the array's task IDs to be one range ({values}: a count of {count} "
                f"does not span {low}..{high} in steps of {step}); submit with sbatch --array=0-{max(count, 1) - 1} "
                f"so that every shard runs, or pass {option('shard', 'i/n')}"
            )
        if not low <= task <= high or (task - low) % step:
            raise InputError(
                f"{option('shard', 'auto')}: this task's ID lies outside its array ({values}); submit with "
                f"sbatch --array=0-{count - 1}, or pass {option('shard', 'i/n')}"
            )
        return cls((task - low) // step, count)

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
    _check_same(prov_a, prov_b, "config_sha256", "study configurations (framework, context length, excluded keys, seed)",
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
