"""What an adapter must provide: the seam between model frameworks and the statistics.

An adapter is the only code that knows a framework (TransformerLens, Hugging Face,
nnsight). It tells the probe the shape of the model's attention (layers, query heads,
the real mask of every layer) and runs token windows through the model, handing each
layer's attention to the statistics *as soon as it exists*, so that the probe
reduces it to sums and never keeps it.

The whole contract, all of it on :class:`Adapter` (the probe and the statistics use nothing else):

* geometry and identity: :attr:`~Adapter.layout`, :attr:`~Adapter.vocab_size`,
  :attr:`~Adapter.tokenizer`, :meth:`~Adapter.encode`, :attr:`~Adapter.device`,
  :attr:`~Adapter.dtype`, :meth:`~Adapter.info`;
* running a batch: :meth:`~Adapter.run_statistics` (inside the statistics' ``begin_batch`` /
  ``end_batch``; the adapter calls ``statistics.update(layer, pattern)`` or
  ``statistics.update_from_scores(layer, query, key, scaling=, softcap=)`` once per layer, or, when
  the reduction runs elsewhere, ``statistics.reduction_plan`` and ``statistics.add_batch_sums``), built
  on the two standard plans of :mod:`~equivariance_probe.adapters.passes` (each layer's post-softmax pattern
  at ``"weights.{l}"``, or its :class:`~equivariance_probe.adapters.internals.AttentionCall` at ``"qk.{l}"``);
* where attention comes from: :attr:`~Adapter.source` (an :class:`AttentionSource`: what was asked, what runs,
  and the first batch's checks that decide it), which the probe runs through
  :func:`~equivariance_probe.adapters.checks.run_first_batch_checks` and records in
  ``metadata["engine"]``;
* plans: :meth:`~Adapter.plan`, :meth:`~Adapter.check_plan` and :meth:`~Adapter.run_plan` run one forward pass
  that reads and replaces named sites (:mod:`~equivariance_probe.adapters.plan`); every feature above the
  adapters (the shift test's passes, the positional analyses) is a plan, and :attr:`~Adapter.score_site` says
  where this framework hands over attention scores;
* the shift test's checks and remote sums: :meth:`~Adapter.check_segment_recompute` (the block's weights against the model's own),
  :attr:`~Adapter.segment_capture` (where the block is read, recorded in the result) and, for a model whose
  blocks cannot come back (nnsight on NDIF), :meth:`~Adapter.segment_grid_sums` (a segment's whole grid summed
  where the model runs, :attr:`~Adapter.sums_segment_grid`);
* errors: :func:`~equivariance_probe.adapters.passes.check_layers_seen`, with the framework's
  :attr:`~Adapter.capture_fix`;
* the registry's declarations (:mod:`~equivariance_probe.adapters.registry` reads them, the way einops
  finds its backends): :attr:`~Adapter.framework`, :attr:`~Adapter.model_types` (checked without importing
  a framework), :attr:`~Adapter.capabilities`, :meth:`~Adapter.wrap` and :meth:`~Adapter.unwrap`.

Shapes follow one order everywhere: ``pattern: [batch, head, query, key]``, rows sum to 1.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError, UnsupportedModelError

#: Callback an adapter calls once per layer and batch: ``on_pattern(layer, pattern)``
#: with ``pattern: [batch, head, query, key]``.
PatternCallback = Callable[[int, torch.Tensor], None]
#: Capability: the framework's models always end in a language-model head (a TransformerBridge, an nnsight
#: language model); a Hugging Face model has one only when its class is a causal LM (``...ForCausalLM``).
LANGUAGE_MODEL_HEAD = "language_model_head"
#: Capability: the adapter can run the model elsewhere (nnsight on NDIF), so the attention never comes back.
RUNS_REMOTELY = "runs_remotely"
#: Capability: the adapter runs bidirectional encoders (BERT-like) as well as causal decoders.
RUNS_ENCODERS = "runs_encoders"
#: ``on_capture(component, x)`` with a component's output at the segment (:mod:`~.components`' names),
#: ``x: [batch, m, d]`` (``[batch, m, head_dim]`` for a head: its slice of the output projection's input).
ComponentCallback = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class SegmentBatch:
    """One forward pass of a segment's shift grid: right-padded windows of one context at several offsets.

    Attributes:
        tokens: ``[batch, T]`` token ids; window ``b`` has ``lengths[b]`` real tokens, its segment the last ``m``.
        lengths: ``[batch]`` real tokens per window.
        offset_indices: each window's offset, an index into the run's offsets.
        position_start: ``[batch]`` each window's first position id (the ``"position_ids"`` mode), or ``None`` (0).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    offset_indices: tuple[int, ...]
    position_start: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionLayout:
    """The attention geometry of a model, as the statistics need it.

    Attributes:
        n_layers: number of attention layers.
        n_heads: number of query heads per layer (for grouped-query attention, the
            query heads, not the key/value heads).
        sliding_windows: per layer, ``None`` for full causal attention or the width ``w`` of a
            sliding window, in which query ``q`` sees keys ``max(0, q-w+1) .. q``
            (``|V(q)| = min(q+1, w)``; Gemma 3 local layers, Mistral).
        max_context: the longest window the model accepts, or ``None`` if unbounded.
        causal: ``False`` for a bidirectional encoder (BERT): query ``q`` sees every real key of
            its window, and padding keys are hidden by the attention mask the adapter passes.
        hidden_size: ``d``, the residual stream's width (``None``: the framework does not say).
        rotary: whether positions enter as rotations of the queries and keys (``None``: not said), which decides
            the shift test's built-in check.
    """

    n_layers: int
    n_heads: int
    sliding_windows: tuple[int | None, ...]
    max_context: int | None = None
    causal: bool = True
    hidden_size: int | None = None
    rotary: bool | None = None

    def __post_init__(self) -> None:
        if len(self.sliding_windows) != self.n_layers:
            raise InputError(
                f"AttentionLayout: {len(self.sliding_windows)} sliding windows given for {self.n_layers} layers; "
                "give one per layer (None for full causal attention)"
            )


