"""The house keeps its shape: layers import only downwards, and the code speaks of itself.

The layers and the framework rules are import-linter contracts in ``pyproject.toml``
(``[tool.importlinter]``); this test runs them, so a change that imports upwards, closes an
import circle (function-level imports included) or names a framework outside its layer fails CI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "equivariance_probe"


def test_import_linter_contracts_are_kept(capsys):
    cli = pytest.importorskip("importlinter.cli")
    status = cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert status == 0, report
    assert "0 broken" in report


def test_every_floor_is_a_contract():
    """Each folder of the package (and each top-level module) is named in the layers contract."""
    config = (ROOT / "pyproject.toml").read_text()
    layers = config.split('type = "layers"', 1)[1].split("]", 1)[0]
    parts = {path.stem for path in PACKAGE.iterdir() if (path.is_dir() and (path / "__init__.py").exists())
             or (path.suffix == ".py" and path.stem != "__init__")}
    missing = sorted(part for part in parts if f"equivariance_probe.{part}" not in layers)
    assert not missing, f"not in any layer of the import-linter contract: {missing}"


def test_the_code_speaks_of_itself_not_of_its_issues():
    """Docstrings and comments say what a thing is and why; a tracker's numbers mean nothing to a reader."""
    mentions = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"issue [0-9]", line, flags=re.IGNORECASE)
    ]
    assert not mentions, mentions


def test_no_hook_is_registered_outside_the_adapters():
    """Only the adapters bind sites: everything above them reads a model through a plan (adapters/plan.py)."""
    registering = re.compile(r"\.register_(?:full_backward_|forward_|module_forward_)\w*hook\w*\(|\brun_with_hooks\(|"
                             r"\.add_hook\(|\.hooks\(")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in PACKAGE.rglob("*.py") if "adapters" not in path.relative_to(PACKAGE).parts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if registering.search(line)
    ]
    assert not found, found
