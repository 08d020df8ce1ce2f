"""Views of long windows: the block overview's sums against brute-force numpy sums and the uniform prior's
closed form, the detail range against the full pattern, a page whose size does not grow with the window,
bad requests refused, and the command line's report --views --overview on a tiny model from a config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe import BlockOverview, EquivarianceProbe, InputError, head_views
from equivariance_probe.display.overview import (
    DEFAULT_OVERVIEW_BLOCKS,
    block_edges,
    block_excerpts,
    block_sums,
    capture_head_blocks,
    prior_block_sums,
)
from equivariance_probe.display.views import prior_pattern

from synthetic import SyntheticAdapter
from test_heads import POSITIONAL, PREVIOUS_TOKEN, built_heads
from test_views import tiny_study  # noqa: F401  (the fixture: a study of a tiny Gemma 3 saved with its model)

N = 100
HEADS = [POSITIONAL, PREVIOUS_TOKEN, (1, 2)]


def brute_block_sums(pattern: np.ndarray, edges: np.ndarray) -> np.ndarray:
    cells = range(len(edges) - 1)
    return np.array([[pattern[edges[i]:edges[i + 1], edges[j]:edges[j + 1]].sum() for j in cells] for i in cells])


@pytest.fixture(scope="module")
def probe_and_tokens():
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=4 * N)
    tokens = torch.randint(0, 1000, (N,), generator=torch.Generator().manual_seed(0))
    return EquivarianceProbe(adapter), tokens


@pytest.mark.parametrize("block_size", [7, 10, 1, N])
def test_block_sums_and_averages_are_numpy_s_over_every_cell_and_the_detail_is_the_pattern_s_slice(
        probe_and_tokens, block_size):
    probe, tokens = probe_and_tokens
    views = head_views(probe, tokens, heads=HEADS, overview=True, start=30, stop=55, block_size=block_size)
    overview = views.overview
    edges = np.append(np.arange(0, N, block_size), N)
    np.testing.assert_array_equal(overview.edges, edges)  # the last block is shorter where B does not divide T
    full = {layer: built_heads(layer, tokens[None]).double().numpy()[0] for layer in range(2)}
    for index, (layer, head) in enumerate(HEADS):
        pattern = full[layer][head]
        sums = brute_block_sums(pattern, edges)
        np.testing.assert_allclose(overview.sums[index], sums, rtol=1e-12, atol=1e-13)
        sizes = np.diff(edges)
        np.testing.assert_allclose(overview.mean()[index], sums / np.outer(sizes, sizes), rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(views.pattern[index], pattern[30:55, 30:55])  # the detail: bitwise the slice
    np.testing.assert_allclose(overview.share().sum(-1), 1.0, rtol=1e-6)  # float32 rows: every query's attention
    # The detail range is the plain views' own numbers, tokens and all.
    plain = head_views(probe, tokens, heads=HEADS, start=30, stop=55)
    np.testing.assert_array_equal(views.pattern, plain.pattern)
    assert views.tokens == plain.tokens and views.overview is not None and plain.overview is None


def test_block_sums_stream_query_rows_in_steps_and_keep_the_pattern_s_sums(monkeypatch):
    from equivariance_probe.display import overview as module

    pattern = torch.rand(203, 203, generator=torch.Generator().manual_seed(1))
    edges = block_edges(203, 9)
    once = block_sums(pattern, edges)
    monkeypatch.setattr(module, "_ENTRIES_PER_STEP", 1)  # one block of query rows per step
    np.testing.assert_allclose(block_sums(pattern, edges), once, rtol=1e-12)
    np.testing.assert_allclose(once, brute_block_sums(pattern.double().numpy(), edges), rtol=1e-12)


@pytest.mark.parametrize("window", [None, 5, 16])
@pytest.mark.parametrize("block_size", [1, 6, 13])
def test_the_prior_s_block_sums_have_the_closed_form_of_the_uniform_pattern(window, block_size):
    edges = block_edges(50, block_size)
    np.testing.assert_allclose(prior_block_sums(edges, window), brute_block_sums(prior_pattern(50, window), edges),
                               rtol=1e-12, atol=1e-15)


def test_a_uniform_head_s_log_ratio_is_zero_where_visible_and_a_previous_token_head_s_is_log_of_its_mass(
        probe_and_tokens):
    probe, tokens = probe_and_tokens
    overview = head_views(probe, tokens, heads=HEADS[:2], overview=True, block_size=10).overview
    visible = overview.prior_sums[0] > 0
    np.testing.assert_allclose(overview.log_ratios()[0][visible], 0.0, atol=1e-6)  # a float32 pattern
    assert (overview.log_ratios()[:, ~visible] == 0).all()
    # Previous token: query q >= 1 puts 1 on key q - 1 and query 0 on itself; block I's sums hold |I| of it.
    sums = overview.sums[1]
    np.testing.assert_allclose(np.diag(sums)[1:] + np.diag(sums, -1), 10.0, rtol=1e-6)
    expected = np.log(np.maximum(sums, overview.log_floor)[visible] / overview.prior_sums[1][visible])
    np.testing.assert_allclose(overview.log_ratios()[1][visible], expected)


def test_a_sliding_window_layer_gets_its_own_prior(probe_and_tokens):
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, sliding_windows=[8, None], max_context=4 * N)
    _, tokens = probe_and_tokens
    overview = head_views(EquivarianceProbe(adapter), tokens, heads=[(0, 0), (1, 2)], overview=True,
                          block_size=10).overview
    edges = overview.edges
    np.testing.assert_allclose(overview.prior_sums[0], prior_block_sums(edges, 8))
    np.testing.assert_allclose(overview.prior_sums[1], prior_block_sums(edges, None))
    assert overview.prior_sums[0][9, 0] == 0 and overview.prior_sums[1][9, 0] > 0


def test_capture_holds_the_chosen_heads_only_and_refuses_missing_ones(probe_and_tokens):
    probe, tokens = probe_and_tokens
    edges = block_edges(N, 25)
    sums, pattern = capture_head_blocks(probe.adapter, tokens, [(1, 3)], edges)
    assert sums.shape == (1, 4, 4) and pattern is None
    np.testing.assert_allclose(sums[0], brute_block_sums(built_heads(1, tokens[None])[0, 3].double().numpy(), edges),
                               rtol=1e-12)
    with pytest.raises(InputError, match="L2H0 does not exist"):
        capture_head_blocks(probe.adapter, tokens, [(2, 0)], edges)
    with pytest.raises(InputError, match=r"the range \(90, 120\) does not fit the window's 100 tokens"):
        capture_head_blocks(probe.adapter, tokens, [(1, 3)], edges, detail=(90, 120))
    with pytest.raises(InputError, match="the blocks end at 50 but the window has 100 tokens"):
        capture_head_blocks(probe.adapter, tokens, [(1, 3)], block_edges(50, 25))


def _uniform_overview(n_positions: int, n_heads: int = 2) -> BlockOverview:
    """An overview of uniform causal heads over ``n_positions``, from the prior's closed form (no T x T array)."""
    edges = block_edges(n_positions)
    prior = prior_block_sums(edges, None)
    return BlockOverview(heads=[(0, h) for h in range(n_heads)], edges=edges, sums=np.stack([prior] * n_heads),
                         prior_sums=np.stack([prior] * n_heads), excerpts=[f"token {i} " * 8 for i in range(len(edges) - 1)],
                         log_floor=1e-30, detail=(0, 64))


