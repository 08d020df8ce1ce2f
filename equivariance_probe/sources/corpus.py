"""Documents to run the probe on: the packaged default corpus and the user's own text.

Place in the seams: *sources*. It turns "a corpus" (nothing, a file, a folder, JSONL, a
Hugging Face ``datasets`` object or a dataset saved with ``save_to_disk``) into a plain
``list[str]`` of documents; tokenisation and windowing belong to the probe, except that
``pack=T`` returns the documents packed into windows of exactly ``T`` tokens
(:mod:`~equivariance_probe.sources.packing`). It imports no
model framework; ``datasets`` is imported only when a saved dataset is loaded from disk. The
default corpus (full English Wikipedia articles from gensim's test data) is read by
:mod:`~equivariance_probe.sources.wikipedia`.

Example:
    >>> from equivariance_probe import load_corpus
    >>> docs = load_corpus(n_docs=8, min_chars=20_000)   # the default corpus
    >>> docs = load_corpus("my_texts/")                  # one document per .txt file
    >>> docs = load_corpus("data.jsonl", text_field="body")
    >>> windows = load_corpus(pack=1024, tokenizer=tokenizer)   # PackedWindows [n, 1024], EOS between documents
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import EmptyCorpusError, InputError, check_integer, option
from .packing import PackedWindows, pack_documents
from .wikipedia import DEFAULT_CORPUS, load_default_articles

__all__ = ["load_corpus"]


"""Name of the default corpus, accepted by :func:`load_corpus` as ``source``."""


def _is_datasets_object(obj: object) -> bool:
    """Whether ``obj`` is a Hugging Face ``datasets`` object, without importing ``datasets``."""
    return any(cls.__module__.split(".")[0] == "datasets" for cls in type(obj).__mro__)


def _is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _dataset_texts(dataset: Any, *, text_field: str, split: str | None, source: str) -> Iterator[str]:
    """Texts of a ``datasets`` Dataset, IterableDataset, DatasetDict or IterableDatasetDict."""
    # DatasetDict and IterableDatasetDict are dict subclasses keyed by split name.
    if isinstance(dataset, dict):
        splits = list(dataset.keys())
        if split is None:
            split = "train" if "train" in splits or len(splits) != 1 else splits[0]
        if split not in splits:
            raise InputError(
                f"{source} has splits {splits}, not {split!r}; pass split= one of them, "
                "e.g. load_corpus(..., split=" + repr(splits[0] if splits else "train") + ")."
            )
        dataset = dataset[split]
    columns = getattr(dataset, "column_names", None)
    if columns is not None and text_field not in columns:
        raise InputError(
            f"{source} has no column {text_field!r}; its columns are {list(columns)}. "
            f"Pass {option('text_field', '...')} naming the column that holds the text."
        )
    for row in dataset:
        value = row[text_field]
        if value is not None:
            yield str(value)


def _jsonl_texts(path: Path, *, text_field: str) -> Iterator[str]:
    """Texts of a JSON Lines file, one JSON object per line."""
    with path.open(encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(
                    f"{path}, line {number}, is not valid JSON ({error.msg}); a JSONL corpus "
                    "needs one JSON object per line."
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = list(record) if isinstance(record, dict) else type(record).__name__
                raise InputError(
                    f"{path}, line {number}, has no field {text_field!r} (found {keys}); "
                    f"pass {option('text_field', '...')} naming the field that holds the text."
                )
            if record[text_field] is not None:
                yield str(record[text_field])


def _text_file_texts(path: Path, *, separator: str | None) -> Iterator[str]:
    """Texts of one plain-text file: the whole file, or its pieces between ``separator``."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if separator is None:
        yield text
    else:
        yield from text.split(separator)


def _iter_source(
    source: Any, *, text_field: str, split: str | None, separator: str | None
) -> tuple[Iterable[str], str]:
    """Dispatch a corpus source to an iterable of raw texts and a description of the source."""
    if source is None or (isinstance(source, str) and source == DEFAULT_CORPUS):
        return (text for _title, text in load_default_articles()), f"the default corpus ({DEFAULT_CORPUS})"
    if _is_datasets_object(source):
        name = f"the {type(source).__name__} passed as source"
        return _dataset_texts(source, text_field=text_field, split=split, source=name), name
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.exists():
            raise InputError(
                f"Corpus source {str(source)!r} is neither {DEFAULT_CORPUS!r} nor an existing file or "
                "folder; pass a text file, a folder of .txt files, a .jsonl file, a folder written by "
                f"datasets' save_to_disk, or {option('source', None)} for the default corpus."
            )
        if path.is_dir():
            if _is_saved_dataset(path):
                import datasets  # only here: loading a saved dataset needs the library

                dataset = datasets.load_from_disk(str(path))
                name = f"the dataset saved at {path}"
                return _dataset_texts(dataset, text_field=text_field, split=split, source=name), name
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            texts = (t for p in files for t in _text_file_texts(p, separator=separator))
            return texts, f"the folder {path} ({len(files)} .txt files)"
        if path.suffix.lower() in (".jsonl", ".ndjson"):
            return _jsonl_texts(path, text_field=text_field), f"the JSONL file {path}"
        return _text_file_texts(path, separator=separator), f"the text file {path}"
    if isinstance(source, Iterable) and not isinstance(source, (bytes, dict)):
        items = list(source)
        bad = [type(x).__name__ for x in items if not isinstance(x, str)]
        if bad:
            raise InputError(
                f"A corpus given as a sequence must hold strings, but it holds {sorted(set(bad))}; "
                "pass a list of documents as str."
            )
        return items, f"the sequence of {len(items)} strings passed as source"
    raise InputError(
        f"Cannot read a corpus from a {type(source).__name__}; pass None (the default corpus), a path "
        "(text file, folder of .txt files, .jsonl, or a save_to_disk folder), a datasets "
        "Dataset/DatasetDict, or a list of strings."
    )


