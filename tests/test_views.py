"""Head views: captured patterns, uniform prior and log-ratio against closed forms; offline HTML;
the report with views; the CLI's report --views."""

from __future__ import annotations

import re
import socket

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, FileWriteError, HeadViews, InputError, head_views
from equivariance_probe.display.report import ReportSection, render_report
from equivariance_probe.display.circuitsvis import circuitsvis_bundle
from equivariance_probe.markup import Markup
from equivariance_probe.display.views import (
    capture_head_patterns,
    log_ratio,
    parse_heads,
    prior_pattern,
)

from synthetic import SyntheticAdapter, causal_mask, save_tiny_model_with_tokenizer, uniform_pattern, write_text_corpus
from test_heads import POSITIONAL, PREVIOUS_TOKEN, built_heads

EPS = float(torch.finfo(torch.float32).tiny)
EXTERNAL_URL = re.compile(r"""(src|href)\s*=\s*["']?\s*(https?:)?//|import\s*[^;]*from\s*["']https?:|url\(\s*["']?https?:""", re.I)


@pytest.fixture(scope="module")
def probe_and_result():
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    probe = EquivarianceProbe(adapter)
    tokens = torch.randint(0, 1000, (6, 32), generator=torch.Generator().manual_seed(0))
    return probe, probe.run(tokens, keep_pattern=True, progress=False), tokens


def test_captured_patterns_are_the_models_for_the_chosen_heads_only(probe_and_result):
    probe, _, tokens = probe_and_result
    heads = [(1, 2), (0, 1), (0, 3)]
    got = capture_head_patterns(probe.adapter, tokens[0], heads)
    full = {layer: built_heads(layer, tokens[:1]) for layer in range(2)}
    assert got.shape == (3, 32, 32) and got.dtype == np.float64
    for index, (layer, head) in enumerate(heads):
        np.testing.assert_array_equal(got[index], full[layer][0, head].double().numpy())
    with pytest.raises(InputError, match="L2H0 does not exist"):
        capture_head_patterns(probe.adapter, tokens[0], [(2, 0)])


@pytest.mark.parametrize("window", [None, 5])
def test_prior_pattern_is_one_over_visible_keys_under_the_mask(window):
    n = 12
    expected = uniform_pattern(n, window).double().numpy()  # mask / row count, built independently
    np.testing.assert_allclose(prior_pattern(n, window), expected, rtol=1e-7)  # float32 reference
    q, k = 9, 3
    assert prior_pattern(n, window)[q, k] == (0.0 if window == 5 else 1 / 10)


def test_log_ratio_is_zero_for_a_uniform_head_and_log_q_plus_1_for_the_previous_token():
    n = 10
    prior = prior_pattern(n, None)
    visible = causal_mask(n).numpy()
    uniform = np.where(visible, 1.0 / (np.arange(n)[:, None] + 1.0), 0.0)
    np.testing.assert_allclose(log_ratio(uniform, prior, EPS), 0.0, atol=1e-14)
    previous = np.zeros((n, n))
    previous[0, 0] = 1.0
    previous[np.arange(1, n), np.arange(n - 1)] = 1.0
    ratio = log_ratio(previous, prior, EPS)
    for q in range(1, n):
        for k in range(n):
            expected = 0.0 if not visible[q, k] else np.log(q + 1) + (0.0 if k == q - 1 else np.log(EPS))
            assert ratio[q, k] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_default_heads_are_the_most_and_least_position_bound_and_windows_slice_exactly(probe_and_result):
    probe, result, tokens = probe_and_result
    views = head_views(probe, tokens[0], result=result, n_each=1, start=4, stop=20)
    assert isinstance(views, HeadViews) and views.heads == [POSITIONAL, PREVIOUS_TOKEN]
    assert views.tokens == [str(t) for t in tokens[0, 4:20].tolist()]  # no tokenizer: ids as text
    full = built_heads(0, tokens[:1])[0]
    np.testing.assert_array_equal(views.pattern[1], full[1, 4:20, 4:20].double().numpy())
    # the prior keeps absolute positions: row q of the window is 1/(q+1)
    prior = views.priors()[None]
    assert prior[0, 0] == pytest.approx(1 / 5) and prior[15, 3] == pytest.approx(1 / 20)
    np.testing.assert_allclose(views.log_ratios()[0][np.tril(np.ones((16, 16), bool))], 0.0, atol=1e-6)
    assert "rank 1, log_eta2 1.000" in views.scores[0]
    assert views.stop == 20 and "positions 4..19" in repr(views)


