"""Inputs, tokenisation, and every refused input with its message."""

import pytest
import torch

from equivariance_probe import (
    AttentionCaptureError,
    ContextLengthError,
    EmptyCorpusError,
    EquivarianceProbe,
    InputError,
    NonFiniteAttentionError,
    UnsupportedModelError,
)

from synthetic import SyntheticAdapter, tiny_gpt2, uniform_pattern


class ByteTokenizer:
    """Hugging Face-style tokenizer: a BOS id, then bytes modulo the vocabulary."""

    def __call__(self, text, add_special_tokens=True):
        ids = [3 + b % 90 for b in text.encode()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_strings_are_tokenised_with_special_tokens_and_truncated():
    probe = EquivarianceProbe(tiny_gpt2(), tokenizer=ByteTokenizer())
    result = probe.run(["a" * 100, "short text", "", "   "], context_length=32, batch_size=2, progress=False)
    assert result.n_windows == 2
    assert result.n_tokens == 32 + 11  # BOS + 10 bytes
    assert result.metadata["skipped_windows"] == 2
    assert result.metadata["context_length"] == 32


def test_iterables_of_tensors_and_lists_and_generators_are_accepted():
    probe = EquivarianceProbe(tiny_gpt2())
    tokens = torch.randint(0, 97, (5, 12))
    expected = probe.run(tokens, progress=False)
    generator = (row for row in tokens)
    from_generator = probe.run(generator, context_length=12, progress=False)
    from_lists = probe.run([row.tolist() for row in tokens], context_length=12, progress=False)
    for other in (from_generator, from_lists):
        for name, value in expected.statistics.arrays.items():
            assert torch.allclose(other.statistics.arrays[name], value, rtol=1e-9, atol=1e-12)


def test_unsupported_model_lists_supported_types():
    with pytest.raises(UnsupportedModelError, match="TransformerBridge.*HookedTransformer.*nnsight.*PreTrainedModel"):
        EquivarianceProbe(torch.nn.Linear(3, 3))


def test_bad_token_inputs_name_the_problem_and_the_fix():
    probe = EquivarianceProbe(tiny_gpt2(n_positions=32))
    with pytest.raises(InputError, match="integer tensor.*tokens.long"):
        probe.run(torch.rand(2, 8), progress=False)
    with pytest.raises(InputError, match="vocabulary"):
        probe.run(torch.full((1, 8), 500), progress=False)
    with pytest.raises(ContextLengthError, match="maximum context of 32"):
        probe.run(torch.zeros((1, 40), dtype=torch.long), progress=False)
    with pytest.raises(ContextLengthError, match="context_length=33"):
        probe.run(["x"], context_length=33, progress=False)
    with pytest.raises(InputError, match="no tokenizer"):
        probe.run(["some text"], context_length=8, progress=False)
    with pytest.raises(InputError, match="single string"):
        probe.run("some text", progress=False)
    with pytest.raises(InputError, match="batch_size"):
        probe.run(torch.zeros((1, 8), dtype=torch.long), batch_size=0, progress=False)


def test_empty_corpus_is_refused():
    probe = EquivarianceProbe(tiny_gpt2(), tokenizer=ByteTokenizer())
    with pytest.raises(EmptyCorpusError, match="no window"):
        probe.run(["", "  "], context_length=8, progress=False)
    with pytest.raises(EmptyCorpusError):
        probe.run([], context_length=8, progress=False)


def test_nan_attention_raises_and_keeps_complete_batches():
    calls = {"n": 0}

    def pattern(layer, tokens):
        calls["n"] += 1
        p = uniform_pattern(tokens.shape[1]).expand(tokens.shape[0], 1, -1, -1).clone()
        if calls["n"] > 4:  # the third batch's first layer
            p[..., 3, 1] = float("nan")
        return p

    probe = EquivarianceProbe(SyntheticAdapter(pattern, n_layers=2, n_heads=1))
    with pytest.raises(NonFiniteAttentionError, match="layer 0.*NaN") as caught:
        probe.run(torch.zeros((6, 8), dtype=torch.long), batch_size=2, progress=False)
    partial = caught.value.partial_result
    assert partial is probe.last_result and partial.n_windows == 4
    assert partial.metadata["complete"] is False
    assert partial.query_position_r2("raw", "prior") == pytest.approx(1.0)


def test_nan_weights_in_a_real_model_raise():
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteAttentionError, match="layer 1"):
        EquivarianceProbe(model).run(torch.randint(0, 97, (2, 8)), progress=False)


def test_a_mask_the_adapter_does_not_know_is_detected():
    # The pattern attends over the whole causal prefix but the adapter claims a window of 3.
    adapter = SyntheticAdapter(lambda layer, tokens: uniform_pattern(tokens.shape[1]).expand(tokens.shape[0], 1, -1, -1),
                               n_layers=1, n_heads=1, sliding_windows=[3])
    with pytest.raises(AttentionCaptureError, match="outside the mask"):
        EquivarianceProbe(adapter).run(torch.zeros((1, 10), dtype=torch.long), progress=False)
