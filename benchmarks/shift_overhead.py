"""The shift test against the forward passes its grid needs: time side by side, peak memory per process.

    python benchmarks/shift_overhead.py [N_SEGMENTS N_CONTEXTS ROUNDS]

Both routes run the same windows ``(g, f, s)`` of the packaged Gemma 3 270M (sdpa, float32, CPU or the
default device): ``forward`` is the model's own forward pass with the LM head on the segment's positions
only (``logits_to_keep=m``) and nothing read; ``shift`` is :meth:`EquivarianceProbe.shift`. Each round runs
them back to back in one process and prints the ratio; then each route runs once more in a fresh process
for its peak RSS over the route, the model loaded (:class:`~equivariance_probe.sources.resources.PeakMemory`:
Linux ``VmHWM`` reset before the route; ``ru_maxrss`` would not do, as a child started from this process
inherits this process's peak).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch


def design(n_segments: int, n_contexts: int):
    from equivariance_probe import EquivarianceProbe, load_corpus, load_model
    from equivariance_probe.sources.packing import special_prefix
    from equivariance_probe.sources.shift_grid import default_offsets, shift_grid, split_documents

    model, tokenizer = load_model("gemma-3-270m", attn_implementation="sdpa")
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    layout = probe.adapter.layout
    offsets = default_offsets(layout.max_context, len(special_prefix(tokenizer)), 64, layout.sliding_windows)
    segments, contexts = split_documents(load_corpus(), tokenizer, n_segments=n_segments, n_contexts=n_contexts,
                                         segment_length=64, context_length=max(offsets))
    grid = shift_grid(segments, contexts, tokenizer, offsets=offsets, segment_length=64)
    return model, probe, segments, contexts, offsets, grid


def forward_passes(model, grid) -> None:
    with torch.no_grad():
        for g in range(grid.segments.shape[0]):
            for f in range(grid.n_contexts):
                for s in grid.offsets:
                    ids, _ = grid.window(g, f, s)
                    model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=grid.segment_length)


def shift(probe, segments, contexts, offsets) -> None:
    probe.shift(segments, contexts, offsets=offsets, segment_length=64, progress=False)


def one(route: str, n_segments: int, n_contexts: int) -> None:
    from equivariance_probe.sources.resources import PeakMemory

    model, probe, segments, contexts, offsets, grid = design(n_segments, n_contexts)
    with PeakMemory() as peak:
        start, cpu = time.perf_counter(), time.process_time()
        forward_passes(model, grid) if route == "forward" else shift(probe, segments, contexts, offsets)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    # CPU seconds too: on a shared machine the wall time measures the neighbours as much as the route.
    print(json.dumps({"route": route, "seconds": seconds, "cpu_seconds": cpu_seconds, "peak_rss_mib": peak.bytes / 2**20,
                      "peak_method": peak.method, "windows": grid.forward_passes()}))


def main() -> None:
    if sys.argv[1:2] in (["forward"], ["shift"]):
        one(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
        return
    n_segments, n_contexts, rounds = (int(a) for a in (sys.argv[1:] + ["2", "2", "2"])[:3])
    model, probe, segments, contexts, offsets, grid = design(n_segments, n_contexts)
    ratios, times = [], {"forward": [], "shift": []}
    for _ in range(rounds):
        start = time.perf_counter()
        forward_passes(model, grid)
        times["forward"].append(time.perf_counter() - start)
        start = time.perf_counter()
        shift(probe, segments, contexts, offsets)
        times["shift"].append(time.perf_counter() - start)
        ratios.append(times["shift"][-1] / times["forward"][-1])
    print(f"{grid.forward_passes()} windows, offsets {list(offsets)}")
    print(f"time: forward best {min(times['forward']):.1f} s, shift best {min(times['shift']):.1f} s; "
          f"ratio best over best {min(times['shift']) / min(times['forward']):.2f}x, median of rounds "
          f"{statistics.median(ratios):.2f}x")
    for route in ("forward", "shift"):
        line = subprocess.run([sys.executable, __file__, route, str(n_segments), str(n_contexts)], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(line)


if __name__ == "__main__":
    main()
