"""Markup from data never reaches a page: every page and notebook view we produce, fed hostile strings (in a
crafted, re-signed result file, a positional study's stored values, a document's tokens, labels and titles),
parsed with a real HTML parser, has exactly the elements and attributes of the same page fed plain text;
no script element, event-handler attribute or ``javascript:`` URL comes from data, and every script ends
where it should. One page is also opened in headless Chromium, which must not run the data's script.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from crafted import HOSTILE, resign
from synthetic import SyntheticAdapter
from test_heads import built_heads

from equivariance_probe import EquivarianceProbe, ProbeResult, render_report
from equivariance_probe.analyses.positional import gram_toeplitz
from equivariance_probe.display.positional import render_positional_page, render_positional_section
from equivariance_probe.display.shift import ShiftView
from equivariance_probe.display.overview import BlockOverview
from equivariance_probe.display.views import HeadViews
from equivariance_probe.errors import ResultFileError
from equivariance_probe.markup import Markup, json_script
from equivariance_probe.runs.positional import PositionalStudy

PLAIN = [f"plain text {i}" for i in range(len(HOSTILE))]
HOSTILE_TEXT = " ".join(HOSTILE)


class Structure(HTMLParser):
    """Every start tag with its attribute names, every URL attribute's value, and each script's text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: Counter = Counter()
        self.handlers: list[tuple[str, str]] = []
        self.urls: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags[(tag, tuple(sorted(name for name, _ in attrs)))] += 1
        self.handlers += [(tag, name) for name, _ in attrs if name.lower().startswith("on")]
        self.urls += [value or "" for name, value in attrs if name.lower() in ("href", "src", "action", "formaction")]
        if tag == "script":
            self._in_script = True
            self.scripts.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def parse(page: str) -> Structure:
    parser = Structure()
    parser.feed(str(page))
    parser.close()
    return parser


def assert_inert(hostile_page: str, plain_page: str) -> None:
    """The page fed hostile strings has the same elements and attributes as the page fed plain text, no
    event handler or script URL, and no script that the data could keep from ending (``<!--`` / ``<script``
    inside a script put the browser's parser into its double-escaped state, where ``</script>`` no longer ends it)."""
    hostile, plain = parse(hostile_page), parse(plain_page)
    assert hostile.tags == plain.tags
    assert not hostile.handlers
    assert not [url for url in hostile.urls if url.strip().lower().startswith(("javascript:", "vbscript:"))]
    for text in hostile.scripts:  # data inside a script: only as JSON escapes, never as markup
        assert not [h for h in HOSTILE if "<" in h and h in text]
    assert "PWNED" in hostile_page  # the data is shown, as text


# -- a result file whose stored header strings carry markup ----------------------------------------------------
@pytest.fixture(scope="module")
def saved_result(tmp_path_factory):
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    result = EquivarianceProbe(adapter).run(tokens, progress=False)
    folder = tmp_path_factory.mktemp("hostile_result")
    return result.save(folder / "result.safetensors"), folder


def _crafted_result(saved, strings, name):
    path, folder = saved

    def edit(header):
        header["metadata"]["model"]["name"] = strings[0]
        header["metadata"]["label"] = strings[1]
        header["summary"]["most_position_bound_head"] = strings[2]
        header["summary"]["least_position_bound_head"] = strings[3]

    return resign(path, edit, out=folder / name)


def test_a_result_file_s_stored_strings_are_escaped_in_repr_html_and_the_report(saved_result):
    hostile = ProbeResult.load(_crafted_result(saved_result, HOSTILE, "hostile.safetensors"))
    plain = ProbeResult.load(_crafted_result(saved_result, PLAIN, "plain.safetensors"))
    assert isinstance(hostile._repr_html_(), Markup)
    assert_inert(hostile._repr_html_(), plain._repr_html_())
    assert "&lt;script&gt;window.PWNED=1&lt;/script&gt;" in hostile._repr_html_()
    assert_inert(str(render_report(hostile)), str(render_report(plain)))


# -- a positional study with markup in its stored values -------------------------------------------------------
def _study(strings, path):
    table = np.random.default_rng(0).normal(size=(8, 4))
    study = PositionalStudy(parts={"gram": gram_toeplitz(table)},
                            skipped={strings[0]: strings[1]}, metadata={"model": strings[2], "conventions": strings[3]})
    study.save(path)
    # A stored value of another type than the writer's (a number written as text) is shown as text, or refused.
    return resign(path, lambda header: header["parts"]["gram"].update(offset=strings[4]))


def test_a_positional_study_s_stored_values_are_escaped_in_its_page_and_report_section(tmp_path):
    hostile_path, plain_path = _study(HOSTILE, tmp_path / "h.safetensors"), _study(PLAIN, tmp_path / "p.safetensors")
    try:
        hostile = PositionalStudy.load(hostile_path)
    except ResultFileError as error:  # refused by name is as safe as escaped
        assert "offset" in str(error)
        return
    plain = PositionalStudy.load(plain_path)
    assert_inert(render_positional_page(hostile), render_positional_page(plain))
    assert_inert(render_positional_section(hostile), render_positional_section(plain))


# -- tokens, labels and titles in the CircuitsVis views ----------------------------------------------------------
def _head_views(strings):
    n = len(strings)
    pattern = np.tril(np.ones((n, n)))
    pattern /= pattern.sum(1, keepdims=True)
    return HeadViews(tokens=list(strings), heads=[(0, 0)], pattern=pattern[None], sliding_windows=[None], title=strings[0])


