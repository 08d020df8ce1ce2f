"""The comparison across models end to end on two tiny built models, and its refusals (fast).

The two models have different tokenizers (one token per word vs one per character), so the
same text gives them very different token counts: the windows must still hold exactly ``T``
tokens for each. Known answers: the all-zero baseline gives query-position R² = 1 in every
form and scale and a persistence curve equal to the prior, for every architecture.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from synthetic import tiny_gemma3, tiny_gpt2, tiny_llama  # noqa: E402

from equivariance_probe import EquivarianceProbe, ProbeResult, load_model  # noqa: E402
from equivariance_probe.cli import main  # noqa: E402
from equivariance_probe.display.comparison import save_comparison  # noqa: E402
from equivariance_probe.runs.compare import common_windows, compare_models, model_folders  # noqa: E402
from equivariance_probe.errors import EmptyCorpusError, InputError, InsufficientMemoryError  # noqa: E402
from equivariance_probe.maths.metrics import FORMS, SCALES  # noqa: E402
from equivariance_probe.sources.resources import (  # noqa: E402
    ACTIVATION_WIDTHS,
    BASE_BYTES,
    ModelSize,
    PeakMemory,
    count_parameters,
    estimate_memory,
    model_size,
)

T = 24  # tokens per window


def _char_tokenizer():
    """One token per character (plus BOS): several times the word-level tokenizer's count."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<bos>": 1, "<eos>": 2}
    for char in "abcdefghijklmnopqrstuvwxyz0123456789 ":
        vocab[char] = len(vocab)
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<bos>", eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_folder, text_corpus):
    """A tiny Gemma 3 with a word-level tokenizer and a tiny Llama with a character-level one, on disk."""
    root = tmp_path_factory.mktemp("compare")
    gemma = tiny_model_folder("gemma3", 64)
    llama = root / "llama"
    tiny_llama(seed=3).save_pretrained(llama)
    _char_tokenizer().save_pretrained(llama)
    corpus = text_corpus(n_docs=4, words=60)
    return root, gemma, str(llama), corpus


def test_common_windows_give_every_tokenizer_at_least_t_tokens(tiny):
    _, gemma, llama, corpus = tiny
    from equivariance_probe.sources.corpus import load_corpus
    from equivariance_probe.sources.models import load_tokenizer

    toks = {"words": load_tokenizer(gemma), "chars": load_tokenizer(llama)}
    docs = load_corpus(corpus)
    windows = common_windows(docs, toks, T, n_docs=3)
    assert len(windows) == 3
    for window, doc in zip(windows, docs, strict=False):
        assert doc.startswith(window)
        counts = {name: len(tok(window)["input_ids"]) for name, tok in toks.items()}
        assert min(counts.values()) >= T
        # The cut is as short as the slower tokenizer needs: the word-level one (T words) sets it,
        # so the character tokenizer gets several times T.
        assert counts["words"] < T + 3 and counts["chars"] > 2 * T
    with pytest.raises(EmptyCorpusError, match=r"only 4 documents .* at least 24 tokens .* n_docs=5"):
        common_windows(docs, toks, T, n_docs=5)
    with pytest.raises(EmptyCorpusError, match=r"only 0 documents"):
        common_windows(docs, toks, 10_000, n_docs=1)


def test_compare_two_tiny_models_end_to_end(tiny, tmp_path):
    _, gemma, llama, corpus = tiny
    comparison = compare_models({"gemma": gemma, "llama": llama}, corpus=corpus, n_docs=3, context_length=T,
                                batch_size=2, baselines=("random_init", "zero"), progress=False)
    rows = comparison.rows()
    assert [(r["model"], r["variant"]) for r in rows] == [
        (m, v) for m in ("gemma", "llama") for v in ("trained", "random_init", "zero")]
    for row in rows:
        assert (row["windows"], row["tokens"]) == (3, 3 * T)  # same windows, exactly T tokens each
        assert row["windows_per_minute"] > 0 and row["seconds"] > 0
        assert row["peak_memory_gib"] is None or row["peak_memory_gib"] > 0
    # Known answer: every head of an all-zero model is uniform, whatever the architecture.
    for row in (r for r in rows if r["variant"] == "zero"):
        for scale in SCALES:
            for form in FORMS:
                assert row[f"{scale}_{form}"] == pytest.approx(1.0, abs=1e-9), (row["model"], scale, form)
        assert row["persistence_prior_r2"] == pytest.approx(1.0, abs=1e-9)
    assert (rows[0]["n_layers"], rows[0]["n_heads"]) == (3, 4) and (rows[3]["n_layers"], rows[3]["n_heads"]) == (2, 4)
    assert rows[3]["n_parameters"] == count_parameters(tiny_llama())

    # The table reports what the probe measures on those windows (no parallel computation), with the
    # model running the kernel the comparison loads it with.
    model, tokenizer = load_model(llama, attn_implementation="sdpa")
    from equivariance_probe.sources.corpus import load_corpus

    texts = common_windows(load_corpus(corpus), {"g": load_model(gemma)[1], "l": tokenizer}, T, 3)
    direct = EquivarianceProbe(model, tokenizer=tokenizer).run(texts, context_length=T, progress=False)
    assert rows[3]["log_eta2"] == pytest.approx(direct.query_position_r2("log", "eta2"), rel=1e-12)
    assert rows[3]["toeplitz_r2"] == pytest.approx(float(direct.toeplitz_r2(estimator="per_doc").mean()), rel=1e-12)

    paths = save_comparison(comparison, tmp_path)
    with paths["csv"].open() as stream:
        table = list(csv.DictReader(stream))
    assert len(table) == 6 and float(table[0]["log_eta2"]) == pytest.approx(rows[0]["log_eta2"])
    saved = json.loads(paths["json"].read_text())
    assert saved["config"]["arguments"]["context_length"] == T and len(saved["rows"]) == 6
    markdown = paths["markdown"].read_text()
    assert "| QPVE log | eta2 |" in markdown and "windows per minute" in markdown and "3 / 72" in markdown
    assert paths["figure"].stat().st_size > 10_000
    reloaded = ProbeResult.load(tmp_path / "models" / "llama" / "results.safetensors")
    assert reloaded.query_position_r2("log", "eta2") == pytest.approx(rows[3]["log_eta2"], rel=1e-12)


