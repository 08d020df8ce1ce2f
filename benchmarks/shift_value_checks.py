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
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from header_validation import gemma3_270m_shaped, in_rounds, print_medians  # noqa: E402 - the same model shape and rounds


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
    result = EquivarianceProbe(gemma3_270m_shaped(2048)).shift(
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
        times = in_rounds(cases, args.rounds)
        size = path.stat().st_size
    print(f"shift result file: {size / 1e6:.2f} MB, {len(arrays)} arrays, {len(result.config.components)} components; "
          f"{args.rounds} rounds, medians")
    plain = "plain array read (load_file)"
    print_medians(times, {
        "value relations / plain array read": ("value relations alone", plain),
        "checked full load / plain array read": ("checked full load (load + verify)", plain),
        "checks recomputed / plain array read": ("checks recomputed (recorded_checks)", plain),
    })


if __name__ == "__main__":
    main()
