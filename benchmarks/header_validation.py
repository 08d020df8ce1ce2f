"""What checking a result file costs: the header's schema against a plain header read, and the arrays' values
(digests, checksum, finiteness) against a plain array read, measured side by side in one process.

    python benchmarks/header_validation.py [--n-docs 4] [--context-length 1024] [--rounds 30]

The file is a default result (interval groups, stored summary; no summed pattern) of a model shaped as the
default one, Gemma 3 270M (18 layers, 4 query heads, 1 key-value head, head size 256, hidden size 640, sliding
window 512 on five layers of six), with random weights and a small vocabulary so that it runs in seconds on a
CPU: what a header holds and what its checks walk depend on the layers, heads and positions, not on the
weights. In rounds, each case once per round in turn:

* plain header read: ``safe_open(path).metadata()`` and ``json.loads`` of the header (what any reader does);
* checked open: ``ProbeResult.load(path)`` (format 3 reads the header alone: kind, version, header checksum,
  depth limit, every configuration field, the metadata records, the stored summary, and the name, dtype and
  shape of every array against the configuration);
* plain array read: ``safetensors.numpy.load_file(path)``;
* checked full load: ``ProbeResult.load(path).verify()`` (the header as above, every array against its digest,
  all of them with the counts against the checksum, and every float array checked finite);
* the schema checks alone, on a header already read and parsed (depth limit, configuration, metadata records,
  stored summary, arrays' names, dtypes and shapes): what the checks added to the plain read cost;
* the finiteness check alone, on arrays already in memory.

Prints the median of each and the medians of each round's ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def gemma3_270m_shaped(context_length: int):
    """A random model of Gemma 3 270M's attention shape (small vocabulary and MLP: the probe reads attention)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    config = Gemma3TextConfig(vocab_size=512, hidden_size=640, intermediate_size=256, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              max_position_embeddings=max(context_length, 2048), layer_types=layer_types,
                              pad_token_id=0, bos_token_id=2, eos_token_id=1)
    return Gemma3ForCausalLM(config).eval()


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def in_rounds(cases: dict, rounds: int) -> dict[str, list[float]]:
    """Each case's times, every case once per round in turn (after one warm-up call each: the page cache, the
    imports), so that a machine's load falls on all of them alike."""
    for function in cases.values():
        function()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, function in cases.items():
            times[name].append(timed(function))
    return times


def print_medians(times: dict[str, list[float]], ratios: dict[str, tuple[str, str]]) -> None:
    """Each case's median time, then per ratio ``(a, b)`` the median over rounds of ``a / b`` (a round's two
    times share its load)."""
    for name, values in times.items():
        print(f"  {name:38s} {statistics.median(values) * 1e3:9.3f} ms")
    for label, (a, b) in ratios.items():
        print(f"{label + ':':41s} {statistics.median(x / y for x, y in zip(times[a], times[b])):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-docs", type=int, default=4)
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    from safetensors import safe_open
    from safetensors.numpy import load_file

    from equivariance_probe import EquivarianceProbe, ProbeResult
    from equivariance_probe.records.container import HEADER_KEY
    from equivariance_probe.records.container import read_container
    from equivariance_probe.records.fileformat import RESULT_KIND, check_config, check_depth, check_finite
    from equivariance_probe.records.result_file import _check_summary, _check_tensors, check_metadata

    model = gemma3_270m_shaped(args.context_length)
    tokens = torch.randint(3, 512, (args.n_docs, args.context_length), generator=torch.Generator().manual_seed(0))
    result = EquivarianceProbe(model).run(tokens, progress=False, batch_size=1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "results.safetensors"
        result.save(path)
        arrays = load_file(str(path))

        def plain_header() -> None:
            with safe_open(str(path), framework="np") as handle:
                json.loads(handle.metadata()[HEADER_KEY])

        container = read_container(path, RESULT_KIND)
        header = container.header

        def schema_only() -> None:
            check_depth(header, str(path))
            check_config(header["statistics"], str(path))
            check_metadata(header["metadata"], str(path))
            _check_tensors(container, header["statistics"], str(path))
            _check_summary(header["summary"], header["statistics"], str(path))

        cases = {
            "plain header read": plain_header,
            "schema checks alone": schema_only,
            "checked open (ProbeResult.load)": lambda: ProbeResult.load(path),
            "plain array read (load_file)": lambda: load_file(str(path)),
            "checked full load (load + verify)": lambda: ProbeResult.load(path).verify(),
            "finiteness check alone": lambda: check_finite(arrays, path),
        }
        times = in_rounds(cases, args.rounds)
        size = path.stat().st_size
        with safe_open(str(path), framework="np") as handle:
            header_bytes = len(handle.metadata()[HEADER_KEY])
    print(f"default result file: {size / 1e6:.2f} MB, header {header_bytes / 1e3:.1f} kB, {len(arrays)} arrays; "
          f"{args.rounds} rounds, medians")
    print_medians(times, {
        "schema checks / plain header read": ("schema checks alone", "plain header read"),
        "checked open / plain header read": ("checked open (ProbeResult.load)", "plain header read"),
        "checked full load / plain array read": ("checked full load (load + verify)", "plain array read (load_file)"),
        "finiteness check / plain array read": ("finiteness check alone", "plain array read (load_file)"),
    })


if __name__ == "__main__":
    main()
