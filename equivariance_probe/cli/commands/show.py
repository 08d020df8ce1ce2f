"""``equivariance-probe show``: the headline numbers of result files, read from their headers (no array is loaded;
``--verify`` reads every array and checks it against its digest); shift results and positional studies as their own tables,
and ``--csv`` any of them in long form."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ...errors import InputError
from ...records.fileformat import jsonable
from ..options import add_shared_options

NAME = "show"
#: Its place in ``equivariance-probe --help``.
ORDER = 30
SUMMARY = 'print the headline numbers of result files'
DETAILS = (
    "Reads each file's header only: instant, whatever the file's size. Shift results "
    "(shift_<variant>.safetensors, from 'shift') print as one table, a row per file, read whole; positional "
    'studies (positional.safetensors) as their table. --csv prints any of them in long form.'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``show``'s options."""
    parser.add_argument("results", nargs="+", help="result files (any format version), one column each; or shift "
                                                   "results, one row each")
    add_shared_options(parser, "json", differ={"json": ({"help": "print the stored summaries as JSON instead of a table"},
                                                        "the whole stored summary and metadata of each file")})
    parser.add_argument("--csv", action="store_true",
                        help="print every file's numbers as one long table in CSV, a row per statistic and split (model, "
                             "layer group, layer, head) with its interval and the run's model, variant and run id: "
                             "the rows of to_dataframe(), which --json also gives under 'rows'")
    parser.add_argument("--explain", action="store_true",
                        help="under the shift results' table, a plain reading of each of its columns (what pair η² "
                             "is, the residual stream's unit, ...)")
    parser.add_argument("--verify", action="store_true",
                        help="also read every array and check it against the digest stored when the file was written "
                             "(a few MB hashed per default result file; see 'verify')")


def handle(args: argparse.Namespace) -> int:
    from ...records.container import file_kind, header_kind
    from ...result import ProbeResult
    from ...runs.positional import POSITIONAL_KIND
    from ...runs.study import BASELINES
    from ...runs.tables import summary_table
    from ...shift_result import SHIFT_KIND

    for path in args.results:
        file_kind(path)  # a file that cannot be read is named as such, whatever kind the others are
    if args.csv and args.json:
        raise InputError("show prints one form: pass --csv (the long table) or --json (the summaries and the same "
                         "rows), not both")
    if args.csv:
        return _show_rows(args)
    # Shift results and positional studies each print as their own table, never beside probe results.
    for kind, handler, plural, one in ((SHIFT_KIND, _show_shift, "shift results", "a shift result"),
                                       (POSITIONAL_KIND, _show_positional, "positional studies", "a positional study")):
        files = [path for path in args.results if header_kind(path) == kind]
        if files:
            if len(files) != len(args.results):
                others = [str(path) for path in args.results if path not in files]
                raise InputError(f"show puts {plural} and probe results in different tables; {others[0]!r} is not "
                                 f"{one}: show each kind on its own")
            return handler(args)
    results = {str(path): ProbeResult.load(path) for path in args.results}
    if args.verify:
        for result in results.values():
            result.verify()  # every array read and checked against its digest before anything is printed
    if args.json:
        print(json.dumps(jsonable({path: {"model": result.model_name, "variant": result.metadata.get("label"),
                                          "complete": result.complete, "integrity": result.integrity,
                                          "arrays_verified": args.verify, "metadata": result.metadata,
                                          "summary": result.summary(), "rows": result.to_rows()}
                                   for path, result in results.items()}), indent=1))
        print(verification_note(results, args.verify), file=sys.stderr)
        return 0
    # The study's order, whatever the shell's glob gave: the trained model first, then its baselines.
    def study_order(item: tuple[int, tuple[str, ProbeResult]]) -> tuple[int, int]:
        index, (_, result) = item
        label = result.metadata.get("label")
        return (0 if label == "trained" else 1 if label in BASELINES else 2, index)

    ordered = [pair for _, pair in sorted(enumerate(results.items()), key=study_order)]
    columns: dict[str, dict[str, Any]] = {}
    for path, result in ordered:
        label = str(result.metadata.get("label") or Path(path).name)
        label = label if label not in columns else f"{label} ({path})"
        summary = result.summary()
        if summary.get("n_windows", 0) == 0:
            raise InputError(f"{path} holds no windows (an empty result): there is nothing to show")
        columns[label] = summary
        state = "" if result.complete else " (PARTIAL: the run stopped before the end)"
        named = path if label == Path(path).name else f"{label} ({path})"
        print(f"{named}: model {result.model_name}, {summary['n_windows']} windows, log floor eps = "
              f"{result.log_floor:.3g}, excluded keys {list(result.excluded_keys) or 'none'}{state}")
    print("\nQuery-position R² over every visible entry (log scale: y = log max(a, eps)), with 95 % intervals over "
          "windows where the file has them\n")
    print(summary_table(columns, extended=True))
    print("\n" + verification_note(results, args.verify))
    return 0


