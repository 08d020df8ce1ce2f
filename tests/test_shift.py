"""The shift test on tiny models built from configs: known answers, kernels, files and bad input."""

import numpy as np
import pytest
import torch

from synthetic import tiny_bert, tiny_gemma3, tiny_gpt2, tiny_llama

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.features.segments import segment_pass
from equivariance_probe.errors import (
    ContextLengthError,
    IncompatibleResultsError,
    InputError,
    UndefinedStatisticError,
)
from equivariance_probe.maths.shift import decomposition, decomposition_sums
from equivariance_probe.shift_result import number_cell
from equivariance_probe.sources.shift_grid import default_offsets, shift_grid
from equivariance_probe.statistics.shift import REPRESENTATIONS

M = 10
OFFSETS = [0, 7, 30]


def design(n_segments=4, n_contexts=3, length=30, seed=0):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, 97, (M,), generator=generator).tolist() for _ in range(n_segments)]
    contexts = [torch.randint(3, 97, (length,), generator=generator).tolist() for _ in range(n_contexts)]
    return segments, contexts


def run(model, segments=None, contexts=None, **options):
    if segments is None:
        segments, contexts = design()
    options = {"offsets": OFFSETS, "segment_length": M, "progress": False, "interval_groups": 4, **options}
    return EquivarianceProbe(model).shift(segments, contexts, **options)


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_llama])
def test_rotary_model_in_float64_is_shift_invariant_in_layer_0(build):
    result = run(build().to(torch.float64))
    layer_0 = result.share("centred_logits", "offset", by="layer")[0]
    assert layer_0 <= 1e-12
    assert result.metadata["check"]["passed"] is True
    assert result.metadata["check"]["value"] == pytest.approx(layer_0)
    # Later layers see the context through layer 0's attention: the offset moves them.
    assert result.share("centred_logits", "offset", by="layer")[-1] > 1e-6


def test_position_ids_mode_on_a_rotary_model_moves_nothing_but_rounding():
    segments, _ = design()
    result = run(tiny_gemma3().to(torch.float64), segments, None, mode="position_ids", offsets=[0, 5, 40])
    for representation in REPRESENTATIONS:
        assert result.share(representation, "offset") <= 1e-12, representation
    with pytest.raises(UndefinedStatisticError, match="one context"):
        result.share("centred_logits", "context")
    assert result.divergence("offset") <= 1e-12


def constant_token_gpt2():
    model = tiny_gpt2().to(torch.float64)
    with torch.no_grad():
        model.transformer.wte.weight[:] = model.transformer.wte.weight[5]
    return model


def test_learned_positions_with_constant_token_embeddings_put_the_whole_change_on_the_offset():
    result = run(constant_token_gpt2())
    for representation in REPRESENTATIONS:
        by_layer = result.decomposition(representation, by="layer")
        assert abs(by_layer["context"][0]) <= 1e-12 * by_layer["all"][0]
        assert abs(by_layer["residual"][0]) <= 1e-12 * by_layer["all"][0]
        assert result.share(representation, "context", by="layer")[0] <= 1e-12
        offset = result.share(representation, "offset", by="layer")[0]
        assert offset > 1e-6
        assert offset + result.share(representation, "pair", by="layer")[0] == pytest.approx(1.0, abs=1e-12)
    # The output embedding is tied to the constant input one: every prediction is uniform over the vocabulary.
    np.testing.assert_allclose(result.loss_by_offset(), np.log(97), rtol=1e-12)
    assert result.divergence("context") <= 1e-12


