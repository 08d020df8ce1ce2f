"""Precision and devices: bf16/fp16 models through the log floor and the floored-entry
count, checked against the model's own attention; device selection; what results record."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, InputError, zero_like
from equivariance_probe.sources.devices import parse_dtype, resolve_device
from equivariance_probe.records.provenance import model_identity

from synthetic import tiny_gemma3, tiny_gpt2


def _peaky_gpt2(dtype: torch.dtype):
    """Tiny GPT-2 with large query/key weights: sharp attention, many weights below fp16's smallest normal."""
    model = tiny_gpt2(n_positions=32)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:, :64] *= 40
        model.transformer.h[1].attn.c_attn.weight[:, :64] *= 40
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_floors_and_counts_exactly_what_the_model_produces(dtype):
    model = _peaky_gpt2(dtype)
    tokens = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(0))
    # From the eager weights the model returns; recomputed from its queries and keys (float32 scores)
    # below, which agrees to the bf16/fp16 rounding of the eager scores.
    result = EquivarianceProbe(model, pattern_source="weights").run(tokens, progress=False)
    recomputed = EquivarianceProbe(model, pattern_source="recompute").run(tokens, progress=False)
    eps = torch.finfo(dtype).tiny
    assert result.log_floor == eps and result.metadata["model"]["dtype"] == str(dtype).replace("torch.", "")
    # Brute force over the attention the model itself returns (same eager weights, upcast as the probe does).
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(tokens, output_attentions=True).attentions
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    floored = np.array([[int(((a[:, h].float() < eps) & causal).sum()) for h in range(4)] for a in attentions])
    log_sum = np.stack([torch.where(causal, a.float().clamp_min(eps).log(), 0.0).sum((0, 3)).double().numpy()
                        for a in attentions])
    assert np.array_equal(result.floored(by="head"), floored)
    assert np.allclose(result.statistics.numpy()["log_sum"], log_sum, rtol=1e-5)
    assert recomputed.log_floor == eps
    assert np.allclose(recomputed.statistics.numpy()["log_sum"], log_sum, rtol=1e-2)
    if dtype == torch.float16:
        assert result.floored() > 0  # 6.1e-5 is a real floor for fp16; bf16 reaches 1.2e-38
    assert np.isfinite(result.query_position_r2("log", "eta2"))


def test_a_bf16_model_with_uniform_attention_gives_r2_one():
    """Zero weights make every head uniform; bf16 rounds 1/|V(q)| the same within a row, so within-group
    variance is exactly zero (η² = 1) and the fitted line and the prior miss only by bf16 rounding."""
    model = zero_like(tiny_gemma3(window=6).to(torch.bfloat16))
    result = EquivarianceProbe(model).run(torch.randint(3, 97, (2, 20)), progress=False)
    assert result.floored() == 0 and result.log_floor == torch.finfo(torch.bfloat16).tiny
    for scale in ("log", "raw"):
        assert result.query_position_r2(scale, "eta2") == pytest.approx(1.0, abs=1e-12)
        # x = 1/|V(q)| exactly, y = its bf16 rounding (relative error up to 2^-9): the line misses by that.
        assert result.query_position_r2(scale, "fitted") == pytest.approx(1.0, abs=1e-4)
        assert result.query_position_r2(scale, "prior") == pytest.approx(1.0, abs=1e-4)


def test_results_record_dtype_device_versions_and_revision(tmp_path):
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    metadata = EquivarianceProbe(loaded).run(torch.randint(0, 97, (1, 8)), progress=False).metadata
    assert metadata["model"]["dtype"] == "float32" and metadata["model"]["device"] == "cpu"
    assert {"torch", "transformers", "numpy", "equivariance-probe"} <= set(metadata["versions"])
    revision = metadata["model"]["revision"]
    assert revision["name_or_path"] == str(tmp_path / "m") and len(revision["config_sha256"]) == 64
    # The same weights loaded twice have one identity; other weights or another dtype do not.
    assert model_identity(loaded)["weights_sha256"] == model_identity(model)["weights_sha256"]
    assert model_identity(tiny_gpt2(seed=1))["weights_sha256"] != model_identity(model)["weights_sha256"]
    assert model_identity(tiny_gpt2().to(torch.bfloat16))["weights_sha256"] != model_identity(model)["weights_sha256"]


def test_device_selection(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device(None)
    with pytest.raises(InputError, match="no CUDA GPU.*device='cpu'"):
        resolve_device("cuda")
    with pytest.raises(InputError, match="not a torch device"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda:1")
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun: one process per GPU
    assert resolve_device("auto") == torch.device("cuda:3")
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(None) is torch.float32
    with pytest.raises(InputError, match="float64"):
        parse_dtype("float64")


def test_cli_dtype_option(tmp_path, tiny_model_folder, text_corpus):
    from equivariance_probe import ProbeResult
    from equivariance_probe.cli import main

    model = tiny_model_folder("gemma3", 64)
    corpus = text_corpus(n_docs=2, words=20)
    assert main(["run", "--out", str(tmp_path / "out"), "--model", model, "--corpus", corpus, "--n-docs", "2",
                 "--context-length", "16", "--baselines", "none", "--no-progress", "--no-figures",
                 "--dtype", "bfloat16", "--device", "cpu"]) == 0
    result = ProbeResult.load(tmp_path / "out" / "results.safetensors")
    assert result.metadata["model"]["dtype"] == "bfloat16" and result.log_floor == torch.finfo(torch.bfloat16).tiny
    assert result.metadata["provenance"]["model"]["dtype"] == "bfloat16"
