"""The shift test's massive activations: the residual stream's largest magnitude at the segment's first token and at
its other tokens, and its median magnitude, per block and offset, against a tiny GPT-2 whose blocks add nothing.

Known answer: with every attention and MLP output projection zero, the residual stream after each block is the
token embedding plus the position embedding, ``h[i] = wte[token_i] + wpe[position_i]``, with the segment's token
``i`` at window position ``len(prefix) + s + i`` (text mode). A coordinate planted in ``wpe[0]`` sits at the
window's first position: it is the segment's first token's at offset 0 without a prefix, and nobody's with a BOS
prefix or at a later offset. A coordinate planted in one token's embedding moves with the text.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from synthetic import tiny_gpt2
from test_shift_sinks import bos_tokenizer, design

from equivariance_probe import EquivarianceProbe, ShiftResult
from equivariance_probe.errors import UndefinedStatisticError
from equivariance_probe.maths.intervals import Interval
from equivariance_probe.records import shift_file
from equivariance_probe.records.container import read_container, read_tensors, tensor_checksum, write_container
from equivariance_probe.statistics.shift import MASSIVE_ARRAYS

M = 10
OFFSETS = [0, 3, 7, 30]
PLANTED = 1000.0


def embedding_gpt2(plant: str):
    """A float64 tiny GPT-2 whose blocks add nothing, with one large coordinate planted in the embedding of the
    window's first position (``"position"``) or of token 5 (``"token"``)."""
    model = tiny_gpt2(n_layer=3).to(torch.float64)
    with torch.no_grad():
        for block in model.transformer.h:
            for projection in (block.attn.c_proj, block.mlp.c_proj):
                projection.weight.zero_()
                projection.bias.zero_()
        if plant == "position":
            model.transformer.wpe.weight[0, 5] = PLANTED
        else:
            model.transformer.wte.weight[5, 7] = -PLANTED
    return model


def run(model, tokenizer=None, segments=None, contexts=None, **options):
    if segments is None:
        segments, contexts = design()
    options = {"offsets": OFFSETS, "segment_length": M, "progress": False, "interval_groups": 2, **options}
    return EquivarianceProbe(model, tokenizer=tokenizer).shift(segments, contexts, **options)


def expected(model, segments, contexts, prefix: int) -> dict[str, np.ndarray]:
    """Each part's mean over segments and contexts per offset, from the embeddings alone (the module docstring)."""
    tokens = model.transformer.wte.weight.detach().numpy()
    positions = model.transformer.wpe.weight.detach().numpy()
    parts = {"first": [], "rest": [], "median": []}
    for offset in OFFSETS:
        first, rest, median = [], [], []
        for segment in segments:
            for _ in contexts:
                magnitude = np.abs(tokens[segment] + positions[prefix + offset + np.arange(M)])
                first.append(magnitude[0].max())
                rest.append(magnitude[1:].max())
                median.append(np.median(magnitude))
        for name, values in (("first", first), ("rest", rest), ("median", median)):
            parts[name].append(np.mean(values))
    return {name: np.asarray(values) for name, values in parts.items()}


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("plant", ["position", "token"])
def test_a_planted_coordinate_is_found_exactly_where_it_sits(plant, prefix):
    segments, contexts = design()
    segments = [[5, *segment[1:]] for segment in segments]  # every segment starts with the planted token
    model = embedding_gpt2(plant)
    result = run(model, bos_tokenizer() if prefix else None, segments, contexts)
    want = expected(model, segments, contexts, int(prefix))
    for part, values in want.items():
        np.testing.assert_allclose(result.massive(part), np.broadcast_to(values, (3, len(OFFSETS))), rtol=1e-12,
                                   err_msg=part)
    np.testing.assert_allclose(result.massive("first_ratio"), result.massive("first") / result.massive("median"),
                               rtol=1e-12)
    first = result.massive("first")[0]
    if plant == "token":  # moves with the text: the first token's magnitude at every offset
        assert np.all(first > PLANTED / 2)
    elif not prefix:  # stays at the window's first position: the text's first token holds it at offset 0 only
        assert first[0] > PLANTED / 2 and np.all(first[1:] < PLANTED / 10)
    else:  # the prefix holds the window's first position, which the test does not read
        assert np.all(first < PLANTED / 10)
    assert np.all(result.massive("rest") < PLANTED / 10)