def test_a_window_wider_than_the_shown_positions_is_full_causal():
    pattern = np.stack([uniform_pattern(6).double().numpy(), uniform_pattern(6, 3).double().numpy()])
    views = HeadViews(tokens=list("abcdef"), heads=[(0, 0), (1, 0)], pattern=pattern, sliding_windows=[512, 3])
    priors = views.priors()
    assert list(priors) == [None, 3]  # window 512 >= 6 positions: the same mask as full causal
    np.testing.assert_allclose(views.log_ratios(), 0.0, atol=1e-6)  # each uniform head matches its own prior
    body = views.body_html()
    assert "uniform prior (full causal)" in body and "uniform prior (window 3)" in body and "window 512" not in body


def test_views_refuse_bad_requests(probe_and_result):
    probe, result, tokens = probe_and_result
    with pytest.raises(InputError, match="no heads to view"):
        head_views(probe, tokens[0])
    with pytest.raises(InputError, match="do not fit the document's 32 tokens"):
        head_views(probe, tokens[0], heads=[(0, 0)], start=10, stop=40)
    with pytest.raises(InputError, match="cannot be viewed"):
        head_views(probe, 3.5, heads=[(0, 0)])
    with pytest.raises(InputError, match="'L4X3'"):
        parse_heads("L4X3")
    assert parse_heads("L4H3, 5.1") == [(4, 3), (5, 1)]


def _numbers_in_calls(page: str) -> list[str]:
    calls = re.findall(r"CircuitsVis\.render\((.*?)\)\s*(?:</script>|\n)", page, flags=re.S)
    assert calls
    return re.findall(r"-?\d+\.\d+(?:e-?\d+)?", "".join(calls))


