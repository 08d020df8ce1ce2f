"""The shift test's figures, CircuitsVis view and report section, drawn from real runs of a tiny model built from a
config: each figure shows the result's own numbers, the view shows the model's own attention, offline."""

import re

import numpy as np
import pytest
import torch

from synthetic import tiny_bert, tiny_gemma3
from test_shift import M, design, run

from equivariance_probe import EquivarianceProbe, random_init_like
from equivariance_probe.display.circuitsvis import circuitsvis_bundle
from equivariance_probe.display.report import render_report
from equivariance_probe.display.shift import (
    ShiftView,
    render_shift_report,
    shift_divergence_figure,
    shift_figures,
    shift_heads_figure,
    shift_layers_figure,
    shift_loss_figure,
    shift_report_section,
    shift_view,
)
from equivariance_probe.errors import InputError

EXTERNAL_URL = re.compile(r"""(src|href)\s*=\s*["']?\s*(https?:)?//|import\s*[^;]*from\s*["']https?:|url\(\s*["']?https?:""", re.I)


@pytest.fixture(scope="module")
def shift_run():
    """A float64 Gemma 3-shaped model (eager attention, so its own weights can be read back) and its random
    initialisation, on one grid of 4 segments in 4 interval groups."""
    model = tiny_gemma3().to(torch.float64)
    model.set_attn_implementation("eager")
    segments, contexts = design()
    trained = run(model, segments, contexts)
    baseline = run(random_init_like(model, seed=1), segments, contexts)
    return model, segments, contexts, {"trained": trained, "random_init": baseline}


def _error_bar_ends(container):
    """``(low, high)`` of each point of a matplotlib ErrorbarContainer's vertical bars."""
    segments = container.lines[2][0].get_segments()
    return np.array([s[0][1] for s in segments]), np.array([s[1][1] for s in segments])


def test_layers_figure_shows_each_variant_s_offset_share_by_layer_with_its_interval(shift_run):
    _, _, _, variants = shift_run
    fig = shift_layers_figure(variants)
    panels = fig.axes[:2]
    for ax, representation in zip(panels, ("centred_logits", "residual")):
        assert ax.get_xlabel() == "layer" and ax.get_ylabel() == "offset η²"
        assert [text.get_text() for text in ax.get_legend().get_texts()] == ["global layer", *variants]
        for container, result in zip(ax.containers, variants.values()):
            interval = result.share(representation, "offset", by="layer", interval=0.95)
            np.testing.assert_allclose(container.lines[0].get_ydata(), interval.estimate, rtol=1e-12)
            low, high = _error_bar_ends(container)
            np.testing.assert_allclose(low, interval.low, rtol=1e-9, atol=1e-15)
            np.testing.assert_allclose(high, interval.high, rtol=1e-9, atol=1e-15)
    # Layer 0 of a rotary model in float64 does not move with the offset (the run's built-in check).
    assert panels[0].containers[0].lines[0].get_ydata()[0] <= 1e-12
    # The global layers among the sliding ones are shaded.
    shaded = [patch for patch in panels[0].patches if patch.get_label() == "global layer"]
    assert len(shaded) == 1 and variants["trained"].layer_groups()["global"] == (2,)


def test_heads_figure_maps_the_offset_and_pair_shares_of_every_head(shift_run):
    _, _, _, variants = shift_run
    result = variants["trained"]
    fig = shift_heads_figure(result)
    images = [ax for ax in fig.axes if ax.images]
    assert len(images) == 2
    for ax, term in zip(images, ("offset", "pair")):
        np.testing.assert_array_equal(ax.images[0].get_array(), result.share("centred_logits", term, by="head"))
        assert ax.get_xlabel() == "head" and ax.get_ylabel() == "layer" and term in ax.get_title()


def test_loss_figure_is_the_loss_by_offset_with_its_interval(shift_run):
    _, _, _, variants = shift_run
    ax = shift_loss_figure(variants).axes[0]
    assert "offset" in ax.get_xlabel() and "loss" in ax.get_ylabel()
    for container, result in zip(ax.containers, variants.values()):
        interval = result.loss_by_offset(interval=0.95)
        np.testing.assert_array_equal(container.lines[0].get_xdata(), result.offsets)
        np.testing.assert_allclose(container.lines[0].get_ydata(), interval.estimate, rtol=1e-12)
        low, high = _error_bar_ends(container)
        np.testing.assert_allclose(low, interval.low, rtol=1e-9)
        np.testing.assert_allclose(high, interval.high, rtol=1e-9)


