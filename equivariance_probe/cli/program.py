"""The program itself: the parser built from the subcommand modules, and :func:`main`, which runs one.

Bad arguments exit with status 2 and a message that names the problem and the fix in this program's flags
(:func:`~equivariance_probe.cli.options.api_flags` tells :func:`~equivariance_probe.errors.option` how the API's
arguments are spelt here). A command that writes into an output folder holds that folder's lock while it runs;
SIGTERM stops a run before its next batch and exits with status 143 (128 + 15, what a shell reports for a process
the signal ended).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import EquivarianceProbeError, FileWriteError, StopRequested, command_line_options
from .commands import command_modules
from .common import HELD, checkpoint_note
from .options import HelpFormatter, add_shared_options, api_flags, declared_for

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``equivariance-probe``: one subcommand per module of :mod:`~equivariance_probe.cli.commands`."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="equivariance-probe", formatter_class=HelpFormatter,
        description="How much does attention depend on absolute position? Exact, streaming attention statistics.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in command_modules():
        summary = module.SUMMARY
        sub = commands.add_parser(module.NAME, help=summary, formatter_class=HelpFormatter,
                                  description=f"{summary[0].upper()}{summary[1:]}. {module.DETAILS}".strip())
        module.arguments(sub)
        taken = {action.dest for action in sub._actions}
        add_shared_options(sub, *[name for name in declared_for(module.NAME) if name not in taken])
        sub.set_defaults(handler=module.handle)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input or a file that cannot be written,
    130 interrupted, 143 stopped by SIGTERM)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with command_line_options(api_flags(parser)), _stop_on_sigterm(), contextlib.ExitStack() as held:
            token = HELD.set(held)
            if getattr(args, "threads", None) is not None:  # before any model loads or any tensor is computed
                from ..sources.devices import set_threads

                set_threads(args.threads)
            try:
                status = args.handler(args)
            finally:
                HELD.reset(token)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at the interpreter's exit
        return status
    except EquivarianceProbeError as error:
        if isinstance(error, FileWriteError) and args.command in ("run", "shift"):  # the checkpoint is intact: say how to go on
            error = f"{error}; {checkpoint_note(args)}"
        print(f"equivariance-probe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except StopRequested:
        print(f"equivariance-probe {args.command}: stopped by SIGTERM before the next batch; {checkpoint_note(args)}",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`show ... | head`): what it read is all it wanted. Point stdout at
        # /dev/null so that the interpreter's final flush does not raise again (Python's documented recipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


@contextlib.contextmanager
def _stop_on_sigterm():
    """While the command runs, SIGTERM (what Slurm and Kubernetes send before SIGKILL) asks every run
    to stop before its next batch (:data:`~equivariance_probe.progress.STOP_REQUESTED`), so that what the
    checkpoint holds is kept and the stop says how to resume; a second SIGTERM ends the process at once."""
    from ..progress import STOP_REQUESTED

    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def request_stop(signum: int, frame: Any) -> None:
        STOP_REQUESTED.set()
        signal.signal(signum, signal.SIG_DFL)

    previous = signal.signal(signal.SIGTERM, request_stop)
    try:
        yield
    finally:
        # None: the previous handler was not set from Python; the default is what Python starts with.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        STOP_REQUESTED.clear()
