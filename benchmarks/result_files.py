"""Result files by format version: size, save time, load + summary time, full load time; the cost of verifying.

    python benchmarks/result_files.py [--n-docs 8] [--context-length 1024] [--tiny] [--study-out DIR] [--verify-only]

Runs the packaged Gemma 3 270M (``--tiny``: a tiny random Gemma 3, for a quick check of shapes)
on ``--n-docs`` windows of ``--context-length`` tokens once, keeping the summed pattern, and
writes the same sums, in one process, as

* format 2 (JSON, as every release before format 3 wrote it), with the summed pattern (what
  ``run`` wrote by default whenever the pattern fit in 1 GiB) and without;
* format 3 (safetensors), without the pattern (the default: the interval groups' sums included) and
  with it (``keep_pattern``), and without the pattern or interval groups (``interval_groups=0``).

For each it prints the file's size, the time to save it, the time to load it and print its
summary (``ProbeResult.load(path).summary()``), and the time of a full load (every array read,
checksum verified). ``--study-out DIR`` also runs ``equivariance-probe run --n-docs 4
--context-length 512 --out DIR`` in this process and prints the size of every file it wrote,
against the format-2 size of its three results.

Then, for the default file, the cost of verifying it (every array against its digest, and all of
them against the whole-file checksum, as ``ProbeResult.load(path).statistics`` does), measured side
by side in rounds: the time to read the arrays alone (``safetensors.numpy.load_file``), the time to
hash them (one sha256 per array, :func:`~equivariance_probe.records.container.tensor_digest`), and a
full load; the ratios are medians of each round's own ratios. ``--verify-only`` runs only the
default case (no summed pattern kept: a quicker run) and this measurement.

Timings are one measurement each, on whatever machine runs this (docs/guide/long-runs.md says which).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from equivariance_probe import AttentionStatistics, EquivarianceProbe, ProbeResult
from equivariance_probe.records.fileformat import checksum, encode_array, jsonable, write_json_atomically


def write_format_2(result: ProbeResult, path: Path) -> Path:
    """The result as format 2 wrote it: every array base64 float64 inside one JSON object."""
    statistics = result.statistics
    data = {
        "format_version": 2,
        "kind": "equivariance_probe.ProbeResult",
        "complete": result.complete,
        "metadata": result.metadata,
        "statistics": {
            "config": {**statistics.config(), "interval_groups": 0},  # format 2 had no interval groups
            "n_windows": statistics.n_windows,
            "n_tokens": statistics.n_tokens,
            "arrays": {name: encode_array(value) for name, value in statistics.arrays.items()},
            "sample": None if statistics.sample is None else {
                "size": statistics.sample.size,
                "columns": {c: encode_array(torch.from_numpy(v)) for c, v in statistics.sample.to_arrays().items()},
            },
        },
        "summary": jsonable(result.summary()),
    }
    data["checksum"] = checksum(data["statistics"])
    return write_json_atomically(path, jsonable(data))


def without_pattern(result: ProbeResult, groups: bool = True) -> ProbeResult:
    """The same sums without the summed pattern (what a run with keep_pattern=False holds), with the
    run's interval groups or (``groups=False``) without them, as ``interval_groups=0`` runs."""
    statistics = result.statistics
    config = {**statistics.config(), "keep_pattern": False, "interval_groups": 0}
    arrays = {name: value for name, value in statistics.arrays.items() if name != "pattern_sum"}
    kept = AttentionStatistics.from_arrays(config, arrays, n_windows=statistics.n_windows, n_tokens=statistics.n_tokens,
                                           window_fingerprints=statistics.window_fingerprints, sample=statistics.sample)
    if groups and statistics.groups is not None:
        kept.groups = statistics.groups.copy()
    return ProbeResult(kept, dict(result.metadata))


def measure(result: ProbeResult, path: Path, save) -> dict[str, float]:
    start = time.perf_counter()
    save(result, path)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    summary = ProbeResult.load(path).summary()
    text = json.dumps(jsonable(summary["query_position_r2"]))
    summarised = time.perf_counter() - start
    start = time.perf_counter()
    ProbeResult.load(path).statistics
    loaded = time.perf_counter() - start
    assert text
    return {"bytes": path.stat().st_size, "save_s": saved, "load_summary_s": summarised, "full_load_s": loaded}


