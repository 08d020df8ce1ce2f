"""Every Python block of the README runs as written, in order, in one namespace (as a notebook would),
and every example script runs as written.

The README's models are real (Gemma 3 270M, SmolLM2, Qwen2.5); here a tiny random Gemma 3 saved with
its tokenizer stands in for every packaged name that ``load_model`` (and the comparisons and scans
that load by name) is given, so the blocks run in seconds and test the API they show, not the
models. The packaged MiniLM encoder is small and runs as itself. The blocks that send work to
NDIF's public service cannot run offline; :data:`NOT_RUN` names them and why.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import equivariance_probe
from equivariance_probe.runs import compare, scan, study
from equivariance_probe.sources import models

README = Path(__file__).resolve().parent.parent / "README.md"

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


def test_the_readme_shows_python_blocks_and_names_every_one_it_does_not_run():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 8
    skipped = [line for line, code in blocks if any(marker in code for marker in NOT_RUN)]
    assert len(skipped) == len(NOT_RUN)  # every marker still names a block


@pytest.fixture
def stand_in_models(monkeypatch, tiny_model_folder):
    """Every packaged model name that the README's blocks load becomes a tiny Gemma 3 with its tokenizer."""
    folder = tiny_model_folder("gemma3", 4096)
    real = {name: getattr(models, name) for name in ("load_model", "load_config", "load_tokenizer")}

    def standing_in(name: str):
        original = real[name]

        def load(model_name, *args, **kwargs):
            return original(folder, *args, **kwargs)

        return load

    for module in (models, equivariance_probe, compare, scan, study):
        for name in real:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, standing_in(name))
    return folder


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs_as_written(stand_in_models, tmp_path, monkeypatch):
    from equivariance_probe.cli import main

    monkeypatch.chdir(tmp_path)  # the blocks write run.safetensors, heads.html, out/, scan_out/, pos/ where they run
    # The result-file block reads the study the README's command line wrote: a small one stands in.
    assert main(["run", "--out", "study_out", "--model", stand_in_models, "--n-docs", "4", "--context-length", "64",
                 "--baselines", "none", "--no-figures", "--no-progress", "--sample-size", "0"]) == 0
    namespace: dict = {"__name__": "readme"}
    ran = 0
    for line, code in python_blocks(README.read_text()):
        if any(marker in code for marker in NOT_RUN):
            continue
        try:
            exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - re-raised naming the block
            raise AssertionError(f"the README's Python block at line {line} does not run as written: "
                                 f"{type(error).__name__}: {error}") from error
        if ran == 0:
            notebook = dict(namespace)  # later blocks reuse these names for other models
        ran += 1
    assert ran == len(python_blocks(README.read_text())) - len(NOT_RUN)
    # What the notebook block promises, checked on what it built.
    merged = notebook["result"].merge(notebook["other"])
    assert merged.n_windows == notebook["result"].n_windows + notebook["other"].n_windows
    assert (tmp_path / "run.safetensors").exists() and (tmp_path / "heads.html").exists()


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
