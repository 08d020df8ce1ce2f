"""The study report shows the trained model beside its baselines, names the model as the user
named it, and clips no caption."""

from __future__ import annotations

import re

import pytest

from equivariance_probe import ProbeResult, paired_difference
from equivariance_probe.cli import main
from equivariance_probe.sources.registry import name_of_converted_copy


@pytest.fixture(scope="module")
def study(tmp_path_factory, tiny_model_folder, text_corpus):
    out = tmp_path_factory.mktemp("report_variants") / "out"
    model = tiny_model_folder("gemma3", 64)
    assert main(["run", "--out", str(out), "--model", model, "--corpus", text_corpus(n_docs=3, words=50),
                 "--n-docs", "3", "--context-length", "24", "--no-progress", "--sample-size", "200"]) == 0
    return out, model


def _headers(page: str) -> list[str]:
    table = page[page.index('<table class="summary">'):]
    return re.findall(r"<th>([^<]*)</th>", table[: table.index("</tr>")])


def test_the_report_shows_every_variant_side_by_side(study, capsys):
    out, model = study
    assert main(["report", str(out / "results.safetensors")]) == 0
    page = (out / "report.html").read_text()
    assert _headers(page) == ["", "", "trained", "random_init", "zero"]
    for variant in ("trained", "random_init", "zero"):
        assert f"Per-head query-position R² and Toeplitz R², {variant}" in page
    assert "Fig. 1a — persistence P(dt) with power, exponential and uniform-prior fits (trained and baselines side by side)" in page
    assert "Fig. 1c — R² of each fit to P_t(dt) by key position (trained and baselines side by side)" in page
    # every number of the table is the variant's own
    zero = ProbeResult.load(out / "baseline_zero.safetensors")
    row = re.search(r"<tr><td>log</td><td>eta2</td>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td>([^<]*)</td>", row)[2] == str(zero.query_position_r2("log", "eta2", interval=0.95))
    # and the differences from each baseline over the same windows, with their intervals
    trained = ProbeResult.load(out / "results.safetensors")
    difference = re.search(r'<table class="differences">.*?<tr><td>log</td><td>fitted</td>(.*?)</tr>', page).group(1)
    assert re.findall(r"<td>([^<]*)</td>", difference)[1] == str(paired_difference(trained, zero, "log_fitted"))
    assert "<th>trained − random_init</th><th>trained − zero</th>" in page
    # the model as given, in the title
    assert f"<h1>Equivariance probe: {model}</h1>" in page


def test_a_missing_baseline_is_said_and_the_report_still_written(study, tmp_path, capsys):
    out, _ = study
    lone = ProbeResult.load(out / "results.safetensors")
    lone.save(tmp_path / "results.safetensors")
    ProbeResult.load(out / "baseline_zero.safetensors").save(tmp_path / "baseline_zero.safetensors")
    assert main(["report", str(tmp_path / "results.safetensors")]) == 0
    assert "baselines ['random_init'] are not beside" in capsys.readouterr().err
    assert _headers((tmp_path / "report.html").read_text()) == ["", "", "trained", "zero"]


def test_packaged_models_are_shown_by_their_registry_name_not_their_cache_path():
    cache_path = "/root/.cache/equivariance_probe/gemma-3-270m-q4_k_m-fp32"
    assert name_of_converted_copy(cache_path) == "gemma-3-270m"
    assert name_of_converted_copy("/data/my-model") is None
    from equivariance_probe import AttentionStatistics

    statistics = AttentionStatistics(n_layers=1, n_heads=1, n_positions=4, sliding_windows=[None])
    result = ProbeResult(statistics, {"model": {"name": cache_path}})
    assert result.model_name == "gemma-3-270m" and "gemma-3-270m" in repr(result) and cache_path not in repr(result)
    assert ProbeResult(statistics, {"model": {"name": cache_path}, "study": {"model": "./my copy"}}).model_name == "./my copy"
    assert ProbeResult(statistics, {"model": {"name": "/data/my-model"}}).model_name == "/data/my-model"
    from equivariance_probe import PositionalStudy

    assert PositionalStudy(metadata={"model": cache_path}).model_name == "gemma-3-270m"
    assert "gemma-3-270m" in repr(PositionalStudy(metadata={"model": cache_path}))


def test_no_figure_title_runs_past_the_figure(study):
    from equivariance_probe.display.figures import persistence_figure, pyplot

    out, _ = study
    result = ProbeResult.load(out / "results.safetensors")
    figure = persistence_figure(result)  # one panel: the narrowest figure, where the title was clipped
    figure.canvas.draw()
    for text in [figure._suptitle, *(ax.title for ax in figure.axes)]:
        box = text.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= figure.bbox.width, text.get_text()
    pyplot().close(figure)


def test_a_probe_figure_takes_a_result_and_its_baselines_as_a_shift_figure_does(study):
    from equivariance_probe.display.figures import heatmaps_figure, persistence_figure, pyplot, sink_rate_figure
    from equivariance_probe.errors import InputError

    out, _ = study
    result = ProbeResult.load(out / "results.safetensors")
    baseline = ProbeResult.load(out / "baseline_random_init.safetensors")
    for draw in (persistence_figure, sink_rate_figure):
        together = draw({"trained": result, "random_init": baseline})
        apart = draw(result, {"random_init": baseline})
        assert [ax.get_title() for ax in together.axes] == [ax.get_title() for ax in apart.axes]
        assert len(apart.axes[0].lines) == len(together.axes[0].lines)
        pyplot().close(together)
        pyplot().close(apart)
        with pytest.raises(InputError, match=rf"{draw.__name__} takes a ProbeResult and its baselines"):
            draw({"trained": result}, {"random_init": baseline})
    with pytest.raises(InputError, match=r"heatmaps_figure draws one ProbeResult, not dict"):
        heatmaps_figure({"trained": result})
