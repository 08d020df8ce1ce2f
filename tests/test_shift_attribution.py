"""The shift test's attribution: the residual stream's offset and context sums of squares split into what each
component writes, on tiny float64 models built from configs, against known answers (the identity, constructions
whose offset has one way in, a brute-force Gram) and across frameworks, files and merges."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from synthetic import tiny_gemma3, tiny_gpt2, tiny_llama

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.errors import InputError, UndefinedStatisticError, UnsupportedModelError
from equivariance_probe.maths.shift import component_grams_reference, component_shares
from equivariance_probe.shift_result import attribution_check
from equivariance_probe.sources.shift_grid import ShiftOptions
from equivariance_probe.statistics.shift import ShiftConfig, SegmentGrid

from test_shift import M, OFFSETS, design
from test_shift import run as plain_run


def run(model, segments=None, contexts=None, **options):
    return plain_run(model, segments, contexts, **{"attribution": True, **options})


def with_random_norms(model):
    """Norm weights away from their initial zeros and ones, so a post-norm's gain is not the identity."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    return model


def test_the_streamed_gram_matrices_equal_a_brute_force_reference():
    generator = np.random.default_rng(0)
    n_contexts, n_offsets, m, d = 3, 4, 5, 6
    names = ("embedding", "attention.0", "mlp.0")
    values = 100.0 + generator.normal(size=(len(names), n_contexts, n_offsets, m, d))  # far from 0: no cancellation
    config = ShiftConfig(n_layers=1, n_heads=1, offsets=tuple(range(n_offsets)), n_contexts=n_contexts,
                         segment_length=m, hidden_size=d, predictions=False, components=names)
    grid = SegmentGrid(config)
    for f in range(n_contexts):
        for s in reversed(range(n_offsets)):  # any order of offsets within a context
            for c, name in enumerate(names):
                grid.add_component(name, s, torch.from_numpy(values[c, f, s]))
        grid.end_context()
    sums = grid.sums()
    expected = component_grams_reference(values)
    for term in ("offset", "context"):
        np.testing.assert_allclose(sums[f"attribution/{term}_gram"], expected[term], rtol=1e-10, atol=1e-10)
    with pytest.raises(InputError, match="not one of this run's components"):
        SegmentGrid(config).add_component("mlp.3", 0, torch.zeros(m, d))


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_llama, tiny_gpt2])
def test_the_components_add_up_to_the_residual_stream_and_the_heads_to_their_attention(build):
    model = with_random_norms(build().to(torch.float64))
    result = run(model, attribution_heads=[0, 1])
    check = result.metadata["attribution_check"]
    assert check["passed"] is True and check["value"] <= 1e-12
    # Gemma's post-norms compute in float32 whatever the model's dtype: the heads' pieces under them agree to that.
    assert check["heads_max_difference"] <= (1e-6 if build is tiny_gemma3 else 1e-12)
    np.testing.assert_array_less(result.attribution_identity("offset"), 1e-12)
    np.testing.assert_array_less(result.attribution_identity("context"), 1e-12)
    residual = result.decomposition("residual", by="layer")
    for layer in range(result.config.n_layers):
        shares = result.attribution(layer)[layer]
        blocks = {name: value for name, value in shares.items() if not name.startswith("head.")}
        assert sum(blocks.values()) == pytest.approx(1.0, abs=1e-12)
        heads = sum(value for name, value in shares.items() if name.startswith(f"head.{min(layer, 1)}."))
        assert heads == pytest.approx(shares[f"attention.{min(layer, 1)}"], abs=1e-6)
        gram = result.statistics.totals()["attribution/offset_gram"]
        columns = [i for i, name in enumerate(result.config.components) if name in blocks]
        assert gram[np.ix_(columns, columns)].sum() == pytest.approx(residual["offset"][layer], rel=1e-12)


def test_learned_positions_with_constant_tokens_put_layer_0_s_offset_on_the_embedding():
    model = tiny_gpt2().to(torch.float64)
    with torch.no_grad():
        model.transformer.wte.weight[:] = model.transformer.wte.weight[5]
        block = model.transformer.h[0]
        for projection in (block.attn.c_proj, block.mlp.c_proj):
            projection.weight.zero_()
            projection.bias.zero_()
    result = run(model, attribution_heads=[0])
    shares = result.attribution(0, interval=0.95)[0]
    assert shares["embedding"].estimate == pytest.approx(1.0, abs=1e-12)
    assert abs(shares["attention.0"].estimate) <= 1e-12 and abs(shares["mlp.0"].estimate) <= 1e-12
    assert all(abs(shares[f"head.0.{h}"].estimate) <= 1e-12 for h in range(4))


