"""The shift test on a real NDIF server on localhost (see test_ndif_server.py for its components).

Each segment's whole grid runs as one nnsight session on the server, one trace per batch of windows; the
running sums stay there between the traces and only the segment's float64 sums come back. The check of the
recomputation runs first, as one trace on the server.

Tolerance: the server and the local Hugging Face model hold the same float32 weights and both shift runs
recompute the segment block's scores in float32 from the queries and keys their own kernel receives, so every
sum agrees to ``rtol=1e-5`` (``atol=1e-9`` for sums that are zero in exact arithmetic, such as centred logits
summed over a row), and each Jensen–Shannon sum within 1e-6 nats per position counted (float32's resolution of a
divergence over the vocabulary), as tests/test_shift_adapters.py states for float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import client_model

from equivariance_probe import EquivarianceProbe
from equivariance_probe.adapters.nnsight import NNsightAdapter
from equivariance_probe.adapters.nnsight_remote import segment_reply_nbytes

M = 10
#: Offsets on both sides of the tiny Gemma 3's sliding window of 8 tokens.
OFFSETS = [0, 5, 12, 40]


def design(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, 97, (M,), generator=generator).tolist() for _ in range(3)]
    contexts = [torch.randint(3, 97, (max(OFFSETS),), generator=generator).tolist() for _ in range(2)]
    return segments, contexts


def shift(probe: EquivarianceProbe, mode: str):
    segments, contexts = design()
    return probe.shift(segments, contexts if mode == "text" else None, mode=mode, offsets=OFFSETS, segment_length=M,
                       batch_size=3, progress=False, interval_groups=3)


def local_shift(folder: str, mode: str):
    """The same shift run on the same weights, here: the Hugging Face model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return shift(EquivarianceProbe(model, tokenizer=AutoTokenizer.from_pretrained(folder)), mode)


def assert_same_sums(got, expected) -> None:
    arrays = expected.statistics.arrays
    assert set(got.statistics.arrays) == set(arrays)
    for name, value in arrays.items():
        value = np.asarray(value)
        difference = np.abs(np.asarray(got.statistics.arrays[name]) - value)
        allowed = 1e-5 * np.abs(value) + (1e-6 * np.asarray(arrays[name.replace("_sum", "_count")])
                                          if name.startswith("js_") and name.endswith("_sum") else 1e-9)
        assert (difference <= allowed).all(), (name, float(difference.max()))
    np.testing.assert_array_equal(got.statistics.segment_fingerprints, expected.statistics.segment_fingerprints)


def test_shift_on_the_server_equals_the_local_run_and_only_sums_come_back(ndif_server, sent_and_received):
    folder = ndif_server.folders["gemma"]
    probe = EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True))
    remote = shift(probe, "text")
    expected = local_shift(folder, "text")
    assert remote.metadata["complete"] is True
    assert_same_sums(remote, expected)
    np.testing.assert_allclose(remote.share("centred_logits", "offset", by="layer"),
                               expected.share("centred_logits", "offset", by="layer"), rtol=1e-5)
    check = remote.metadata["recompute_check"]
    assert check["passed"] is True and check["max_difference"] < 1e-5 and "server kernel" in check["compared"]
    # One request for the check, then one per segment however many contexts and offsets (2 × 4 windows each).
    assert len(sent_and_received["sent"]) == len(sent_and_received["received"]) == 1 + 3
    layout = probe.adapter.layout
    sums_bytes = segment_reply_nbytes(layout.n_layers, layout.n_heads, len(OFFSETS), hidden_size=remote.config.hidden_size)
    # What comes back is the zstd-compressed torch.save of the sums: their bytes and a fixed envelope, where one
    # window's float32 residual stream at the segment alone is 4·m·d bytes per layer, its distributions 4·m·V.
    replies = sent_and_received["received"][1:]
    print(f"segment requests: {sent_and_received['sent'][1:]} bytes; replies: {replies} bytes; float64 sums "
          f"{sums_bytes} bytes; check: sent {sent_and_received['sent'][0]}, received {sent_and_received['received'][0]}")
    assert max(replies) < sums_bytes + 20_000