def test_all_zero_weights_give_undefined_shares_and_the_uniform_prior_s_raw_weights():
    segments, contexts = design()
    result = run(tiny_gpt2(zero=True).to(torch.float64), segments, contexts)
    assert set(result.undefined) == {"centred_logits", "residual"}
    assert np.isnan(result.share("centred_logits", "offset"))
    summary = result.summary()
    assert summary["representations"]["centred_logits"]["offset_eta2"]["estimate"] is None
    assert "undefined" in result.table() and "nan" not in result.table().lower()
    assert result.share("conditional_weights", "pair") == pytest.approx(1.0)
    # Uniform attention over the q + 1 keys a causal query sees: a_ij = 1 / (s + i + 1), no prefix here.
    rows, keys = np.tril_indices(M)
    keep = rows >= 1
    values = np.array([[1.0 / (s + rows[keep] + 1) for s in OFFSETS]] * len(contexts))  # [F, S, E]
    per_head = np.broadcast_to(values[None, :, :, None, None, :], (len(segments), len(contexts), len(OFFSETS), 2, 4,
                                                                     int(keep.sum())))
    expected = decomposition(decomposition_sums(per_head))
    found = result.decomposition("raw_weights", by="head")
    for term in ("all", "pair", "offset", "context"):
        np.testing.assert_allclose(found[term], expected[term], rtol=1e-9, atol=1e-15)


def test_sdpa_equals_eager_and_raw_weights_equal_the_model_s_own():
    segments, contexts = design()
    eager = tiny_gemma3().to(torch.float64)
    eager.set_attn_implementation("eager")
    sdpa = tiny_gemma3().to(torch.float64)
    sdpa.set_attn_implementation("sdpa")
    a, b = run(eager, segments, contexts), run(sdpa, segments, contexts)
    assert a.metadata["recompute_check"]["passed"] is True and b.metadata["recompute_check"]["max_difference"] < 1e-6
    # transformers' eager attention takes its softmax in float32 even for a float64 model, so the layers after
    # the first differ between the two kernels at float32 rounding; layer 0 reads only the embeddings.
    for name, value in a.statistics.arrays.items():
        np.testing.assert_allclose(b.statistics.arrays[name], value, rtol=1e-5, atol=1e-9, err_msg=name)
        # layer 0's residual stream (and the massive activations read from it) is after its attention
        if "/" in name and value.size and not name.startswith(("residual", "massive")):
            np.testing.assert_allclose(b.statistics.arrays[name][:, 0], value[:, 0], rtol=1e-12, atol=1e-14, err_msg=name)
    # The recomputed block against the weights eager attention returns.
    probe = EquivarianceProbe(eager)
    window = torch.tensor([contexts[0][:7] + segments[0]])
    captured = {}
    segment_pass(probe.adapter, window, torch.tensor([window.shape[1]]), M,
                 on_attention=lambda layer, s, z, sink: captured.setdefault(layer, torch.exp(s - z[..., None])))
    weights = eager(window, output_attentions=True).attentions
    windows = probe.adapter.layout.sliding_windows
    for layer, block in captured.items():
        offsets = torch.arange(M).view(-1, 1) - torch.arange(M).view(1, -1)
        visible = (offsets >= 0) & (offsets < (windows[layer] or M))
        # eager's float32 softmax again: agreement to float32 rounding.
        torch.testing.assert_close(block[0] * visible, weights[layer][0, :, -M:, -M:], rtol=1e-6, atol=1e-7)


def test_streaming_does_not_depend_on_batch_size():
    segments, contexts = design()
    model = tiny_gpt2().to(torch.float64)
    one, three = run(model, segments, contexts), run(model, segments, contexts, batch_size=3)
    for name, value in one.statistics.arrays.items():
        np.testing.assert_allclose(three.statistics.arrays[name], value, rtol=1e-10, atol=1e-13, err_msg=name)


