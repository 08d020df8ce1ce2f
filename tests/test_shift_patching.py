"""Activation patching in the shift test against known answers, on tiny float64 models built from configs.

* Patching components with their own outputs in the same window changes nothing, bit for bit (every framework).
* Patching the embedding and every block's attention and MLP together makes the predictions the reference
  offset's: recovered 1, and the last block's residual offset sum of squares is gone.
* A rotary model whose only way for the offset in is one head with zero query and key weights (uniform causal
  attention: it averages every token before it, so it moves with the amount of preceding text), every other
  head's output-projection columns and every MLP's down-projection zero: patching that head (or its layer's
  attention) recovers 1, any other component 0.
* Hugging Face, nnsight (local) and a TransformerLens 4 bridge give the same sums (the tolerance of
  tests/test_shift_adapters.py); a remote model and bad options are refused by name; files save, load and merge.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from synthetic import bridged_tiny_model, tiny_gemma3, tiny_gpt2, tiny_llama

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.adapters.components import block_component_names
from equivariance_probe.errors import InputError, RemoteExecutionError, UndefinedStatisticError
from equivariance_probe.features.segments import segment_pass
from equivariance_probe.sources.shift_grid import ShiftOptions

M = 10
OFFSETS = [0, 7, 30]
RTOL, ATOL = 1e-9, 1e-12
TOKENS = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], [6, 10, 14, 18, 22, 26, 30, 34, 38, 0, 0, 0]])
LENGTHS = torch.tensor([12, 9])


def design(seed: int = 0, n_segments: int = 3):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, 80, (M,), generator=generator).tolist() for _ in range(n_segments)]
    generator = torch.Generator().manual_seed(seed + 1000)  # the same contexts however many segments
    contexts = [torch.randint(3, 80, (30,), generator=generator).tolist() for _ in range(2)]
    return segments, contexts


def patched_run(model, patch, segments=None, tokenizer=None, **options):
    segments_, contexts = design()
    return EquivarianceProbe(model, tokenizer=tokenizer).shift(segments or segments_, contexts, offsets=OFFSETS, segment_length=M,
                                          batch_size=2, progress=False, interval_groups=3, patch=patch, **options)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3, tiny_gpt2])
def test_patching_components_with_their_own_outputs_changes_nothing(build):
    adapter = EquivarianceProbe(build().to(torch.float64)).adapter
    names = [*block_component_names(adapter.layout.n_layers), "head.1.0", "head.1.3"]
    captured = {}
    clean = segment_pass(adapter, TOKENS, LENGTHS, 4, predictions=True, capture=names,
                         on_capture=lambda name, values: captured.__setitem__(name, values))
    assert set(captured) == set(names) and captured["head.1.0"].shape == (2, 4, 8)
    for name in names:
        patched = segment_pass(adapter, TOKENS, LENGTHS, 4, predictions=True, patch={name: captured[name]})
        assert torch.equal(patched, clean), name


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_patching_everything_together_recovers_one_and_removes_the_residual_offset(build):
    """``"all"``: the embedding and every attention and MLP output at the segment are the reference's, so the
    residual stream at the segment is the reference's after every block (post-norm Gemma 3 included)."""
    result = patched_run(build().to(torch.float64), ["all", "mlp.0"])
    everything = result.config.patch_components[0]
    assert everything == "+".join(block_component_names(result.config.n_layers))
    recovered = result.patching()
    assert recovered[everything] == pytest.approx(1.0, abs=1e-9)
    assert result.patching("residual_removed")[everything] == 1.0  # every patched stream equals the reference's
    assert abs(recovered["mlp.0"]) < 1.0 and result.divergence("offset") > 1e-6
    # Every group of segments recovers 1 too: the interval has no width.
    interval = result.patching(interval=0.95)[everything]
    assert interval.estimate == pytest.approx(1.0, abs=1e-9) and interval.high - interval.low < 1e-6


def uniform_head_model(layer: int = 1, head: int = 0):
    """A float64 tiny Llama (rotary, 2 layers, 4 query heads over 2 key/value heads of width 8) where query head
    ``head`` of ``layer`` has zero query and key weights and is the only thing written into the residual stream
    besides the embedding."""
    model = tiny_llama().to(torch.float64)
    size = model.config.hidden_size // model.config.num_attention_heads
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():
        for index, block in enumerate(model.model.layers):
            block.mlp.down_proj.weight.zero_()
            keep = block.self_attn.o_proj.weight[:, head * size:(head + 1) * size].clone()
            block.self_attn.o_proj.weight.zero_()
            if index == layer:
                block.self_attn.o_proj.weight[:, head * size:(head + 1) * size] = keep
                block.self_attn.q_proj.weight[head * size:(head + 1) * size] = 0.0
                kv = head // group
                block.self_attn.k_proj.weight[kv * size:(kv + 1) * size] = 0.0
    return model


