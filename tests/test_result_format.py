"""Result file versions: version 1 files still load, version 2 checks its schema and checksum,
and a partial result never reads as a complete one. Version 3 (safetensors) has its
own tests in test_result_file_format.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, ProbeResult, ResultFileError
from equivariance_probe.records.fileformat import checksum
from equivariance_probe.records.result_file import FORMAT_VERSION

from synthetic import result_header, tiny_gpt2, uniform_pattern, SyntheticAdapter

V1_FIXTURE = Path(__file__).parent / "data" / "result_format_v1.json"
#: Written by the version-2 writer (equivariance_probe before format 3) from the run of ``_v1_run``.
V2_FIXTURE = Path(__file__).parent / "data" / "result_format_v2.json"


def _v1_run() -> ProbeResult:
    """The run that wrote the version-1 fixture (equivariance_probe 0.1.0, JSON format version 1)."""
    tokens = torch.randint(0, 97, (3, 8), generator=torch.Generator().manual_seed(11))
    return EquivarianceProbe(tiny_gpt2(n_layer=2, n_head=2)).run(tokens, progress=False, sample_size=20, sample_seed=0)


def test_a_version_1_file_loads_with_its_numbers(tmp_path):
    data = json.loads(V1_FIXTURE.read_text())
    assert data["format_version"] == 1 and "checksum" not in data and "complete" not in data
    loaded = ProbeResult.load(V1_FIXTURE)
    assert loaded.complete and loaded.n_windows == 3
    # The numbers the version-1 writer stored in its summary are those of the loaded sums ...
    assert loaded.query_position_r2("log", "eta2") == pytest.approx(data["summary"]["query_position_r2"]["log"]["eta2"], rel=1e-12)
    # ... and the sums are those of the same run today, to the float32 rounding of the model's own
    # forward pass, which changes between transformers releases (GPT-2's attention: 1e-7 relative).
    fresh = _v1_run()
    # Today's run also keeps the first token's sums (attention sinks), which the old file never had.
    assert "first_key_sum" not in loaded.statistics.arrays and not loaded.keeps_first_token
    for name, value in fresh.statistics.arrays.items():
        if name != "first_key_sum":
            assert torch.allclose(loaded.statistics.arrays[name], value, rtol=1e-6, atol=1e-6), name
    assert len(loaded.entry_sample()["attention"]) == 20
    # Saving writes the current version, which loads back identically.
    again = result_header(loaded.save(tmp_path / "again.safetensors"))
    assert again["format_version"] == FORMAT_VERSION == 3 and again["checksum"].startswith("sha256:")
    reloaded = ProbeResult.load(tmp_path / "again.safetensors")
    for name, value in loaded.statistics.arrays.items():
        assert torch.equal(reloaded.statistics.arrays[name], value), name


def test_a_version_2_file_loads_with_its_numbers():
    data = json.loads(V2_FIXTURE.read_text())
    assert data["format_version"] == 2 and data["checksum"].startswith("sha256:") and data["complete"] is True
    loaded = ProbeResult.load(V2_FIXTURE)
    assert loaded.complete and loaded.n_windows == 3 and len(loaded.entry_sample()["attention"]) == 20
    assert loaded.query_position_r2("log", "eta2") == pytest.approx(data["summary"]["query_position_r2"]["log"]["eta2"], rel=1e-12)
    assert len(loaded.statistics.window_fingerprints) == 0  # version 2 carried none
    fresh = _v1_run()
    # Today's run also keeps the first token's sums (attention sinks), which the old file never had.
    assert "first_key_sum" not in loaded.statistics.arrays and not loaded.keeps_first_token
    for name, value in fresh.statistics.arrays.items():
        if name != "first_key_sum":
            assert torch.allclose(loaded.statistics.arrays[name], value, rtol=1e-6, atol=1e-6), name


def test_checksum_catches_a_changed_number(tmp_path):
    data = json.loads(V2_FIXTURE.read_text())
    assert data["checksum"] == checksum(data["statistics"]) and data["complete"] is True
    data["statistics"]["n_windows"] = 4
    (tmp_path / "edited.json").write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="checksum does not match"):
        ProbeResult.load(tmp_path / "edited.json")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["statistics"]["config"].__setitem__("n_layers", "two"), "config.n_layers"),
        (lambda d: d["statistics"]["config"].pop("windows"), "config.windows"),
        (lambda d: d["statistics"]["config"].__setitem__("windows", [None]), "one entry per layer"),
        (lambda d: d["statistics"].__setitem__("n_tokens", -1), "n_tokens"),
        (lambda d: d.__setitem__("metadata", [1, 2]), "'metadata' must be an object"),
        (lambda d: d.__setitem__("complete", "yes"), "'complete' must be true or false"),
        (lambda d: d["statistics"]["arrays"]["raw_sum"].pop("data"), "raw_sum"),
        (lambda d: d.__setitem__("format_version", 4), "format_version 4.*Upgrade"),
        (lambda d: d.__setitem__("format_version", 3), "JSON but says format_version 3"),
        (lambda d: d.__setitem__("format_version", True), "format_version True"),
    ],
)
def test_schema_check_names_the_bad_field(tmp_path, edit, message):
    data = json.loads(V2_FIXTURE.read_text())
    data.pop("checksum")  # so that the schema check, not the checksum, speaks
    edit(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match=message):
        ProbeResult.load(tmp_path / "bad.json")


def test_a_partial_result_is_saved_and_loaded_as_partial(tmp_path):
    def pattern(layer, tokens):
        if tokens[0, 0] == 7:
            raise KeyboardInterrupt  # the user presses Ctrl-C during the second batch
        return uniform_pattern(tokens.shape[1]).expand(tokens.shape[0], 1, -1, -1)

    probe = EquivarianceProbe(SyntheticAdapter(pattern, n_layers=1, n_heads=1))
    tokens = torch.zeros((4, 6), dtype=torch.long)
    tokens[2:, 0] = 7
    with pytest.raises(KeyboardInterrupt):
        probe.run(tokens, batch_size=2, progress=False)
    partial = probe.last_result
    assert partial.n_windows == 2 and not partial.complete
    loaded = ProbeResult.load(partial.save(tmp_path / "partial.safetensors"))
    assert not loaded.complete and result_header(tmp_path / "partial.safetensors")["complete"] is False
    # A merge with a partial result is partial.
    whole = probe.run(tokens[:2] + 1, progress=False)  # other windows than the partial result's (no double count)
    assert whole.complete and not (whole + loaded).complete
    assert np.isclose((whole + loaded).query_position_r2("raw", "prior"), 1.0)