def test_save_load_merge_equals_the_whole(tmp_path):
    segments, contexts = design(n_segments=6)
    model = tiny_gemma3()
    whole = run(model, segments, contexts)
    merged = run(model, segments[:2], contexts) + run(model, segments[2:], contexts)
    for name, value in whole.statistics.arrays.items():
        np.testing.assert_allclose(merged.statistics.arrays[name], value, rtol=1e-12, atol=1e-14, err_msg=name)
    loaded = ShiftResult.load(merged.save(tmp_path / "shift.safetensors"))
    for name, value in merged.statistics.arrays.items():
        np.testing.assert_array_equal(loaded.statistics.arrays[name], value)
    assert loaded.share("residual", "offset", interval=0.95).estimate == pytest.approx(whole.share("residual", "offset"))
    assert loaded.metadata["check"] == whole.metadata["check"]
    assert "ShiftResult" in repr(loaded) and "<pre>" in loaded._repr_html_()
    with pytest.raises(IncompatibleResultsError, match="count twice"):
        loaded.merge(run(model, segments[:1], contexts))
    baseline = run(tiny_gemma3(seed=1), segments, contexts)
    difference = whole.paired_difference(baseline, "centred_logits", "offset")
    assert difference.estimate == pytest.approx(whole.share() - baseline.share())
    assert difference.low <= difference.estimate <= difference.high
    with pytest.raises(IncompatibleResultsError, match="same segments"):
        whole.paired_difference(merged.merge(run(model, design(seed=9)[0], contexts)))
    with pytest.raises(IncompatibleResultsError, match="contexts"):
        whole.merge(run(model, design(seed=5)[0], design(seed=6)[1]))


def test_encoder_has_no_predictions_and_bidirectional_entries():
    segments, contexts = design()
    result = run(tiny_bert().to(torch.float64), segments, contexts)
    assert result.config.causal is False and result.config.predictions is False
    assert result.statistics.totals()["centred_logits/count"][0, 0] == 4 * 3 * 3 * M * M
    with pytest.raises(UndefinedStatisticError, match="predictions"):
        result.loss_by_offset()


def test_bad_input_is_named(tiny_model_folder):
    segments, contexts = design()
    probe = EquivarianceProbe(tiny_gemma3())
    options = {"segment_length": M, "progress": False}
    with pytest.raises(InputError, match="at least two distinct"):
        probe.shift(segments, contexts, offsets=[5], **options)
    with pytest.raises(InputError, match="at least two contexts"):
        probe.shift(segments, contexts[:1], offsets=OFFSETS, **options)
    with pytest.raises(ContextLengthError, match="fewer than the largest offset"):
        probe.shift(segments, contexts, offsets=[0, 31], **options)
    with pytest.raises(ContextLengthError, match="beyond this model's 128-token window"):
        probe.shift(segments, [c * 5 for c in contexts], offsets=[0, 120], **options)
    with pytest.raises(InputError, match="segment and context"):
        probe.shift(segments, [segments[1] + contexts[0]] + contexts[1:], offsets=OFFSETS, **options)


def test_grid_windows_and_default_offsets(tiny_model_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder("gemma3"))
    grid = shift_grid(["the a of and to in is was for on as with"], ["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"],
                      tokenizer, offsets=[0, 2, 5], segment_length=4)
    ids, start = grid.window(0, 1, 2)
    assert grid.prefix == (1,) and start == 0
    assert ids == [1] + tokenizer("w7 w8", add_special_tokens=False)["input_ids"] + grid.segments[0].tolist()
    assert grid.describe()["offset_means"].startswith("position and amount")
    offsets = default_offsets(32768, 1, 64, [512, None])
    assert max(offsets) == 1024 - 65 and 512 - 65 in offsets and 512 in offsets
    assert offsets == (0, 320, 447, 512, 639, 959)  # six in all: both sides of the window, the rest evenly spaced
    assert default_offsets(8192, 1, 64) == (0, 192, 384, 575, 767, 959)
    assert len(default_offsets(100, 1, 64)) == 6 and len(default_offsets(40000, 1, 64, [512, 1024])) == 6


