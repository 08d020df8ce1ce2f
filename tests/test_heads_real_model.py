"""Ranking, views and the report with views on the packaged Gemma 3 270M (slow: CI runs it).

Kept short (context 128, one or two windows): the model loads once per test, in turn.
"""

from __future__ import annotations

import numpy as np
import pytest

from equivariance_probe.display.circuitsvis import circuitsvis_bundle


@pytest.mark.slow
def test_gemma_views_rows_sum_to_one_and_the_report_carries_one_bundle():
    from equivariance_probe import EquivarianceProbe, head_views, load_corpus, load_model, render_report

    model, tokenizer = load_model()
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    docs = load_corpus(n_docs=2)
    result = probe.run(docs, context_length=128, batch_size=2, progress=False)
    ranking = result.rank_heads()
    assert len(ranking) == 18 * 4 and ranking.order[0] == ranking.top(1)[0]
    eta2 = result.query_position_r2("log", "eta2", by="head")
    assert ranking.scores["log_eta2"][0] == pytest.approx(np.nanmax(eta2))
    views = head_views(probe, docs[0], result=result, stop=64)  # default: 2 most, 2 least position-bound
    assert views.heads == ranking.top(2) + ranking.bottom(2)[::-1]
    # the window starts at position 0, so every row holds all its visible keys: rows sum to 1
    np.testing.assert_allclose(views.pattern.sum(-1), 1.0, atol=1e-5)
    assert views.tokens[0] == "<bos>"
    page = str(render_report(result, views=views))
    assert page.count(circuitsvis_bundle()) == 1 and "L" in views.labels[0]


@pytest.mark.slow
def test_report_command_reloads_gemma_for_views(tmp_path, capsys):
    from equivariance_probe.cli import main

    out = tmp_path / "study"
    assert main(["run", "--out", str(out), "--n-docs", "1", "--context-length", "96", "--baselines", "none",
                 "--no-progress", "--sample-size", "200"]) == 0
    assert main(["report", str(out / "results.safetensors"), "--views", "--stop", "48"]) == 0
    assert "on document 0 of the packaged corpus with model gemma-3-270m" in capsys.readouterr().out
    page = (out / "report.html").read_text()
    assert page.count(circuitsvis_bundle()) == 1 and "uniform prior (full causal)" in page
