"""Overhead of checkpointing a study every 50 documents.

    python benchmarks/checkpoint_overhead.py                      # Gemma 3 270M, 100 documents, context 256
    python benchmarks/checkpoint_overhead.py --docs 100 --context-length 128 --every 50

Runs the trained model of the study (no baselines) on the same documents twice in one process
after a warm-up: without checkpoints (one chunk) and with a checkpoint every ``--every``
documents (chunks, a fsynced atomic write of the statistics after each, the final result
saved in the checkpoint folder). Prints both wall times and their ratio, the time spent
writing checkpoints inside the checkpointed run (robust to a load that changes between the
two runs), the size of one checkpoint file, and the time of one checkpoint write of statistics the size of a
context-1024 Gemma 3 270M run (the study's default context, where the summed pattern
``8·L·H·T²`` bytes dominates the file). One measurement per number; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--no-1024-write", action="store_true", help="skip the context-1024 write (needs ~3 GB RAM)")
    args = parser.parse_args()

    from equivariance_probe import AttentionStatistics, ProbeResult, load_corpus, load_model, run_study

    model, tokenizer = load_model("gemma-3-270m")
    docs = load_corpus(n_docs=args.docs)
    common = dict(corpus=docs, n_docs=len(docs), loaded=(model, tokenizer), context_length=args.context_length,
                  batch_size=args.batch_size, baselines=(), sample_size=20000, progress=False)
    run_study(**{**common, "corpus": docs[:4], "n_docs": 4})  # warm-up: first-call costs out of the timings

    start = time.perf_counter()
    plain = run_study(**common)
    plain_s = time.perf_counter() - start
    # The time spent writing checkpoints, measured inside the run: on a shared machine the load can
    # change between the two runs by more than the overhead, while this share is measured under one load.
    writes: list[float] = []
    original_save = ProbeResult.save

    def timed_save(self, path):
        begin = time.perf_counter()
        try:
            return original_save(self, path)
        finally:
            writes.append(time.perf_counter() - begin)

    ProbeResult.save = timed_save
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        checkpointed = run_study(**common, checkpoint_dir=Path(folder) / "checkpoint", checkpoint_every=args.every)
        checkpointed_s = time.perf_counter() - start
        sizes = [p.stat().st_size for p in (Path(folder) / "checkpoint").glob("*.safetensors")]
    ProbeResult.save = original_save
    assert plain.trained.n_windows == checkpointed.trained.n_windows
    n_writes = (len(docs) - 1) // args.every + 1  # checkpoints inside the run + the finished result
    print(f"Gemma 3 270M, {len(docs)} documents, context {args.context_length}, batch {args.batch_size}, "
          f"{plain.trained.n_tokens} tokens, torch threads {torch.get_num_threads()}")
    print(f"no checkpoints:           {plain_s:7.1f} s")
    print(f"checkpoint every {args.every:3d} docs: {checkpointed_s:7.1f} s  ({n_writes} writes of ~{max(sizes) / 1e6:.0f} MB)")
    print(f"ratio: {checkpointed_s / plain_s:.3f}")
    print(f"time inside the checkpointed run spent writing checkpoints: {sum(writes):.2f} s "
          f"({100 * sum(writes) / checkpointed_s:.2f} % of it)")

    if not args.no_1024_write:
        layout = dict(n_layers=18, n_heads=4, n_positions=1024, sliding_windows=[512] * 18)
        big = ProbeResult(AttentionStatistics(**layout, keep_pattern=True), {"complete": False})
        # Empty sums: the file's size does not depend on the values (and an empty result has no summary to fit).
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            path = big.save(Path(folder) / "checkpoint.safetensors")
            write_s = time.perf_counter() - start
            print(f"one checkpoint write at context 1024 (Gemma 3 270M shape, summed pattern kept): "
                  f"{write_s:.1f} s, {path.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
