"""Adapter for nnsight models, local or remote (NDIF): reduce inside the trace.

Place in the seams: an *adapter* (the only code that knows nnsight). Locally it streams
each layer's pattern to the probe like the Hugging Face adapter. Remotely
(``remote=True``) patterns cannot come home: a Llama-3.1-70B layer at context 1024 is
64·1024² bf16 weights = 128 MiB per document, 10 GiB for its 80 layers. So
:meth:`NNsightAdapter.run_statistics` runs the statistics' own torch-only reduction
(:func:`~equivariance_probe.stats.reduce_layer`) *inside* the trace, where the model
runs, and ``.save()``\\ s only float64 sums of shapes ``[layer, head, T]`` and one
``[T, T]``, which :meth:`AttentionStatistics.add_reduced` merges exactly like local ones.

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

What travels to NDIF: the trace's code, the variables it reads, and the functions it
calls, which are shipped by value (``nnsight.register``): the in-trace functions of
this module and of :mod:`equivariance_probe.stats`, which use only ``torch`` and
builtins (the server's sandbox allows torch, numpy, einops, math, collections ...;
``tests/test_nnsight_adapter.py`` checks what the payload would import). Fits run
locally.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import (
    AttentionCaptureError,
    EquivarianceProbeError,
    InputError,
    MissingAPIKeyError,
    RemoteExecutionError,
    UnsupportedModelError,
)
from ..stats import default_log_floor, key_lag_index, mask_statistics, reduce_layer, uniform_prior, visible_mask
from .base import Adapter, AttentionLayout, ModelInfo, PatternCallback
from .huggingface import HuggingFaceAdapter

__all__ = [
    "NNsightAdapter",
    "RemoteExecutionError",
    "MissingAPIKeyError",
    "PATTERN_SOURCES",
    "REMOTE_FUNCTIONS",
    "attention_scores",
    "recompute_pattern",
    "reduce_batch_in_trace",
    "reply_nbytes",
]

#: Accepted values of ``pattern_source``.
PATTERN_SOURCES = ("auto", "weights", "recompute")

#: The operation of an attention module's forward whose inputs are
#: ``(module, query, key, value, attention_mask, **{scaling, softcap, sliding_window})``:
#: the call of ``attention_interface`` (its binding is ``attention_interface_0``).
#: Every ``transformers`` 4.48+ decoder (Llama, Mistral, Qwen, Gemma 1-3, GPT-2) has it.
ATTENTION_CALL = "attention_interface_1"

#: Tolerated attention mass per query outside the mask the adapter reported (as in
#: ``AttentionStatistics._check_mask``).
_LEAK_TOLERANCE = 1e-3


# -- code that runs inside the trace (remotely: on the NDIF server) ---------------------
#
# Everything below until the adapter class is shipped by value and must use only torch,
# builtins and the other functions listed in REMOTE_FUNCTIONS: the server's sandbox
# refuses other imports, and `equivariance_probe` is not installed there. No
# equivariance_probe exception classes either (they would travel by value, with their
# module): in-trace failures raise builtins and the adapter translates them.


def attention_scores(
    query: torch.Tensor, key: torch.Tensor, scaling: float | None, softcap: float | None
) -> torch.Tensor:
    """Pre-softmax, pre-mask attention scores as eager attention computes them.

    ``s = softcap(q·kᵀ·scaling)`` with ``softcap(s) = c·tanh(s/c)`` (Gemma 2) when ``softcap``
    is given. Grouped-query attention: each key head serves ``H / H_kv`` consecutive query
    heads (``repeat_kv`` in transformers). Float32 for half-precision inputs, float64 kept.

    Args:
        query: ``[batch, head, query, head_dim]``, after rotary embeddings and q-norm.
        key: ``[batch, kv_head, key, head_dim]``, likewise.
        scaling: the module's score scale (``head_dim**-0.5`` when ``None``, as eager).
        softcap: logit soft-capping ``c``, or ``None``.

    Returns:
        ``[batch, head, query, key]`` scores.
    """
    n_heads, n_kv_heads = query.shape[1], key.shape[1]
    if n_heads != n_kv_heads:
        key = key.repeat_interleave(n_heads // n_kv_heads, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def recompute_pattern(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """Post-softmax attention from queries and keys, as eager attention computes it.

    ``a = softmax(mask(softcap(q·kᵀ·scaling)))`` in float32, where
    ``softcap(s) = c·tanh(s/c)`` (Gemma 2) and the mask hides ``k > q`` and, for a
    sliding window ``w``, ``q - k >= w``. Grouped-query attention: each key head serves
    ``H / H_kv`` consecutive query heads (``repeat_kv`` in transformers).

    Args:
        query: ``[batch, head, query, head_dim]``, after rotary embeddings and q-norm.
        key: ``[batch, kv_head, key, head_dim]``, likewise.
        scaling: the module's score scale (``head_dim**-0.5`` when ``None``, as eager).
        softcap: logit soft-capping ``c``, or ``None``.
        window: sliding window width ``w``, or ``None`` for full causal attention.

    Returns:
        ``[batch, head, query, key]`` float32, rows sum to 1.
    """
    scores = attention_scores(query, key, scaling, softcap).float()
    n_query, n_key = scores.shape[-2], scores.shape[-1]
    q = torch.arange(n_query, device=scores.device).view(-1, 1)
    k = torch.arange(n_key, device=scores.device).view(1, -1)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    # Every row keeps its diagonal, so no row is all -inf (right padding, causal mask).
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def outside_mass(pattern: torch.Tensor, window: int | None, lengths: torch.Tensor) -> torch.Tensor:
    """Largest attention mass a real query puts outside the reported mask: ``[]`` float64.

    The in-trace twin of ``AttentionStatistics._check_mask``: if it is not ~0, the model's
    real mask is not the one the adapter reported and every statistic would miss mass.
    """
    n_positions = pattern.shape[-1]
    model_mask = visible_mask(n_positions, window, lengths)  # [batch, query, key]
    real_rows = model_mask.any(-1, keepdim=True).unsqueeze(1)
    hidden = real_rows & ~model_mask.unsqueeze(1)
    outside = torch.where(hidden, pattern.abs().to(torch.float64), torch.zeros((), dtype=torch.float64, device=pattern.device))
    return outside.sum(-1).max() if outside.numel() else torch.zeros((), dtype=torch.float64)


def layer_pattern(attention: object, source: str, window: int | None) -> torch.Tensor:
    """One layer's ``[batch, head, query, key]`` pattern, read inside a trace.

    Args:
        attention: the attention module's envoy (e.g. ``model.model.layers[l].self_attn``).
        source: ``"weights"`` (its returned weights) or ``"recompute"`` (from its q, k).
        window: the layer's sliding window, for ``"recompute"``.
    """
    if source == "weights":
        weights = attention.output[1]
        if weights is None:
            # A builtin: equivariance_probe is not importable on the server.
            raise ValueError(
                "the attention module returned no attention weights (it does not run eager attention); "
                "use pattern_source='recompute'"
            )
        return weights.detach()
    args, kwargs = attention.source.attention_interface_1.inputs
    return recompute_pattern(
        args[1].detach(), args[2].detach(), kwargs.get("scaling"), kwargs.get("softcap"), window
    )


def reduce_batch_in_trace(attention: list, lengths: torch.Tensor, plan: dict) -> dict[str, torch.Tensor]:
    """Reduce one batch's attention to float64 sums, layer by layer, inside the trace.

    Only one layer's pattern exists at a time. The caller stops the model run after it
    (the final norm and the projection to the vocabulary are not needed).

    Args:
        attention: per layer, the attention module's envoy.
        lengths: ``[batch]`` real tokens per window (right-padded).
        plan: plain values: ``source`` (``"weights"``/``"recompute"``), ``model_windows``
            (per layer, the model's sliding window or ``None``), ``windows`` (the
            statistics' windows: ``None`` where the window covers the context),
            ``excluded_keys``, ``log_floor``, ``keep_pattern``, ``check_mask``.

    Returns:
        float64 tensors for ``W`` = the batch's width and ``L`` layers:
        ``raw_sum, raw_sq, log_sum, log_sq, lag_sum: [L, head, W]``;
        ``floored, doc_toeplitz_sum, doc_toeplitz_count: [L, head]``;
        ``key_lag_sum: [W, W]`` (summed over layers); ``outside_mass: [L]``; and, if
        ``keep_pattern``, ``pattern_sum: [L, head, W, W]``.
    """
    # No typing names in here: annotations would make the payload import `typing`.
    per_layer: dict[str, list[torch.Tensor]] = {}
    key_lag_total = None
    outside: list[torch.Tensor] = []
    masks: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
    index = None
    for layer, module in enumerate(attention):
        pattern = layer_pattern(module, plan["source"], plan["model_windows"][layer])
        device = pattern.device
        n_positions = pattern.shape[-1]
        lengths_here = lengths.to(device)
        if index is None:
            index = key_lag_index(n_positions, device)
        window = plan["windows"][layer]
        if window not in masks:
            visible = visible_mask(n_positions, window, lengths_here, plan["excluded_keys"])
            prior = uniform_prior(n_positions, window, device)
            masks[window] = (visible, mask_statistics(visible, prior, index)["doc_lag_count"])
        visible, doc_lag_count = masks[window]
        reduced = reduce_layer(
            pattern, visible, index, plan["log_floor"], doc_lag_count, keep_pattern=plan["keep_pattern"],
            max_lag=window,
        )
        key_lag = reduced.pop("key_lag_sum")
        key_lag_total = key_lag if key_lag_total is None else key_lag_total + key_lag
        for name, value in reduced.items():
            per_layer.setdefault(name, []).append(value)
        if plan["check_mask"]:
            outside.append(outside_mass(pattern, window, lengths_here))
        else:
            outside.append(torch.zeros((), dtype=torch.float64, device=device))
        del pattern, reduced
    out = {name: torch.stack(values) for name, values in per_layer.items()}
    out["key_lag_sum"] = key_lag_total
    out["outside_mass"] = torch.stack(outside)
    # Sums come home on the CPU (the server would otherwise return CUDA tensors).
    return {name: value.cpu() for name, value in out.items()}


#: The functions that run inside the trace, and so on the server (by value).
REMOTE_FUNCTIONS = (
    "equivariance_probe.adapters.nnsight.attention_scores",
    "equivariance_probe.adapters.nnsight.recompute_pattern",
    "equivariance_probe.adapters.nnsight.outside_mass",
    "equivariance_probe.adapters.nnsight.layer_pattern",
    "equivariance_probe.adapters.nnsight.reduce_batch_in_trace",
    "equivariance_probe.stats.visible_mask",
    "equivariance_probe.stats.uniform_prior",
    "equivariance_probe.stats.key_lag_index",
    "equivariance_probe.stats.mask_statistics",
    "equivariance_probe.stats.reduce_layer",
    "equivariance_probe.stats.entry_moments",
    "equivariance_probe.stats.diagonal_sums",
    "equivariance_probe.stats._row_moments",
)


def reply_nbytes(n_layers: int, n_heads: int, n_positions: int, keep_pattern: bool = False) -> int:
    """Bytes of float64 sums one trace sends back, from the shapes alone.

    ``8·(L·(5·H·T + 3·H + 1) + T²)``, plus ``8·L·H·T²`` with ``keep_pattern``; it does not
    depend on the number of windows in the batch. For comparison, the bf16 patterns of
    one window are ``2·L·H·T²`` bytes.
    """
    n = n_layers * (5 * n_heads * n_positions + 3 * n_heads + 1) + n_positions**2
    if keep_pattern:
        n += n_layers * n_heads * n_positions**2
    return 8 * n


# -- the adapter --------------------------------------------------------------------------


def _inner_module(model: Any) -> Any:
    """The ``torch.nn.Module`` an nnsight envoy wraps (``_module`` in 0.8, ``_model`` before)."""
    inner = getattr(model, "_module", None)
    if inner is None:
        inner = getattr(model, "_model", None)
    return inner


def _api_key() -> str | None:
    """The NDIF API key nnsight would send: its config (``NDIF_API_KEY`` wins at import)."""
    try:
        from nnsight import CONFIG

        key = CONFIG.API.APIKEY
    except Exception:  # noqa: BLE001 - an nnsight without CONFIG: fall back to the variable
        key = None
    # Set after nnsight was imported, the variable is not in CONFIG yet; nnsight reads
    # CONFIG when it sends, so the adapter passes it on (see _trace_options).
    return key or os.environ.get("NDIF_API_KEY") or None


class NNsightAdapter(Adapter):
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

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None = None,
        *,
        remote: bool | str = False,
        pattern_source: str = "auto",
    ) -> None:
        super().__init__(model, tokenizer)
        if pattern_source not in PATTERN_SOURCES:
            raise InputError(f"pattern_source={pattern_source!r} is not one of {PATTERN_SOURCES}")
        if not isinstance(remote, (bool, str)):
            raise InputError(f"remote must be True, False, 'local' or a host URL, not {remote!r}")
        self.remote = remote
        self.pattern_source = pattern_source
        inner = _inner_module(model)
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
        paths = {id(module): name for name, module in inner.named_modules()}
        self.attention_paths = [paths[id(module)] for module in self._hf.attention_modules]
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
        config_dtype = getattr(self.hf_model.config, "dtype", None) or getattr(self.hf_model.config, "torch_dtype", None)
        if self.is_remote and isinstance(config_dtype, torch.dtype):
            return config_dtype  # what the server loads; the meta copy here is float32
        return self._hf.dtype

    def model_name(self) -> str:
        return str(getattr(self.model, "repo_id", None) or self._hf.model_name())

    def info(self) -> ModelInfo:
        info = super().info()
        info.extra.update(
            architecture=type(self.hf_model).__name__,
            wrapper=type(self.model).__name__,
            remote=self.remote if isinstance(self.remote, str) else bool(self.remote),
            pattern_source=self.resolved_source(),
        )
        if not self.is_remote:
            info.extra["attn_implementation"] = self._hf._attn_implementation()
        return info

    def capture_hint(self) -> str:
        return (
            "Load the model with attn_implementation='eager', or pass pattern_source='recompute' "
            "(EquivarianceProbe(model, pattern_source='recompute'))."
        )

    def resolved_source(self) -> str:
        """``"weights"`` or ``"recompute"``: what ``"auto"`` means for this model."""
        if self.pattern_source != "auto":
            return self.pattern_source
        if self.remote:
            return "recompute"
        return "weights" if self._hf._attn_implementation() == "eager" else "recompute"

    # -- remote readiness ----------------------------------------------------------------
    def _check_remote_ready(self) -> None:
        """Fail before any work if a remote run cannot be sent at all."""
        if not hasattr(self.model, "to_model_key"):
            raise RemoteExecutionError(
                f"a {type(self.model).__name__} cannot run remotely: only models NDIF hosts can, built by hub id "
                "(nnsight.TransformersModel('meta-llama/Llama-3.1-70B')); pass remote=False to run here"
            )
        repo_id = getattr(self.model, "repo_id", None)
        if not isinstance(repo_id, str) or not repo_id or os.path.exists(repo_id):
            # NDIF names models by hub id; a local path or an in-memory model fails there.
            raise RemoteExecutionError(
                f"remote runs need a model built from a Hugging Face hub id that NDIF hosts, but this "
                f"{type(self.model).__name__} was built from {repo_id or 'an in-memory model'!r}; use "
                "nnsight.TransformersModel('meta-llama/Llama-3.1-70B') (see nnsight.status() for hosted models), "
                "or pass remote=False to run it here"
            )
        if _api_key() is None:
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
                CONFIG.API.APIKEY = _api_key()
        return options

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

        from .. import stats
        from . import nnsight as this_module

        added = [m for m in (stats, this_module) if m.__name__ not in _PICKLE_BY_VALUE_MODULES]
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
            with self._hf._eager_eval(), torch.no_grad():
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
    def run_patterns(self, tokens: torch.Tensor, on_pattern: PatternCallback) -> None:
        """Stream each layer's pattern to ``on_pattern`` from inside a local trace.

        Only one layer's pattern is alive at a time. Remote models cannot stream
        patterns (they stay on the server); :meth:`run_statistics` reduces them there.
        """
        if self.remote:
            raise RemoteExecutionError(
                "patterns of a remote model cannot be streamed here (they would be gigabytes per document); "
                "EquivarianceProbe.run reduces them on the server (run_statistics), or pass remote=False"
            )
        source = self.resolved_source()
        model = self.model
        attention = self._attention_envoys()
        windows = list(self.layout.windows)
        seen: list[int] = []
        with self._local_run(source), self._translate_errors(source):
            with model.trace(tokens.to(self.device), use_cache=False) as tracer:
                for layer, module in enumerate(attention):
                    on_pattern(layer, layer_pattern(module, source, windows[layer]))
                    seen.append(layer)
                tracer.stop()
        self.check_layers_seen(seen)

    def run_statistics(self, tokens: torch.Tensor, statistics: Any) -> None:
        """Run a batch and add it to ``statistics`` (between ``begin_batch``/``end_batch``).

        Locally (``remote=False``) each layer's pattern streams to ``statistics.update``,
        exactly as with the Hugging Face adapter. Remotely (``True``, a URL, or
        ``"local"``, the simulation) the reduction runs inside the trace and only float64
        sums of :func:`reply_nbytes` bytes come back, however many windows the batch has.
        """
        if not self.remote:
            self.run_patterns(tokens, statistics.update)
            return
        if getattr(statistics, "sample", None) is not None:
            import warnings

            # A sample needs individual entries, which stay on the server.
            warnings.warn(
                "sample_size is ignored for remote nnsight runs: the entry sample is not filled (only sums come "
                "back); run a few documents locally for scatter plots",
                stacklevel=3,
            )
        lengths = statistics.batch_lengths
        if lengths is None:
            raise RuntimeError("NNsightAdapter.run_statistics called outside statistics.begin_batch/end_batch")
        if statistics.log_floor is None:
            # What an eager run of this model would use, so the sums merge with local ones.
            statistics.log_floor = default_log_floor(self.dtype)
        source = self.resolved_source()
        width = int(tokens.shape[1])
        plan = {
            "source": source,
            "model_windows": list(self.layout.windows),
            "windows": [None if w is None or w >= width else int(w) for w in statistics.windows],
            "excluded_keys": [int(k) for k in statistics.excluded_keys],
            "log_floor": float(statistics.log_floor),
            "keep_pattern": bool(statistics.keep_pattern),
            "check_mask": statistics.n_windows == 0,
        }
        sums = self._trace_statistics(tokens, lengths.cpu(), plan, source)
        self._add_sums(sums, statistics, width)

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

    def _add_sums(self, sums: dict[str, torch.Tensor], statistics: Any, width: int) -> None:
        """Pad ``[.., W]`` sums to the statistics' ``T`` and add them layer by layer."""
        n_positions = statistics.n_positions
        pad = n_positions - width
        if sums["outside_mass"].numel() and float(sums["outside_mass"].max()) > _LEAK_TOLERANCE:
            layer = int(sums["outside_mass"].argmax())
            window = statistics.windows[layer]
            raise AttentionCaptureError(
                f"layer {layer} puts attention mass up to {float(sums['outside_mass'][layer]):.3g} per query on keys "
                f"outside the mask the adapter reported ({'full causal' if window is None else f'sliding window {window}'}); "
                "the statistics would miss it. The model's mask is not one this adapter understands: report the "
                "architecture, or pass an adapter with the right windows"
            )

        def padded(value: torch.Tensor, dims: int) -> torch.Tensor:
            if pad == 0:
                return value
            # Key-lag arrays are indexed [t, dt]: a narrower window's entries keep their
            # (t, dt), so zero-padding embeds them exactly (see stats.key_lag_index).
            return torch.nn.functional.pad(value, (0, pad) * dims)

        zero_key_lag = torch.zeros((n_positions, n_positions), dtype=torch.float64)
        for layer in range(self.layout.n_layers):
            reduced = {
                name: padded(sums[name][layer], 1)
                for name in ("raw_sum", "raw_sq", "log_sum", "log_sq", "lag_sum")
            }
            for name in ("floored", "doc_toeplitz_sum", "doc_toeplitz_count"):
                reduced[name] = sums[name][layer]
            if "pattern_sum" in sums:
                reduced["pattern_sum"] = padded(sums["pattern_sum"][layer], 2)
            # The trace summed key_lag_sum over layers (the statistics only keep that
            # sum): it goes with the last layer, zeros with the others.
            last = layer == self.layout.n_layers - 1
            reduced["key_lag_sum"] = padded(sums["key_lag_sum"], 2) if last else zero_key_lag
            statistics.add_reduced(layer, reduced)

    @contextlib.contextmanager
    def _translate_errors(self, source: str) -> Iterator[None]:
        """nnsight, network and in-trace failures as equivariance_probe errors that say the fix."""
        try:
            yield
        except EquivarianceProbeError:
            raise
        except Exception as error:  # noqa: BLE001 - sorted below; anything else re-raised as is
            if isinstance(error, ValueError) and "returned no attention weights" in str(error):
                raise AttentionCaptureError(
                    f"the attention modules returned no attention weights (pattern_source={source!r} needs eager "
                    f"attention). {self.capture_hint()}"
                ) from error
            if self.is_remote and _is_remote_failure(error):
                host = self.remote if isinstance(self.remote, str) else _configured_host()
                raise RemoteExecutionError(
                    f"the remote run on {host} failed: {type(error).__name__}: {error}. This batch was not added; "
                    "the statistics of complete batches before it are kept (probe.last_result, or the error's "
                    "partial_result), and a later run can be merged with them (result_a + result_b). Check the "
                    "server status (nnsight.ndif_status()), your NDIF_API_KEY and that the model is hosted "
                    "(nnsight.is_model_running(hub_id)), then run the remaining documents"
                ) from error
            if _is_source_failure(error):
                raise AttentionCaptureError(
                    f"cannot read the queries and keys of this model's attention ({error}): pattern_source="
                    f"'recompute' needs the call {ATTENTION_CALL} (transformers' attention_interface) inside "
                    "each attention module's forward. Use pattern_source='weights' with eager attention"
                ) from error
            raise


def _configured_host() -> str:
    try:
        from nnsight import CONFIG

        return CONFIG.API.HOST
    except Exception:  # noqa: BLE001
        return "NDIF"


def _is_remote_failure(error: BaseException) -> bool:
    """Whether ``error`` comes from talking to the server (not from our own code)."""
    if isinstance(error, (OSError, ConnectionError, TimeoutError)):
        return True
    module = type(error).__module__ or ""
    return module.split(".")[0] in ("nnsight", "httpx", "httpcore", "websocket", "huggingface_hub", "requests")


def _is_source_failure(error: BaseException) -> bool:
    name = type(error).__name__
    return "SourceNotAvailable" in name or (isinstance(error, AttributeError) and ATTENTION_CALL in str(error))
