"""TransformerLens 4 as it behaves: a bridge that keeps the model's own attention, and what booting one does.

For some architectures (JetMoE here; PhiMoE, Gemma 3n, Llama 4, Jamba, OLMo-hybrid and others in TransformerLens
4.3) the bridge delegates attention to the Hugging Face module and fires ``hook_attn_scores`` with the module's
*post-softmax* weights, where the reimplemented bridges (Gemma 3, Llama, Qwen2, GPT-2) fire pre-softmax scores.
Both kinds must give the Hugging Face model's numbers, in the main probe and in the shift test.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformer_lens")

from transformer_lens.model_bridge import TransformerBridge  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from synthetic import bridged_tiny_model, save_tiny_model_with_tokenizer  # noqa: E402
from test_shift_adapters import assert_same_in_float32, shift  # noqa: E402

from equivariance_probe import EquivarianceProbe  # noqa: E402
from equivariance_probe.adapters.transformer_lens import scores_from_weights  # noqa: E402
from equivariance_probe.errors import AttentionCaptureError  # noqa: E402


@pytest.fixture(scope="module", params=["jetmoe", "gemma3"])
def bridged(request, tmp_path_factory):
    return request.param, *bridged_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def test_the_adapter_knows_which_bridges_fire_weights_at_hook_attn_scores(bridged):
    kind, _, bridge, _ = bridged
    adapter = EquivarianceProbe(bridge).adapter
    fired = {}
    tokens = torch.randint(3, 80, (1, 9), generator=torch.Generator().manual_seed(1))
    hooks = [(f"blocks.0.attn.hook_{name}", lambda value, hook, name=name: fired.setdefault(name, value.detach()))
             for name in ("attn_scores", "pattern")]
    bridge.run_with_hooks(tokens, return_type=None, fwd_hooks=hooks)
    # What TransformerLens does, observed: the native bridge's "scores" are its pattern, rows summing to 1.
    carries_weights = torch.equal(fired["attn_scores"], fired["pattern"])
    assert carries_weights is (kind == "jetmoe")
    assert adapter.weights_as_scores == (carries_weights,) * adapter.layout.n_layers


def test_the_main_probe_through_either_bridge_equals_hugging_face(bridged):
    _, hf, bridge, tokenizer = bridged
    tokens = torch.randint(3, 80, (3, 24), generator=torch.Generator().manual_seed(0))
    options = {"context_length": 24, "batch_size": 3, "progress": False}
    expected = EquivarianceProbe(hf, tokenizer=tokenizer).run(tokens, **options)
    got = EquivarianceProbe(bridge).run(tokens, **options)
    for name, value in expected.statistics.arrays.items():
        # The bridge softmaxes in float32 as transformers' eager attention does for a float64 model.
        np.testing.assert_allclose(got.statistics.arrays[name].cpu().numpy(), value.cpu().numpy(), rtol=1e-6,
                                   atol=1e-9, err_msg=name)


@pytest.mark.parametrize("mode", ["text", "position_ids"])
def test_the_shift_test_through_either_bridge_equals_hugging_face(bridged, mode):
    kind, hf, bridge, tokenizer = bridged
    if kind == "gemma3":
        pytest.skip("the reimplemented bridges are compared in test_shift_adapters.py")
    expected = shift(EquivarianceProbe(hf, tokenizer=tokenizer), mode)
    got = shift(EquivarianceProbe(bridge), mode)
    # The module's eager attention softmaxes in float32 even for a float64 model, so the log-weights the bridge
    # hands over carry float32 rounding, where the Hugging Face adapter recomputes the scores in float64.
    assert_same_in_float32(got, expected)
    np.testing.assert_allclose(got.share("centred_logits", "offset", by="layer"),
                               expected.share("centred_logits", "offset", by="layer"), rtol=1e-5, atol=1e-9)
    assert "log-weights" in got.metadata["capture"]
    assert got.metadata["recompute_check"]["passed"] is True


def test_a_weight_that_underflowed_at_a_visible_key_is_refused_by_name():
    weights = torch.softmax(torch.randn(2, 3, 7, dtype=torch.float64), -1)
    weights[1, 2, 4] = 0.0  # segment row 2 is position 6 of the window: key 4 is visible to it
    with pytest.raises(AttentionCaptureError, match="layer 3's attention weights underflowed.*float64"):
        scores_from_weights(weights, 4, None, 3)
    weights[1, 2, 4] = 1e-3
    hidden = torch.tril(torch.ones(3, 7, dtype=torch.bool), diagonal=4)  # keys a causal row sees
    scores = scores_from_weights(weights * hidden, 4, None, 3)
    assert torch.isinf(scores[:, ~hidden]).all() and torch.isfinite(scores[:, hidden]).all()


def test_booting_a_bridge_changes_the_hugging_face_model_it_is_given(tmp_path):
    """What TransformerLens 4's boot_transformers does to a model passed as ``hf_model``: it switches the model to
    eager attention and puts its own components into the model's module tree. The package boots bridges only
    around models it loaded or built itself (load_model, random_init_like, zero_like); a user's own model stays
    as given."""
    from equivariance_probe import random_init_like, zero_like

    path = save_tiny_model_with_tokenizer(tmp_path, kind="gemma3")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    kept = copy.deepcopy(hf)
    bridge = TransformerBridge.boot_transformers(path, hf_model=hf, tokenizer=tokenizer)
    assert hf.config._attn_implementation == "eager" and kept.config._attn_implementation == "sdpa"
    assert type(hf.model.layers[0]).__name__ != type(kept.model.layers[0]).__name__
    # The package's baselines of a bridge leave the bridge and the model inside it as they were.
    modules = [type(module).__name__ for module in bridge.original_model.modules()]
    weights = {name: value.clone() for name, value in bridge.original_model.state_dict().items()}
    for build in (random_init_like, zero_like):
        baseline = build(bridge)
        assert baseline is not bridge and baseline.original_model is not bridge.original_model
    assert [type(module).__name__ for module in bridge.original_model.modules()] == modules
    for name, value in bridge.original_model.state_dict().items():
        assert torch.equal(value, weights[name]), name
