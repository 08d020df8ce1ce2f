"""Wall time and peak memory of the probe against a plain forward and the naive route.

    python benchmarks/overhead.py [--docs 8] [--context 1024] [--batch 4]

On the same windows of the packaged Gemma 3 270M, each in its own process:
  full  — a plain eager forward returning logits (what a user would run first);
  bare  — an eager forward that skips the projection to the vocabulary (the floor for
          capturing attention);
  probe — EquivarianceProbe.run (capture + streaming reduction);
  naive — TransformerLens run_with_cache of every pattern, then numpy (at N and 2N docs,
          to show that its memory grows with the documents).
Prints the ratios measured in this one run. Targets (issue 3): probe <= 0.6x full,
probe <= 1.1x bare; the probe's memory flat in the documents.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(mode: str, docs: int, context: int, batch: int) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "_measure.py"), mode, str(docs), str(context), str(batch)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    runs = {}
    for mode in ("full", "bare", "probe"):
        runs[mode] = measure(mode, args.docs, args.context, args.batch)
    runs["probe_2x"] = measure("probe", 2 * args.docs, args.context, args.batch)
    runs["naive"] = measure("naive", args.docs, args.context, args.batch)
    runs["naive_2x"] = measure("naive", 2 * args.docs, args.context, args.batch)
    for name, run in runs.items():
        print(f"{name:9s} docs={run['n_docs']:4d}  {run['seconds']:8.1f} s  peak RSS {run['peak_rss_mib']:8.0f} MiB")
    seconds = {k: v["seconds"] for k, v in runs.items()}
    print(f"probe / full forward:        {seconds['probe'] / seconds['full']:.2f}x  (target <= 0.6)")
    print(f"probe / bare forward:        {seconds['probe'] / seconds['bare']:.2f}x  (target <= 1.1)")
    print(f"naive / probe:               {seconds['naive'] / seconds['probe']:.2f}x")
    print(f"probe peak RSS, 2N / N docs: {runs['probe_2x']['peak_rss_mib'] / runs['probe']['peak_rss_mib']:.2f}x")
    print(f"naive peak RSS, 2N / N docs: {runs['naive_2x']['peak_rss_mib'] / runs['naive']['peak_rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
