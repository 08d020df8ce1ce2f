"""Massive activations (Sun et al. 2024) against known answers: one planted coordinate is found at its
position and dimension with its exact ratio to the median; streamed batches and merged halves equal one
pass; the positional study keeps, saves, tabulates and draws them, trained beside untrained."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe.analyses.order import representation_sums
from equivariance_probe.statistics.massive import MassiveActivationSums

from synthetic import tiny_gpt2

transformers = pytest.importorskip("transformers")

POSITION, DIMENSION, SIZE = 5, 17, 1000.0


def _planted(n_layer: int = 2):
    """A GPT-2 whose residual stream is 1 in every coordinate, but ``1 + SIZE`` at (POSITION, DIMENSION):
    every token embedding is all ones, the position table zero but for the planted entry, and every
    block's output projections zero (each block passes its input through)."""
    model = tiny_gpt2(n_layer=n_layer).double()
    with torch.no_grad():
        model.transformer.wte.weight.fill_(1.0)
        model.transformer.wpe.weight.zero_()
        model.transformer.wpe.weight[POSITION, DIMENSION] = SIZE
        for block in model.transformer.h:
            for projection in (block.attn.c_proj, block.mlp.c_proj):
                projection.weight.zero_()
                projection.bias.zero_()
    return model


def _tokens(n: int, length: int = 12) -> torch.Tensor:
    return torch.randint(3, 97, (n, length), generator=torch.Generator().manual_seed(0))


def _massive(model, tokens, batch_size: int = 2) -> MassiveActivationSums:
    massive = MassiveActivationSums.empty(len(model.transformer.h), tokens.shape[1], 32)
    representation_sums(model, tokens, batch_size=batch_size, massive=massive)
    return massive


def test_a_planted_coordinate_is_found_exactly_with_its_exact_ratio():
    summary = _massive(_planted(), _tokens(6)).summary()
    assert summary["n_windows"] == 6
    assert summary["position"] == [POSITION, POSITION] and summary["dimension"] == [DIMENSION, DIMENSION]
    assert summary["position_share"] == [1.0, 1.0] and summary["dimension_share"] == [1.0, 1.0]
    assert summary["top"] == [[1.0 + SIZE, 1.0, 1.0]] * 2  # |h| = 1 everywhere else
    assert summary["median"] == [1.0, 1.0] and summary["ratio"] == [1.0 + SIZE, 1.0 + SIZE]


def test_streamed_batches_and_merged_halves_equal_one_pass():
    model = tiny_gpt2(n_layer=2).double()
    tokens = _tokens(8)
    whole = _massive(model, tokens, batch_size=8)
    merged = _massive(model, tokens[:3], batch_size=2).merge(_massive(model, tokens[3:], batch_size=1))
    for name in ("top", "median", "position", "dimension"):
        torch.testing.assert_close(getattr(merged, name), getattr(whole, name), rtol=1e-12, atol=0)
    # By hand: the median and the largest |h| of each window's block-1 output, averaged over windows.
    with torch.no_grad():
        hidden = model.transformer(input_ids=tokens, output_hidden_states=True).hidden_states[1].abs()
    flat = hidden.reshape(8, -1).numpy()
    assert whole.summary()["median"][0] == pytest.approx(float(np.median(flat, axis=1).mean()), rel=1e-12)
    assert whole.summary()["top"][0][0] == pytest.approx(float(flat.max(1).mean()), rel=1e-12)
    loaded = MassiveActivationSums.from_dict(whole.to_dict())
    assert loaded.summary() == whole.summary()


def test_the_study_keeps_saves_and_shows_them_trained_beside_untrained(tmp_path):
    from equivariance_probe.display.positional import positional_figures, render_positional_section
    from equivariance_probe.runs.positional import PositionalStudy, run_positional

    study = run_positional(_planted(), docs=_tokens(4, 16), n_docs=4, context_length=16, analyses=("massive",),
                           progress=False)
    assert set(study.parts) == {"massive", "massive_baseline"}
    assert study.summary()["massive"]["ratio"] == [1.0 + SIZE, 1.0 + SIZE]
    loaded = PositionalStudy.load(study.save(tmp_path))
    assert loaded.summary()["massive"] == study.summary()["massive"]
    assert "massive activations (trained)" in loaded.table() and "position 5" in loaded.table()
    rows = [row for row in loaded.to_rows() if row["statistic"] == "massive_ratio"]
    assert {row["variant"] for row in rows} == {"trained", "random_init"}
    assert [row["value"] for row in rows if row["variant"] == "trained"] == [1.0 + SIZE, 1.0 + SIZE]
    assert "massive" in positional_figures(loaded)
    assert "Massive activations" in str(render_positional_section(loaded))