@dataclass
class ModelInfo:
    """What a result records about the model it was measured on."""

    name: str
    framework: str
    dtype: str
    device: str
    extra: dict[str, Any] = field(default_factory=dict)


class AttentionSource:
    """Where the main probe's attention comes from, for one adapter: what was asked (``"weights"``: the model's own
    post-softmax weights; ``"recompute"``: queries and keys, the weights recomputed by the statistics; ``"auto"``),
    which of the first batch's checks decide it (:func:`~equivariance_probe.adapters.checks.run_first_batch_checks`:
    ``"source"``, that recomputed weights are the model's own; ``"engine"``, that the engine's sums equal a float64
    reduction of the model's weights), and what they decided.

    This default is an adapter with one source, its captured weights: nothing to check. Adapters that read queries
    and keys subclass it (:meth:`auto`, :meth:`checks`).
    """

    def __init__(self, asked: str = "weights") -> None:
        self.asked = asked
        self.decided: str | None = None

    def resolved(self) -> str:
        """``"weights"`` or ``"recompute"``: what runs (so far)."""
        if self.asked != "auto":
            return self.asked
        return self.decided or self.auto()

    def auto(self) -> str:
        """What ``"auto"`` means before a check has decided."""
        return "recompute"

    def checks(self) -> tuple[str, ...]:
        """What the probe checks on a run's first batch, before reducing it (empty: nothing is recomputed)."""
        return ()

    def use(self, decided: str) -> None:
        """Take the source the first batch's ``"source"`` check decided."""
        self.decided = decided


