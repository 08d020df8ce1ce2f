"""``equivariance-probe verify``: read every array of result files and check it against the digest stored when it was written."""

from __future__ import annotations

import argparse
import sys

from ...errors import EquivarianceProbeError

NAME = "verify"
#: Its place in ``equivariance-probe --help``.
ORDER = 40
SUMMARY = 'read every array of result files and check it against its digest'
DETAILS = (
    'Reads each file whole and refuses one whose data does not match the digest stored when it was written, '
    'naming the file and the array.'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``verify``'s options."""
    parser.add_argument("results", nargs="+", help="result files (any format version)")


def handle(args: argparse.Namespace) -> int:
    from ...result import ProbeResult

    failed = 0
    for path in args.results:
        try:
            integrity = ProbeResult.load(path).verify()
        except EquivarianceProbeError as error:
            print(f"equivariance-probe verify: error: {error}", file=sys.stderr)
            failed += 1
            continue
        print({"digests": f"{path}: every array matches its digest",
               "checksum": f"{path}: unverified array by array (written before per-array digests); its arrays match "
                           "its whole-file checksum",
               "unverified": f"{path}: unverified (format 1 holds no checksum to check against)"}[integrity])
    return 2 if failed else 0