def test_a_uniform_head_is_the_only_way_in_and_gets_the_whole_offset():
    """Rotary positions, one head of layer 0 with zero query weights (uniform causal attention: its output averages
    every token before it, so it moves with the amount of preceding text), every other head's output columns and
    every MLP's output zero: the residual stream's offset is that head's alone."""
    model = tiny_llama().to(torch.float64)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            block.mlp.down_proj.weight.zero_()
            keep = block.self_attn.o_proj.weight[:, :head_dim].clone()
            block.self_attn.o_proj.weight.zero_()
            if layer == 0:
                block.self_attn.q_proj.weight[:head_dim].zero_()
                block.self_attn.o_proj.weight[:, :head_dim] = keep
    result = run(model, attribution_heads=[0, 1])
    last = result.config.n_layers - 1
    assert result.attribution_layers() == (0, last) or result.attribution_layers() == (last,)
    for term in ("offset", "context"):
        shares = result.attribution(last, term)[last]
        assert shares["head.0.0"] == pytest.approx(1.0, abs=1e-10), term
        assert shares["attention.0"] == pytest.approx(1.0, abs=1e-10), term
        others = {name: value for name, value in shares.items() if name not in ("head.0.0", "attention.0")}
        assert max(abs(value) for value in others.values()) <= 1e-10, (term, others)


@pytest.fixture(scope="module")
def attributed():
    segments, contexts = design()
    return run(with_random_norms(tiny_gemma3().to(torch.float64)), segments, contexts, attribution_heads=[1])


def test_rows_table_and_intervals(attributed):
    rows = attributed.attribution_rows()
    assert {row["term"] for row in rows} == {"offset", "context"}
    row = next(row for row in rows if row["component"] == "head.1.2" and row["term"] == "offset")
    assert row["kind"] == "head" and row["component_layer"] == 1 and row["head"] == 2
    assert row["low"] <= row["share"] <= row["high"]
    json.dumps(rows)
    table = attributed.attribution_table()
    assert "offset SS after block" in table and "passed" in table and table in attributed.table()
    summary = json.loads(json.dumps(attributed.summary()))["attribution"]
    last = str(attributed.config.n_layers - 1)
    assert summary["check"]["passed"] is True and int(last) in summary["layers"]
    at_last = next(row for row in rows if row["component"] == "head.1.2" and row["term"] == "offset"
                   and row["layer"] == int(last))
    assert summary["offset"][last]["head.1.2"]["estimate"] == pytest.approx(at_last["share"])
    tidy = [row for row in attributed.to_rows() if row["statistic"] == "attribution_offset"]
    assert len(tidy) == sum(row["term"] == "offset" for row in rows)
    same = next(row for row in tidy if row["component"] == "head.1.2" and row["layer"] == int(last))
    assert same["split"] == "component" and same["head"] is None  # the head is the component's, not the layer's
    assert (same["value"], same["low"], same["high"]) == pytest.approx((at_last["share"], at_last["low"],
                                                                         at_last["high"]))


def test_save_load_and_merge_keep_the_gram_matrices(attributed, tmp_path):
    path = attributed.save(tmp_path / "a.safetensors")
    loaded = ShiftResult.load(path)
    assert loaded.config.components == attributed.config.components
    assert loaded.attribution() == attributed.attribution()
    segments, contexts = design()
    model = with_random_norms(tiny_gemma3().to(torch.float64))
    first = run(model, segments[:2], contexts, attribution_heads=[1])
    second = run(model, segments[2:], contexts, attribution_heads=[1])
    whole = run(model, segments, contexts, attribution_heads=[1])
    merged = first.merge(second)
    for term in ("offset", "context"):
        name = f"attribution/{term}_gram"
        np.testing.assert_allclose(merged.statistics.totals()[name], whole.statistics.totals()[name], rtol=1e-12)
    assert merged.metadata["attribution_check"]["passed"] is True


