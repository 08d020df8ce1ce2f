"""The probe's remote path against a real NDIF server on localhost (ndif 0.1.2, see ndif_stack.py).

Server components every remote run here goes through: ``redis-server`` (the request queue and the
pub/sub channel the result rides back on, inline), the API (gunicorn + FastAPI ``/request``,
the ``/subscribe`` websocket, the queue dispatcher), Ray (head node, ndif's controller actor, which
placed the model), ndif's sandboxed model actor (``SandboxModelDeployment``: request template,
execution-timeout race, result blob) with its CPU load, and a sandbox runner process
(``ndif.services.ray.sandbox.runner``: unpickles the request against a meta model and runs the
traced block lock-step with the actor's forward pass over a Unix socket). No object store runs.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch
from conftest import client_model, tiny_tokenizer, token_windows

from equivariance_probe import EquivarianceProbe, ModelSource, RequestLimits, RequestTooLongError, run_study
from equivariance_probe.adapters.nnsight import NNsightAdapter
from equivariance_probe.adapters.nnsight_remote import ATTENTION_CALL, reply_nbytes
from equivariance_probe.adapters.server_versions import attention_call_label
from equivariance_probe.errors import (
    ModelNotDeployedError,
    RemoteResultTooLargeError,
    RemoteTimeoutError,
    ServerUnreachableError,
)
from equivariance_probe.result import ProbeResult

WIDTH = 16


def local_run(folder: str, tokens: torch.Tensor, **kwargs) -> ProbeResult:
    """The same study on the same weights, here: the Hugging Face model, eager weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    kwargs.setdefault("progress", False)
    return EquivarianceProbe(model).run(tokens, **kwargs)


def remote_probe(folder: str, **kwargs) -> EquivarianceProbe:
    return EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True, **kwargs))


def assert_same_statistics(got: ProbeResult, expected: ProbeResult) -> None:
    """The tolerance the remote path states (tests/test_nnsight_adapter.py): float32 patterns
    recomputed from q, k against eager weights, float64 sums."""
    assert got.statistics.n_windows == expected.statistics.n_windows
    assert got.statistics.log_floor == expected.statistics.log_floor
    np.testing.assert_array_equal(got.statistics.window_fingerprints, expected.statistics.window_fingerprints)
    assert set(got.statistics.arrays) == set(expected.statistics.arrays)
    for name, value in expected.statistics.arrays.items():
        assert torch.allclose(got.statistics.arrays[name], value, rtol=1e-5, atol=1e-7), name


def test_probe_on_the_server_equals_the_local_run(ndif_server, sent_and_received):
    """Gemma 3 with sliding-window layers, one window per request (interval groups kept)."""
    folder = ndif_server.folders["gemma"]
    tokens = token_windows(4, WIDTH)
    remote = remote_probe(folder).run(tokens, batch_size=1, progress=False, exclude_keys=[0])
    local = local_run(folder, tokens, batch_size=1, exclude_keys=[0])
    assert remote.metadata["complete"] is True
    # The server reported its releases (ndif's /env) before the first request, and they give the attention call.
    server = remote.metadata["model"]["server"]
    assert (server["host"], server["source"]) == (ndif_server.url, "reported")
    assert {name: server[name] for name in ("nnsight", "transformers", "torch")} == {
        name: importlib.metadata.version(name) for name in ("nnsight", "transformers", "torch")}
    assert attention_call_label(server["nnsight"], server["transformers"]) == ATTENTION_CALL
    assert remote.statistics.sliding_windows == (8, 8, None)
    assert_same_statistics(remote, local)
    assert np.array_equal(remote.statistics.groups.ids, local.statistics.groups.ids)
    found, expected = remote.interval("log_fitted"), local.interval("log_fitted")
    assert (found.low, found.high) == pytest.approx((expected.low, expected.high), rel=1e-5)
    assert remote.query_position_r2() == pytest.approx(local.query_position_r2(), rel=1e-5)
    # One request per window; what comes back is the zstd-compressed torch.save of the sums.
    assert len(sent_and_received["sent"]) == len(sent_and_received["received"]) == 4
    assert max(sent_and_received["received"]) < reply_nbytes(3, 4, WIDTH) + 20_000


