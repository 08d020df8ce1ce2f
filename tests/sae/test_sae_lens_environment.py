"""The environment a sparse-autoencoder researcher has: sae-lens 6 beside TransformerLens 3.9 (which sae-lens pins
below 4) and this package's [transformer-lens] extra, run in .venv-sae by tests/test_sae_environment.py.

TransformerLens 3.9 offers both the ``HookedTransformer`` (what sae-lens' ``HookedSAETransformer`` extends) and the
``TransformerBridge``; each is probed here against the Hugging Face run of the same weights, with an SAE from
sae-lens built in the same process, and a 3.9 bridge's replacement of transformers' Gemma attention is checked.
"""

from __future__ import annotations

import copy
import importlib.metadata

import pytest
import torch

from equivariance_probe import EquivarianceProbe, ReplacedAttentionFunctionError
from equivariance_probe.adapters import get_adapter
from equivariance_probe.adapters.internals import replaced_by
from equivariance_probe.adapters.transformer_lens import HookedTransformerAdapter, TransformerBridgeAdapter
from synthetic import save_tiny_model_with_tokenizer, tiny_gemma3, tiny_gpt2

TOKENS = torch.randint(3, 97, (4, 24), generator=torch.Generator().manual_seed(0))


def probe_arrays(model) -> dict[str, torch.Tensor]:
    result = EquivarianceProbe(model).run(TOKENS, context_length=24, batch_size=2, sample_size=0, progress=False)
    return result.statistics.arrays


def assert_same_statistics(found: dict, expected: dict, rtol: float = 1e-9) -> None:
    assert sorted(found) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=rtol, atol=1e-9, msg=name)


def test_the_environment_is_sae_lens_on_transformer_lens_3_9():
    assert importlib.metadata.version("transformer-lens").startswith("3.9")
    assert importlib.metadata.version("sae-lens").split(".")[0] == "6"
    from transformer_lens import HookedTransformer
    from transformer_lens.model_bridge import TransformerBridge

    assert HookedTransformer and TransformerBridge  # TransformerLens 3.9 has both


def hooked_gpt2(hf):
    """A 3.9 ``HookedSAETransformer`` (sae-lens' subclass of ``HookedTransformer``) holding ``hf``'s weights
    unprocessed (no folded norms, no centring), so its attention is the Hugging Face model's."""
    from sae_lens import HookedSAETransformer
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    config = hf.config
    cfg = HookedTransformerConfig(n_layers=config.n_layer, d_model=config.n_embd, n_heads=config.n_head,
                                  d_head=config.n_embd // config.n_head, d_mlp=4 * config.n_embd, d_vocab=config.vocab_size,
                                  n_ctx=config.n_positions, act_fn="gelu_new", normalization_type="LN",
                                  eps=config.layer_norm_epsilon, dtype=torch.float64)
    model = HookedSAETransformer(cfg)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)
    return model.eval()


def test_a_hooked_transformer_with_an_sae_spliced_in_gives_the_hugging_face_numbers():
    from sae_lens import StandardSAE, StandardSAEConfig

    hf = tiny_gpt2(n_positions=32).to(torch.float64)
    hf.set_attn_implementation("eager")
    expected = probe_arrays(hf)
    model = hooked_gpt2(hf)
    assert isinstance(get_adapter(model), HookedTransformerAdapter)
    assert_same_statistics(probe_arrays(model), expected)
    # An SAE on layer 1's input, spliced in with its error term: the residual it passes on is the one it was given
    # (up to float64 rounding), so the attention after it, and every number, stays the Hugging Face model's.
    torch.manual_seed(1)
    sae = StandardSAE(StandardSAEConfig(d_in=model.cfg.d_model, d_sae=4 * model.cfg.d_model, dtype="float64"))
    sae.cfg.metadata.hook_name = "blocks.1.hook_resid_pre"
    model.add_sae(sae, use_error_term=True)
    _, cache = model.run_with_cache(TOKENS[:1])
    assert "blocks.1.hook_resid_pre.hook_sae_acts_post" in cache  # the SAE ran inside the forward pass
    assert_same_statistics(probe_arrays(model), expected)


def test_a_transformer_bridge_gives_the_hugging_face_numbers(tmp_path):
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_model_with_tokenizer(tmp_path, kind="gpt2", n_positions=32)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float64).eval()
    bridge = TransformerBridge.boot_transformers(path, hf_model=copy.deepcopy(hf), tokenizer=AutoTokenizer.from_pretrained(path),
                                                 dtype=torch.float64)
    assert isinstance(get_adapter(bridge), TransformerBridgeAdapter)
    assert_same_statistics(probe_arrays(bridge), probe_arrays(hf))


def test_after_a_3_9_bridge_of_gemma_3_a_hugging_face_gemma_3_gives_its_numbers_or_a_named_refusal(tmp_path):
    import transformers.models.gemma3.modeling_gemma3 as gemma3
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    hf = tiny_gemma3(window=5).to(torch.float64)
    hf.set_attn_implementation("eager")
    expected = probe_arrays(hf)  # before any bridge: the function transformers ships
    assert replaced_by(gemma3.eager_attention_forward) is None
    path = save_tiny_model_with_tokenizer(tmp_path, kind="gemma3", n_positions=32)
    TransformerBridge.boot_transformers(path, tokenizer=AutoTokenizer.from_pretrained(path), dtype=torch.float64)
    # TransformerLens 3.9 leaves its own wrapper in transformers' Gemma 3 module for the rest of the process.
    replacement = replaced_by(gemma3.eager_attention_forward)
    assert replacement is not None and replacement.startswith("transformer_lens.")
    try:
        found = probe_arrays(hf)
    except ReplacedAttentionFunctionError as error:
        assert error.replaced_by == replacement and "TransformerLens" in str(error)
    else:
        assert_same_statistics(found, expected)
