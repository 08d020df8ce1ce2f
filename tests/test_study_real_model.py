"""The study command on the real packaged Gemma 3 270M (slow: CI runs it)."""

from __future__ import annotations

import pytest

from equivariance_probe import ProbeResult
from equivariance_probe.cli import main


@pytest.mark.slow
def test_two_document_study_at_context_256_writes_every_output(tmp_path, capsys):
    out = tmp_path / "study"
    assert main(["run", "--out", str(out), "--n-docs", "2", "--context-length", "256", "--no-progress"]) == 0
    for name in ("results.safetensors", "baseline_random_init.safetensors", "baseline_zero.safetensors", "summary.md", "persistence.png",
                 "head_curves.png", "fit_by_key.png", "scatter.png", "heatmaps.png"):
        assert (out / name).stat().st_size > 0, name
    trained = ProbeResult.load(out / "results.safetensors")
    assert (trained.n_layers, trained.n_heads) == (18, 4)
    assert trained.statistics.sliding_windows.count(None) == 18  # sliding window 512 >= context 256: all full causal
    zero = ProbeResult.load(out / "baseline_zero.safetensors")
    assert zero.query_position_r2("log", "eta2") == pytest.approx(1.0, abs=1e-9)
    assert "| log | fitted |" in capsys.readouterr().out


@pytest.mark.slow
def test_gemma_sliding_layers_at_context_above_the_window():
    from equivariance_probe import EquivarianceProbe, load_corpus, load_model

    model, tokenizer = load_model()
    docs = [d for d in load_corpus(n_docs=20) if len(tokenizer(d)["input_ids"]) > 600][:1]
    result = EquivarianceProbe(model, tokenizer=tokenizer).run(docs, context_length=600, progress=False)
    windows = result.statistics.sliding_windows
    assert windows.count(512) == 15 and windows.count(None) == 3  # Gemma 3: 5 local layers per global one
    counts = result.statistics.arrays["query_count"]
    assert float(counts[0, 599]) == 512 and float(counts[5, 599]) == 600


@pytest.mark.slow
def test_gemma_gives_the_same_numbers_loaded_eager_or_sdpa():
    """The probe reads queries and keys whatever kernel the model runs: the two kernels differ only in
    the float32 rounding of each layer's attention output, which later layers' queries inherit."""
    import numpy as np

    from equivariance_probe import EquivarianceProbe, load_corpus, load_model

    docs = load_corpus(n_docs=3)
    results = {}
    for kernel in ("eager", "sdpa"):
        model, tokenizer = load_model(attn_implementation=kernel)
        results[kernel] = EquivarianceProbe(model, tokenizer=tokenizer).run(docs, context_length=600, batch_size=3,
                                                                          progress=False)
        assert results[kernel].metadata["engine"]["source"] == "recompute"
    eager, sdpa = results["eager"], results["sdpa"]
    for name, value in eager.statistics.arrays.items():
        other = sdpa.statistics.arrays[name]
        assert np.allclose(value.numpy(), other.numpy(), rtol=1e-4, atol=1e-6 * float(value.abs().max())), name
    for scale in ("log", "raw"):
        for form in ("prior", "fitted", "eta2"):
            assert sdpa.query_position_r2(scale, form) == pytest.approx(eager.query_position_r2(scale, form), rel=1e-5)
