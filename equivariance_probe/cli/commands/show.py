"""``equivariance-probe show``: the headline numbers of result files, read from their headers (no array is loaded;
``--verify`` reads every array and checks it against its digest); shift results and positional studies as their own tables,
and ``--csv`` any of them in long form."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

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
    add_shared_options(parser, "sink_epsilon", differ={"sink_epsilon": ({}, (
        "probe results' sink rates in the table and --json; another threshold than the stored one reads the arrays"))})
    parser.add_argument("--verify", action="store_true",
                        help="also read every array and check it against the digest stored when the file was written "
                             "(a few MB hashed per default result file; see 'verify')")


def handle(args: argparse.Namespace) -> int:
    """``show``: every file's result, loaded by its kind and printed by one path over the
    :class:`~equivariance_probe.analyses.results.Result` protocol (``model_name``, ``complete``, ``metadata``,
    ``summary()``, ``to_rows()``); what differs by kind (how its files are labelled and ordered, what its table
    of several files looks like) is declared in :func:`_shown_kinds`."""
    from ...analyses.tidy import COLUMNS
    from ...records.container import file_kind, header_kind
    from ...runs.tables import csv_text

    for path in args.results:
        file_kind(path)  # a file that cannot be read is named as such, whatever kind the others are
    if args.csv and args.json:
        raise InputError("show prints one form: pass --csv (the long table) or --json (the summaries and the same "
                         "rows), not both")
    kinds = _shown_kinds([str(path) for path in args.results])
    found = {str(path): kind if kind in kinds else None for path, kind in
             ((path, header_kind(path)) for path in args.results)}
    if args.csv:  # every file's long-form rows, whatever its kind, as one CSV table
        rows = [row for path, kind in found.items() for row in _loaded(kinds[kind], path, args.verify).to_rows()]
        sys.stdout.write(csv_text(rows) if rows else ",".join(COLUMNS) + "\n")
        return 0
    # Shift results and positional studies each print as their own table, never beside another kind.
    kind = next((kind for kind in found.values() if kind is not None), None)
    shown = kinds[kind]
    others = [path for path, other in found.items() if other != kind]
    if others:
        raise InputError(f"show puts {shown.plural} and probe results in different tables; {others[0]!r} is not "
                         f"{shown.one}: show each kind on its own")
    loaded = [(path, _loaded(shown, path, args.verify)) for path in found]
    results: dict[str, tuple[str, Any]] = {}
    for index, (path, result) in sorted(enumerate(loaded), key=lambda item: shown.order(*item[1], item[0])):
        label = shown.label(path, result)
        results[label if label not in results else shown.again(label, path)] = (path, result)
    summaries = {label: _summary(result, args.sink_epsilon) for label, (path, result) in results.items()}
    if args.json:
        print(json.dumps(jsonable({shown.key(label, path): {
            **(summaries[label] if shown.flat else {}), "model": result.model_name, "complete": result.complete,
            "metadata": result.metadata, "summary": summaries[label], "rows": result.to_rows(),
            **shown.record(path, result, args)} for label, (path, result) in results.items()}), indent=1))
        if shown.note:
            print(shown.note(dict(results.values()), args.verify), file=sys.stderr)
        return 0
    for label, (path, result) in results.items():
        summary = summaries[label]
        if summary.get("n_windows", summary.get("n_segments")) == 0:
            raise InputError(f"{path} holds no {'windows' if 'n_windows' in summary else 'segments'} (an empty "
                             "result): there is nothing to show")
        summaries[label] = {**summary, **shown.record(path, result, args)}
        state = "" if result.complete else " (PARTIAL: the run stopped before the end)"
        print(shown.heading(label, path, result, summaries[label]) + state)
    if shown.table:
        print(shown.table(summaries, args))
    if shown.note:
        print("\n" + shown.note(dict(results.values()), args.verify))
    return 0


class _Shown(NamedTuple):
    """How ``show`` prints one kind of result file (everything else it does alike for every kind)."""

    load: Callable[[str], Any]
    plural: str
    one: str
    #: The sort key of a file: its path, its result and its place on the command line.
    order: Callable[[str, Any, int], Any]
    #: A file's label (the table's column or row), that of a second file with the same label, and its JSON key.
    label: Callable[[str, Any], str]
    again: Callable[[str, str], str]
    key: Callable[[str, str], str]
    #: What a file's JSON record and table summary hold besides what every result has.
    record: Callable[[str, Any, argparse.Namespace], dict[str, Any]]
    #: Whether a file's JSON record also holds its summary's numbers at its top level.
    flat: bool
    #: The line of one file before the table.
    heading: Callable[[str, str, Any, dict[str, Any]], str]
    #: The table of every file's summary (by label), or None.
    table: Callable[[dict[str, dict[str, Any]], argparse.Namespace], str] | None = None
    #: What was read of the files (results by path, whether --verify was given), or None.
    note: Callable[[dict[str, Any], bool], str] | None = None


def _summary(result: Any, epsilon: float) -> dict[str, Any]:
    """A result's summary; a probe result's with its sink rates at ``epsilon``."""
    from ...result import ProbeResult

    return result.summary(epsilon=epsilon) if isinstance(result, ProbeResult) else result.summary()


def _loaded(shown: _Shown, path: str, verify: bool) -> Any:
    """The result in ``path``; with ``--verify``, a lazily read one's arrays read and checked against their digests
    first (shift results and positional studies are read whole, their arrays checked, on load)."""
    result = shown.load(path)
    if verify and hasattr(result, "verify"):
        result.verify()
    return result


def _shown_kinds(paths: list[str]) -> dict[str | None, _Shown]:
    """What ``show`` prints of each kind of file given (``paths``), by the kind its header names (``None``: a
    probe result, including files written before headers named their kind)."""
    from ...result import ProbeResult
    from ...runs.positional import POSITIONAL_KIND, PositionalStudy
    from ...runs.study import BASELINES
    from ...runs.tables import shift_column_readings, shift_table, summary_table
    from ...shift_result import SHIFT_KIND, ShiftResult

    def probe_order(path: str, result: Any, index: int) -> tuple[int, int]:
        # The study's order, whatever the shell's glob gave: the trained model first, then its baselines.
        label = result.metadata.get("label")
        return (0 if label == "trained" else 1 if label in BASELINES else 2, index)

    def probe_heading(label: str, path: str, result: Any, summary: dict[str, Any]) -> str:
        named = path if label == Path(path).name else f"{label} ({path})"
        return (f"{named}: model {result.model_name}, {summary['n_windows']} windows, log floor eps = "
                f"{result.log_floor:.3g}, excluded keys {list(result.excluded_keys) or 'none'}")

    def probe_table(summaries: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
        return ("\nQuery-position R² over every visible entry (log scale: y = log max(a, eps)), with 95 % intervals "
                f"over windows where the file has them\n\n{summary_table(summaries, extended=True)}")

    def shift_table_text(summaries: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
        explain = "\n" + shift_column_readings() if args.explain else "\n(--explain gives a plain reading of each column)"
        return ("\nThe shift test: shares of the variance of the segment's centred attention logits and of its residual "
                f"stream, with 95 % intervals over segments where the file has them\n\n{shift_table(summaries)}\n"
                + explain)

    # Shift results: folders in the order given, in each the trained model first; labelled <folder>/<variant> (the
    # shift command writes shift_<variant>.safetensors).
    folder = {path: Path(path).resolve().parent for path in paths}
    folders = list(dict.fromkeys(folder.values()))
    return {
        None: _Shown(
            load=ProbeResult.load, plural="probe results", one="a probe result", order=probe_order,
            label=lambda path, result: str(result.metadata.get("label") or Path(path).name),
            again=lambda label, path: f"{label} ({path})", key=lambda label, path: path,
            record=lambda path, result, args: {"variant": result.metadata.get("label"), "integrity": result.integrity,
                                               "arrays_verified": args.verify}, flat=False,
            heading=probe_heading, table=probe_table, note=verification_note),
        SHIFT_KIND: _Shown(
            load=ShiftResult.load, plural="shift results", one="a shift result",
            order=lambda path, result, index: (folders.index(folder[path]), Path(path).stem != "shift_trained"),
            label=lambda path, result: f"{folder[path].name}/{Path(path).stem.removeprefix('shift_')}",
            again=lambda label, path: path, key=lambda label, path: label,
            # The summary's numbers also at the record's top level, where the shift results' JSON has them.
            record=lambda path, result, args: {"file": path, "dtype": result.metadata.get("model", {}).get("dtype")},
            flat=True,
            heading=lambda label, path, result, summary: (
                f"{label}: {path}: model {result.model_name} ({summary['dtype']}), {summary['mode']} mode, offsets "
                f"{summary['offsets']}"),
            table=shift_table_text),
        POSITIONAL_KIND: _Shown(
            load=PositionalStudy.load, plural="positional studies", one="a positional study",
            order=lambda path, result, index: index, label=lambda path, result: path,
            again=lambda label, path: path, key=lambda label, path: path,
            record=lambda path, result, args: {"skipped": result.skipped}, flat=False,
            heading=lambda label, path, result, summary: (
                f"{path}: positional analyses of {result.model_name}\n\n{result.table()}\n")),
    }


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
