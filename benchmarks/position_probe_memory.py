"""Peak memory of the linear position probes on a 7B-shaped model from a config, against its forward passes.

    python benchmarks/position_probe_memory.py [--layers 1,2] [--windows 8] [--dtype bfloat16]

The model is shift_memory.py's: Llama 2 7B's shape (hidden 4096, 32 heads, MLP 11008, vocabulary 32,000), random weights
(memory does not depend on their values), cut to a few layers so that it fits and runs on a CPU. Each
(layers, route) pair runs in its own process and its peak resident memory is taken over the run with the model
built (:class:`~equivariance_probe.sources.resources.PeakMemory`): ``forward`` is the forward passes over the
windows (256 tokens, 4 per pass), ``probe`` is :func:`~equivariance_probe.position_probe` on the same windows
(32 positions each, 2 windows per document, 5 folds). Weights and activations grow with the layers, the kept
residual streams as ``(L+1)·n·P·d`` float32 (:func:`~equivariance_probe.analyses.position_probe.probe_feature_bytes`),
and the ridge fits work on one layer at a time, so the whole model's peaks are the measured ones extrapolated
along the per-layer slope; the script prints the measurements, the extrapolation and the formula's feature store
for the 7B model and for the guide's default study (docs/guide/positional.md, "Linear position probes").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from shift_memory import SHAPE, model_of  # the same 7B-shaped Llama, built in its dtype (run from benchmarks/)

CONTEXT = 256
POSITIONS = 32
def one(route: str, n_layers: int, n_windows: int, dtype: torch.dtype) -> dict:
    from equivariance_probe import position_probe
    from equivariance_probe.sources.resources import PeakMemory

    model = model_of(n_layers, dtype)
    tokens = torch.randint(3, SHAPE["vocab_size"], (n_windows, CONTEXT), generator=torch.Generator().manual_seed(1))
    groups = torch.arange(n_windows) // 2
    with PeakMemory() as peak:
        if route == "forward":
            with torch.no_grad():
                for start in range(0, n_windows, 4):
                    model.base_model(input_ids=tokens[start : start + 4], use_cache=False)  # no LM head, as the probe
        else:
            position_probe(model, tokens, groups=groups, positions_per_window=POSITIONS)
    return {"route": route, "layers": n_layers, "windows": n_windows, "peak_mib": peak.bytes / 2**20,
            "peak_method": peak.method}


def main() -> None:
    from equivariance_probe.analyses.position_probe import probe_feature_bytes

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="1,2")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--n-layers-full", type=int, default=32)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), int(args.one[2]), dtype)))
        return
    layers = [int(n) for n in args.layers.split(",")]
    rows = {}
    for n_layers in layers:
        for route in ("forward", "probe"):
            line = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--one", route, str(n_layers),
                                   str(args.windows)], check=True, capture_output=True, text=True).stdout.strip()
            rows[(route, n_layers)] = json.loads(line.splitlines()[-1])
            print(line.splitlines()[-1])
    full = args.n_layers_full
    low, high = min(layers), max(layers)
    for route in ("forward", "probe"):
        slope = (rows[(route, high)]["peak_mib"] - rows[(route, low)]["peak_mib"]) / max(high - low, 1)
        print(f"{route}: {slope:.0f} MiB per layer; extrapolated to {full} layers: "
              f"{rows[(route, high)]['peak_mib'] + slope * (full - high):.0f} MiB")
    for windows in (args.windows, 32):
        print(f"kept residual streams, {full} layers, {windows} windows x {POSITIONS} positions: "
              f"{probe_feature_bytes(full, windows, POSITIONS, SHAPE['hidden_size']) / 2**20:.0f} MiB float32")


if __name__ == "__main__":
    main()