def test_a_format_2_file_loads_without_components(tmp_path):
    from equivariance_probe.records.container import read_container, read_tensors, tensor_checksum, write_container
    from equivariance_probe.records.shift_file import SHIFT_KIND

    plain = run(tiny_gemma3().to(torch.float64), attribution=False)
    assert plain.statistics.arrays["attribution/offset_gram"].shape == (4, 0, 0)
    written = plain.save(tmp_path / "new.safetensors")
    container = read_container(written, SHIFT_KIND)
    header = container.header
    tensors = {name: value for name, value in read_tensors(container).items() if not name.startswith("attribution/")}
    config = {key: value for key, value in header["config"].items() if key != "components"}
    old = {"kind": SHIFT_KIND, "format_version": 2, "checksum": tensor_checksum(tensors), "config": config,
           "metadata": header["metadata"], "summary": header["summary"]}
    write_container(tmp_path / "old.safetensors", tensors, json.loads(json.dumps(old)))
    loaded = ShiftResult.load(tmp_path / "old.safetensors")
    assert loaded.config.components == ()
    assert loaded.share("residual", "offset") == pytest.approx(plain.share("residual", "offset"), rel=1e-12)
    with pytest.raises(UndefinedStatisticError, match="attribution=True"):
        loaded.attribution()


def test_a_failed_identity_is_marked_failed(attributed):
    import copy

    broken = copy.deepcopy(attributed)
    broken.statistics.arrays["attribution/offset_gram"][:, 0, 0] += 1.0  # the embedding's own term, made up
    check = attribution_check(broken, dtype="float64")
    assert check["passed"] is False and check["value"] > 1e-3


def test_options_refuse_bad_attribution_settings_by_name():
    with pytest.raises(InputError, match="attribution_heads must be layer indices"):
        ShiftOptions(attribution=True, attribution_heads=[1.5])
    with pytest.raises(InputError, match="attribution is off"):
        ShiftOptions(attribution_heads=[1])
    with pytest.raises(InputError, match="attribution must be True or False"):
        ShiftOptions(attribution="yes")
    assert ShiftOptions(attribution=True, attribution_heads=[2, 0, 2]).attribution_heads == (0, 2)
    with pytest.raises(InputError, match="has 3 layers"):
        run(tiny_gemma3().to(torch.float64), attribution_heads=[3])


def test_a_remote_session_sums_the_block_level_attribution_on_the_server(monkeypatch):
    """``remote="local"``: the segment's grid is serialised as one nnsight session for a server (the functions shipped
    by value), and its Gram matrices come back with the other sums, equal to the Hugging Face model's."""
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel

    from test_shift_adapters import tiny_tokenizer

    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.adapters.nnsight_remote import segment_reply_nbytes
    from equivariance_probe.statistics.shift import ShiftStatistics

    model = with_random_norms(tiny_gemma3().to(torch.float64))
    tokenizer = tiny_tokenizer()
    segments, contexts = design(n_segments=3, n_contexts=2)
    options = {"offsets": OFFSETS, "segment_length": M, "progress": False, "interval_groups": 3, "attribution": True,
               "batch_size": 2}
    expected = EquivarianceProbe(model, tokenizer=tokenizer).shift(segments, contexts, **options)
    replies: list[dict] = []
    add_segment_sums = ShiftStatistics.add_segment_sums
    monkeypatch.setattr(ShiftStatistics, "add_segment_sums", lambda self, fingerprint, group, sums: (
        replies.append(sums), add_segment_sums(self, fingerprint, group, sums))[1])
    probe = EquivarianceProbe(NNsightAdapter(TransformersModel(model, tokenizer=tokenizer), remote="local"))
    got = probe.shift(segments, contexts, **options)
    for term in ("offset", "context"):
        name = f"attribution/{term}_gram"
        np.testing.assert_allclose(got.statistics.arrays[name], expected.statistics.arrays[name], rtol=1e-9, atol=1e-12)
    assert got.metadata["attribution_check"]["passed"] is True
    layout = probe.adapter.layout
    assert sum(value.nbytes for value in replies[0].values()) == segment_reply_nbytes(
        layout.n_layers, layout.n_heads, len(OFFSETS), hidden_size=model.config.hidden_size,
        components=len(got.config.components))
    with pytest.raises(UnsupportedModelError, match="block-level attribution"):
        probe.shift(segments, contexts, **options, attribution_heads=[1])


def test_the_attribution_figure_draws_each_target_block(attributed):
    pytest.importorskip("matplotlib")
    from equivariance_probe.display.shift import shift_attribution_figure, shift_figures

    figure = shift_attribution_figure(attributed)
    assert len(figure.axes) == 2 * len(attributed.attribution_layers())
    assert "shift_attribution" in shift_figures(attributed)