def verification_note(results: dict[str, Any], verified: bool) -> str:
    """What ``show`` read of the files: their headers alone, or every array checked too."""
    older = [path for path, result in results.items() if result.integrity != "digests"]
    note = ("every array was read and matches its digest" if verified else
            "read from the headers alone: the arrays were not read or checked (--verify, or the 'verify' command, "
            "checks every array against its digest)")
    if older:
        note += (f"; unverified array by array: {', '.join(older)} "
                 f"{'was' if len(older) == 1 else 'were'} written before per-array digests"
                 + (" (a whole-file checksum, where the format has one, was checked instead)" if verified else ""))
    return note


def _show_positional(args: argparse.Namespace) -> int:
    """``show`` of positional studies (``positional.safetensors``): each file's table of analyses, read whole (its
    arrays checked against its checksum), or with ``--json`` the stored summaries."""
    from ...runs.positional import PositionalStudy

    studies = {str(path): PositionalStudy.load(path) for path in args.results}
    if args.json:
        print(json.dumps(jsonable({path: {"model": study.model_name, "metadata": study.metadata,
                                          "summary": study.summary(), "skipped": study.skipped,
                                          "rows": study.to_rows()}
                                   for path, study in studies.items()}), indent=1))
        return 0
    for path, study in studies.items():
        print(f"{path}: positional analyses of {study.model_name}\n")
        print(study.table() + "\n")
    return 0


def _show_shift(args: argparse.Namespace) -> int:
    """``show`` of shift results: one row per file, labelled ``<folder>/<variant>`` (the shift command writes
    ``shift_<variant>.safetensors``), as :func:`~equivariance_probe.runs.tables.shift_table`; every file is read
    whole, its arrays checked against its checksum."""
    from ...runs.tables import shift_column_readings, shift_table
    from ...shift_result import ShiftResult

    # The study's order whatever the shell's glob gave: folders as given, in each the trained model first.
    folder_of = {path: Path(path).resolve().parent for path in args.results}
    folders = list(dict.fromkeys(folder_of.values()))
    ordered = sorted(args.results, key=lambda path: (folders.index(folder_of[path]), Path(path).stem != "shift_trained"))
    summaries = {}
    for path in ordered:
        result = ShiftResult.load(path)
        label = f"{folder_of[path].name}/{Path(path).stem.removeprefix('shift_')}"
        dtype = result.metadata.get("model", {}).get("dtype")
        summaries[label if label not in summaries else str(path)] = {**result.summary(), "file": str(path),
                                                                     "dtype": dtype, "rows": result.to_rows()}
    if args.json:
        print(json.dumps(jsonable(summaries), indent=1))
        return 0
    for label, summary in summaries.items():
        state = "" if summary["complete"] else " (PARTIAL: the run stopped before the end)"
        print(f"{label}: {summary['file']}: model {summary['model']} ({summary['dtype']}), {summary['mode']} mode, "
              f"offsets {summary['offsets']}{state}")
    print("\nThe shift test: shares of the variance of the segment's centred attention logits and of its residual "
          "stream, with 95 % intervals over segments where the file has them\n")
    print(shift_table(summaries))
    if args.explain:
        print("\n" + shift_column_readings())
    else:
        print("\n(--explain gives a plain reading of each column)")
    return 0


def _show_rows(args: argparse.Namespace) -> int:
    """``show --csv``: every file's long-form rows (``to_rows()`` of its result, whatever its kind) as one CSV table."""
    from ...analyses.tidy import COLUMNS
    from ...records.container import header_kind
    from ...result import ProbeResult
    from ...runs.positional import POSITIONAL_KIND, PositionalStudy
    from ...runs.tables import csv_text
    from ...shift_result import SHIFT_KIND, ShiftResult

    rows = []
    for path in args.results:
        kind = header_kind(path)
        result = (ShiftResult.load(path) if kind == SHIFT_KIND else
                  PositionalStudy.load(path) if kind == POSITIONAL_KIND else ProbeResult.load(path))
        if args.verify and isinstance(result, ProbeResult):
            result.verify()
        rows += result.to_rows()
    sys.stdout.write(csv_text(rows) if rows else ",".join(COLUMNS) + "\n")
    return 0
