"""The command line as a package: one module per subcommand, found without a list, and the API-argument -> flag
table read from the parser itself."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from equivariance_probe.cli import FLAGS, build_parser
from equivariance_probe.cli import commands as commands_package
from equivariance_probe.cli.commands import DECLARED, command_modules
from equivariance_probe.cli.options import API_NAMES, api_flags


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_module_of_the_commands_package_is_a_subcommand_named_as_its_file():
    modules = command_modules()
    assert [module.__name__.rsplit(".", 1)[1] for module in modules] == [module.NAME for module in modules]
    assert list(_subparsers(build_parser())) == [module.NAME for module in modules]
    assert {"run", "merge", "show", "verify", "report", "compare", "scan", "positional", "shift"} <= {
        module.NAME for module in modules}


def test_a_new_module_is_a_new_subcommand_with_nothing_else_changed(monkeypatch):
    # A module put into the package (here through the import system, as a file would be found) is parsed and run.
    module = types.ModuleType(f"{commands_package.__name__}.hello")
    module.NAME, module.ORDER, module.SUMMARY, module.DETAILS = "hello", 1000, "say hello", ""
    module.arguments = lambda parser: parser.add_argument("--name", default="world")
    module.handle = lambda args: print(f"hello {args.name}") or 0
    import pkgutil

    found = list(pkgutil.iter_modules(commands_package.__path__))
    monkeypatch.setattr(pkgutil, "iter_modules",
                        lambda path: found + [pkgutil.ModuleInfo(None, "hello", False)])
    monkeypatch.setitem(sys.modules, module.__name__, module)
    from equivariance_probe.cli import main

    assert "hello" in _subparsers(build_parser())
    assert main(["hello", "--name", "there"]) == 0


def test_a_module_that_does_not_declare_a_subcommand_is_named(monkeypatch):
    import pkgutil

    broken = types.ModuleType(f"{commands_package.__name__}.broken")
    broken.NAME = "broken"
    found = list(pkgutil.iter_modules(commands_package.__path__))
    monkeypatch.setattr(pkgutil, "iter_modules", lambda path: found + [pkgutil.ModuleInfo(None, "broken", False)])
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    with pytest.raises(TypeError, match=r"broken.*does not declare \['ORDER'"):
        command_modules()
    assert DECLARED[0] == "NAME"


def test_the_flag_table_is_read_from_the_parser():
    parser = build_parser()
    flags = api_flags(parser)
    assert flags == FLAGS
    # Every flag of every subcommand, under its dest, spelt as the user types it (the longest spelling).
    for name, sub in _subparsers(parser).items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert flags[action.dest] in action.option_strings, (name, action.dest)
    # The API's arguments spelt otherwise name the flag that sets them.
    assert {api: flags[api] for api in API_NAMES} == {
        "source": "--corpus", "checkpoint_dir": "--out", "memory_limit": "--memory-limit-gib", "head": "--view-head",
        "format": "--figure-format", "name": "--model"}
    assert flags["out"] == "--out" and flags["framework"] == "--framework" and flags["baselines"] == "--baselines"


def test_a_new_shared_option_is_one_declaration(monkeypatch):
    from equivariance_probe.cli import options

    declared = options.shared_options()
    declared["demo_level"] = (("--demo-level",), {"type": int, "default": 3, "help": "a level (default %(default)s)",
                                                  "commands": ("run", "shift")})
    monkeypatch.setattr(options, "shared_options", lambda: declared)
    parser = build_parser()
    subs = _subparsers(parser)
    for name in ("run", "shift"):
        assert subs[name].parse_known_args(["--out", "x", "--demo-level", "5"])[0].demo_level == 5
    assert not any(action.dest == "demo_level" for action in subs["scan"]._actions)
    assert api_flags(parser)["demo_level"] == "--demo-level"
