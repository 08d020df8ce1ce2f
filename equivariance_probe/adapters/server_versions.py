"""What an NDIF server runs, and whether its releases give the sites the nnsight adapter binds.

Place in the seams: *adapters*, beside :mod:`~equivariance_probe.adapters.nnsight_remote`. A remote trace's code
runs in the server's nnsight on the server's transformers, and the adapter reads each attention module's queries
and keys at the operation :data:`~equivariance_probe.adapters.nnsight_remote.ATTENTION_CALL` of its forward. That
label is the server's, not the client's: nnsight names an operation ``{name}_{n}``, ``n`` counting the earlier
operations of that name in the forward's source, so the label of the ``attention_interface(...)`` call depends on

- nnsight's release: up to 0.7 only calls are operations, and the call is ``attention_interface_0``; from 0.8 an
  assignment to a name is an operation too (its binding), so the call comes after the bindings of
  ``attention_interface``;
- transformers' release: up to 5.0 the attention forwards bind ``attention_interface`` twice (the eager default,
  then ``ALL_ATTENTION_FUNCTIONS[...]`` under an ``if``), from 5.1 once (``ALL_ATTENTION_FUNCTIONS.get_interface``).
  Attention interfaces first appear in 4.48.

So the call is ``attention_interface_0`` under nnsight 0.7 or earlier, ``attention_interface_2`` under nnsight 0.8
with transformers 4.48 to 5.0, and ``attention_interface_1`` under nnsight 0.8 with transformers 5.1 or later
(measured with nnsight 0.8.1's instrumentation on the Llama, Gemma 3, GPT-2 and Qwen2 attention forwards of
transformers 4.57.6, 5.0.0, 5.1.0 and 5.15.0, and read in nnsight 0.7.0's). A later nnsight release is taken to
keep 0.8's labels.

The server says what it runs: ndif's API answers ``GET /env`` with its controller's Python version and installed
packages (``{"python_version": ..., "packages": {"nnsight": ..., "transformers": ...}}``, what
``nnsight.compare()`` reads). :func:`checked_server` asks once per adapter and host, before the first request,
and refuses by name (:class:`~equivariance_probe.errors.RemoteVersionError`) where the server's releases give
another label, or where the server does not report them and the caller did not state them
(``server_versions={"nnsight": ..., "transformers": ...}``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InputError, RemoteVersionError

__all__ = ["ServerVersions", "attention_call_label", "release", "stated_versions", "check_server_versions",
           "server_report", "checked_server", "CLIENT_PACKAGES"]

#: The packages whose releases decide the sites a remote trace binds.
CLIENT_PACKAGES = ("nnsight", "transformers")


def release(version: str | None) -> tuple[int, ...] | None:
    """The leading numbers of a version (``"0.8.1"`` → ``(0, 8, 1)``, ``"5.1.0rc1"`` → ``(5, 1, 0)``), or
    ``None`` for none or one that does not start with a number."""
    if not isinstance(version, str):
        return None
    numbers = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in numbers.group(1).split(".")) if numbers else None


def attention_call_label(nnsight_version: str | None, transformers_version: str | None) -> str | None:
    """The operation label nnsight gives the ``attention_interface(...)`` call of a transformers attention forward
    (see the module docstring), or ``None`` where transformers has no attention interface (before 4.48) or a
    version is not known."""
    nnsight, transformers = release(nnsight_version), release(transformers_version)
    if nnsight is None or transformers is None or transformers < (4, 48):
        return None
    if nnsight < (0, 8):
        return "attention_interface_0"
    return "attention_interface_1" if transformers >= (5, 1) else "attention_interface_2"


@dataclass(frozen=True)
class ServerVersions:
    """The releases a server runs, as it reported them (``reported``) or as the caller stated them (``stated``).

    Attributes:
        host: the server asked.
        nnsight, transformers, torch, python: their versions there (``None``: not reported).
        source: ``"reported"`` (the server's ``/env``) or ``"stated"`` (``server_versions=``).
    """

    host: str
    nnsight: str | None
    transformers: str | None
    torch: str | None = None
    python: str | None = None
    source: str = "reported"

    @classmethod
    def from_report(cls, host: str, report: dict[str, Any]) -> ServerVersions:
        """From ndif's ``/env`` answer (``packages`` by import name, ``python_version`` as ``sys.version``)."""
        packages = report.get("packages") if isinstance(report.get("packages"), dict) else {}
        python = report.get("python_version")
        return cls(host=host, nnsight=packages.get("nnsight"), transformers=packages.get("transformers"),
                   torch=packages.get("torch"), python=python.split()[0] if isinstance(python, str) else None)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for a result's metadata."""
        return asdict(self)


def stated_versions(value: Any) -> dict[str, str] | None:
    """``server_versions=`` as given, checked: ``None``, or the server's ``nnsight`` and ``transformers`` versions."""
    if value is None:
        return None
    if not isinstance(value, dict) or any(release(value.get(name)) is None for name in CLIENT_PACKAGES):
        raise InputError(f"server_versions must name the server's nnsight and transformers versions, e.g. "
                         f"server_versions={{'nnsight': '0.8.1', 'transformers': '5.15.0'}}, not {value!r}")
    return {name: str(value[name]) for name in CLIENT_PACKAGES}


def _client_versions() -> dict[str, str | None]:
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for name in CLIENT_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def check_server_versions(server: ServerVersions, bound: str, client: dict[str, str | None]) -> None:
    """Raise :class:`RemoteVersionError` unless the server's releases label the attention call ``bound``.

    Args:
        server: what the server runs.
        bound: the label the adapter reads (:data:`~equivariance_probe.adapters.nnsight_remote.ATTENTION_CALL`).
        client: this machine's ``nnsight`` and ``transformers`` versions, named beside the server's.
    """
    here = f"nnsight {client.get('nnsight') or '?'} and transformers {client.get('transformers') or '?'} here"
    if release(server.nnsight) is None or release(server.transformers) is None:
        raise RemoteVersionError(
            f"the server {server.host} does not report which nnsight and transformers it runs (nnsight "
            f"{server.nnsight!r}, transformers {server.transformers!r}; {here}), so whether it names the attention "
            f"call {bound!r} that the remote trace reads is unknown. Nothing was sent. Ask its operator (or run "
            "nnsight.compare() against it) and state them: EquivarianceProbe(model, remote=..., server_versions="
            "{'nnsight': '0.8.1', 'transformers': '5.15.0'}); or pass remote=False to run the model here")
    label = attention_call_label(server.nnsight, server.transformers)
    if label == bound:
        return
    gives = (f"names it {label!r}" if label is not None else
             "has no attention interface to read the queries and keys at (transformers before 4.48)")
    raise RemoteVersionError(
        f"the server {server.host} runs nnsight {server.nnsight} and transformers {server.transformers} ({here}); "
        f"the remote trace reads each attention module's queries and keys at the operation {bound!r}, which needs "
        f"nnsight 0.8 or later and transformers 5.1 or later, and the server's releases {gives} (nnsight 0.8 "
        "labels assignments too, and transformers 5.1 binds attention_interface once). Nothing was sent. Use a "
        "server that runs nnsight >= 0.8 and transformers >= 5.1 (nnsight.status() lists NDIF's; a self-hosted "
        "ndif: pip install -U nnsight transformers there), or pass remote=False to run the model here")


def server_report(host: str, key: str | None, timeout: float = 30.0) -> dict[str, Any] | None:
    """ndif's ``GET {host}/env`` (one request), or ``None`` where the server has no such endpoint (404/405) or
    answers something else than a JSON object. Network failures are raised as httpx raises them."""
    import httpx  # nnsight's own HTTP client

    headers = {"ndif-api-key": key} if key else {}
    response = httpx.get(f"{host.rstrip('/')}/env", headers=headers, timeout=httpx.Timeout(10.0, read=timeout))
    if response.status_code in (404, 405):
        return None
    response.raise_for_status()
    try:
        report = response.json()
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def checked_server(host: str, key: str | None, stated: dict[str, str] | None, bound: str) -> ServerVersions:
    """What the server at ``host`` runs, checked against the label the adapter binds (:func:`check_server_versions`):
    ``stated`` versions where the caller gave them, else one ``/env`` request; raises before any work is sent."""
    if stated is not None:
        server = ServerVersions(host=host, nnsight=stated["nnsight"], transformers=stated["transformers"],
                                source="stated")
    else:
        report = server_report(host, key)
        server = ServerVersions.from_report(host, report or {})
    check_server_versions(server, bound, _client_versions())
    return server