def test_batches_of_several_windows_equal_the_local_run(ndif_server):
    folder = ndif_server.folders["gemma"]
    tokens = token_windows(5, WIDTH, seed=1)
    with pytest.warns(UserWarning, match="interval groups dropped"):
        remote = remote_probe(folder).run(tokens, batch_size=3, progress=False)
    assert_same_statistics(remote, local_run(folder, tokens, batch_size=3, interval_groups=0))


def test_server_down_is_a_remote_error_before_any_window(ndif_server):
    from ndif_stack import free_port

    probe = EquivarianceProbe(NNsightAdapter(client_model(ndif_server.folders["gemma"]),
                                             remote=f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(ServerUnreachableError, match="cannot be reached") as caught:
        probe.run(token_windows(2, WIDTH), batch_size=1, progress=False)
    assert caught.value.partial_result.statistics.n_windows == 0
    assert caught.value.partial_result.metadata["complete"] is False


def test_a_model_the_server_does_not_run_is_named(ndif_server):
    probe = remote_probe(ndif_server.folders["llama"])
    with pytest.raises(ModelNotDeployedError, match="does not run this model"):
        probe.run(token_windows(2, WIDTH), batch_size=1, progress=False)


def test_a_reply_too_large_for_the_inline_channel_keeps_complete_batches(ndif_server):
    """keep_pattern adds 8·L·H·T² bytes: at T = 512, 25 MB (about 4 MB zstd-compressed: the causal and
    sliding-window zeros), over the 1 MiB this stack's Redis lets ride pub/sub; with no object store the
    server cannot return it, and the error says so."""
    folder = ndif_server.folders["gemma"]
    width = 512
    assert reply_nbytes(3, 4, width, keep_pattern=True) > 8 << 20
    probe = remote_probe(folder)
    with pytest.raises(RemoteResultTooLargeError, match="over the size the server returns inline") as caught:
        probe.run(token_windows(2, width), batch_size=1, keep_pattern=True, progress=False)
    assert caught.value.partial_result.metadata["complete"] is False


def test_connection_dropped_mid_run_keeps_complete_batches_and_resume_sends_only_the_rest(
        ndif_server, sent_and_received):
    """The API goes down after the first two windows (one request each); the error keeps them; once the
    API is back, the run goes on from the third window: two requests more, not four."""
    folder = ndif_server.folders["gemma"]
    rows = token_windows(4, WIDTH, seed=2)
    probe = remote_probe(folder)

    def documents():
        yield rows[0]
        yield rows[1]
        ndif_server.stack.stop_api()  # the connection to the server drops here
        yield rows[2]
        yield rows[3]

    try:
        with pytest.raises(ServerUnreachableError, match="complete batches before it are kept") as caught:
            probe.run(documents(), batch_size=1, context_length=WIDTH, progress=False)
    finally:
        ndif_server.stack.start_api()
    partial = caught.value.partial_result
    assert partial is probe.last_result and partial.metadata["complete"] is False
    assert partial.statistics.n_windows == 2
    assert len(sent_and_received["received"]) == 2
    rest = probe.run(rows[partial.statistics.n_windows:], batch_size=1, progress=False)
    assert len(sent_and_received["received"]) == 4  # windows 3 and 4 only
    resumed = partial + rest
    assert_same_statistics(resumed, local_run(folder, rows, batch_size=1))


def test_a_request_over_the_server_timeout_is_named(ndif_server):
    """A second deployment of the same weights with a 1 ms execution timeout (ndif's per-model option)."""
    folder = ndif_server.folders["gemma_timeout"]
    ndif_server.stack.deploy(client_model(folder).to_model_key(), folder, timeout_seconds=0.001)
    with pytest.raises(RemoteTimeoutError, match="execution timeout"):
        remote_probe(folder).run(token_windows(1, WIDTH), batch_size=1, progress=False)


#: The execution timeout of the deployment below: a few seconds, as a server sets with its per-model
#: ``execution_timeout_seconds`` (NDIF's public service: 3,600 s).
SHORT_TIMEOUT = 8.0


@pytest.fixture(scope="module")
def short_timeout_model(ndif_server) -> str:
    folder = ndif_server.folders["gemma_short"]
    ndif_server.stack.deploy(client_model(folder).to_model_key(), folder, timeout_seconds=SHORT_TIMEOUT)
    return folder


def test_requests_are_sized_to_a_quarter_of_a_short_server_timeout(short_timeout_model, sent_and_received):
    """Told the server's 8 s timeout, the run plans requests of at most 2 s from its first one (4 windows); every
    request completes, each later one carries what the plan allows, and the sums are the local run's. Where this
    machine is so busy that one window already takes over 2 s, the next request is refused by name instead,
    the first one kept; either way no request is sent that the first one's time says would come near 8 s."""
    tokens = token_windows(12, WIDTH, seed=3)
    probe = remote_probe(short_timeout_model, request_limits=RequestLimits(execution_timeout=SHORT_TIMEOUT))
    try:
        with pytest.warns(UserWarning, match="interval groups dropped"):
            result = probe.run(tokens, batch_size=4, progress=False)
    except RequestTooLongError as refused:
        plan = probe.adapter.requests.plan
        assert plan.predicted_seconds > SHORT_TIMEOUT / 4 and plan.measured_documents == 4
        assert refused.partial_result.statistics.n_windows == 4 and len(sent_and_received["received"]) == 1
        return
    plan = result.metadata["requests"]
    assert plan["target_seconds"] == SHORT_TIMEOUT / 4 and plan["refused"] is None
    assert plan["predicted_seconds"] <= SHORT_TIMEOUT / 4 and plan["measured_documents"] == 4
    per_request = min(4, plan["documents"])
    assert len(sent_and_received["received"]) == 1 + -(-8 // per_request)
    assert_same_statistics(result, local_run(short_timeout_model, tokens, batch_size=4, interval_groups=0))


def test_a_refused_remote_study_keeps_its_requests_and_resumes_from_them(short_timeout_model, sent_and_received,
                                                                           tmp_path):
    """A checkpointed study whose target (1 µs) no request can meet stops after its first request, before the
    second is sent, and its checkpoint holds that request; resumed under the server's 8 s timeout it sends only
    the windows left, and the result is the local run's."""
    from transformers import AutoModelForCausalLM

    corpus = [" ".join(f"t{int(t)}" for t in row) for row in token_windows(6, WIDTH, seed=4)]

    def study(resume: bool, **limits):
        return run_study(ModelSource(framework="nnsight"), corpus=corpus, n_docs=6, baselines=(), remote=True,
                         loaded=(client_model(short_timeout_model), tiny_tokenizer()), progress=False,
                         request_limits=RequestLimits(**limits), checkpoint_dir=tmp_path, resume=resume,
                         context_length=WIDTH, batch_size=2, sample_size=0, interval_groups=0)

    with pytest.raises(RequestTooLongError, match="one window is predicted") as caught:
        study(False, request_seconds=1e-6)
    assert caught.value.partial_result.statistics.n_windows == 2 and len(sent_and_received["received"]) == 1
    resumed = study(True, execution_timeout=SHORT_TIMEOUT).trained
    assert resumed.metadata["checkpoint"]["resumed_from"]["current"]["position"] == 2
    plan = resumed.metadata["requests"]
    assert plan["measured_documents"] == 2 and plan["target_seconds"] == SHORT_TIMEOUT / 4  # measured, re-planned
    assert len(sent_and_received["received"]) - 1 == -(-4 // min(2, plan["documents"]))  # only the 4 windows left
    model = AutoModelForCausalLM.from_pretrained(short_timeout_model, attn_implementation="eager").eval()
    local = EquivarianceProbe(model, tokenizer=tiny_tokenizer()).run(corpus, context_length=WIDTH, batch_size=2,
                                                                     interval_groups=0, progress=False)
    assert_same_statistics(resumed, local)


def test_the_position_probe_samples_on_the_server_equal_the_local_run(ndif_server, sent_and_received):
    """The residual stream at sampled positions, picked on the server: each reply is ``(L+1)·P·d`` numbers per
    window, whatever the window's length."""
    from transformers import AutoModelForCausalLM

    from equivariance_probe.analyses.position_probe import probe_positions, residual_samples

    folder = ndif_server.folders["gemma"]
    tokens = token_windows(3, WIDTH)
    positions = probe_positions(3, WIDTH, 4, seed=0)
    remote = residual_samples(NNsightAdapter(client_model(folder), remote=True), tokens, positions, batch_size=3)
    local = residual_samples(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(), tokens,
                             positions, batch_size=3)
    assert remote.shape == local.shape == (4, 3 * 4, 32)
    # The server runs its own attention kernel in float32: equal to float32 rounding (measured: 1.4e-6).
    torch.testing.assert_close(remote, local, rtol=1e-4, atol=1e-5)
    assert len(sent_and_received["received"]) == 1
    assert max(sent_and_received["received"]) < remote.numel() * 4 + 20_000


def test_the_score_profile_on_the_server_equals_the_local_run(ndif_server, sent_and_received):
    """Each layer's attention call read on the server and reduced there to its diagonal sums and counts: a reply of
    ``2·L·H·(2T − 1)`` numbers per batch, whatever the queries' and keys' size."""
    from transformers import AutoModelForCausalLM

    from equivariance_probe.analyses.positional import score_profile

    folder = ndif_server.folders["gemma"]
    tokens = token_windows(3, WIDTH)
    remote = score_profile(NNsightAdapter(client_model(folder), remote=True), tokens, batch_size=3, exclude_keys=[0])
    local = score_profile(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(), tokens,
                          batch_size=3, exclude_keys=[0])
    assert remote.sums.shape == local.sums.shape == (3, 4, 2 * WIDTH - 1)
    np.testing.assert_array_equal(remote.counts, local.counts)  # the sliding windows of layers 0 and 1 included
    assert not remote.counts[:2, :, WIDTH - 1 + 8:].any() and remote.counts[2, :, WIDTH - 1 + 8:].any()
    # The server runs its own attention kernel in float32: equal to float32 rounding.
    np.testing.assert_allclose(remote.sums, local.sums, rtol=1e-4, atol=1e-5)
    assert len(sent_and_received["received"]) == 1
    assert max(sent_and_received["received"]) < remote.sums.nbytes + remote.counts.nbytes + 20_000


def test_permutation_sensitivity_on_the_server_equals_the_local_run(ndif_server):
    """The last position's logits and final state come back, and per layer one number: the largest attention
    mass on later keys, from weights recomputed on the server."""
    from transformers import AutoModelForCausalLM

    from equivariance_probe.analyses.order import permutation_sensitivity

    folder = ndif_server.folders["gemma"]
    tokens = token_windows(2, WIDTH)
    tokens[:, 0] = 1
    remote = permutation_sensitivity(NNsightAdapter(client_model(folder), remote=True), tokens, n_permutations=3,
                                     ablations=("none",))
    local = permutation_sensitivity(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(),
                                    tokens, n_permutations=3, ablations=("none",))
    np.testing.assert_allclose(remote.total_variation["none"], local.total_variation["none"], atol=1e-6)
    np.testing.assert_allclose(remote.hidden_change["none"], local.hidden_change["none"], atol=1e-5)
    assert remote.upper_mass["none"] == local.upper_mass["none"] == 0.0
