"""``equivariance-probe shift``: move the same texts through the window, trained weights against their baselines:
what their attention, residual stream and predictions owe to the offset, to what precedes them and to the tokens
themselves."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...errors import FigureError
from ..common import check_writable, model_source_of, print_result, read_documents
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
    "and --shard (run's only). Checkpoints every --checkpoint-every segments and goes on from the last with "
    '--resume, as run does. No --sink-epsilon: the shift test measures the sink mass by offset, which no '
    'threshold cuts.'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``shift``'s options."""
    from ...runs.shift import DEFAULT_SHIFT_CHECKPOINT_EVERY
    from ...sources.shift_grid import DEFAULT_SHIFT, SHIFT_MODES

    add_shared_options(parser, "out", *MODEL_OPTIONS, "framework", "corpus", "text_field", "batch_size", "baselines",
                       "seed", "interval_groups", "no_progress", "json", differ={
                           "baselines": ({"default": []}, "default none: each baseline is a second run of the whole "
                                                          "grid; random_init for the model's own initialisation"),
                           "batch_size": ({"default": 1}, "default 1: a segment's windows differ in length by "
                                                          "their offsets, and padding them costs more than it saves "
                                                          "on a CPU"),
                       })
    from ...sources.shift_grid import DEFAULT_PATCH_SHIFT

    parser.add_argument("--n-segments", type=positive, default=None,
                        help=f"texts to move, one per document (default {DEFAULT_SHIFT['n_segments']}; "
                             f"{DEFAULT_PATCH_SHIFT['n_segments']} with --patch)")
    parser.add_argument("--n-contexts", type=positive, default=None,
                        help=f"preceding texts, from other documents (default {DEFAULT_SHIFT['n_contexts']}; "
                             f"{DEFAULT_PATCH_SHIFT['n_contexts']} with --patch)")
    parser.add_argument("--segment-length", type=positive, default=DEFAULT_SHIFT["segment_length"],
                        help="tokens per segment (default %(default)s)")
    parser.add_argument("--offsets", type=int_list, default=None,
                        help="comma-separated offsets (default: 6 from 0 to a 1024-token window, both sides of a sliding "
                             "window)")
    parser.add_argument("--patch", nargs="?", const=True, default=False, metavar="COMPONENTS",
                        help="activation patching: run each window with a component's output at the segment replaced "
                             "by its output at the reference offset, and report how much of the prediction change "
                             "goes away. Alone: each block's attention and MLP, one at a time; or comma-separated "
                             "items: 'attention.3,mlp.3', 'head.5.2', 'heads.5' (every head of layer 5), 'heads', "
                             "'all' (everything together), components joined by '+' patched together. A forward pass "
                             "per item per window, so smaller defaults: "
                             f"{DEFAULT_PATCH_SHIFT['n_segments']} segments, {DEFAULT_PATCH_SHIFT['n_contexts']} "
                             f"contexts, {DEFAULT_PATCH_SHIFT['n_offsets']} offsets (explicit options win)")
    parser.add_argument("--patch-reference", type=int, default=0, metavar="INDEX",
                        help="the index among the offsets of the reference offset whose outputs are patched in "
                             "(default 0: the smallest)")
    parser.add_argument("--mode", choices=SHIFT_MODES, default="text",
                        help="text (default): context tokens precede the segment; position_ids: the segment alone with "
                             "its position ids moved")
    parser.add_argument("--attribution", action="store_true",
                        help="also split the residual stream's offset and context sums of squares into what the "
                             "embedding and each block's attention and MLP write (shift_attribution figure, attribution "
                             "table)")
    parser.add_argument("--attribution-heads", type=int_list, default=[],
                        help="comma-separated layers whose attention is split into heads too, with --attribution "
                             "(e.g. 5,6,7; each head's state is as large as a block's)")
    add_shared_options(parser, "checkpoint_every", "resume", differ={"checkpoint_every": (
        {"default": DEFAULT_SHIFT_CHECKPOINT_EVERY, "help": "save a checkpoint in OUT/checkpoint every N segments (0: never)"},
        "default 1: a segment's grid is many forward passes, its checkpoint one small file")})
    add_shared_options(parser, "no_figures", "figure_format")
    parser.add_argument("--view-head", default=None,
                        help="the head of the report's CircuitsVis view, e.g. 'L4H3' (default: the head whose centred "
                             "logits the offset moves most)")


