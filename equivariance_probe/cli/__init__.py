"""The command-line program ``equivariance-probe``.

Place in the seams: the top floor, argparse only. Each subcommand is one module of
:mod:`~equivariance_probe.cli.commands` that composes a run (:mod:`equivariance_probe.runs`) with its display
(:mod:`equivariance_probe.display`), prints a short human summary (a table; ``--json`` prints the numbers for
machines instead) and says which files it wrote; ``equivariance-probe --help`` lists them with their one-line
summaries. The options that several subcommands take are declared once (:mod:`~equivariance_probe.cli.options`);
what several commands do alike (lock the output folder, read the corpus, print) is in
:mod:`~equivariance_probe.cli.common`; :mod:`~equivariance_probe.cli.program` builds the parser and runs a command.
"""

from __future__ import annotations

from typing import Any

from .options import WHY, HelpFormatter, add_shared_options, api_flags, shared_options
from .program import build_parser, main

__all__ = ["main", "build_parser", "shared_options", "add_shared_options", "HelpFormatter", "FLAGS", "WHY", "api_flags"]


def __getattr__(name: str) -> Any:
    """``FLAGS``: API argument -> the flag that sets it, read from the parser (:func:`api_flags`) when asked for,
    so that importing the program builds no parser."""
    if name == "FLAGS":
        return api_flags(build_parser())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
