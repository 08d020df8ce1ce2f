"""``equivariance-probe report``: an offline HTML report from a results file (``--views``: with CircuitsVis views of
the most and least position-bound heads, reloading the model the results name; ``--overview``: the same with the
heads over the whole window in blocks of positions)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...errors import ModelNotFoundError
from ..options import WHY, Deprecated, add_shared_options, non_negative, positive

NAME = "report"
#: Its place in ``equivariance-probe --help``.
ORDER = 50
SUMMARY = 'write an offline HTML report from a results file'
DETAILS = (
    'With --views, CircuitsVis views of the most and least position-bound heads, reloading the model the '
    'results name (offline).'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``report``'s options."""
    parser.add_argument("results", help="a results.safetensors written by 'run' (or a result file of any version)")
    parser.add_argument("-o", "--out", default=None,
                        help=f"the HTML file; {WHY}: a file, not a folder, since a report is one page "
                             "(default: report.html next to the results)")
    parser.add_argument("--output", dest="out", action=Deprecated, help="deprecated spelling of -o/--out")
    add_shared_options(parser, "cache_dir", "corpus", "no_progress", differ={
        "no_progress": ({}, "a report draws no progress bar (it reloads at most one model and one document); the "
                            "flag is taken so that a script can pass the same flags to every command"),
        "corpus": ({"help": "corpus to take the viewed document from"}, "default: the study's")})
    parser.add_argument("--views", action="store_true",
                        help="add CircuitsVis views of heads: reloads the model named in the results (offline) and one document")
    parser.add_argument("--heads", default=None,
                        help="heads to view, e.g. 'L4H3,L5H1' (default: the 2 most and 2 least position-bound)")
    parser.add_argument("--document", type=non_negative, default=0, help="index of the corpus document to view (default 0)")
    parser.add_argument("--start", type=non_negative, default=0, help="first position shown")
    parser.add_argument("--stop", type=positive, default=None, help="position after the last shown (default: start + 128)")
    parser.add_argument("--decimals", type=int, default=3, help="round view values to this many decimals (default 3)")
    parser.add_argument("--overview", action="store_true",
                        help="views (as --views) with the heads over the study's whole window in blocks of positions "
                             "(a page of a few MB that draws in seconds at 8,192 positions); --start/--stop choose the "
                             "range shown in full")
    add_shared_options(parser, "sink_epsilon")
    parser.add_argument("--block-size", type=positive, default=None,
                        help="positions per block of --overview (default: the window / 256, rounded up)")


def handle(args: argparse.Namespace) -> int:
    from ...display.positional import positional_report_section
    from ...display.report import render_report
    from ...display.views import parse_heads, views_for_result
    from ...result import ProbeResult
    from ...runs.positional import PositionalStudy
    from ...runs.study import load_study_baselines

    result = ProbeResult.load(args.results)
    output = Path(args.out) if args.out else Path(args.results).with_name("report.html")
    # A study's trained result: its baselines lie beside it, shown side by side.
    baselines, missing = load_study_baselines(args.results, result)
    if missing:
        print(f"the study's baselines {missing} are not beside {args.results}; reporting without them", file=sys.stderr)
    views = None
    if args.views or args.overview:
        heads = parse_heads(args.heads) if args.heads else None  # bad heads: exit 2, not a silent report
        try:
            views, note = views_for_result(result, heads=heads, document=args.document, corpus=args.corpus,
                                           start=args.start, stop=args.stop, decimals=args.decimals,
                                           cache_dir=args.cache_dir, overview=args.overview, block_size=args.block_size)
            print(note)
        except ModelNotFoundError as error:
            print(f"writing the report without views: {error}", file=sys.stderr)
    # The positional analyses' section, when the study wrote them beside its results.
    candidates = [Path(args.results).with_name(name) for name in ("positional.safetensors", "positional.json")]
    positional = next((path for path in candidates if path.is_file()), None)
    extra = [positional_report_section(PositionalStudy.load(positional))] if positional is not None else []
    render_report(result, baselines=baselines, views=views, extra_sections=extra, sink_epsilon=args.sink_epsilon).save(output)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB)")
    return 0