def test_one_uniform_head_carries_the_whole_offset():
    items = ["head.1.0", "attention.1", "head.1.1", "head.1.2", "attention.0", "mlp.0", "mlp.1", "embedding"]
    result = patched_run(uniform_head_model(), items)
    assert result.divergence("offset") > 1e-6 and result.share("residual", "offset") > 1e-6
    recovered, removed = result.patching(), result.patching("residual_removed")
    for item in ("head.1.0", "attention.1"):
        assert recovered[item] == pytest.approx(1.0, abs=1e-9), item
        assert removed[item] == pytest.approx(1.0, abs=1e-12), item
    for item in ("head.1.1", "head.1.2", "attention.0", "mlp.0", "mlp.1", "embedding"):
        assert recovered[item] == pytest.approx(0.0, abs=1e-12), item
        assert removed[item] == pytest.approx(0.0, abs=1e-9), item


def assert_same_arrays(got, expected):
    assert got.config == expected.config
    for name, value in expected.statistics.arrays.items():
        np.testing.assert_allclose(got.statistics.arrays[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


PATCH = ["blocks", "embedding", "head.1.2", "heads.0", "all"]


def test_nnsight_patching_equals_hugging_face():
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel
    from test_nnsight_adapter import tiny_tokenizer

    model = tiny_gemma3().to(torch.float64)
    expected = patched_run(model, PATCH)
    got = patched_run(TransformersModel(model, tokenizer=tiny_tokenizer()), PATCH)
    assert got.statistics.arrays["patch/js_sum"].any()
    assert_same_arrays(got, expected)


@pytest.mark.parametrize("kind", ["gemma3", "gpt2"])
def test_transformer_bridge_patching_equals_hugging_face(kind, tmp_path):
    pytest.importorskip("transformer_lens")
    hf, bridge, tokenizer = bridged_tiny_model(tmp_path, kind)
    expected = patched_run(hf, PATCH, tokenizer=tokenizer)
    got = patched_run(bridge, PATCH)
    assert got.statistics.arrays["patch/residual_offset"].any()
    assert_same_arrays(got, expected)


def test_a_remote_model_refuses_patching_with_the_reason():
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel
    from test_nnsight_adapter import tiny_tokenizer

    from equivariance_probe.adapters.nnsight import NNsightAdapter

    adapter = NNsightAdapter(TransformersModel(tiny_llama().to(torch.float64), tokenizer=tiny_tokenizer()),
                             remote="local")
    with pytest.raises(RemoteExecutionError, match="one request, which cannot be split.*remote=False"):
        patched_run(adapter, True)


@pytest.mark.parametrize("patch, message", [
    ("attention.x", "not a component"), (5, "must be True, False"), (["head.1"], "not a component"),
    ("mlp.0+blocks", "not a component"),
])
def test_bad_patch_options_are_named(patch, message):
    with pytest.raises(InputError, match=message):
        ShiftOptions(patch=patch)


def test_patch_options_beyond_the_model_or_the_offsets_are_named():
    with pytest.raises(InputError, match="patch_reference=3 is not the index"):
        ShiftOptions(offsets=OFFSETS, patch=True, patch_reference=3)
    with pytest.raises(InputError, match="patch_reference must be"):
        ShiftOptions(patch=True, patch_reference=-1)
    with pytest.raises(InputError, match="layers 0 to 1"):
        patched_run(tiny_llama().to(torch.float64), "attention.2")
    with pytest.raises(InputError, match="heads 0 to 3"):
        patched_run(tiny_llama().to(torch.float64), "head.0.4")
    plain = patched_run(tiny_llama().to(torch.float64), False)
    assert plain.statistics.arrays["patch/js_sum"].shape == (3, 0, 3)
    with pytest.raises(UndefinedStatisticError, match="patched nothing.*patch=True"):
        plain.patching()


def test_options_spell_out_the_items_and_take_fewer_default_offsets():
    from equivariance_probe.adapters.base import AttentionLayout

    layout = AttentionLayout(n_layers=2, n_heads=2, sliding_windows=(None, None), max_context=200)
    options = ShiftOptions(patch=True).resolved(layout, 1)
    assert options.patch == ("attention.0", "mlp.0", "attention.1", "mlp.1")
    assert options.offsets == (0, 200 - 1 - 64) and len(ShiftOptions().resolved(layout, 1).offsets) == 6
    spelled = ShiftOptions(patch="heads.1,mlp.0+mlp.1,all", offsets=OFFSETS).resolved(layout, 1).patch
    assert spelled == ("head.1.0", "head.1.1", "mlp.0+mlp.1", "embedding+attention.0+mlp.0+attention.1+mlp.1")
    assert ShiftOptions(patch=spelled, offsets=OFFSETS).resolved(layout, 1).patch == spelled  # settled once


def test_patching_sums_save_load_and_merge(tmp_path):
    model = tiny_llama().to(torch.float64)
    segments, _ = design(n_segments=4)
    whole = patched_run(model, ["mlp.0", "head.1.1"], segments=segments, patch_reference=1)
    first = patched_run(model, ["mlp.0", "head.1.1"], segments=segments[:2], patch_reference=1)
    second = patched_run(model, ["mlp.0", "head.1.1"], segments=segments[2:], patch_reference=1)
    merged = first.merge(second)
    for name, value in whole.statistics.arrays.items():
        np.testing.assert_allclose(merged.statistics.arrays[name], value, rtol=1e-12, atol=1e-15, err_msg=name)
    assert not whole.statistics.arrays["patch/js_sum"][:, :, 1].any()  # the reference offset is never patched
    path = whole.save(tmp_path / "patched.safetensors")
    loaded = ShiftResult.load(path)
    assert loaded.config.patch_components == ("mlp.0", "head.1.1") and loaded.config.patch_reference == 1
    assert loaded.patching() == whole.patching()
    rows = loaded.patching_rows()
    assert [(row["kind"], row["layer"], row["head"]) for row in rows] == [("mlp", 0, None), ("head", 1, 1)]
    tidy = {(row["statistic"], row["component"]): row for row in loaded.to_rows() if row["split"] == "component"}
    assert set(tidy) == {(f"patch_{m}", c) for m in ("recovered", "residual_removed") for c in ("mlp.0", "head.1.1")}
    for row in rows:
        for measure in ("recovered", "residual_removed"):
            got = tidy[f"patch_{measure}", row["component"]]
            assert (got["layer"], got["head"]) == (row["layer"], row["head"])
            assert got["value"] == pytest.approx(row[measure]["estimate"] if isinstance(row[measure], dict)
                                                 else row[measure])
    assert "activation patching (reference offset 7)" in loaded.table()
    with pytest.raises(Exception, match="patch_components"):
        whole.merge(patched_run(model, ["mlp.1"], segments=segments[:1], patch_reference=1))


def test_a_format_2_file_loads_without_patching(tmp_path):
    import json

    from equivariance_probe.records.container import read_container, read_tensors, tensor_checksum, write_container
    from equivariance_probe.shift_result import SHIFT_KIND

    result = patched_run(tiny_llama().to(torch.float64), False)
    written = result.save(tmp_path / "new.safetensors")
    container = read_container(written, SHIFT_KIND)
    header = container.header
    tensors = {name: value for name, value in read_tensors(container).items() if not name.startswith("patch/")}
    config = {key: value for key, value in header["config"].items() if not key.startswith("patch_")}
    old = {"kind": SHIFT_KIND, "format_version": 2, "checksum": tensor_checksum(tensors), "config": config,
           "metadata": header["metadata"], "summary": header["summary"]}
    write_container(tmp_path / "old.safetensors", tensors, json.loads(json.dumps(old)))
    loaded = ShiftResult.load(tmp_path / "old.safetensors")
    assert loaded.config.patch_components == () and loaded.config == result.config
    assert loaded.share("residual", "offset") == result.share("residual", "offset")
    assert "patching" not in loaded.summary()


def test_the_command_patches_with_its_smaller_default_grid(tiny_model_folder, text_corpus, tmp_path, capsys):
    from equivariance_probe.cli import main

    common = ["--model", tiny_model_folder("gemma3", n_positions=128), "--corpus", text_corpus(n_docs=8, words=60),
              "--segment-length", "8", "--offsets", "0,5,20", "--interval-groups", "3", "--no-progress"]
    assert main(["shift", "-o", str(tmp_path / "a"), *common, "--patch", "mlp.0,all", "--patch-reference", "1"]) == 0
    assert "activation patching (reference offset 5)" in capsys.readouterr().out
    result = ShiftResult.load(tmp_path / "a" / "shift_trained.safetensors")
    assert result.n_segments == 2 and result.config.n_contexts == 2  # the patching defaults
    assert result.config.patch_components[0] == "mlp.0" and result.config.patch_reference == 1
    assert (tmp_path / "a" / "shift_patching.png").exists()
    assert result.patching()[result.config.patch_components[1]] == pytest.approx(1.0, abs=1e-6)  # float32
    assert main(["shift", "-o", str(tmp_path / "b"), *common, "--patch", "mlp.x"]) == 2
    assert "not a component" in capsys.readouterr().err


@pytest.mark.parametrize("framework", ["huggingface", "nnsight"])
def test_patching_leaves_the_other_sums_of_the_run_as_they_are(framework):
    """The reference outputs are captured in a pass of their own: with attribution and the sink sums read in the
    clean passes, every array but patching's is bitwise the run's without patching."""
    model = tiny_gemma3().to(torch.float64)
    if framework == "nnsight":
        pytest.importorskip("nnsight")
        from nnsight.modeling.transformers import TransformersModel
        from test_nnsight_adapter import tiny_tokenizer

        model = TransformersModel(model, tokenizer=tiny_tokenizer())
    plain = patched_run(model, False, attribution=True)
    patched = patched_run(model, ["mlp.0", "head.2.1"], attribution=True)
    assert patched.statistics.arrays["patch/js_sum"].any()
    for name, value in plain.statistics.arrays.items():
        if not name.startswith("patch/"):
            assert np.array_equal(patched.statistics.arrays[name], value), name