def test_streamed_halves_merge_to_the_whole_run_and_the_numbers_reach_the_summary_rows_and_table():
    segments, contexts = design(n_segments=6)
    model = embedding_gpt2("position")
    whole = run(model, segments=segments, contexts=contexts)
    merged = run(model, segments=segments[:3], contexts=contexts).merge(
        run(model, segments=segments[3:], contexts=contexts))
    for name in MASSIVE_ARRAYS:
        np.testing.assert_allclose(merged.statistics.totals()[name], whole.statistics.totals()[name], rtol=1e-12,
                                   err_msg=name)
    interval = whole.massive("first_ratio", interval=0.95)
    assert isinstance(interval, Interval)
    np.testing.assert_allclose(interval.estimate, whole.massive("first_ratio"), rtol=1e-12)
    summary = whole.summary()["massive_activations"]
    np.testing.assert_allclose(summary["first"]["estimate"], whole.massive("first"), rtol=1e-12)
    rows = [row for row in whole.to_rows() if row["statistic"] == "massive_first"]
    assert len(rows) == 3 * len(OFFSETS)
    row = next(row for row in rows if row["layer"] == 1 and row["offset"] == 0)
    assert row["value"] == pytest.approx(whole.massive("first")[1, 0], rel=1e-12) and row["low"] is not None
    assert "largest magnitude over its median" in whole.table()


def test_a_format_3_file_loads_with_the_massive_activations_undefined(tmp_path):
    result = run(embedding_gpt2("position"))
    path = result.save(tmp_path / "new.safetensors")
    loaded = ShiftResult.load(path)
    np.testing.assert_array_equal(loaded.massive("first"), result.massive("first"))
    container = read_container(path, shift_file.SHIFT_KIND)
    tensors = {name: value for name, value in read_tensors(container).items() if not name.startswith("massive/")}
    header = {key: value for key, value in container.header.items() if key not in ("digests", "header_checksum")}
    header.update(format_version=3, checksum=tensor_checksum(tensors))
    old = ShiftResult.load(write_container(tmp_path / "old.safetensors", tensors, json.loads(json.dumps(header))))
    assert set(MASSIVE_ARRAYS) <= set(old._file.filled)
    with pytest.raises(UndefinedStatisticError, match="written before the shift test kept them"):
        old.massive("first")
    assert old.summary()["massive_activations"] is None
    assert not [row for row in old.to_rows() if row["statistic"].startswith("massive_")]
    np.testing.assert_array_equal(old.sink_mass("first_key"), result.sink_mass("first_key"))
    segments, contexts = design(seed=5)
    newer = run(embedding_gpt2("position"), segments=segments, contexts=design()[1])
    newer.metadata.update({key: old.metadata.get(key) for key in ("model", "contexts_sha256")})
    with pytest.raises(UndefinedStatisticError, match="a merge with an older file"):
        old.merge(newer).massive("rest")
    header["format_version"] = 4  # a file of this format without them is malformed, not old
    broken = write_container(tmp_path / "broken.safetensors", tensors, json.loads(json.dumps(header)))
    with pytest.raises(Exception, match="massive/first"):
        ShiftResult.load(broken)


def test_a_file_with_a_negative_magnitude_sum_is_refused_naming_it(tmp_path):
    path = run(embedding_gpt2("position")).save(tmp_path / "new.safetensors")
    container = read_container(path, shift_file.SHIFT_KIND)
    tensors = read_tensors(container)
    tensors["massive/median"] = -tensors["massive/median"]
    header = {key: value for key, value in container.header.items() if key not in ("digests", "header_checksum")}
    header.update(checksum=tensor_checksum(tensors))
    edited = ShiftResult.load(write_container(tmp_path / "edited.safetensors", tensors, json.loads(json.dumps(header))))
    with pytest.raises(Exception, match="massive/median"):
        edited.massive("median")


def test_the_figure_draws_both_ratios_at_the_peak_block_and_every_figure_includes_it():
    from equivariance_probe import shift_figures, shift_massive_figure

    result = run(embedding_gpt2("position"))
    figure = shift_massive_figure(result, layer=2)
    lines = {line.get_label(): line.get_ydata() for line in figure.axes[0].get_lines()}
    np.testing.assert_allclose(lines["first token"], result.massive("first_ratio")[2], rtol=1e-12)
    np.testing.assert_allclose(lines["other tokens"], result.massive("rest_ratio")[2], rtol=1e-12)
    assert len(figure.axes[0].collections) == 2  # one interval band per line
    assert "shift_massive" in shift_figures(result)
