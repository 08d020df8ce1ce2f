"""The shift test through nnsight (local): the same numbers as the plain
Hugging Face model it wraps, in text mode and in position-ids mode, on tiny float64 models built from configs.

Tolerance: the models run in float64, so every array of the result (attention sums, residual stream sums,
prediction sums, counts) agrees to ``rtol=1e-9, atol=1e-12``. The absolute part covers sums that are zero in
exact arithmetic (centred logits sum to 0 over each row) and come out at float64 rounding (1e-16) with a
different sign from each framework.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from synthetic import tiny_gemma3, tiny_gpt2, tiny_llama

from equivariance_probe import EquivarianceProbe
from equivariance_probe.errors import RemoteExecutionError

pytest.importorskip("nnsight")

M = 10
OFFSETS = [0, 7, 30]
RTOL, ATOL = 1e-9, 1e-12
BUILDERS = {"gemma3-sliding-gqa": tiny_gemma3, "llama-gqa": tiny_llama, "gpt2": tiny_gpt2}


def design(vocab_top: int = 80, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, vocab_top, (M,), generator=generator).tolist() for _ in range(3)]
    contexts = [torch.randint(3, vocab_top, (30,), generator=generator).tolist() for _ in range(2)]
    return segments, contexts


def shift(probe: EquivarianceProbe, mode: str):
    segments, contexts = design()
    # batch_size=2: right-padded batches of windows of different lengths, with logits kept for the longest stretch
    return probe.shift(segments, contexts if mode == "text" else None, mode=mode, offsets=OFFSETS, segment_length=M,
                       batch_size=2, progress=False, interval_groups=3)


def assert_same_result(got, expected):
    assert set(got.statistics.arrays) == set(expected.statistics.arrays)
    assert any("nll_sum" in name for name in expected.statistics.arrays)  # the predictions are compared too
    for name, value in expected.statistics.arrays.items():
        np.testing.assert_allclose(np.asarray(got.statistics.arrays[name]), np.asarray(value), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    for representation in ("centred_logits", "residual"):
        np.testing.assert_allclose(got.share(representation, "offset", by="layer"),
                                   expected.share(representation, "offset", by="layer"), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.loss_by_offset(), expected.loss_by_offset(), rtol=1e-9)


def tiny_tokenizer():
    from test_nnsight_adapter import tiny_tokenizer as build

    return build()


@pytest.mark.parametrize("mode", ["text", "position_ids"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_nnsight_shift_equals_hugging_face(name, mode):
    from nnsight.modeling.transformers import TransformersModel

    model = BUILDERS[name]().to(torch.float64)
    model.set_attn_implementation("sdpa")
    tokenizer = tiny_tokenizer()
    expected = shift(EquivarianceProbe(model, tokenizer=tokenizer), mode)
    wrapped = TransformersModel(model, tokenizer=tokenizer)
    model.train()
    got = shift(EquivarianceProbe(wrapped), mode)
    assert model.training and model.config._attn_implementation == "sdpa"  # left as it was found
    assert_same_result(got, expected)
    assert got.metadata["model"]["framework"] == "nnsight"
    assert "nnsight trace" in got.metadata["capture"]
    assert got.metadata["recompute_check"]["passed"] is True
    assert got.metadata["check"]["rotary"] == (name != "gpt2") == expected.metadata["check"]["rotary"]
    if mode == "position_ids" and name == "gpt2":  # learned positions: the ids reached the model's table
        assert got.share("residual", "offset") > 1e-3


def test_remote_nnsight_shift_is_refused_with_the_fix():
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter

    adapter = NNsightAdapter(TransformersModel(tiny_gemma3().to(torch.float64), tokenizer=tiny_tokenizer()),
                             remote="local")
    with pytest.raises(RemoteExecutionError, match="remote=False") as caught:
        shift(EquivarianceProbe(adapter), "text")
    assert caught.value.partial_result.metadata["complete"] is False
