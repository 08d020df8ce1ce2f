"""Remote requests sized from the first request's time: the planner against known answers, and the nnsight
adapter's remote path (nnsight's ``remote="local"`` simulation) with a clock that says how long each request
took, so that every plan here is exact and no assertion rests on this machine's speed.

The NDIF server's own timeout against a planned run: tests/ndif/test_ndif_server.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, ModelSource, RequestLimits, RequestPlan, RequestTooLongError, run_study
from equivariance_probe.adapters.request_sizes import plan_requests
from equivariance_probe.errors import InputError, RemoteTimeoutError


# -- the planner ----------------------------------------------------------------------------------
def test_the_default_target_is_a_quarter_of_nnsights_read_timeout():
    limits = RequestLimits()
    assert (limits.execution_timeout, limits.read_timeout, limits.reply_limit) == (3600.0, 600.0, 8 << 20)
    assert limits.limit_seconds == 600.0 and limits.target_seconds == 150.0
    assert RequestLimits(execution_timeout=8.0).target_seconds == 2.0  # the server's is the smaller
    assert RequestLimits(execution_timeout=None, read_timeout=None).target_seconds == math.inf
    assert RequestLimits(request_seconds=7.0).target_seconds == 7.0  # instead of the fraction


def test_documents_per_request_is_the_target_over_the_measured_time_of_one():
    limits = RequestLimits(execution_timeout=40.0, read_timeout=None)  # target 10 s
    plan = plan_requests(4.0, 8, 1000, limits, upper=64)  # 0.5 s a window
    assert (plan.documents, plan.predicted_seconds, plan.target_seconds) == (20, 10.0, 10.0)
    assert plan.refused is None and plan.reply_bytes == 1000
    assert plan_requests(4.0, 8, 1000, limits, upper=16).documents == 16  # never more than the batch asked for
    assert plan_requests(3.0, 4, 1000, limits).documents == 13  # ⌊10 / 0.75⌋
    assert plan_requests(6.0, 1, 1000, limits).documents == 1  # ⌊10 / 6⌋ = 1: still fits
    assert plan_requests(0.0, 4, 0, limits, upper=9).documents == 9  # no measurable time: the batch asked for


def test_one_document_over_the_target_refuses_further_requests_by_name():
    plan = plan_requests(12.0, 1, 1000, RequestLimits(execution_timeout=40.0), unit="segment's grid",
                         fix="fewer contexts or offsets")
    assert plan.documents == 0 and plan.predicted_seconds == 12.0
    assert "one segment's grid is predicted to take 12 s" in plan.refused
    assert "over the 10 s" in plan.refused and "execution timeout 40 s" in plan.refused
    assert "fewer contexts or offsets" in plan.refused and "RequestLimits(" in plan.refused


def test_overrides_and_a_reply_that_grows_with_the_documents():
    assert plan_requests(1.0, 4, 10, RequestLimits(request_seconds=2.0)).documents == 8
    fixed = plan_requests(100.0, 1, 10, RequestLimits(documents_per_request=5))
    assert (fixed.documents, fixed.refused, fixed.predicted_seconds) == (5, None, 500.0)  # as told, unplanned
    mib = 1 << 20
    # 1 MiB per 4 documents against a quarter of 8 MiB: at most 8 documents, whatever the time allows.
    assert plan_requests(1.0, 4, mib, RequestLimits(), reply_grows=True).documents == 8
    assert plan_requests(1.0, 4, mib, RequestLimits(), reply_grows=False).documents == 600


def test_a_plan_reads_back_from_its_plain_values():
    for plan in (plan_requests(4.0, 8, 1000, RequestLimits(), upper=8),
                 plan_requests(1.0, 8, 1000, RequestLimits(execution_timeout=None, read_timeout=None))):
        assert RequestPlan.from_dict(plan.to_dict()) == plan
    assert plan_requests(1.0, 8, 0, RequestLimits(read_timeout=None, execution_timeout=None)).to_dict()[
        "target_seconds"] is None


@pytest.mark.parametrize("values, match", [
    ({"fraction": 0}, "fraction must be a number in \\(0, 1\\]"),
    ({"fraction": 1.5}, "fraction must be"),
    ({"execution_timeout": -1}, "execution_timeout must be a positive number"),
    ({"documents_per_request": 2.5}, "documents_per_request must be a positive integer"),
    ({"request_seconds": float("nan")}, "request_seconds must be a positive number"),
])
def test_bad_limits_are_refused_by_name(values, match):
    with pytest.raises(InputError, match=match):
        RequestLimits(**values)


# -- the nnsight adapter's remote path -----------------------------------------------------------
nnsight = pytest.importorskip("nnsight")

from equivariance_probe.adapters import nnsight as nnsight_adapter  # noqa: E402
from equivariance_probe.adapters import nnsight_segments  # noqa: E402
from equivariance_probe.adapters.nnsight import NNsightAdapter  # noqa: E402
from synthetic import tiny_gemma3  # noqa: E402
from test_nnsight_adapter import tiny_tokenizer, transformers_model  # noqa: E402

#: Each request "takes" this long by the clock below, whatever its size.
REQUEST_SECONDS = 4.0


@pytest.fixture
def requests(monkeypatch):
    """A clock that advances ``REQUEST_SECONDS`` from each request's start to its end, and the windows of each
    request the adapter sends (the simulation serialises each as for NDIF and runs it here)."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(nnsight_adapter, "perf_counter", lambda: next(ticks) * REQUEST_SECONDS)
    sent: list[int] = []
    trace = NNsightAdapter._trace_statistics

    def spy(self, tokens, *args):
        sent.append(int(tokens.shape[0]))
        return trace(self, tokens, *args)

    monkeypatch.setattr(NNsightAdapter, "_trace_statistics", spy)
    return sent


