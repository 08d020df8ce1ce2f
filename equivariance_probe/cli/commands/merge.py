"""``equivariance-probe merge``: add result files of shards of one study into one."""

from __future__ import annotations

import argparse
import sys

from ...errors import InputError
from ..common import print_result
from ..options import WHY, add_shared_options

NAME = "merge"
#: Its place in ``equivariance-probe --help``.
ORDER = 20
SUMMARY = 'merge result files of shards into one'
DETAILS = (
    'Reads and writes result files only: no model, corpus or progress bar.'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``merge``'s options."""
    add_shared_options(parser, "json")
    parser.add_argument("inputs", nargs="+", help="result files to merge (any format version)")
    parser.add_argument("-o", "--out", default=None,
                        help=f"the merged result file (required); {WHY}: a file, not a folder, since merge writes one result")
    parser.add_argument("--allow-duplicate-windows", action="store_true",
                        help="merge results that share windows (the same token ids), counting those windows twice "
                             "(default: refused, naming how many are shared)")


def handle(args: argparse.Namespace) -> int:
    from ...result import ProbeResult

    if args.out is None:
        raise InputError("merge needs the file to write: -o/--out merged.safetensors")
    results = [ProbeResult.load(path) for path in args.inputs]
    for result in results:
        result.statistics  # every input's arrays read and checksum-verified before anything is merged
    partial = [path for path, result in zip(args.inputs, results) if not result.complete]
    merged = results[0]
    for other in results[1:]:
        merged = merged.merge(other, allow_duplicate_windows=args.allow_duplicate_windows)
    output = merged.save(args.out)
    if partial:  # the numbers are exact sums of what was measured; the file says it is partial
        print(f"equivariance-probe merge: note: {', '.join(map(str, partial))} "
              f"{'is a partial result' if len(partial) == 1 else 'are partial results'} of a run that stopped, "
              "so the merged result is partial (complete: false)", file=sys.stderr)
    shards = merged.metadata.get("shards")
    missing = sorted(set(range(shards["count"])) - set(shards["indices"])) if shards else []
    note = f"; shards {missing} of {shards['count']} are still missing" if missing else ""
    table = f"merged {len(results)} results ({merged.n_windows} windows, {merged.n_tokens} tokens){note}"
    print_result(args, table, {"summary": merged.summary(), "missing_shards": missing}, [output])
    return 0
