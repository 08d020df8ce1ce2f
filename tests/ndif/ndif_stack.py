"""An NDIF server on localhost: Redis, a Ray head with ndif's controller, the API, one deployed model.

The processes are the ones ``ndif start redis ray api`` launches (``redis-server``,
``ray start --head`` + ``python -m ndif.services.ray.deployments.controller.controller``,
gunicorn serving ``ndif.services.api.app``), started here with ports and a home of their own,
each in its own session, and stopped by process id. Two settings differ from ``ndif start``
because this machine has no GPU: the Ray node declares one GPU and its memory
(``--num-gpus 1``, ``cuda_memory_bytes``; ndif's controller places models on GPU nodes only),
and models deploy with :class:`cpu_actor.CPUSandboxModelActor` (ndif's sandboxed actor, loading on
the CPU). No object store runs (RustFS is not installed): results travel inline over Redis
pub/sub, up to the cap ndif derives from Redis's ``client-output-buffer-limit pubsub``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ACTOR_CLASS = "cpu_actor.CPUSandboxModelActor"
API_KEY = "00000000-0000-4000-8000-000000000000"  # ndif checks the UUID form; no database, no check


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports. Every probe socket stays bound until all are, so the kernel cannot hand the
    same port out twice (Ray refuses to start when two of its components are given one port)."""
    with contextlib.ExitStack() as held:
        probes = [held.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def wait_for(check, what: str, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.3)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise TimeoutError(f"{what} did not come up in {timeout:.0f} s\n{tail}")


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def missing_components() -> str | None:
    """Why the stack cannot run here, or ``None``."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    for module in ("ray", "ndif", "gunicorn", "nnsight"):
        try:
            __import__(module)
        except ImportError as error:
            return f"{module} cannot be imported ({error}); run scripts/setup_ndif_env.sh"
    return None


@dataclass
class NDIFStack:
    """A running stack; :meth:`stop` ends every process it started."""

    home: Path
    ports: dict[str, int]
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    pubsub_limit: str = "0 8mb 60"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['api']}"

    # -- processes -----------------------------------------------------------------
    def spawn(self, name: str, command: list[str], **env: str) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        try:
            process = subprocess.Popen(command, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.home)
        finally:
            log.close()
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> None:
        self.start_redis()
        self.start_ray()
        self.start_api()

    def start_redis(self) -> None:
        port = self.ports["redis"]
        self.spawn("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(self.home),
                             "--client-output-buffer-limit", f"pubsub {self.pubsub_limit}"])
        wait_for(lambda: port_open(port), "redis-server", 20, self.home / "redis.log")

    def start_ray(self) -> None:
        ports = self.ports
        # Ray's session folder holds Unix sockets, whose paths are limited to 107 bytes.
        resources = {"head": 10, "cuda_memory_bytes": 8 << 30, "cpu_memory_bytes": 8 << 30}
        self.spawn("ray", [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            f"--port={ports['gcs']}", f"--ray-client-server-port={ports['ray_client']}",
            f"--dashboard-port={ports['dashboard']}", f"--dashboard-agent-grpc-port={ports['dashboard_agent']}",
            f"--dashboard-agent-listen-port={ports['dashboard_listen']}", f"--metrics-export-port={ports['metrics']}",
            f"--node-manager-port={ports['node_manager']}", f"--object-manager-port={ports['object_manager']}",
            f"--runtime-env-agent-port={ports['runtime_env']}",
            f"--min-worker-port={ports['workers']}", f"--max-worker-port={ports['workers'] + 40}",
            "--node-ip-address=127.0.0.1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            "--num-cpus=4", "--num-gpus=1", f"--resources={json.dumps(resources)}",
            f"--temp-dir={self.home / 'ray'}", "--disable-usage-stats",
        ])
        wait_for(lambda: port_open(ports["ray_client"]) and port_open(ports["dashboard"]), "the Ray head", 120,
                 self.home / "ray.log")
        controller = self.spawn("controller", [sys.executable, "-m", "ndif.services.ray.deployments.controller.controller"],
                                RAY_ADDRESS=f"127.0.0.1:{ports['gcs']}")
        if controller.wait(timeout=120) != 0:
            raise RuntimeError("ndif's controller did not launch:\n" + self.log("controller")[-3000:])

    def start_api(self) -> None:
        # The dispatcher keeps Redis's ``ray:connected`` flag, and an API that was stopped leaves it set: a new API
        # would then answer /status before its own dispatcher reached Ray, and 503 ("compute backend is
        # reconnecting") while it connects. Clearing the flag first makes the wait below wait for the new one.
        import redis

        redis.Redis(host="127.0.0.1", port=self.ports["redis"]).delete("ray:connected")
        self.spawn("api", [str(Path(sys.executable).parent / "gunicorn"), "--config",
                           "python:ndif.services.api.gunicorn_conf", "ndif.services.api.app:app"])
        # /status answers once the API's dispatcher reached Ray (503 before).
        wait_for(lambda: urllib.request.urlopen(self.url + "/status", timeout=5).status == 200, "the API", 120,
                 self.home / "api.log")

    def stop_api(self) -> None:
        self._stop("api")

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            self._stop(name)
        shutil.rmtree(self.home, ignore_errors=True)

    def _stop(self, name: str) -> None:
        """End the process ``name`` and everything in its session (Ray's daemons, gunicorn's workers,
        model actors and sandbox runners), by process id: SIGTERM, then SIGKILL after 5 s."""
        process = self.processes.pop(name, None)
        if process is None:
            return
        members = session_members(process.pid)
        for pid in members:
            with _ignore_gone():
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in members):
            with _ignore_gone():
                process.wait(timeout=0.2)
        for pid in session_members(process.pid) + members:
            with _ignore_gone():
                os.kill(pid, signal.SIGKILL)
        with _ignore_gone():
            process.wait(timeout=5)

    # -- models --------------------------------------------------------------------
    def deploy(self, model_key: str, checkpoint: str, *, timeout_seconds: float | None = None) -> None:
        """Deploy ``model_key`` (as the client spells it) through ndif's deploy command."""
        spec = {"models": [{"checkpoint": checkpoint, "model_key": model_key, "actor_class": ACTOR_CLASS,
                            "dtype": "float32", "size_bytes": 1 << 20, "padding_bias": 0, "max_tp": 0,
                            "execution_timeout_seconds": timeout_seconds}]}
        spec_file = self.home / f"deploy-{len(list(self.home.glob('deploy-*')))}.json"
        spec_file.write_text(json.dumps(spec))
        ndif = str(Path(sys.executable).parent / "ndif")
        done = subprocess.run([ndif, "deploy", "-f", str(spec_file)], env=self.env, capture_output=True,
                              text=True, timeout=180, cwd=self.home)
        # `ndif deploy` waits for the replica and prints "ready" once the actor has loaded the model.
        if done.returncode != 0 or ": ready" not in done.stdout:
            raise RuntimeError(f"ndif deploy failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def session_members(session: int) -> list[int]:
    """Process ids whose session id is ``session`` (the Popen'd leader started a new session)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == session:
                members.append(int(entry))
        except (ProcessLookupError, PermissionError):
            continue
    return members


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _ignore_gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, (ProcessLookupError, subprocess.TimeoutExpired, ChildProcessError))


def new_stack(pubsub_limit: str = "0 8mb 60", **extra_env: str) -> NDIFStack:
    home = Path(tempfile.mkdtemp(prefix="ndif", dir="/tmp"))
    names = ["redis", "gcs", "ray_client", "dashboard", "dashboard_agent", "dashboard_listen", "metrics",
             "node_manager", "object_manager", "runtime_env", "api"]
    ports = dict(zip(names, free_ports(len(names))))
    ports["workers"] = 21000 + (os.getpid() % 200) * 50
    python_path = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("NDIF_", "RAY_"))},
        "NDIF_HOME": str(home),
        "NDIF_REDIS_URL": f"redis://127.0.0.1:{ports['redis']}",
        "NDIF_RAY_ADDRESS": f"ray://127.0.0.1:{ports['ray_client']}",
        "NDIF_API_PORT": str(ports["api"]),
        "NDIF_API_URL": f"http://127.0.0.1:{ports['api']}",
        # Nothing listens here: results travel inline, or fail naming the object store.
        "NDIF_OBJECT_STORE_URL": f"http://127.0.0.1:{free_port()}",
        "NDIF_DEFAULT_MODEL_ACTOR_CLASS": ACTOR_CLASS,
        "NDIF_SANDBOX_POOL_SIZE": "1",
        "NDIF_CONTROLLER_SYNC_INTERVAL_S": "2",
        "NDIF_MINIMUM_DEPLOYMENT_TIME_SECONDS": "0",
        "GRPC_ENABLE_FORK_SUPPORT": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": python_path,
        **extra_env,
    }
    return NDIFStack(home=home, ports=ports, env=env, pubsub_limit=pubsub_limit)