def load_corpus(
    source: Any = None,
    *,
    n_docs: int | None = None,
    min_chars: int = 1,
    text_field: str = "text",
    split: str | None = None,
    separator: str | None = None,
    pack: int | None = None,
    tokenizer: Any = None,
) -> list[str] | PackedWindows:
    """Load documents as a list of strings, or packed into windows of exactly ``pack`` tokens.

    Sources:

    - ``None`` or ``"gensim-enwiki"``: the default corpus, 106 English Wikipedia articles as
      plain prose (see the module docstring and :data:`DEFAULT_CORPUS_LICENSE`).
    - a text file: **one document per file** (the whole file), because the study reads long
      windows and splitting at blank lines would yield paragraphs; pass ``separator`` (e.g.
      ``"\\n\\n\\n"`` or ``"\\f"``) to split one file into several documents.
    - a folder: every ``*.txt`` file under it (recursively, sorted by path), one document per
      file (or split by ``separator``). A folder written by ``datasets``' ``save_to_disk`` is
      recognised and loaded with ``datasets.load_from_disk`` instead.
    - a ``.jsonl`` / ``.ndjson`` file: one JSON object per line, the text in ``text_field``.
    - a Hugging Face ``datasets`` ``Dataset``, ``IterableDataset``, ``DatasetDict`` or
      ``IterableDatasetDict``: the column ``text_field`` of split ``split`` (``None``:
      ``"train"``, or the only split if there is just one).
    - a list (or any iterable) of strings, used as is.

    Documents are stripped of surrounding whitespace, those shorter than ``min_chars``
    characters are skipped, and the first ``n_docs`` that remain are returned, in order.

    With ``pack=T`` (and the model's ``tokenizer``) those documents are tokenised without their
    special tokens, joined with the tokenizer's EOS between them, and cut into windows of the
    tokenizer's special prefix (BOS for Gemma and Llama, nothing for GPT-2) plus ``T - len(prefix)``
    stream tokens; the tail that fills no window is dropped
    (:func:`~equivariance_probe.sources.packing.pack_documents`, as TransformerLens'
    ``tokenize_and_concatenate``). The default stays one window per document, cut by the probe.

    Args:
        source: Where the documents come from (see above).
        n_docs: How many documents to return at most; ``None`` for all.
        min_chars: Skip documents with fewer characters than this (after stripping).
        text_field: The field (JSONL) or column (datasets) that holds the text.
        split: The split to read from a ``DatasetDict``; ``None`` reads ``"train"``, or the
            only split of a one-split dict.
        separator: Split each text file at this string; ``None`` keeps one document per file.
        pack: Window length ``T`` to pack the documents into; ``None`` returns the documents.
        tokenizer: The model's tokenizer (required with ``pack``).

    Returns:
        The documents, in source order; with ``pack``, a
        :class:`~equivariance_probe.sources.packing.PackedWindows` (``.tokens``: ``[n_windows, T]``).

    Raises:
        EmptyCorpusError: No document is left (the source is empty, or every document is
            shorter than ``min_chars``), or the documents do not fill one packed window.
        InputError: The source cannot be read (missing path, bad JSON, missing field or split).

    Example:
        >>> docs = load_corpus(n_docs=4, min_chars=10_000)
        >>> len(docs), all(len(d) >= 10_000 for d in docs)
        (4, True)
    """
    check_integer("n_docs", n_docs, allow_none=True, message=f"n_docs must be a positive integer or None, got {n_docs!r}.")
    check_integer("min_chars", min_chars, minimum=0, message=f"min_chars must be a non-negative integer, got {min_chars!r}.")
    if separator == "":
        raise InputError("separator must be a non-empty string or None (one document per file).")
    if pack is not None and tokenizer is None:
        raise InputError(f"pack={pack!r} needs the model's tokenizer to cut windows of tokens; pass tokenizer=... "
                         "(e.g. load_tokenizer(name), or the one load_model returns)")

    texts, description = _iter_source(source, text_field=text_field, split=split, separator=separator)
    documents = _kept_documents(texts, n_docs, min_chars, description)
    if pack is not None:
        return pack_documents(documents, tokenizer, pack)
    return documents


def _kept_documents(texts: Iterable[str], n_docs: int | None, min_chars: int, description: str) -> list[str]:
    """The first ``n_docs`` texts with at least ``min_chars`` characters, stripped, in order.

    Raises:
        EmptyCorpusError: none is left, saying whether the source held nothing or only shorter texts.
    """
    documents: list[str] = []
    seen = 0
    for text in texts:
        seen += 1
        text = text.strip()
        if text and len(text) >= min_chars:
            documents.append(text)
            if n_docs is not None and len(documents) >= n_docs:
                break
    if not documents:
        if seen == 0:
            reason = "it holds no documents"
        else:
            reason = f"none of its {seen} documents has at least {max(min_chars, 1)} characters"
        raise EmptyCorpusError(
            f"The corpus from {description} is empty: {reason}. Point {option('source', '...')} at a corpus with "
            f"text in it (or {option('source', None)} for the default corpus), or lower min_chars."
        )
    return documents