def remote_probe(**limits) -> EquivarianceProbe:
    return EquivarianceProbe(NNsightAdapter(transformers_model(tiny_gemma3()), remote="local",
                                            request_limits=RequestLimits(**limits)))


def windows(n: int, width: int = 12) -> torch.Tensor:
    return torch.randint(3, 97, (n, width), generator=torch.Generator().manual_seed(n))


def test_requests_after_the_first_carry_what_its_time_allows(requests):
    """8 windows in 4 s: 0.5 s a window, so a 2 s target gives requests of 4 windows."""
    tokens = windows(20)
    with pytest.warns(UserWarning, match="interval groups dropped"):
        result = remote_probe(request_seconds=2.0).run(tokens, batch_size=8, progress=False)
    assert requests == [8, 4, 4, 4]
    assert result.metadata["requests"] == {"documents": 4, "predicted_seconds": 2.0, "target_seconds": 2.0,
                                           "measured_seconds": 4.0, "measured_documents": 8,
                                           "reply_bytes": result.metadata["requests"]["reply_bytes"],
                                           "refused": None, "context_length": 12}
    hf_model = tiny_gemma3()
    hf_model.set_attn_implementation("eager")
    local = EquivarianceProbe(hf_model).run(tokens, batch_size=8, progress=False, interval_groups=0)
    assert result.statistics.n_windows == 20
    for name, value in local.statistics.arrays.items():
        assert torch.allclose(result.statistics.arrays[name], value, rtol=1e-5, atol=1e-7), name


def test_a_request_predicted_near_the_timeout_is_not_sent_and_the_finished_ones_are_kept(requests):
    probe = remote_probe(execution_timeout=8.0, read_timeout=None)  # target 2 s; one window: 4 s
    with pytest.raises(RequestTooLongError, match="one window is predicted to take 4 s") as caught:
        probe.run(windows(3), batch_size=1, progress=False)
    assert isinstance(caught.value, RemoteTimeoutError)
    assert requests == [1]  # the second was never sent
    partial = caught.value.partial_result
    assert partial is probe.last_result and partial.statistics.n_windows == 1
    assert partial.metadata["complete"] is False and partial.metadata["requests"]["refused"]


def test_a_segment_predicted_near_the_timeout_is_refused_before_it_is_sent(monkeypatch):
    """One request is one segment's whole grid: after the first segment's 4 s against a 2 s target the second
    is not sent, and the first is kept."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(nnsight_segments, "perf_counter", lambda: next(ticks) * REQUEST_SECONDS)
    probe = remote_probe(request_seconds=2.0)
    generator = torch.Generator().manual_seed(0)
    segments = [torch.randint(3, 97, (6,), generator=generator).tolist() for _ in range(3)]
    contexts = [torch.randint(3, 97, (8,), generator=generator).tolist() for _ in range(2)]
    with pytest.raises(RequestTooLongError, match="one segment's grid is predicted.*fewer contexts or offsets") \
            as caught:
        probe.shift(segments, contexts, offsets=[0, 4, 8], segment_length=6, batch_size=2, progress=False)
    assert caught.value.partial_result.metadata["complete"] is False
    assert caught.value.partial_result.statistics.n_segments == 1
    # Another grid is measured again: its first segment is sent, and the second refused.
    with pytest.raises(RequestTooLongError) as again:
        probe.shift(segments, contexts, offsets=[0, 4], segment_length=6, batch_size=2, progress=False)
    assert again.value.partial_result.statistics.n_segments == 1


def test_a_checkpointed_remote_study_keeps_every_request_and_resumes_bitwise(requests, tmp_path):
    """Refused after its first request, the study's checkpoint holds that request; resumed under a target that
    allows 4 windows a request, it sends only the rest, and its sums equal, bit for bit, those of a study that
    ran under that target from the start."""
    vocabulary = [f"t{i}" for i in range(3, 97)]
    generator = np.random.default_rng(0)
    corpus = [" ".join(generator.choice(vocabulary, size=12)) for _ in range(20)]

    def study(folder, resume=False, **limits):
        return run_study(ModelSource(framework="nnsight"), corpus=corpus, n_docs=20, baselines=(), progress=False,
                         loaded=(transformers_model(tiny_gemma3()), tiny_tokenizer()), remote="local",
                         request_limits=RequestLimits(**limits), checkpoint_dir=folder, resume=resume,
                         context_length=12, batch_size=8, sample_size=0, interval_groups=0)

    with pytest.raises(RequestTooLongError) as caught:
        study(tmp_path / "a", request_seconds=0.1)
    assert requests == [8] and caught.value.partial_result.statistics.n_windows == 8
    resumed = study(tmp_path / "a", resume=True, request_seconds=2.0)
    assert requests == [8, 4, 4, 4]  # nothing finished is sent again
    assert resumed.trained.metadata["checkpoint"]["resumed_from"]["current"]["position"] == 8
    fresh = study(tmp_path / "b", request_seconds=2.0)
    assert requests[4:] == [8, 4, 4, 4]
    for name, value in fresh.trained.statistics.arrays.items():
        assert torch.equal(resumed.trained.statistics.arrays[name], value), name


def test_request_limits_are_for_remote_runs_only():
    with pytest.raises(InputError, match="request_limits sizes remote requests only"):
        run_study(corpus=["t5 t6 t7"], n_docs=1, baselines=(), request_limits=RequestLimits(), progress=False)
    with pytest.raises(InputError, match="baselines=\\(\\)"):
        run_study(ModelSource(framework="nnsight"), corpus=["t5 t6 t7"], n_docs=1, remote=True, progress=False,
                  loaded=(object(), None))
