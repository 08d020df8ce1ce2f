"""The shift test's design: segments, contexts and offsets, and the windows they make.

Place in the seams: *sources*, like :mod:`~equivariance_probe.sources.packing` (whose
:func:`~equivariance_probe.sources.packing.special_prefix` reads the tokenizer's special prefix).

Window ``(g, f, s)`` = the tokenizer's special prefix (``[BOS]`` for Gemma and Llama, nothing for GPT-2)
+ the first ``s`` tokens of context ``f`` + segment ``g``: segment token ``i`` sits at position
``len(prefix) + s + i``, and the segment ends the window. Segments are ``m`` tokens of a document
tokenised without special tokens; contexts are other documents, at least as long as the largest offset.
In ``"position_ids"`` mode the window is the prefix and the segment alone, run with position ids
``s, s + 1, ...``: the position code moves and nothing else does (one "context").

In ``"text"`` mode a causal model's text cannot move without changing how much text precedes it: the
offset is position *and* amount of preceding text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..adapters.base import SegmentBatch
from ..adapters.components import EMBEDDING, block_component_names, head_component_names, parse_component
from ..errors import ContextLengthError, EmptyCorpusError, InputError, check_choice, check_integer, option
from ..statistics.groups import DEFAULT_INTERVAL_GROUPS
from ..statistics.options import Options
from .packing import special_prefix

__all__ = ["SHIFT_MODES", "ShiftGrid", "ShiftOptions", "SHIFT_FIELDS", "shift_grid", "check_shift_options",
           "default_offsets", "split_documents", "DEFAULT_SHIFT", "check_attribution", "check_attribution_layers",
           "DEFAULT_PATCH_SHIFT", "PATCH_KEYWORDS", "check_patch", "resolve_patch"]

SHIFT_MODES = ("text", "position_ids")
#: Defaults of the study: 8 segments of 64 tokens, 4 contexts, 6 offsets, windows of at most 1024 tokens.
DEFAULT_SHIFT = {"n_segments": 8, "n_contexts": 4, "segment_length": 64, "n_offsets": 6, "longest_window": 1024}
#: Defaults of a study with activation patching, which costs a forward pass per patched item per window at an
#: offset other than the reference: 2 segments, 2 contexts and 2 offsets (0 and the largest; no sides of a
#: sliding window). Gemma 3 270M with its 36 block components: 144 patched windows of 1,024 tokens at 2.6–2.7 s
#: each on 2 CPU cores, about 7 min (docs/guide/shift.md).
DEFAULT_PATCH_SHIFT = {"n_segments": 2, "n_contexts": 2, "n_offsets": 2}
#: What ``patch`` takes besides component names (:mod:`~equivariance_probe.adapters.components`), each a whole
#: item: ``"blocks"`` (each block's attention and each block's MLP, one at a time: the default), ``"heads"``
#: (every head of every layer, one at a time), ``"heads.<layer>"`` (every head of one layer) and ``"all"`` (the
#: embedding and every block's attention and MLP patched together, which makes the predictions the reference's:
#: a check that recovers 1). Components joined by ``+`` are patched together.
PATCH_KEYWORDS = ("blocks", "heads", "all")


@dataclass(frozen=True)
class ShiftGrid:
    """Segments, contexts and offsets of one shift run.

    Attributes:
        prefix: the tokenizer's special prefix.
        segments: ``[G, m]`` token ids.
        contexts: ``[F, max(offsets)]`` token ids (``[1, 0]`` in ``"position_ids"`` mode).
        offsets: sorted distinct offsets ``s``.
        mode: ``"text"`` or ``"position_ids"``.
    """

    prefix: tuple[int, ...]
    segments: torch.Tensor
    contexts: torch.Tensor
    offsets: tuple[int, ...]
    mode: str = "text"

    @property
    def segment_length(self) -> int:
        return int(self.segments.shape[1])

    @property
    def n_contexts(self) -> int:
        return int(self.contexts.shape[0])

    def window(self, segment: int, context: int, offset: int) -> tuple[list[int], int]:
        """``(token ids, first position id)`` of window ``(g, f, s)``."""
        if self.mode == "position_ids":
            return list(self.prefix) + self.segments[segment].tolist(), offset
        return list(self.prefix) + self.contexts[context, :offset].tolist() + self.segments[segment].tolist(), 0

    def longest_window(self) -> int:
        """Tokens of the longest window (positions, in ``"position_ids"`` mode)."""
        return len(self.prefix) + max(self.offsets) + self.segment_length

    def forward_passes(self) -> int:
        """Windows the grid runs: ``G · F · S``."""
        return int(self.segments.shape[0]) * self.n_contexts * len(self.offsets)

    def batch(self, segment: int, context: int, indices: Sequence[int]) -> SegmentBatch:
        """One forward pass: the right-padded windows ``(segment, context, offsets[i])`` for ``i`` in ``indices``."""
        rows, starts = zip(*(self.window(segment, context, self.offsets[i]) for i in indices))
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
        tokens = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
        for b, row in enumerate(rows):
            tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        position_start = torch.tensor(starts, dtype=torch.long) if self.mode == "position_ids" else None
        return SegmentBatch(tokens, lengths, tuple(indices), position_start)

    def batches(self, segment: int, batch_size: int) -> list[list[SegmentBatch]]:
        """Segment ``segment``'s grid as forward passes: per context, the offsets in runs of ``batch_size``."""
        n = len(self.offsets)
        return [[self.batch(segment, context, range(first, min(first + batch_size, n))) for first in range(0, n, batch_size)]
                for context in range(self.n_contexts)]

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "prefix": list(self.prefix), "n_segments": int(self.segments.shape[0]),
                "n_contexts": self.n_contexts, "segment_length": self.segment_length, "offsets": list(self.offsets),
                "windows": self.forward_passes(),
                "offset_means": "position and amount of preceding text" if self.mode == "text"
                else "position ids only (the text and what precedes it are fixed)"}


