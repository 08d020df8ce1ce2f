"""The statistics' configuration, declared once, and the reduction spec with its dispatcher's rules."""

from __future__ import annotations

import pytest
import torch

from equivariance_probe.errors import InputError
from equivariance_probe.statistics import STATISTICS, AttentionStatistics, StatisticsConfig
from equivariance_probe.statistics.config import shapes_of
from equivariance_probe.statistics.engines import reduce_scores
from equivariance_probe.statistics.engines.spec import ReductionSpec
from equivariance_probe.statistics.engines.torch_blocks import attention_sums_from_qk


def test_a_configuration_round_trips_through_its_file_form_and_normalises_what_it_is_given():
    config = StatisticsConfig(n_layers=2, n_heads=3, n_positions=16, sliding_windows=(4, 40), excluded_keys=(3, 0, 3),
                              key_bins=100, interval_groups=5)
    assert config.sliding_windows == (4, None)  # a window covering T is full causal
    assert config.excluded_keys == (0, 3) and config.key_bins == 16
    stored = config.to_dict()
    assert stored["windows"] == [4, None] and "sliding_windows" not in stored
    assert StatisticsConfig.from_dict(stored) == config


def test_a_file_configuration_without_the_later_keys_reads_as_it_was_written():
    old = {"n_layers": 1, "n_heads": 2, "n_positions": 8, "windows": [None], "log_floor": 1e-30,
           "excluded_keys": [], "keep_pattern": True}
    config = StatisticsConfig.from_dict(old)
    assert (config.key_bins, config.causal, config.interval_groups) == (8, True, 0)
    assert config.shapes()["key_lag_sum"] == (8, 8) and config.shapes()["pattern_sum"] == (1, 2, 8, 8)


def test_the_table_gives_the_arrays_their_shapes_and_only_kept_arrays_exist():
    statistics = AttentionStatistics(n_layers=2, n_heads=3, n_positions=6, sliding_windows=[None, 2], key_bins=4,
                                     causal=True, interval_groups=0)
    shapes = {name: tuple(value.shape) for name, value in statistics.arrays.items()}
    assert shapes == statistics.settings.shapes() == AttentionStatistics.array_shapes(statistics.config())
    assert "pattern_sum" not in shapes and set(shapes) == set(STATISTICS) - {"pattern_sum"}
    assert all(shape[0] == 2 for name, shape in shapes.items() if STATISTICS[name].per_layer)
    sizes = {"L": 1, "H": 1, "T": 2, "D": 2, "K": 1}
    assert shapes_of(STATISTICS, sizes, StatisticsConfig(1, 1, 2, (None,), keep_pattern=True))["pattern_sum"] == (1, 1, 2, 2)


def test_merging_names_every_field_that_differs():
    config = StatisticsConfig(n_layers=1, n_heads=2, n_positions=8, sliding_windows=(None,), log_floor=None)
    other = StatisticsConfig(n_layers=1, n_heads=2, n_positions=9, sliding_windows=(None,), log_floor=1e-9,
                             excluded_keys=(0,))
    differences = config.differences(other)
    assert any(d.startswith("n_positions: 8 vs 9") for d in differences)
    assert any(d.startswith("excluded_keys") for d in differences)
    assert not any(d.startswith("log_floor") for d in differences)  # an unset floor takes the other's


def test_a_bidirectional_window_is_refused_where_the_configuration_is_made():
    with pytest.raises(InputError, match="bidirectional"):
        StatisticsConfig(n_layers=1, n_heads=1, n_positions=8, sliding_windows=(4,), causal=False)
    with pytest.raises(InputError, match="bidirectional"):
        attention_sums_from_qk(torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4), window=4, causal=False)


def test_the_spec_travels_as_builtins_and_options_replace_its_fields():
    spec = ReductionSpec(lengths=torch.tensor([5, 3]), window=4, excluded_keys=[2, 0], key_bin=torch.arange(5))
    plain = spec.plain()
    assert plain["lengths"] == [5, 3] and plain["excluded_keys"] == [0, 2] and plain["key_bin"] == [0, 1, 2, 3, 4]
    assert all(isinstance(value, (list, int, float, bool, type(None))) for value in plain.values())
    assert ReductionSpec.of(spec, softcap=30.0).softcap == 30.0 and ReductionSpec.of(spec) is spec


def test_the_dispatcher_refuses_triton_on_cpu_and_routes_encoders_to_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    query, key = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    with pytest.raises(InputError, match="needs CUDA"):
        reduce_scores(query, key, ReductionSpec(), engine="triton")
    sums, path = reduce_scores(query, key, ReductionSpec(causal=False), engine="auto")
    assert path == "torch"
    expected = attention_sums_from_qk(query, key, causal=False)
    assert all(torch.equal(sums[name], expected[name]) for name in expected)
