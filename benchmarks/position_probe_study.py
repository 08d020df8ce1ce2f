"""The linear position probes on the packaged models, trained against their random initialisation, and their cost.

    python benchmarks/position_probe_study.py --out probe_study [--models gemma-3-270m,smollm2,qwen2.5-coder,minilm]

For each model: :func:`~equivariance_probe.run_positional` with ``analyses=("probe",)`` at the guide's defaults
(16 documents of the packaged corpus, 2 consecutive windows of 256 tokens each, 32 positions per window,
5 document folds), saved as ``<out>/<model>/positional.safetensors`` with its figure; then, on the same windows,
the plain forward passes (the model's base, 4 windows per pass) timed alone, so that the probe's cost reads
against them (``--n-docs``, ``--windows-per-doc``, ``--context-length``: fewer tokens for a larger model on a
busy machine).
Prints one JSON line per model (the numbers of docs/guide/positional.md's table).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MODELS = ("gemma-3-270m", "smollm2", "qwen2.5-coder", "minilm")
SETTINGS = {"n_docs": 16, "context_length": 256, "probe_positions": 32, "windows_per_doc": 2, "n_folds": 5}


def study_one(name: str, out: Path, **changes: int) -> dict:
    from equivariance_probe import load_corpus, load_positional_model, run_positional
    from equivariance_probe.adapters.modules import hf_model_of
    from equivariance_probe.display.figures import save_figures
    from equivariance_probe.display.positional import positional_figures
    from equivariance_probe.runs.positional import _probe_windows

    settings = SETTINGS | changes
    model, tokenizer = load_positional_model(name)
    docs = list(load_corpus())
    started = time.perf_counter()
    study = run_positional(model, tokenizer, docs=docs, analyses=("probe",), progress=False, **settings)
    probe_seconds = time.perf_counter() - started
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    study.save(folder / "positional.safetensors")
    save_figures(positional_figures(study), folder, prefix="positional_")
    tokens, _ = _probe_windows(docs, tokenizer, settings["context_length"], settings["n_docs"], settings["windows_per_doc"])
    hf = hf_model_of(model)
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(tokens), 4):
            hf.base_model(input_ids=tokens[start : start + 4], use_cache=False)
    forward_seconds = time.perf_counter() - started
    summary = study.summary()
    row = {"model": name, "probe_seconds_trained_and_untrained": round(probe_seconds, 1),
           "forward_seconds_trained": round(forward_seconds, 1), "windows": study.metadata["probe_windows"]}
    for key in ("probe", "probe_baseline"):
        for target in ("position", "log1p_position"):
            part = summary[key][target]
            best = part["best_layer"]
            row[f"{key}/{target}"] = {"best_layer": best, "r2": round(part["best_r2"], 4),
                                      "low": round(part["r2_low"][best], 4), "high": round(part["r2_high"][best], 4),
                                      "mae": round(part["best_mae"], 2), "r2_by_layer": [round(v, 3) for v in part["r2"]]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--n-docs", type=int, default=SETTINGS["n_docs"])
    parser.add_argument("--windows-per-doc", type=int, default=SETTINGS["windows_per_doc"])
    parser.add_argument("--context-length", type=int, default=SETTINGS["context_length"])
    args = parser.parse_args()
    for name in args.models.split(","):
        print(json.dumps(study_one(name.strip(), Path(args.out), n_docs=args.n_docs,
                                   windows_per_doc=args.windows_per_doc, context_length=args.context_length)), flush=True)


if __name__ == "__main__":
    main()