def default_offsets(max_context: int | None, prefix_length: int, segment_length: int,
                    sliding_windows: Sequence[int | None] = (), n_offsets: int = DEFAULT_SHIFT["n_offsets"],
                    longest_window: int = DEFAULT_SHIFT["longest_window"]) -> tuple[int, ...]:
    """``n_offsets`` offsets in all, from 0 to the largest a window of ``min(max_context, longest_window)`` tokens
    allows. For a model with sliding windows of width ``w`` that fits, they include ``w − m − len(prefix)`` (the
    largest offset at which every segment token still sees the prefix in a sliding layer) and ``w`` (the smallest
    at which none does), so the offsets fall on both sides of the window; the rest are evenly spaced, 0 and the
    largest among them. (Gemma 3 270M, ``m = 64``: 0, 320, 447, 512, 639, 959.)

    The count is fixed because the run keeps one next-token distribution per offset (``(m − 1)·vocab`` float32
    values each, 66 MB for Gemma 3) and pairs every two offsets of a context."""
    limit = min(max_context or longest_window, longest_window)
    largest = limit - prefix_length - segment_length
    if largest < 1:
        raise ContextLengthError(
            f"a segment of {segment_length} tokens after a prefix of {prefix_length} leaves no room to move in a "
            f"window of {limit} tokens; pass a shorter {option('segment_length')}")
    sides: set[int] = set()
    for window in {w for w in sliding_windows if w is not None}:
        inside = window - segment_length - prefix_length
        if 0 <= inside and window <= largest:
            sides |= {inside, window}
    evenly = max(2, n_offsets - len(sides))
    offsets = sides | {round(k * largest / (evenly - 1)) for k in range(evenly)}
    while len(offsets) < n_offsets and evenly <= largest:  # an evenly spaced offset fell on a side of a window
        evenly += 1
        offsets = sides | {round(k * largest / (evenly - 1)) for k in range(evenly)}
    return tuple(sorted(offsets))