def test_the_overview_page_does_not_grow_with_the_window():
    sizes = {n: len(_uniform_overview(n).body_html()) for n in (1024, 4096, 8192)}
    # 256 blocks per side whatever T: the pages differ only by the digits of the positions and numbers.
    assert all(len(_uniform_overview(n).edges) == DEFAULT_OVERVIEW_BLOCKS + 1 for n in sizes)
    assert max(sizes.values()) < 1.1 * min(sizes.values())
    # Two arrays of 256² half floats per head in base64 (8/3 characters each), plus the script and text.
    assert max(sizes.values()) < 2 * 2 * DEFAULT_OVERVIEW_BLOCKS ** 2 * 8 / 3 + 50_000


def test_block_excerpts_are_each_block_s_text_cut_short():
    tokens = [f"<t{i}>" for i in range(40)]
    excerpts = block_excerpts(tokens, block_edges(40, 30))
    assert excerpts[1] == "".join(tokens[30:])
    assert len(excerpts[0]) == 60 and excerpts[0].endswith("…") and excerpts[0].startswith("<t0><t1>")


def test_long_views_refuse_bad_requests(probe_and_tokens):
    probe, tokens = probe_and_tokens
    with pytest.raises(InputError, match="block_size must be a positive number of positions, got 0"):
        head_views(probe, tokens, heads=HEADS, overview=True, block_size=0)
    with pytest.raises(InputError, match=r"1200 blocks per side.*pass block_size >= 3"):
        block_edges(1200, 1)
    with pytest.raises(InputError, match="do not fit the document's 100 tokens"):
        head_views(probe, tokens, heads=HEADS, overview=True, start=90, stop=120)
    with pytest.raises(InputError, match="does not match blocks of 10 positions"):
        block_sums(torch.zeros(9, 9), block_edges(10, 2))


