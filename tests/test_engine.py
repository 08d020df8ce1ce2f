"""The engine end to end: statistics from queries and keys equal those from captured weights, the
model keeps its own attention kernel, what the recomputation cannot model falls back to weights,
and the key-bin state gives the key-conditioned curves exactly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from equivariance_probe import AttentionCaptureError, EngineCheckError, EquivarianceProbe, ProbeResult
from equivariance_probe.statistics.masks import key_bin_edges

from synthetic import tiny_gemma3, tiny_gpt2, tiny_llama

BUILDERS = {"gemma3-sliding": lambda: tiny_gemma3(window=8), "llama-gqa": tiny_llama, "gpt2": tiny_gpt2}


def _windows() -> list[torch.Tensor]:
    tokens = torch.randint(3, 90, (5, 24), generator=torch.Generator().manual_seed(1))
    return [tokens[i, : 24 - 3 * i] for i in range(5)]  # ragged lengths: right padding in a batch


def _assert_close(a, b, rtol=2e-6) -> None:
    assert (a.n_windows, a.n_tokens) == (b.n_windows, b.n_tokens)
    for name, value in a.statistics.arrays.items():
        other = b.statistics.arrays[name]
        scale = float(value.abs().max()) or 1.0
        assert float((value - other).abs().max()) <= rtol * scale, name


@pytest.mark.parametrize("name", BUILDERS)
def test_recomputed_from_queries_and_keys_equals_captured_weights(name):
    model = BUILDERS[name]()
    options = dict(context_length=24, batch_size=2, exclude_keys=[0, 5], keep_pattern=True, progress=False)
    weights = EquivarianceProbe(model, pattern_source="weights").run(_windows(), **options)
    recomputed = EquivarianceProbe(model, pattern_source="recompute").run(_windows(), **options)
    _assert_close(recomputed, weights)
    assert recomputed.metadata["engine"]["source"] == "recompute" and recomputed.metadata["engine"]["paths"] == {
        "torch": model.config.num_hidden_layers * 3}
    assert weights.metadata["engine"]["paths"] == {"weights": model.config.num_hidden_layers * 3}
    for scale in ("log", "raw"):
        for form in ("prior", "fitted", "eta2"):
            assert recomputed.query_position_r2(scale, form) == pytest.approx(weights.query_position_r2(scale, form), abs=1e-6)


def test_a_model_keeps_its_own_kernel_and_agrees_with_eager():
    from transformers.integrations import sdpa_attention

    model = tiny_llama()
    model.set_attn_implementation("sdpa")
    calls = []
    original = sdpa_attention.sdpa_attention_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register("sdpa", spy)
    try:
        fused = EquivarianceProbe(model).run(_windows(), batch_size=2, progress=False)
    finally:
        ALL_ATTENTION_FUNCTIONS.register("sdpa", original)
    assert calls and model.config._attn_implementation == "sdpa"  # ran sdpa; never switched to eager
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    _assert_close(fused, EquivarianceProbe(eager).run(_windows(), batch_size=2, progress=False), rtol=1e-5)


def _alibi(model):
    """Add an ALiBi-style bias (slope · -(q - k)) to every attention mask: attention the recomputation,
    which reads only q, k, the scale and the causal mask, cannot model."""

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        n = kwargs["hidden_states"].shape[1]
        distance = (torch.arange(n).view(-1, 1) - torch.arange(n).view(1, -1)).clamp_min(0).float()
        bias = -0.5 * distance
        causal = torch.where(torch.arange(n).view(1, -1) <= torch.arange(n).view(-1, 1), 0.0, float("-inf"))
        kwargs["attention_mask"] = (causal + bias)[None, None] if mask is None or mask.dtype == torch.bool else mask + bias
        return args, kwargs

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def test_attention_the_recomputation_cannot_model_falls_back_to_weights():
    model = _alibi(tiny_llama())
    model.set_attn_implementation("eager")
    with pytest.warns(UserWarning, match="differ from its own eager weights"):
        auto = EquivarianceProbe(model).run(_windows(), batch_size=2, progress=False)
    assert auto.metadata["engine"]["source"] == "weights"
    assert auto.metadata["engine"]["check"]["max_difference"] > auto.metadata["engine"]["check"]["tolerance"]
    weights = EquivarianceProbe(model, pattern_source="weights").run(_windows(), batch_size=2, progress=False)
    _assert_close(auto, weights, rtol=0)
    with pytest.raises(AttentionCaptureError, match="differ from its own eager weights.*pattern_source='weights'"):
        EquivarianceProbe(model, pattern_source="recompute").run(_windows(), batch_size=2, progress=False)


@pytest.mark.parametrize("n_positions", [32, 128])
def test_key_bins_give_the_key_conditioned_curves_exactly(n_positions):
    """P_t(dt) by key bin from the binned state equals the same curves summed from the whole pattern."""
    model = tiny_llama()
    tokens = torch.randint(3, 90, (3, n_positions), generator=torch.Generator().manual_seed(2))
    result = EquivarianceProbe(model).run(tokens, keep_pattern=True, progress=False)
    stored = result.statistics.key_bins
    assert stored == min(n_positions, 64)
    curves = result.persistence(by="key_position", bins=16)
    assert np.array_equal(curves.key_bins, key_bin_edges(n_positions, 16).numpy())
    # Brute force: the batch-summed pattern (query-key layout), summed over heads and layers, by key bin and lag.
    pattern = result.statistics.arrays["pattern_sum"].sum((0, 1)).numpy()  # [q, k]
    expected = np.zeros((16, n_positions))
    for q in range(n_positions):
        for k in range(q + 1):
            expected[np.searchsorted(curves.key_bins, k, side="right") - 1, q - k] += pattern[q, k]
    summed = np.where(curves.count > 0, curves.curve * curves.count, 0.0)  # the curve is NaN where no entry is
    assert np.allclose(summed, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["gemma3-sliding", "llama-gqa"])
def test_first_batch_checks_the_engine_against_a_float64_reduction_of_the_models_own_weights(name, dtype, tmp_path):
    from equivariance_probe.statistics.engine_check import CHECKED_SUMS, engine_tolerance

    model = BUILDERS[name]().to(dtype)
    model.set_attn_implementation("sdpa")
    result = EquivarianceProbe(model).run(_windows(), batch_size=2, progress=False)
    check = result.metadata["engine"]["engine_check"]
    assert check["passed"] and check["engine"] == "torch" and check["option"] == "auto"
    assert check["tokens"] == 24 and check["dtype"] == str(dtype).replace("torch.", "")
    assert check["tolerance"] == engine_tolerance(dtype) and set(check["worst"]) == set(CHECKED_SUMS)
    assert max(check["worst"].values()) == check["max_difference"] <= check["tolerance"]
    assert check["max_difference"] < 1e-5  # float32 rounding only: far inside the tolerance
    result.save(tmp_path / "run.safetensors")
    assert ProbeResult.load(tmp_path / "run.safetensors").metadata["engine"]["engine_check"] == check


def _shift_lags(sums_of):
    """Wrap an engine so that its lag sums land one lag too far: the kind of error a kernel can make."""

    def wrong(*args, **kwargs):
        sums = sums_of(*args, **kwargs)
        sums["lag_sum"] = torch.roll(sums["lag_sum"], 1, dims=-1)
        return sums

    return wrong


def test_an_engine_whose_sums_are_wrong_is_stopped_by_name_and_nothing_is_added(monkeypatch):
    from equivariance_probe.statistics import engines

    monkeypatch.setattr(engines, "attention_sums_from_qk", _shift_lags(engines.attention_sums_from_qk))
    probe = EquivarianceProbe(tiny_llama())
    with pytest.raises(EngineCheckError, match=r"torch engine's sums differ .* layer \d+'s lag_sum by .* relative "
                       r"\(tolerance 0.0001 for float32\).*pattern_source='weights'") as caught:
        probe.run(_windows(), batch_size=2, progress=False)
    assert caught.value.comparison["worst_sum"] == "lag_sum" and not caught.value.comparison["passed"]
    assert caught.value.partial_result.n_windows == 0
    assert caught.value.partial_result.metadata["complete"] is False
    # the weights path never goes through the engine, so it is the way round
    fallback = EquivarianceProbe(tiny_llama(), pattern_source="weights").run(_windows(), batch_size=2, progress=False)
    assert fallback.metadata["engine"]["engine_check"] == {}


def test_a_failing_fused_engine_names_the_torch_path_as_the_fix():
    """The message of a mismatch on the fused kernel's path (a GPU) names engine='torch'."""
    from equivariance_probe.statistics import AttentionStatistics
    from equivariance_probe.statistics.engine_check import EngineCheck

    statistics = AttentionStatistics(n_layers=1, n_heads=4, n_positions=16, sliding_windows=[None])
    check = EngineCheck(statistics, 16, torch.float32)
    query, key = torch.randn(1, 4, 16, 8, dtype=torch.float32), torch.randn(1, 2, 16, 8, dtype=torch.float32)
    scores = (query @ key.repeat_interleave(2, dim=1).transpose(-1, -2)) * 8**-0.5
    weights = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    check.add_layer(0, query, key, weights.flip(-1).tril())  # weights the engine cannot have computed
    check.checked.paths = {"triton": 1}  # as on a GPU
    with pytest.raises(EngineCheckError, match="triton engine's sums differ.*engine='torch'"):
        check.finish()


