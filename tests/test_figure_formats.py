"""Figures for papers: every figure as PNG, SVG and PDF, each file opened by a reader of its format,
with the text carried in the file (SVG glyphs as paths, PDF fonts embedded) so that it looks the
same on a machine without matplotlib's fonts."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

from equivariance_probe import EquivarianceProbe, InputError
from equivariance_probe.cli import main
from equivariance_probe.display.figures import figure_formats, save_figures, study_figures

from synthetic import tiny_gpt2

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def result():
    tokens = torch.randint(3, 90, (3, 16), generator=torch.Generator().manual_seed(0))
    return EquivarianceProbe(tiny_gpt2(0)).run(tokens, progress=False, sample_size=200)


def open_png(path: Path) -> tuple[int, int]:
    """Its size in pixels, decoded by matplotlib's PNG reader."""
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    return image.shape[0], image.shape[1]


def open_svg(path: Path) -> ElementTree.Element:
    """The parsed document: an ``<svg>`` whose text is drawn as paths (no ``<text>`` left to a font)."""
    root = ElementTree.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    assert not list(root.iter(f"{SVG}text")), f"{path.name} leaves text to the viewer's fonts"
    assert len(list(root.iter(f"{SVG}path"))) > 10
    return root


def open_pdf(path: Path, tmp_path: Path) -> int:
    """Its page count, read by a PDF reader: poppler's pdftoppm (rendering page 1) where installed, else
    pypdf where installed, else this file's own reading of the cross-reference table (every object at
    the offset the table gives). Its fonts are embedded TrueType, no Type 3."""
    data = path.read_bytes()
    assert data.startswith(b"%PDF-1.") and data.rstrip().endswith(b"%%EOF")
    assert b"/FontFile2" in data and b"/Type3" not in data, f"{path.name}: fonts not embedded as TrueType"
    if shutil.which("pdftoppm"):
        subprocess.run(["pdftoppm", "-png", "-r", "20", "-f", "1", "-l", "1", str(path), str(tmp_path / "page")],
                       check=True, capture_output=True)
        open_png(next(tmp_path.glob("page*.png")))
        return 1
    if importlib.util.find_spec("pypdf") is not None:
        import pypdf

        return len(pypdf.PdfReader(path).pages)
    start = int(re.search(rb"startxref\s+(\d+)\s+%%EOF\s*$", data).group(1))
    table = re.match(rb"xref\s+0 (\d+)\s+((?:\d{10} \d{5} [nf]\s*\r?\n?)+)", data[start:])
    assert table is not None, "no cross-reference table where startxref points"
    entries = re.findall(rb"(\d{10}) (\d{5}) ([nf])", table.group(2))
    assert len(entries) == int(table.group(1))
    for number, (offset, _generation, kind) in enumerate(entries):
        if kind == b"n":
            assert re.match(rb"%d 0 obj" % number, data[int(offset):]), f"object {number} is not at {int(offset)}"
    return len(re.findall(rb"/Type\s*/Page\b", data))


def test_every_study_figure_is_written_and_opens_as_png_svg_and_pdf(result, tmp_path):
    figures = study_figures(result)
    paths = save_figures(figures, tmp_path, prefix="x_", format="png,svg,pdf")
    assert [path.name for path in paths] == [f"x_{name}.{kind}" for name in figures for kind in ("png", "svg", "pdf")]
    for path in paths:
        if path.suffix == ".png":
            assert open_png(path) > (100, 100)
        elif path.suffix == ".svg":
            open_svg(path)
        else:
            assert open_pdf(path, tmp_path) == 1


def test_the_same_figure_gives_the_same_svg_and_pdf_bytes(result, tmp_path):
    """No creation date or random ids: a figure redrawn from the same result is the same file."""
    for folder in ("a", "b"):
        save_figures({"heatmaps": study_figures(result)["heatmaps"]}, tmp_path / folder, format=["svg", "pdf"])
    for name in ("heatmaps.svg", "heatmaps.pdf"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_formats_are_named_once_in_order_and_an_unknown_one_is_refused():
    assert figure_formats("pdf, PNG,pdf") == ("pdf", "png")
    assert figure_formats([".svg"]) == ("svg",)
    with pytest.raises(InputError, match=r"figure format 'png,gif' is not one of png, svg, pdf; pass for example "
                                         r"format='png,svg,pdf'"):
        figure_formats("png,gif")
    with pytest.raises(InputError, match="is not one of"):
        figure_formats("")


def test_the_command_line_writes_each_figure_in_each_format_and_refuses_an_unknown_one_before_loading(
        tiny_model_folder, text_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--out", str(out), "--model", tiny_model_folder("gpt2", 64), "--corpus",
                 text_corpus(n_docs=3, words=40), "--n-docs", "3", "--context-length", "16", "--baselines", "zero",
                 "--no-progress", "--sample-size", "100", "--interval-groups", "0", "--figure-format", "svg,pdf"]) == 0
    printed = capsys.readouterr().out
    for name in ("persistence", "head_curves", "fit_by_key", "scatter", "heatmaps", "baseline_zero_heatmaps"):
        open_svg(out / f"{name}.svg")
        assert open_pdf(out / f"{name}.pdf", tmp_path) == 1
        assert not (out / f"{name}.png").exists() and str(out / f"{name}.pdf") in printed
    with pytest.raises(SystemExit) as caught:
        main(["run", "--out", str(tmp_path / "bad"), "--model", "no-such-model", "--figure-format", "png,eps"])
    assert caught.value.code == 2
    assert "figure format 'png,eps' is not one of png, svg, pdf; pass for example --figure-format png,svg,pdf" in \
        capsys.readouterr().err
