"""How much one remote (NDIF) request may carry: a pure planner from the first request's measured time.

Place in the seams: *adapters*, beside :mod:`~equivariance_probe.adapters.nnsight_remote`; it knows no
framework and does arithmetic only, so that the nnsight adapter (which sends the requests) and the runs
(which checkpoint them) read one rule.

Two limits end a request. NDIF's server stops a job at its *execution timeout*: ndif's model actor races
the job against ``execution_timeout_seconds`` (per model, else the controller's
``NDIF_DEFAULT_EXECUTION_TIMEOUT_SECONDS``; ndif 0.1.2 sets none by default, NDIF's public service
3,600 s) and answers "Your job exceeded the execution timeout". nnsight's client (0.8) gives every HTTP
read, the result's download included, a read timeout of 600 s (``RemoteBackend._READ_TIMEOUT``). A reply
larger than the server's inline cap (``min(soft, hard/2)`` of Redis's ``client-output-buffer-limit
pubsub``: 8 MiB under stock Redis) goes through the server's object store, or fails where it has none.

The rule (:func:`plan_requests`): with ``t₁`` the wall time of the first request and ``d₁`` its documents
(windows), a document is predicted to cost ``t₁/d₁`` seconds, all of the first request's fixed costs
(queue, network, the model's load) counted as if they grew with each document, which over-predicts and so
errs on the safe side. A request may take ``target = fraction · min(execution timeout, read timeout)``
(``fraction = 1/4`` by default: 150 s against nnsight's 600 s), or ``request_seconds`` where that is given,
so it carries ``n = ⌊target · d₁ / t₁⌋`` documents, at least 1 and at most the batch size asked for (the
most the server's memory was asked to hold). Where even one document is predicted over the target the next
request is refused by name before it is sent, the finished ones kept. A reply that grows with the
documents is held to ``fraction · reply limit`` the same way; the probe's and the shift test's replies do
not grow (their sums have fixed shapes), so for them the first reply's size is recorded, not planned.
``documents_per_request`` overrides the rule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InputError

__all__ = [
    "RequestLimits",
    "RequestPlan",
    "plan_requests",
    "Requests",
    "windows_per_pass",
    "NDIF_EXECUTION_TIMEOUT_SECONDS",
    "NNSIGHT_READ_TIMEOUT_SECONDS",
    "INLINE_REPLY_BYTES",
    "DEFAULT_FRACTION",
]

#: NDIF's public service's execution timeout (ndif's own server sets none unless configured).
NDIF_EXECUTION_TIMEOUT_SECONDS = 3600.0
#: nnsight's client read timeout (``nnsight.intervention.backends.remote._READ_TIMEOUT``, nnsight 0.8).
NNSIGHT_READ_TIMEOUT_SECONDS = 600.0
#: ndif's inline reply cap under stock Redis (pub/sub soft limit 8 MiB); larger replies need an object store.
INLINE_REPLY_BYTES = 8 << 20
#: The share of the smaller limit a request is planned to take.
DEFAULT_FRACTION = 0.25


def _positive(name: str, value: Any, *, integer: bool = False, at_most_one: bool = False) -> None:
    if value is None:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value <= 0 \
            or (at_most_one and value > 1):
        allowed = "a positive integer" if integer else "a number in (0, 1]" if at_most_one else "a positive number"
        raise InputError(f"{name} must be {allowed} or None, not {value!r}")


@dataclass(frozen=True)
class RequestLimits:
    """The limits a remote request is sized against, and the overrides.

    Attributes:
        execution_timeout: seconds after which the server stops a job (``None``: no limit; NDIF's public
            service: 3,600 s; a self-hosted ndif: its ``execution_timeout_seconds`` or
            ``NDIF_DEFAULT_EXECUTION_TIMEOUT_SECONDS``).
        read_timeout: nnsight's client read timeout in seconds (600 s in nnsight 0.8; ``None``: no limit).
        reply_limit: bytes a reply may have (``None``: no limit); ndif returns up to 8 MiB inline under
            stock Redis.
        fraction: the share of the smaller timeout (and of ``reply_limit``) a request is planned to use.
        request_seconds: seconds a request is planned to take, instead of ``fraction`` of the timeouts.
        documents_per_request: documents (windows) every request carries, instead of planning.

    Example:
        >>> RequestLimits().target_seconds
        150.0
        >>> RequestLimits(execution_timeout=8.0, fraction=0.5).target_seconds
        4.0
    """

    execution_timeout: float | None = NDIF_EXECUTION_TIMEOUT_SECONDS
    read_timeout: float | None = NNSIGHT_READ_TIMEOUT_SECONDS
    reply_limit: int | None = INLINE_REPLY_BYTES
    fraction: float = DEFAULT_FRACTION
    request_seconds: float | None = None
    documents_per_request: int | None = None

    def __post_init__(self) -> None:
        _positive("execution_timeout", self.execution_timeout)
        _positive("read_timeout", self.read_timeout)
        _positive("reply_limit", self.reply_limit, integer=True)
        _positive("fraction", self.fraction, at_most_one=True)
        _positive("request_seconds", self.request_seconds)
        _positive("documents_per_request", self.documents_per_request, integer=True)

    @property
    def limit_seconds(self) -> float | None:
        """The smaller of the two timeouts (``None`` when neither is set)."""
        limits = [t for t in (self.execution_timeout, self.read_timeout) if t is not None]
        return float(min(limits)) if limits else None

    @property
    def target_seconds(self) -> float:
        """Seconds a request is planned to take: ``request_seconds``, else ``fraction · limit_seconds``
        (infinite when no limit is set)."""
        if self.request_seconds is not None:
            return float(self.request_seconds)
        limit = self.limit_seconds
        return math.inf if limit is None else self.fraction * limit


@dataclass(frozen=True)
class RequestPlan:
    """What :func:`plan_requests` decided from one measured request.

    Attributes:
        documents: documents each later request carries (0 when refused).
        predicted_seconds: the predicted time of such a request, ``documents · t₁/d₁``.
        target_seconds: the time a request was allowed (:attr:`RequestLimits.target_seconds`).
        measured_seconds, measured_documents, reply_bytes: the first request's wall time, documents and
            reply size.
        refused: why no further request may be sent (``None``: they may).
        context_length: the window length the measurement holds for (a request's time grows with it), where
            the caller records one.
    """

    documents: int
    predicted_seconds: float
    target_seconds: float
    measured_seconds: float
    measured_documents: int
    reply_bytes: int
    refused: str | None = None
    context_length: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for a result's metadata and a checkpoint's state); :meth:`from_dict` reads them back."""
        values = asdict(self)
        values["target_seconds"] = None if math.isinf(self.target_seconds) else self.target_seconds
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RequestPlan:
        values = dict(values)
        if values.get("target_seconds") is None:
            values["target_seconds"] = math.inf
        return cls(**values)


def plan_requests(seconds: float, documents: int, reply_bytes: int, limits: RequestLimits, *,
                  upper: int | None = None, reply_grows: bool = False, unit: str = "window",
                  fix: str = "fewer tokens per window (a shorter context_length)",
                  context_length: int | None = None) -> RequestPlan:
    """Documents per request after a first request of ``documents`` that took ``seconds`` and replied
    ``reply_bytes``: ``n = ⌊target · d₁ / t₁⌋``, clamped to ``[1, upper]`` (see the module docstring).

    Args:
        seconds: the first request's wall time ``t₁`` (send to reply).
        documents: its documents ``d₁`` (windows; for the shift test one segment's grid).
        reply_bytes: its reply's size.
        limits: the limits and overrides.
        upper: the most documents a request may carry (the batch size asked for); ``None``: no bound.
        reply_grows: whether the reply grows with the documents (then ``n ≤ fraction · reply_limit · d₁ /
            reply_bytes`` too); a fixed reply is only recorded.
        unit: what one document is, for the refusal's message.
        fix: what makes one ``unit`` cheaper, for the refusal's message.
        context_length: recorded in the plan (the window length it holds for).

    Example:
        >>> limits = RequestLimits(execution_timeout=40.0, read_timeout=None)   # target 10 s
        >>> plan_requests(4.0, 8, 1000, limits, upper=64).documents            # 0.5 s a window
        20
        >>> plan_requests(4.0, 8, 1000, limits, upper=16).documents
        16
    """
    if documents < 1:
        raise InputError(f"a measured request carries at least one document, not {documents!r}")
    target = limits.target_seconds
    per_document = max(float(seconds), 0.0) / documents
    plan = dict(target_seconds=target, measured_seconds=float(seconds), measured_documents=int(documents),
                reply_bytes=int(reply_bytes), context_length=context_length)
    if limits.documents_per_request is not None:
        n = limits.documents_per_request
        return RequestPlan(documents=n, predicted_seconds=n * per_document, **plan)
    if per_document > target:
        reason = (f"one {unit} is predicted to take {per_document:.3g} s (the first request: {seconds:.3g} s for "
                  f"{documents}), over the {target:.3g} s a request may take ({_target_words(limits)}); a slower "
                  f"moment on the server would reach its timeout. Send less per request: {fix}; or, on a server "
                  "with a longer timeout, say so (request_limits=RequestLimits(execution_timeout=..., "
                  "read_timeout=...), or request_seconds=...)")
        return RequestPlan(documents=0, predicted_seconds=per_document, refused=reason, **plan)
    n = math.inf if per_document == 0 or math.isinf(target) else math.floor(target / per_document)
    if reply_grows and limits.reply_limit is not None and reply_bytes > 0:
        n = min(n, math.floor(limits.fraction * limits.reply_limit * documents / reply_bytes))
    if upper is not None:
        n = min(n, upper)
    n = int(max(1, n if math.isfinite(n) else (upper or documents)))
    return RequestPlan(documents=n, predicted_seconds=n * per_document, **plan)


def _target_words(limits: RequestLimits) -> str:
    if limits.request_seconds is not None:
        return "request_seconds"
    parts = []
    if limits.execution_timeout is not None:
        parts.append(f"the server's execution timeout {limits.execution_timeout:g} s")
    if limits.read_timeout is not None:
        parts.append(f"nnsight's read timeout {limits.read_timeout:g} s")
    return f"{limits.fraction:g} of the smaller of {' and '.join(parts)}"


class Requests:
    """How a remote adapter sizes the requests of a run: its limits, and what it planned from the first request of a
    window length (:func:`plan_requests`). An adapter whose batches are requests to a server carries one
    (:attr:`~equivariance_probe.adapters.base.Adapter.requests`); a local adapter carries none.

    Attributes:
        limits: what a request is sized against.
        plan: what was planned from the first request's measured time (``None``: nothing sent yet). Settable, so
            that a resumed run sends the requests the interrupted one planned (:meth:`restore`).
    """

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self.plan: RequestPlan | None = None

    def planned(self, seconds: float, windows: int, reply_bytes: int, context_length: int | None) -> RequestPlan:
        """The main run's plan after a first request of ``windows`` windows of ``context_length`` tokens (the batch
        size asked for bounds it in :meth:`windows`). Its reply's sums have fixed shapes, so the reply is recorded,
        not planned."""
        return plan_requests(seconds, windows, reply_bytes, self.limits, unit="window", fix="a shorter context_length",
                             context_length=context_length)

    def restore(self, values: dict[str, Any]) -> None:
        """Take up the plan an interrupted run recorded (:meth:`RequestPlan.to_dict`), planned again under these
        limits (the same plan where the limits are the same, so the resumed run sends the same requests; a plan that
        was refused is lifted by larger limits)."""
        measured = RequestPlan.from_dict(values)
        self.plan = self.planned(measured.measured_seconds, measured.measured_documents, measured.reply_bytes,
                                 measured.context_length)

    def windows(self, batch_size: int, context_length: int | None = None) -> int:
        """Windows the next request carries when ``batch_size`` was asked for, for windows of ``context_length``
        tokens: after the first request of that length, what :func:`plan_requests` planned from its wall time (never
        more than ``batch_size``, unless ``documents_per_request`` says so). Another window length is measured
        again."""
        plan, explicit = self.plan, self.limits.documents_per_request
        if plan is None or plan.refused is not None or plan.context_length != context_length:
            return explicit or batch_size  # a refused plan stops the next request when it is sent
        return plan.documents if explicit else min(batch_size, plan.documents)


def windows_per_pass(adapter: Any, batch_size: int, context_length: int | None = None) -> int:
    """Windows the next forward pass carries: ``batch_size`` for a local model, what a remote adapter's
    :class:`Requests` planned for one whose passes are requests."""
    requests = getattr(adapter, "requests", None)
    return batch_size if requests is None else requests.windows(batch_size, context_length)
