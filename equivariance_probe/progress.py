"""Progress bars: one line on stderr per run, or tqdm's widget in a notebook.

Place in the seams: the bottom floor beside :mod:`~equivariance_probe.errors`, so that the probe and the
study runners draw the same bars (tqdm is imported when a bar is drawn).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

__all__ = ["progress_bar"]


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