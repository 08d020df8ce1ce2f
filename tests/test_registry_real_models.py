"""Every packaged model loads offline and every adapter reads its attention as plain HF does (slow).

For each registry entry: ``load_model(name)`` converts it once (first run: the GGUF file from
its package, dequantised, saved, checked) into the default cache, with no network; the model
is a trained language model (its next-token loss on an English sentence is far below that of
a uniform guess, ``ln V``); and the attention captured through each adapter (Hugging Face
hooks, TransformerLens bridge, nnsight) equals the weights plain Hugging Face eager attention
returns with ``output_attentions=True``. One model is in memory at a time.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from synthetic import collect_patterns

from equivariance_probe import get_adapter, load_model
from equivariance_probe.sources.registry import REGISTRY

TEXT = (
    "Albedo is the fraction of sunlight that a surface reflects. Fresh snow reflects most of the light "
    "that falls on it, while the open ocean absorbs almost all of it."
)
ARCHITECTURES = {"gemma-3-270m": "Gemma3ForCausalLM", "smollm2-135m-instruct": "LlamaForCausalLM",
                 "qwen2.5-coder-0.5b-instruct": "Qwen2ForCausalLM"}
WINDOW = 12  # tokens: a short window, every layer full causal


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REGISTRY))
def test_packaged_model_loads_offline_and_adapters_agree_with_plain_eager_attention(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    model, tokenizer = load_model(name)
    assert type(model).__name__ == ARCHITECTURES[name] == model.config.architectures[0]
    assert model.config._attn_implementation == "eager" and not model.training
    assert getattr(model.config, "quantization_config", None) is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    encoded = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(encoded, labels=encoded).loss.item()
    assert loss < 0.5 * math.log(model.config.vocab_size), f"{name}: loss {loss:.2f} is not a trained model's"

    ids = encoded[:, :WINDOW]
    with torch.no_grad():
        reference = [a[0].clone() for a in model(ids, output_attentions=True).attentions]  # [head, query, key]
    assert len(reference) == model.config.num_hidden_layers
    patterns = collect_patterns(get_adapter(model, tokenizer=tokenizer), ids)
    for layer, expected in enumerate(reference):
        torch.testing.assert_close(patterns[layer][0].float(), expected, rtol=0, atol=1e-6)
    del model, patterns
    gc.collect()

    for backend in ("transformer_lens", "nnsight"):
        wrapped, _ = load_model(name, framework=backend)
        patterns = collect_patterns(get_adapter(wrapped, tokenizer=tokenizer), ids)
        assert sorted(patterns) == list(range(len(reference))), backend
        for layer, expected in enumerate(reference):
            torch.testing.assert_close(patterns[layer][0].float(), expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, b=backend, l=layer: f"{name} {b} layer {l}: {m}")
        del wrapped, patterns
        gc.collect()
