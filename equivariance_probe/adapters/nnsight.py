"""Adapter for nnsight models, local or remote (NDIF): reduce inside the trace.

Place in the seams: an *adapter* (the only code that knows nnsight). Locally it streams
each layer's pattern to the probe like the Hugging Face adapter. Remotely
(``remote=True``) patterns cannot come home, so :meth:`NNsightAdapter.run_statistics` runs
the statistics' own torch-only reduction *inside* the trace, where the model runs
(:mod:`~equivariance_probe.adapters.nnsight_remote`), and ``.save()``\\ s only float64 sums
of shapes ``[layer, head, T]`` and one ``[T, T]``, which
:meth:`AttentionStatistics.add_batch_sums` merges exactly like local ones.

Where the pattern comes from (``pattern_source``):

- ``"weights"``: the post-softmax weights the attention module returns,
  ``model.model.layers[l].self_attn.output[1]`` (``[batch, head, query, key]``); they
  exist only under eager attention (``None`` under ``sdpa``/flash). Locally the model is
  switched to eager for the run and back afterwards.
- ``"recompute"``: the queries and keys the module hands to its attention function
  (``self_attn.source.attention_interface_1``, after rotary embeddings and q/k norms),
  turned into ``softmax(mask(softcap(q·kᵀ·scaling)))`` with the module's own ``scaling``
  and ``softcap``, grouped-query heads repeated, the causal mask and the layer's sliding
  window, in float32. This works whatever attention kernel the remote side runs; tests
  check it against the eager weights of the same tiny models.
- ``"auto"`` (default): ``"recompute"`` when remote (the server picks its kernel), else
  ``"weights"`` under eager attention and ``"recompute"`` otherwise.

Precision and the log floor: the reduction upcasts the pattern to float32 (float64 if
it is float64) and accumulates float64 sums. The log scale reads ``log max(a, eps)``
with ``eps`` the smallest normal number of the *model's* dtype, so remote runs merge
with local eager runs of the same model. bfloat16 has float32's exponent range, so under
bf16 ``eps = 2^-126 ≈ 1.18e-38`` and the floor is ``log eps ≈ -87.34``: weights below it
(scores more than ~87 nats under the row's maximum) are floored and counted
(``result.floored()``). Under float16 ``eps = 6.1e-5`` (floor ≈ -9.70), which floors
much real attention: run float16 models in bf16 or float32. Eager bf16 weights carry
bf16's 8-bit mantissa (relative error 2^-9); recomputed weights are float32 softmaxes of
scores the server computed in bf16, so the two agree to bf16 rounding of the scores.

The shift test (:meth:`EquivarianceProbe.shift`) runs locally through plans of sites (:meth:`NNsightAdapter.run_plan`),
and remotely through :meth:`NNsightAdapter.segment_grid_sums`: one nnsight session per segment, one trace per
batch of its windows, the segment's running sums kept on the server between the traces and only its float64
sums returned; its check of the recomputation compares attention outputs on the server
(:meth:`NNsightAdapter.check_segment_recompute`).

What travels to NDIF: the trace's code, the variables it reads, and the functions it
calls, which are shipped by value: the in-trace functions of
:mod:`~equivariance_probe.adapters.nnsight_remote`, :mod:`~equivariance_probe.adapters.segments`,
:mod:`~equivariance_probe.statistics.engines.in_trace` and
:mod:`~equivariance_probe.statistics.engines.shift_sums`, which use only ``torch``, ``math`` and builtins
(``tests/test_nnsight_adapter.py`` checks what the payload would import). Fits run locally.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from time import perf_counter
from typing import Any

import torch

from ..errors import (
    AttentionCaptureError,
    EquivarianceProbeError,
    InputError,
    MissingAPIKeyError,
    ModelNotDeployedError,
    RemoteExecutionError,
    RemoteResultTooLargeError,
    RemoteTimeoutError,
    RequestTooLongError,
    ServerUnreachableError,
    UnsupportedModelError,
    check_choice,
    require_extra,
)
from ..statistics.masks import default_log_floor
from .base import LANGUAGE_MODEL_HEAD, RUNS_REMOTELY, Adapter, AttentionLayout, AttentionSource, ModelInfo
from .huggingface import PATTERN_SOURCES, HuggingFaceAdapter
from .modules import inner_module, parent_layer
from .nnsight_binder import check_nnsight_plan, run_nnsight_plan
from .request_sizes import RequestLimits, RequestPlan, Requests
from .server_versions import ServerVersions, checked_server, stated_versions
from .nnsight_segments import NNsightSegments, _nbytes
from .passes import call_pass, pattern_pass
from .nnsight_remote import (
    ATTENTION_CALL,
    NO_WEIGHTS,
    REMOTE_MODULES,
    api_key,
    configured_host,
    is_public_host,
    is_remote_failure,
    is_source_failure,
    remote_failure_kind,
    reduce_batch_in_trace,
)

__all__ = ["NNsightAdapter", "PATTERN_SOURCES"]


class NNsightSource(AttentionSource):
    """Where an nnsight model's attention comes from: ``"auto"`` recomputes remotely, and locally reads the model's
    own weights where it runs eager attention; the first batch checks the engine of a local run that recomputes
    (on the wrapped model), nothing remotely, where the reduction runs on the server, or from captured weights."""

    def __init__(self, asked: str, adapter: Any) -> None:
        super().__init__(asked)
        self._adapter = adapter

    def auto(self) -> str:
        if self._adapter.remote:
            return "recompute"
        return "weights" if self._adapter._hf.attn_implementation() == "eager" else "recompute"

    def checks(self) -> tuple[str, ...]:
        return ("engine",) if not self._adapter.remote and self.resolved() != "weights" else ()


class NNsightAdapter(NNsightSegments, Adapter):
    """Runs the study on an nnsight-wrapped Hugging Face model, locally or on NDIF.

    Args:
        model: an ``nnsight.TransformersModel`` (or its deprecated alias ``LanguageModel``)
            or an ``nnsight.NNsight`` around a ``transformers`` causal LM. For remote runs,
            a ``TransformersModel`` built from a hub id (``TransformersModel(
            "meta-llama/Llama-3.1-70B")``; it loads on the meta device, no weights).
        tokenizer: a tokenizer, if the model carries none.
        remote: ``False`` (run here), ``True`` (run on NDIF, ``CONFIG.API.HOST``), a host
            URL, or ``"local"`` (nnsight's local simulation: serialise the trace as for
            NDIF and run it here).
        pattern_source: ``"weights"``, ``"recompute"`` or ``"auto"`` (see the module
            docstring).
        request_limits: what a remote request is sized against (the server's execution timeout,
            nnsight's read timeout, the reply limit, the share of them a request may take) and the
            overrides (``request_seconds``, ``documents_per_request``); default
            :class:`~equivariance_probe.adapters.request_sizes.RequestLimits` ``()``: a request is planned
            to take at most 150 s, a quarter of nnsight's 600 s read timeout
            (:mod:`~equivariance_probe.adapters.request_sizes` states the rule).
        server_versions: the server's ``{"nnsight": ..., "transformers": ...}``, stated where it does not report
            them; ``None``: asked once before the first request (:mod:`~equivariance_probe.adapters.server_versions`).

    Raises:
        MissingAPIKeyError: ``remote`` is ``True`` or a URL and no NDIF API key is set.
        UnsupportedModelError: the wrapped module is not a ``transformers`` model.
        InputError: an unknown ``pattern_source``.

    Example:
        >>> from nnsight import TransformersModel  # doctest: +SKIP
        >>> model = TransformersModel("meta-llama/Llama-3.1-70B")  # doctest: +SKIP
        >>> probe = EquivarianceProbe(model, remote=True)  # doctest: +SKIP
        >>> result = probe.run(docs, context_length=1024, batch_size=8)  # doctest: +SKIP
    """

    framework = "nnsight"
    model_types = (("nnsight", ("NNsight", "LanguageModel", "TransformersModel", "Envoy")),)
    supported_models = "nnsight.LanguageModel / nnsight.TransformersModel / nnsight.NNsight (local or remote=True)"
    #: nnsight language models end in the unembedding, and run on NDIF with ``remote=True``.
    capabilities = frozenset({LANGUAGE_MODEL_HEAD, RUNS_REMOTELY})
    #: First: an envoy holds a Hugging Face model inside.
    detection_order = 0

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, *, source: str, dtype: torch.dtype, device: str | torch.device) -> Any:
        """An nnsight ``TransformersModel`` around ``model``."""
        require_extra("nnsight", "nnsight", "framework='nnsight'")
        from nnsight.modeling.transformers import TransformersModel

        return TransformersModel(model, task="text-generation", tokenizer=tokenizer)

    @classmethod
    def unwrap(cls, model: Any) -> Any | None:
        """The module the envoy wraps."""
        if type(model).__module__.split(".")[0] != "nnsight":
            return None
        from transformers import PreTrainedModel

        inner = inner_module(model)
        return inner if isinstance(inner, PreTrainedModel) else None

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None = None,
        *,
        remote: bool | str = False,
        pattern_source: str = "auto",
        request_limits: RequestLimits | None = None,
        server_versions: dict[str, str] | None = None,
    ) -> None:
        super().__init__(model, tokenizer)
        check_choice("pattern_source", pattern_source, PATTERN_SOURCES)
        if not isinstance(remote, (bool, str)):
            raise InputError(f"remote must be True, False, 'local' or a host URL, not {remote!r}")
        if request_limits is not None and not isinstance(request_limits, RequestLimits):
            raise InputError(f"request_limits must be a RequestLimits, not {type(request_limits).__name__}; pass "
                             "e.g. request_limits=RequestLimits(execution_timeout=600, request_seconds=60)")
        self.remote = remote
        self.source = NNsightSource(pattern_source, self)
        self.request_limits = request_limits if request_limits is not None else RequestLimits()
        #: Each batch of a remote run is a request (``"local"`` included), sized by what the first one measured.
        self.requests = Requests(self.request_limits) if remote else None
        self.server_versions = stated_versions(server_versions)
        self.server: ServerVersions | None = None
        #: What was planned from the first segment's request of the shift test (see :attr:`requests`), and the
        #: grid it was measured on (contexts, offsets, segment length): another grid is measured again.
        self.segment_plan: RequestPlan | None = None
        self._segment_grid: tuple[int, int, int] | None = None
        inner = inner_module(model)
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover - nnsight depends on transformers
            PreTrainedModel = ()  # type: ignore[assignment]
        if not isinstance(inner, PreTrainedModel):
            raise UnsupportedModelError(
                f"the nnsight adapter needs an nnsight wrapper around a transformers causal LM, but this "
                f"{type(model).__name__} wraps a {type(inner).__name__}; load the model with "
                "nnsight.TransformersModel(hub_id) or wrap a transformers model with nnsight.NNsight(model)"
            )
        self.hf_model = inner
        # The Hugging Face adapter knows how to find layers, heads and windows in a
        # transformers model; the envoys mirror the same module tree.
        self._hf = HuggingFaceAdapter(inner, tokenizer=tokenizer)
        if not self._hf.layout.causal:
            # The traces run right-padded windows without an attention mask, which only a causal mask makes
            # harmless; an encoder needs its padding masked, as the Hugging Face adapter does.
            raise AttentionCaptureError(
                f"{type(inner).__name__} is a bidirectional encoder; probe the Hugging Face model inside the nnsight "
                "wrapper directly: EquivarianceProbe(model._module) (encoders run locally)"
            )
        paths = {id(module): name for name, module in inner.named_modules()}
        self.attention_paths = [paths[id(module)] for module in self._hf.attention_modules]
        # The decoder layer around each attention module: its output is the residual stream after the block.
        self.layer_paths = [paths[id(parent_layer(inner, module))] for module in self._hf.attention_modules]
        if self.is_remote:
            self._check_remote_ready()

    # -- geometry and identity ---------------------------------------------------------
    @property
    def layout(self) -> AttentionLayout:
        return self._hf.layout

    @property
    def vocab_size(self) -> int | None:
        return self._hf.vocab_size

    @property
    def is_remote(self) -> bool:
        """Whether traces go to a server (``remote`` is ``True`` or a URL, not ``"local"``)."""
        return bool(self.remote) and self.remote != "local"

    @property
    def device(self) -> torch.device:
        # A remote model lives on the meta device here; its tokens travel from the CPU.
        if self.remote:
            return torch.device("cpu")
        return self._hf.device

    @property
    def dtype(self) -> torch.dtype:
        config = self.hf_model.config
        # transformers 5 names it dtype and warns on every read of torch_dtype, the 4.x name
        config_dtype = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        if self.is_remote and isinstance(config_dtype, torch.dtype):
            return config_dtype  # what the server loads; the meta copy here is float32
        return self._hf.dtype

    @property
    def model_name(self) -> str:
        return str(getattr(self.model, "repo_id", None) or self._hf.model_name)

    def info(self) -> ModelInfo:
        info = super().info()
        info.extra.update(
            architecture=type(self.hf_model).__name__,
            wrapper=type(self.model).__name__,
            remote=self.remote if isinstance(self.remote, str) else bool(self.remote),
            pattern_source=self.source.resolved(),
        )
        if not self.is_remote:
            info.extra["attn_implementation"] = self._hf.attn_implementation()
        else:  # taken before a run's first request; a server not reached now is met by that request
            with contextlib.suppress(ServerUnreachableError):
                info.extra["server"] = self.check_server().to_dict()
        return info

    capture_fix = ("Load the model with attn_implementation='eager', or pass pattern_source='recompute' "
                   "(EquivarianceProbe(model, pattern_source='recompute')).")

    @property
    def pattern_source(self) -> str:
        """Where attention comes from, as asked (``self.source.asked``)."""
        return self.source.asked

    # -- remote readiness ----------------------------------------------------------------
    def _check_remote_ready(self) -> None:
        """Fail before any work if a remote run cannot be sent at all."""
        if not hasattr(self.model, "to_model_key"):
            raise RemoteExecutionError(
                f"a {type(self.model).__name__} cannot run remotely: only models NDIF hosts can, built by hub id "
                "(nnsight.TransformersModel('meta-llama/Llama-3.1-70B')); pass remote=False to run here"
            )
        repo_id = getattr(self.model, "repo_id", None)
        host = self.remote if isinstance(self.remote, str) else configured_host()
        folder_allowed = os.path.isdir(repo_id) and not is_public_host(host) if isinstance(repo_id, str) else False
        if not isinstance(repo_id, str) or not repo_id or (os.path.exists(repo_id) and not folder_allowed):
            # NDIF's public service names models by hub id; a local path or an in-memory model fails
            # there. A self-hosted server (ndif deploy /path/to/folder) loads the folder by the
            # same path the client names, so a folder goes to any other host.
            raise RemoteExecutionError(
                f"remote runs need a model built from a Hugging Face hub id that NDIF hosts, but this "
                f"{type(self.model).__name__} was built from {repo_id or 'an in-memory model'!r}; use "
                "nnsight.TransformersModel('meta-llama/Llama-3.1-70B') (see nnsight.status() for hosted models), "
                "send a local folder to a self-hosted server (remote='http://host:port' after ndif deploy "
                "/path/to/folder), or pass remote=False to run it here"
            )
        if folder_allowed:
            # nnsight keys a model by its canonical hub id (HfApi().model_info), which a folder path
            # has not; `ndif deploy /path/to/folder` keys the folder by its path, and so does the client.
            import nnsight.modeling.huggingface as hf_wrapper

            getattr(hf_wrapper, "_ID_CACHE", {}).setdefault(repo_id, repo_id)
        if api_key() is None:
            raise MissingAPIKeyError(
                "remote=True needs an NDIF API key and none is set. Get one at https://login.ndif.us, then "
                "either export NDIF_API_KEY=<key> or run nnsight.CONFIG.set_default_api_key('<key>') once "
                "(or nnsight.login()); or pass remote=False to run the model here"
            )

    def _trace_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.remote:
            options["remote"] = self.remote
        if self.is_remote:
            from nnsight import CONFIG

            # nnsight reads NDIF_API_KEY into CONFIG at import only.
            if not CONFIG.API.APIKEY:
                CONFIG.API.APIKEY = api_key()
            self.check_server()
        return options

    def check_server(self) -> ServerVersions:
        """What the server runs, asked once per host before the first request and checked
        (:func:`~equivariance_probe.adapters.server_versions.checked_server`)."""
        host = self.remote if isinstance(self.remote, str) else configured_host()
        if self.server is None or self.server.host != host:
            with self._translate_errors("recompute"):
                self.server = checked_server(host, api_key(), self.server_versions, ATTENTION_CALL)
        return self.server

    @contextlib.contextmanager
    def _shipped_by_value(self) -> Iterator[None]:
        """Ship the in-trace functions with the request (the server lacks equivariance_probe).

        ``nnsight.register`` marks a module for pickling by value; the marks are removed
        afterwards unless the user had set them.
        """
        if not self.remote:
            yield
            return
        from cloudpickle import register_pickle_by_value, unregister_pickle_by_value
        from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES

        from ..statistics.engines import block_maths, in_trace, shift_sums
        from . import nnsight_remote, segments

        shipped = (nnsight_remote, segments, in_trace, block_maths, shift_sums)
        assert tuple(m.__name__ for m in shipped) == REMOTE_MODULES
        added = [m for m in shipped if m.__name__ not in _PICKLE_BY_VALUE_MODULES]
        for module in added:
            register_pickle_by_value(module)
        try:
            yield
        finally:
            for module in added:
                unregister_pickle_by_value(module)

    @contextlib.contextmanager
    def _local_run(self, source: str) -> Iterator[None]:
        """Eval mode, no gradients and (for eager weights) eager attention, restored after."""
        if self.remote:
            yield
            return
        if source == "weights":
            with self._hf.eager_eval(), torch.no_grad():
                yield
        else:
            was_training = self.hf_model.training
            self.hf_model.eval()
            try:
                with torch.no_grad():
                    yield
            finally:
                self.hf_model.train(was_training)

    def _attention_envoys(self) -> list[Any]:
        return [self.model.get(path) for path in self.attention_paths]

    # -- running -------------------------------------------------------------------------
    def check_plan(self, plan: Any) -> None:
        """:meth:`Adapter.check_plan` (:func:`~equivariance_probe.adapters.nnsight_binder.check_nnsight_plan`)."""
        check_nnsight_plan(self, plan)

    def run_plan(self, tokens: torch.Tensor, plan: Any, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        """:meth:`Adapter.run_plan` with the envoys of one local trace
        (:func:`~equivariance_probe.adapters.nnsight_binder.run_nnsight_plan`)."""
        return run_nnsight_plan(self, tokens, plan, position_ids=position_ids, attention_mask=attention_mask)

    def run_statistics(self, tokens: torch.Tensor, statistics: Any) -> None:
        """Run a batch and add it to ``statistics`` (between ``begin_batch``/``end_batch``).

        Locally (``remote=False``) each layer's pattern streams to ``statistics.update``,
        exactly as with the Hugging Face adapter. Remotely (``True``, a URL, or
        ``"local"``, the simulation) the reduction runs inside the trace and only float64
        sums of :func:`reply_nbytes` bytes come back, however many windows the batch has.
        """
        if not self.remote:
            if self.source.resolved() == "weights":
                with self._local_run("weights"):  # eager attention switched as the Hugging Face adapter switches it
                    pattern_pass(self, tokens, statistics.update)
            else:
                call_pass(self, tokens, lambda call: statistics.update_from_scores(
                    call.layer, call.query, call.key, scaling=call.scaling, softcap=call.softcap))
            return
        if statistics.sample is not None:
            # A sample needs individual entries, which stay on the server.
            warnings.warn(
                "sample_size is ignored for remote nnsight runs: the entry sample is not filled (only sums come "
                "back); run a few documents locally for scatter plots",
                stacklevel=3,
            )
        lengths = statistics.batch_lengths
        if lengths is None:
            raise AttentionCaptureError(
                "NNsightAdapter.run_statistics was called outside a batch; call statistics.begin_batch(lengths) first"
            )
        if statistics.log_floor is None:
            # What an eager run of this model would use, so the sums merge with local ones.
            statistics.log_floor = default_log_floor(self.dtype)
        requests = self.requests
        if requests.plan is not None and requests.plan.context_length != statistics.n_positions:
            requests.plan = None  # measured at another window length: measure this one
        self._refuse_if_planned(requests.plan, "batch")
        source = self.source.resolved()
        width = int(tokens.shape[1])
        plan = {"source": source, "model_windows": list(self.layout.sliding_windows), **statistics.reduction_plan(width)}
        started = perf_counter()
        sums = self._trace_statistics(tokens, lengths.cpu(), plan, source)
        elapsed = perf_counter() - started
        statistics.add_batch_sums(sums, width)
        if requests.plan is None:
            requests.plan = requests.planned(elapsed, int(tokens.shape[0]), _nbytes(sums), statistics.n_positions)

    @staticmethod
    def _refuse_if_planned(plan: RequestPlan | None, unit: str) -> None:
        """Raise :class:`RequestTooLongError` before a request that the first one's time says would come near
        the server's limits."""
        if plan is None or plan.refused is None:
            return
        units = {"batch": "batches", "segment": "segments"}[unit]
        raise RequestTooLongError(
            f"the next request is not sent: {plan.refused}. The {units} finished so far are kept (probe.last_result, "
            "or the error's partial_result; a checkpointed run_study keeps them in its checkpoint and resume=True "
            "goes on from them)")

    def _trace_statistics(self, tokens: torch.Tensor, lengths: torch.Tensor, plan: dict[str, Any], source: str) -> dict[str, torch.Tensor]:
        import nnsight

        model = self.model
        attention = self._attention_envoys()
        options = self._trace_options()
        tokens = tokens if self.remote else tokens.to(self.device)
        sums = None
        with self._local_run(source), self._translate_errors(source), self._shipped_by_value():
            # The block reads only these locals, the module-level function and nnsight:
            # that (and the model's name) is all a remote request carries.
            with model.trace(tokens, use_cache=False, **options) as tracer:
                sums = reduce_batch_in_trace(attention, lengths, plan)
                nnsight.save(sums)
                tracer.stop()  # skips the final norm and the projection to the vocabulary
        if not isinstance(sums, dict):
            raise RemoteExecutionError(
                f"the {'remote ' if self.remote else ''}trace returned no statistics (got {type(sums).__name__}); "
                "this batch was not added. Run again; if it persists, report it with nnsight's version"
            )
        return sums

    @contextlib.contextmanager
    def _translate_errors(self, source: str, unit: str = "batch") -> Iterator[None]:
        """nnsight, network and in-trace failures as equivariance_probe errors that say the fix; ``unit`` is what
        one request carries (``"batch"``, or ``"segment"`` for the shift test), named in what is kept."""
        units = {"batch": "batches", "segment": "segments"}[unit]
        try:
            yield
        except EquivarianceProbeError:
            raise
        except Exception as error:  # noqa: BLE001 - sorted below; anything else re-raised as is
            if isinstance(error, ValueError) and NO_WEIGHTS in str(error):
                raise AttentionCaptureError(
                    f"the attention modules returned no attention weights (pattern_source={source!r} needs eager "
                    f"attention). {self.capture_fix}"
                ) from error
            if self.is_remote and is_remote_failure(error):
                host = self.remote if isinstance(self.remote, str) else configured_host()
                kept = (
                    f"This {unit} was not added; the statistics of complete {units} before it are kept "
                    "(probe.last_result, or the error's partial_result), and a run over the remaining documents "
                    "merges with them (result_a + result_b)"
                )
                kind, fix = remote_failure_kind(error)
                if kind == "timeout" and unit == "segment":
                    fix = fix.replace("(a smaller batch_size or context_length)",
                                      "(fewer contexts or offsets: one request is one segment's whole grid)")
                named = {"unreachable": ServerUnreachableError, "not_deployed": ModelNotDeployedError,
                         "timeout": RemoteTimeoutError, "too_large": RemoteResultTooLargeError}.get(kind)
                if named is not None:
                    raise named(f"the remote run on {host} failed: {fix}. {kept}. Server said: "
                                f"{type(error).__name__}: {str(error)[:600]}") from error
                raise RemoteExecutionError(
                    f"the remote run on {host} failed: {type(error).__name__}: {error}. This {unit} was not added; "
                    f"the statistics of complete {units} before it are kept (probe.last_result, or the error's "
                    "partial_result), and a later run can be merged with them (result_a + result_b). Check the "
                    "server status (nnsight.ndif_status()), your NDIF_API_KEY and that the model is hosted "
                    "(nnsight.is_model_running(hub_id)), then run the remaining documents"
                ) from error
            if is_source_failure(error):
                raise AttentionCaptureError(
                    f"cannot read the queries and keys of this model's attention ({error}): pattern_source="
                    f"'recompute' needs the call {ATTENTION_CALL} (transformers' attention_interface) inside "
                    "each attention module's forward. Use pattern_source='weights' with eager attention"
                ) from error
            raise
