"""The newest doors (attribution, patching, sinks, views, probes, shards, model names) take their options as typed,
by one validator per kind, before any forward pass: a layer given as text is refused (iterated, ``'10'`` would be
the layers 1 and 0), a bool is not the layer 1, a float is not truncated, a numpy number is a number; options
that depend on another are refused alone; every spelling of ``--patch`` that the help offers runs to its figure,
and a figure that fails to draw costs none of the measured results. Messages name the value, where it came from
and the fix, in the spelling of the interface used."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from synthetic import tiny_bert, tiny_gemma3
from test_shift import M, OFFSETS, design

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.errors import (AttentionCaptureError, FigureError, InputError, ModelNotFoundError,
                                       check_fraction, check_index, check_indices, command_line_options, option)


@pytest.fixture(scope="module")
def probe():
    return EquivarianceProbe(tiny_gemma3())


@pytest.fixture(scope="module")
def attributed(probe):
    segments, contexts = design()
    return probe.shift(segments, contexts, offsets=OFFSETS, segment_length=M, progress=False, attribution=True,
                       interval_groups=0)


def no_forward_pass(probe, monkeypatch):
    """A forward pass fails the test: every refusal here comes first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model ran before the input was checked")

    monkeypatch.setattr(probe.adapter, "check_segment_recompute", refuse)


# -- one validator per kind ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [
    ("10", "not a str"), (True, "not a bool"), (1.0, "not a float"), (np.float64(1.0), "not a float"),
    (5, "has 3 layers \\(0 to 2\\)"), (-1, "has 3 layers"), ([0, "1"], "whole number from 0 to 2, not a str"),
    ({1: 2}, "not a dict"),
])
def test_a_layer_is_an_integer_in_range_as_typed(attributed, value, words):
    with pytest.raises(InputError, match=rf"layer=.*{words}.*pass layer=0"):
        attributed.attribution(value)


def test_numpy_integers_are_layers(attributed):
    assert list(attributed.attribution(np.int64(1))) == [1]
    assert list(attributed.attribution([np.int32(2), 0])) == [2, 0]
    assert check_indices("layers", (1, 0), 2) == (1, 0)


def test_the_attribution_figure_takes_layers_as_the_method_does(attributed):
    from equivariance_probe import shift_attribution_figure

    with pytest.raises(InputError, match="layers='10' must be a layer index or a list of them, not a str"):
        shift_attribution_figure(attributed, layers="10")


@pytest.mark.parametrize("value", [np.float32(0.3), np.float16(0.3), 0.3, 1 / 3])
def test_a_numpy_float_threshold_in_range_is_a_threshold(value):
    assert check_fraction("epsilon", value) == pytest.approx(float(value))


@pytest.mark.parametrize("value", [1.0, -0.1, float("nan"), True, "0.3", None])
def test_a_threshold_outside_its_range_or_of_another_type_is_refused(value):
    with pytest.raises(InputError, match=r"epsilon=.* must be a fraction in \[0, 1\); pass e.g. epsilon=0.5"):
        check_fraction("epsilon", value)


def test_the_sink_rate_takes_a_float32_epsilon_and_level(probe):
    result = probe.run([list(range(3, 27)), list(range(40, 64)), list(range(5, 29))], context_length=24, progress=False,
                       interval_groups=3, keep_pattern=True)
    assert result.sink_rate(np.float32(0.25)) == result.sink_rate(0.25)
    assert result.sink_rate(0.25, interval=np.float32(0.9)).level == pytest.approx(0.9)
    with pytest.raises(InputError, match="epsilon=1.5 must be a weight threshold"):
        result.sink_rate(1.5)
    for layer, head in (("1", 0), (1, True), (9, 0), (0, 2.0)):
        with pytest.raises(InputError, match="(layer|head)=.*(not a|is not a (layer|head) of this model)"):
            result.mean_pattern(layer, head)
    assert result.mean_pattern(np.int64(1), 0).shape == (24, 24)


def test_check_index_names_the_range_and_the_fix():
    with pytest.raises(InputError, match=r"head=4 is not a head of this model, which has 4 heads \(0 to 3\); pass head=0"):
        check_index("head", 4, 4, what="head")
    assert check_index("layer", np.uint8(3)) == 3


