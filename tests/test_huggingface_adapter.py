"""The Hugging Face adapter: layout, eager switching, no change to the user's model."""

import copy

import pytest
import torch

from equivariance_probe import AttentionCaptureError, EquivarianceProbe
from equivariance_probe.adapters.huggingface import HuggingFaceAdapter, layer_windows
from equivariance_probe.adapters.passes import pattern_pass

from synthetic import collect_patterns, tiny_gemma3, tiny_gpt2, tiny_llama


def test_layouts_from_configs():
    assert HuggingFaceAdapter(tiny_gemma3(window=5)).layout.sliding_windows == (5, 5, None)
    llama = HuggingFaceAdapter(tiny_llama()).layout
    assert (llama.n_layers, llama.n_heads, llama.sliding_windows) == (2, 4, (None, None))
    gpt2 = HuggingFaceAdapter(tiny_gpt2(n_positions=48)).layout
    assert gpt2.max_context == 48

    class Mistral:
        sliding_window = 7
    assert layer_windows(Mistral(), 3) == (7, 7, 7)


def test_patterns_are_eager_weights_rows_sum_to_one_and_grouped_query_heads_are_query_heads():
    model = tiny_llama()
    tokens = torch.randint(3, 97, (2, 10))
    patterns = collect_patterns(HuggingFaceAdapter(model), tokens)
    assert set(patterns) == {0, 1}
    assert patterns[0].shape == (2, 4, 10, 10)
    assert torch.allclose(patterns[0].sum(-1), torch.ones(2, 4, 10), atol=1e-5)
    # Under sdpa output_attentions silently returns nothing: the adapter switched to eager for
    # the run; an eager copy asked the documented way gives the same weights.
    assert model.config._attn_implementation == "sdpa"
    assert not model(tokens, output_attentions=True).attentions
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reference = eager(tokens, output_attentions=True).attentions
    assert torch.allclose(patterns[1], reference[1], atol=1e-6)


def test_user_model_is_left_as_it_was():
    model = tiny_gpt2()
    model.train()
    before = model.config._attn_implementation
    state = {k: v.clone() for k, v in model.state_dict().items()}
    EquivarianceProbe(model).run(torch.randint(0, 97, (2, 8)), progress=False)
    assert model.training and model.config._attn_implementation == before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_training_mode_dropout_does_not_leak_into_statistics():
    model = tiny_gpt2()
    model.config.attn_pdrop = 0.5
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    tokens = torch.randint(0, 97, (2, 8))
    model.eval()
    evaluated = EquivarianceProbe(model).run(tokens, progress=False)
    model.train()
    trained = EquivarianceProbe(model).run(tokens, progress=False)
    assert torch.equal(evaluated.statistics.arrays["raw_sum"], trained.statistics.arrays["raw_sum"])


def test_vocabulary_projection_is_skipped():
    model = tiny_gpt2()
    fired = []
    handle = model.lm_head.register_forward_hook(lambda *args: fired.append(1))
    EquivarianceProbe(model).run(torch.randint(0, 97, (2, 8)), progress=False)
    handle.remove()
    assert not fired


def test_attention_that_cannot_be_captured_is_refused_with_the_fix():
    model = tiny_gpt2()
    adapter = HuggingFaceAdapter(model)
    adapter.attention_modules[0].forward = lambda *args, **kwargs: (torch.zeros(1), None)
    with pytest.raises(AttentionCaptureError, match="attn_implementation='eager'"):
        pattern_pass(adapter, torch.zeros((1, 4), dtype=torch.long), lambda layer, pattern: None)
