"""TransformerLens 4.x TransformerBridge: same patterns and statistics as plain Hugging Face."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformer_lens")

from transformer_lens.model_bridge import TransformerBridge  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from equivariance_probe import EquivarianceProbe  # noqa: E402
from equivariance_probe.adapters import get_adapter  # noqa: E402
from equivariance_probe.adapters.huggingface import HuggingFaceAdapter  # noqa: E402
from equivariance_probe.adapters.transformer_lens import TransformerBridgeAdapter  # noqa: E402

from synthetic import collect_patterns, save_tiny_model_with_tokenizer  # noqa: E402


@pytest.fixture(scope="module", params=["gemma3", "gpt2"])
def models(request, tmp_path_factory):
    path = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp(request.param), kind=request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # boot_transformers modifies the model it is given in place: give it its own copy.
    bridge = TransformerBridge.boot_transformers(path, hf_model=copy.deepcopy(hf), tokenizer=tokenizer)
    return request.param, hf, bridge, tokenizer


def test_dispatch_layout_and_patterns_equal_hugging_face(models):
    kind, hf, bridge, _ = models
    adapter = get_adapter(bridge)
    assert isinstance(adapter, TransformerBridgeAdapter)
    reference = HuggingFaceAdapter(hf)
    assert adapter.layout == reference.layout
    if kind == "gemma3":
        assert adapter.layout.sliding_windows == (8, 8, None)
    tokens = torch.randint(3, 80, (2, 20), generator=torch.Generator().manual_seed(0))
    mine, theirs = collect_patterns(adapter, tokens), collect_patterns(reference, tokens)
    for layer in theirs:
        assert torch.allclose(mine[layer], theirs[layer], atol=1e-6), layer


def test_statistics_equal_hugging_face_and_unembed_is_skipped(models):
    kind, hf, bridge, tokenizer = models
    docs = ["the a of and to in is was " * 5, "w1 w2 w3 w4 of the w5 " * 4, "in is was for on as"]
    fired = []
    handle = bridge.unembed.register_forward_hook(lambda *args: fired.append(1))
    bridge.train()
    try:
        from_bridge = EquivarianceProbe(bridge).run(docs, context_length=32, batch_size=2, progress=False)
    finally:
        handle.remove()
    assert not fired and bridge.training
    bridge.eval()
    from_hf = EquivarianceProbe(hf, tokenizer=tokenizer).run(docs, context_length=32, batch_size=2, progress=False)
    assert from_bridge.n_tokens == from_hf.n_tokens
    for name, value in from_hf.statistics.arrays.items():
        assert torch.allclose(from_bridge.statistics.arrays[name], value, rtol=1e-5, atol=1e-6), name
    # Each window's first-token weight (Gu et al.'s per-window sink rate) too.
    mine, theirs = from_bridge.statistics.window_sinks, from_hf.statistics.window_sinks
    assert (mine.keys == theirs.keys).all() and torch.allclose(
        torch.from_numpy(mine.alpha), torch.from_numpy(theirs.alpha), rtol=1e-5, atol=1e-6)
    assert from_bridge.metadata["model"]["framework"] == "transformer_lens"
