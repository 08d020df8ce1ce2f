"""The shift test's sink mass: the attention the segment's rows put on the window's first key and on the rest of the
text before the segment, by offset, against uniform causal attention's exact answer (with and without a prefix
token, under a sliding window), and through files, merges and intervals.

Known answer: with zero query and key weights every score is 0, so a row at window position ``p`` spreads its
attention evenly over the ``n = min(p + 1, w)`` keys it sees (``w`` the sliding window, ``∞`` for a global layer).
With the segment at positions ``t .. t + m − 1``, row ``p`` puts ``1/n`` on key 0 if it sees it (``t ≥ 1`` and
``p < w``) and ``|{k : 1 ≤ k < t, k > p − w}| / n`` on the text before the segment.
(Agreement between Hugging Face, nnsight locally and remotely, and the TransformerLens bridge: every array,
the sink sums included, is compared in tests/test_shift_adapters.py.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from synthetic import tiny_gemma3

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.features.segments import segment_pass
from equivariance_probe.errors import UndefinedStatisticError
from equivariance_probe.records import shift_file
from equivariance_probe.records.container import read_container, read_tensors, tensor_checksum, write_container
from equivariance_probe.statistics.shift import SINK_ARRAYS

M = 10
OFFSETS = [0, 3, 7, 30]
WINDOW = 8


def uniform_gemma3():
    """A tiny Gemma 3 (sliding window 8 in layers 0 and 1, global layer 2) whose attention is uniform: zero query
    and key projections give zero scores after the query and key norms."""
    model = tiny_gemma3(window=WINDOW).to(torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    return model


def bos_tokenizer():
    """A word-level tokenizer ``t0 .. t96`` that puts ``t1`` (BOS) before every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", bos_token="t1",
                                   eos_token="t2")


def design(n_segments=4, n_contexts=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, 97, (M,), generator=generator).tolist() for _ in range(n_segments)]
    contexts = [torch.randint(3, 97, (30,), generator=generator).tolist() for _ in range(n_contexts)]
    return segments, contexts


def run(model, tokenizer=None, segments=None, contexts=None, **options):
    if segments is None:
        segments, contexts = design()
    options = {"offsets": OFFSETS, "segment_length": M, "progress": False, "interval_groups": 2, **options}
    return EquivarianceProbe(model, tokenizer=tokenizer).shift(segments, contexts, **options)


def uniform_sink(start: int, window: int | None) -> tuple[float, float]:
    """Uniform causal attention's mean weight on key 0 and on keys ``1 .. start − 1`` over the segment's rows."""
    first, preceding = [], []
    for p in range(start, start + M):
        lowest = 0 if window is None else max(0, p - window + 1)
        n = p + 1 - lowest
        first.append(1.0 / n if start >= 1 and lowest == 0 else 0.0)
        preceding.append(len(range(max(1, lowest), start)) / n)
    return float(np.mean(first)), float(np.mean(preceding))