def test_shares_from_a_gram_matrix():
    gram = np.array([[4.0, -1.0, 0.0], [-1.0, 2.0, 0.5], [0.0, 0.5, 1.0]])
    shares = component_shares(gram, [0, 1], [0, 1])
    assert shares.sum() == pytest.approx(1.0)
    assert shares[0] == pytest.approx(3.0 / 4.0)


@pytest.mark.parametrize("kind", ["gemma3", "gpt2"])
def test_hugging_face_nnsight_and_a_bridge_give_the_same_attribution(kind, tmp_path):
    """The tolerance of tests/test_shift_adapters.py (float64 models: rtol=1e-9, atol=1e-12)."""
    pytest.importorskip("nnsight")
    pytest.importorskip("transformer_lens")
    from nnsight.modeling.transformers import TransformersModel

    from synthetic import bridged_tiny_model

    hf, bridge, tokenizer = bridged_tiny_model(tmp_path, kind)
    segments, contexts = design(n_segments=3, n_contexts=2)
    options = {"offsets": OFFSETS, "segment_length": M, "progress": False, "interval_groups": 3, "attribution": True,
               "attribution_heads": [1], "batch_size": 2}
    expected = EquivarianceProbe(hf, tokenizer=tokenizer).shift(segments, contexts, **options)
    results = {"bridge": EquivarianceProbe(bridge).shift(segments, contexts, **options),
               "nnsight": EquivarianceProbe(TransformersModel(hf, tokenizer=tokenizer)).shift(segments, contexts,
                                                                                             **options)}
    for framework, got in results.items():
        assert got.config.components == expected.config.components
        for term in ("offset", "context"):
            name = f"attribution/{term}_gram"
            np.testing.assert_allclose(got.statistics.arrays[name], expected.statistics.arrays[name], rtol=1e-9,
                                       atol=1e-12, err_msg=f"{framework} {name}")
        assert got.metadata["attribution_check"]["passed"] is True, framework
        for layer, shares in expected.attribution().items():
            np.testing.assert_allclose(list(got.attribution(layer)[layer].values()), list(shares.values()),
                                       rtol=1e-9, atol=1e-12, err_msg=framework)


def test_the_command_runs_the_attribution_and_draws_it(tiny_model_folder, text_corpus, tmp_path, capsys):
    from equivariance_probe.cli import main

    model = tiny_model_folder("gemma3", n_positions=128)
    corpus = text_corpus(n_docs=6, words=60)
    common = ["--model", model, "--corpus", corpus, "--n-segments", "3", "--n-contexts", "2", "--segment-length", "8",
              "--offsets", "0,5,20", "--interval-groups", "3", "--no-progress"]
    assert main(["shift", "-o", str(tmp_path / "a"), *common, "--attribution", "--attribution-heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "Attribution of the residual stream" in out and "offset SS after block" in out
    assert (tmp_path / "a" / "shift_attribution.png").exists()
    assert "offset and context sums of squares after the target blocks" in (tmp_path / "a" / "shift_report.html").read_text()
    result = ShiftResult.load(tmp_path / "a" / "shift_trained.safetensors")
    assert "head.1.0" in result.config.components and result.metadata["attribution_check"]["passed"] is True
    assert main(["shift", "-o", str(tmp_path / "b"), *common, "--attribution-heads", "1"]) == 2
    assert "--attribution" in capsys.readouterr().err
    assert main(["shift", "-o", str(tmp_path / "c"), *common, "--attribution", "--attribution-heads", "9"]) == 2
    assert "layers (0 to" in capsys.readouterr().err


def test_the_attribution_figure_takes_a_result_and_its_baselines_as_every_figure_does(attributed):
    pytest.importorskip("matplotlib")
    from equivariance_probe.display.shift import shift_attribution_figure

    figure = shift_attribution_figure(attributed, {"random_init": attributed})
    legends = [[text.get_text() for text in ax.get_legend().get_texts()] for ax in figure.axes]
    assert len(legends) == 2 * len(attributed.attribution_layers())
    assert all(labels[-1] == "random_init" and len(labels) == 2 for labels in legends)
    one = shift_attribution_figure(attributed, layers=attributed.attribution_layers()[:1], terms=["offset"])
    assert len(one.axes) == 1
