"""Tidy tables: every result kind in long form (one row per statistic and split), the same rows from
``to_rows()``, ``to_dataframe()`` and ``equivariance-probe show --csv / --json``; pandas optional."""

from __future__ import annotations

import csv
import io
import json
import math
import sys

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, IntervalUnavailableError, MissingDependencyError, ProbeResult, ShiftResult
from equivariance_probe.analyses.tidy import COLUMNS
from equivariance_probe.cli import main
from equivariance_probe.runs.positional import PositionalStudy, run_positional

from synthetic import tiny_gemma3, tiny_gpt2

OFFSETS = [0, 7, 30]


def _tokens(n: int = 6, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 90, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A study's two probe results, a shift result and a positional study, each saved and loaded back."""
    folder = tmp_path_factory.mktemp("tidy")
    trained = EquivarianceProbe(tiny_gemma3()).run(_tokens(), progress=False, interval_groups=3)
    trained.metadata["label"] = "trained"
    baseline = EquivarianceProbe(tiny_gemma3(seed=1)).run(_tokens(), progress=False, interval_groups=3)
    baseline.metadata["label"] = "random_init"
    generator = torch.Generator().manual_seed(0)
    segments = [torch.randint(3, 97, (10,), generator=generator).tolist() for _ in range(4)]
    contexts = [torch.randint(3, 97, (30,), generator=generator).tolist() for _ in range(3)]
    shift = EquivarianceProbe(tiny_gpt2()).shift(segments, contexts, offsets=OFFSETS, segment_length=10,
                                                 progress=False, interval_groups=4)
    positional = run_positional(tiny_gpt2(), docs=_tokens(4, 20), n_docs=4, context_length=20, n_prompts=2,
                                prompt_length=12, n_permutations=2, n_kernels=2, progress=False)
    paths = {"trained": trained.save(folder / "results.safetensors"),
             "random_init": baseline.save(folder / "baseline_random_init.safetensors"),
             "shift": shift.save(folder / "shift_trained.safetensors"),
             "positional": positional.save(folder / "positional.safetensors")}
    return {"paths": paths, "trained": trained, "random_init": ProbeResult.load(paths["random_init"]),
            "shift": ShiftResult.load(paths["shift"]), "positional": PositionalStudy.load(paths["positional"])}


def _pick(rows, **where):
    found = [row for row in rows if all(row[key] == value for key, value in where.items())]
    assert len(found) == 1, (where, len(found))
    return found[0]


def test_probe_rows_hold_every_number_with_its_interval_and_the_run(files):
    result = files["trained"]
    rows = result.to_rows()
    assert all(tuple(row) == COLUMNS for row in rows)
    log_eta2 = _pick(rows, statistic="log_eta2", split="model")
    interval = result.query_position_r2("log", "eta2", interval=0.95)
    assert log_eta2["value"] == pytest.approx(interval.estimate) and log_eta2["level"] == 0.95
    assert (log_eta2["low"], log_eta2["high"]) == pytest.approx((interval.low, interval.high))
    assert log_eta2["kind"] == "probe" and log_eta2["variant"] == "trained"
    assert log_eta2["run_id"] == result.metadata["run_id"] and log_eta2["dtype"] == "float32"
    # every head of every head score, at its layer and head
    heads = result.query_position_r2("raw", "fitted", by="head")
    for (layer, head), value in np.ndenumerate(heads):
        assert _pick(rows, statistic="raw_fitted", split="head", layer=layer, head=head)["value"] == pytest.approx(value)
    # a model with sliding-window and global layers: each group, with its interval
    groups = result.query_position_r2("log", "fitted", by="layer_group", interval=0.95)
    for group in ("sliding", "global"):
        row = _pick(rows, statistic="log_fitted", split="layer_group", layer_group=group)
        assert (row["value"], row["low"], row["high"]) == pytest.approx(
            (groups[group].estimate, groups[group].low, groups[group].high))
    fit = _pick(rows, statistic="persistence_power_r2", split="model")
    assert fit["value"] == pytest.approx(result.persistence().fits["power"].r2) and fit["low"] is not None


def test_a_loaded_result_gives_the_same_rows_from_its_header(files):
    loaded = ProbeResult.load(files["paths"]["trained"])
    assert loaded.to_rows() == files["trained"].to_rows()


def test_shift_rows_hold_each_representation_the_loss_by_offset_and_the_mode(files):
    result = files["shift"]
    rows = result.to_rows()
    share = result.share("centred_logits", "offset", interval=0.95)
    row = _pick(rows, statistic="offset_eta2", representation="centred_logits", split="model")
    assert (row["value"], row["low"], row["high"]) == pytest.approx((share.estimate, share.low, share.high))
    assert row["mode"] == "text" and row["kind"] == "shift" and row["unit"] == "share of variance"
    by_layer = result.share("residual", "offset", by="layer")
    for layer, value in enumerate(by_layer):
        assert _pick(rows, statistic="offset_eta2", representation="residual", split="layer",
                     layer=layer)["value"] == pytest.approx(value)
    loss = result.loss_by_offset()
    for offset, value in zip(OFFSETS, np.ravel(getattr(loss, "estimate", loss)), strict=True):
        assert _pick(rows, statistic="loss", offset=offset)["value"] == pytest.approx(float(value))
    assert _pick(rows, statistic="offset_rms", representation="residual")["unit"] == \
        result.summary()["representations"]["residual"]["unit"]


def test_positional_rows_hold_each_head_and_layer_and_the_baseline_as_its_own_variant(files):
    study = files["positional"]
    rows = study.to_rows()
    per_head = np.asarray(study.summary()["attention_toeplitz"]["mean_pattern"]["per_head"])
    for (layer, head), value in np.ndenumerate(per_head):
        assert _pick(rows, statistic="attention_toeplitz_mean_pattern", layer=layer, head=head)["value"] == \
            pytest.approx(value)
    baseline = [row for row in rows if row["variant"] == "random_init"]
    statistics = {row["statistic"] for row in baseline}
    assert baseline and {name for name in statistics if not name.startswith(("probe_", "massive_"))} == {
        "shrinkage_attention", "shrinkage_residual", "correlation_mean_off_diagonal"}
    assert ("probe_baseline" in study.parts) == ("probe_r2_position" in statistics)  # the probe's rows, its own test
    massive = {f"massive_{name}" for name in ("top1", "top2", "top3", "median", "ratio", "position", "dimension")}
    assert ("massive_baseline" in study.parts) == (massive <= statistics)
    probe = study.summary()["probe"]["position"]
    row = _pick(rows, statistic="probe_mae_position", variant="trained", layer=1)
    assert (row["value"], row["low"], row["high"]) == pytest.approx((probe["mae"][1], probe["mae_low"][1],
                                                                     probe["mae_high"][1]))
    assert row["unit"] == "tokens" and row["level"] == 0.95
    assert _pick(rows, statistic="permutation_kl_mean", mode="no_positions")["kind"] == "positional"


def test_to_dataframe_is_the_rows_and_runs_concatenate(files):
    pandas = pytest.importorskip("pandas")
    trained, baseline = files["trained"].to_dataframe(), files["random_init"].to_dataframe()
    assert list(trained.columns) == list(COLUMNS) and len(trained) == len(files["trained"].to_rows())
    both = pandas.concat([trained, baseline, files["shift"].to_dataframe(), files["positional"].to_dataframe()])
    model = both[(both.statistic == "log_eta2") & (both.split == "model")].set_index("variant")
    assert set(model.index) == {"trained", "random_init"}
    assert model.loc["trained", "value"] == pytest.approx(files["trained"].query_position_r2("log", "eta2"))


def test_without_pandas_to_dataframe_names_the_install(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    for call, name in ((files["trained"].to_dataframe, "ProbeResult"), (files["shift"].to_dataframe, "ShiftResult"),
                       (files["positional"].to_dataframe, "PositionalStudy"),
                       (files["trained"].rank_heads().to_dataframe, "HeadRanking")):
        with pytest.raises(MissingDependencyError, match=rf"{name}\.to_dataframe\(\) needs pandas, which is not "
                                                         r"installed in this Python; install it with `pip install pandas`"):
            call()
    assert files["trained"].to_rows()  # the rows need no pandas


def _same(a, b):
    """Two cells equal, a CSV's text against a row's value (empty for None; floats written exactly)."""
    if b is None:
        return a == ""
    if isinstance(b, float):
        return math.isclose(float(a), b, rel_tol=0, abs_tol=0)
    return a == str(b)


def test_show_csv_and_json_print_the_same_rows_as_to_rows(files, capsys):
    paths = files["paths"]
    order = ["trained", "random_init", "shift", "positional"]
    assert main(["show", "--csv", *(str(paths[name]) for name in order)]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    expected = [row for name in order for row in files[name].to_rows()]
    assert len(table) == len(expected) and tuple(table[0]) == COLUMNS
    for printed, row in zip(table, expected, strict=True):
        assert all(_same(printed[column], row[column]) for column in COLUMNS), (printed, row)

    assert main(["show", "--json", str(paths["trained"]), str(paths["random_init"])]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown[str(paths["trained"])]["rows"] == json.loads(json.dumps(files["trained"].to_rows()))
    assert main(["show", "--json", str(paths["shift"])]) == 0
    assert json.loads(capsys.readouterr().out)["tidy0/trained"]["rows"] == \
        json.loads(json.dumps(files["shift"].to_rows()))
    assert main(["show", str(paths["positional"])]) == 0
    assert f"{paths['positional']}: positional analyses of GPT2LMHeadModel\n\n| analysis |" in capsys.readouterr().out

    assert main(["show", "--csv", "--json", str(paths["trained"])]) == 2
    assert "pass --csv (the long table) or --json" in capsys.readouterr().err


def test_show_explains_each_column_of_the_shift_table(files, capsys):
    from equivariance_probe.runs.tables import SHIFT_COLUMN_READINGS, SHIFT_COLUMNS

    assert list(SHIFT_COLUMN_READINGS) == list(SHIFT_COLUMNS)  # every column read, in the table's order
    assert main(["show", str(files["paths"]["shift"])]) == 0
    assert "(--explain gives a plain reading of each column)" in capsys.readouterr().out
    assert main(["show", "--explain", str(files["paths"]["shift"])]) == 0
    shown = capsys.readouterr().out
    table, readings = shown.split("\nColumns:\n")
    assert "| pair η² |" in table
    assert "- pair η²: the share that depends only on which two tokens of the text" in readings
    assert "'residual-stream units'" in readings and len(readings.strip().splitlines()) == len(SHIFT_COLUMNS) + 1


def test_a_probe_result_s_rows_and_table_hold_its_sink_rate_and_first_token_weights(files):
    for result in (files["trained"], files["random_init"]):
        rows = result.to_rows()
        rate = _pick(rows, statistic="sink_rate", split="model")
        interval = result.sink_rate(interval=0.95)
        assert (rate["value"], rate["low"], rate["high"]) == pytest.approx(
            (interval.estimate, interval.low, interval.high), abs=1e-12)
        assert rate["unit"] == "share of heads" and rate["variant"] == result.metadata["label"]
        by_layer = [_pick(rows, statistic="sink_rate", split="layer", layer=layer)["value"]
                    for layer in range(result.n_layers)]
        np.testing.assert_allclose(by_layer, result.sink_rate(by="layer"), atol=1e-12)
        alpha = result.first_token_weight("head")
        for (layer, head), value in np.ndenumerate(alpha):
            assert _pick(rows, statistic="first_token_weight", split="head", layer=layer, head=head)["value"] == \
                pytest.approx(value, abs=1e-12)
        # The share of heads is the share of α₁ above the threshold: the known answer from the weights themselves.
        assert rate["value"] == pytest.approx(float(np.mean(alpha > 0.3)), abs=1e-12)
        assert f"mean first-token weight α₁ {float(np.mean(alpha)):.4f}" in result.table()
        frame = result.to_dataframe() if "pandas" in sys.modules or _has_pandas() else None
        if frame is not None:
            assert set(frame["statistic"]) >= {"sink_rate", "first_token_weight"}


def _has_pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True


def _made_probe():
    """A PositionProbe of 3 layers and 4 folds with known fold scores (no model: the numbers are given)."""
    from equivariance_probe import PositionProbe

    r2 = {"position": np.array([[0.1, 0.2, 0.3, 0.2], [0.5, 0.6, 0.7, 0.6], [0.9, 0.8, 0.85, 0.95]]),
          "log1p_position": np.array([[0.0, 0.1, 0.0, 0.1], [0.4, 0.4, 0.5, 0.3], [0.7, 0.8, 0.9, 0.8]])}
    mae = {target: 10 * (1 - values) for target, values in r2.items()}
    return PositionProbe(r2=r2, mae=mae, alpha={target: np.ones((3, 4)) for target in r2},
                         positions=np.arange(24).reshape(6, 4), groups=np.repeat(np.arange(3), 2),
                         window_fold=np.arange(6) % 4, context_length=32, metadata={"model": "made-up"})


def test_a_position_probe_speaks_the_result_protocol_with_its_rows_table_and_data_frame():
    from equivariance_probe import Result
    from equivariance_probe.analyses.position_probe import PROBE_TARGETS

    probe = _made_probe()
    assert isinstance(probe, Result) and probe.model_name == "made-up" and probe.complete and probe.undefined == {}
    rows = probe.to_rows()
    assert len(rows) == len(PROBE_TARGETS) * 2 * probe.n_layers and set(rows[0]) == set(COLUMNS)
    for target in PROBE_TARGETS:
        for score, table in (("r2", probe.r2[target]), ("mae", probe.mae[target])):
            with pytest.raises(IntervalUnavailableError):  # fold scores alone: no per-document sums to resample
                probe.interval(target, score)
            for layer in range(probe.n_layers):
                row = _pick(rows, statistic=f"probe_{score}_{target}", layer=layer)
                assert row["value"] == pytest.approx(table[layer].mean(), abs=1e-12)  # the mean over folds
                assert row["low"] is None and row["high"] is None  # a score without an interval, not a made-up one
    text = probe.table()
    assert "made-up" in text and f"{probe.r2['position'][2].mean():.3f}" in text and len(text.splitlines()) == 2 + 3
    if _has_pandas():
        frame = probe.to_dataframe()
        assert list(frame.columns) == list(COLUMNS) and len(frame) == len(rows)


def test_a_positional_study_s_rows_hold_its_position_probe(files):
    from equivariance_probe.runs.positional import PositionalStudy

    probe = _made_probe()
    study = PositionalStudy(parts={"probe": probe}, skipped={}, metadata={"model": "made-up"})
    rows = study.to_rows()
    row = _pick(rows, statistic="probe_r2_position", layer=1)
    assert row["variant"] == "trained" and row["kind"] == "positional"
    assert row["value"] == pytest.approx(probe.r2["position"][1].mean(), abs=1e-12)
