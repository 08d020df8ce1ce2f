"""The shift test's attribution against the plain shift test: time and peak memory, one process per route.

    python benchmarks/shift_attribution.py [N_SEGMENTS N_CONTEXTS [HEAD_LAYERS]]

Each route runs :meth:`EquivarianceProbe.shift` of the packaged Gemma 3 270M (sdpa, float32, CPU or the default
device) on the same grid (three of its default offsets: the smallest, the middle and the largest): ``plain``
(no attribution), ``attribution`` (the embedding and every block's attention and MLP) and ``heads`` (those and
the heads of ``HEAD_LAYERS``, default 4 layers spread over the model). Each runs in a fresh process, for its
peak RSS over the run with the model loaded
(:class:`~equivariance_probe.sources.resources.PeakMemory`); wall and CPU seconds are printed (on a shared
machine CPU seconds measure the route, wall seconds the neighbours too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def one(route: str, n_segments: int, n_contexts: int, head_layers: tuple[int, ...]) -> None:
    from equivariance_probe import EquivarianceProbe, load_corpus, load_model
    from equivariance_probe.sources.packing import special_prefix
    from equivariance_probe.sources.resources import PeakMemory
    from equivariance_probe.sources.shift_grid import default_offsets, split_documents

    model, tokenizer = load_model("gemma-3-270m", attn_implementation="sdpa")
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    layout = probe.adapter.layout
    offsets = default_offsets(layout.max_context, len(special_prefix(tokenizer)), 64, layout.sliding_windows)
    offsets = (offsets[0], offsets[len(offsets) // 2], offsets[-1])
    segments, contexts = split_documents(load_corpus(), tokenizer, n_segments=n_segments, n_contexts=n_contexts,
                                         segment_length=64, context_length=max(offsets))
    options = {"plain": {}, "attribution": {"attribution": True},
               "heads": {"attribution": True, "attribution_heads": head_layers}}[route]
    with PeakMemory() as peak:
        start, cpu = time.perf_counter(), time.process_time()
        result = probe.shift(segments, contexts, offsets=offsets, segment_length=64, progress=False, **options)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    check = result.metadata.get("attribution_check", {})
    print(json.dumps({"route": route, "seconds": seconds, "cpu_seconds": cpu_seconds,
                      "peak_rss_mib": peak.bytes / 2**20, "peak_method": peak.method,
                      "components": len(result.config.components), "offsets": list(offsets),
                      "windows": n_segments * n_contexts * len(offsets), "check": check.get("value"),
                      "heads_difference": check.get("heads_max_difference"), "passed": check.get("passed")}))


def main() -> None:
    if sys.argv[1:2] and sys.argv[1] in ("plain", "attribution", "heads"):
        one(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), tuple(int(x) for x in sys.argv[4].split(",")))
        return
    n_segments, n_contexts = (int(a) for a in (sys.argv[1:] + ["2", "2"])[:2])
    head_layers = sys.argv[3] if len(sys.argv) > 3 else "5,6,11,17"
    for route in ("plain", "attribution", "heads"):
        line = subprocess.run([sys.executable, __file__, route, str(n_segments), str(n_contexts), head_layers],
                              check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(line, flush=True)


if __name__ == "__main__":
    main()