def check_offsets(offsets: Any) -> tuple[int, ...]:
    """The distinct offsets, sorted, each checked as the user typed it: an integer of at least 0 (``2.5`` is
    not run as 2, nor ``True`` as 1, nor ``"4"`` as 4).

    Raises:
        InputError: naming the first offset that is not a non-negative integer, or offsets that are not a sequence.
    """
    if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Iterable):
        raise InputError(f"offsets={offsets!r} must be a list of non-negative integers; pass e.g. "
                         f"{option('offsets', [0, 256, 512])}")
    offsets = list(offsets)
    for value in offsets:
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool:
            continue
        check_integer("offsets", value, minimum=0, message=(
            f"offsets must be non-negative integers; {value!r} is not one (of {offsets!r}): pass whole numbers of "
            f"tokens, e.g. {option('offsets', [0, 256, 512])}"))
    return tuple(sorted({int(s) for s in offsets}))


def _ids(item: Any, tokenizer: Any, what: str) -> list[int]:
    if isinstance(item, str):
        if tokenizer is None:
            raise InputError(f"{what} are strings but the model has no tokenizer; pass token ids (lists of ints)")
        return list(tokenizer(item, add_special_tokens=False)["input_ids"])
    if isinstance(item, torch.Tensor):
        if item.is_floating_point() or item.is_complex() or item.dtype == torch.bool:
            raise InputError(f"{what} hold token ids as a {item.dtype} tensor; token ids are integers (a float id "
                             "would be truncated): convert with .long() where the values are whole numbers")
        if item.dim() > 1:
            raise InputError(f"each of the {what} must be a 1-D tensor of token ids, got shape {tuple(item.shape)}")
        return item.tolist()
    if isinstance(item, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return list(item)
    raise InputError(f"each of the {what} must be a string or a list/1-D tensor of token ids, got {type(item).__name__}")


def split_documents(documents: Iterable[Any], tokenizer: Any, *, n_segments: int, n_contexts: int,
                    segment_length: int, context_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Segments and contexts from one corpus, no document used as both: documents with at least
    ``context_length`` tokens (no special tokens) become contexts until there are ``n_contexts``, the others
    with at least ``segment_length`` become segments (their first ``segment_length`` tokens).

    Raises:
        EmptyCorpusError: the corpus holds too few documents long enough for ``n_segments`` segments and
            ``n_contexts`` contexts.

    Example:
        >>> segments, contexts = split_documents(load_corpus(), tokenizer, n_segments=8, n_contexts=4,
        ...                                      segment_length=64, context_length=959)  # doctest: +SKIP
    """
    segments: list[list[int]] = []
    contexts: list[list[int]] = []
    for document in documents:
        ids = _ids(document, tokenizer, "documents")
        if len(contexts) < n_contexts and len(ids) >= context_length:
            contexts.append(ids[:context_length])
        elif len(segments) < n_segments and len(ids) >= segment_length:
            segments.append(ids[:segment_length])
        if len(segments) >= n_segments and len(contexts) >= n_contexts:
            break
    if len(segments) < n_segments or len(contexts) < n_contexts:
        raise EmptyCorpusError(
            f"the corpus gave {len(segments)} segments of {segment_length} tokens and {len(contexts)} contexts of "
            f"{context_length} tokens, but {n_segments} and {n_contexts} were asked for; pass a larger {option('corpus')}, "
            f"fewer {option('n_segments')} or {option('n_contexts')}, or smaller {option('offsets')}")
    return segments, contexts


def check_shift_options(*, offsets: Sequence[int] | None, segment_length: int, mode: str = "text",
                        n_contexts: int | None = None) -> tuple[int, ...] | None:
    """Check the settings of a shift design that need no model or text; the offsets sorted, each once.

    The command line calls it before it loads a model, so that a wrong setting costs no load.

    Args:
        offsets: at least two distinct non-negative offsets, or ``None`` (the model's defaults, chosen later).
        segment_length: ``m``, at least 2.
        mode: ``"text"`` or ``"position_ids"``.
        n_contexts: how many contexts will be drawn, if known: at least two in ``"text"`` mode.

    Raises:
        InputError: a setting outside those bounds, named with its fix.
    """
    check_choice("mode", mode, SHIFT_MODES)
    if not isinstance(segment_length, int) or isinstance(segment_length, bool) or segment_length < 2:
        raise InputError(f"{option('segment_length', segment_length)} must be an integer of at least 2 (a segment's attention "
                         f"needs rows with two keys); pass {option('segment_length', 64)}")
    if mode == "text" and n_contexts is not None and n_contexts < 2:
        raise InputError(f"text mode needs at least two contexts to separate what precedes the text from where it "
                         f"sits, got {n_contexts}; pass {option('n_contexts', 4)}, or {option('mode', 'position_ids')}")
    if offsets is None:
        return None
    unique = check_offsets(offsets)
    if len(unique) < 2:
        raise InputError(f"{option('offsets', list(unique))} must hold at least two distinct non-negative offsets: with one there "
                         f"is nothing to compare; pass more through {option('offsets')}, e.g. 0, 256 and 512")
    return unique


def shift_grid(segments: Iterable[Any], contexts: Iterable[Any] | None, tokenizer: Any, *, offsets: Sequence[int],
               segment_length: int, mode: str = "text", max_context: int | None = None) -> ShiftGrid:
    """Check and tokenise a shift design.

    Args:
        segments: strings (tokenised without special tokens) or token-id lists; each gives its first
            ``segment_length`` tokens.
        contexts: likewise, each at least ``max(offsets)`` tokens (``None`` in ``"position_ids"`` mode).
        tokenizer: the model's tokenizer (its special prefix starts every window), or ``None`` for token ids
            and no prefix.
        offsets: at least two distinct non-negative offsets.
        segment_length: ``m``, at least 2.
        mode: ``"text"`` or ``"position_ids"``.
        max_context: the model's longest window, if it has one.

    Raises:
        InputError: a single offset, fewer than two contexts in ``"text"`` mode, a segment equal to a
            context, a segment shorter than ``segment_length``.
        ContextLengthError: a window longer than the model allows at the largest offset, a context shorter
            than the largest offset.
    """
    offsets = check_shift_options(offsets=offsets, segment_length=segment_length, mode=mode)
    for what, items in (("segments", segments), ("contexts", contexts)):
        if isinstance(items, (str, bytes)):  # iterating a string would move each of its characters
            raise InputError(f"{what} must be a list of texts or token-id lists, not one string; pass {what}=[{items[:20]!r}, ...]")
    prefix = special_prefix(tokenizer) if tokenizer is not None else ()
    segment_ids = []
    for index, segment in enumerate(segments):
        ids = _ids(segment, tokenizer, "segments")
        if len(ids) < segment_length:
            raise InputError(f"segment {index} has {len(ids)} tokens, fewer than {option('segment_length', segment_length)}; "
                             f"pass longer segments or a smaller {option('segment_length')}")
        segment_ids.append(ids[:segment_length])
    if len(segment_ids) < 1:
        raise EmptyCorpusError("no segments were given; pass at least one text to move")
    longest = len(prefix) + offsets[-1] + segment_length
    if max_context is not None and longest > max_context:
        raise ContextLengthError(
            f"at the largest offset {offsets[-1]} a segment of {segment_length} tokens after a prefix of {len(prefix)} "
            f"ends at position {longest - 1}, beyond this model's {max_context}-token window; pass {option('offsets')} up "
            f"to {max_context - len(prefix) - segment_length} or a shorter {option('segment_length')}")
    if mode == "position_ids":
        if contexts is not None and len(list(contexts)):
            raise InputError("position_ids mode moves the segment's position ids and runs no context; pass contexts=None")
        return ShiftGrid(prefix, torch.tensor(segment_ids), torch.zeros((1, 0), dtype=torch.long), offsets, mode)
    if contexts is None:
        raise InputError("text mode needs contexts (texts that precede the segment); pass contexts=[...], or "
                         f"{option('mode', 'position_ids')}")
    context_ids = []
    for index, context in enumerate(contexts):
        ids = _ids(context, tokenizer, "contexts")
        if len(ids) < offsets[-1]:
            raise ContextLengthError(
                f"context {index} has {len(ids)} tokens, fewer than the largest offset {offsets[-1]}; pass contexts "
                f"of at least {offsets[-1]} tokens or smaller {option('offsets')}")
        if any(ids[:segment_length] == seg or ids == seg[: len(ids)] for seg in segment_ids):
            raise InputError(f"context {index} starts with a segment's tokens: the same document would be used as "
                             "segment and context; draw segments and contexts from different documents")
        context_ids.append(ids[: offsets[-1]])
    if len(context_ids) < 2:
        raise InputError(f"text mode needs at least two contexts to separate what precedes the text from where it "
                         f"sits, got {len(context_ids)}; pass more contexts, or {option('mode', 'position_ids')}")
    return ShiftGrid(prefix, torch.tensor(segment_ids), torch.tensor(context_ids), offsets, mode)


def _patch_item_example() -> str:
    return f"{option('patch', True)} (every block's attention and MLP) or {option('patch', 'attention.3,mlp.3')}"


def check_patch(patch: Any) -> tuple[str, ...]:
    """``patch`` as a tuple of items, each checked: ``False``/``None``/empty -> ``()``, ``True`` -> ``("blocks",)``, a
    string -> its comma-separated items, a sequence -> its items. An item is one of :data:`PATCH_KEYWORDS`,
    ``"heads.<layer>"``, or component names joined by ``+``.

    Raises:
        InputError: naming the first item that is none of these, and the forms that are.
    """
    if patch is None or patch is False:
        return ()
    if patch is True:
        return ("blocks",)
    if isinstance(patch, str):
        items = [item.strip() for item in patch.split(",")]
    elif isinstance(patch, Iterable) and not isinstance(patch, (bytes, dict)):
        items = list(patch)
    else:
        raise InputError(f"patch={patch!r} must be True, False, a component name or a list of them; pass "
                         f"{_patch_item_example()}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise InputError(f"patch item {item!r} (of {patch!r}) is not a component name; pass {_patch_item_example()}")
        if item in PATCH_KEYWORDS or (item.startswith("heads.") and item[6:].isdigit()):
            continue
        for part in item.split("+"):
            try:
                parse_component(part)
            except InputError:
                raise InputError(
                    f"patch item {item!r} is not a component ('embedding', 'attention.<layer>', 'mlp.<layer>', "
                    f"'head.<layer>.<head>', several joined by '+') nor one of {list(PATCH_KEYWORDS)} or "
                    f"'heads.<layer>'; pass {_patch_item_example()}") from None
    return tuple(dict.fromkeys(items))


def resolve_patch(items: Sequence[str], n_layers: int, n_heads: int) -> tuple[str, ...]:
    """:func:`check_patch`'s items for a model of ``n_layers`` layers of ``n_heads`` query heads: the keywords
    spelled out as component names, each item once, in the order given.

    Raises:
        InputError: a layer or head the model does not have.
    """
    blocks = block_component_names(n_layers)
    out: list[str] = []
    for item in items:
        if item == "blocks":
            out += [name for name in blocks if name != EMBEDDING]
        elif item == "heads":
            out += head_component_names(range(n_layers), n_heads)
        elif item == "all":
            out.append("+".join(blocks))
        elif item.startswith("heads."):
            out += head_component_names([int(item[6:])], n_heads)
        else:
            out.append(item)
    for item in out:
        for part in item.split("+"):
            _, layer, head = parse_component(part)
            if (layer is not None and layer >= n_layers) or (head is not None and head >= n_heads):
                raise InputError(f"patch item {item!r}: the model has layers 0 to {n_layers - 1} with heads 0 to "
                                 f"{n_heads - 1}; pass components it has")
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class ShiftOptions(Options):
    """How a shift run measures: one value passed whole from the command line through the study runner
    (:func:`~equivariance_probe.runs.shift.run_shift_study`) down to :meth:`~equivariance_probe.EquivarianceProbe.shift`,
    as :class:`~equivariance_probe.probe.MeasurementOptions` is for ``run``.

    Every value is checked once, when the options are built (each by the check the rest of the package uses
    for it: ``batch_size`` as ``run`` checks it); what needs the model (offsets beyond its window, the default
    offsets) is settled once by :meth:`resolved`.

    Attributes:
        offsets: the offsets ``s``, sorted and each once (``None``: :func:`default_offsets` for the model,
            filled in by :meth:`resolved`).
        segment_length: ``m`` tokens per segment (at least 2).
        mode: ``"text"`` or ``"position_ids"``.
        batch_size: windows per forward pass (one context at several offsets). Results do not depend on it.
        predictions: measure next-token predictions (``None``: for a causal language model with its head).
        interval_groups: groups of segments for the jackknife intervals; 0 for none (as for ``run``).
        attribution: also split the residual stream's offset and context sums of squares into what each
            component writes (the embedding, every block's attention and MLP): the Gram matrices of
            :data:`~equivariance_probe.statistics.shift.ATTRIBUTION_ARRAYS`.
        attribution_heads: layers whose attention is split further into its heads (with ``attribution``); a
            head's state is as large as a block's, so heads are read only for the layers named.
        patch: activation patching (``False``: none): ``True`` for each block's attention and MLP, one at a time,
            or items as :func:`check_patch` reads them (``"attention.3,mlp.3"``, ``["heads.5"]``, ``"all"``);
            settled for the model by :meth:`resolved` (:func:`resolve_patch`: component names).
        patch_reference: the index, among the offsets, of the reference offset ``s₀`` whose outputs are patched
            into the others (default 0: the smallest).

    Example:
        >>> ShiftOptions(offsets=[512, 0, 256]).offsets
        (0, 256, 512)
    """

    offsets: tuple[int, ...] | None = None
    segment_length: int = DEFAULT_SHIFT["segment_length"]
    mode: str = "text"
    batch_size: int = 1
    predictions: bool | None = None
    interval_groups: int = DEFAULT_INTERVAL_GROUPS
    attribution: bool = False
    attribution_heads: tuple[int, ...] = ()
    patch: bool | str | tuple[str, ...] = False
    patch_reference: int = 0

    _option: ClassVar[str] = "shift option"
    _example: ClassVar[str] = "offsets=[0, 256, 512]"

    def __post_init__(self) -> None:
        offsets = check_shift_options(offsets=self.offsets, segment_length=self.segment_length, mode=self.mode)
        object.__setattr__(self, "offsets", offsets)
        check_integer("batch_size", self.batch_size)
        check_integer("interval_groups", self.interval_groups, minimum=0, message=(
            f"interval_groups must be a non-negative integer (0: no intervals), not {self.interval_groups!r}; pass e.g. "
            f"{option('interval_groups', DEFAULT_INTERVAL_GROUPS)}"))
        if self.predictions is not None and not isinstance(self.predictions, bool):
            raise InputError(f"predictions must be True, False or None (the default for the model), not {self.predictions!r}")
        object.__setattr__(self, "attribution_heads", check_attribution(self.attribution, self.attribution_heads))
        object.__setattr__(self, "patch", check_patch(self.patch))
        check_integer("patch_reference", self.patch_reference, minimum=0, message=(
            f"patch_reference must be the index of an offset (0: the smallest), not {self.patch_reference!r}; pass "
            f"e.g. {option('patch_reference', 0)}"))
        if self.patch_reference and not self.patch:  # as attribution_heads without attribution: refused alone
            raise InputError(f"{option('patch_reference', self.patch_reference)} picks the offset whose outputs are patched in, but "
                             f"nothing is patched; pass {option('patch', True)} (or components) as well, or leave "
                             f"{option('patch_reference')} out")
        if self.offsets is not None and self.patch_reference >= len(self.offsets):
            raise InputError(f"patch_reference={self.patch_reference} is not the index of one of the offsets "
                             f"{list(self.offsets)}; pass 0 to {len(self.offsets) - 1}")

    def resolved(self, layout: Any, prefix_length: int) -> ShiftOptions:
        """These options with the offsets settled for a model: given ones kept, else :func:`default_offsets` of its
        layout (``max_context``, ``sliding_windows``) after a special prefix of ``prefix_length`` tokens (with
        patching, :data:`DEFAULT_PATCH_SHIFT`'s two: 0 and the largest); and the patched items spelled out
        (:func:`resolve_patch`).

        Raises:
            ContextLengthError: the model's window leaves a segment no room to move.
            InputError: a patched layer or head the model does not have, or ``patch_reference`` beyond the offsets.
        """
        check_attribution_layers(self.attribution_heads, layout.n_layers)
        patch = resolve_patch(self.patch, layout.n_layers, layout.n_heads)
        if self.offsets is not None:
            return self.replace(patch=patch) if patch != self.patch else self
        if patch:  # the reference and the largest offset: each further offset costs a pass per patched item
            offsets = default_offsets(layout.max_context, prefix_length, self.segment_length, (),
                                      n_offsets=DEFAULT_PATCH_SHIFT["n_offsets"])
        else:
            offsets = default_offsets(layout.max_context, prefix_length, self.segment_length, layout.sliding_windows)
        return self.replace(patch=patch, offsets=offsets)


def check_attribution(attribution: Any, heads: Any) -> tuple[int, ...]:
    """The layers of ``attribution_heads``, sorted and each once, checked with ``attribution`` (a bool).

    Raises:
        InputError: ``attribution`` not a bool, a layer that is not a non-negative integer, or heads without
            attribution.
    """
    if not isinstance(attribution, bool):
        raise InputError(f"attribution must be True or False, not {attribution!r}; pass {option('attribution', True)}")
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise InputError(f"attribution_heads={heads!r} must be a list of layer indices; pass e.g. "
                         f"{option('attribution_heads', [5, 6, 7])}")
    layers = list(heads)
    for layer in layers:
        check_integer("attribution_heads", layer, minimum=0, message=(
            f"attribution_heads must be layer indices (integers of at least 0); {layer!r} is not one (of {layers!r}): "
            f"pass e.g. {option('attribution_heads', [5, 6, 7])}"))
    if layers and not attribution:
        raise InputError(f"{option('attribution_heads', layers)} splits the attribution's attention into heads, but attribution "
                         f"is off; pass {option('attribution', True)} as well")
    return tuple(sorted({int(layer) for layer in layers}))


def check_attribution_layers(layers: Sequence[int], n_layers: int) -> None:
    """Refuse attribution heads of a layer the model does not have (it has ``n_layers``)."""
    beyond = [layer for layer in layers if layer >= n_layers]
    if beyond:
        raise InputError(f"attribution_heads names layer(s) {beyond}, but the model has {n_layers} layers (0 to "
                         f"{n_layers - 1}); pass layers in that range")


#: The names of :class:`ShiftOptions`' fields, in order.
SHIFT_FIELDS: tuple[str, ...] = ShiftOptions.field_names()
