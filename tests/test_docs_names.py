"""The documentation names only what exists.

Every name the README, the documentation pages, the example notebooks and scripts, and the package's
own docstrings give as ``from equivariance_probe(.module) import X`` or as a dotted
``equivariance_probe.X.Y`` resolves; and every method that a docstring or page calls on one of the
objects the package returns, under the name the documentation always gives it (``result.x(``,
``probe.x(``, ``views.x(``...), is a member of that object's class.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import equivariance_probe as package

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
SCRIPTS = sorted((ROOT / "examples").glob("*.py"))
SOURCES = sorted((ROOT / "equivariance_probe").rglob("*.py"))

#: The names the documentation gives the objects it calls methods on, and the classes they may be.
OBJECTS = {
    "result": ("ProbeResult", "ShiftResult"),
    "probe": ("EquivarianceProbe",),
    "views": ("HeadViews",),
    "report": ("RenderedReport",),
    "comparison": ("Comparison",),
    "scan": ("ContextScan",),
    "ranking": ("HeadRanking",),
}


def _docstrings(path: Path) -> str:
    """Every docstring of a module (module, classes, functions), joined."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = [tree, *(node for node in ast.walk(tree)
                     if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    return "\n".join(ast.get_docstring(node) or "" for node in nodes)


def _notebook_text(path: Path) -> str:
    return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text(encoding="utf-8"))["cells"])


def documents() -> dict[str, str]:
    """What the documentation says, by where it says it."""
    texts = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in PAGES + SCRIPTS}
    texts.update({str(path.relative_to(ROOT)): _notebook_text(path) for path in NOTEBOOKS})
    texts.update({f"docstrings of {path.relative_to(ROOT)}": _docstrings(path) for path in SOURCES})
    return texts


def imported_names(text: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from equivariance_probe[.module] import a, b as c, (d, e)``: ``a``, ``b``, ``d``, ``e``."""
    found = []
    for module, names in re.findall(r"from (equivariance_probe(?:\.\w+)*) import (\([^)]*\)|[^\n#]+)", text):
        for item in names.strip().strip("()").split(","):
            name = item.split("#")[0].split()[0] if item.split("#")[0].split() else ""
            if re.fullmatch(r"[A-Za-z_]\w*", name):
                found.append((module, name))
    return found


def resolves(dotted: str) -> bool:
    """Whether ``equivariance_probe.a.b.c`` names a module or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(found, part):  # a dataclass's field without a default is no class attribute
                fields = getattr(found, "__dataclass_fields__", {})
                return part == parts[-1] and part in fields
            found = getattr(found, part)
        return True
    return False


def test_every_imported_name_exists():
    texts = documents()
    missing = sorted({f"{where}: from {module} import {name}" for where, text in texts.items()
                      for module, name in imported_names(text) if not resolves(f"{module}.{name}")})
    assert len([1 for text in texts.values() if imported_names(text)]) > 20
    assert not missing, missing


def test_every_dotted_name_exists():
    texts = documents()
    named = {(where, match) for where, text in texts.items()
             for match in re.findall(r"(?<![\w/.-])equivariance_probe(?:\.[A-Za-z_]\w*)+", text)}
    missing = sorted(f"{where}: {name}" for where, name in named
                     if not resolves(name.rstrip(".")) and not name.endswith((".py", ".md")))
    assert len(named) > 50
    assert not missing, missing


def test_every_method_called_on_a_documented_object_exists():
    classes = {variable: [getattr(package, name) for name in names] for variable, names in OBJECTS.items()}
    texts = documents()
    calls = {(where, variable, method) for where, text in texts.items()
             for variable, method in re.findall(r"(?<![\w.])(" + "|".join(OBJECTS) + r")\.([A-Za-z_]\w*)\(", text)}
    missing = sorted(f"{where}: {variable}.{method}(" for where, variable, method in calls
                     if not any(hasattr(cls, method) for cls in classes[variable]))
    assert len(calls) > 40
    assert not missing, missing


@pytest.mark.parametrize("text, names", [
    ("from equivariance_probe import (\n    EquivarianceProbe,\n    load_model as lm,\n)", ["EquivarianceProbe", "load_model"]),
    ("from equivariance_probe.cli import main  # the program", ["main"]),
])
def test_imports_are_read_as_python_reads_them(text, names):
    assert [name for _, name in imported_names(text)] == names


def test_a_name_that_does_not_exist_is_caught():
    assert not resolves("equivariance_probe.sources.shift_grid.no_such_function")
    assert not resolves("equivariance_probe.no_such_module")
    assert resolves("equivariance_probe.runs.tables.shift_table") and resolves("equivariance_probe.ProbeResult.summary")
    assert not hasattr(package.ProbeResult, "to_html")  # what head_views' docstring once pointed to


#: Where the figure and page functions live: every one a guide names is part of the package's public API.
DISPLAY = ROOT / "equivariance_probe" / "display"


def display_functions() -> set[str]:
    """The public functions and classes defined at the top level of the display modules."""
    names = set()
    for path in DISPLAY.glob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                names.add(node.name)
    return names


def named_in_code(text: str, names: set[str]) -> set[str]:
    """Which of ``names`` a page writes as code (between backticks or in a code block), bare or called, and not as
    an attribute of something else (``result.x`` is a method)."""
    code = "\n".join(re.findall(r"```.*?```", text, re.S) + re.findall(r"`([^`\n]+)`", text))
    return {name for name in re.findall(r"(?<![\w.])([A-Za-z_]\w*)", code) if name in names}


def test_every_figure_function_a_guide_names_is_exported_and_listed():
    functions = display_functions()
    listing = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    named = {(path.relative_to(ROOT), name) for path in PAGES
             for name in named_in_code(path.read_text(encoding="utf-8"), functions)}
    assert {name for _, name in named} >= {"shift_layers_figure", "shift_attribution_figure", "render_report"}
    missing = sorted(f"{where}: {name}" for where, name in named
                     if name not in package.__all__ or f"::: equivariance_probe.{name}\n" not in listing)
    assert not missing, f"named in the guides but not exported from equivariance_probe and in the API reference: {missing}"


def test_a_guide_naming_a_function_the_package_does_not_export_is_caught():
    text = "Draw it with `shift_layers_figure(variants)` or with `views_body_html(...)`; `result.table()` is a method."
    named = named_in_code(text, display_functions())
    assert named == {"shift_layers_figure", "views_body_html"}
    assert "views_body_html" not in package.__all__
