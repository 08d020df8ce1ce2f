"""ModelSource: which model a run measures and how it loads, one value for every entry point; loading keywords
given beside the model are refused with the source that carries them."""

from __future__ import annotations

import pytest

from equivariance_probe import ModelSource, run_study, scan_context_lengths
from equivariance_probe.errors import InputError
from equivariance_probe.sources.model_source import model_source


def test_defaults_are_the_study_defaults_and_bad_values_are_named():
    source = ModelSource()
    assert (source.name, source.framework, source.device, source.dtype, source.attn_implementation) == (
        "gemma-3-270m", "huggingface", "auto", None, "sdpa")
    with pytest.raises(InputError, match="framework 'jax' is not one of"):
        ModelSource("m", framework="jax")
    with pytest.raises(InputError, match="dtype 'float8'"):
        ModelSource("m", dtype="float8")
    with pytest.raises(InputError, match="name must be a model name"):
        ModelSource(3)
    assert ModelSource("m").replace(device="cpu") == ModelSource("m", device="cpu")


def test_loading_keywords_beside_the_model_are_refused_with_the_source_that_carries_them():
    source = ModelSource("m", framework="nnsight", device="cpu")
    assert model_source("m", {}, where="run_study") == ModelSource("m")
    assert model_source(source, {"device": None}, where="run_study") is source
    with pytest.raises(InputError, match=r"run_study\(\) got the loading keywords \['device', 'framework'\].*"
                                         r"ModelSource\('m', device=\.\.\., framework=\.\.\.\)"):
        model_source("m", {"framework": "nnsight", "device": "cpu"}, where="run_study")
    with pytest.raises(InputError, match=r"source\.replace\(device=\.\.\.\)"):
        model_source(source, {"device": "cpu"}, where="run_study")
    with pytest.raises(InputError, match=r"unexpected keyword arguments \['backend'\]"):
        model_source("m", {"backend": "nnsight"}, where="run_study")
    loaded = (object(), object())
    assert model_source(loaded, {}, where="scan_context_lengths") is loaded


def test_a_study_takes_its_loading_from_the_source_alone(tiny_model_folder, text_corpus):
    folder, corpus = tiny_model_folder("gemma3", 64), text_corpus(n_docs=3, words=40)
    common = dict(corpus=corpus, n_docs=3, baselines=["zero"], context_length=16, batch_size=2, progress=False,
                  sample_size=0)
    study = run_study(ModelSource(folder, device="cpu", attn_implementation="eager"), **common)
    assert study.config["attn_implementation"] == "eager" and sorted(study.results) == ["trained", "zero"]
    with pytest.raises(InputError, match=r"ModelSource\('.*', attn_implementation=\.\.\.\)"):
        run_study(folder, attn_implementation="eager", **common)


def test_scan_takes_a_source(tiny_model_folder, text_corpus):
    folder, corpus = tiny_model_folder("gemma3", 64), text_corpus(n_docs=4, words=60)
    scan = scan_context_lengths(ModelSource(folder, device="cpu", attn_implementation="eager"), context_lengths=(8, 16),
                                corpus=corpus, n_tokens=32, baselines=[], progress=False)
    assert scan.config["model"] == folder and scan.config["arguments"]["attn_implementation"] == "eager"
    assert sorted(scan.results) == [8, 16]


@pytest.fixture
def torch_threads():
    """torch's thread count, put back after the test (it is the whole process's)."""
    import torch

    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_a_bad_thread_count_is_named_before_anything_loads(threads):
    with pytest.raises(InputError, match=r"ModelSource\.threads=.* must be a positive number of CPU threads"):
        ModelSource("gemma-3-270m", threads=threads)


def test_a_source_sets_torch_s_threads_as_its_model_loads(tiny_model_folder, torch_threads):
    torch_threads.set_num_threads(2)
    source = ModelSource(tiny_model_folder("gpt2", 64), threads=1)
    assert torch_threads.get_num_threads() == 2  # a source is a value: building it changes nothing
    source.load()
    assert torch_threads.get_num_threads() == 1
    torch_threads.set_num_threads(2)
    ModelSource(tiny_model_folder("gpt2", 64)).load()
    assert torch_threads.get_num_threads() == 2  # None leaves torch's choice alone


def test_the_threads_option_sets_torch_s_threads_before_the_command_runs(tiny_model_folder, text_corpus, tmp_path,
                                                                          torch_threads, monkeypatch, capsys):
    from equivariance_probe.cli import main
    from equivariance_probe.runs import shift as shift_runs

    torch_threads.set_num_threads(2)
    seen = []

    def load(source):  # what the thread count is when the model would load, then stop there
        seen.append((source.threads, torch_threads.get_num_threads()))
        raise InputError("stopped before loading")

    monkeypatch.setattr(shift_runs, "load_shift_model", load)
    assert main(["shift", "-o", str(tmp_path / "out"), "--model", tiny_model_folder("gpt2", 64), "--corpus",
                 text_corpus(), "--threads", "1", "--no-progress"]) == 2
    assert seen == [(1, 1)] and "stopped before loading" in capsys.readouterr().err
    for command in ("run", "compare", "scan", "positional"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--threads" in capsys.readouterr().out, command
    with pytest.raises(SystemExit):
        main(["shift", "-o", str(tmp_path / "x"), "--threads", "0"])
