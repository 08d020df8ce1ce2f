"""Run code as notebook cells in a real Jupyter kernel, and read what each cell displayed.

Used by the notebook and README tests: nbclient (Jupyter's own runner) starts an ipykernel, so
what a cell shows is what a researcher's notebook shows (the last expression's rich display,
streams, widgets), not what ``exec`` of the same code would print.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient and ipykernel (the test extra)")

#: The ProbeResult table, a head ranking, a CircuitsVis view, the report: markers of their HTML.
PROBE_RESULT = "<b>ProbeResult</b>"
EXTERNAL_URL = re.compile(r"""<(script|link|img|iframe)[^>]*(src|href)\s*=\s*["']?(https?:)?//""", re.I)
WIDGET = "application/vnd.jupyter.widget-view+json"


def stand_in_setup(folder: str) -> str:
    """A first cell that makes every packaged model name load the tiny model saved in ``folder``.

    The notebooks and the README name the real models; on 2 CPU cores in CI a tiny random Gemma 3
    with its tokenizer stands in for each, so the cells test the API they show, in seconds.
    """
    return f"""
import equivariance_probe
from equivariance_probe.runs import compare, scan, study
from equivariance_probe.sources import models

def _standing_in(original):
    def load(model_name, *args, **kwargs):
        return original({folder!r}, *args, **kwargs)
    return load

for _name in ("load_model", "load_config", "load_tokenizer"):
    _original = getattr(models, _name)
    for _module in (models, equivariance_probe, compare, scan, study):
        if hasattr(_module, _name):
            setattr(_module, _name, _standing_in(_original))
"""


def execute(notebook: nbformat.NotebookNode, folder: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Execute ``notebook`` in a fresh kernel whose working folder is ``folder``; errors stay in the outputs."""
    client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(folder)}})
    client.execute()
    return notebook


def cells_notebook(sources: list[str]) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    return notebook


def errors(cell) -> list[str]:
    return [f"{o['ename']}: {o['evalue']}" for o in cell.get("outputs", []) if o["output_type"] == "error"]


def stderr(cell) -> str:
    return "".join(o["text"] for o in cell.get("outputs", []) if o["output_type"] == "stream" and o["name"] == "stderr")


def shown(cell, mime: str = "text/html") -> str:
    """What the cell displayed in ``mime`` (its result and any display calls), joined."""
    return "".join("".join(o.get("data", {}).get(mime, "")) for o in cell.get("outputs", [])
                   if o["output_type"] in ("execute_result", "display_data"))


def result_shown(cell, mime: str = "text/plain") -> str:
    """The cell's own result: what its last expression displays."""
    return "".join("".join(o["data"].get(mime, "")) for o in cell.get("outputs", []) if o["output_type"] == "execute_result")


def widgets(cell) -> int:
    return sum(WIDGET in o.get("data", {}) for o in cell.get("outputs", []) if o["output_type"] == "display_data")


def exported_page(notebook: nbformat.NotebookNode) -> str:
    """The notebook as a standalone HTML page (nbconvert's basic template: the cells and their
    outputs, without the CDN scripts of its full templates)."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="basic").from_notebook_node(notebook)
    return f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>notebook</title></head><body>{body}</body></html>'