def test_view_html_is_offline_carries_the_bundle_once_and_rounds(probe_and_result, monkeypatch):
    probe, result, tokens = probe_and_result
    # Any network attempt fails the test: CircuitsVis' own _repr_html_ would try one.
    def no_network(*args, **kwargs):
        raise AssertionError("a view tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr("urllib.request.urlopen", no_network)
    views = head_views(probe, tokens[0], heads=[POSITIONAL, PREVIOUS_TOKEN, (1, 0)], result=result)
    page = views._repr_html_()
    bundle = circuitsvis_bundle()
    assert page.count(bundle) == 1 and page.count("CircuitsVis.render(") - bundle.count("CircuitsVis.render(") == 2
    assert not EXTERNAL_URL.search(page.replace(bundle, "")), "external URL in a view"
    assert "unpkg" not in page and "<script src" not in page
    numbers = _numbers_in_calls(page.replace(bundle, ""))
    assert max(len(n.split(".")[1]) for n in numbers) <= 3
    unrounded = views.to_html(decimals=None)
    assert max(len(n.split(".")[1]) for n in _numbers_in_calls(unrounded.replace(bundle, ""))) > 3
    assert len(unrounded) > len(page)


def test_tokens_cannot_close_the_script(probe_and_result):
    probe, _, _ = probe_and_result
    views = HeadViews(tokens=["</script><b>x", "y"], heads=[(0, 0)], pattern=np.array([[[1.0, 0.0], [0.5, 0.5]]]),
                      sliding_windows=[None])
    body = views.body_html()
    assert "</script><b>" not in body and "\\u003c/script\\u003e\\u003cb\\u003ex" in body


def test_report_holds_the_bundle_once_for_every_view_and_extra_sections(probe_and_result):
    probe, result, tokens = probe_and_result
    views = [head_views(probe, tokens[i], heads=[POSITIONAL, PREVIOUS_TOKEN], stop=16) for i in range(2)]
    extra = ReportSection("Positional analyses", Markup("<p id='extra'>more</p>"))
    page = str(render_report(result, views=views, extra_sections=[extra]))
    bundle = circuitsvis_bundle()
    assert page.count(bundle) == 1
    assert page.count("CircuitsVis.render(") - bundle.count("CircuitsVis.render(") == 4
    assert page.index(bundle) < page.index('class="circuitsvis-view"')  # drawn from the bundle in <head>
    titles = re.findall(r"<h2>(.*?)</h2>", page)
    assert titles == ["Summary", "Figures", "Heads ranked by how position-bound they are", "Attention sinks",
                      "Heads on one document (CircuitsVis)", "Positional analyses"]
    assert not EXTERNAL_URL.search(page.replace(bundle, ""))
    assert str(render_report(result, views=views[0])).count(bundle) == 1
    assert bundle not in str(render_report(result))  # no views: no bundle


def test_the_report_is_drawn_by_a_notebook_and_saved_by_a_script(probe_and_result, tmp_path):
    probe, result, tokens = probe_and_result
    views = head_views(probe, tokens[0], heads=[POSITIONAL, PREVIOUS_TOKEN], stop=16)
    report = render_report(result, views=views)
    page, drawn, bundle = str(report), report._repr_html_(), circuitsvis_bundle()
    # the page for a file; for a notebook the same sections and bundle in one <div> whose style is its own
    assert page.startswith("<!DOCTYPE html>") and drawn.startswith('<div class="equivariance-probe-report">')
    assert drawn.count(bundle) == 1 and 'class="circuitsvis-view"' in drawn and "<h2>Summary</h2>" in drawn
    assert "body{" not in drawn and "<html" not in drawn  # leaves the notebook page's own style alone
    assert report.save(tmp_path / "report.html").read_text(encoding="utf-8") == page
    assert "MB" in repr(report) and len(repr(report)) < 200  # a cell never prints megabytes of source
    with pytest.raises(FileWriteError, match="does not exist"):
        report.save(tmp_path / "missing" / "report.html")


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    from equivariance_probe.cli import main

    # The study folder holds its model and corpus: a test moves it and reloads both from there.
    root = tmp_path_factory.mktemp("views_cli")
    model = save_tiny_model_with_tokenizer(root / "model", kind="gemma3", n_positions=64)
    corpus = write_text_corpus(root / "corpus", n_docs=3, words=60)
    assert main(["run", "--out", str(root / "out"), "--model", model, "--corpus", corpus, "--n-docs", "2",
                 "--context-length", "32", "--baselines", "none", "--no-progress", "--sample-size", "100"]) == 0
    return root


def test_report_views_reload_the_model_and_document_of_the_study(tiny_study, capsys):
    from equivariance_probe import ProbeResult
    from equivariance_probe.cli import main

    results = tiny_study / "out" / "results.safetensors"
    assert ProbeResult.load(results).metadata["study"]["corpus"] == str(tiny_study / "corpus")
    output = tiny_study / "with_views.html"
    assert main(["report", str(results), "--views", "--heads", "L2H1,L0H0", "--stop", "20", "-o", str(output)]) == 0
    assert "views of L2H1, L0H0 on document 0" in capsys.readouterr().out
    page = output.read_text()
    bundle = circuitsvis_bundle()
    assert page.count(bundle) == 1 and "L2H1 attention" in page and "uniform prior (window 8)" in page
    assert "uniform prior (full causal)" in page  # L2 is Gemma 3's global layer, L0 a sliding one
    assert "\\u003cbos\\u003e" in page  # tokens come from the model's tokenizer (JSON-escaped inside the script)


def test_report_without_a_loadable_model_is_written_without_views(tiny_study, tmp_path, capsys):
    from equivariance_probe import ProbeResult
    from equivariance_probe.cli import main

    result = ProbeResult.load(tiny_study / "out" / "results.safetensors")
    result.metadata["study"]["model"] = str(tmp_path / "gone")
    result.metadata["model"]["name"] = str(tmp_path / "gone")
    moved = result.save(tmp_path / "results.safetensors")
    assert main(["report", str(moved), "--views"]) == 0
    assert "writing the report without views" in capsys.readouterr().err
    page = (tmp_path / "report.html").read_text()
    assert "Heads ranked" in page and circuitsvis_bundle() not in page
    assert main(["report", str(moved), "--views", "--heads", "nonsense"]) == 2


@pytest.mark.parametrize("backend", ["transformer_lens", "nnsight"])
def test_views_are_the_same_through_every_adapter(tiny_study, backend):
    from equivariance_probe import load_model

    folder = str(tiny_study / "model")
    text = "the a of and to in is was for on as with by at from that which"
    hf_model, hf_tokenizer = load_model(folder)
    reference = head_views(hf_model, text, tokenizer=hf_tokenizer, heads="L0H1,L2H3")
    model, tokenizer = load_model(folder, framework=backend)
    views = head_views(model, text, tokenizer=tokenizer, heads="L0H1,L2H3")
    assert views.tokens == reference.tokens and views.sliding_windows == reference.sliding_windows == [8, None]
    np.testing.assert_allclose(views.pattern, reference.pattern, atol=1e-6)