def test_position_ids_shift_on_the_server_equals_the_local_run(ndif_server):
    folder = ndif_server.folders["gemma"]
    remote = shift(EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True)), "position_ids")
    assert_same_sums(remote, local_shift(folder, "position_ids"))


def test_connection_dropped_mid_shift_keeps_finished_segments_and_the_rest_merges(ndif_server, monkeypatch):
    """The API goes down once the first segment's sums are in; the error keeps that segment; once the API is
    back, the remaining segments run and the two results add up to the local run."""
    from equivariance_probe.errors import ServerUnreachableError
    from equivariance_probe.statistics.shift import ShiftStatistics

    folder = ndif_server.folders["gemma"]
    segments, contexts = design()
    probe = EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True))
    add_segment_sums = ShiftStatistics.add_segment_sums

    def add_then_drop(self, fingerprint, group, sums):
        add_segment_sums(self, fingerprint, group, sums)
        ndif_server.stack.stop_api()  # the connection to the server drops here

    options = dict(offsets=OFFSETS, segment_length=M, batch_size=3, progress=False, interval_groups=3)
    monkeypatch.setattr(ShiftStatistics, "add_segment_sums", add_then_drop)
    try:
        with pytest.raises(ServerUnreachableError, match="complete segments before it are kept") as caught:
            probe.shift(segments, contexts, **options)
    finally:
        monkeypatch.setattr(ShiftStatistics, "add_segment_sums", add_segment_sums)
        ndif_server.stack.start_api()
    partial = caught.value.partial_result
    assert partial is probe.last_result and partial.metadata["complete"] is False
    assert partial.statistics.n_segments == 1
    rest = probe.shift(segments[1:], contexts, **options)
    assert_same_sums(partial + rest, local_shift(folder, "text"))


def test_the_block_level_attribution_on_the_server_equals_the_local_run(ndif_server):
    """The attribution's Gram matrices are summed in the segment's session on the server, with its other sums, and
    come back as sums alone: equal to the local run's to float32 rounding (``rtol=1e-5``) relative to the
    matrix's largest entry, and the identity check holds there as here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ndif_server.folders["gemma"]
    segments, contexts = design()
    options = {"offsets": OFFSETS, "segment_length": M, "batch_size": 3, "progress": False, "interval_groups": 3,
               "attribution": True}
    remote = EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True)).shift(segments, contexts, **options)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = EquivarianceProbe(model, tokenizer=AutoTokenizer.from_pretrained(folder)).shift(segments, contexts,
                                                                                                **options)
    assert remote.config.components == expected.config.components
    for term in ("offset", "context"):
        name = f"attribution/{term}_gram"
        value = np.asarray(expected.statistics.arrays[name])
        np.testing.assert_allclose(remote.statistics.arrays[name], value, rtol=0, atol=1e-5 * np.abs(value).max())
    assert remote.metadata["attribution_check"]["passed"] is True


def test_a_mechanism_of_one_s_own_runs_on_the_server_and_equals_the_local_run(ndif_server):
    """A toy mechanism (the mean norm of an MLP's output at the segment, by offset), added without touching an
    adapter: on the server its measure runs where the model runs (one more request per batch), and only a number
    per window comes back; it equals the Hugging Face run here to float32 rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toy_mechanism import mean_norm

    from equivariance_probe.features.mechanisms import SegmentMechanism, mechanism_by_offset

    folder = ndif_server.folders["gemma"]
    mechanism = SegmentMechanism("mlp_norm", "mlp.1", mean_norm)
    segments, contexts = design()
    options = dict(offsets=OFFSETS, segment_length=M, batch_size=3, progress=False, interval_groups=3,
                   mechanisms=[mechanism])
    remote = EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True)).shift(segments, contexts, **options)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    local = EquivarianceProbe(model, tokenizer=AutoTokenizer.from_pretrained(folder)).shift(segments, contexts, **options)
    got, expected = (mechanism_by_offset(run.metadata, "mlp_norm") for run in (remote, local))
    assert (got["count"] == expected["count"]).all() and got["count"].sum() == 3 * 2 * len(OFFSETS)
    np.testing.assert_allclose(got["mean"], expected["mean"], rtol=1e-5)