def test_divergence_figure_sets_moving_the_text_beside_changing_what_precedes_it(shift_run):
    _, _, _, variants = shift_run
    ax = shift_divergence_figure(variants).axes[0]
    heights = [patch.get_height() for patch in ax.patches]
    expected = [result.divergence(kind) for result in variants.values() for kind in ("offset", "context")]
    np.testing.assert_allclose(heights, expected, rtol=1e-12)
    labels = [tick.get_text() for tick in ax.get_xticklabels()]
    assert labels == [f"{name}\nratio {result.divergence('ratio', interval=0.95)}" for name, result in variants.items()]
    assert "Jensen–Shannon" in ax.get_ylabel()


def test_view_shows_the_model_s_own_attention_at_two_offsets(shift_run):
    model, segments, contexts, variants = shift_run
    result = variants["trained"]
    view = shift_view(model, segments, contexts, result=result, segment=1, context=2)
    shares = result.share("centred_logits", "offset", by="head")
    assert view.head == tuple(int(i) for i in np.unravel_index(np.nanargmax(shares), shares.shape))
    assert view.offsets == (result.offsets[0], result.offsets[-1])
    layer, head = view.head
    visible = view.entries
    for row, offset in enumerate(view.offsets):
        window = torch.tensor([contexts[2][:offset] + segments[1]])
        with torch.no_grad():
            weights = model(window, output_attentions=True).attentions[layer][0, head, -M:, -M:].numpy()
        block = np.where(visible, weights, 0.0)
        conditional = block / np.where(visible.any(-1, keepdims=True), block.sum(-1, keepdims=True), 1.0)
        # transformers' eager attention takes its softmax in float32 even for a float64 model.
        np.testing.assert_allclose(view.conditional[row], conditional, rtol=1e-5, atol=1e-7)
        log_weights = np.log(np.where(visible, weights, 1.0))
        rows = visible.sum(-1, keepdims=True)
        centred = np.where(visible, log_weights - np.where(visible, log_weights, 0).sum(-1, keepdims=True)
                           / np.maximum(rows, 1), 0.0)
        np.testing.assert_allclose(view.centred[row], centred, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(view.change, view.centred[1] - view.centred[0])
    with pytest.raises(InputError, match="two different offsets"):
        shift_view(model, segments, contexts, head=(0, 0), offsets=(7, 7), segment_length=M)
    with pytest.raises(InputError, match="no head to view"):
        shift_view(model, segments, contexts, offsets=(0, 7))
    with pytest.raises(InputError, match="L9H0 does not exist"):
        shift_view(model, segments, contexts, head="L9H0", offsets=(0, 7))


def test_view_html_is_offline_and_carries_the_bundle_once(shift_run, tmp_path):
    model, segments, contexts, variants = shift_run
    view = shift_view(EquivarianceProbe(model), segments, contexts, head="L1H2", offsets=(0, 30), segment_length=M)
    assert isinstance(view, ShiftView) and repr(view) == "ShiftView(L1H2; offsets 0 and 30; 10 tokens)"
    page = view.save(tmp_path / "view.html").read_text(encoding="utf-8")
    bundle = circuitsvis_bundle()
    assert page.count(bundle) == 1
    assert page.count("CircuitsVis.render(") - bundle.count("CircuitsVis.render(") == 5  # 2 + 3 side by side
    assert not EXTERNAL_URL.search(page.replace(bundle, ""))
    assert "L1H2 at offset 0" in page and "L1H2 at offset 30" in page and "L1H2 change from offset 0 to 30" in page
    assert page.count('<div style="display:flex') == 2
    assert bundle not in view.body_html()


def test_report_section_holds_every_figure_and_the_view_in_a_rendered_report(shift_run):
    model, segments, contexts, variants = shift_run
    view = shift_view(model, segments, contexts, result=variants["trained"])
    section = shift_report_section(variants["trained"], {"random_init": variants["random_init"]}, view=view)
    assert section.uses_circuitsvis
    assert set(shift_figures(variants["trained"])) == {"shift_layers", "shift_heads", "shift_loss", "shift_divergence",
                                                       "shift_sink", "shift_massive"}
    probe_result = EquivarianceProbe(model).run(torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(0)),
                                                progress=False)
    bundle = circuitsvis_bundle()
    for page in map(str, (render_report(probe_result, extra_sections=[section]),
                          render_shift_report(variants["trained"], {"random_init": variants["random_init"]}, view=view))):
        assert "<h2>The shift test: the same text moved through the window</h2>" in page
        assert page.count(bundle) == 1
        assert page.index(bundle) < page.index('class="shift-view"')  # drawn from the bundle in <head>
        assert not EXTERNAL_URL.search(page.replace(bundle, ""))
        assert "Offset η² by layer" in page and "Per-head offset η²" in page and "Next-token loss" in page
        assert "Jensen–Shannon divergence between offsets" in page and "<th>random_init</th>" in page
        assert "first key and on the rest of the text before the segment, by offset and layer group" in page
        assert "largest magnitude over its median" in page
        assert page.count('src="data:image/png;base64,') >= 6
        difference = variants["trained"].paired_difference(variants["random_init"], "centred_logits", "offset")
        assert "<th>trained − random_init</th>" in page and f"<td>{difference}</td>" in page
    assert bundle not in str(render_shift_report(variants["trained"]))  # no view: no bundle