# -- options that depend on another, refused alone and first ------------------------------------------------------
def test_patch_reference_without_patch_is_refused_as_attribution_heads_without_attribution(probe, monkeypatch):
    no_forward_pass(probe, monkeypatch)
    segments, contexts = design()
    common = dict(offsets=OFFSETS, segment_length=M, progress=False)
    with pytest.raises(InputError, match="attribution_heads=\\[1\\] splits .* pass attribution=True as well"):
        probe.shift(segments, contexts, attribution_heads=[1], **common)
    with pytest.raises(InputError, match="patch_reference=1 picks the offset .* nothing is patched; pass patch=True"):
        probe.shift(segments, contexts, patch_reference=1, **common)


@pytest.mark.parametrize("options", [{"patch": True}, {"attribution": True}, {"patch": "attention.0+mlp.0"}])
def test_a_post_ln_encoder_is_refused_before_any_pass_with_the_reason(options, monkeypatch):
    encoder = EquivarianceProbe(tiny_bert())
    no_forward_pass(encoder, monkeypatch)
    segments, contexts = design()
    with pytest.raises(AttentionCaptureError, match=r"BertLayer norms the residual stream after adding .*post-LN.* "
                                                    r"not the sum of the components' outputs.*without attribution"):
        encoder.shift(segments, contexts, offsets=OFFSETS, segment_length=M, progress=False, **options)


@pytest.mark.parametrize("level", [7, 0, "0.95", True])
def test_a_level_that_is_no_level_is_refused_even_without_intervals(attributed, level):
    assert attributed.config.interval_groups == 0
    for read in (attributed.summary, attributed.to_rows, attributed.table):
        with pytest.raises(InputError, match=rf"level={level!r} must be a confidence level"):
            read(level)


# -- shards, names, token ids ------------------------------------------------------------------------------------
@pytest.mark.parametrize("environ, named", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK must lie in 0..WORLD_SIZE-1 \\(0..3\\)"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1"),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, "RANK is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "four"}, "WORLD_SIZE is not a whole number"),
])
def test_a_launcher_s_rank_out_of_range_names_its_variable(environ, named):
    from equivariance_probe import Shard

    with pytest.raises(InputError, match=rf"RANK='{environ['RANK']}', WORLD_SIZE='{environ['WORLD_SIZE']}'.*{named}"):
        Shard.from_environment(environ)


def test_a_model_name_longer_than_a_file_name_is_a_named_error_not_an_os_error():
    from equivariance_probe import ModelSource, load_model

    for load in (lambda: ModelSource("a" * 300), lambda: load_model("org/" + "b" * 256)):
        with pytest.raises(ModelNotFoundError, match="part of (300|256) bytes .* longer than the 255 bytes"):
            load()
    with pytest.raises(ModelNotFoundError, match="is 4999 bytes long, longer than the 4095 bytes a path may have"):
        ModelSource("/".join(["c" * 99] * 50))
    with command_line_options({"name": "--model"}):
        with pytest.raises(ModelNotFoundError, match="e.g. --model gpt2"):
            ModelSource("a" * 300)


def test_float_token_ids_for_a_position_probe_are_refused_not_truncated(probe):
    from equivariance_probe import position_probe

    tokens = torch.arange(3, 3 + 4 * 16, dtype=torch.float32).reshape(4, 16) + 0.7
    for given in (tokens, tokens.numpy(), tokens.tolist()):
        with pytest.raises(InputError, match="token ids as torch.float.* truncated"):
            position_probe(probe, given, positions_per_window=4, n_folds=2)
    with pytest.raises(InputError, match="level=7 must be a confidence level"):
        position_probe(probe, tokens.long(), positions_per_window=4, n_folds=2, level=7)


def test_a_head_of_a_layer_the_model_lacks_is_refused_before_any_lookup(probe):
    from equivariance_probe import head_views

    with pytest.raises(InputError, match="head L9H0 does not exist"):
        head_views(probe, list(range(3, 20)), heads=[(9, 0)])
    with pytest.raises(InputError, match="heads=1.5 is not a layer index"):
        head_views(probe, list(range(3, 20)), heads=[(1.5, 0)])


@pytest.mark.parametrize("head, words", [((1.0, 0), "not a float"), (("1", 0), "not a str"), ((1, 7), "head L1H7 does not exist"),
                                         ((1,), "not a \\(layer, head\\) pair")])
