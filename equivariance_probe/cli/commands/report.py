"""``equivariance-probe report``: an offline HTML page from a result file of any kind: a probe result (``--views``:
with CircuitsVis views of the most and least position-bound heads, reloading the model the results name;
``--overview``: the same with the heads over the whole window in blocks of positions), a shift result (its
baselines beside it, as the page ``shift`` writes) or a positional study."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ...errors import InputError, ModelNotFoundError
from ..options import WHY, add_shared_options, non_negative, positive

NAME = "report"
#: Its place in ``equivariance-probe --help``.
ORDER = 50
SUMMARY = 'write an offline HTML report from a result file of any kind'
DETAILS = (
    "Reads a probe result (results.safetensors from 'run', any format version), a shift result "
    "(shift_<variant>.safetensors from 'shift'; a trained model's page shows the baselines beside it) or a "
    "positional study (positional.safetensors). 'shift' already writes shift_report.html with a head's "
    "CircuitsVis view; this command writes the same page without the view from the files alone. With --views, "
    'CircuitsVis views of the most and least position-bound heads of a probe result, reloading the model the '
    'results name (offline).'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``report``'s options."""
    parser.add_argument("results", help="a result file of any kind and version: results.safetensors from 'run', "
                                        "shift_<variant>.safetensors from 'shift' (which writes shift_report.html "
                                        "itself, with a head's view), positional.safetensors from 'positional'")
    parser.add_argument("-o", "--out", default=None,
                        help=f"the HTML file; {WHY}: a file, not a folder, since a report is one page "
                             "(default, next to the results: report.html for a probe result, "
                             "<file>_report.html for a shift result, so that shift_report.html stays as 'shift' "
                             "wrote it, positional_report.html for a positional study)")
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
    """The page of the file's kind (:func:`_reported_kind`): a probe result's report, a shift result's or a
    positional study's."""
    from ...runs.positional import POSITIONAL_KIND
    from ...shift_result import SHIFT_KIND

    kind = _reported_kind(args.results)
    if kind not in (SHIFT_KIND, POSITIONAL_KIND):  # a probe result, of any format version
        return _probe_report(args)
    viewed = [flag for flag, given in (("--views", args.views), ("--overview", args.overview),
                                       ("--heads", args.heads is not None)) if given]
    what = {SHIFT_KIND: "a shift result", POSITIONAL_KIND: "a positional study"}[kind]
    if viewed:
        raise InputError(f"{' and '.join(viewed)} draw{'s' if len(viewed) == 1 else ''} heads of a probe result's model; "
                         f"{args.results} is {what}, whose page has no head views here ('shift' writes its "
                         "view into shift_report.html): drop the flag")
    page, default = _shift_page(args) if kind == SHIFT_KIND else _positional_page(args)
    output = Path(args.out) if args.out else Path(args.results).with_name(default)
    page.save(output)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB)")
    return 0


def _reported_kind(path: str) -> str | None:
    """The kind a file's header names (``None`` for a file whose header names none, as a probe result of an early
    format); a positional study of the JSON format names its format in its body."""
    from ...records.container import file_kind, header_kind
    from ...runs.positional import POSITIONAL_KIND

    kind = header_kind(path)
    if kind is None and file_kind(path) == "json":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # the probe result's loader names what is wrong with the file
            return None
        if isinstance(data, dict) and data.get("format") == "equivariance_probe.positional":
            return POSITIONAL_KIND
    return kind


def _shift_page(args: argparse.Namespace) -> tuple[Any, str]:
    """A shift result's page and its default file name; a trained model's baselines (``shift_<baseline>`` files
    beside ``shift_trained``) drawn and compared beside it."""
    from ...display.shift import render_shift_report
    from ...runs.shift import shift_file
    from ...runs.study import BASELINES
    from ...shift_result import ShiftResult

    path = Path(args.results)
    result = ShiftResult.load(path)
    baselines = {}
    if path.stem == "shift_trained":
        baselines = {name: ShiftResult.load(shift_file(path.parent, name)) for name in BASELINES
                     if shift_file(path.parent, name).is_file()}
    name = path.stem.removeprefix("shift_")
    return render_shift_report(result, baselines, name=name), f"{path.stem}_report.html"


def _positional_page(args: argparse.Namespace) -> tuple[Any, str]:
    """A positional study's page and its default file name."""
    from ...display.positional import positional_report_section
    from ...display.report import sections_page
    from ...runs.positional import PositionalStudy

    study = PositionalStudy.load(args.results)
    page = sections_page(f"equivariance_probe positional analyses: {study.model_name}",
                         f"Equivariance probe, positional analyses: {study.model_name}",
                         [positional_report_section(study)])
    return page, "positional_report.html"


def _probe_report(args: argparse.Namespace) -> int:
    """A probe result's report, with its study's baselines and positional analyses where they lie beside it."""
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