def test_command_line_writes_the_figures_and_the_report_with_its_view(tiny_model_folder, text_corpus, tmp_path, capsys):
    from equivariance_probe.cli import main

    common = ["--model", tiny_model_folder("gemma3", n_positions=128), "--corpus", text_corpus(n_docs=6, words=60),
              "--n-segments", "3", "--n-contexts", "2", "--segment-length", "8", "--offsets", "0,5,20",
              "--interval-groups", "3", "--no-progress"]
    assert main(["shift", "-o", str(tmp_path / "a"), *common, "--baselines", "random_init", "--view-head", "L1H0"]) == 0
    wrote = capsys.readouterr().out
    for name in ("shift_layers.png", "shift_heads.png", "shift_loss.png", "shift_divergence.png", "shift_sink.png",
                 "shift_report.html"):
        assert (tmp_path / "a" / name).is_file() and name in wrote
    page = (tmp_path / "a" / "shift_report.html").read_text(encoding="utf-8")
    bundle = circuitsvis_bundle()
    assert page.count(bundle) == 1 and not EXTERNAL_URL.search(page.replace(bundle, ""))
    assert "<th>random_init</th>" in page and "L1H0 at offset 0" in page and "L1H0 at offset 20" in page
    assert main(["shift", "-o", str(tmp_path / "b"), *common, "--no-figures"]) == 0
    assert sorted(path.name for path in (tmp_path / "b").iterdir()) == ["shift_trained.safetensors"]


@pytest.mark.browser
def test_view_draws_offline_in_headless_chromium(shift_run, tmp_path):
    test_report_browser = pytest.importorskip("test_report_browser")
    if test_report_browser.CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; scripts/install.sh does it)")
    model, segments, contexts, variants = shift_run
    path = tmp_path / "shift_report.html"
    path.write_text(str(render_shift_report(variants["trained"], view=shift_view(model, segments, contexts,
                                                                                  result=variants["trained"]))))
    dom = test_report_browser.chromium(path, tmp_path / "profile", "--dump-dom").stdout
    # Five heat maps drawn (two offsets' weights; two offsets' centred logits and their change), one canvas each.
    assert len(re.findall(r"<canvas", dom)) == 5


def test_an_encoder_s_view_shows_the_whole_block_and_its_figures_omit_predictions():
    segments, contexts = design()
    model = tiny_bert()
    result = run(model, segments, contexts)
    # An encoder makes no next-token predictions; its rows still attend to the text before the segment.
    assert set(shift_figures(result)) == {"shift_layers", "shift_heads", "shift_sink", "shift_massive"}
    view = shift_view(model, segments, contexts, result=result)
    assert not view.causal and view.entries.all()  # every segment key is visible to every segment query
    np.testing.assert_allclose(view.conditional.sum(-1), 1.0, rtol=1e-6)
    assert '"maskUpperTri": false' in view.to_html()


def _drawn_lines(fig):
    """Every plotted line's y values, panel by panel (what two calls that draw the same thing share)."""
    return [[np.asarray(line.get_ydata(), dtype=float) for line in ax.lines] for ax in fig.axes]


