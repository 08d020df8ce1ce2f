"""Peak resident memory of a probe run against :func:`~equivariance_probe.sources.resources.estimate_memory`.

    python benchmarks/memory_estimate.py [--model gemma-3-270m] [--runs 8192x1,4096x1,1024x4,256x16]
                                         [--copies 2] [--json out.json]

Each run ``TxB`` (one batch of ``B`` packed windows of ``T`` tokens from the packaged corpus) has its
own process, so that each peak belongs to that run alone: the resident memory after the libraries
are imported, after the model is loaded (and, with ``--copies 2``, after its random-init baseline is
built, as a study keeps the trained model loaded while a baseline runs), the peak of the process
over the probe run (Linux ``VmHWM``, never reset, so the loading peak counts too) and the peak of
the run alone (``VmHWM`` reset just before it). The estimate is computed from the model's config
before anything is loaded, as ``compare`` and ``scan`` do. One measurement each; the machine's
other jobs do not change resident memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys


def _rss(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as stream:
        for line in stream:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status (Linux only)")


def measure(model_name: str, context: int, batch: int, copies: int) -> dict:
    """One run in this process (the child side)."""
    from equivariance_probe import EquivarianceProbe, load_corpus, load_model, random_init_like
    from equivariance_probe.sources.resources import PeakMemory, estimate_memory_of

    libraries = _rss("VmRSS")

    estimate = estimate_memory_of(model_name, context_length=context, batch_size=batch, copies=copies)
    model, tokenizer = load_model(model_name, attn_implementation="sdpa")
    windows = load_corpus(n_docs=40, pack=context, tokenizer=tokenizer)
    if len(windows) < batch:
        raise SystemExit(f"the first 40 articles give {len(windows)} windows of {context} tokens, fewer than {batch}")
    trained = model
    if copies == 2:  # the trained model stays loaded while its baseline runs, as in a study
        model = random_init_like(trained, seed=0)
    gc.collect()
    loaded, load_peak = _rss("VmRSS"), _rss("VmHWM")
    with PeakMemory() as peak:
        EquivarianceProbe(model, tokenizer=tokenizer).run(windows.tokens[:batch], batch_size=batch, progress=False)
    run_peak = peak.bytes if peak.method == "VmHWM" else None
    return {"model": model_name, "context": context, "batch": batch, "copies": copies,
            "libraries_gib": libraries / 2**30, "loaded_gib": loaded / 2**30, "load_peak_gib": load_peak / 2**30,
            "run_peak_gib": None if run_peak is None else run_peak / 2**30,
            "process_peak_gib": max(load_peak, run_peak or 0) / 2**30,
            "estimate_gib": estimate.total / 2**30, "estimate": estimate.describe()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--runs", default="8192x1,4096x1,1024x4,256x16", help="comma-separated TxB")
    parser.add_argument("--copies", type=int, default=2, choices=[1, 2])
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=3, type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        context, batch, copies = args.child
        print(json.dumps(measure(args.model, context, batch, copies)))
        return
    rows = []
    for run in args.runs.split(","):
        context, batch = (int(part) for part in run.lower().split("x"))
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", str(context), str(batch),
                              str(args.copies)], capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(f"T={context:5d} B={batch:3d} copies={args.copies}: libraries {row['libraries_gib']:.2f} GiB, loaded "
              f"{row['loaded_gib']:.2f} GiB (loading peak {row['load_peak_gib']:.2f}), run peak {row['run_peak_gib']:.2f} "
              f"GiB; process peak {row['process_peak_gib']:.2f} GiB, estimate {row['estimate_gib']:.2f} GiB "
              f"({100 * (row['estimate_gib'] / row['process_peak_gib'] - 1):+.0f} %)", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as stream:
            json.dump(rows, stream, indent=1)


if __name__ == "__main__":
    main()
