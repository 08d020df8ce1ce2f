"""Peak memory of the shift test on a 7B-shaped model from a config, against the forward passes its grid needs.

    python benchmarks/shift_memory.py [--layers 2,4] [--dtype bfloat16] [--n-layers-full 32]

The model is Llama 2 7B's shape (hidden 4096, 32 heads, MLP 11008, vocabulary 32,000, 4096 positions) with
random weights (memory does not depend on their values), cut to a few layers so that it fits and runs on a CPU.
Each (layers, route) pair runs in its own process, its peak resident memory taken over the run with the model
built (:class:`~equivariance_probe.sources.resources.PeakMemory`), so each peak is that run's alone:
``forward`` is the model's forward passes over the grid with the LM head on the segment's positions, ``shift``
is :meth:`EquivarianceProbe.shift` on the same grid (1 segment × 2 contexts × 6 offsets from 0 to 959, a
64-token segment; token ids drawn at random, no special prefix). Weights, activations and the shift test's
state all grow linearly with the layers (the predictions' state does not), so the whole model's peaks are the
measured ones extrapolated along the per-layer slope; the script prints the measurements, the extrapolation and
the state the formula gives (``docs/guide/shift.md``, "Cost").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

SEGMENT_LENGTH = 64
OFFSETS = (0, 192, 384, 575, 767, 959)
SHAPE = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
         "vocab_size": 32000, "max_position_embeddings": 4096}


def model_of(n_layers: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, num_hidden_layers=n_layers, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy to cast from
    try:
        return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def design():
    generator = torch.Generator().manual_seed(1)
    segment = torch.randint(3, SHAPE["vocab_size"], (SEGMENT_LENGTH,), generator=generator).tolist()
    contexts = [torch.randint(3, SHAPE["vocab_size"], (max(OFFSETS),), generator=generator).tolist() for _ in range(2)]
    return [segment], contexts


def one(route: str, n_layers: int, dtype: torch.dtype) -> dict:
    from equivariance_probe.sources.resources import PeakMemory

    model = model_of(n_layers, dtype)
    segments, contexts = design()
    with PeakMemory() as peak:
        run(route, model, segments, contexts)
    return {"route": route, "layers": n_layers, "peak_mib": peak.bytes / 2**20, "peak_method": peak.method}


def run(route: str, model, segments, contexts) -> None:
    from equivariance_probe import EquivarianceProbe

    if route == "forward":
        with torch.no_grad():
            for context in contexts:
                for offset in OFFSETS:
                    model(input_ids=torch.tensor([context[:offset] + segments[0]]), use_cache=False,
                          logits_to_keep=SEGMENT_LENGTH)
    else:
        EquivarianceProbe(model).shift(segments, contexts, offsets=OFFSETS, segment_length=SEGMENT_LENGTH,
                                       progress=False)


def state_mib(n_layers: int, n_offsets: int = len(OFFSETS), m: int = SEGMENT_LENGTH) -> dict:
    """The shift state's size by its formula: per attention representation ``L·H·(S + 5)·E`` float64 values
    (``E = m(m + 1)/2 − 1`` counted entries of a causal block), the residual stream ``L·(S + 5)·m·d`` float64, the
    predictions ``S·(m − 1)·V`` float32."""
    entries = m * (m + 1) // 2 - 1
    attention = 3 * n_layers * SHAPE["num_attention_heads"] * (n_offsets + 5) * entries * 8
    residual = n_layers * (n_offsets + 5) * m * SHAPE["hidden_size"] * 8
    predictions = n_offsets * (m - 1) * SHAPE["vocab_size"] * 4
    return {name: value / 2**20 for name, value in
            {"attention": attention, "residual": residual, "predictions": predictions}.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="2,4")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--n-layers-full", type=int, default=32)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), dtype)))
        return
    layers = [int(n) for n in args.layers.split(",")]
    rows = {}
    for n_layers in layers:
        for route in ("forward", "shift"):
            line = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--one", route, str(n_layers)],
                                  check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            rows[(route, n_layers)] = json.loads(line)
            print(line)
    full = args.n_layers_full
    low, high = min(layers), max(layers)
    peaks = {}
    for route in ("forward", "shift"):
        slope = (rows[(route, high)]["peak_mib"] - rows[(route, low)]["peak_mib"]) / (high - low)
        peaks[route] = rows[(route, high)]["peak_mib"] + slope * (full - high)
        print(f"{route}: {slope:.0f} MiB per layer; extrapolated to {full} layers: {peaks[route]:.0f} MiB")
    print(f"shift / forward at {full} layers: {peaks['shift'] / peaks['forward']:.2f}x; "
          + ", ".join(f"{name} state {value:.0f} MiB" for name, value in state_mib(full).items()))


if __name__ == "__main__":
    main()