def _long_views(strings):
    # The views with an overview of the same positions in blocks of 2: each block's text is hover data.
    from dataclasses import replace

    from equivariance_probe.display.overview import block_edges, block_excerpts, block_sums, prior_block_sums

    views = _head_views(strings)
    edges = block_edges(len(strings), 2)
    overview = BlockOverview(heads=[(0, 0)], edges=edges, sums=block_sums(views.pattern[0], edges)[None],
                             prior_sums=prior_block_sums(edges, None)[None], excerpts=block_excerpts(strings, edges),
                             log_floor=1e-30, detail=(0, 4))
    return replace(views, overview=overview)


def _shift_view(strings):
    n = len(strings)
    return ShiftView(tokens=list(strings), head=(0, 1), offsets=(0, 9), conditional=np.zeros((2, n, n)),
                     centred=np.zeros((2, n, n)), entries=np.tril(np.ones((n, n))), title=strings[1])


@pytest.mark.parametrize("build", [_head_views, _long_views, _shift_view], ids=["head views", "long views", "shift view"])
def test_document_tokens_cannot_end_or_escape_the_view_s_script(build, tmp_path):
    hostile, plain = build(HOSTILE), build(PLAIN)
    assert_inert(hostile.to_html(), plain.to_html())
    assert_inert(hostile.body_html(), plain.body_html())
    assert_inert(hostile._repr_html_(), plain._repr_html_())
    hostile.save(tmp_path / "hostile.html")
    plain.save(tmp_path / "plain.html")
    assert_inert((tmp_path / "hostile.html").read_text(), (tmp_path / "plain.html").read_text())


def test_json_script_writes_no_character_that_the_html_parser_reads_inside_a_script():
    text = json_script({"tokens": HOSTILE})
    assert not set("<>&") & set(text)
    import json

    assert json.loads(text) == {"tokens": HOSTILE}
    page = Markup("<script>var data = {};</script><p>after</p>").format(text)
    assert parse(page).tags == Counter({("script", ()): 1, ("p", ()): 1})


def test_a_builder_escapes_whatever_it_is_not_told_is_markup():
    # The unescaped form needs an explicit Markup(...): a data string passed on is text.
    built = Markup("<td>{}</td>").format(HOSTILE[0]) + HOSTILE[1]
    assert parse(built).tags == Counter({("td", ()): 1})


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium; scripts/install.sh does it)")
@pytest.mark.parametrize("build", [_head_views, _long_views], ids=["head views", "long views"])
def test_headless_chromium_runs_no_script_from_a_view_s_tokens(tmp_path, build):
    # The page's own script writes a marker into the title when it runs to its end; the data's would set PWNED.
    views = build(HOSTILE)
    page = tmp_path / "page.html"
    page.write_text(Markup("<!DOCTYPE html><html><head><title>start</title></head><body>{}<script>"
                           "document.title = 'ended ' + (typeof window.PWNED === 'undefined' ? 'clean' : 'pwned');"
                           "</script></body></html>").format(views.to_html()))
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
               "--virtual-time-budget=5000", "--dump-dom", page.as_uri()]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=180).stdout
    assert "<title>ended clean</title>" in dom
    if views.overview is not None:  # drawn, with the hostile text as data
        assert '<div class="block-overview" data-drawn=' in dom and dom.count('class="block-overview-canvas"') == 2


# -- a shift result's stored model name ----------------------------------------------------------------------------
def _shift(strings):
    from equivariance_probe import ShiftResult
    from equivariance_probe.statistics.shift import ShiftConfig, ShiftStatistics

    config = ShiftConfig(n_layers=2, n_heads=2, offsets=(0, 8, 16), n_contexts=3, segment_length=4, interval_groups=2,
                         sliding_windows=(None, None), hidden_size=4)
    statistics = ShiftStatistics(config)
    for name, array in statistics.arrays.items():
        array[...] = {"count": 1.0, "total": 0.0, "cell_square": 0.0, "within": 100.0}.get(name.rsplit("/", 1)[-1], 1.0)
    statistics.segment_fingerprints = np.arange(4, dtype=np.uint64)
    return ShiftResult(statistics, {"model": {"name": strings[0]}, "study": {"model": strings[1]}})


def test_a_shift_result_s_model_name_is_escaped_in_its_notebook_view_and_report():
    from equivariance_probe.display.shift import render_shift_report

    hostile, plain = _shift(HOSTILE), _shift(PLAIN)
    assert_inert(hostile._repr_html_(), plain._repr_html_())
    assert_inert(str(render_shift_report(hostile)), str(render_shift_report(plain)))


def test_the_comparison_page_shows_labels_as_text_and_links_only_inside_its_folder():
    from equivariance_probe.display.comparison import comparison_page
    from equivariance_probe.runs.compare import model_folders
    from test_safe_writers import tiny_comparison

    def page(labels):
        folders = model_folders(labels)
        return comparison_page(tiny_comparison(labels), {label: f"models/{folders[label]}/report.html" for label in labels})

    hostile, plain = page(HOSTILE[:3]), page(PLAIN[:3])
    assert_inert(hostile, plain)
    assert all(url.startswith("models/") and ".." not in url for url in parse(hostile).urls if not url.startswith("data:"))
