"""Progress bars: what they count, which bar a notebook gets, and ``progress=False`` everywhere."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from equivariance_probe import EquivarianceProbe, PackedWindows
from equivariance_probe.probe import _bar_class, counted, progress_bar

from synthetic import SyntheticAdapter, uniform_pattern


def test_a_bar_counts_documents_for_texts_and_windows_for_token_rows():
    tokens = torch.zeros(3, 8, dtype=torch.long)
    packed = object.__new__(PackedWindows)  # what it is, not what it holds, decides
    assert counted(["a text", "another"]) == "documents"
    assert counted(tokens) == counted(packed) == "windows"


def kernel(monkeypatch, widgets: bool) -> None:
    """This process as seen from inside a Jupyter kernel, with or without ipywidgets."""
    shell = types.SimpleNamespace(config={"IPKernelApp": {}})
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    if not widgets:
        monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails, as where it is not installed


def test_a_kernel_without_ipywidgets_gets_one_plain_bar_and_no_warning(monkeypatch, capsys):
    from tqdm.std import tqdm

    kernel(monkeypatch, widgets=False)
    assert _bar_class() is tqdm
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tqdm.auto's "IProgress not found" TqdmWarning would fail here
        bar = progress_bar(True, 4, "windows", "windows")
        for _ in range(4):
            bar.update(1)
        bar.close()
    drawn = capsys.readouterr().err
    assert "4/4" in drawn and " window" in drawn and "IProgress" not in drawn
    assert drawn.count("100%") == 1  # the last step drawn once


def test_a_kernel_with_ipywidgets_gets_the_widget_bar(monkeypatch):
    pytest.importorskip("ipywidgets")
    from tqdm.notebook import tqdm

    kernel(monkeypatch, widgets=True)
    assert _bar_class() is tqdm


def test_outside_a_kernel_the_bar_is_plain():
    from tqdm.std import tqdm

    assert _bar_class() is tqdm


def test_progress_false_prints_nothing(capsys):
    def uniform(layer, tokens):
        return uniform_pattern(tokens.shape[1]).expand(tokens.shape[0], 2, -1, -1)

    probe = EquivarianceProbe(SyntheticAdapter(uniform, n_layers=1, n_heads=2, max_context=16))
    probe.run(torch.randint(0, 100, (3, 8)), progress=False)
    assert capsys.readouterr() == ("", "")
    probe.run(torch.randint(0, 100, (3, 8)))
    assert "windows" in capsys.readouterr().err