class Adapter(ABC):
    """Base class of the framework adapters.

    Subclasses set :attr:`framework` and ``self._layout`` (an :class:`AttentionLayout`)
    and bind sites (:meth:`check_plan` and :meth:`run_plan`, one binder module): every analysis runs on that.
    ``self._tokenizer`` is the tokenizer given, else
    the model's own ``tokenizer`` attribute (TransformerLens, nnsight), else ``None``.
    """

    #: Short name of the framework, recorded in results and chosen with ``--framework`` (e.g. ``"huggingface"``).
    framework: str = ""
    #: The model classes this adapter takes, as ``(module, class names)`` pairs. A pair is checked only once
    #: the module's top package is in ``sys.modules`` (a model of that type cannot exist otherwise), so that
    #: finding an adapter imports no framework. Only a class that declares it in its own body is registered (a
    #: variant that inherits it does not compete with its parent); empty: the registry never picks the class.
    model_types: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: What the framework's models can do beyond the contract: :data:`LANGUAGE_MODEL_HEAD`, :data:`RUNS_REMOTELY`,
    #: :data:`RUNS_ENCODERS`; read through :func:`~equivariance_probe.adapters.registry.framework_can`.
    capabilities: frozenset[str] = frozenset()
    #: The registry tries adapters in this order, lower first: a framework whose models hold another
    #: framework's model inside (nnsight's envoys hold a ``transformers`` model) comes before it.
    detection_order: int = 0
    #: What :attr:`model_types` means to a user, for error messages and docs/guide/models.md.
    supported_models: str = ""
    #: The attention implementation a Hugging Face model must be loaded with to be wrapped for this
    #: framework (``None``: any); a TransformerBridge replaces the attention modules with its own eager ones.
    load_attention: str | None = None
    #: Where the main probe's attention comes from (:class:`AttentionSource`; adapters that read queries and keys
    #: set their own in ``__init__``).
    source: AttentionSource
    #: How to make attention capturable for this framework (appended to capture errors).
    capture_fix: str = ""
    #: Where the shift test reads the segment block, recorded in a shift result's ``metadata["capture"]``.
    segment_capture: str = ""

    def __init__(self, model: Any, tokenizer: Any | None = None) -> None:
        self.model = model
        self._tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self._layout: AttentionLayout | None = None
        self.source = AttentionSource()

    # -- the registry's declarations ---------------------------------------------
    @classmethod
    def takes(cls, model: Any) -> bool:
        """Whether ``model`` is an instance of one of :attr:`model_types`, importing no framework that
        is not imported already."""
        for module, names in cls.model_types:
            if module.split(".")[0] not in sys.modules:
                continue
            try:
                imported = importlib.import_module(module)
                # A name a framework has removed may raise ImportError on access (TransformerLens 4's
                # HookedTransformer) rather than be missing.
                found = [getattr(imported, name, None) for name in names]
            except ImportError:
                continue
            classes = tuple(c for c in found if isinstance(c, type))
            if classes and isinstance(model, classes):
                return True
        return False

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, *, source: str, dtype: torch.dtype, device: str | torch.device) -> Any:
        """A Hugging Face ``model`` wrapped for this framework (it may modify ``model`` in place), the
        inverse of :meth:`unwrap`; ``source`` is the name or folder it was loaded from.

        Raises:
            InputError: this adapter's framework does not wrap Hugging Face models.
        """
        raise InputError(f"the {cls.framework or cls.__name__} adapter cannot wrap a Hugging Face model")

    @classmethod
    def unwrap(cls, model: Any) -> Any | None:
        """The ``transformers`` model inside ``model`` (one of :attr:`model_types`), ``None`` if there is none."""
        return None

    @property
    def has_language_model_head(self) -> bool:
        """Whether the model predicts the next token (:data:`LANGUAGE_MODEL_HEAD`)."""
        return LANGUAGE_MODEL_HEAD in self.capabilities

    # -- geometry ---------------------------------------------------------------
    @property
    def layout(self) -> AttentionLayout:
        """Layers, query heads and the real mask of every layer."""
        if self._layout is None:
            raise NotImplementedError(f"{type(self).__name__} did not set its attention layout")
        return self._layout

    @property
    def vocab_size(self) -> int | None:
        """Size of the input vocabulary, used to reject out-of-range token ids."""
        return None

    @property
    def tokenizer(self) -> Any | None:
        """The model's tokenizer (Hugging Face style: callable, ``encode``), or ``None``."""
        return self._tokenizer

    @property
    def device(self) -> torch.device:
        """Device the model's parameters live on; token windows are moved there."""
        for parameter in self.model.parameters():
            return parameter.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        for parameter in self.model.parameters():
            return parameter.dtype
        return torch.float32

    def info(self) -> ModelInfo:
        """Identity of the model for the result's metadata."""
        return ModelInfo(
            name=self.model_name,
            framework=self.framework,
            dtype=str(self.dtype).replace("torch.", ""),
            device=str(self.device),
        )

    @property
    def model_name(self) -> str:
        """The model's name (its repository or class), as results record it."""
        return type(self.model).__name__

    # -- running ----------------------------------------------------------------
    #: How the batches of a run are sized as requests to a server
    #: (:class:`~equivariance_probe.adapters.request_sizes.Requests`: a remote nnsight model), or ``None`` for a
    #: model that runs here. A checkpointed run keeps each finished request, and the plan it was sent under
    #: (:mod:`~equivariance_probe.runs.checkpoint`).
    requests: Any = None

    def run_statistics(self, tokens: torch.Tensor, statistics: Any) -> None:
        """Run a batch and add its attention to ``statistics`` (an ``AttentionStatistics``
        on which ``begin_batch`` was called).

        The default streams each layer's pattern to ``statistics.update`` through this framework's binder
        (:func:`~equivariance_probe.adapters.passes.pattern_pass`, site ``"weights.{l}"``). Adapters that
        cannot bring patterns home (remote nnsight) override this to reduce where the model runs and add only the
        sums.
        """
        from .passes import pattern_pass

        pattern_pass(self, tokens, statistics.update, getattr(statistics, "batch_lengths", None))

    def check_segment_recompute(self, tokens: torch.Tensor, segment_length: int) -> dict[str, Any] | None:
        """Before a shift run: do the segment block's weights that the shift test recomputes from queries
        and keys equal the model's own, on one window ``tokens: [1, T]`` (its segment the last
        ``segment_length`` tokens)?

        Returns ``{"max_difference", "tolerance", "tokens", "passed"}``, or ``None`` (the default) for an
        adapter that has nothing to compare; raises
        :class:`~equivariance_probe.errors.AttentionCaptureError` where they differ.
        """
        return None

    #: Whether :meth:`segment_grid_sums` sums a segment's grid where the model runs (the blocks of
    #: a plan's reads cannot come back); ``False``: the probe sums the blocks its segment passes hand it.
    sums_segment_grid: bool = False

    def segment_grid_sums(self, contexts: Sequence[Sequence[SegmentBatch]], config: Any,
                          targets: torch.Tensor | None) -> dict[str, Any]:
        """One segment's whole ``F × S`` grid, summed where the model runs.

        Args:
            contexts: per context, the forward passes that cover every offset (:class:`SegmentBatch`).
            config: the run's :class:`~equivariance_probe.statistics.shift.ShiftConfig`.
            targets: ``[m − 1]`` the segment's own next tokens, or ``None`` without predictions.

        Returns:
            :meth:`~equivariance_probe.statistics.shift.SegmentGrid.sums`' arrays (numpy float64).
        """
        raise UnsupportedModelError(
            f"this {self.framework or type(self).__name__} adapter hands the shift test its blocks window by window "
            "(plans of sites); it does not sum a segment's grid where the model runs")

    # -- plans: one forward pass that reads and replaces named sites ---------------------------
    #: Where this framework hands over each layer's attention scores: ``"qk"`` (the queries and keys of the
    #: attention call, :class:`~equivariance_probe.adapters.internals.AttentionCall`) or ``"scores"`` (scores the
    #: framework forms itself, :class:`~equivariance_probe.adapters.internals.AttentionScores`).
    score_site: str = "qk"

    def plan(self, steps: Sequence[tuple[str, Any]], *, ablation: str | None = None,
             last_position_logits: bool = False, logits_kept: int = 0, own_kernel: bool = False) -> Any:
        """A :class:`~equivariance_probe.adapters.plan.Plan` of ``(site name, action)`` pairs, checked against
        this model's layers and heads (:meth:`~equivariance_probe.adapters.plan.Plan.of`)."""
        from .plan import Plan

        return Plan.of(steps, n_layers=self.layout.n_layers, n_heads=self.layout.n_heads, ablation=ablation,
                       last_position_logits=last_position_logits, logits_kept=logits_kept, own_kernel=own_kernel)

    def check_plan(self, plan: Any) -> None:
        """Refuse, before any pass, a plan whose sites or ablation this framework cannot bind.

        Raises:
            UnsupportedModelError: this adapter binds no sites (the default).
        """
        raise self._binds_no_sites()

    def run_plan(self, tokens: torch.Tensor, plan: Any, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        """Run ``tokens: [batch, T]`` through the model once under ``plan``
        (:mod:`~equivariance_probe.adapters.plan`), without gradients, each site bound to this framework's hook
        points once, and the model left as it was found; ``position_ids: [batch, T]`` and an encoder's
        ``attention_mask: [batch, T]`` go to the model where given.

        Returns:
            What the pass recorded of the plan's ablation (``{"ablation": (...), "rotary_calls": ...,
            "position_table_calls": ...}``; ``{"ablation": ()}`` without one).

        Raises:
            UnsupportedModelError: this adapter binds no sites (the default).
        """
        raise self._binds_no_sites()

    def _binds_no_sites(self) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"the {self.framework or type(self).__name__} adapter binds no sites, so analyses that read a model's "
            "insides (position probes, permutation sensitivity, representation sums) cannot run on it; use a "
            "Hugging Face model, a TransformerBridge or an nnsight model")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's own special tokens (e.g. BOS)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise InputError(
                f"this {self.framework} model has no tokenizer, so strings cannot be tokenised; "
                "pass token ids instead (a LongTensor [n_docs, n_tokens]), or attach a tokenizer "
                "to the model"
            )
        return token_ids(tokenizer, text, add_special_tokens=True)


def token_ids(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """The ids of the whole of ``text``, whatever its length.

    Callers cut windows from them and never run a document whole, so a Hugging Face tokenizer is
    called with ``verbose=False``: its "longer than the specified maximum sequence length" warning
    would be a false alarm on stderr. Other tokenizers are called as they are.
    """
    try:
        accepts_verbose = "verbose" in inspect.signature(tokenizer.__call__).parameters
    except (TypeError, ValueError):  # a callable without a readable signature
        accepts_verbose = False
    quiet = {"verbose": False} if accepts_verbose else {}
    return list(tokenizer(text, add_special_tokens=add_special_tokens, **quiet)["input_ids"])