def test_the_overview_is_drawn_above_the_views_in_the_page_the_notebook_and_the_report(probe_and_tokens, tmp_path):
    from equivariance_probe import render_report
    from equivariance_probe.display.circuitsvis import circuitsvis_bundle

    probe, tokens = probe_and_tokens
    views = head_views(probe, tokens, heads=HEADS, overview=True, start=10, stop=20)
    assert "overview of 100 positions" in repr(views) and repr(views.overview).startswith("BlockOverview(L0H0")
    for html in (views.to_html(), views.body_html(), views._repr_html_()):
        assert html.startswith('<div class="block-overview">') and "positions 10..19, shown in full below" in html
    page = views.save(tmp_path / "views.html").read_text()
    assert page.count(circuitsvis_bundle()) == 1 and page.count('class="block-overview"') == 1
    result = probe.run(tokens[None], progress=False)
    report = str(render_report(result, views=views))
    assert report.count(circuitsvis_bundle()) == 1 and report.count('class="block-overview"') == 1


def test_report_overview_reloads_the_tiny_model_and_sums_its_whole_window(tiny_study, capsys):  # noqa: F811
    from equivariance_probe import ProbeResult
    from equivariance_probe.cli import main
    from equivariance_probe.display.views import views_for_result

    results = tiny_study / "out" / "results.safetensors"
    output = tiny_study / "overview.html"
    assert main(["report", str(results), "--overview", "--block-size", "4", "--heads", "L2H1,L0H0",
                 "--start", "8", "--stop", "16", "-o", str(output)]) == 0
    page = output.read_text()
    assert "Overview of positions 0..31: blocks of 4 positions (8 per side)" in page and "L2H1 attention" in page
    # Through the model: the overview's blocks hold every query's attention, and the detail is its slice.
    views, _ = views_for_result(ProbeResult.load(results), heads="L2H1,L0H0", start=8, stop=16, overview=True,
                                block_size=4)
    np.testing.assert_allclose(views.overview.share().sum(-1), 1.0, rtol=1e-5)
    inside = views.overview.sums[:, 2:4, 2:4].sum(axis=(1, 2))
    np.testing.assert_allclose(views.pattern.sum(axis=(1, 2)), inside, rtol=1e-9)  # the same entries, summed
    # Gemma 3's layer 0 slides a window of 8: no attention, and no prior, 8 or more positions back.
    assert views.overview.prior_sums[1][7, 0] == 0 and views.overview.sums[1][7, 0] == 0
    with pytest.raises(SystemExit):
        main(["report", str(results), "--views", "--overview", "--block-size", "0"])


def test_the_page_carries_each_head_s_share_and_log_ratio_as_half_floats(probe_and_tokens):
    import base64
    import json

    probe, tokens = probe_and_tokens
    overview = head_views(probe, tokens, heads=HEADS, overview=True, block_size=10).overview
    html = str(overview.body_html())
    data = json.loads(html.rsplit("})(", 1)[1].rsplit(");</script>", 1)[0])
    assert data["edges"] == overview.edges.tolist() and len(data["excerpts"]) == 10
    for written, share, ratio in zip(data["heads"], overview.share(), overview.log_ratios()):
        decoded = {name: np.frombuffer(base64.b64decode(written[name]), dtype="<f2").reshape(10, 10)
                   for name in ("share", "ratio")}
        np.testing.assert_allclose(decoded["share"], share, rtol=1e-3, atol=6e-8)
        np.testing.assert_allclose(decoded["ratio"], ratio, rtol=1e-3, atol=6e-8)
