"""Known answers for equivariance_probe.analyses.order on tiny models built from configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe.errors import InputError
from equivariance_probe.analyses.order import (
    VarianceShrinkage,
    distribution_change,
    permutation_sensitivity,
    permute_middle,
    position_correlation,
    representation_sums,
)
from equivariance_probe.maths.fitting import fit_shrinkage_exponent
from equivariance_probe.statistics.representation import RepresentationSums

from synthetic import tiny_gemma3, tiny_gpt2, tiny_llama

transformers = pytest.importorskip("transformers")


def _prompts(n: int = 2, length: int = 14, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 90, (n, length), generator=torch.Generator().manual_seed(seed))


def test_permutations_keep_the_first_and_last_tokens():
    tokens = torch.arange(10)
    permuted = permute_middle(tokens, 5, keep_first=1, seed=3)
    assert permuted.shape == (5, 10)
    assert (permuted[:, 0] == 0).all() and (permuted[:, -1] == 9).all()
    for row in permuted:
        assert sorted(row[1:-1].tolist()) == list(range(1, 9))
    assert not (permuted == tokens).all(-1).all()


def test_distribution_change_known_values():
    p = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    q = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    kl, tv = distribution_change(p, q)
    assert float(kl) == pytest.approx(0.5 * np.log(2) + 0.5 * np.log(0.5 / 0.75), abs=1e-12)
    assert float(tv) == pytest.approx(0.25, abs=1e-12)


def test_a_model_without_position_code_and_mask_is_exactly_permutation_invariant():
    # GPT-2 with its position table zeroed has no position code; the ablation removes the mask.
    # Float64 and LayerNorm (no float32 upcast): invariant to rounding.
    model = tiny_gpt2().double()
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
    result = permutation_sensitivity(model, _prompts(), n_permutations=4, ablations=("none", "no_mask"))
    summary = result.summary()
    assert summary["no_mask"]["kl_max"] < 1e-13
    assert result.total_variation["no_mask"].max() < 1e-13 and result.hidden_change["no_mask"].max() < 1e-12
    # The causal mask alone breaks the symmetry.
    assert summary["none"]["kl_mean"] > 1e-9 and result.hidden_change["none"].min() > 1e-6
    # The ablation took effect: later keys get attention, the unpermuted output changed.
    assert summary["no_mask"]["upper_mass"] > 0.1 and summary["none"]["upper_mass"] == 0.0
    assert summary["no_mask"]["effect"] > 0.0 and summary["none"]["effect"] < 1e-12


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama, tiny_gemma3])
def test_removing_mask_and_positions_restores_invariance(build):
    # Learned absolute (GPT-2) or rotary (Llama, Gemma 3 with sliding windows) positions.
    model = build().double()
    result = permutation_sensitivity(model, _prompts(seed=1), n_permutations=3)
    summary = result.summary()
    assert set(summary) == {"none", "no_mask", "no_positions", "no_mask+no_positions"}
    for name in ("no_mask", "no_positions", "no_mask+no_positions"):
        assert summary[name]["effect"] > 1e-6, name
    # Llama and Gemma RMSNorm compute in float32 even in a float64 model: invariant to float32 rounding.
    assert summary["no_mask+no_positions"]["kl_max"] < 1e-12
    assert summary["no_mask+no_positions"]["hidden_change_mean"] < 1e-6
    assert summary["none"]["kl_mean"] > 1e3 * summary["no_mask+no_positions"]["kl_max"] + 1e-10


def test_no_positions_on_a_model_without_position_code_is_refused():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=97, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.transformer.wpe = torch.nn.Identity()  # no table to remove any more
    model.transformer.wpe.forward = lambda ids: torch.zeros(())  # type: ignore[method-assign]
    from equivariance_probe.errors import AttentionCaptureError

    with pytest.raises(AttentionCaptureError, match="no rotary embedding and no position-embedding table"):
        permutation_sensitivity(model, _prompts(1), n_permutations=2, ablations=("no_positions",))


def test_short_prompts_are_refused():
    with pytest.raises(InputError, match="fewer than 2 tokens to permute"):
        permute_middle(torch.arange(3), 2)


def test_shrinkage_exponent_of_an_exact_power_law():
    q = np.arange(50)
    gamma, scale, r2 = fit_shrinkage_exponent(3.0 * (q + 1.0) ** -0.7, q_min=0)
    assert gamma == pytest.approx(0.7, abs=1e-12) and scale == pytest.approx(3.0, rel=1e-12) and r2 == pytest.approx(1.0)


def _uniform_nope_gpt2(vocab: int = 1000) -> torch.nn.Module:
    """Random-init GPT-2 with no position code and zero query/key weights: every head is uniform causal."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=vocab, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, : 2 * 32].zero_()  # c_attn packs [q | k | v]
            block.attn.c_attn.bias[: 2 * 32].zero_()
    return model