@pytest.mark.parametrize("draw", [shift_layers_figure, shift_loss_figure, shift_divergence_figure])
def test_every_figure_of_variants_takes_a_result_and_its_baselines_or_one_mapping(shift_run, draw):
    _, _, _, variants = shift_run
    baselines = {"random_init": variants["random_init"]}
    together, apart = draw(variants), draw(variants["trained"], baselines)
    assert len(together.axes) == len(apart.axes)
    for mine, theirs in zip(_drawn_lines(together), _drawn_lines(apart)):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(InputError, match=rf"{draw.__name__} takes a ShiftResult and its baselines.*not both"):
        draw(variants, baselines)
    with pytest.raises(InputError, match=r"got \{'random_init': 'str'\}"):
        draw(variants["trained"], {"random_init": "shift_random_init.safetensors"})


def test_a_figure_of_one_result_refuses_a_mapping_of_variants_by_name(shift_run):
    _, _, _, variants = shift_run
    with pytest.raises(InputError, match=r"shift_heads_figure draws one ShiftResult, not dict.*variants\['trained'\]"):
        shift_heads_figure(variants)


@pytest.mark.parametrize("head, message", [
    ("L9H0", r"--view-head L9H0: .* has layers 0\.\.\d+ and heads 0\.\.\d+"),
    ("L1H0,L0H1", r"names 2 heads; the view shows one"),
    ("head one", r"cannot read the head 'head one'"),
])
def test_a_bad_view_head_is_refused_before_the_model_loads(tiny_model_folder, text_corpus, tmp_path, capsys,
                                                           monkeypatch, head, message):
    from equivariance_probe.cli import main
    from equivariance_probe.runs import shift as shift_runs

    loaded = []
    monkeypatch.setattr(shift_runs, "load_shift_model", lambda source: loaded.append(source))
    args = ["shift", "-o", str(tmp_path / "out"), "--model", tiny_model_folder("gemma3", n_positions=128),
            "--corpus", text_corpus(n_docs=6, words=60), "--view-head", head, "--no-progress"]
    assert main(args) == 2
    assert re.search(message, capsys.readouterr().err) and loaded == []
    assert main([*args[:-3], "--view-head", "L1H0", "--no-figures"]) == 2
    assert "--no-figures writes no report" in capsys.readouterr().err and loaded == []


def test_the_report_s_tables_are_html_with_the_largest_rows_first_and_the_rest_folded(shift_run):
    from equivariance_probe.display.shift_tables import shift_tables_html

    _, _, _, variants = shift_run
    page = str(render_shift_report(variants["trained"], {"random_init": variants["random_init"]}))
    assert "<pre>" not in page and page.count('<table class="shift">') >= 4
    html = str(shift_tables_html(variants, shown=4))
    by_layer = html[html.index("<h3>Offset η² by layer</h3>"):]
    by_layer = by_layer[:by_layer.index("<h3>", 4)]
    shown, folded = by_layer.split("<details>")
    assert "<summary>8 more rows</summary>" in folded  # 4 representations × 3 layers, 4 shown
    trained = variants["trained"]
    expected = sorted(((representation, layer, value) for representation in ("centred_logits", "conditional_weights",
                                                                             "raw_weights", "residual")
                       for layer, value in enumerate(trained.share(representation, "offset", by="layer"))),
                      key=lambda item: -abs(item[2]))
    cells = [float(cell) for cell in re.findall(r"<td>layer \d</td><td>([-0-9.]+)</td>", by_layer)]
    np.testing.assert_allclose(cells, [round(value, 4) for _, _, value in expected], atol=1e-4)
    assert len(re.findall(r"<td>layer \d</td>", shown)) == 4


def test_captions_say_intervals_only_where_the_figure_draws_them(shift_run):
    model, segments, contexts, variants = shift_run
    with_intervals = str(render_shift_report(variants["trained"]))
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", with_intervals)
    assert sum("bars: 95% intervals over segments" in caption for caption in captions) >= 3
    assert any("estimates: a heat map draws no intervals" in caption for caption in captions)
    one_group = run(model, segments[:1], contexts)
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", str(render_shift_report(one_group)))
    assert captions and not any("95%" in caption or "95 %" in caption for caption in captions)
    assert sum("no intervals: fewer than 2 groups of segments" in caption for caption in captions) >= 3


def test_a_figure_wider_than_the_page_scrolls_at_its_own_size_instead_of_shrinking():
    from equivariance_probe.display.report import html_page

    style = str(html_page("t", ""))
    assert "figure img{max-width:none}" in style and "overflow-x:auto" in style
