"""``equivariance-probe shift``: move the same texts through the window, trained weights against their baselines:
what their attention, residual stream and predictions owe to the offset, to what precedes them and to the tokens
themselves."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...errors import InputError
from ..common import check_writable, print_result, read_documents
from ..options import MODEL_OPTIONS, add_shared_options, int_list, positive

NAME = "shift"
#: Its place in ``equivariance-probe --help``.
ORDER = 90
SUMMARY = 'move the same texts through the window: what their attention, residual stream and predictions owe to the offset, to what precedes them and to the tokens themselves'
DETAILS = (
    'Trained weights vs baselines on one grid of segments, contexts and offsets, each run through '
    "--framework. Not taken: --context-length and --n-docs (each window is the special prefix, an offset's "
    'worth of context and a segment: --offsets, --segment-length, --n-segments, --n-contexts), --pack, '
    "--exclude-keys, --keep-pattern, --sample-size and --analyses (they shape the study's windows and sums, "
    "not the shift grid's), --memory-limit-gib (the grid's memory is one segment's, measured in the guide) "
    "and --resume, --shard, --checkpoint-every (run's only)."
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``shift``'s options."""
    from ...sources.shift_grid import DEFAULT_SHIFT, SHIFT_MODES

    add_shared_options(parser, "out", *MODEL_OPTIONS, "framework", "corpus", "text_field", "batch_size", "baselines",
                       "seed", "interval_groups", "no_progress", "json", differ={
                           "baselines": ({"default": []}, "default none: each baseline is a second run of the whole "
                                                          "grid; random_init for the model's own initialisation"),
                           "batch_size": ({"default": 1}, "default 1: a segment's windows differ in length by "
                                                          "their offsets, and padding them costs more than it saves "
                                                          "on a CPU"),
                       })
    parser.add_argument("--n-segments", type=positive, default=DEFAULT_SHIFT["n_segments"],
                        help="texts to move, one per document (default %(default)s)")
    parser.add_argument("--n-contexts", type=positive, default=DEFAULT_SHIFT["n_contexts"],
                        help="preceding texts, from other documents (default %(default)s)")
    parser.add_argument("--segment-length", type=positive, default=DEFAULT_SHIFT["segment_length"],
                        help="tokens per segment (default %(default)s)")
    parser.add_argument("--offsets", type=int_list, default=None,
                        help="comma-separated offsets (default: 6 from 0 to a 1024-token window, both sides of a sliding "
                             "window)")
    parser.add_argument("--mode", choices=SHIFT_MODES, default="text",
                        help="text (default): context tokens precede the segment; position_ids: the segment alone with "
                             "its position ids moved")
    add_shared_options(parser, "no_figures", "figure_format")
    parser.add_argument("--view-head", default=None,
                        help="the head of the report's CircuitsVis view, e.g. 'L4H3' (default: the head whose centred "
                             "logits the offset moves most)")


def handle(args: argparse.Namespace) -> int:
    """``equivariance-probe shift``: the shift test on the trained model and each baseline; one
    ``shift_<variant>.safetensors`` per variant and a table (``--json``: the summaries)."""
    from ...probe import EquivarianceProbe
    from ...runs.study import check_baselines, variant_builders
    from ...runs.tables import shift_result_readings
    from ...sources.corpus import load_corpus
    from ...sources.devices import parse_dtype, resolve_device
    from ...sources.models import PACKAGED_ENCODERS, load_model, load_positional_model
    from ...sources.packing import special_prefix
    from ...sources.shift_grid import check_shift_options, default_offsets, split_documents

    out = Path(args.out)
    check_writable(out)
    check_baselines(args.baselines)
    # Everything that needs no model is checked before one loads (a minute for a packaged model's first load).
    check_shift_options(offsets=args.offsets, segment_length=args.segment_length, mode=args.mode,
                        n_contexts=args.n_contexts)
    # Loaded as run_study loads it: the Hugging Face model wrapped for --framework; each baseline is built from it
    # and wrapped the same way, so trained and baselines run through one framework.
    if args.model in PACKAGED_ENCODERS:  # the packaged BERT encoder: the segment ends the window, attention both ways
        if args.framework != "huggingface":
            raise InputError(f"the packaged encoder {args.model!r} runs as a Hugging Face model only; drop --framework "
                             f"{args.framework}")
        model, tokenizer = load_positional_model(args.model, cache_dir=args.cache_dir)
        model = model.to(device=resolve_device(args.device), dtype=parse_dtype(args.dtype))
    else:
        model, tokenizer = load_model(args.model, args.framework, cache_dir=args.cache_dir, dtype=parse_dtype(args.dtype),
                                      attn_implementation=args.attn_implementation, device=resolve_device(args.device))
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    offsets = args.offsets or default_offsets(probe.adapter.layout.max_context, len(special_prefix(tokenizer)),
                                              args.segment_length, probe.adapter.layout.sliding_windows)
    documents = read_documents(args)
    documents = load_corpus(documents) if documents is None or isinstance(documents, (str, Path)) else documents
    segments, contexts = split_documents(
        documents, tokenizer, n_segments=args.n_segments, n_contexts=1 if args.mode == "position_ids" else args.n_contexts,
        segment_length=args.segment_length, context_length=max(offsets))
    options = dict(offsets=offsets, segment_length=args.segment_length, mode=args.mode, batch_size=args.batch_size,
                   interval_groups=args.interval_groups)
    results, wrote = {}, []
    for name, build in variant_builders(model, args.baselines, args.seed):  # one baseline in memory at a time
        results[name] = EquivarianceProbe(build(), tokenizer=tokenizer).shift(
            segments, None if args.mode == "position_ids" else contexts,
            progress=False if args.no_progress else f"{name}: segments", **options)
        results[name].metadata["study"] = {"model": args.model, "variant": name}  # as the user named them
        wrote.append(results[name].save(out / f"shift_{name}.safetensors"))
    if not args.no_figures:
        wrote += _shift_display(out, probe, results, segments, None if args.mode == "position_ids" else contexts,
                                args.view_head, args.figure_format)
    table = "\n\n".join(f"[{name}]\n{result.table()}" for name, result in results.items())
    print_result(args, f"{table}\n\n{shift_result_readings()}", {name: result.summary() for name, result in results.items()},
           wrote)
    return 0


def _shift_display(out: Path, probe: Any, results: dict[str, Any], segments: list[Any], contexts: list[Any] | None,
                   head: str | None, figure_format: str) -> list[Path]:
    """The shift run's figures (``shift_*.png``, or the ``figure_format`` files; the trained model beside its baselines) and
    ``shift_report.html`` with the CircuitsVis view of one head at the smallest and largest offsets."""
    from ...display.figures import save_figures
    from ...display.shift import render_shift_report, shift_figures, shift_view

    trained = results["trained"]
    baselines = {name: result for name, result in results.items() if name != "trained"}
    wrote = save_figures(shift_figures(trained, baselines), out, format=figure_format)
    view = shift_view(probe, segments, contexts, result=trained, head=head)
    return wrote + [render_shift_report(trained, baselines, view=view).save(out / "shift_report.html")]