def test_uniform_attention_over_iid_tokens_shrinks_variance_as_one_over_q_plus_one():
    model = _uniform_nope_gpt2()
    tokens = torch.randint(0, 1000, (256, 64), generator=torch.Generator().manual_seed(1))
    shrinkage = VarianceShrinkage.from_sums(representation_sums(model, tokens, batch_size=64))
    assert shrinkage.n_documents == 256
    assert shrinkage.exponent["attention"][0] == pytest.approx(1.0, abs=0.06)
    assert shrinkage.exponent_r2["attention"][0] > 0.99
    assert shrinkage.across_documents["attention"].shape == (2, 64)


def test_representation_sums_equal_direct_statistics_and_merge_over_batches():
    model = tiny_gpt2()
    tokens = _prompts(6, 10, seed=4)
    whole = representation_sums(model, tokens, batch_size=6)
    split = representation_sums(model, tokens, batch_size=4)
    np.testing.assert_allclose(split.variance_across_documents(), whole.variance_across_documents(), rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        states = model.transformer(tokens, output_hidden_states=True).hidden_states
    layer0 = states[1].double()  # the residual stream after block 0
    direct = layer0.var(0, unbiased=False).mean(-1).numpy()
    np.testing.assert_allclose(whole.variance_across_documents()[1, 0], direct, rtol=1e-6)
    np.testing.assert_allclose(whole.variance_across_dimensions()[1, 0], layer0.var(-1, unbiased=False).mean(0).numpy(), rtol=1e-6)


def test_position_correlation_of_running_means_has_its_closed_form():
    # x_q = mean of q+1 i.i.d. values: corr(x_i, x_j) = sqrt((i+1)/(j+1)) for i <= j.
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(20000, 8, 4, generator=generator, dtype=torch.float64)
    running = values.cumsum(1) / torch.arange(1, 9, dtype=torch.float64).view(1, -1, 1)
    sums = RepresentationSums.empty(1, 8, 4)
    sums.add(1, 0, running)
    sums.add_documents(20000)
    correlation = position_correlation(sums)[0]
    i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    expected = np.sqrt((np.minimum(i, j) + 1) / (np.maximum(i, j) + 1))
    np.testing.assert_allclose(correlation, expected, atol=0.02)
    np.testing.assert_allclose(np.diag(correlation), 1.0, atol=1e-12)


def test_a_position_that_is_the_same_in_every_document_has_no_variance_and_no_correlation():
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(50, 5, 7, generator=generator, dtype=torch.float64) * 3.0 + 11.0
    x[:, 0] = torch.linspace(-40.0, 40.0, 7, dtype=torch.float64) + 1e3  # a BOS: identical in every document
    sums = RepresentationSums.empty(1, 5, 7)
    sums.add(1, 0, x)
    sums.add_documents(50)
    variance = sums.variance_across_documents()[1, 0]
    assert variance[0] == 0.0
    np.testing.assert_allclose(variance[1:], x[:, 1:].var(0, unbiased=False).mean(-1).numpy(), rtol=1e-9)
    correlation = position_correlation(sums)[0]
    assert np.isnan(correlation[0]).all() and np.isnan(correlation[:, 0]).all()
    assert np.isfinite(correlation[1:, 1:]).all()