def handle(args: argparse.Namespace) -> int:
    """``equivariance-probe shift``: the shift study (:func:`~equivariance_probe.runs.shift.run_shift_study`); one
    ``shift_<variant>.safetensors`` per variant and a table (``--json``: the summaries)."""
    from ...runs.checkpoint import CHECKPOINT_FOLDER
    from ...runs.shift import run_shift_study
    from ...runs.tables import shift_result_readings
    from ...sources.shift_grid import ShiftOptions

    out = Path(args.out)
    check_writable(out)
    view_head = _view_head(args)  # a bad head is refused now, not after the grid has run
    args.checkpoint_folder = out / CHECKPOINT_FOLDER  # for the note of a study that stops (see main)
    options = ShiftOptions(offsets=args.offsets, segment_length=args.segment_length, mode=args.mode,
                           batch_size=args.batch_size, interval_groups=args.interval_groups,
                           attribution=args.attribution, attribution_heads=tuple(args.attribution_heads),
                           patch=args.patch, patch_reference=args.patch_reference)
    study = run_shift_study(model_source_of(args), out, options, corpus=read_documents(args),
                            n_segments=args.n_segments, n_contexts=args.n_contexts, baselines=args.baselines,
                            seed=args.seed, checkpoint_every=args.checkpoint_every, resume=args.resume,
                            progress=not args.no_progress)
    if study.probe is None:  # killed after its files were written, while its checkpoint was cleared
        print(f"the shift study in {out} had finished: its results are in {', '.join(map(str, study.wrote))}")
        return 0
    wrote = list(study.wrote)
    not_drawn = None
    if not args.no_figures:
        try:
            wrote += _shift_display(out, study.probe, study.results, study.segments, study.contexts, view_head,
                                    args.figure_format)
        except FigureError as error:  # the results are saved: print their table, then say what was not drawn
            not_drawn = error
    table = "\n\n".join(f"[{name}]\n{result.table()}" for name, result in study.results.items())
    print_result(args, f"{table}\n\n{shift_result_readings()}",
                 {name: result.summary() for name, result in study.results.items()}, wrote)
    if not_drawn is not None:
        raise FigureError(f"{not_drawn}; the measured results are saved ({', '.join(map(str, study.wrote))}) and "
                          f"their table is printed above, but the figures and shift_report.html were not written: "
                          f"run again with --no-figures, or draw from the saved files", figure=not_drawn.figure)
    return 0


def _view_head(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--view-head`` read and checked before the model loads: one head, inside the model's layers and heads as its
    config gives them (read without the weights; a model whose config cannot be read alone is checked by the view).

    Raises:
        InputError: not one head, a head the model lacks, or a head beside ``--no-figures`` (no report to view it in).
    """
    from ...display.views import parse_heads
    from ...errors import InputError, ModelNotFoundError
    from ...sources.resources import model_size

    if args.view_head is None:
        return None
    if args.no_figures:
        raise InputError(f"--view-head {args.view_head} names the head of the report's view, and --no-figures writes "
                         "no report: drop one of them")
    heads = parse_heads(args.view_head)
    if len(heads) != 1:
        raise InputError(f"--view-head {args.view_head!r} names {len(heads)} heads; the view shows one, e.g. 'L4H3'")
    try:
        size = model_size(model_source_of(args).load_config())
    except ModelNotFoundError:  # the packaged encoder has no config of its own here: the view checks the head
        return heads[0]
    layer, head = heads[0]
    if not (layer < size.n_layers and head < size.n_heads):
        raise InputError(f"--view-head {args.view_head}: {args.model} has layers 0..{size.n_layers - 1} and heads "
                         f"0..{size.n_heads - 1}; pass a head within those ranges")
    return heads[0]


def _shift_display(out: Path, probe: Any, results: dict[str, Any], segments: list[Any], contexts: list[Any] | None,
                   head: tuple[int, int] | None, figure_format: str) -> list[Path]:
    """The shift run's figures (``shift_*.png``, or the ``figure_format`` files; the trained model beside its baselines) and
    ``shift_report.html`` with the CircuitsVis view of one head at the smallest and largest offsets."""
    from ...display.figures import save_figures
    from ...display.shift import render_shift_report, shift_figures, shift_view

    trained = results["trained"]
    baselines = {name: result for name, result in results.items() if name != "trained"}
    wrote = save_figures(shift_figures(trained, baselines), out, format=figure_format)
    view = shift_view(probe, segments, contexts, result=trained, head=head)
    return wrote + [render_shift_report(trained, baselines, view=view).save(out / "shift_report.html")]
