"""Packed windows: documents concatenated with EOS and cut into windows of exactly T, with known answers.

The stream each test expects is built here independently, from the tokenizer's ids of each
document without special tokens joined by its EOS id: every document token appears once and in
order in the windows (after each window's BOS), and the windows cover the stream up to the
reported dropped tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from synthetic import WORDS, tiny_gemma3  # noqa: E402

from equivariance_probe import EquivarianceProbe, ProbeResult, load_corpus, load_model, run_study  # noqa: E402
from equivariance_probe.cli import main  # noqa: E402
from equivariance_probe.errors import EmptyCorpusError, InputError  # noqa: E402
from equivariance_probe.records.provenance import window_fingerprints  # noqa: E402
from equivariance_probe.sources.packing import (  # noqa: E402
    PackedWindows,
    pack_documents,
    pack_stream,
    special_prefix,
)

BOS, EOS = 1, 2  # the tiny word-level tokenizer's ids (tests/synthetic.py)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_folder):
    return load_model(tiny_model_folder("gemma3", 128))[1]


def _bare_tokenizer():
    """A word-level tokenizer that puts no special token before a text (as GPT-2's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<bos>": 1, "<eos>": 2, **{word: 3 + i for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")


def _documents(n: int = 5) -> list[str]:
    """Documents of different lengths (3 to 3 + 8·(n-1) words), so windows straddle boundaries."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + 8 * i)) for i in range(n)]


def _stream(tokenizer, documents: list[str]) -> list[int]:
    stream: list[int] = []
    for index, text in enumerate(documents):
        stream += ([EOS] if index else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
    return stream


@pytest.mark.parametrize("length", [2, 5, 16, 33])
def test_every_document_token_once_and_in_order(tokenizer, length):
    documents = _documents()
    windows = load_corpus(documents, pack=length, tokenizer=tokenizer)
    stream = _stream(tokenizer, documents)
    assert isinstance(windows, PackedWindows)
    assert windows.prefix == (BOS,) and windows.separator == (EOS,) and windows.protocol == "packed"
    assert windows.tokens.shape == (len(stream) // (length - 1), length) and windows.tokens.dtype == torch.long
    assert torch.all(windows.tokens[:, 0] == BOS)
    body = windows.tokens[:, 1:].reshape(-1).tolist()
    assert body == stream[: len(body)]                        # every token once, in order
    assert windows.dropped_tokens == windows.dropped_tail == len(stream) - len(body) < length - 1
    assert windows.stream_tokens == len(stream) and windows.n_documents == len(documents)
    assert windows.starts.tolist() == list(range(0, len(body), length - 1))
    assert windows.spans.tolist() == list(range(len(windows)))  # plain packing: each window its own span


def test_a_tokenizer_without_special_prefix_packs_plain_rows():
    tokenizer = _bare_tokenizer()
    documents = _documents()
    windows = pack_documents(documents, tokenizer, 7)
    stream = _stream(tokenizer, documents)
    assert special_prefix(tokenizer) == () and windows.prefix == ()
    assert windows.tokens.reshape(-1).tolist() == stream[: len(stream) // 7 * 7]


def test_spans_hold_whole_windows_and_every_length_reads_the_same_spans():
    stream = torch.arange(3, 3 + 400)  # distinct ids: positions are readable from the values
    longest, n_spans = 64, 6
    span = longest - 1
    read = {}
    for length in (8, 16, 32, 64):
        windows = pack_stream(stream[: n_spans * span], length, prefix=(BOS,), span_tokens=span)
        text = length - 1
        assert windows.n_spans == n_spans and windows.tokens.shape[1] == length
        assert len(windows) == n_spans * (span // text)
        if longest // length < length:   # floor((rT - 1)/(T - 1)) = r for r = T_max/T < T:
            assert len(windows) * length == n_spans * longest     # the same window tokens at every length
        else:                            # T = 8: floor(63/7) = 9 windows of 8 per span, not 64/8
            assert len(windows) == n_spans * 9
        for row, start, which in zip(windows.tokens, windows.starts.tolist(), windows.spans.tolist(), strict=True):
            assert row[0] == BOS and row[1:].tolist() == stream[start : start + text].tolist()
            assert start // span == which and (start + text - 1) // span == which   # never across two spans
        # Each span is read from its start, in consecutive windows; what is left is its remainder.
        for j in range(n_spans):
            body = windows.tokens[windows.spans == j, 1:].reshape(-1).tolist()
            assert body == stream[j * span : j * span + span // text * text].tolist()
        assert windows.dropped_tokens == n_spans * (span % text) and windows.dropped_tail == 0
        read[length] = set(windows.spans.tolist())
    assert all(spans == set(range(n_spans)) for spans in read.values())


def test_document_prefixes_are_the_first_tokens_of_long_documents(tokenizer):
    documents = _documents(6)          # 3, 11, 19, 27, 35, 43 words
    windows = pack_documents(documents, tokenizer, 10, protocol="document_prefixes", span_tokens=18)
    long_enough = [d for d in documents if len(d.split()) >= 18]
    assert windows.separator == () and windows.n_documents == len(long_enough) == windows.n_spans == 4
    for j, text in enumerate(long_enough):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:18]
        assert windows.tokens[windows.spans == j, 1:].reshape(-1).tolist() == ids   # two windows of 9
    # At the span's own length each window is the study's one window per document (BOS + first tokens).
    whole = pack_documents(documents, tokenizer, 19, protocol="document_prefixes", span_tokens=18)
    assert whole.tokens.tolist() == [tokenizer(t)["input_ids"][:19] for t in long_enough]


def test_refusals(tokenizer):
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        load_corpus(_documents(), pack=8)
    with pytest.raises(EmptyCorpusError, match=r"packing needs 1 span\(s\) of 999 stream tokens"):
        load_corpus(_documents(2), pack=1000, tokenizer=tokenizer)
    with pytest.raises(InputError, match="above the 1 prefix tokens"):
        pack_documents(_documents(), tokenizer, 1)
    with pytest.raises(InputError, match="shorter than one window"):
        pack_stream(torch.arange(50), 10, prefix=(BOS,), span_tokens=5)
    with pytest.raises(InputError, match="can be sliced"):
        pack_documents(_documents(), tokenizer, 8)[0]


def test_the_probe_runs_packed_windows_and_records_the_protocol(tokenizer):
    model = tiny_gemma3(max_positions=128)
    windows = load_corpus(_documents(8), pack=16, tokenizer=tokenizer)
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    packed = probe.run(windows, batch_size=3, progress=False)
    direct = probe.run(windows.tokens, batch_size=3, progress=False)
    assert packed.n_windows == len(windows) and packed.n_tokens == windows.tokens.numel()
    assert packed.query_position_r2("log", "eta2") == direct.query_position_r2("log", "eta2")
    record = packed.metadata["windows"]
    assert record["protocol"] == "packed" and record["prefix"] == [BOS] and record["separator"] == [EOS]
    assert record["starts"] == windows.starts.tolist() and record["dropped_tokens"] == windows.dropped_tokens
    assert direct.metadata["windows"]["protocol"] == "given"
    assert probe.run(_documents(2), progress=False).metadata["windows"]["protocol"] == "truncated"
    assert ProbeResult.load(packed.save(tokenizer.name_or_path + "/packed.safetensors")).metadata["windows"] == record
    # A merge keeps what each part read.
    first, second = probe.run(windows[:2], progress=False), probe.run(windows[2:4], progress=False)
    merged = (first + second).metadata["windows"]
    assert merged["protocol"] == "merged" and [p["starts"] for p in merged["parts"]] == [
        windows.starts[:2].tolist(), windows.starts[2:4].tolist()]


def test_study_and_command_line_pack(tiny_model_folder, text_corpus, tmp_path):
    folder, corpus = tiny_model_folder("gemma3", 128), text_corpus(n_docs=3, words=50)
    study = run_study(folder, corpus=corpus, n_docs=3, context_length=32, batch_size=2, baselines=(), pack=True,
                      sample_size=0, progress=False, checkpoint_dir=tmp_path / "ck", checkpoint_every=2)
    tokenizer = load_model(folder)[1]
    expected = load_corpus(corpus, pack=32, tokenizer=tokenizer)
    trained = study.trained
    assert trained.n_windows == len(expected) == 4 and trained.n_tokens == 4 * 32   # 3 × 50 words + 2 EOS = 152
    assert trained.metadata["windows"]["starts"] == expected.starts.tolist()        # not a checkpoint chunk's
    assert sorted(trained.statistics.window_fingerprints.tolist()) == sorted(window_fingerprints(expected.tokens).tolist())
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--model", folder, "--corpus", corpus, "--n-docs", "3", "--context-length",
                 "32", "--baselines", "none", "--pack", "--no-figures", "--no-progress"]) == 0
    saved = ProbeResult.load(out / "results.safetensors")
    assert saved.metadata["windows"]["protocol"] == "packed" and saved.n_windows == 4
