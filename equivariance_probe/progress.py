"""How a measuring loop reports and stops: progress bars (one line on stderr per run, or tqdm's widget in a
notebook), the stop a scheduler asks for, and the scaffold that keeps what a stopped loop measured.

Place in the seams: the bottom floor beside :mod:`~equivariance_probe.errors`, so that the probe and the
study runners draw the same bars and stop alike (tqdm is imported when a bar is drawn).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .errors import StopRequested

__all__ = ["progress_bar", "STOP_REQUESTED", "keeping_partial"]

#: Set from outside (the command line sets it on SIGTERM) to stop every run before its next batch:
#: the run raises :class:`~equivariance_probe.errors.StopRequested`, its complete batches kept as
#: the exception's ``partial_result``. A batch is never cut half-way, and a scheduler's grace period
#: (30 s by default in Slurm and Kubernetes) is spent finishing one batch, not a checkpoint's chunk.
STOP_REQUESTED = threading.Event()


def _stop_if_requested() -> None:
    if STOP_REQUESTED.is_set():
        raise StopRequested("a stop was requested (SIGTERM): stopped before the next batch")

@contextlib.contextmanager
def keeping_partial(result: Any, bar: Any = None, *, on_stop: Callable[[], None] | None = None,
                    always: Callable[[], None] | None = None) -> Iterator[Any]:
    """The scaffold of every measuring loop (``run``, ``shift`` and the study runners above them): whatever stops
    the loop (the package's own error, an interrupt, a SIGTERM's stop, an OSError from a document generator, a
    ValueError from a user's hook), what was measured so far is kept, marked partial, and handed to the caller as
    the exception's ``partial_result``, so nothing computed is lost and nothing claims to be complete.

    Args:
        result: the result the loop adds to (its ``metadata["complete"]`` becomes ``False`` on a stop).
        bar: a progress bar, closed however the loop ends.
        on_stop: what the loop records when it stops (before the result is handed over).
        always: what the loop records however it ends.
    """
    try:
        yield result
    except BaseException as error:
        if on_stop is not None:
            on_stop()
        result.metadata["complete"] = False
        with contextlib.suppress(AttributeError, TypeError):  # exceptions with __slots__ take no attribute
            error.partial_result = result  # type: ignore[attr-defined]
        raise
    finally:
        if bar is not None:
            bar.close()
        if always is not None:
            always()



class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _FinishOnce:
    """A tqdm bar whose last step is drawn by ``close()`` alone: tqdm draws the step that reaches the
    total and then draws it again when closed, which a log (stderr not a terminal) shows as two lines
    at 100 %."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def update(self, n: int = 1) -> None:
        if self.bar.total is not None and self.bar.n + n >= self.bar.total:
            self.bar.n += n  # drawn once, by close()
        else:
            self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _bar_class() -> Any:
    """tqdm's widget bar inside a Jupyter kernel where ipywidgets is installed, else its plain bar.

    ``tqdm.auto`` picks the widget bar in every kernel and, without ipywidgets, warns
    ("IProgress not found") before falling back; choosing here gives the same bars without the
    warning.
    """
    shell = None
    if "IPython" in sys.modules:
        with contextlib.suppress(Exception):
            shell = sys.modules["IPython"].get_ipython()
    if shell is not None and "IPKernelApp" in getattr(shell, "config", {}):
        try:
            import ipywidgets  # noqa: F401 - only asks whether the widget bar can draw
        except ImportError:
            pass
        else:
            from tqdm.notebook import tqdm as widget_bar

            return widget_bar
    from tqdm.std import tqdm as plain_bar

    return plain_bar


def progress_bar(enabled: bool, total: int | None, description: str = "documents", unit: str = "documents") -> Any:
    """A progress bar over ``total`` items, drawn at 100 % once, or one that shows nothing when not ``enabled``.

    Args:
        enabled: ``False`` shows nothing.
        total: the number of items (``None``: unknown, the bar counts without a percentage).
        description: what is measured (a study's variant: ``"trained: documents"``).
        unit: what one step counts, in the plural (``"documents"`` or ``"windows"``, :func:`counted`).

    In a Jupyter kernel the bar is tqdm's widget where ipywidgets is installed, otherwise one plain
    line on stderr.
    """
    if not enabled:
        return _NoProgress()
    singular = unit[:-1] if unit.endswith("s") else unit
    return _FinishOnce(_bar_class()(total=total, desc=description, unit=f" {singular}"))