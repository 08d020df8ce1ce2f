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
from equivariance_probe.maths.probing import FOLD_T, FOLD_T_CLIPPED, fold_interval, grouped_folds

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


def test_fold_interval_is_the_t_interval_over_folds():
    interval = fold_interval([1.0, 2.0, 3.0])
    from scipy.stats import t

    assert interval.estimate == 2.0 and interval.n_groups == 3 and interval.method == FOLD_T
    assert interval.high - 2.0 == pytest.approx(t.ppf(0.975, 2) * 1.0 / np.sqrt(3))
    clipped = fold_interval([0.9, 1.0, 1.0], upper=1.0)  # an R²'s interval never runs past 1
    assert clipped.high == 1.0 and clipped.method == FOLD_T_CLIPPED and clipped.low < 0.9
    with pytest.raises(InputError, match="at least 2 folds"):
        fold_interval([0.5])


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
