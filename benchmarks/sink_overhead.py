"""What the first token's sums (the attention-sink rate) cost the engines, measured side by side in one process.

    python benchmarks/sink_overhead.py [--batch 4] [--heads 4] [--kv-heads 1] [--context 1024] [--dim 256]
                                       [--rounds 7] [--json out.json]

One layer of one batch, shaped as Gemma 3 270M's (4 query heads sharing 1 key head of dimension 256)
at the study's 1024 tokens and batch 4 by default, reduced by each engine with ``keep_first_key``
off and on, in interleaved rounds (so a shared machine's load falls on both alike; on the CPU each is
timed by the process's own CPU time, on CUDA by the synchronised wall clock):

  scores  — the torch engine from queries and keys (the default path of a run);
  weights — the torch engine from captured post-softmax weights;
  triton  — the fused kernel, only on a CUDA device (Triton's CPU interpreter times numpy, not the kernel).

Each ratio (on / off) is given best over best and as the median of the rounds' own ratios. The
extra work is one masked copy of a ``[B, H, rows]`` column per query block that starts at key 0
(the kernel: one masked row sum in the tile of key 0): "costs nothing measurable" means a ratio
within the rounds' own spread of 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from equivariance_probe.statistics.engines.block_maths import BlockWorkspace
from equivariance_probe.statistics.engines.spec import ReductionSpec
from equivariance_probe.statistics.engines.torch_blocks import attention_sums_from_qk, attention_sums_from_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on the CPU (default 1: threads that spin while waiting for a busy core "
                             "count as CPU time, which would bury a small difference)")
    parser.add_argument("--json", default=None, help="write every measurement to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(args.batch, args.heads, args.context, args.dim, generator=generator).to(device)
    key = torch.randn(args.batch, args.kv_heads, args.context, args.dim, generator=generator).to(device)
    lengths = torch.full((args.batch,), args.context)
    scores = torch.matmul(query, key.repeat_interleave(args.heads // args.kv_heads, 1).transpose(-1, -2)) * args.dim**-0.5
    causal = torch.ones(args.context, args.context, dtype=torch.bool, device=device).tril()
    pattern = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    del scores
    workspace = BlockWorkspace()

    def spec(keep: bool) -> ReductionSpec:
        return ReductionSpec(lengths=lengths, excluded_keys=(0,), keep_first_key=keep)

    routes = {
        "scores": lambda keep: attention_sums_from_qk(query, key, spec(keep), workspace=workspace),
        "weights": lambda keep: attention_sums_from_weights(pattern, spec(keep), workspace=workspace),
    }
    if device == "cuda":
        from equivariance_probe.statistics.engines.triton import attention_sums_triton, triton_available

        if triton_available():
            routes["triton"] = lambda keep: attention_sums_triton(query, key, spec(keep))

    # On the CPU the process's own CPU time (every thread's), not the wall clock: on a machine shared with
    # other work the wall clock mostly measures waiting for a core (rounds 5x apart were seen at a load of 13
    # on 2 cores), while the CPU time counts the work done. On CUDA the wall clock, synchronised.
    clock = time.perf_counter if device == "cuda" else time.process_time

    def timed(function) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = clock()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        return clock() - start

    for route in routes.values():  # warm-up: workspace buffers, kernel compilation
        route(False), route(True)
    times: dict[str, dict[bool, list[float]]] = {name: {False: [], True: []} for name in routes}
    for round_ in range(args.rounds):
        for name, route in routes.items():
            # Alternate which goes first, so neither always runs on a warmer cache.
            for keep in ((False, True) if round_ % 2 == 0 else (True, False)):
                times[name][keep].append(timed(lambda: route(keep)))

    report = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
              "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "context": args.context,
                        "dim": args.dim}, "rounds": args.rounds, "routes": {}}
    print(f"one layer, B={args.batch} H={args.heads} H_kv={args.kv_heads} T={args.context} d={args.dim}, "
          f"{args.rounds} interleaved rounds on {report['device']}, {'wall' if device == 'cuda' else 'CPU'} time")
    print(f"{'engine':8} {'off (ms)':>10} {'on (ms)':>10} {'best/best':>10} {'median ratio':>13} {'spread of off':>14}")
    for name, measured in times.items():
        off, on = measured[False], measured[True]
        ratios = [b / a for a, b in zip(off, on)]
        spread = (max(off) - min(off)) / min(off)
        row = {"off_ms": [1e3 * t for t in off], "on_ms": [1e3 * t for t in on], "best_ratio": min(on) / min(off),
               "median_ratio": statistics.median(ratios), "off_spread": spread}
        report["routes"][name] = row
        print(f"{name:8} {1e3 * min(off):10.1f} {1e3 * min(on):10.1f} {row['best_ratio']:10.3f} "
              f"{row['median_ratio']:13.3f} {spread:13.1%}")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(report, stream, indent=2)


if __name__ == "__main__":
    main()