def verify_cost(path: Path, rounds: int = 7) -> None:
    """Print the time to hash a file's arrays against the time to read them, and a full (verified) load."""
    from safetensors.numpy import load_file

    from equivariance_probe.records.container import tensor_digest

    times: dict[str, list[float]] = {"read": [], "hash": [], "load": []}
    for _ in range(rounds):
        start = time.perf_counter()
        arrays = load_file(str(path))
        times["read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        digests = [tensor_digest(name, array) for name, array in arrays.items()]
        times["hash"].append(time.perf_counter() - start)
        start = time.perf_counter()
        ProbeResult.load(path).statistics
        times["load"].append(time.perf_counter() - start)
        assert len(digests) == len(arrays)
    size = sum(array.nbytes for array in arrays.values())
    median = {name: statistics.median(values) for name, values in times.items()}
    hash_over_read = statistics.median(h / r for h, r in zip(times["hash"], times["read"]))
    hash_over_load = statistics.median(h / f for h, f in zip(times["hash"], times["load"]))
    print(f"\nverifying the default file ({len(arrays)} arrays, {size / 1e6:.2f} MB of data), median of {rounds} rounds:")
    print("| read the arrays | hash them (one sha256 each) | hash / read | full verified load | hash / full load |\n"
          "|---|---|---|---|---|")
    print(f"| {median['read'] * 1e3:.1f} ms | {median['hash'] * 1e3:.1f} ms | {hash_over_read:.2f} | "
          f"{median['load'] * 1e3:.1f} ms | {hash_over_load:.2f} |")


def build(args: argparse.Namespace) -> ProbeResult:
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from synthetic import tiny_gemma3

        tokens = torch.randint(3, 97, (args.n_docs, min(args.context_length, 128)), generator=torch.Generator().manual_seed(0))
        return EquivarianceProbe(tiny_gemma3()).run(tokens, keep_pattern=not args.verify_only, progress=False)
    from equivariance_probe import load_corpus, load_model

    model, tokenizer = load_model("gemma-3-270m")
    docs = load_corpus(n_docs=args.n_docs, min_chars=20_000)  # long articles: every window is full
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    return probe.run(docs, context_length=args.context_length, batch_size=4, keep_pattern=not args.verify_only,
                     progress=False)


def study_sizes(folder: Path) -> None:
    from equivariance_probe.cli import main as cli

    start = time.perf_counter()
    assert cli(["run", "--n-docs", "4", "--context-length", "512", "--out", str(folder), "--no-progress"]) == 0
    seconds = time.perf_counter() - start
    files = sorted(p for p in folder.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"\nequivariance-probe run --n-docs 4 --context-length 512 ({seconds:.0f} s): {len(files)} files, {total / 1e6:.1f} MB")
    for path in files:
        print(f"  {path.name:40s} {path.stat().st_size / 1e6:8.2f} MB")
    with tempfile.TemporaryDirectory() as scratch:
        old = 0
        for path in folder.glob("*.safetensors"):
            result = ProbeResult.load(path)
            old += write_format_2(result, Path(scratch) / "old.json").stat().st_size
        print(f"  the three results in format 2 (without the pattern): {old / 1e6:.1f} MB; "
              f"with the pattern (the old default), add 3 × 8·L·H·T² · 4/3 (base64) bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Gemma 3 instead of Gemma 3 270M")
    parser.add_argument("--study-out", default=None, help="also run the small default study into this folder")
    parser.add_argument("--verify-only", action="store_true",
                        help="only the default file (no summed pattern kept) and the cost of verifying it")
    args = parser.parse_args()
    start = time.perf_counter()
    result = build(args)
    print(f"{'tiny Gemma 3' if args.tiny else 'Gemma 3 270M'}, {result.n_windows} windows × {args.context_length} "
          f"tokens ({result.n_tokens} tokens), {result.n_layers} layers × {result.n_heads} heads; probed in "
          f"{time.perf_counter() - start:.0f} s; torch threads {torch.get_num_threads()}")
    plain = without_pattern(result)
    if args.verify_only:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "default.safetensors"
            plain.summary()
            numbers = measure(plain, path, lambda r, p: r.save(p))
            print(f"default file: {numbers['bytes'] / 1e6:.2f} MB, saved in {numbers['save_s']:.2f} s")
            verify_cost(path)
        return
    ungrouped = without_pattern(result, groups=False)
    plain.summary(), ungrouped.summary(), result.summary()  # computed once here, so that saving times only the writing
    occupied = plain.interval_groups().get("occupied", 0)
    cases = [
        ("format 2 (JSON), summed pattern kept (the old default)", result, write_format_2, ".json"),
        ("format 2 (JSON), no summed pattern", ungrouped, write_format_2, ".json"),
        (f"format 3 (safetensors), default: no summed pattern, interval groups ({occupied} occupied)", plain,
         lambda r, p: r.save(p), ".safetensors"),
        ("format 3 (safetensors), keep_pattern=True", result, lambda r, p: r.save(p), ".safetensors"),
        ("format 3 (safetensors), no summed pattern, interval_groups=0", ungrouped, lambda r, p: r.save(p), ".safetensors"),
    ]
    print("\n| file | size | save | load + summary | full load |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        default_file = None
        for index, (name, variant, save, suffix) in enumerate(cases):
            path = Path(folder) / f"case{index}{suffix}"
            numbers = measure(variant, path, save)
            print(f"| {name} | {numbers['bytes'] / 1e6:.2f} MB | {numbers['save_s']:.2f} s | "
                  f"{numbers['load_summary_s']:.3f} s | {numbers['full_load_s']:.2f} s |", flush=True)
            if index == 2:
                default_file = path
                sizes = {k: v.nbytes for k, v in plain.statistics.arrays.items()}
            if index != 2:
                path.unlink()
        start = time.perf_counter()
        shown = subprocess.run([sys.executable, "-m", "equivariance_probe.cli", "show", str(default_file)],
                               capture_output=True, text=True, env={**os.environ})
        print(f"\n'equivariance-probe show' of the default file, a new process (Python and torch imports included): "
              f"{time.perf_counter() - start:.2f} s, status {shown.returncode}")
        largest = sorted(sizes.items(), key=lambda item: -item[1])[:4]
        print("largest arrays of the default file: " + ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in largest))
        verify_cost(default_file)
    if args.study_out:
        study_sizes(Path(args.study_out))


if __name__ == "__main__":
    main()
