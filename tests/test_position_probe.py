"""Linear position probes against known answers: a position coordinate is read exactly, a model with
neither position code nor causal mask gives nothing to read, and the causal mask alone makes position
readable (the symmetry-breaking claim, tested directly); folds never split a document."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe.analyses.position_probe import (
    PositionProbe,
    position_probe,
    probe_feature_bytes,
    probe_positions,
    residual_samples,
)
from equivariance_probe.errors import InputError
from equivariance_probe.maths.probing import grouped_folds

transformers = pytest.importorskip("transformers")
pytest.importorskip("sklearn")

T = 32


def _windows(n: int, length: int = T, seed: int = 0, first: int | None = 1) -> torch.Tensor:
    """Random token windows; with ``first``, every window starts with that token (a BOS)."""
    tokens = torch.randint(3, 97, (n, length), generator=torch.Generator().manual_seed(seed))
    if first is not None:
        tokens[:, 0] = first
    return tokens


def test_a_position_coordinate_in_the_residual_stream_is_read_exactly():
    # Constant token embeddings and a position table that is the position on coordinate 0 and zero
    # elsewhere: the residual entering block 0 is c + p·e₀. Block 0's output projections are zeroed, so
    # the stream after it is the same: both layers hold the position as a coordinate.
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=97,
                                                           n_positions=64)).double().eval()
    with torch.no_grad():
        model.wte.weight[:] = model.wte.weight[5]
        model.wpe.weight.zero_()
        model.wpe.weight[:, 0] = torch.arange(64, dtype=torch.float64)
        for projection in (model.h[0].attn.c_proj, model.h[0].mlp.c_proj):
            projection.weight.zero_()
            projection.bias.zero_()
    probe = position_probe(model, _windows(12), positions_per_window=16, min_position=0)
    for layer in (0, 1):
        assert probe.r2["position"][layer].min() > 1 - 1e-9, probe.r2["position"][layer]
        assert probe.mae["position"][layer].max() < 1e-4


def _bert_without_positions():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    model = transformers.BertModel._from_config(config, attn_implementation="eager").double().eval()
    with torch.no_grad():
        model.embeddings.position_embeddings.weight.zero_()
        model.embeddings.token_type_embeddings.weight.zero_()
    return model


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).double().eval()


def _at_or_below_zero(probe: PositionProbe) -> None:
    for target in ("position", "log1p_position"):
        interval = probe.interval(target)
        assert np.all(interval.low <= 0), (target, interval.low)
        assert np.all(interval.estimate < 0.01), (target, interval.estimate)


def test_without_position_code_and_mask_position_cannot_be_decoded():
    # Each token's representation is a function of the token and the multiset of the window's tokens:
    # nothing in it depends on where the token sits, at any layer.
    _at_or_below_zero(position_probe(_bert_without_positions(), _windows(40), positions_per_window=16))
    _at_or_below_zero(position_probe(_llama(), _windows(40), positions_per_window=16, ablation="no_mask+no_positions"))


def test_the_causal_mask_alone_makes_position_decodable():
    # The same decoder without rotary, causal: query q averages over the q + 1 tokens before it, the first
    # of which is the same in every window, so the average carries its position (Haviv et al. 2022).
    probe = position_probe(_llama(), _windows(40), positions_per_window=16, ablation="no_positions")
    assert probe.interval("position").low.max() > 0.02
    assert probe.interval("log1p_position").low.max() > 0.05


def test_folds_never_put_one_documents_windows_on_both_sides():
    groups = np.repeat(np.arange(7), 3)[np.random.default_rng(0).permutation(21)]  # 3 windows per document, shuffled
    probe = position_probe(_llama(), _windows(21), groups=groups, positions_per_window=4, n_folds=5)
    for document in range(7):
        assert len(set(probe.window_fold[groups == document])) == 1
    rows = np.repeat(groups, 4)
    for train, held_out in grouped_folds(rows, 5):
        assert not set(rows[train]) & set(rows[held_out])
    assert probe.n_folds == 5 and probe.n_documents == 7


def test_positions_are_a_stratified_bounded_sample():
    positions = probe_positions(50, 256, 32, min_position=1, seed=3)
    assert positions.shape == (50, 32)
    edges = 1 + np.floor(np.linspace(0, 255, 33)).astype(int)
    assert np.all((positions.numpy() >= edges[:-1]) & (positions.numpy() < edges[1:]))
    np.testing.assert_array_equal(probe_positions(2, 8, 32, min_position=0), np.tile(np.arange(8), (2, 1)))
    with pytest.raises(InputError, match="min_position=8"):
        probe_positions(2, 8, 4, min_position=8)


def test_features_are_the_rows_asked_for_and_their_memory_is_the_formula():
    model = _llama()
    tokens = _windows(5, 12)
    positions = probe_positions(5, 12, 3, seed=1)
    features = residual_samples(model, tokens, positions, batch_size=2)
    hidden = model.model(input_ids=tokens, output_hidden_states=True).hidden_states
    for layer in (0, 1):  # the last entry of hidden_states has the final norm applied; the probe's does not
        expected = torch.stack([hidden[layer][w, positions[w]] for w in range(5)]).reshape(15, -1)
        torch.testing.assert_close(features[layer], expected)
    assert features.numel() * features.element_size() == probe_feature_bytes(2, 5, 3, 32, 8)


def test_too_few_documents_and_bad_groups_are_refused():
    with pytest.raises(InputError, match="1 group"):
        position_probe(_llama(), _windows(3, 8), groups=[0, 0, 0], positions_per_window=2)
    with pytest.raises(InputError, match="one document per window"):
        position_probe(_llama(), _windows(3, 8), groups=[0, 1], positions_per_window=2)


def test_the_result_round_trips_through_a_dict():
    probe = position_probe(_llama(), _windows(6, 10), positions_per_window=3, n_folds=3)
    loaded = PositionProbe.from_dict(probe.to_dict())
    assert loaded.summary() == probe.summary()
    np.testing.assert_array_equal(loaded.r2["log1p_position"], probe.r2["log1p_position"])
    assert "best layer" in repr(loaded)


def _signal_rows(seed: int, documents: int = 80, per_document: int = 16, d: int = 4, length: int = 64):
    """Rows ``x = p·w + u_doc + e`` (a document effect shared by its rows) and the population R² and mean
    absolute error of the best linear predictor of ``p`` (``p`` stratified over ``1 .. length-1``)."""
    from scipy.stats import norm

    setup = np.random.default_rng(123)
    w, root = setup.normal(size=d) * 0.05, setup.normal(size=(d, d)) * 0.5
    document_cov = root @ root.T
    values = np.arange(1, length)
    variance = values.var()
    noise_cov = document_cov + np.eye(d)
    beta = np.linalg.solve(variance * np.outer(w, w) + noise_cov, variance * w)
    r2 = float(w @ beta)
    mean = (values - values.mean()) * (1 - beta @ w)
    sd = float(np.sqrt(beta @ noise_cov @ beta))
    mae = float(np.mean(sd * np.sqrt(2 / np.pi) * np.exp(-mean**2 / (2 * sd * sd)) + mean * (1 - 2 * norm.cdf(-mean / sd))))
    rng = np.random.default_rng(seed)
    edges = 1 + np.floor(np.linspace(0, length - 1, per_document + 1)).astype(int)
    p = rng.integers(edges[:-1], edges[1:], size=(documents, per_document)).reshape(-1).astype(float)
    docs = np.repeat(np.arange(documents), per_document)
    x = np.outer(p, w) + rng.multivariate_normal(np.zeros(d), document_cov, size=documents)[docs] + rng.normal(size=(len(p), d))
    return x, p, docs, r2, mae


def test_the_jackknife_interval_covers_the_true_score_at_about_the_nominal_rate():
    # 100 seeded draws of 80 documents; the truth is the best linear predictor's population R² and
    # mean |error|, computed in closed form. Binomial spread of 100 draws at 95 %: ±0.022.
    from equivariance_probe.maths.intervals import jackknife_interval
    from equivariance_probe.maths.probing import grouped_ridge_scores, jackknife_scores

    covered = np.zeros(2)
    draws = 100
    for seed in range(draws):
        x, p, docs, r2, mae = _signal_rows(seed)
        scores = grouped_ridge_scores(x, p[:, None], docs)
        found = jackknife_scores(scores["sums"][0], scores["replicate_sums"][0])
        r2_interval = jackknife_interval(*found["r2"], upper=1.0)
        mae_interval = jackknife_interval(*found["mae"])
        covered += [r2_interval.low <= r2 <= r2_interval.high, mae_interval.low <= mae <= mae_interval.high]
    assert np.all((covered / draws >= 0.9) & (covered / draws <= 0.99)), covered / draws


def test_leaving_a_group_out_moves_predictions_as_a_refit_does():
    from equivariance_probe.maths.probing import ridge_fold

    x, p, docs, _, _ = _signal_rows(0, documents=12, d=6)
    y = np.stack([p, np.log1p(p)], 1)
    train, test = np.flatnonzero(docs < 9), np.flatnonzero(docs >= 9)
    deleted = (np.flatnonzero(docs[train] == 2), np.flatnonzero(docs[train] == 5))
    predictions, alpha, shifts = ridge_fold(x[train], y[train], x[test], delete=deleted)
    mean, std = x[train].mean(0), x[train].std(0)
    for rows, shift in zip(deleted, shifts):
        kept = np.setdiff1d(np.arange(len(train)), rows)
        z = (x[train][kept] - mean) / std  # the fold's standardisation, refitted by hand with its α
        for j in range(2):
            design = np.column_stack([np.ones(len(kept)), z])
            penalty = np.diag([0.0] + [alpha[j]] * z.shape[1])
            coef = np.linalg.solve(design.T @ design + penalty, design.T @ y[train][kept, j])
            refit = np.column_stack([np.ones(len(test)), (x[test] - mean) / std]) @ coef
            np.testing.assert_allclose(predictions[:, j] + shift[:, j], refit, rtol=0, atol=1e-9 * np.abs(refit).max())


@pytest.mark.parametrize("rows, features, signal", [(3000, 64, 0.01), (120, 300, 0.002)])
def test_the_fast_ridge_equals_scikit_learns_ridgecv_on_the_same_folds(rows, features, signal):
    # Fewer rows than features: the leave-one-out errors of the smallest penalties agree to rounding (each
    # fit interpolates), so a weaker signal keeps the chosen penalty off that plateau.
    from sklearn.linear_model import RidgeCV
    from sklearn.metrics import r2_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from equivariance_probe.maths.probing import RIDGE_ALPHAS, grouped_ridge_scores

    rng = np.random.default_rng(features)
    docs = np.repeat(np.arange(rows // 20), 20)
    p = rng.integers(1, 256, rows).astype(float)
    x = (rng.normal(size=(rows, features)) + np.outer(p, rng.normal(size=features)) * signal
         + rng.normal(size=(rows // 20, features))[docs])
    x[:, 3] = 5.0  # a constant feature
    y = np.stack([p, np.log1p(p)], 1)
    fast = grouped_ridge_scores(x, y, docs, inverse=(None, np.expm1))
    for fold, (train, test) in enumerate(grouped_folds(docs, 5)):
        pipeline = make_pipeline(StandardScaler(), RidgeCV(alphas=RIDGE_ALPHAS, alpha_per_target=True)).fit(x[train], y[train])
        predicted = pipeline.predict(x[test])
        np.testing.assert_array_equal(pipeline[-1].alpha_, fast["alpha"][:, fold])
        for column in range(2):
            assert abs(r2_score(y[test, column], predicted[:, column]) - fast["r2"][column, fold]) < 1e-9
        mae = np.mean(np.abs(p[test] - np.expm1(predicted[:, 1])))
        assert abs(mae - fast["mae"][1, fold]) < 1e-9 * mae


def test_a_fold_with_one_position_is_refused_before_any_pass():
    # Windows of 2 tokens from position 1: every sampled position is 1, and a constant target would score
    # R² = 1 with an error of 0 tokens.
    with pytest.raises(InputError, match="held-out fold 0 has 1 distinct position"):
        position_probe(_llama(), _windows(6, 2), positions_per_window=1, n_folds=3)


def test_rounding_noise_is_no_position_signal():
    # The same token at every position of a float32 rotary model: in exact arithmetic every position's
    # residual stream is the same; float32 rotary arithmetic leaves position-dependent rounding, which a
    # standardised probe would read perfectly.
    model = _llama().float()
    tokens = torch.full((12, T), 7)
    probe = position_probe(model, tokens, positions_per_window=16, n_folds=3)
    assert np.all(probe.score("position") <= 0.0), probe.score("position")
    assert np.all(probe.constant[1:] == 32) and probe.summary()["constant_features"][1:] == [32, 32]


def test_a_non_finite_activation_is_named_with_its_layer_before_any_fit():
    from equivariance_probe.errors import NonFiniteActivationError

    model = _llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteActivationError, match=r"layer\(s\) \[2\]"):
        position_probe(model, _windows(6, 10), positions_per_window=3, n_folds=3)


def test_results_written_before_the_sums_have_no_interval():
    from equivariance_probe.errors import IntervalUnavailableError

    probe = position_probe(_llama(), _windows(6, 10), positions_per_window=3, n_folds=3)
    data = probe.to_dict()
    del data["sums"], data["replicate_sums"]
    old = PositionProbe.from_dict(data)
    with pytest.raises(IntervalUnavailableError, match="run the probe again"):
        old.interval()
    summary = old.summary()["position"]
    assert summary["interval"].startswith("unavailable") and np.isnan(summary["r2_low"]).all()
    np.testing.assert_allclose(summary["r2"], probe.r2["position"].mean(1))
