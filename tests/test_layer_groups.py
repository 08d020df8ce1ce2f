"""Layer groups: sliding-window and global layers reported apart, with known answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, ProbeResult
from equivariance_probe.maths import metrics
from equivariance_probe.runs.tables import summary_table
from equivariance_probe.statistics.masks import layer_groups
from synthetic import tiny_gemma3, tiny_llama


def tokens(n: int = 6, width: int = 32) -> torch.Tensor:
    return torch.randint(3, 97, (n, width), generator=torch.Generator().manual_seed(0))


def test_groups_follow_the_declared_kind_of_each_layer():
    assert layer_groups([512, None, 512]) == {"all": (0, 1, 2), "sliding": (0, 2), "global": (1,)}
    assert layer_groups([None, None]) == {"all": (0, 1)}
    assert layer_groups([4096] * 3) == {"all": (0, 1, 2)}


def test_uniform_attention_gives_one_in_every_group():
    result = EquivarianceProbe(tiny_gemma3(zero=True)).run(tokens(), batch_size=3, progress=False)
    assert result.layer_groups() == {"all": (0, 1, 2), "sliding": (0, 1), "global": (2,)}
    for scale in metrics.SCALES:
        for form in metrics.FORMS:
            values = result.query_position_r2(scale, form, by="layer_group")
            assert set(values) == {"all", "sliding", "global"}
            np.testing.assert_allclose(list(values.values()), 1.0, atol=1e-12)
    for curves in result.persistence(by="layer_group").values():
        np.testing.assert_allclose(curves.curve, curves.prior, rtol=1e-7)  # float32 weights 1/|V(q)|


def test_a_group_is_the_statistic_over_its_layers_only():
    result = EquivarianceProbe(tiny_gemma3(window=8)).run(tokens(), batch_size=4, progress=False)
    arrays = result.statistics.numpy()
    visible = result.statistics.visible_keys().numpy()
    groups = result.query_position_r2("log", "eta2", by="layer_group")
    assert groups["all"] == result.query_position_r2("log", "eta2")
    for name, layers in result.layer_groups().items():
        layers = list(layers)
        expected = metrics.query_position_r2(arrays["query_count"][layers], arrays["log_sum"][layers],
                                             arrays["log_sq"][layers], visible[layers], scale="log")["eta2"]
        assert groups[name] == pytest.approx(expected, abs=1e-15)
    # One global layer: its group equals that layer's own number.
    assert groups["global"] == pytest.approx(result.query_position_r2("log", "eta2", by="layer")[2], abs=1e-12)
    curves = result.persistence(by="layer_group")
    np.testing.assert_array_equal(curves["global"].curve, result.persistence(by="layer").curve[2])
    # Sliding layers see at most 8 keys: their curve has no entry beyond lag 7.
    assert np.all(curves["sliding"].count[8:] == 0) and np.all(curves["sliding"].count[:8] > 0)


def test_the_kind_stays_when_the_window_covers_the_context():
    # Window 64 > context 32: every mask is full causal, but the local layers are still the sliding group.
    result = EquivarianceProbe(tiny_gemma3(window=64)).run(tokens(), batch_size=3, progress=False)
    assert result.statistics.sliding_windows == (None, None, None)
    assert result.layer_groups()["sliding"] == (0, 1)


def test_models_of_one_kind_have_one_group_and_no_extra_rows():
    result = EquivarianceProbe(tiny_llama()).run(tokens(n=2), progress=False)
    assert result.layer_groups() == {"all": (0, 1)}
    assert result.summary()["layer_groups"] == {}
    assert "sliding layers" not in summary_table({"llama": result.summary()}, extended=True)


def test_groups_are_in_the_summary_the_file_and_the_table(tmp_path):
    result = EquivarianceProbe(tiny_gemma3()).run(tokens(), batch_size=3, progress=False)
    loaded = ProbeResult.load(result.save(tmp_path / "gemma.safetensors"))
    stored = loaded.summary()["layer_groups"]
    assert stored["sliding"]["layers"] == [0, 1] and stored["global"]["layers"] == [2]
    assert stored["global"]["query_position_r2"]["log"]["fitted"] == pytest.approx(
        result.query_position_r2("log", "fitted", by="layer_group")["global"])
    table = summary_table({"trained": loaded.summary()})
    assert "| log, sliding layers | eta2 |" in table and "| log, global layers | fitted |" in table
    assert "raw, sliding layers" not in table  # the raw scale per group is in the extended table only
    assert "| P(dt), global layers | prior fit R² |" in summary_table({"t": loaded.summary()}, extended=True)
