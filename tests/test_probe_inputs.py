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
    with pytest.raises(UnsupportedModelError) as caught:
        EquivarianceProbe(torch.nn.Linear(3, 3))
    for name in ("TransformerBridge", "HookedTransformer", "nnsight", "PreTrainedModel", "torch.nn.modules.linear.Linear"):
        assert name in str(caught.value), name


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


# ----------------------------------------------------------------- runs that stop, options that measure nothing
@pytest.mark.parametrize("fault", [OSError("disk gone"), ValueError("hook refused"), KeyboardInterrupt()],
                         ids=["oserror_from_a_document_generator", "valueerror_from_a_hook", "interrupt"])
def test_any_exception_leaves_a_partial_result_marked_incomplete(fault):
    from synthetic import tiny_gpt2

    def documents():
        for _ in range(4):
            yield torch.arange(1, 9)
        raise fault

    probe = EquivarianceProbe(tiny_gpt2())
    with pytest.raises(type(fault)) as caught:
        probe.run(documents(), context_length=8, batch_size=2, progress=False)
    partial = probe.last_result
    assert caught.value.partial_result is partial
    assert partial.metadata["complete"] is False
    assert partial.n_windows == 4  # the two batches done before the fault, kept whole
    whole = EquivarianceProbe(tiny_gpt2()).run(torch.arange(1, 9).repeat(4, 1), batch_size=2, progress=False)
    for name, value in whole.statistics.arrays.items():
        assert torch.equal(value, partial.statistics.arrays[name]), name


@pytest.mark.parametrize(
    "options, match",
    [
        ({"exclude_keys": [1000]}, r"exclude_keys=\[1000\].*\[1000\].*context_length=8.*0\.\.7"),
        ({"exclude_keys": list(range(8))}, r"leaves out every key position.*exclude fewer keys"),
        ({"max_windows": 0}, r"max_windows must be a positive integer.*not 0"),
        ({"key_bins": -1}, r"key_bins must be a positive integer, not -1"),
        ({"context_length": 1, "min_tokens": 1}, r"context_length=1 .*pass context_length=2 or more"),
        ({"context_length": 1}, r"context_length=1 .*pass context_length=2 or more"),
        ({"min_tokens": 9}, r"min_tokens=9 is more than context_length=8"),
    ],
    ids=["exclude_key_outside_the_window", "exclude_every_key", "max_windows_zero", "negative_key_bins",
         "one_token_context_min_tokens_1", "one_token_context_default_min_tokens", "min_tokens_over_context"],
)
def test_options_that_would_measure_nothing_are_refused_by_name(options, match):
    from synthetic import tiny_gpt2

    options = {"context_length": 8, **options}
    with pytest.raises(InputError, match=match):
        EquivarianceProbe(tiny_gpt2()).run(torch.arange(1, 9).repeat(2, 1)[:, : options["context_length"]],
                                           progress=False, **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_on_a_machine_without_cuda_is_a_named_error():
    from synthetic import tiny_gpt2

    with pytest.raises(InputError, match=r"device 'cuda'.*no CUDA GPU.*device='cpu'"):
        EquivarianceProbe(tiny_gpt2()).run(torch.arange(1, 9).repeat(2, 1), device="cuda", progress=False)


def test_an_encoder_decoder_model_is_refused_as_unsupported_not_told_to_wrap_itself():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    with pytest.raises(UnsupportedModelError, match=r"T5ForConditionalGeneration is an encoder-decoder model.*decoder-only") as caught:
        EquivarianceProbe(t5)
    assert "Wrap the model" not in str(caught.value)


def test_measurement_options_are_the_run_keywords_as_one_value():
    """run(docs, options) measures what run(docs, **the same keywords) does, bit for bit; keywords given
    beside the options win; a name that is no option, or options given by position, is a TypeError."""
    from equivariance_probe import MeasurementOptions

    tokens = torch.randint(3, 90, (5, 12), generator=torch.Generator().manual_seed(3))
    probe = EquivarianceProbe(tiny_gpt2())
    by_keywords = probe.run(tokens, context_length=12, batch_size=2, exclude_keys=[0], interval_groups=4, progress=False)
    options = MeasurementOptions(context_length=12, batch_size=3, exclude_keys=(0,), interval_groups=4)
    by_options = probe.run(tokens, options, batch_size=2, progress=False)
    assert by_options.metadata["batch_size"] == 2 and by_options.excluded_keys == (0,)
    for name, value in by_keywords.statistics.numpy().items():
        assert (by_options.statistics.numpy()[name] == value).all(), name
    with pytest.raises(TypeError, match="context_lenght is not a measurement option"):
        probe.run(tokens, context_lenght=12, progress=False)
    with pytest.raises(TypeError, match="options must be a MeasurementOptions"):
        probe.run(tokens, 12, progress=False)