def test_compare_accepts_loaded_models_and_refuses_what_does_not_fit(tiny):
    _, gemma, llama, corpus = tiny
    loaded = load_model(llama)
    with pytest.raises(InsufficientMemoryError, match=r"not enough memory for \['gemma', 'llama'\].*GiB = weights"):
        compare_models({"gemma": gemma, "llama": loaded}, corpus=corpus, n_docs=1, context_length=T,
                       memory_limit=1, progress=False)
    with pytest.raises(InputError, match="unknown baselines"):
        compare_models({"llama": loaded}, corpus=corpus, baselines=("shuffled",))
    with pytest.raises(InputError, match="context_length must be a positive integer"):
        compare_models({"llama": loaded}, corpus=corpus, context_length=0)
    comparison = compare_models({"llama": loaded}, corpus=corpus, n_docs=2, context_length=T, baselines=(),
                                progress=False)
    assert [r["variant"] for r in comparison.rows()] == ["trained"]


def test_compare_command(tiny, tmp_path, capsys):
    _, gemma, llama, corpus = tiny
    out = tmp_path / "out"
    arguments = ["compare", "--out", str(out), "--models", f"{gemma},{llama}", "--corpus", corpus,
                 "--n-docs", "2", "--context-length", str(T), "--no-progress"]
    assert main(arguments) == 0
    assert "| QPVE raw | prior |" in capsys.readouterr().out
    for name in ("comparison.md", "comparison.csv", "comparison.json", "comparison.png", "comparison.html"):
        assert (out / name).stat().st_size > 0
    # each model's report shows its trained weights beside its baseline, named as given
    page = (out / "comparison.html").read_text()
    folders = json.loads((out / "comparison.json").read_text())["folders"]
    assert folders == model_folders([gemma, llama])  # the mapping from labels to folders is recorded
    for model in (gemma, llama):
        folder = folders[model]
        assert f'href="models/{folder}/report.html"' in page
        report = (out / "models" / folder / "report.html").read_text()
        assert "<th>trained</th><th>random_init</th>" in report and f"Equivariance probe: {model}" in report
    assert main(arguments + ["--memory-limit-gib", "0.001"]) == 2
    assert "not enough memory" in capsys.readouterr().err


def test_memory_estimate_follows_the_engine_and_peak():
    estimate = estimate_memory(n_parameters=1000, n_heads=4, n_layers=3, hidden_size=32, intermediate_size=64,
                               attention_width=32, mask_kinds=2, context_length=8192, batch_size=2, copies=2,
                               block_memory=2**20)
    tokens = 2 * 8192
    assert estimate.weights == 1000 * 4 * 2
    widths = ACTIVATION_WIDTHS["hidden"] * 32 + ACTIVATION_WIDTHS["intermediate"] * 64 + ACTIVATION_WIDTHS["attention"] * 32
    assert estimate.activations == int(tokens * 4 * widths)
    assert estimate.attention == 2 * tokens * 8192 + max(2**20, 2 * 4 * 8192 * 96)   # masks + one query block
    assert estimate.statistics == 8 * (6 * 3 * 4 * 8192 * 3 + 2 * 3 * 8192 + 3 * 64 * 8192)
    assert estimate.base == BASE_BYTES
    assert estimate.total == (estimate.weights + estimate.activations + estimate.attention + estimate.statistics
                              + estimate.base)
    # Grows with B·T, and with B·T² only by the masks' byte per pair: no B·H·T² weights any more.
    longer = estimate_memory(n_parameters=1000, n_heads=4, n_layers=3, hidden_size=32, intermediate_size=64,
                             attention_width=32, mask_kinds=2, context_length=16384, batch_size=1, copies=2,
                             block_memory=2**20)
    assert longer.attention - estimate.attention == 2 * 16384**2 - 2 * 2 * 8192**2
    kept = estimate_memory(n_parameters=1000, n_heads=4, n_layers=3, context_length=64, batch_size=1, keep_pattern=True)
    assert kept.statistics - estimate_memory(n_parameters=1000, n_heads=4, n_layers=3, context_length=64,
                                             batch_size=1).statistics == 8 * 3 * 4 * 64 * 64
    assert "GiB = weights" in estimate.describe()
    # What the estimate reads of a model: from its config (nothing loaded) as from the model itself.
    gemma = tiny_gemma3()
    assert model_size(gemma.config) == model_size(gemma) == ModelSize(
        n_parameters=count_parameters(gemma), n_layers=3, n_heads=4, hidden_size=32, intermediate_size=64,
        attention_width=4 * 8, max_context=128, mask_kinds=2)
    gpt2 = model_size(tiny_gpt2())
    assert (gpt2.intermediate_size, gpt2.attention_width, gpt2.max_context, gpt2.mask_kinds) == (4 * 32, 32, 64, 1)
    # Counting on the meta device (no weights allocated) gives the built model's count.
    model = tiny_gpt2()
    assert count_parameters(model.config) == count_parameters(model) == sum(p.numel() for p in model.parameters())
    with PeakMemory() as peak:
        block = torch.ones(2**25, dtype=torch.float64)  # 256 MiB, every page written
        del block
    assert peak.bytes is not None and peak.bytes >= 2**28

