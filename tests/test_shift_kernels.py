"""The shift test under a fused attention kernel: flash attention's contract, run on a CPU.

flash-attn needs a GPU, but what the probe meets at transformers' attention call does not: a flash kernel is
registered with transformers' ``AttentionInterface`` under its ``attn_implementation`` name, receives the queries,
keys and values after rotary embeddings and q/k norms, no 4-D mask (its ``AttentionMaskInterface`` entry,
``flash_attention_mask``, hands it ``None`` or a 2-D padding mask: causality and the sliding window are the kernel's
own, from ``is_causal`` and ``sliding_window``), and returns ``(output [batch, query, head, dim], None)``, no
weights. :func:`weightless_attention` keeps that contract. Its softmax runs in float32 and its weights are rounded
to the model's dtype, as flash-attn's float32 accumulators and transformers' eager attention do, so a float64
model gives eager attention's result arrays to ``rtol=1e-9``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from synthetic import save_tiny_model_with_tokenizer, tiny_gemma3, tiny_llama

from equivariance_probe import EquivarianceProbe
from equivariance_probe.errors import AttentionCaptureError

#: The kernel's ``attn_implementation`` name: without "flash" in it, so that transformers does not look for the
#: flash-attn package or a hub kernel (it matches names containing "flash").
KERNEL = "weightless_fused"
M = 10
OFFSETS = [0, 7, 30]
RTOL, ATOL = 1e-9, 1e-12


def weightless_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                         softcap=None, is_causal=None, **kwargs):
    """Attention under flash attention's calling convention: ``query: [batch, head, q, dim]``, ``key`` and ``value``
    ``[batch, kv_head, k, dim]``, ``attention_mask`` ``None`` or a boolean ``[batch, k]`` of real keys; returns
    ``([batch, q, head, dim], None)``."""
    assert attention_mask is None or attention_mask.dim() == 2, "a flash kernel never receives a 4-D mask"
    CALLS.append(sliding_window)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    position = torch.arange(query.shape[2]).view(-1, 1) + key.shape[2] - query.shape[2]
    other = torch.arange(key.shape[2]).view(1, -1)
    causal = module.is_causal if is_causal is None else is_causal
    hidden = (other > position) if causal else torch.zeros(position.shape[0], other.shape[1], dtype=torch.bool)
    if sliding_window is not None:
        hidden = hidden | (position - other >= sliding_window)
    hidden = hidden.view(1, 1, *hidden.shape)
    if attention_mask is not None:
        hidden = hidden | ~attention_mask.bool().view(attention_mask.shape[0], 1, 1, -1)
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


#: The sliding window of each call of :func:`weightless_attention` (``None``: full attention).
CALLS: list[int | None] = []


@pytest.fixture(scope="module", autouse=True)
def registered_kernel():
    """:func:`weightless_attention` registered as an attention implementation, with flash attention's mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(KERNEL, weightless_attention)
    AttentionMaskInterface.register(KERNEL, flash_attention_mask)
    yield
    del AttentionInterface._global_mapping[KERNEL]
    del AttentionMaskInterface._global_mapping[KERNEL]


def design(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, 97, (M,), generator=generator).tolist() for _ in range(3)]
    contexts = [torch.randint(3, 97, (30,), generator=generator).tolist() for _ in range(2)]
    return segments, contexts


def shift(model, mode: str):
    segments, contexts = design()
    # batch_size=2: right-padded batches of windows of different lengths
    return EquivarianceProbe(model).shift(segments, contexts if mode == "text" else None, mode=mode, offsets=OFFSETS,
                                          segment_length=M, batch_size=2, progress=False, interval_groups=3)


def saved(build, tmp_path, attn_implementation: str):
    """``build()`` in float64, saved and loaded back with ``attn_implementation``, as a user loads a model."""
    from transformers import AutoModelForCausalLM

    build().to(torch.float64).save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=attn_implementation,
                                                dtype=torch.float64).eval()


@pytest.mark.parametrize("mode", ["text", "position_ids"])
@pytest.mark.parametrize("build", [tiny_gemma3, tiny_llama], ids=["gemma3-sliding", "llama"])
def test_a_kernel_that_returns_no_weights_gives_eager_attention_s_arrays(build, mode, tmp_path):
    eager = saved(build, tmp_path / "eager", "eager")
    fused = saved(build, tmp_path / "fused", KERNEL)
    assert fused.config._attn_implementation == KERNEL
    expected = shift(eager, mode)
    CALLS.clear()
    got = shift(fused, mode)
    assert fused.config._attn_implementation == KERNEL  # the check ran eager attention and switched back
    assert got.metadata["model"]["attn_implementation"] == KERNEL
    assert got.metadata["recompute_check"]["passed"] is True
    windows = EquivarianceProbe(fused).adapter.layout.sliding_windows
    assert set(CALLS) == set(windows)  # the grid ran through the kernel, sliding layers with their window
    assert set(got.statistics.arrays) == set(expected.statistics.arrays)
    assert any("nll_sum" in name for name in expected.statistics.arrays)
    for name, value in expected.statistics.arrays.items():
        np.testing.assert_allclose(np.asarray(got.statistics.arrays[name]), np.asarray(value), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    if build is tiny_gemma3 and mode == "text":  # the sliding layers' window is smaller than the longest window
        assert min(window for window in windows if window is not None) < M + max(OFFSETS)


def test_a_model_set_to_flash_attention_without_flash_attn_is_refused_by_name(tmp_path):
    """Where flash-attn is absent, transformers refuses to load a model with ``attn_implementation="flash_attention_2"``,
    and our ``load_model`` names that; a config can still name it (a failed ``from_config`` leaves it in the config
    it was given). The shift test then stops before any window with the fix, and leaves the model as found."""
    import importlib.util

    from equivariance_probe.errors import InputError
    from equivariance_probe.sources.models import load_model

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    folder = save_tiny_model_with_tokenizer(tmp_path, kind="gemma3")
    with pytest.raises(InputError, match="flash_attention_2.*attn_implementation='eager'"):
        load_model(folder, attn_implementation="flash_attention_2")
    model = tiny_gemma3().to(torch.float64)
    with pytest.raises(ImportError):
        type(model)._from_config(model.config, attn_implementation="flash_attention_2")
    assert model.config._attn_implementation == "flash_attention_2"
    probe = EquivarianceProbe(model)
    segments, contexts = design()
    with pytest.raises(AttentionCaptureError, match="attn_implementation='flash_attention_2'.*'sdpa' or 'eager'"):
        probe.shift(segments, contexts, offsets=OFFSETS, segment_length=M, progress=False)
    assert model.config._attn_implementation == "flash_attention_2"  # as found, not silently eager
    assert probe.last_result.metadata["complete"] is False and probe.last_result.statistics.n_segments == 0
