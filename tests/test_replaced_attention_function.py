"""A model's eager attention function replaced in its modelling module (TransformerLens 3.9 does this to Gemma 2 and
Gemma 3 whenever it builds a bridge with rotary hooks; here a monkey-patch does it): the probe reads through a
replacement that computes eager attention, with the same numbers, and refuses one that does not, by name."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from equivariance_probe import EquivarianceProbe, ReplacedAttentionFunctionError
from equivariance_probe.adapters.internals import replaced_by
from synthetic import tiny_gemma3

TOKENS = torch.randint(3, 97, (4, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def gemma3_module():
    import transformers.models.gemma3.modeling_gemma3 as module

    shipped = module.eager_attention_forward
    yield module
    module.eager_attention_forward = shipped


def eager_gemma3():
    model = tiny_gemma3(window=5).to(torch.float64)
    model.set_attn_implementation("eager")
    return model


def arrays(model):
    result = EquivarianceProbe(model).run(TOKENS, context_length=24, batch_size=2, progress=False)
    return result.statistics.arrays


def test_the_function_transformers_ships_is_recognised_and_a_replacement_is_named(gemma3_module):
    shipped = gemma3_module.eager_attention_forward
    assert replaced_by(shipped) is None

    def patched(*args, **kwargs):
        return shipped(*args, **kwargs)

    assert replaced_by(patched) == f"{__name__}.{patched.__qualname__}"
    # A decorator that copies the shipped function's name and module still wraps it.
    assert replaced_by(functools.wraps(shipped)(patched)) is not None


@pytest.mark.parametrize("wrap", [False, True])
def test_a_replacement_that_computes_eager_attention_is_read_through_with_the_same_numbers(gemma3_module, wrap):
    model = eager_gemma3()
    expected = arrays(model)
    shipped = gemma3_module.eager_attention_forward
    calls = []

    def passing_through(module, query, key, value, attention_mask, **kwargs):
        calls.append(1)
        return shipped(module, query, key, value, attention_mask, **kwargs)

    gemma3_module.eager_attention_forward = functools.wraps(shipped)(passing_through) if wrap else passing_through
    found = arrays(model)
    assert calls, "the replacement was not the function the model ran"
    assert found.keys() == expected.keys()
    for name in expected:
        assert torch.equal(found[name], expected[name]), name


def test_a_replacement_that_changes_attention_is_refused_by_name(gemma3_module):
    model = eager_gemma3()
    shipped = gemma3_module.eager_attention_forward

    def sharpening(module, query, key, value, attention_mask, **kwargs):
        return shipped(module, 2.0 * query, key, value, attention_mask, **kwargs)

    gemma3_module.eager_attention_forward = sharpening
    library = f"{__name__}.{sharpening.__qualname__}"
    with pytest.raises(ReplacedAttentionFunctionError,
                       match=rf"replaced by {re.escape(library)}\..*process without the replacement") as caught:
        arrays(model)
    assert caught.value.replaced_by == library
