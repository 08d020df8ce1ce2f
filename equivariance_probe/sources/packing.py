"""Packed windows: documents concatenated into one token stream and cut into windows of exactly ``T``.

Place in the seams: *sources*, beside the corpus (:mod:`~equivariance_probe.sources.corpus`, whose
``load_corpus(..., pack=T, tokenizer=...)`` calls :func:`pack_documents`). It turns documents into a
:class:`PackedWindows`: a LongTensor ``[n_windows, T]`` that :meth:`EquivarianceProbe.run
<equivariance_probe.probe.EquivarianceProbe.run>` accepts like any token tensor, plus the
description the run records in ``metadata["windows"]``. It imports torch only; the tokenizer is
whatever object the caller passes.

The protocol, as TransformerLens' ``tokenize_and_concatenate`` does it:

* each document is tokenised **without** its special tokens, and documents are joined with the
  tokenizer's **EOS** token between them (none after the last): the *stream*;
* each window holds ``c = T - len(prefix)`` consecutive stream tokens after the tokenizer's
  **special prefix**, the tokens it puts before any text (``[BOS]`` for Gemma and Llama, nothing
  for GPT-2), so that position 0 keeps the role it has in one window per document (Gemma's BOS is
  an attention sink for many heads). TransformerLens prepends BOS whenever ``add_bos_token=True``,
  also for tokenizers that never add one; here the tokenizer decides;
* the stream's tail that does not fill a window is dropped (and counted).

Spans, for comparisons between context lengths: the stream is read in *spans* of ``S`` tokens, and
each span is cut on its own into ``floor(S / c)`` windows, the last ``S mod c`` tokens of a span
being dropped; so no window straddles two spans. :func:`pack_documents` uses spans of one window
each (``S = c``: plain packing). A context-length scan (:mod:`equivariance_probe.runs.scan`) uses
the spans of its longest length ``T_max`` at every length ``T``: ``S = T_max - len(prefix)``, and
with powers of two each span gives ``T_max / T`` windows (``floor((rT - 1)/(T - 1)) = r`` for
``r = T_max/T < T``), so every length reads the same spans, ``n_spans · T_max`` window tokens in
all, and :attr:`PackedWindows.spans` says which span (= which window of the longest length) each
window lies in: the key that pairs windows of different lengths by the text they read.

Two ways to make the stream (``protocol``):

* ``"packed"`` — the EOS-separated concatenation above; windows may hold a document boundary.
* ``"document_prefixes"`` — the first ``S`` text tokens of each document that has that many, one
  span per document, no separator: at the longest length each window is exactly the study's one
  window per document (special prefix + first ``T_max - len(prefix)`` tokens); shorter windows cut
  that same prefix into consecutive pieces, each after the special prefix.

Example:
    >>> from equivariance_probe import load_corpus, load_tokenizer
    >>> tokenizer = load_tokenizer("gemma-3-270m")
    >>> windows = load_corpus(n_docs=4, pack=1024, tokenizer=tokenizer)
    >>> windows.tokens.shape, windows.prefix, windows.separator     # doctest: +SKIP
    (torch.Size([21, 1024]), (2,), (1,))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.base import token_ids
from ..errors import EmptyCorpusError, InputError, check_choice, check_integer, option

__all__ = [
    "PackedWindows",
    "PROTOCOLS",
    "pack_documents",
    "pack_stream",
    "token_stream",
    "special_prefix",
    "first_token_record",
    "merged_first_token",
    "document_separator",
    "windows_record",
    "merged_windows_record",
]

#: How a stream is made from documents (see the module docstring).
PROTOCOLS = ("packed", "document_prefixes")


@dataclass(frozen=True)
class PackedWindows:
    """Windows of exactly ``T`` tokens cut from one token stream, and how they were cut.

    Attributes:
        tokens: ``[n_windows, T]`` int64: ``prefix`` then ``c = T - len(prefix)`` stream tokens.
        starts: ``[n_windows]`` int64: offset in the stream of each window's first stream token
            (window ``i`` holds ``stream[starts[i] : starts[i] + c]``).
        spans: ``[n_windows]`` int64: the span ``starts[i] // span_tokens`` the window lies in.
        context_length: ``T``.
        prefix: special tokens put before each window's stream tokens (``(bos,)`` or ``()``).
        separator: tokens between documents in the stream (``(eos,)``; ``()`` for ``document_prefixes``).
        protocol: ``"packed"`` or ``"document_prefixes"``.
        n_documents: documents with at least one token in the stream.
        stream_tokens: tokens of the stream.
        span_tokens: ``S``, stream tokens per span.
        n_spans: complete spans in the stream (``stream_tokens // S``).

    Behaves as the token tensor where one is expected: ``len(windows)`` windows, ``windows[a:b]``
    the windows ``a..b-1`` with their starts and spans (the stream's counts are kept).
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    spans: torch.Tensor
    context_length: int
    prefix: tuple[int, ...]
    separator: tuple[int, ...]
    protocol: str
    n_documents: int
    stream_tokens: int
    span_tokens: int
    n_spans: int

    @property
    def n_windows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def text_tokens(self) -> int:
        """Stream tokens inside windows: ``n_windows · (T - len(prefix))``."""
        return self.n_windows * (self.context_length - len(self.prefix))

    @property
    def dropped_tokens(self) -> int:
        """Stream tokens in no window: the remainders of the spans plus the tail after the last span."""
        return self.stream_tokens - self.text_tokens

    @property
    def dropped_tail(self) -> int:
        """Stream tokens after the last complete span (the end of the stream that fills no span)."""
        return self.stream_tokens - self.n_spans * self.span_tokens

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, index: slice) -> PackedWindows:
        if not isinstance(index, slice):
            raise InputError(f"PackedWindows can be sliced (windows[a:b]), not indexed with {index!r}; "
                             "use windows.tokens[i] for one window's token ids")
        return PackedWindows(self.tokens[index], self.starts[index], self.spans[index], self.context_length,
                             self.prefix, self.separator, self.protocol, self.n_documents, self.stream_tokens,
                             self.span_tokens, self.n_spans)

    def describe(self) -> dict[str, Any]:
        """The JSON record a run keeps in ``metadata["windows"]`` (:func:`windows_record`)."""
        return {
            "protocol": self.protocol,
            "context_length": self.context_length,
            "prefix": list(self.prefix),
            "separator": list(self.separator),
            "n_documents": self.n_documents,
            "stream_tokens": self.stream_tokens,
            "span_tokens": self.span_tokens,
            "n_spans": self.n_spans,
            "n_windows": self.n_windows,
            "text_tokens": self.text_tokens,
            "dropped_tokens": self.dropped_tokens,
            "dropped_tail": self.dropped_tail,
            "starts": self.starts.tolist(),
            "spans": self.spans.tolist(),
        }

    def __repr__(self) -> str:
        return (f"PackedWindows({self.protocol}: {self.n_windows} windows × {self.context_length} tokens, prefix "
                f"{list(self.prefix)}, separator {list(self.separator)}, {self.n_documents} documents, "
                f"{self.stream_tokens} stream tokens in {self.n_spans} spans of {self.span_tokens}, "
                f"{self.dropped_tokens} dropped)")


# -- the tokenizer's special tokens ----------------------------------------------------------------
def special_prefix(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens ``tokenizer`` puts before a text (``(bos,)`` for Gemma and Llama, ``()`` for GPT-2).

    Read from the tokenizer itself: the ids it gives a text with its special tokens, up to where
    the ids of the same text without them begin.
    """
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    for cut in range(len(with_special) - len(bare) + 1):
        if with_special[cut : cut + len(bare)] == bare:
            return tuple(int(i) for i in with_special[:cut])
    return ()


#: How many of the most common first tokens :func:`first_token_record` keeps.
FIRST_TOKEN_IDS = 8


def first_token_record(counts: Mapping[int, int], tokenizer: Any = None) -> dict[str, Any]:
    """What the windows' first token was (the attention-sink numbers read the weight on it), as a run records it
    in ``metadata["first_token"]``.

    Args:
        counts: ``{token id: windows starting with it}``.
        tokenizer: the model's tokenizer, to name the token (``None``: ids only).

    Returns:
        ``ids`` (the :data:`FIRST_TOKEN_IDS` most common ``{id: windows}``, ids as strings for JSON),
        ``distinct`` (how many ids), ``bos`` (the tokenizer's BOS id, or ``None``), ``text``: the tokenizer's
        BOS where every window starts with it (Gemma, Llama: the special prefix of
        :func:`special_prefix`), one named token where every window starts with the same other token,
        else the first text token of each window (GPT-2, which puts nothing before a text).
    """
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    common = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    record: dict[str, Any] = {"ids": {str(i): int(n) for i, n in common[:FIRST_TOKEN_IDS]}, "distinct": len(counts),
                              "bos": None if bos is None else int(bos)}
    if len(counts) == 1:
        token = common[0][0]
        name = _token_name(tokenizer, token)
        kind = "the tokenizer's BOS token" if bos is not None and int(token) == int(bos) else "the token"
        record["text"] = f"{kind} {name} (id {token}) at position 0 of every window"
    elif counts:
        record["text"] = (f"the first text token of each window ({len(counts)} distinct ids; no special token is "
                          "put before the text)")
    else:
        record["text"] = "no window"
    return record


def merged_first_token(mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``metadata["first_token"]`` of a merge: one record when both parts started every window with the same token,
    else the first text token of each window, with both parts' most common ids added up (``distinct`` then
    counts at least as many ids as either part had)."""
    if theirs is None or mine is None:
        return mine if theirs is None else theirs
    counts: dict[int, int] = {}
    for record in (mine, theirs):
        for token, windows in record.get("ids", {}).items():
            counts[int(token)] = counts.get(int(token), 0) + int(windows)
    if len(counts) == 1 and mine.get("distinct") == theirs.get("distinct") == 1:
        return {**mine, "ids": {str(token): windows for token, windows in counts.items()}}
    distinct = max(len(counts), int(mine.get("distinct", 0)), int(theirs.get("distinct", 0)))
    common = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:FIRST_TOKEN_IDS]
    return {"ids": {str(token): windows for token, windows in common}, "distinct": distinct, "bos": mine.get("bos"),
            "text": f"the first text token of each window (at least {distinct} distinct ids over the merged parts)"}


def _token_name(tokenizer: Any, token: int) -> str:
    """``'<bos>'``: how the tokenizer spells a token id (``'?'`` without one)."""
    try:
        return repr(str(tokenizer.convert_ids_to_tokens(int(token))))
    except Exception:  # noqa: BLE001 - any tokenizer (or none) that cannot name it: the id alone says enough
        return "'?'"


def document_separator(tokenizer: Any) -> tuple[int, ...]:
    """``(eos,)``: the token put between documents in a packed stream.

    Raises:
        InputError: the tokenizer has no EOS token.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise InputError(
            f"this {type(tokenizer).__name__} has no EOS token to put between packed documents; set one "
            "(tokenizer.eos_token = ...), or pass separator=[id] to pack_documents"
        )
    return (int(eos),)


# -- streams and windows ---------------------------------------------------------------------------
def _encode(tokenizer: Any, text: str) -> list[int]:
    return token_ids(tokenizer, text, add_special_tokens=False)


def token_stream(
    documents: Iterable[str],
    tokenizer: Any,
    *,
    protocol: str = "packed",
    separator: Sequence[int] = (),
    span_tokens: int | None = None,
    max_tokens: int | None = None,
) -> tuple[list[int], int]:
    """The stream of a corpus: ``(token ids, documents with a token in it)``.

    ``"packed"``: every document's ids (no special tokens), ``separator`` between documents.
    ``"document_prefixes"``: the first ``span_tokens`` ids of each document that has that many
    (shorter documents are skipped), nothing between them. Documents are tokenised one at a time
    and only until ``max_tokens`` stream tokens are reached (the stream is cut there).
    """
    check_choice("protocol", protocol, PROTOCOLS)
    if protocol == "document_prefixes" and (span_tokens is None or span_tokens < 1):
        raise InputError(f"the document_prefixes protocol needs span_tokens >= 1 (tokens per document), got {span_tokens!r}")
    stream: list[int] = []
    used = 0
    for text in documents:
        if max_tokens is not None and len(stream) >= max_tokens:
            break
        ids = _encode(tokenizer, text)
        if not ids or (protocol == "document_prefixes" and len(ids) < span_tokens):
            continue
        if protocol == "document_prefixes":
            ids = ids[:span_tokens]
        elif used:
            ids = list(separator) + ids
        stream += ids
        used += 1
    if max_tokens is not None:
        del stream[max_tokens:]
    return stream, used


def pack_stream(
    stream: Sequence[int] | torch.Tensor,
    context_length: int,
    *,
    prefix: Sequence[int] = (),
    span_tokens: int | None = None,
    separator: Sequence[int] = (),
    protocol: str = "packed",
    n_documents: int = 0,
) -> PackedWindows:
    """Cut ``stream`` into windows of exactly ``context_length`` tokens, span by span.

    With ``c = T - len(prefix)``, span ``j`` is ``stream[j·S : (j+1)·S]`` and holds the windows
    ``prefix + stream[j·S + i·c : j·S + (i+1)·c]`` for ``i < floor(S / c)``.

    Args:
        stream: token ids ``[N]``.
        context_length: ``T``.
        prefix: special tokens put before each window (e.g. ``(bos,)``).
        span_tokens: ``S`` (at least ``c``); ``None``: ``c``, every window its own span.
        separator, protocol, n_documents: how the stream was made, recorded as given.

    Returns:
        :class:`PackedWindows` (possibly with no window, when the stream is shorter than a span).
    """
    prefix = tuple(int(i) for i in prefix)
    check_integer("context_length", context_length, minimum=len(prefix) + 1,
                  message=f"context_length must be an integer above the {len(prefix)} prefix tokens, got {context_length!r}")
    text = context_length - len(prefix)
    span_tokens = text if span_tokens is None else int(span_tokens)
    if span_tokens < text:
        raise InputError(f"span_tokens={span_tokens} is shorter than one window's {text} stream tokens; "
                         "spans must hold at least one window (use the longest context length's)")
    ids = torch.as_tensor(stream, dtype=torch.long).reshape(-1)
    n_spans = int(ids.numel()) // span_tokens
    per_span = span_tokens // text
    spans = torch.arange(n_spans).repeat_interleave(per_span)
    starts = spans * span_tokens + torch.arange(per_span).repeat(n_spans) * text
    body = ids[starts.unsqueeze(1) + torch.arange(text)] if starts.numel() else torch.zeros((0, text), dtype=torch.long)
    tokens = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(body.shape[0], -1), body], dim=1)
    return PackedWindows(tokens.contiguous(), starts, spans, context_length, prefix, tuple(int(i) for i in separator),
                         protocol, int(n_documents), int(ids.numel()), span_tokens, n_spans)


def pack_documents(
    documents: Iterable[str],
    tokenizer: Any,
    context_length: int,
    *,
    protocol: str = "packed",
    span_tokens: int | None = None,
    max_spans: int | None = None,
    separator: Sequence[int] | None = None,
    prefix: Sequence[int] | None = None,
) -> PackedWindows:
    """Documents as windows of exactly ``context_length`` tokens (see the module docstring).

    Args:
        documents: texts, in order.
        tokenizer: the model's Hugging Face tokenizer.
        context_length: ``T``.
        protocol: ``"packed"`` (EOS between documents; the default) or ``"document_prefixes"``.
        span_tokens: ``S``; ``None``: one window per span (``T - len(prefix)``).
        max_spans: tokenise only what fills this many spans (the rest of the corpus is not read).
        separator: tokens between documents; ``None``: the tokenizer's EOS
            (:func:`document_separator`). Not used by ``"document_prefixes"``.
        prefix: tokens before each window; ``None``: the tokenizer's own (:func:`special_prefix`).

    Raises:
        EmptyCorpusError: the documents do not fill one window (or ``max_spans`` spans).
        InputError: bad arguments, or a tokenizer without EOS for ``"packed"``.
    """
    check_choice("protocol", protocol, PROTOCOLS)
    prefix = special_prefix(tokenizer) if prefix is None else tuple(prefix)
    if protocol == "packed":
        separator = document_separator(tokenizer) if separator is None else tuple(separator)
    else:
        separator = ()
    check_integer("context_length", context_length, minimum=len(prefix) + 1,
                  message=f"context_length must be an integer above the {len(prefix)} prefix tokens, got {context_length!r}")
    span = context_length - len(prefix) if span_tokens is None else span_tokens
    check_integer("max_spans", max_spans, allow_none=True,
                  message=f"max_spans must be a positive integer or None, got {max_spans!r}")
    stream, used = token_stream(documents, tokenizer, protocol=protocol, separator=separator, span_tokens=span,
                                max_tokens=None if max_spans is None else max_spans * span)
    windows = pack_stream(stream, context_length, prefix=prefix, span_tokens=span, separator=separator,
                          protocol=protocol, n_documents=used)
    wanted = 1 if max_spans is None else max_spans
    if windows.n_spans < wanted:
        what = ("documents of at least that many tokens" if protocol == "document_prefixes"
                else "tokens in the whole corpus, EOS separators included")
        raise EmptyCorpusError(
            f"packing needs {wanted} span(s) of {span} stream tokens but the corpus gives {windows.n_spans} "
            f"({len(stream)} {what}); pass more or longer documents, or ask for fewer tokens or a shorter "
            f"{option('context_length')}"
        )
    return windows


# -- what a run records ------------------------------------------------------------------------------
#: ``metadata["windows"]["protocol"]`` of runs whose windows were not packed here.
_UNPACKED = {
    "truncated": "one window per document: each string tokenised with its special tokens and truncated to its "
                 "first context_length tokens (token tensors used as given)",
    "given": "token rows used as given, one window per row",
}


def windows_record(docs: Any) -> dict[str, Any]:
    """``metadata["windows"]`` of a run over ``docs``: the packing's description for
    :class:`PackedWindows`, else which unpacked protocol the probe applies."""
    if isinstance(docs, PackedWindows):
        return docs.describe()
    if isinstance(docs, torch.Tensor) or hasattr(docs, "keys"):
        return {"protocol": "given", "description": _UNPACKED["given"]}
    return {"protocol": "truncated", "description": _UNPACKED["truncated"]}


def merged_windows_record(mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``metadata["windows"]`` of a merge: one record when both parts have the same, else both parts."""
    if mine == theirs:
        return mine
    parts = [part for record in (mine, theirs) if record is not None
             for part in (record.get("parts", [record]) if record.get("protocol") == "merged" else [record])]
    return {"protocol": "merged", "parts": parts}
