"""Head ranking on a synthetic model with a built-in positional head and a previous-token head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, HeadRanking, rank_heads
from equivariance_probe.analyses.heads import HIGHER_IS_MORE_POSITION_BOUND, RANKING_SCORES

from synthetic import SyntheticAdapter, random_causal_pattern, uniform_pattern

N_POSITIONS = 32
POSITIONAL = (0, 0)  # a = 1/(q+1): a function of the absolute position alone
PREVIOUS_TOKEN = (0, 1)  # a[q, q-1] = 1: a function of q - k alone


def previous_token_pattern(n: int) -> torch.Tensor:
    """``a[q, q-1] = 1`` (``a[0, 0] = 1``): ``[query, key]``."""
    pattern = torch.zeros(n, n)
    pattern[0, 0] = 1.0
    pattern[torch.arange(1, n), torch.arange(n - 1)] = 1.0
    return pattern


def built_heads(layer: int, tokens: torch.Tensor) -> torch.Tensor:
    """Two layers of four heads: content heads (softmax of token-pair scores), except L0H0
    (uniform causal) and L0H1 (previous token)."""
    pattern = random_causal_pattern(tokens, 4, seed=layer).clone()
    if layer == 0:
        n = tokens.shape[1]
        pattern[:, POSITIONAL[1]] = uniform_pattern(n)
        pattern[:, PREVIOUS_TOKEN[1]] = previous_token_pattern(n)
    return pattern


@pytest.fixture(scope="module")
def result():
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    tokens = torch.randint(0, 1000, (6, N_POSITIONS), generator=torch.Generator().manual_seed(0))
    return EquivarianceProbe(adapter).run(tokens, keep_pattern=True, progress=False)


@pytest.mark.parametrize("key", list(RANKING_SCORES))
def test_positional_head_ranks_first_and_previous_token_head_last_by_every_score(result, key):
    ranking = result.rank_heads(score=key)
    assert ranking.order[0] == POSITIONAL
    assert ranking.order[-1] == PREVIOUS_TOKEN
    assert ranking.top(1) == [POSITIONAL] and ranking.bottom(1) == [PREVIOUS_TOKEN]


def test_scores_are_the_results_own_numbers_and_the_known_values(result):
    ranking = rank_heads(result)
    assert isinstance(ranking, HeadRanking) and len(ranking) == 8
    row = {pair: i for i, pair in enumerate(ranking.order)}
    for scale in ("log", "raw"):
        for form in ("prior", "fitted", "eta2"):
            grid = result.query_position_r2(scale, form, by="head")
            got = np.array([ranking.scores[f"{scale}_{form}"][row[(l, h)]] for l in range(2) for h in range(4)])
            np.testing.assert_allclose(got, grid.ravel())
            # the uniform head is explained by the query position exactly
            assert ranking.scores[f"{scale}_{form}"][row[POSITIONAL]] == pytest.approx(1.0, abs=1e-9)
    np.testing.assert_allclose(ranking.scores["prior_fit"][row[POSITIONAL]], 1.0, atol=1e-9)
    # previous-token head: lag-only except row 0 (a[0,0] = 1 on the lag-0 diagonal), computed here directly
    n = N_POSITIONS
    values = previous_token_pattern(n).double().numpy()
    visible = np.tril(np.ones((n, n), dtype=bool))
    lags = (np.arange(n)[:, None] - np.arange(n)[None, :])[visible]
    entries = values[visible]
    diagonal_means = np.array([entries[lags == d].mean() for d in range(n)])
    rss = ((entries - diagonal_means[lags]) ** 2).sum()
    tss = ((entries - entries.mean()) ** 2).sum()
    assert ranking.scores["toeplitz"][row[PREVIOUS_TOKEN]] == pytest.approx(1 - rss / tss, rel=1e-9)


def test_prior_fit_by_head_is_the_persistence_curves_prior_r2(result):
    from equivariance_probe.analyses.heads import prior_fit_by_head

    np.testing.assert_allclose(prior_fit_by_head(result), result.persistence(by="head").r2("prior"), rtol=1e-12)


def test_default_order_is_descending_log_eta2_with_ties_in_head_order(result):
    ranking = result.rank_heads()
    assert ranking.key == "log_eta2" and ranking.descending
    values = ranking.scores["log_eta2"]
    assert np.all(np.diff(values) <= 0)
    toeplitz = result.rank_heads(score="toeplitz")
    assert not toeplitz.descending and np.all(np.diff(toeplitz.scores["toeplitz"]) >= 0)
    assert HIGHER_IS_MORE_POSITION_BOUND["prior_fit"] and not HIGHER_IS_MORE_POSITION_BOUND["toeplitz_per_doc"]


def test_records_dataframe_text_and_html(result):
    ranking = result.rank_heads(scores=["log_eta2", "toeplitz"])
    records = ranking.to_records()
    assert records[0]["rank"] == 1 and records[0]["label"] == "L0H0" and set(records[0]) == {
        "rank", "layer", "head", "label", "log_eta2", "toeplitz", "in_top_k"}
    frame = ranking.to_dataframe()
    assert list(frame.columns) == ["layer", "head", "label", "log_eta2", "toeplitz", "in_top_k"]
    assert frame.loc[1, "label"] == "L0H0" and frame.loc[8, "label"] == "L0H1"
    text = repr(ranking)
    assert "L0H0" in text and "most position-bound first" in text
    page = ranking._repr_html_()
    assert page.startswith('<table class="head-ranking">') and "<script" not in page
    assert result.rank_heads().to_text(max_rows=4).count("\n") == 1 + 4 + 1  # caption, header, 4 rows, "..."
    assert "head-ranking" in result._repr_html_()


def test_nan_scores_go_last_and_bad_keys_are_refused(result):
    ranking = result.rank_heads(score="toeplitz")
    assert np.isfinite(ranking.scores["toeplitz"]).all()
    with pytest.raises(ValueError, match="not a ranking score"):
        result.rank_heads(score="eta2")
    with pytest.raises(ValueError, match="unknown scores"):
        result.rank_heads(scores=["bogus"])


def test_nan_key_rows_are_ranked_last():
    from equivariance_probe.analyses.heads import HeadRanking as Ranking

    # A run without the summed pattern has no document-averaged Toeplitz score: all NaN, order kept.
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    result = EquivarianceProbe(adapter).run(tokens, keep_pattern=False, progress=False)
    ranking = result.rank_heads(score="toeplitz")
    assert isinstance(ranking, Ranking) and np.isnan(ranking.scores["toeplitz"]).all()
    assert ranking.order == [(l, h) for l in range(2) for h in range(4)]
    assert ranking.top(1) == [] and ranking.to_records()[0]["toeplitz"] is None
