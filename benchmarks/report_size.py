"""Sizes of the HTML report and of head views at a long context.

    python benchmarks/report_size.py [--docs 4] [--context 1024] [--out report_size_out]

Runs the packaged Gemma 3 270M on ``--docs`` windows of ``--context`` tokens, ranks the
heads, and writes (under ``--out``) and measures:

  report_plain.html        — summary, figures and ranking, no views (no CircuitsVis bundle);
  report_views.html        — the same with views of the 2 most and 2 least position-bound heads
                             over positions 0..127 of the first document;
  report_views_full.html   — views of the same heads over all ``--context`` positions;
  view_*.html              — the views alone, rounded to 3 decimals and unrounded.

Prints one JSON line of sizes (bytes) and timings (seconds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from equivariance_probe import EquivarianceProbe, head_views, load_corpus, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default="report_size_out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    timings: dict[str, float] = {}
    start = time.perf_counter()
    model, tokenizer = load_model()
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    docs = load_corpus(n_docs=args.docs, min_chars=20_000)  # long articles: every window is full
    timings["load"] = time.perf_counter() - start
    start = time.perf_counter()
    result = probe.run(docs, context_length=args.context, batch_size=2, keep_pattern=True, progress=False)
    timings["probe"] = time.perf_counter() - start
    start = time.perf_counter()
    ranking = result.rank_heads()
    timings["rank_heads"] = time.perf_counter() - start
    print(ranking.to_text(max_rows=8))

    start = time.perf_counter()
    window = head_views(probe, docs[0], result=result, ranking=ranking, stop=128)
    timings["views_128"] = time.perf_counter() - start
    start = time.perf_counter()
    full = head_views(probe, docs[0], result=result, ranking=ranking, stop=args.context)
    timings["views_full"] = time.perf_counter() - start

    sizes: dict[str, int] = {}

    def write(name: str, text: str) -> None:
        path = out / name
        path.write_text(text, encoding="utf-8")
        sizes[name] = path.stat().st_size

    start = time.perf_counter()
    write("report_plain.html", result.to_html())
    timings["report_plain"] = time.perf_counter() - start
    write("report_views.html", result.to_html(views=window))
    start = time.perf_counter()
    write("report_views_full.html", result.to_html(views=full))
    timings["report_views_full"] = time.perf_counter() - start
    for name, views in (("128", window), (str(args.context), full)):
        write(f"view_{name}_rounded3.html", views.to_html())
        write(f"view_{name}_unrounded.html", views.to_html(decimals=None))
    print(json.dumps({"heads": window.labels, "windows": result.n_windows, "tokens": result.n_tokens,
                      "bytes": sizes, "seconds": {k: round(v, 1) for k, v in timings.items()}}))


if __name__ == "__main__":
    main()
