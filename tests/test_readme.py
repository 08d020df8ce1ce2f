"""Every Python block of the README and of the documentation's pages runs as a notebook cell, in
order, in one real Jupyter kernel; each README block shows what it promises; every example
script runs as written.

The blocks are executed by nbclient in an ipykernel (``notebook_kernel``), so what is checked is
what a researcher who pastes a block into a cell sees: the last expression's display (a
ProbeResult table, an Interval, CircuitsVis views, the report), streams and widgets; stderr must
stay empty. The README's models are real (Gemma 3 270M, SmolLM2, Qwen2.5); here a tiny random
Gemma 3 saved with its tokenizer stands in for every packaged name that ``load_model`` (and the
comparisons and scans that load by name) is given, so the blocks run in seconds and test the API
they show, not the models. The packaged MiniLM encoder is small and runs as itself. The blocks
that send work to NDIF's public service cannot run offline; :data:`NOT_RUN` names them and why.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from equivariance_probe.runs import compare, scan, study
from equivariance_probe.sources import models

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: The pages whose blocks run after the README's, in the site's order (they use its names:
#: ``model``, ``tokenizer``, ``probe``, ``docs``, ``result``).
PAGES = [README, *(ROOT / "docs" / page for page in (
    "getting-started.md", "guide/studies.md", "guide/heads.md", "guide/comparisons.md", "guide/scans.md",
    "guide/positional.md", "guide/encoders.md", "guide/models.md", "guide/remote.md", "guide/long-runs.md",
    "guide/engine.md", "guide/cost.md"))]

#: Blocks that cannot run here, by a line they hold, and why.
NOT_RUN = {
    'TransformersModel("meta-llama/Llama-3.1-70B")': "a 70B model on NDIF's public service needs an API key and the "
    "internet; tests/test_ndif_server.py runs the same remote path against an NDIF server on this machine",
    "EquivarianceProbe(model, remote=True).run(Shard(i, n)": "remote shards on NDIF's public service (as above); "
    "tests/test_shards.py merges shards locally",
}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every fenced ```python block, in order."""
    return [(text[: match.start()].count("\n") + 2, match.group(1))
            for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)]


def runnable_blocks() -> list[tuple[str, int, str]]:
    """``(page, line, code)`` of every block that runs here, README first."""
    return [(page.relative_to(ROOT).as_posix(), line, code) for page in PAGES
            for line, code in python_blocks(page.read_text()) if not any(marker in code for marker in NOT_RUN)]


def test_the_pages_show_python_blocks_and_name_every_one_they_do_not_run():
    blocks = [code for page in PAGES for _, code in python_blocks(page.read_text())]
    assert len(python_blocks(README.read_text())) >= 6 and len(blocks) >= 14
    for marker in NOT_RUN:  # every marker still names a block
        assert any(marker in code for code in blocks), marker


@pytest.fixture
def stand_in_models(monkeypatch, tiny_model_folder):
    """Every packaged model name that the blocks load becomes a tiny Gemma 3 with its tokenizer (in this process)."""
    folder = tiny_model_folder("gemma3", 4096)
    real = {name: getattr(models, name) for name in ("load_model", "load_config", "load_tokenizer")}

    def standing_in(name: str):
        original = real[name]

        def load(model_name, *args, **kwargs):
            return original(folder, *args, **kwargs)

        return load

    import equivariance_probe

    for module in (models, equivariance_probe, compare, scan, study):
        for name in real:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, standing_in(name))
    return folder


@pytest.fixture(scope="module")
def cells(tiny_model_folder, tmp_path_factory):
    """Every runnable block executed as one cell of one notebook: ``[(page, line, cell)]`` and the folder it ran in."""
    from notebook_kernel import cells_notebook, execute, stand_in_setup

    from equivariance_probe.cli import main

    folder = tmp_path_factory.mktemp("readme")
    stand_in = tiny_model_folder("gemma3", 4096)
    # The result-file block reads the study the command line wrote: a small one stands in.
    assert main(["run", "--out", str(folder / "study_out"), "--model", stand_in, "--n-docs", "4",
                 "--context-length", "64", "--baselines", "none", "--no-figures", "--no-progress",
                 "--sample-size", "0"]) == 0
    blocks = runnable_blocks()
    notebook = execute(cells_notebook([stand_in_setup(stand_in)] + [code for _, _, code in blocks]), folder)
    return [(page, line, cell) for (page, line, _), cell in zip(blocks, notebook.cells[1:])], folder


@pytest.mark.slow
def test_every_block_runs_as_a_notebook_cell_without_an_error_or_stderr(cells):
    from notebook_kernel import errors, stderr

    ran, _ = cells
    assert len(ran) == len(runnable_blocks())
    for page, line, cell in ran:
        assert not errors(cell), f"{page}, the block at line {line} does not run as a cell: {errors(cell)}"
        assert not stderr(cell), f"{page}, the block at line {line} wrote to stderr:\n{stderr(cell)[:2000]}"


@pytest.mark.slow
def test_each_readme_block_shows_what_it_promises(cells):
    from notebook_kernel import PROBE_RESULT, result_shown, shown

    from equivariance_probe.display.circuitsvis import circuitsvis_bundle

    ran, folder = cells
    readme = [cell for page, _, cell in ran if page == "README.md"]
    first, numbers, difference, merged, views, report = readme
    assert PROBE_RESULT in shown(first) and "8 windows" in shown(first)
    assert re.match(r"Interval\(-?\d\.\d{4} \[.*\], 95% over \d+ groups of windows", result_shown(numbers))
    assert result_shown(difference).startswith("Interval(")
    assert PROBE_RESULT in shown(merged) and "12 windows" in shown(merged)
    bundle = circuitsvis_bundle()[:2000]
    assert "circuitsvis-view" in shown(views) and shown(views).count(bundle) == 1
    drawn = shown(report)
    assert 'class="equivariance-probe-report"' in drawn and drawn.count(bundle) == 1 and "<h2>Summary</h2>" in drawn
    assert len(result_shown(report)) < 200  # its text form is a one-line repr, never the page's source
    assert (folder / "run.safetensors").exists() and (folder / "report.html").exists()
    assert (folder / "heads.html").exists()  # written by the heads page's block


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script, arguments", [
    ("quickstart.py", ["--docs", "4", "--context-length", "64", "--out", "results/quickstart.safetensors"]),
    ("study.py", ["--out", "study_out", "--docs", "3", "--context-length", "32"]),
    ("remote_llama.py", ["--docs", "4", "--context", "32"]),  # without --remote: the same code on a local model
])
def test_every_example_script_runs_as_written(script, arguments, stand_in_models, tmp_path, monkeypatch, capsys):
    import runpy
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script, *arguments])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    printed = capsys.readouterr().out
    assert printed.strip()
    if script == "quickstart.py":
        assert (tmp_path / "results" / "quickstart.safetensors").exists()
        assert "equivariance-probe show results/quickstart.safetensors" in printed
    if script == "study.py":
        assert (tmp_path / "study_out" / "results.safetensors").exists()
