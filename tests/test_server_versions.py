"""The check of an NDIF server's releases before a remote run: the attention call's label by nnsight and
transformers release, checked against nnsight's own labels here, and the adapter against a stand-in server on
localhost that answers ``GET /env`` as ndif does and records every request it gets (one per adapter, before any
work; none sent where the releases do not fit). The real server: tests/ndif/test_ndif_server.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

nnsight = pytest.importorskip("nnsight")

from equivariance_probe import (  # noqa: E402
    EquivarianceProbe,
    RemoteExecutionError,
    RemoteVersionError,
    ServerUnreachableError,
)
from equivariance_probe.adapters.nnsight import NNsightAdapter  # noqa: E402
from equivariance_probe.adapters.nnsight_remote import ATTENTION_CALL  # noqa: E402
from equivariance_probe.adapters.plan import Read  # noqa: E402
from equivariance_probe.adapters.server_versions import attention_call_label, release  # noqa: E402
from equivariance_probe.errors import InputError  # noqa: E402

from synthetic import tiny_llama  # noqa: E402
from test_nnsight_adapter import eager, token_windows, transformers_model  # noqa: E402

HERE = {name: importlib.metadata.version(name) for name in ("nnsight", "transformers")}


def test_the_attention_call_label_by_release():
    assert attention_call_label("0.7.0", "5.15.0") == "attention_interface_0"  # calls only
    assert attention_call_label("0.5.15", "4.57.6") == "attention_interface_0"
    assert attention_call_label("0.8.1", "5.15.0") == "attention_interface_1"  # one binding, then the call
    assert attention_call_label("0.8.0", "5.1.0") == "attention_interface_1"
    assert attention_call_label("0.8.1", "5.0.0") == "attention_interface_2"  # two bindings, then the call
    assert attention_call_label("0.8.1", "4.57.6") == "attention_interface_2"
    assert attention_call_label("0.8.1", "4.47.1") is None  # no attention interface yet
    assert attention_call_label(None, "5.15.0") is None and attention_call_label("0.8.1", "unknown") is None
    assert release("5.1.0rc1") == (5, 1, 0) and release("0.8.1.dev3") == (0, 8, 1) and release("") is None


def test_the_label_is_the_one_nnsight_gives_the_attention_call_here():
    """nnsight's own operation labels of a Llama attention forward, under the nnsight and transformers installed
    here: the call is the last operation named attention_interface, and the rule names it."""
    model = transformers_model(eager(tiny_llama))
    names = [name for name in model.model.layers[0].self_attn.source.names if name.startswith("attention_interface_")]
    assert names[-1] == attention_call_label(HERE["nnsight"], HERE["transformers"]) == ATTENTION_CALL


class StandIn:
    """A server on localhost that answers ``GET /env`` with ``report`` (404 where it is ``None``) and 404 to
    anything else, recording ``"METHOD path"`` of every request."""

    def __init__(self, report: dict | None):
        self.report, self.requests = report, []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self):
                stand_in.requests.append(f"{self.command} {self.path}")
                if self.path == "/env" and stand_in.report is not None:
                    body = json.dumps(stand_in.report).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                else:
                    body = b'{"detail": "Not Found"}'
                    self.send_response(404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def env_report(nnsight_version: str, transformers_version: str) -> dict:
    return {"python_version": "3.11.9 (main)", "packages": {"nnsight": nnsight_version,
                                                           "transformers": transformers_version, "torch": "2.9.0"}}


@pytest.fixture
def remote_adapter(monkeypatch):
    """An adapter whose traces go to a host (set ``adapter.remote``), with a key and a model key that need no
    network (built as the simulation, then pointed at the host)."""
    import nnsight.modeling.huggingface as hf_wrapper

    monkeypatch.setenv("NDIF_API_KEY", "test-key")
    monkeypatch.setattr(nnsight.CONFIG.APP, "REMOTE_LOGGING", False)

    def build(**options):
        model = transformers_model(eager(tiny_llama))
        monkeypatch.setitem(hf_wrapper._ID_CACHE, model.repo_id, "tiny/llama")
        return NNsightAdapter(model, remote="local", **options)

    return build


@pytest.mark.parametrize("server", [("0.7.0", HERE["transformers"]), (HERE["nnsight"], "5.0.0"),
                                    (HERE["nnsight"], "4.47.1")])
def test_a_server_whose_releases_name_the_call_otherwise_is_refused_before_any_work(remote_adapter, server):
    nnsight_version, transformers_version = server
    with StandIn(env_report(nnsight_version, transformers_version)) as stand_in:
        adapter = remote_adapter()
        adapter.remote = stand_in.url
        probe = EquivarianceProbe(adapter)
        words = f"runs nnsight {nnsight_version} and transformers {transformers_version}.*nnsight {HERE['nnsight']}"
        with pytest.raises(RemoteVersionError, match=words + ".*Nothing was sent.*remote=False") as caught:
            probe.run(token_windows(2, 12), context_length=12, batch_size=2, progress=False)
        assert isinstance(caught.value, RemoteExecutionError)
        with pytest.raises(RemoteVersionError, match=ATTENTION_CALL):  # the shift test's grid sums: the same
            probe.shift([list(range(3, 9))], [list(range(10, 18)), list(range(20, 28))], offsets=[0, 4],
                        segment_length=6, batch_size=2, progress=False)
        read = []  # a plan's reads (the positional analyses'), and the shift test's check of its recomputation
        with pytest.raises(RemoteVersionError):
            adapter.run_plan(token_windows(1, 12), adapter.plan([("resid.0", Read(read.append))]))
        with pytest.raises(RemoteVersionError):
            adapter.check_segment_recompute(token_windows(1, 12), 6)
    assert stand_in.requests == ["GET /env"] * 4 and read == []  # asked, refused, asked again: no work sent
    assert probe.last_result is None


def test_a_fitting_server_is_asked_once_and_recorded(remote_adapter):
    with StandIn(env_report(HERE["nnsight"], HERE["transformers"])) as stand_in:
        adapter = remote_adapter()
        adapter.remote = stand_in.url
        first = adapter.check_server()
        assert adapter.check_server() is first and adapter._trace_options()["remote"] == stand_in.url
        assert adapter.info().extra["server"] == {"host": stand_in.url, "nnsight": HERE["nnsight"],
                                                   "transformers": HERE["transformers"], "torch": "2.9.0",
                                                   "python": "3.11.9", "source": "reported"}
        # The run's work goes out after the check passed: nnsight opens its result channel (/subscribe), which
        # the stand-in lacks (a remote failure).
        with pytest.raises(RemoteExecutionError) as caught:
            EquivarianceProbe(adapter).run(token_windows(2, 12), context_length=12, batch_size=2, progress=False)
        assert not isinstance(caught.value, RemoteVersionError), caught.value
    assert stand_in.requests[0] == "GET /env" and stand_in.requests.count("GET /env") == 1
    assert "GET /subscribe" in stand_in.requests[1:]


def test_a_server_that_does_not_report_is_refused_unless_its_versions_are_stated(remote_adapter):
    with StandIn(None) as stand_in:
        adapter = remote_adapter()
        adapter.remote = stand_in.url
        with pytest.raises(RemoteVersionError, match="does not report.*server_versions=.*remote=False"):
            adapter.check_server()
        stated = remote_adapter(server_versions={"nnsight": HERE["nnsight"], "transformers": HERE["transformers"]})
        stated.remote = stand_in.url
        assert stated.check_server().source == "stated"
        older = remote_adapter(server_versions={"nnsight": "0.7.0", "transformers": HERE["transformers"]})
        older.remote = stand_in.url
        with pytest.raises(RemoteVersionError, match="names it 'attention_interface_0'"):
            older.check_server()
    assert stand_in.requests == ["GET /env"]  # stated versions are not asked for
    with pytest.raises(InputError, match="server_versions must name"):
        remote_adapter(server_versions={"nnsight": "0.8.1"})


def test_local_and_simulated_runs_ask_no_server(remote_adapter):
    adapter = remote_adapter()  # remote="local": nnsight's simulation runs here
    assert "server" not in adapter.info().extra and adapter.server is None
    result = EquivarianceProbe(adapter).run(token_windows(2, 12), context_length=12, batch_size=1, progress=False)
    assert adapter.server is None and "server" not in result.metadata["model"]
    assert result.statistics.n_windows == 2


def test_a_server_not_reached_before_the_run_is_met_by_its_first_request(remote_adapter):
    """The run's metadata is taken before its first request; a server that cannot be reached then is named by that
    request, where the run keeps what it finished (here nothing)."""
    with socket.socket() as probe_socket:  # a port nothing listens on once it is closed
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    adapter = remote_adapter()
    adapter.remote = f"http://127.0.0.1:{port}"
    probe = EquivarianceProbe(adapter)
    with pytest.raises(ServerUnreachableError, match="cannot be reached") as caught:
        probe.run(token_windows(2, 12), context_length=12, batch_size=2, progress=False)
    assert caught.value.partial_result.statistics.n_windows == 0 and adapter.server is None
