"""Known answers for equivariance_probe.analyses.positional and adapters.internals, on tiny models built from configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe.adapters.internals import ablate, intercept_attention, visible_from_mask
from equivariance_probe.errors import InputError, UnsupportedModelError
from equivariance_probe.maths.metrics import toeplitz_r2
from equivariance_probe.analyses.positional import (
    diagonal_profile_sums,
    fit_score_profiles,
    gram_toeplitz,
    position_embedding_table,
    positional_logits,
    score_profile,
    sinusoidal_position_embeddings,
)
from equivariance_probe.maths.fitting import fit_tisa_kernel, tisa_kernel

from synthetic import tiny_gemma3, tiny_gpt2, tiny_llama

transformers = pytest.importorskip("transformers")


def test_sinusoidal_gram_matrix_is_exactly_toeplitz():
    gram = gram_toeplitz(sinusoidal_position_embeddings(96, 32))
    assert gram.r2_whole == pytest.approx(1.0, abs=1e-12)
    assert gram.r2_off_diagonal == pytest.approx(1.0, abs=1e-12)


def test_whole_includes_the_diagonal_and_off_diagonal_excludes_it():
    # Toeplitz off the diagonal, arbitrary squared norms on it: only the whole score drops.
    n = 40
    table = sinusoidal_position_embeddings(n, 16).numpy()
    gram = table @ table.T
    gram[np.diag_indices(n)] += np.linspace(1, 50, n)
    expected_whole = toeplitz_r2(gram)
    embeddings = np.linalg.cholesky(gram)  # E with E Eᵀ = gram
    result = gram_toeplitz(embeddings)
    assert result.r2_off_diagonal == pytest.approx(1.0, abs=1e-6)
    assert result.r2_whole == pytest.approx(expected_whole, abs=1e-6) and result.r2_whole < 0.9


def test_position_tables_drop_offset_rows():
    gpt2 = tiny_gpt2(n_positions=48)
    table, offset = position_embedding_table(gpt2)
    assert offset == 0 and torch.equal(table, gpt2.transformer.wpe.weight.detach().double())

    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        max_position_embeddings=20, word_embed_proj_dim=16)).eval()
    table, offset = position_embedding_table(opt)
    weight = opt.model.decoder.embed_positions.weight.detach().double()
    assert offset == 2 and table.shape[0] == 20 and torch.equal(table, weight[2:])

    roberta = transformers.RobertaModel(transformers.RobertaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=22, pad_token_id=1)).eval()
    table, offset = position_embedding_table(roberta)
    assert offset == 2 and table.shape[0] == 20


def test_rotary_models_have_no_position_table():
    with pytest.raises(UnsupportedModelError, match="no learned absolute position embeddings"):
        position_embedding_table(tiny_gemma3())


def test_gpt2_positional_logits_match_a_hand_computation():
    model = tiny_gpt2(n_positions=24)
    n = 12
    result = positional_logits(model, n)
    block = model.transformer.h[0]
    with torch.no_grad():
        x = model.transformer.wte.weight.mean(0) + model.transformer.wpe.weight[:n]
        q, k, _ = block.attn.c_attn(block.ln_1(x)).split(32, dim=-1)
        q, k = q.view(n, 4, 8).transpose(0, 1), k.view(n, 4, 8).transpose(0, 1)
        expected = (q @ k.transpose(-1, -2) / np.sqrt(8)).double().numpy()
    causal = np.tril(np.ones((n, n), dtype=bool))
    assert np.array_equal(result.visible, causal)
    np.testing.assert_allclose(result.scores, expected, atol=1e-5)
    np.testing.assert_allclose(result.toeplitz_r2, [toeplitz_r2(s, causal) for s in expected], atol=1e-6)


def test_encoder_positional_logits_see_every_entry():
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=30)).eval()
    result = positional_logits(bert)
    assert result.scores.shape == (2, 30, 30) and result.visible.all()


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_gemma3, tiny_llama])
def test_intercepted_scores_reproduce_the_models_attention(build):
    model = build()
    tokens = torch.randint(3, 90, (2, 14), generator=torch.Generator().manual_seed(0))
    calls = []
    with intercept_attention(model, calls.append, keep_weights=True), torch.no_grad():
        model(tokens)
    assert [c.layer for c in calls] == list(range(len(calls))) and len(calls) >= 2
    for call in calls:
        scores = call.scores()
        visible = visible_from_mask(call.attention_mask, scores.shape)
        pattern = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        torch.testing.assert_close(pattern, call.weights.float(), atol=1e-6, rtol=1e-5)
    # The interception is gone after the block.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "eager" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def test_diagonal_profile_sums_match_a_loop():
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 2, 7, 7, generator=generator)
    visible = torch.rand(3, 1, 7, 7, generator=generator) > 0.3
    sums, counts = diagonal_profile_sums(scores, visible)
    for head in range(2):
        for lag in range(-6, 7):
            values = [float(scores[b, head, q, q - lag]) for b in range(3) for q in range(7)
                      if 0 <= q - lag < 7 and visible[b, 0, q, q - lag]]
            assert counts[head, lag + 6] == len(values)
            assert float(sums[head, lag + 6]) == pytest.approx(sum(values), abs=1e-9)


def test_score_profile_respects_sliding_windows():
    model = tiny_gemma3(window=5)
    tokens = torch.randint(3, 90, (3, 16), generator=torch.Generator().manual_seed(2))
    profile = score_profile(model, tokens, batch_size=2)
    lags = profile.lags
    assert profile.sums.shape == (3, 4, 31)
    sliding, full = profile.counts[0, 0], profile.counts[2, 0]
    assert np.all(sliding[(lags < 0) | (lags >= 5)] == 0) and np.all(sliding[(lags >= 0) & (lags < 5)] > 0)
    assert np.all(full[lags >= 0] == 3 * (16 - lags[lags >= 0])) and np.all(full[lags < 0] == 0)
    # Without key 0 the largest lag (query 15, key 0) has no entry left; every other lag loses one per window.
    without_sink = score_profile(model, tokens, batch_size=2, exclude_keys=[0]).counts[2, 0]
    np.testing.assert_array_equal(without_sink[lags >= 0], full[lags >= 0] - 3)


def test_kernel_fit_recovers_synthetic_parameters():
    lags = np.arange(0, 64.0)
    a, b, c = np.array([3.0, -1.5, 0.8]), np.array([0.08, 0.01, 0.5]), np.array([0.0, 20.0, 45.0])
    fit = fit_tisa_kernel(lags, tisa_kernel(lags, a, b, c), n_kernels=3)
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    np.testing.assert_allclose(fit.a, a, rtol=1e-4)
    np.testing.assert_allclose(fit.b, b, rtol=1e-4)
    np.testing.assert_allclose(fit.c, c, atol=1e-3)


def test_default_five_kernels_recover_a_two_sided_encoder_profile():
    lags = np.arange(-40, 41.0)  # an encoder sees keys on both sides: k < 0 too
    a = np.array([0.5, -1.0, 2.0, 0.7, -0.4])
    b = np.array([0.05, 0.02, 0.3, 0.1, 0.005])
    c = np.array([-15.0, -3.0, 0.0, 12.0, 25.0])
    fit = fit_tisa_kernel(lags, tisa_kernel(lags, a, b, c))
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    np.testing.assert_allclose(fit.a, a, rtol=1e-4)
    np.testing.assert_allclose(fit.b, b, rtol=1e-4)
    np.testing.assert_allclose(fit.c, c, atol=1e-3)


def test_too_short_profiles_are_refused_or_left_out():
    with pytest.raises(InputError, match="finite profile points"):
        fit_tisa_kernel(np.arange(5.0), np.ones(5), n_kernels=5)
    profile = score_profile(tiny_gemma3(window=4), torch.randint(3, 90, (2, 12)))
    fits = fit_score_profiles(profile, n_kernels=2)
    r2 = fits.r2()
    assert np.isnan(r2[0]).all() and np.isfinite(r2[2]).all()  # 4 lags in a window-4 layer: too few for 2 kernels


def test_unknown_ablation_is_refused():
    with pytest.raises(InputError, match="unknown ablation"):
        with ablate(tiny_gpt2(), "no_rope"):
            pass
