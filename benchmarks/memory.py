"""Peak memory of a probe run on 10 vs 100 documents: it must not grow with the documents.

    python benchmarks/memory.py [--context 256] [--batch 4]

Each run has its own process (benchmarks/_measure.py), so each peak RSS is that run's alone.
"""

from __future__ import annotations

import argparse

from overhead import measure_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    small = measure_process("probe", 10, args.context, args.batch)
    large = measure_process("probe", 100, args.context, args.batch)
    for run in (small, large):
        print(f"{run['n_docs']:4d} documents: {run['seconds']:7.1f} s, peak RSS {run['peak_rss_mib']:7.0f} MiB "
              f"(model loaded: {run['rss_before_mib']:.0f} MiB)")
    print(f"peak RSS, 100 / 10 documents: {large['peak_rss_mib'] / small['peak_rss_mib']:.3f}x")


if __name__ == "__main__":
    main()
