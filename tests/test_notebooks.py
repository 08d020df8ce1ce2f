"""The example notebooks run in a real Jupyter kernel, quietly, and show what they promise.

Each notebook of ``examples/`` is executed by nbclient in an ipykernel, from a copy, with the
packaged model names standing in for a tiny random Gemma 3 (``notebook_kernel.stand_in_setup``;
the remote notebook's model is already a tiny local nnsight model). The committed notebooks are
executed on the real models (``scripts/execute_notebooks.py``) and shown by the documentation site.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat
import pytest

from notebook_kernel import (EXTERNAL_URL, PROBE_RESULT, errors, execute, exported_page, result_shown, shown,
                             stand_in_setup, stderr, widgets)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, folder: Path, stand_in: str | None) -> nbformat.NotebookNode:
    notebook = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    executed = copy.deepcopy(notebook)
    for cell in executed.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    if stand_in is not None:
        executed.cells.insert(0, nbformat.v4.new_code_cell(stand_in_setup(stand_in)))
    execute(executed, folder)
    if stand_in is not None:
        executed.cells.pop(0)
    return executed


@pytest.fixture(scope="module")
def executed(tiny_model_folder, tmp_path_factory):
    """Each example notebook, executed once in its own kernel (built on first use)."""
    done: dict[str, nbformat.NotebookNode] = {}

    def notebook(name: str) -> nbformat.NotebookNode:
        if name not in done:
            stand_in = None if name == "remote" else tiny_model_folder("gemma3", 4096)
            done[name] = run_example(name, tmp_path_factory.mktemp(name), stand_in)
        return done[name]

    return notebook


def code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("name", ["quickstart", "heads", "compare", "remote"])
def test_every_cell_runs_without_an_error_a_warning_or_progress_lines(executed, name):
    for index, cell in enumerate(code_cells(executed(name))):
        assert not errors(cell), f"{name}.ipynb cell {index}: {errors(cell)}"
        assert not stderr(cell), f"{name}.ipynb cell {index} wrote to stderr:\n{stderr(cell)[:2000]}"


def test_the_committed_notebooks_are_executed_and_hold_no_progress_widget_or_stderr():
    for path in sorted(EXAMPLES.glob("*.ipynb")):
        cells = code_cells(nbformat.read(path, as_version=4))
        assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1)), f"run {path.name} top to bottom"
        assert not any(errors(cell) or stderr(cell) or widgets(cell) for cell in cells), path.name


def test_the_quickstart_shows_the_result_its_interval_and_a_figure(executed):
    cells = code_cells(executed("quickstart"))
    assert PROBE_RESULT in shown(cells[0]) and "<table" in shown(cells[0])
    assert re.match(r"Interval\(-?\d\.\d{4} \[", result_shown(cells[1]))
    assert sum("image/png" in o.get("data", {}) for o in cells[2].outputs) == 1  # drawn once
    assert result_shown(cells[3]).startswith("Interval(")  # trained minus random init
    assert PROBE_RESULT in shown(cells[4])
    pytest.importorskip("ipywidgets")
    assert widgets(cells[0]) == 1  # one widget bar, no stderr lines


def test_the_heads_notebook_shows_the_ranking_and_offline_views_with_one_bundle(executed):
    from equivariance_probe.display.circuitsvis import circuitsvis_bundle

    notebook = executed("heads")
    html = "".join(shown(cell) for cell in code_cells(notebook))
    assert "head-ranking" in html and "<table" in html
    assert "circuitsvis-view" in html and html.count(circuitsvis_bundle()[:2000]) == 1
    assert not EXTERNAL_URL.search(html) and "unpkg.com" not in html


def test_the_comparison_shows_its_table_figure_and_rows(executed):
    cells = code_cells(executed("compare"))
    assert "Comparison" in result_shown(cells[0])
    assert "| " in result_shown(cells[1], "text/markdown")
    assert sum("image/png" in o.get("data", {}) for o in cells[2].outputs) == 1
    assert "<table" in shown(cells[3])


def test_the_remote_notebook_runs_the_same_code_on_a_local_nnsight_model(executed):
    cells = code_cells(executed("remote"))
    assert "nnsight" in result_shown(cells[1])
    assert PROBE_RESULT in shown(cells[2])
    assert result_shown(cells[3]).startswith("(16, ")


@pytest.mark.browser
def test_the_exported_heads_notebook_draws_its_views_offline(executed, tmp_path):
    from test_report_browser import CHROMIUM, RENDERED, chromium

    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; scripts/install.sh does it)")
    page = tmp_path / "heads.html"
    page.write_text(exported_page(executed("heads")), encoding="utf-8")
    assert not EXTERNAL_URL.search(page.read_text(encoding="utf-8"))
    dom = chromium(page, tmp_path / "profile", "--dump-dom").stdout
    assert dom.count(RENDERED) == 2, "the exported notebook's CircuitsVis views did not draw offline"
