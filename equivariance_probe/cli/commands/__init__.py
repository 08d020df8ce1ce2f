"""The subcommands, one module each.

A module here is a subcommand: it declares ``NAME``, ``ORDER`` (its place in ``--help``), ``SUMMARY`` (one line),
``DETAILS`` (what it leaves out, and why), ``arguments(parser)`` and ``handle(args) -> int`` (the exit status).
:func:`command_modules` finds them the way ``pkgutil`` finds a package's modules, so that adding a subcommand is
adding one module; nothing else lists them.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["command_modules", "DECLARED"]

#: What every subcommand module declares.
DECLARED = ("NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle")


def command_modules() -> list[ModuleType]:
    """Every subcommand module, in ``--help`` order (``ORDER``, then ``NAME``).

    Raises:
        TypeError: a module here lacks one of :data:`DECLARED` (a programming error, named with the module).
    """
    modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)
               if not info.name.startswith("_")]
    for module in modules:
        missing = [name for name in DECLARED if not hasattr(module, name)]
        if missing:
            raise TypeError(f"{module.__name__} is in the subcommands' package but does not declare {missing}")
    return sorted(modules, key=lambda module: (module.ORDER, module.NAME))