def test_a_fused_kernel_that_cannot_run_is_named_once(monkeypatch):
    from equivariance_probe.statistics import engines

    monkeypatch.setattr(engines, "_warned_triton_unavailable", False)
    monkeypatch.setattr(engines, "_TRITON_FAILURE", RuntimeError("PTX .version 9.9 does not support .target sm_120"))
    with pytest.warns(RuntimeWarning, match=r"fused Triton kernel cannot run here \(RuntimeError: PTX .version 9.9"):
        engines.warn_triton_unavailable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engines.warn_triton_unavailable()  # once per process


def test_nan_attention_in_a_later_layer_is_non_finite_attention_not_an_engine_mismatch():
    """Python's max skips a NaN that is not first: NaN weights in layer 1 must still read as non-finite."""
    from equivariance_probe import NonFiniteAttentionError

    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteAttentionError):
        EquivarianceProbe(model).run(_windows(), batch_size=2, progress=False)


def test_a_local_nnsight_run_checks_its_engine_too():
    nnsight = pytest.importorskip("nnsight")

    model = tiny_llama()
    model.set_attn_implementation("sdpa")
    wrapped = nnsight.NNsight(model)
    result = EquivarianceProbe(wrapped, pattern_source="recompute").run(_windows(), batch_size=2, progress=False)
    check = result.metadata["engine"]["engine_check"]
    assert check["passed"] and check["engine"] == "torch" and check["max_difference"] < 1e-5
