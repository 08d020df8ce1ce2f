"""What checking a shift result's values costs when its arrays are read: the relations every run's sums satisfy
(:func:`~equivariance_probe.records.shift_values.check_shift_values`: non-negative sums of squares, divergences
within ``[0, ln 2]`` per pair, at most one attention weight per row, symmetric Gram matrices with non-negative
diagonals) and the built-in checks recomputed from the arrays, against a plain read of the same arrays, measured
side by side in one process.

    python benchmarks/shift_value_checks.py [--segments 4] [--rounds 20]

The file is a shift run with attribution (heads of three layers) and patching of a model shaped as the default
one, Gemma 3 270M (18 layers, 4 query heads, 1 key-value head, head size 256, hidden size 640), with random
weights and a small vocabulary so that it runs on a CPU: the arrays' sizes depend on the layers, heads, offsets,
components and interval groups, not on the weights. In rounds, each case once per round in turn:

* plain array read: ``safetensors.numpy.load_file(path)``;
* checked full load: ``ShiftResult.load(path).verify()`` (header, digests, checksum, finiteness and the value
  relations);
* the value relations alone, on arrays already in memory;
* the built-in checks recomputed from a loaded result (``recorded_checks``, what ``summary`` and ``show`` print).

Prints the median of each and the medians of each round's ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def gemma3_270m_shaped():
    """A random model of Gemma 3 270M's shape (small vocabulary and MLP)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    config = Gemma3TextConfig(vocab_size=512, hidden_size=640, intermediate_size=256, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              max_position_embeddings=2048, layer_types=layer_types, pad_token_id=0, bos_token_id=2,
                              eos_token_id=1)
    return Gemma3ForCausalLM(config).eval()


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    from safetensors.numpy import load_file

    from equivariance_probe import EquivarianceProbe, ShiftResult
    from equivariance_probe.records.shift_values import check_shift_values

    generator = torch.Generator().manual_seed(0)
    segments = [torch.randint(3, 512, (32,), generator=generator).tolist() for _ in range(args.segments)]
    contexts = [torch.randint(3, 512, (128,), generator=generator).tolist() for _ in range(2)]
    result = EquivarianceProbe(gemma3_270m_shaped()).shift(
        segments, contexts, offsets=[0, 64, 128], segment_length=32, progress=False, interval_groups=args.segments,
        attribution=True, attribution_heads=[5, 11, 17], patch="attention.5,mlp.5")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "shift.safetensors"
        result.save(path)
        arrays = load_file(str(path))
        cases = {
            "plain array read (load_file)": lambda: load_file(str(path)),
            "checked full load (load + verify)": lambda: ShiftResult.load(path).verify(),
            "value relations alone": lambda: check_shift_values(arrays, path),
            "checks recomputed (recorded_checks)": lambda: ShiftResult.load(path).recorded_checks(),
        }
        for function in cases.values():  # warm the page cache and the imports
            function()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, function in cases.items():
                times[name].append(timed(function))
        size = path.stat().st_size
    print(f"shift result file: {size / 1e6:.2f} MB, {len(arrays)} arrays, {len(result.config.components)} components; "
          f"{args.rounds} rounds, medians")
    for name, values in times.items():
        print(f"  {name:38s} {statistics.median(values) * 1e3:9.3f} ms")

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    plain = "plain array read (load_file)"
    print(f"value relations / plain array read:      {ratio('value relations alone', plain):.2f}")
    print(f"checked full load / plain array read:    {ratio('checked full load (load + verify)', plain):.2f}")
    print(f"checks recomputed / plain array read:    {ratio('checks recomputed (recorded_checks)', plain):.2f}")


if __name__ == "__main__":
    main()