@pytest.mark.parametrize("prefix", [False, True])
def test_uniform_attention_gives_the_exact_sink_mass_under_the_sliding_window(prefix):
    result = run(uniform_gemma3(), bos_tokenizer() if prefix else None)
    assert result.config.prefix_length == int(prefix)
    windows = result.config.sliding_windows
    assert windows == (WINDOW, WINDOW, None)
    first = result.sink_mass("first_key", by="head")
    preceding = result.sink_mass("preceding", by="head")
    segment = result.sink_mass("segment", by="head")
    assert first.shape == (3, 4, len(OFFSETS))
    for layer, window in enumerate(windows):
        for index, offset in enumerate(OFFSETS):
            expected = uniform_sink(int(prefix) + offset, window)
            np.testing.assert_allclose(first[layer, :, index], expected[0], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(preceding[layer, :, index], expected[1], rtol=1e-12, atol=1e-15)
    # Beyond the window a sliding layer gives the first key nothing; the global layer still does.
    assert (first[:2, :, OFFSETS.index(30)] == 0).all() and (first[2, :, OFFSETS.index(30)] > 0).all()
    # Without a prefix nothing precedes the segment at offset 0; with one, the whole mass before it is the BOS's.
    assert (preceding[:, :, 0] == 0).all()
    assert (first[:, :, 0] > 0).all() == prefix
    np.testing.assert_allclose(first + preceding + segment, 1.0, rtol=0, atol=1e-14)
    # Every head and layer holds the same rows, so the aggregates are plain means of the per-head numbers.
    np.testing.assert_allclose(result.sink_mass("first_key", by="layer"), first.mean(1), rtol=1e-12)
    np.testing.assert_allclose(result.sink_mass("preceding"), preceding.mean((0, 1)), rtol=1e-12)
    groups = result.sink_mass("first_key", by="layer_group")
    assert set(groups) == {"all", "sliding", "global"}
    np.testing.assert_allclose(groups["sliding"], first[:2].mean((0, 1)), rtol=1e-12)
    np.testing.assert_allclose(groups["global"], first[2].mean(0), rtol=1e-12)


def test_sink_mass_intervals_merge_and_files():
    segments, contexts = design(n_segments=6, seed=1)
    model = tiny_gemma3(window=WINDOW).to(torch.float64)
    a = run(model, segments=segments[:3], contexts=contexts, interval_groups=3)
    b = run(model, segments=segments[3:], contexts=contexts, interval_groups=3)
    whole = run(model, segments=segments, contexts=contexts, interval_groups=3)
    merged = a.merge(b)
    for name in SINK_ARRAYS:
        np.testing.assert_allclose(merged.statistics.arrays[name], whole.statistics.arrays[name], rtol=1e-12,
                                   err_msg=name)
    interval = whole.sink_mass("first_key", by="layer", interval=0.95)
    assert interval.estimate.shape == (3, len(OFFSETS))
    np.testing.assert_allclose(interval.estimate, whole.sink_mass("first_key", by="layer"), rtol=1e-12)
    assert np.all(interval.low <= interval.estimate) and np.all(interval.estimate <= interval.high)
    assert np.all(interval.high <= 1.0)
    by_group = whole.sink_mass("preceding", by="layer_group", interval=0.95)
    assert set(by_group) == {"all", "sliding", "global"}
    # A rotary model's layer-0 sink mass varies over segments: the interval is not a point.
    assert np.any(interval.high[0, 1:] > interval.low[0, 1:])
    summary = whole.summary()["sink_mass"]
    np.testing.assert_allclose(summary["first_key"]["estimate"], whole.sink_mass("first_key"), rtol=1e-12)
    assert set(summary["by_layer_group"]["preceding"]) == {"sliding", "global"}
    assert "attention before the segment" in whole.table()
    rows = [row for row in whole.to_rows() if row["statistic"].startswith("sink_")]
    assert {row["statistic"] for row in rows} == {"sink_first_key", "sink_preceding", "sink_segment"}
    assert {row["offset"] for row in rows} == set(OFFSETS)


def test_a_file_round_trips_the_sink_sums_and_a_format_2_file_loads_with_them_undefined(tmp_path):
    result = run(tiny_gemma3(window=WINDOW).to(torch.float64))
    path = result.save(tmp_path / "new.safetensors")
    loaded = ShiftResult.load(path)
    assert loaded.verify() == "digests"
    for name in SINK_ARRAYS:
        assert np.array_equal(loaded.statistics.arrays[name], result.statistics.arrays[name]), name
    np.testing.assert_array_equal(loaded.sink_mass("first_key", by="head"), result.sink_mass("first_key", by="head"))
    # The same sums as a file of format 2, written before the sink sums were kept.
    container = read_container(path, shift_file.SHIFT_KIND)
    tensors = {name: value for name, value in read_tensors(container).items() if not name.startswith("sink/")}
    header = {key: value for key, value in container.header.items() if key not in ("digests", "header_checksum")}
    header.update(format_version=2, checksum=tensor_checksum(tensors))
    old_path = write_container(tmp_path / "old.safetensors", tensors, json.loads(json.dumps(header)))
    old = ShiftResult.load(old_path)
    assert set(SINK_ARRAYS) <= set(old._file.filled)
    with pytest.raises(UndefinedStatisticError, match="before the shift test kept the attention before the segment"):
        old.sink_mass("first_key")
    assert old.summary()["sink_mass"] is None
    assert old.share("centred_logits", "offset") == result.share("centred_logits", "offset")
    # Merged with a new run on other segments, only some segments hold sink sums: still undefined, not a subset mean.
    segments, contexts = design(seed=5)
    newer = run(tiny_gemma3(window=WINDOW).to(torch.float64), segments=segments, contexts=design()[1])
    newer.metadata.update({key: old.metadata.get(key) for key in ("model", "contexts_sha256")})
    with pytest.raises(UndefinedStatisticError, match="a merge with an older file"):
        old.merge(newer).sink_mass("preceding")
    # A format 3 file without them is malformed, not old.
    header["format_version"] = 3
    broken = write_container(tmp_path / "broken.safetensors", tensors, json.loads(json.dumps(header)))
    with pytest.raises(Exception, match="sink/first_key"):
        ShiftResult.load(broken)


def test_the_sink_figure_draws_each_layer_group_s_means_with_bands():
    from synthetic import tiny_gpt2

    from equivariance_probe.display.shift import shift_sink_figure, sink_layer_groups

    gemma = run(tiny_gemma3(window=WINDOW).to(torch.float64))
    assert sink_layer_groups(gemma) == {"sliding layers": (0, 1), "global layers": (2,)}
    deep = run(tiny_gpt2(n_layer=6).to(torch.float64), offsets=[0, 7, 20])
    groups = sink_layer_groups(deep)
    assert groups == {"layers 0–1": (0, 1), "layers 2–3": (2, 3), "layers 4–5": (4, 5)}
    figure = shift_sink_figure(deep)
    first_key, preceding = figure.axes[:2]
    for ax, part in ((first_key, "first_key"), (preceding, "preceding")):
        means = deep.sink_mass(part, by="layer_group", layer_groups=groups)
        lines = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
        assert set(lines) == set(groups)
        for group, values in means.items():
            np.testing.assert_allclose(lines[group], values, rtol=1e-12)
        assert len(ax.collections) == len(groups)  # one interval band per group
    shallow = run(tiny_gpt2(n_layer=3).to(torch.float64), offsets=[0, 7])
    assert sink_layer_groups(shallow) == {"layer 0": (0,), "layer 1": (1,), "layer 2": (2,)}


def test_the_captured_sink_weights_are_the_model_s_own_attention_before_the_segment():
    """``on_attention``'s fourth tensor against eager attention's weights of a random float64 Gemma 3 (sliding
    window 8, the segment at position 12: its rows are past the window of key 0), and the three parts of each row
    summing to 1."""
    model = tiny_gemma3(window=WINDOW).to(torch.float64)
    model.set_attn_implementation("eager")
    segments, contexts = design()
    window = torch.tensor([contexts[0][:12] + segments[0]])
    captured = {}
    segment_pass(
        EquivarianceProbe(model).adapter, window, torch.tensor([window.shape[1]]), M,
        on_attention=lambda layer, scores, normaliser, sink: captured.setdefault(layer, (scores, normaliser, sink)))
    own = model(window, output_attentions=True).attentions
    for layer, (scores, normaliser, sink) in captured.items():
        assert sink.shape == (1, 4, M, 2) and sink.dtype == torch.float64
        weights = own[layer][0, :, -M:]                                       # [head, m, T]
        # eager attention softmaxes in float32 even for a float64 model: agreement to float32 rounding
        torch.testing.assert_close(sink[0, ..., 0], weights[..., 0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sink[0, ..., 1], weights[..., 1:12].sum(-1), rtol=1e-6, atol=1e-7)
        lag = torch.arange(M)[:, None] - torch.arange(M)[None]
        reach = WINDOW if model.config.layer_types[layer] == "sliding_attention" else M
        block = torch.exp(scores - normaliser[..., None]) * ((lag >= 0) & (lag < reach))  # the segment's visible keys
        torch.testing.assert_close(sink.sum(-1) + block.sum(-1), torch.ones_like(sink[..., 0]), rtol=0, atol=1e-12)
    assert (captured[0][2][..., 0] == 0).all() and (captured[2][2][..., 0] > 0).all()
