"""Site ``"qk.{l}"`` (the queries and keys as transformers' attention call receives them) on every framework.

Through a TransformerBridge, whose attention components compute the scores themselves, the call is formed from
the bridge's own hook points; on a remote nnsight model it is read inside the trace and reduced there. Both
equal the Hugging Face interception, and so does the score profile that reads it. Tiny models built from
configs; no network.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe.adapters import adapter_of
from equivariance_probe.adapters.internals import intercept_attention
from equivariance_probe.adapters.plan import Read
from equivariance_probe.analyses.positional import score_profile
from equivariance_probe.errors import AttentionCaptureError

transformers = pytest.importorskip("transformers")

from synthetic import bridged_tiny_model, save_tiny_model_with_tokenizer, tiny_gemma3  # noqa: E402


def _windows(n: int = 3, width: int = 12) -> torch.Tensor:
    tokens = torch.randint(3, 60, (n, width), generator=torch.Generator().manual_seed(7))
    tokens[:, 0] = 1
    return tokens


@pytest.fixture(scope="module", params=["gemma3", "llama", "gpt2"])
def bridged(request, tmp_path_factory):
    pytest.importorskip("transformer_lens")
    return request.param, *bridged_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def test_the_bridge_hands_the_attention_call_that_hugging_face_intercepts(bridged):
    """Rotated queries and keys (after Gemma 3's q/k-norm), the keys' own heads, the mask, the scale and soft cap:
    in float64 equal to the interception of transformers' call in the model the bridge wraps."""
    _, hf, bridge, _ = bridged
    tokens = _windows()
    expected, got = {}, {}
    with intercept_attention(hf, lambda call: expected.setdefault(call.layer, call)), torch.no_grad():
        hf(tokens)
    adapter = adapter_of(bridge)
    plan = adapter.plan([(f"qk.{layer}", Read(lambda call: got.setdefault(call.layer, call)))
                         for layer in range(adapter.layout.n_layers)])
    adapter.check_plan(plan)
    adapter.run_plan(tokens, plan)
    assert sorted(got) == sorted(expected) == list(range(adapter.layout.n_layers))
    for layer, call in expected.items():
        mine = got[layer]
        assert mine.query.shape == call.query.shape and mine.key.shape == call.key.shape
        assert (mine.scaling, mine.softcap) == (call.scaling, call.softcap)
        assert torch.equal(mine.attention_mask, call.attention_mask)  # transformers' additive mask, window included
        torch.testing.assert_close(mine.query, call.query, rtol=0, atol=1e-12)
        torch.testing.assert_close(mine.key, call.key, rtol=0, atol=1e-12)


@pytest.mark.parametrize("exclude_keys", [(), (0,)])
def test_score_profile_through_a_bridge_equals_hugging_face(bridged, exclude_keys):
    kind, hf, bridge, _ = bridged
    if kind == "gpt2" and exclude_keys:
        pytest.skip("one learned-position model is enough for the sink's exclusion")
    tokens = _windows(5)
    expected = score_profile(hf, tokens, batch_size=2, exclude_keys=exclude_keys)
    got = score_profile(bridge, tokens, batch_size=2, exclude_keys=exclude_keys)
    np.testing.assert_array_equal(got.counts, expected.counts)
    np.testing.assert_allclose(got.sums, expected.sums, rtol=0, atol=1e-12)
    if kind == "gemma3":  # layers 0 and 1 slide over 8 keys: no entry at lag 8 or more
        assert not got.counts[:2, :, 12 - 1 + 8:].any() and got.counts[2, :, 12 - 1 + 8:].any()


def test_a_bridge_whose_hooks_do_not_carry_the_call_refuses_it_by_name_before_any_pass(tmp_path):
    """JetMoE's bridge keeps the model's own attention: it has no hooks on the call's queries and keys."""
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    path = save_tiny_model_with_tokenizer(tmp_path, kind="jetmoe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    bridge = TransformerBridge.boot_transformers(path, hf_model=hf,
                                                 tokenizer=transformers.AutoTokenizer.from_pretrained(path))
    fired = []
    handle = bridge.blocks[0].register_forward_hook(lambda *args: fired.append(1))
    try:
        with pytest.raises(AttentionCaptureError, match=r"site 'qk.0'.*attention component \w+ replaces"):
            score_profile(bridge, _windows(1))
    finally:
        handle.remove()
    assert not fired


def test_score_profile_on_the_remote_path_equals_hugging_face_and_only_the_profiles_travel(monkeypatch):
    """nnsight's ``remote="local"`` serialises each request as for a server: the attention call is read there and
    reduced to each layer's profile sums by the analysis' own function, shipped by value."""
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.adapters.nnsight_remote import PLAN_FUNCTIONS
    from test_nnsight_adapter import assert_payload_imports_only_torch_math_collections, recorded_payloads, tiny_tokenizer

    blobs = recorded_payloads(monkeypatch)
    hf = tiny_gemma3(window=4).to(torch.float64).eval()
    model = TransformersModel(hf, tokenizer=tiny_tokenizer())
    tokens = _windows(3)
    got = score_profile(NNsightAdapter(model, remote="local"), tokens, batch_size=3, exclude_keys=[0])
    expected = score_profile(hf, tokens, batch_size=3, exclude_keys=[0])
    np.testing.assert_array_equal(got.counts, expected.counts)
    # Layer 0 reads the same float64 queries and keys. The server runs its own kernel (sdpa), the local run eager
    # attention, whose softmax Gemma takes in float32: later layers' inputs differ by float32 rounding.
    np.testing.assert_allclose(got.sums[0], expected.sums[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.sums, expected.sums, rtol=1e-5, atol=1e-6)
    shipped = (*PLAN_FUNCTIONS, "score_profile.profile", "in_trace.visible_from_mask", "in_trace.diagonal_profile_sums")
    assert len(blobs) == 1
    assert_payload_imports_only_torch_math_collections(blobs[0], model, shipped)