def test_command_line_writes_results_and_prints_a_table_or_json(tiny_model_folder, text_corpus, tmp_path, capsys):
    import json

    from equivariance_probe.cli import main

    model = tiny_model_folder("gemma3", n_positions=128)
    corpus = text_corpus(n_docs=6, words=60)
    common = ["--model", model, "--corpus", corpus, "--n-segments", "3", "--n-contexts", "2", "--segment-length", "8",
              "--offsets", "0,5,20", "--interval-groups", "3", "--no-progress"]
    assert main(["shift", "-o", str(tmp_path / "a"), *common, "--baselines", "random_init"]) == 0
    table = capsys.readouterr().out
    assert "[trained]" in table and "[random_init]" in table and "position AND the amount of text" in table
    trained = ShiftResult.load(tmp_path / "a" / "shift_trained.safetensors")
    assert trained.n_segments == 3 and trained.config.n_contexts == 2 and trained.config.prefix_length == 1
    assert main(["shift", "-o", str(tmp_path / "b"), *common, "--json", "--mode", "position_ids"]) == 0
    numbers = json.loads(capsys.readouterr().out)
    assert numbers["trained"]["mode"] == "position_ids"
    assert numbers["trained"]["representations"]["centred_logits"]["offset_eta2"]["estimate"] <= 1e-8
    assert main(["shift", "-o", str(tmp_path / "c"), *common, "--offsets", "7"]) == 2
    assert "at least two distinct" in capsys.readouterr().err
    # show: the shift results side by side, one row per file, as the study's guide prints them.
    files = [tmp_path / "a" / "shift_random_init.safetensors", tmp_path / "a" / "shift_trained.safetensors",
             tmp_path / "b" / "shift_trained.safetensors"]  # as a shell's glob gives them
    assert main(["show", *map(str, files)]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith(("| a/", "| b/"))]
    assert [row[1].strip() for row in rows] == ["a/trained", "a/random_init", "b/trained"]  # trained first in a folder
    summary = trained.summary()
    assert rows[0][2].strip() == "text" and rows[0][3].strip() == "3 × 2 × 3"
    assert rows[0][4].strip() == number_cell(summary["representations"]["centred_logits"]["offset_eta2"])
    assert rows[0][8].strip() == number_cell(summary["representations"]["residual"]["offset_eta2"])
    assert rows[2][2].strip() == "position_ids" and rows[2][5].strip() == "–"  # one context: no context share
    assert main(["show", str(files[1]), str(tmp_path / "a" / "shift_trained.safetensors.missing")]) == 2
    assert main(["show", "--json", str(files[1])]) == 0
    assert json.loads(capsys.readouterr().out)["a/trained"]["n_segments"] == 3


def test_a_stopped_run_keeps_its_finished_segments_marked_partial():
    segments, contexts = design()
    probe = EquivarianceProbe(tiny_gpt2())
    calls = []
    original = probe.adapter.run_plan

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1 + 2 * 3 * 3:  # the recompute check's pass, two segments' grids, then a failure
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    probe.adapter.run_plan = failing
    with pytest.raises(KeyboardInterrupt) as stopped:
        probe.shift(segments, contexts, offsets=OFFSETS, segment_length=M, progress=False)
    partial = stopped.value.partial_result
    assert partial is probe.last_result and partial.n_segments == 2 and not partial.complete
    assert "PARTIAL" in partial.table()


def test_a_bfloat16_model_passes_the_pre_run_check_and_its_layer_0_stays_at_bfloat16_rounding():
    """The check asks what the attention is (scores rounded as eager attention rounds them), not how bf16 rounds:
    the run's float32 recomputation from bf16 queries and keys differs from bf16 eager weights by far more than the
    attention's own difference (0 here)."""
    model = tiny_gemma3().to(torch.bfloat16)
    result = run(model)
    check = result.metadata["recompute_check"]
    assert check["passed"] and check["max_difference"] == 0.0 and "bfloat16" in check["compared"]
    assert result.metadata["check"]["passed"] and result.metadata["check"]["tolerance"] == 1e-3
