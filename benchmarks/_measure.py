"""One measurement in a fresh process: wall time of the timed part and peak RSS of the process.

    python benchmarks/_measure.py MODE N_DOCS CONTEXT BATCH

Prints one JSON line. Used by overhead.py and memory.py so that each number has its own
process (peak RSS cannot be reset inside one). Modes: ``full`` (eager forward with logits),
``bare`` (eager forward without them), ``sdpa`` (the same with the sdpa kernel), ``probe`` (the
probe on the sdpa model), ``naive`` (TransformerLens run_with_cache of every pattern, then numpy).
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np
import torch


def windows(tokenizer, n_docs: int, context: int) -> torch.Tensor:
    from equivariance_probe import load_corpus

    rows, stream = [], []
    for doc in load_corpus(n_docs=None, min_chars=1):
        ids = tokenizer(doc)["input_ids"]
        stream += ids
        if len(ids) >= context:
            rows.append(ids[:context])
        if len(rows) == n_docs:
            break
    # Fewer articles this long than asked: windows cut from the articles one after the other.
    while len(rows) < n_docs and len(stream) >= context:
        rows.append(stream[:context])
        stream = stream[context:]
    return torch.tensor(rows[:n_docs])


def main() -> None:
    mode, n_docs, context, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from equivariance_probe import EquivarianceProbe, load_model

    backend = "transformer_lens" if mode == "naive" else "huggingface"
    kernel = "sdpa" if mode in ("sdpa", "probe") else "eager"
    model, tokenizer = load_model("gemma-3-270m", backend, attn_implementation=kernel)
    tokens = windows(tokenizer, n_docs, context)
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.no_grad():
        if mode == "full":  # plain eager forward, logits for every position
            for i in range(0, n_docs, batch):
                model(tokens[i : i + batch], use_cache=False)
        elif mode in ("bare", "sdpa"):  # eager (sdpa) forward that skips the projection to the vocabulary
            for i in range(0, n_docs, batch):
                model.base_model(tokens[i : i + batch], use_cache=False)
        elif mode == "probe":
            EquivarianceProbe(model, tokenizer=tokenizer).run(tokens, batch_size=batch, progress=False)
        elif mode == "naive":  # cache every pattern, then numpy
            patterns = []
            for i in range(0, n_docs, batch):
                _, cache = model.run_with_cache(tokens[i : i + batch], names_filter=lambda n: n.endswith("hook_pattern"))
                patterns.append({k: v.numpy().copy() for k, v in cache.items()})
            logs = [np.log(np.maximum(p, 1e-38)) for batch_patterns in patterns for p in batch_patterns.values()]
            float(sum(x.sum() for x in logs))
        else:
            raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": mode, "n_docs": n_docs, "context": context, "seconds": seconds,
                      "peak_rss_mib": peak / 1024, "rss_before_mib": baseline_rss / 1024}))


if __name__ == "__main__":
    main()
