"""Adapter for plain Hugging Face causal LMs (``transformers.PreTrainedModel``).

Place in the seams: *adapters*, the only code that knows transformers' modules.

Where attention comes from (``pattern_source``):

* ``"recompute"`` — every transformers attention module hands its queries and keys (after
  rotary embeddings and q/k norms), its scaling and soft-capping to an attention function
  from transformers' registry; the adapter reads them there
  (:func:`~equivariance_probe.adapters.internals.intercept_attention` with the model's own
  implementation), lets the model run its own kernel (``sdpa``, ``flash_attention_2``, eager),
  and the statistics recompute the weights in query blocks
  (:meth:`~equivariance_probe.statistics.AttentionStatistics.update_from_scores`).
* ``"weights"`` — a forward hook on every attention module reads its returned
  ``attn_weights: [batch, head, query, key]``, which exist only under eager attention, so the
  model is switched to eager for the run and back afterwards. For what the recomputation
  cannot model: ALiBi biases, learned sink logits, custom attention.
* ``"auto"`` (default) — ``"recompute"``, checked on the first batch: the first window's first
  :data:`~equivariance_probe.adapters.checks.CHECK_TOKENS` tokens run once more under eager attention
  (:mod:`~equivariance_probe.adapters.checks`), and the recomputed weights must equal the model's own to
  :func:`~equivariance_probe.adapters.internals.recompute_tolerance`; where they do not (or where the
  model calls no registered attention function), the run falls back to ``"weights"`` with a
  warning. The result's metadata says which source ran.

The base model (``model.base_model``) is called instead of the causal LM, and the forward pass
stops after the last layer's attention: nothing after it is needed (at context 1024 the
projection to the vocabulary alone is about half of a Gemma 3 270M forward).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import AttentionCaptureError, check_choice
from .base import Adapter, AttentionLayout, AttentionSource, RUNS_ENCODERS
from .hf_binder import check_hf_plan, run_hf_plan
from .passes import call_pass, pattern_pass
from .internals import AttentionCall, eager_weights, position_embedding_modules, recompute_tolerance, rotary_modules
from .modules import (
    config_max_context,
    find_attention_modules,
    is_bidirectional,
    is_causal_lm,
    layer_windows,
    text_config,
)
from .segments import block_difference, judged_recompute_check, segment_blocks_from_call, segment_spans

#: Accepted values of ``pattern_source``.
PATTERN_SOURCES = ("auto", "recompute", "weights")

def _positions_in_table(model: Any) -> int | None:
    """Positions a learned absolute position table can embed, where it holds offset rows: RoBERTa numbers
    positions from ``padding_idx + 1`` (514 rows, 512 positions), OPT keeps an ``offset`` of 2."""
    for table in position_embedding_modules(model):
        offset = getattr(table, "offset", None)
        if offset is None:
            offset = table.padding_idx + 1 if table.padding_idx is not None else 0
        return int(table.num_embeddings) - int(offset)
    return None


class QueriesAndKeys(AttentionSource):
    """The source of an adapter that reads queries and keys: ``"auto"`` recomputes until the first batch's
    ``"source"`` check decides, and the first batch checks the source and the engine unless the model's own weights
    were asked for."""

    def checks(self) -> tuple[str, ...]:
        return () if self.asked == "weights" else ("source", "engine")


class HuggingFaceAdapter(Adapter):
    """Streams the attention of a ``transformers`` model: a causal LM, or a bidirectional encoder
    (BERT, MiniLM: every real token sees every real token of its window; the adapter passes the
    attention mask that hides the padding of shorter windows).

    Args:
        model: a ``PreTrainedModel`` (e.g. ``AutoModelForCausalLM``, ``AutoModel`` for an
            encoder), any attention implementation.
        tokenizer: its tokenizer, if strings are to be run.
        pattern_source: ``"auto"``, ``"recompute"`` or ``"weights"`` (see the module docstring).
    """

    framework = "huggingface"
    model_types = (("transformers", ("PreTrainedModel",)),)
    capabilities = frozenset({RUNS_ENCODERS})
    supported_models = "transformers.PreTrainedModel (a Hugging Face causal LM)"
    #: Last: the other frameworks' models hold a Hugging Face model inside.
    detection_order = 2

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, *, source: str, dtype: torch.dtype, device: str | torch.device) -> Any:
        """``model`` itself."""
        return model

    @classmethod
    def unwrap(cls, model: Any) -> Any | None:
        """``model`` itself, if it is a ``transformers`` model."""
        from transformers import PreTrainedModel

        return model if isinstance(model, PreTrainedModel) else None

    @property
    def has_language_model_head(self) -> bool:
        """Whether the model's class is a causal LM (``...ForCausalLM``, GPT-2's ``...LMHeadModel``); a bare
        decoder (``Gemma3TextModel``) or an encoder has no head."""
        return is_causal_lm(self.model)

    def __init__(self, model: Any, tokenizer: Any | None = None, *, pattern_source: str = "auto") -> None:
        super().__init__(model, tokenizer)
        check_choice("pattern_source", pattern_source, PATTERN_SOURCES)
        self.source = QueriesAndKeys(pattern_source)
        self.attention_modules = find_attention_modules(model)
        config = text_config(model.config)
        n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
        if n_heads is None:
            raise AttentionCaptureError(
                f"cannot tell the number of attention heads of {type(model).__name__}: its config has "
                "neither num_attention_heads nor n_head"
            )
        max_context = config_max_context(config)
        if max_context:
            max_context = min(max_context, _positions_in_table(model) or max_context)
        bidirectional = is_bidirectional(self.attention_modules)
        self._layout = AttentionLayout(
            n_layers=len(self.attention_modules),
            n_heads=int(n_heads),
            sliding_windows=(None,) * len(self.attention_modules) if bidirectional
            else layer_windows(model.config, len(self.attention_modules)),
            max_context=int(max_context) if max_context else None,
            causal=not bidirectional,
            hidden_size=int(config.hidden_size) if getattr(config, "hidden_size", None) else None,
            rotary=bool(rotary_modules(model)),
        )

    @property
    def vocab_size(self) -> int | None:
        embeddings = self.model.get_input_embeddings()
        return int(embeddings.num_embeddings) if embeddings is not None else None

    @property
    def model_name(self) -> str:
        return str(getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__)

    def info(self):  # type: ignore[override]
        info = super().info()
        info.extra["architecture"] = type(self.model).__name__
        info.extra["attn_implementation"] = self.attn_implementation()
        info.extra["pattern_source"] = self.pattern_source
        return info

    @property
    def pattern_source(self) -> str:
        """Where attention comes from, as asked (``self.source.asked``)."""
        return self.source.asked

    def attn_implementation(self) -> str | None:
        return getattr(self.model.config, "_attn_implementation", None)

    capture_fix = ("Load the model with attn_implementation='eager' "
                   "(AutoModelForCausalLM.from_pretrained(..., attn_implementation='eager')).")

    @contextlib.contextmanager
    def eager_eval(self) -> Iterator[None]:
        """Eager attention and eval mode for the run; the user's settings come back after."""
        original = self.attn_implementation()
        was_training = self.model.training
        switched = False
        try:
            if original != "eager":
                try:
                    self.model.set_attn_implementation("eager")
                    switched = True
                except Exception as error:  # noqa: BLE001 - any refusal means the same thing to the user
                    raise AttentionCaptureError(
                        f"this model runs attention {original!r}, which does not expose attention weights, "
                        f"and could not be switched to eager ({error}). " + self.capture_fix
                    ) from error
            self.model.eval()
            yield
        finally:
            if switched and original is not None:
                try:
                    self.model.set_attn_implementation(original)
                except Exception as error:  # noqa: BLE001 - e.g. flash_attention_2 flagged where flash-attn is absent
                    # The statistics are complete; failing here would throw them away.
                    warnings.warn(
                        f"could not switch the model back to attn_implementation={original!r} after the probe "
                        f"({error!s:.200}); it stays 'eager'", stacklevel=3,
                    )
            self.model.train(was_training)

    # -- statistics from queries and keys ---------------------------------------------------------
    def run_statistics(self, tokens: torch.Tensor, statistics: Any) -> None:
        """Run a batch and add its attention to ``statistics``: recomputed from queries and keys while
        the model runs its own kernel, or from eager weights (see the module docstring)."""
        lengths = statistics.batch_lengths
        if self.source.resolved() == "weights":
            # Switched here rather than by the pass's interception: a model that cannot be switched to eager is
            # refused with the fix, and one that cannot be switched back keeps its complete statistics, with a warning.
            with self.eager_eval():
                pattern_pass(self, tokens, statistics.update, lengths)
            return
        windows = self.layout.sliding_windows

        def on_call(call: AttentionCall) -> None:
            window = call.extra.get("sliding_window")
            if isinstance(window, int) and window < tokens.shape[1] and windows[call.layer] != window:
                raise AttentionCaptureError(
                    f"layer {call.layer} attends within a sliding window of {window} tokens, but its config says "
                    f"{'full causal' if windows[call.layer] is None else f'window {windows[call.layer]}'}; the "
                    "statistics would read the wrong mask. Report the architecture, or use pattern_source='weights'"
                )
            statistics.update_from_scores(call.layer, call.query, call.key, scaling=call.scaling, softcap=call.softcap)

        call_pass(self, tokens, on_call, eager=False, lengths=lengths)

    # -- the shift test: one segment block per window ----------------------------------------------
    segment_capture = ("segment-block scores recomputed from the queries and keys the model's attention function "
                       "receives (the model runs its own kernel); row normalisers over every visible key of the window")

    def check_plan(self, plan: Any) -> None:
        """:meth:`Adapter.check_plan` (:func:`~equivariance_probe.adapters.hf_binder.check_hf_plan`)."""
        check_hf_plan(self.model, plan)

    def run_plan(self, tokens: torch.Tensor, plan: Any, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        """:meth:`Adapter.run_plan` with hooks on the model's modules
        (:func:`~equivariance_probe.adapters.hf_binder.run_hf_plan`)."""
        return run_hf_plan(self.model, tokens, plan, n_heads=self.layout.n_heads, modules=self.attention_modules,
                           position_ids=position_ids, attention_mask=attention_mask)

    def check_segment_recompute(self, tokens: torch.Tensor, segment_length: int) -> dict[str, Any]:
        """Run one window ``tokens: [1, T]`` (its segment the last ``segment_length`` tokens) under eager attention
        and compare the segment block's weights recomputed from queries and keys with the model's own.

        Returns:
            ``{"max_difference", "tolerance", "tokens", "passed", "compared"}``; ``passed`` is ``None`` where the model cannot
            run eager attention (nothing to compare with).

        Raises:
            AttentionCaptureError: the weights differ by more than :func:`recompute_tolerance`: the model's attention
                is not ``softmax(mask(softcap(q·kᵀ·scaling)))`` alone (ALiBi biases, sink logits), so the shift test's
                scores would be wrong.
        """
        spans = segment_spans(torch.tensor([tokens.shape[1]]), segment_length)
        start = spans[0][0]
        differences: list[float] = []

        half = self.dtype not in (torch.float32, torch.float64)

        def on_call(call: AttentionCall) -> None:
            window = self.layout.sliding_windows[call.layer]
            if half:
                # The question is what the attention *is*, not how half-precision scores round: the block computed
                # the way eager attention computes it (scores in the model's dtype, as the first-batch check does).
                # The run's own float32 scores from the same queries and keys differ from bf16 eager weights by
                # up to 0.017 on Gemma 3 270M, which is rounding, not another attention.
                recomputed = eager_weights(call, window, self.layout.causal)[0, :, start:, start:].to(torch.float32)
            else:
                scores, normaliser, _ = segment_blocks_from_call(call, spans, window, self.layout.causal)
                recomputed = torch.exp(scores - normaliser.unsqueeze(-1))[0]
            own = call.weights[0, :, start:, start:].to(recomputed.dtype)
            differences.append(block_difference(recomputed, own, window, self.layout.causal))

        tolerance = recompute_tolerance(self.dtype)
        check: dict[str, Any] = {"tokens": int(tokens.shape[1]), "tolerance": tolerance}
        try:
            call_pass(self, tokens, on_call, eager=True, keep_weights=True)
        except (ValueError, ImportError, NotImplementedError) as error:
            return {**check, "max_difference": None, "passed": None, "reason": f"not checked: {error!s:.200}"}
        how = (f"computed as eager attention computes them (scores in {str(self.dtype).replace('torch.', '')})"
               if half else "recomputed")
        return judged_recompute_check(max(differences, default=0.0), tolerance, check["tokens"],
                                      f"the segment block's weights {how} from queries and keys against the "
                                      "model's own eager weights")
