"""examples/heads.ipynb is committed executed, small, and offline (tests/test_notebooks.py also runs it in a kernel)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from equivariance_probe.display.circuitsvis import circuitsvis_bundle

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "heads.ipynb"


def test_heads_notebook_is_executed_with_one_offline_bundle():
    notebook = json.loads(NOTEBOOK.read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1)), "run the notebook top to bottom"
    outputs = [output for cell in code for output in cell["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    html = "".join("".join(o.get("data", {}).get("text/html", "")) for o in outputs)
    assert "head-ranking" in html and "circuitsvis-view" in html and "<table" in html
    # the views carry CircuitsVis' inline bundle once; nothing loads from a CDN
    assert html.count(circuitsvis_bundle()[:2000]) == 1
    assert "unpkg.com" not in html and not re.search(r"""(src|href)\s*=\s*["']?https?://""", html)
    assert NOTEBOOK.stat().st_size < 3_000_000
