"""Tests of equivariance_probe.corpus: every source kind, the default corpus, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from equivariance_probe.sources.corpus import load_corpus
from equivariance_probe.sources.wikipedia import (
    DEFAULT_CORPUS,
    DEFAULT_CORPUS_LICENSE,
    DEFAULT_CORPUS_PROVENANCE,
    load_default_articles,
    wikitext_to_text,
)
from equivariance_probe.errors import EmptyCorpusError, EquivarianceProbeError, InputError

LONG = "A sentence of plain English that is long enough to count. " * 5


def test_text_file_is_one_document(tmp_path: Path) -> None:
    path = tmp_path / "doc.txt"
    path.write_text(f"  {LONG}\n\nSecond paragraph of the same document.\n", encoding="utf-8")
    docs = load_corpus(path)
    assert docs == [f"{LONG}\n\nSecond paragraph of the same document.".strip()]


def test_text_file_with_separator(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("first document\f second document \f\f", encoding="utf-8")
    assert load_corpus(str(path), separator="\f") == ["first document", "second document"]


def test_folder_of_txt_files_sorted_recursive(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("bravo", encoding="utf-8")
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("charlie", encoding="utf-8")
    (tmp_path / "notes.md").write_text("not a .txt file", encoding="utf-8")
    assert load_corpus(tmp_path) == ["alpha", "bravo", "charlie"]
    assert load_corpus(tmp_path, n_docs=2) == ["alpha", "bravo"]


def test_jsonl_field_and_filters(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    rows = [{"body": "short"}, {"body": LONG}, {"body": None}, {"body": "  "}, {"body": LONG + "!"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_corpus(path, text_field="body") == ["short", LONG.strip(), (LONG + "!").strip()]
    assert load_corpus(path, text_field="body", min_chars=100) == [LONG.strip(), (LONG + "!").strip()]
    assert load_corpus(path, text_field="body", min_chars=100, n_docs=1) == [LONG.strip()]


def test_jsonl_missing_field_and_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"no field 'text'.*text_field="):
        load_corpus(path)
    path.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"line 1, is not valid JSON"):
        load_corpus(path)


def test_datasets_objects_and_save_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    texts = ["first document " * 3, "second document " * 3, "third document " * 3]
    dataset = datasets.Dataset.from_dict({"text": texts, "id": [0, 1, 2]})
    expected = [t.strip() for t in texts]
    assert load_corpus(dataset) == expected

    splits = datasets.DatasetDict({"train": dataset, "test": dataset.select([2])})
    assert load_corpus(splits) == expected
    assert load_corpus(splits, split="test") == [expected[2]]
    with pytest.raises(InputError, match=r"splits \['train', 'test'\], not 'validation'"):
        load_corpus(splits, split="validation")
    with pytest.raises(InputError, match=r"no column 'body'.*\['text', 'id'\]"):
        load_corpus(dataset, text_field="body")

    # Saved with save_to_disk and read back from the path, as a user's local dataset would be.
    dataset.save_to_disk(str(tmp_path / "saved"))
    assert load_corpus(tmp_path / "saved") == expected
    splits.save_to_disk(str(tmp_path / "saved_dict"))
    assert load_corpus(str(tmp_path / "saved_dict"), split="test") == [expected[2]]
    assert load_corpus(tmp_path / "saved_dict", n_docs=2) == expected[:2]

    single = datasets.DatasetDict({"validation": dataset})
    assert load_corpus(single) == expected  # split=None takes the only split


def test_sequence_of_strings() -> None:
    assert load_corpus(["a", "", " b "]) == ["a", "b"]
    with pytest.raises(InputError, match=r"must hold strings.*\['int'\]"):
        load_corpus(["a", 3])


def test_empty_corpus_errors_name_source_and_fix(tmp_path: Path) -> None:
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(EmptyCorpusError, match=r"folder .*empty.*holds no documents.*source="):
        load_corpus(empty_dir)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(EmptyCorpusError, match=r"text file .*blank\.txt.*at least 1 characters"):
        load_corpus(blank)
    with pytest.raises(EmptyCorpusError, match=r"none of its 2 documents has at least 1000 .*lower min_chars"):
        load_corpus(["short", "also short"], min_chars=1000)
    with pytest.raises(EquivarianceProbeError, match=r"neither 'gensim-enwiki' nor an existing file"):
        load_corpus(tmp_path / "missing.txt")


@pytest.mark.parametrize("bad", [{"n_docs": 0}, {"n_docs": 1.5}, {"min_chars": -1}, {"separator": ""}])
def test_bad_arguments(bad: dict) -> None:
    with pytest.raises(InputError, match=next(iter(bad))):
        load_corpus(["document"], **bad)


def test_wikitext_to_text_strips_markup() -> None:
    source = (
        "{{Infobox|name={{nested|x}}}}\n"
        "'''Albedo''' ({{IPAc-en|a}}) is the [[diffuse reflection|diffuse reflectivity]] of a "
        "[[surface]]s.<ref name=a>{{cite web|url=http://x}}</ref><!-- hidden -->\n"
        "[[File:Snow.jpg|thumb|A [[snow]] field]]\n"
        "== Terrestrial albedo ==\n"
        "{| class=wikitable\n| snow || 0.8\n|}\n"
        "* Fresh snow&nbsp;reflects [http://example.org most] light.<br/>Ocean less.\n"
        "== References ==\n"
        "* everything below is dropped\n"
        "[[Category:Climatology]]\n"
    )
    assert wikitext_to_text(source) == (
        "Albedo is the diffuse reflectivity of a surfaces.\n\n"
        "Terrestrial albedo\n\n"
        "Fresh snow reflects most light. Ocean less."
    )


def test_default_corpus_is_long_english_prose() -> None:
    articles = load_default_articles()
    assert len(articles) == 106
    titles = [title for title, _ in articles]
    assert titles[:3] == ["Anarchism", "Autism", "Albedo"]
    docs = load_corpus()
    assert docs == [text for _, text in articles]
    assert load_corpus(DEFAULT_CORPUS) == docs
    # Long enough for 1024-token windows (about 4 characters per token in English).
    long_docs = load_corpus(min_chars=8_000)
    assert len(long_docs) >= 70
    for doc in docs:
        for markup in ("{{", "}}", "[[", "]]", "<ref", "'''", "&nbsp;"):
            assert markup not in doc
    # English prose: the commonest words are everywhere.
    words = " ".join(docs).lower().split()
    assert len(words) > 400_000
    for common in ("the", "of", "and", "in", "is"):
        assert words.count(common) > 1_000
    assert "Wikipedia" in DEFAULT_CORPUS_PROVENANCE and "CC BY-SA 3.0" in DEFAULT_CORPUS_LICENSE
