"""The bad-input survey: the inputs researchers get wrong, fed to the Python API and to
the command-line program. Each gets a specific error or a documented, correct behaviour, and no
partial result is ever written as if it were complete.

Covered (API / CLI): empty documents; documents shorter than the context; token ids outside the
vocabulary (tensors, and a tokenizer that belongs to another model); a context longer than the
model's maximum; a model in train mode with attention dropout; sdpa and flash-attention models;
left-padded batches; NaN and inf weights; truncated, edited and newer-version result files; runs
that stop half-way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from equivariance_probe import (
    AttentionCaptureError,
    ContextLengthError,
    EmptyCorpusError,
    EquivarianceProbe,
    InputError,
    NonFiniteAttentionError,
    ProbeResult,
    run_study,
)
from equivariance_probe.cli import main

from synthetic import WORDS, edited_result_file, result_header, save_tiny_model_with_tokenizer, tiny_gpt2

V2_FIXTURE = Path(__file__).parent / "data" / "result_format_v2.json"


def _equal(a: ProbeResult, b: ProbeResult, exact: bool = False, rtol: float = 1e-9) -> None:
    assert (a.n_windows, a.n_tokens) == (b.n_windows, b.n_tokens)
    for name, value in a.statistics.arrays.items():
        if exact:
            assert torch.equal(value, b.statistics.arrays[name]), name
        else:
            assert torch.allclose(value, b.statistics.arrays[name], rtol=rtol, atol=rtol), name


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_folder, text_corpus):
    return tmp_path_factory.mktemp("bad"), tiny_model_folder("gpt2", 32), text_corpus(n_docs=4, words=30)


def _cli(folders, out, *extra, model=None, corpus=None):
    root, default_model, default_corpus = folders
    return main(["run", "--out", str(out), "--model", model or default_model, "--corpus", corpus or default_corpus,
                 "--n-docs", "4", "--context-length", "16", "--baselines", "none", "--no-progress", "--no-figures",
                 "--sample-size", "0", "--batch-size", "1", *extra])


class _NoBosTokenizer:
    """One id per word, no special tokens: a one-word document has a single token."""

    pad_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + WORDS.index(w) if w in WORDS else 90 for w in text.split()]}


# ----------------------------------------------------------------- empty and short documents
def test_empty_and_one_token_documents_are_skipped_and_counted_across_checkpoint_chunks(tmp_path):
    long = [" ".join(WORDS[i:i + 9]) for i in range(4)]
    docs = ["the", "of", *long]  # the first chunk of two documents has no window at all
    options = dict(loaded=(tiny_gpt2(), _NoBosTokenizer()), context_length=16, baselines=(), sample_size=0,
                   progress=False, batch_size=2)
    study = run_study(corpus=docs, n_docs=6, checkpoint_dir=tmp_path / "ck", checkpoint_every=2, **options)
    assert study.trained.metadata["skipped_windows"] == 2 and study.trained.n_windows == 4
    _equal(study.trained, run_study(corpus=long, n_docs=4, **options).trained)
    with pytest.raises(EmptyCorpusError, match="no document of the 2 given"):
        run_study(corpus=["the", "of"], n_docs=2, checkpoint_dir=tmp_path / "ck2", checkpoint_every=1, **options)


def test_empty_corpus_on_the_command_line_exits_2_and_writes_no_results(folders, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("  \n ")
    assert _cli(folders, tmp_path / "out", corpus=str(empty)) == 2
    assert "empty" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.safetensors").exists()


def test_documents_shorter_than_the_context_count_only_their_own_positions():
    probe = EquivarianceProbe(tiny_gpt2())
    short, long = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 16))
    together = probe.run([short[0], long[0]], context_length=16, batch_size=2, progress=False)
    apart = probe.run([short[0]], context_length=16, progress=False) + probe.run([long[0]], context_length=16, progress=False)
    # float32 matrix products of a [2, 16] and a [1, 5] batch round differently: agree to float32 precision.
    _equal(together, apart, rtol=1e-5)
    assert together.n_tokens == 21
    assert together.statistics.arrays["windows_covering"].tolist() == [2.0] * 5 + [1.0] * 11


# ----------------------------------------------------------------- token ids and context
def test_token_ids_outside_the_vocabulary_are_refused():
    probe = EquivarianceProbe(tiny_gpt2())
    for bad in (torch.full((1, 8), 97), torch.full((1, 8), -1)):
        with pytest.raises(InputError, match=r"0\.\.96.*another tokenizer"):
            probe.run(bad, progress=False)
    wrong_tokenizer = EquivarianceProbe(tiny_gpt2(), tokenizer=lambda text, add_special_tokens: {"input_ids": [5, 200]})
    with pytest.raises(InputError, match="id 200.*97 ids.*does not belong to this model"):
        wrong_tokenizer.run(["some text"], context_length=8, progress=False)


def test_a_tokenizer_from_another_model_exits_2_on_the_command_line(folders, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    root, model, corpus = folders
    small = tmp_path / "small_vocab"
    save_tiny_model_with_tokenizer(small, kind="gpt2", n_positions=32)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=32)).save_pretrained(small)
    assert _cli(folders, tmp_path / "out", model=str(small)) == 2
    assert "does not belong to this model" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.safetensors").exists()


def test_a_context_longer_than_the_model_allows_is_refused(folders, tmp_path, capsys):
    probe = EquivarianceProbe(tiny_gpt2(n_positions=32))
    with pytest.raises(ContextLengthError, match="maximum context of 32"):
        probe.run(torch.zeros((1, 33), dtype=torch.long), progress=False)
    assert _cli(folders, tmp_path / "out", "--context-length", "64") == 2
    assert "maximum context of 32" in capsys.readouterr().err


# ----------------------------------------------------------------- the model's state
def test_a_model_in_train_mode_is_probed_without_dropout_and_left_in_train_mode():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=97, n_positions=32,
                                       attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5))
    tokens = torch.randint(0, 97, (3, 12))
    model.train()
    in_train_mode = EquivarianceProbe(model).run(tokens, progress=False)
    assert model.training  # the user's mode comes back
    model.eval()
    _equal(in_train_mode, EquivarianceProbe(model).run(tokens, progress=False), exact=True)


@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2"])
def test_fused_attention_models_are_switched_to_eager_for_the_run(implementation, recwarn):
    # The weights path reads eager attention weights: the model is switched to eager and back.
    tokens = torch.randint(0, 97, (2, 12))
    eager = tiny_gpt2()
    eager.set_attn_implementation("eager")
    expected = EquivarianceProbe(eager, pattern_source="weights").run(tokens, progress=False)
    fused = tiny_gpt2()
    fused.config._attn_implementation = implementation  # as loaded with attn_implementation=...
    _equal(EquivarianceProbe(fused, pattern_source="weights").run(tokens, progress=False), expected, exact=True)
    if implementation == "sdpa":
        assert fused.config._attn_implementation == "sdpa"  # switched back
    else:  # flash-attn is not installed here: the model cannot be switched back, and we say so
        assert any("stays 'eager'" in str(w.message) for w in recwarn)


def test_a_model_that_cannot_be_switched_to_eager_gets_the_fix(monkeypatch):
    model = tiny_gpt2()

    def refuse(name):
        raise ValueError("this architecture supports sdpa only")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    tokens = torch.randint(0, 97, (1, 8))
    with pytest.raises(AttentionCaptureError, match="sdpa.*could not be switched to eager.*attn_implementation='eager'"):
        EquivarianceProbe(model, pattern_source="weights").run(tokens, progress=False)
    # Recomputed from queries and keys, the model runs its own kernel: nothing to switch.
    result = EquivarianceProbe(model).run(tokens, progress=False)
    assert result.metadata["engine"]["source"] == "recompute" and model.config._attn_implementation == "sdpa"


# ----------------------------------------------------------------- padding
def test_left_padded_batches(folders):
    from transformers import AutoTokenizer

    root, model_folder, corpus = folders
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    tokenizer.pad_token = "[UNK]"  # id 0, distinct from <bos> (1) and <eos> (2)
    tokenizer.padding_side = "left"
    texts = ["the a of and to in is", "was for on", "by at from that which it his an were"]
    probe = EquivarianceProbe(tiny_gpt2(), tokenizer=tokenizer)
    expected = probe.run(texts, context_length=16, progress=False)
    encoding = tokenizer(texts, padding=True, return_tensors="pt")
    assert (encoding["input_ids"][1, :2] == 0).all()  # really left-padded
    # The tokenizer's output: padding removed by its attention_mask, every window starts at position 0.
    _equal(probe.run(encoding, context_length=16, progress=False), expected)
    # The bare ids: refused, naming the fix.
    with pytest.raises(InputError, match=r"rows \[0, 1\] start with the pad token \(id 0\).*left-padded"):
        probe.run(encoding["input_ids"], progress=False)
    holes = {"input_ids": encoding["input_ids"], "attention_mask": torch.tensor([[1] * 10, [1, 0] * 5, [1] * 10])}
    with pytest.raises(InputError, match="padding between real tokens"):
        probe.run(holes, progress=False)
    # GPT-2 style pad = EOS cannot be told from text: such tensors are used as given (docs/getting-started.md, "Inputs, precisely").
    tokenizer.pad_token = "<eos>"
    padded = tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]
    assert probe.run(padded, progress=False).n_tokens == padded.numel()


# ----------------------------------------------------------------- broken weights
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_weights_are_refused(value):
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:, :16] = value  # the query projection
    with pytest.raises(NonFiniteAttentionError, match="layer 0 produced NaN or infinite"):
        EquivarianceProbe(model).run(torch.randint(0, 97, (2, 8)), progress=False)


def test_nan_weights_on_the_command_line_exit_2_and_write_no_results(folders, tmp_path, capsys):
    broken = tmp_path / "broken"
    save_tiny_model_with_tokenizer(broken, kind="gpt2", n_positions=32)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(broken)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    assert _cli(folders, tmp_path / "out", model=str(broken)) == 2
    assert "NaN" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.safetensors").exists()


def test_a_run_that_stops_half_way_leaves_a_checkpoint_and_no_results(folders, tmp_path, capsys, monkeypatch):
    original = EquivarianceProbe._run_batch
    calls = {"n": 0}

    def failing(self, rows, statistics, keys=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise NonFiniteAttentionError("layer 0 produced NaN or infinite attention weights (simulated fp16 overflow)")
        return original(self, rows, statistics, keys)

    monkeypatch.setattr(EquivarianceProbe, "_run_batch", failing)
    out = tmp_path / "out"
    assert _cli(folders, out, "--checkpoint-every", "2") == 2
    assert "simulated fp16 overflow" in capsys.readouterr().err
    assert not (out / "results.safetensors").exists()
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    saved = result_header(out / "checkpoint" / state["current"]["file"])
    assert state["current"]["position"] == 2 and saved["complete"] is False


# ----------------------------------------------------------------- result files
def test_bad_result_files_exit_2_with_the_reason(folders, tmp_path, capsys):
    assert _cli(folders, tmp_path / "run") == 0
    good = tmp_path / "run" / "results.safetensors"
    # Version 2 (JSON), as earlier releases wrote it
    text = V2_FIXTURE.read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 3])
    data = json.loads(text)
    data["format_version"] = 7
    (tmp_path / "future.json").write_text(json.dumps(data))
    data["format_version"] = 2
    data["statistics"]["n_tokens"] += 1
    (tmp_path / "edited.json").write_text(json.dumps(data))
    # Version 3 (safetensors), as 'run' writes it now
    binary = good.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(binary[: len(binary) // 2])
    edited_result_file(good, tmp_path / "future.safetensors", lambda h: h.__setitem__("format_version", 7))
    edited_result_file(good, tmp_path / "forged.safetensors", lambda h: h["statistics"].__setitem__("n_tokens", 1),
                       resign=False)
    edited_result_file(good, tmp_path / "edited.safetensors", lambda h: h["statistics"].__setitem__("n_tokens", 1))
    for name, message in (("cut.json", "not valid JSON"), ("future.json", "format_version 7.*Upgrade"),
                          ("edited.json", "checksum does not match"),
                          ("cut.safetensors", "not a complete safetensors file"),
                          ("future.safetensors", "format_version 7.*Upgrade"),
                          ("forged.safetensors", "header checksum does not match"),
                          ("edited.safetensors", "checksum does not match the arrays")):
        with pytest.raises(Exception, match=message):
            ProbeResult.load(tmp_path / name).statistics  # a header is checked on load, the arrays on first use
        for command in (["merge", str(good), str(tmp_path / name), "-o", str(tmp_path / "m.safetensors")],
                        ["report", str(tmp_path / name), "-o", str(tmp_path / "r.html")]):
            assert main(command) == 2
            assert __import__("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "r.html").exists()


def test_a_model_on_the_meta_device_is_refused_by_name():
    # Built without weights (e.g. from a config under torch.device("meta")): nothing can be run here.
    with torch.device("meta"):
        model = tiny_gpt2()
    with pytest.raises(InputError, match="meta device.*load its weights"):
        EquivarianceProbe(model)


@pytest.mark.parametrize("fault", [OSError("document source gone"), ValueError("a user's forward hook refused")],
                         ids=["oserror", "valueerror_from_a_hook"])
def test_a_study_stopped_by_any_exception_keeps_its_chunks_as_a_partial_result(tmp_path, monkeypatch, fault):
    original = EquivarianceProbe._run_batch
    calls = {"n": 0}

    def failing(self, rows, statistics, keys=None):
        calls["n"] += 1
        if calls["n"] == 3:  # the first batch of the second chunk
            raise fault
        return original(self, rows, statistics, keys)

    docs = [" ".join(WORDS[i:i + 9]) for i in range(4)]
    options = dict(loaded=(tiny_gpt2(), _NoBosTokenizer()), context_length=16, baselines=(), sample_size=0,
                   progress=False, batch_size=1, corpus=docs, n_docs=4)
    monkeypatch.setattr(EquivarianceProbe, "_run_batch", failing)
    with pytest.raises(type(fault)) as caught:
        run_study(checkpoint_dir=tmp_path / "ck", checkpoint_every=2, **options)
    partial = caught.value.partial_result
    assert partial.metadata["complete"] is False and partial.n_windows == 2
    monkeypatch.undo()
    _equal(partial, run_study(**{**options, "corpus": docs[:2], "n_docs": 2}).trained, exact=True)


@pytest.mark.parametrize("arguments, message", [
    (["--offsets", "0"], r"--offsets 0 must hold at least two distinct non-negative offsets: with one there is nothing "
                         r"to compare; pass more through --offsets"),
    (["--offsets", "5,5"], r"--offsets 5 must hold at least two distinct"),
    (["--segment-length", "1"], r"--segment-length 1 must be an integer of at least 2 .*pass --segment-length 64"),
    (["--n-contexts", "1"], r"text mode needs at least two contexts .*got 1; pass --n-contexts 4, or --mode position_ids"),
])
def test_the_shift_command_refuses_its_settings_before_it_loads_a_model(tmp_path, capsys, monkeypatch, arguments,
                                                                        message):
    """A model that does not exist: had it been loaded first, the error would name the model."""
    import re

    from equivariance_probe.sources import models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    assert main(["shift", "-o", str(tmp_path / "out"), "--model", "no-such-model", "--no-progress", *arguments]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error) and "no-such-model" not in error, error
