"""What the probe costs on a GPU against the model's own forward, every route timed in one process.

    python benchmarks/gpu.py [--json gpu.json] [--rows gemma-fp32,gemma-bf16,llama-1024,llama-4096,gemma-32k]
                             [--repeats 3] [--smoke] [--profile]

Runs from a bare checkout (the repository's root goes on ``sys.path``; only torch, transformers,
numpy, scipy, safetensors, tqdm and, for the fused kernel, Triton are needed).

Models are built from configs with random weights (they time the same as trained ones), so the
script needs only torch and transformers (and Triton for the fused kernel): Gemma 3 270M's
shape (18 layers, 4 query heads on 1 key head of 256 dimensions, 5 of 6 layers with a 512-token
sliding window) and Llama-3-8B's (32 layers, 32 query heads on 8 key heads of 128). For each row:

  full   — the causal LM's forward with logits (eager attention);
  eager  — the base model's forward without logits, eager attention;
  sdpa   — the same with the sdpa kernel;
  probe  — EquivarianceProbe.run on the sdpa model (queries and keys read at each attention call,
           the weights recomputed by the fused Triton kernel where Triton imports, else in torch
           query blocks; the result's metadata says which);

The probe is built once per row, as a researcher builds it once per model: its first call (the
first-batch checks of the attention source and of the engine, and the kernel's compilation) is
reported apart, as the time beyond the steady state; every route's time is the best of
``--repeats`` calls after that first one, CUDA-synchronised, with the peak GPU memory of each route
(``torch.cuda.max_memory_allocated``, reset before it). Prints every ratio and writes JSON.
``--profile`` runs one more steady-state probe call under ``torch.profiler`` and prints its kernel
launches, host-device synchronisations and copies, and the top kernels by device time.
``--smoke`` runs tiny versions of every row on whatever device there is (CPU included), to check
the script itself.

Targets: probe <= 1.0x the eager forward without logits, <= 1.5x the sdpa forward; at T = 32768
(Gemma 3 270M shape, batch 1) the probe runs with peak memory <= 1.3x the sdpa forward's; first
call <= 3 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# A bare checkout: the package is imported from the repository, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    dtype: torch.dtype
    n_windows: int
    context: int
    batch: int


ROWS = {
    "gemma-fp32": Row("Gemma 3 270M shape, fp32, 32 x 1024 (batch 8)", "gemma", torch.float32, 32, 1024, 8),
    "gemma-bf16": Row("Gemma 3 270M shape, bf16, 32 x 1024 (batch 8)", "gemma", torch.bfloat16, 32, 1024, 8),
    "llama-1024": Row("Llama-3-8B shape, bf16, 8 x 1024 (batch 4)", "llama", torch.bfloat16, 8, 1024, 4),
    "llama-4096": Row("Llama-3-8B shape, bf16, 2 x 4096 (batch 1)", "llama", torch.bfloat16, 2, 4096, 1),
    "gemma-32k": Row("Gemma 3 270M shape, bf16, 1 x 32768 (batch 1)", "gemma", torch.bfloat16, 1, 32768, 1),
}


def config(model: str, smoke: bool) -> Any:
    import transformers

    if model == "gemma":
        layers = 6 if smoke else 18
        return transformers.Gemma3TextConfig(
            vocab_size=1024 if smoke else 262144, hidden_size=64 if smoke else 640,
            intermediate_size=128 if smoke else 2048, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16 if smoke else 256, query_pre_attn_scalar=16 if smoke else 256,
            sliding_window=16 if smoke else 512, max_position_embeddings=32768,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        )
    return transformers.LlamaConfig(
        vocab_size=1024 if smoke else 128256, hidden_size=128 if smoke else 4096,
        intermediate_size=256 if smoke else 14336, num_hidden_layers=2 if smoke else 32,
        num_attention_heads=8 if smoke else 32, num_key_value_heads=2 if smoke else 8,
        max_position_embeddings=8192, rope_theta=500000.0,
    )


def build(model: str, dtype: torch.dtype, device: torch.device, smoke: bool) -> Any:
    import transformers

    cls = transformers.Gemma3ForCausalLM if model == "gemma" else transformers.LlamaForCausalLM
    with torch.device(device):
        network = cls._from_config(config(model, smoke), dtype=dtype, attn_implementation="sdpa")
    return network.eval()


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(route, device: torch.device, repeats: int) -> dict[str, float]:
    """Best wall time of ``repeats`` calls after one warm-up, and the peak GPU memory of one call."""
    synchronise(device)
    start = time.perf_counter()
    route()
    synchronise(device)
    first = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    seconds = []
    for _ in range(repeats):
        synchronise(device)
        start = time.perf_counter()
        route()
        synchronise(device)
        seconds.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
    return {"first": first, "best": min(seconds), "all": seconds, "peak_gib_above_weights": peak}


def run_row(key: str, row: Row, device: torch.device, repeats: int, smoke: bool, profile_probe: bool = False) -> dict[str, Any]:
    from equivariance_probe import EquivarianceProbe

    if smoke:
        row = Row(row.name + " [smoke]", row.model, row.dtype if device.type == "cuda" else torch.float32,
                  min(row.n_windows, 2), min(row.context, 64), min(row.batch, 2))
    model = build(row.model, row.dtype, device, smoke)
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (row.n_windows, row.context), generator=torch.Generator().manual_seed(0))

    def batches():
        for start in range(0, row.n_windows, row.batch):
            yield tokens[start : start + row.batch].to(device)

    def forward(implementation: str, logits: bool) -> None:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            for batch in batches():
                (model if logits else model.base_model)(batch, use_cache=False)

    probe_result = {}
    model.set_attn_implementation("sdpa")
    built = EquivarianceProbe(model)  # once: its first call runs the first-batch checks

    def probe() -> None:
        model.set_attn_implementation("sdpa")
        result = built.run(tokens, batch_size=row.batch, progress=False)
        probe_result["engine"] = result.metadata.get("engine")

    routes = {"sdpa": lambda: forward("sdpa", False), "probe": probe}
    if row.context <= 8192:  # an eager [batch, head, T, T] pattern per layer: 17 GB at 32768
        routes = {"full": lambda: forward("eager", True), "eager": lambda: forward("eager", False), **routes}
    measured = {name: timed(route, device, repeats) for name, route in routes.items()}
    best = {name: m["best"] for name, m in measured.items()}
    ratios = {"probe/sdpa": best["probe"] / best["sdpa"]}
    if "eager" in best:
        ratios["probe/eager"] = best["probe"] / best["eager"]
    if device.type == "cuda" and measured["sdpa"]["peak_gib_above_weights"]:
        ratios["probe peak / sdpa peak"] = measured["probe"]["peak_gib_above_weights"] / measured["sdpa"]["peak_gib_above_weights"]
    profile = profiled(probe, device) if profile_probe else None
    del model, built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"row": row.name, "key": key, "measured": measured, "best": best, "ratios": ratios,
            "probe_first_call_beyond_steady": measured["probe"]["first"] - best["probe"],
            "engine": probe_result.get("engine"), "profile": profile}


#: Profiler events that make the host wait for the device (or copy through it).
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
               "aten::_local_scalar_dense")
COPY_EVENTS = ("cudaMemcpy", "cudaMemcpyAsync", "aten::copy_")


def profiled(route, device: torch.device) -> dict[str, Any]:
    """One call of ``route`` under ``torch.profiler``: launches, syncs, copies and the top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as recorded:
        route()
        synchronise(device)
    events = recorded.key_averages()
    count = {event.key: event.count for event in events}
    launches = sum(n for name, n in count.items() if name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=sort, row_limit=12)
    return {
        "launches": launches,
        "syncs": {name: count[name] for name in SYNC_EVENTS if name in count},
        "copies": {name: count[name] for name in COPY_EVENTS if name in count},
        "table": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated from {', '.join(ROWS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device: check the script runs")
    parser.add_argument("--profile", action="store_true", help="also profile one steady-state probe call per row")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the script on the CPU")
    description = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {description}; torch {torch.__version__}")
    report = {"device": description, "torch": torch.__version__, "rows": []}
    for key in args.rows.split(","):
        outcome = run_row(key, ROWS[key], device, args.repeats, args.smoke, args.profile)
        report["rows"].append(outcome)
        cells = "  ".join(f"{name} {seconds:.3f} s" for name, seconds in outcome["best"].items())
        ratios = "  ".join(f"{name} {value:.2f}x" for name, value in outcome["ratios"].items())
        peaks = "  ".join(f"{name} {m['peak_gib_above_weights']:.1f} GiB" for name, m in outcome["measured"].items()
                          if m["peak_gib_above_weights"] is not None)
        engine = outcome["engine"] or {}
        check = engine.get("engine_check") or {}
        print(f"{outcome['row']}\n  {cells}\n  {ratios}\n  probe first call {outcome['probe_first_call_beyond_steady']:.2f} s "
              f"beyond the steady state; paths {engine.get('paths')}; engine check {check.get('engine')} "
              f"max difference {check.get('max_difference')} (tolerance {check.get('tolerance')})"
              + (f"\n  peak above weights: {peaks}" if peaks else ""))
        if outcome["profile"]:
            profile = outcome["profile"]
            print(f"  profile: {profile['launches']} kernel launches, syncs {profile['syncs']}, copies {profile['copies']}\n"
                  + profile["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