def test_the_shift_view_s_head_is_typed(probe, head, words):
    from equivariance_probe import shift_view

    segments, contexts = design()
    with pytest.raises(InputError, match=words):
        shift_view(probe, segments, contexts, head=head, offsets=(0, 7), segment_length=M)


# -- messages in the spelling of the interface used ----------------------------------------------------------------
def test_lists_are_spelt_as_the_flag_takes_them():
    assert option("attribution_heads", [5, 6, 7]) == "attribution_heads=[5, 6, 7]"
    with command_line_options({"attribution_heads": "--attribution-heads"}):
        assert option("attribution_heads", [5, 6, 7]) == "--attribution-heads 5,6,7"


def test_a_context_length_message_under_the_command_line_gives_the_flag(probe):
    with command_line_options({"context_length": "--context-length", "min_tokens": "--min-tokens"}):
        with pytest.raises(InputError, match="--context-length 1 gives windows of one token.*--context-length 2") as caught:
            probe.run([list(range(3, 20))], context_length=1, progress=False)
        assert "context_length=" not in str(caught.value)
        with pytest.raises(InputError, match="--min-tokens 9 is more than --context-length 8"):
            probe.run([list(range(3, 11))], context_length=8, min_tokens=9, progress=False)


# -- every spelling of --patch the help offers, to its figure --------------------------------------------------
@pytest.mark.parametrize("patch", [True, "attention.1,mlp.1", "head.1.0", "heads.1", "heads", "all",
                                   "attention.1+mlp.1", ["embedding", "attention.0+head.1.1"]])
def test_every_patch_spelling_runs_to_its_figure(probe, patch):
    from equivariance_probe import shift_figures, shift_patching_figure

    segments, contexts = design()
    result = probe.shift(segments, contexts, offsets=OFFSETS, segment_length=M, progress=False, interval_groups=2,
                         patch=patch)
    figure = shift_patching_figure(result)
    labels = {label.get_text() for ax in figure.axes for label in ax.get_xticklabels()}
    combined = [item for item in result.config.patch_components if "+" in item]
    assert all(item in labels or item[:21] + "..." in labels for item in combined)
    assert "shift_patching" in shift_figures(result)
    assert [row["kind"] for row in result.patching_rows() if "+" in row["component"]] == ["combined"] * len(combined)


def test_the_combined_patch_runs_from_the_command_line_to_the_report(tiny_model_folder, text_corpus, tmp_path, capsys):
    from equivariance_probe.cli import main

    common = ["--model", tiny_model_folder("gemma3", n_positions=128), "--corpus", text_corpus(n_docs=8, words=60),
              "--segment-length", "8", "--offsets", "0,5,20", "--interval-groups", "3", "--no-progress"]
    assert main(["shift", "-o", str(tmp_path / "a"), *common, "--patch", "attention.1+mlp.1"]) == 0
    assert "attention.1+mlp.1" in capsys.readouterr().out
    for name in ("shift_trained.safetensors", "shift_patching.png", "shift_report.html"):
        assert (tmp_path / "a" / name).exists()


def test_a_figure_that_fails_to_draw_keeps_the_saved_result_and_names_the_figure(tiny_model_folder, text_corpus,
                                                                                 tmp_path, capsys, monkeypatch):
    import equivariance_probe.display.shift as shift_display
    from equivariance_probe.cli import main

    def broken(result):
        raise ValueError("a drawing bug")

    monkeypatch.setattr(shift_display, "shift_patching_figure", broken)
    common = ["--model", tiny_model_folder("gemma3", n_positions=128), "--corpus", text_corpus(n_docs=8, words=60),
              "--segment-length", "8", "--offsets", "0,5,20", "--interval-groups", "3", "--no-progress"]
    assert main(["shift", "-o", str(tmp_path / "a"), *common, "--patch", "mlp.0"]) == 2
    printed = capsys.readouterr()
    assert "figure 'shift_patching' could not be drawn (ValueError: a drawing bug)" in printed.err
    assert "the measured results are saved" in printed.err and "--no-figures" in printed.err
    assert "offset η²" in printed.out  # the table is printed before the error
    saved = ShiftResult.load(tmp_path / "a" / "shift_trained.safetensors")
    assert saved.config.patch_components == ("mlp.0",) and saved.complete
    with pytest.raises(FigureError, match="shift_patching"):
        shift_display.shift_figures(saved)
