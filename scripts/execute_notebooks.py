"""Execute the example notebooks in place, in a Jupyter kernel, on the real packaged models.

    python scripts/execute_notebooks.py                    # every examples/*.ipynb
    python scripts/execute_notebooks.py examples/heads.ipynb

The committed notebooks are what the documentation site shows. They are executed with nbclient
(Jupyter's own runner, as ``jupyter execute``), then the progress bars' widget outputs are
removed: a saved page cannot draw a widget, and its text fallback is the bar as first drawn, at
0 %. ``tests/test_notebooks.py`` executes the same notebooks on tiny stand-in models in CI and
checks their outputs, the widget bars included.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WIDGET = "application/vnd.jupyter.widget-view+json"


def is_progress_widget(output: dict) -> bool:
    """A display of tqdm's widget bar (its only rich form is the widget view)."""
    return output.get("output_type") == "display_data" and WIDGET in output.get("data", {})


def execute(path: Path, timeout: int = 1200) -> float:
    """Run ``path`` top to bottom in a fresh kernel started in ``examples/``; seconds taken."""
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", store_widget_state=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if not is_progress_widget(output)]
    notebook.metadata.pop("widgets", None)
    nbformat.write(notebook, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(str(p) for p in EXAMPLES.glob("*.ipynb")):
        print(f"{name}: {execute(Path(name)):.0f} s", flush=True)
