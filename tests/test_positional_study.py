"""The positional study end to end on tiny models: files, figures, HTML section, command line, report."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from equivariance_probe.cli import main
from equivariance_probe.errors import InputError, ResultFileError
from equivariance_probe.display.positional import positional_figures, render_positional_section
from equivariance_probe.runs.positional import ANALYSES, PositionalStudy, run_positional

from synthetic import WORDS, save_tiny_model_with_tokenizer, tiny_gpt2

transformers = pytest.importorskip("transformers")


def _windows(n: int = 4, length: int = 20) -> torch.Tensor:
    return torch.randint(3, 90, (n, length), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gpt2_study() -> PositionalStudy:
    return run_positional(tiny_gpt2(), docs=_windows(), n_docs=4, context_length=20, n_prompts=2, prompt_length=12,
                          n_permutations=2, n_kernels=2, progress=False)


def test_every_analysis_runs_on_a_gpt2_and_round_trips(gpt2_study, tmp_path):
    assert set(gpt2_study.parts) == set(ANALYSES) | {"shrinkage_baseline", "correlation_baseline", "probe_baseline",
                                                     "massive_baseline"}
    assert not gpt2_study.skipped
    summary = gpt2_study.summary()
    assert summary["gram"]["n_positions"] == 64 and len(summary["positional_logits"]["per_head"]) == 4
    assert gpt2_study.parts["correlation"].shape == (2, 20, 20)
    path = gpt2_study.save(tmp_path)
    assert path.name == "positional.safetensors"
    loaded = PositionalStudy.load(path)
    assert json.dumps(loaded.summary(), sort_keys=True) == json.dumps(summary, sort_keys=True)
    np.testing.assert_array_equal(loaded.parts["correlation"], gpt2_study.parts["correlation"])
    np.testing.assert_array_equal(loaded.parts["tisa"]["profile"].sums, gpt2_study.parts["tisa"]["profile"].sums)
    probe = gpt2_study.parts["probe"]  # 4 token rows, each its own document: 4 folds over 19 positions each
    assert probe.n_folds == 4 and probe.positions.shape == (4, 19) and summary["probe"]["n_documents"] == 4
    np.testing.assert_array_equal(loaded.parts["probe"].r2["position"], probe.r2["position"])
    np.testing.assert_array_equal(loaded.parts["probe_baseline"].mae["position"], gpt2_study.parts["probe_baseline"].mae["position"])


def test_figures_and_html_section(gpt2_study):
    figures = positional_figures(gpt2_study)
    assert set(figures) == {"gram", "positional_logits", "tisa", "permutation", "shrinkage", "correlation",
                            "correlation_baseline", "probe", "massive"}
    import matplotlib.pyplot as plt

    for figure in figures.values():
        plt.close(figure)
    section = render_positional_section(gpt2_study)
    assert section.startswith('<section class="positional">') and section.count("data:image/png;base64,") == 9
    assert "Toeplitz R² (diagonal excluded)" in section and "no_mask+no_positions" in section
    assert "Linear position probes" in section and "held-out R²" in section and "Massive activations" in section


def test_rotary_models_skip_the_gram_analyses_and_encoders_the_causal_ones():
    gemma = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, layer_types=["full_attention"], max_position_embeddings=64)).eval()
    study = run_positional(gemma, docs=_windows(), analyses=("gram", "positional_logits"), progress=False)
    assert not study.parts and set(study.skipped) == {"gram", "positional_logits"}
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=97, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=30)).eval()
    study = run_positional(bert, docs=_windows(3, 16), analyses=("gram", "tisa", "permutation"), context_length=16,
                           n_kernels=2, progress=False)
    assert set(study.parts) == {"gram", "tisa"} and "causal language model" in study.skipped["permutation"]
    assert study.parts["tisa"]["profile"].counts[0, 0].min() > 0  # an encoder sees both sides


def test_bad_arguments_and_files_are_refused(tmp_path):
    with pytest.raises(InputError, match="unknown analyses"):
        run_positional(tiny_gpt2(), docs=_windows(), analyses=("gram", "fourier"))
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ResultFileError, match="not a positional results file"):
        PositionalStudy.load(tmp_path / "bad.json")


def test_command_line_writes_json_figures_and_the_report_section(tmp_path, capsys, tiny_model_folder, text_corpus):
    model = tiny_model_folder("gpt2", 64)
    corpus = text_corpus(n_docs=4, words=40)
    out = tmp_path / "out"
    assert main(["run", "--out", str(out), "--model", model, "--corpus", corpus, "--n-docs", "3",
                 "--context-length", "16", "--baselines", "none", "--no-progress", "--sample-size", "0",
                 "--analyses", "gram,permutation,shrinkage"]) == 0
    study = PositionalStudy.load(out / "positional.safetensors")
    assert set(study.parts) == {"gram", "permutation", "shrinkage", "shrinkage_baseline"}
    for name in ("positional_gram.png", "positional_permutation.png", "positional_shrinkage.png", "positional.html"):
        assert (out / name).stat().st_size > 0, name
    assert main(["report", str(out / "results.safetensors")]) == 0
    report = (out / "report.html").read_text()
    assert "<h2>Where order comes from:" in report and "Permutation sensitivity" in report

    assert main(["positional", "--out", str(tmp_path / "p"), "--model", model, "--corpus", corpus,
                 "--analyses", "tisa,correlation,probe", "--n-docs", "2", "--context-length", "12", "--kernels", "2",
                 "--probe-positions", "4", "--windows-per-doc", "3", "--folds", "2", "--baselines", "none"]) == 0
    study = PositionalStudy.load(tmp_path / "p" / "positional.safetensors")
    assert set(study.parts) == {"tisa", "correlation", "probe"}
    probe = study.parts["probe"]  # 2 documents, 3 windows each (after the BOS): the folds hold documents out
    assert probe.positions.shape == (6, 4) and probe.n_folds == 2 and probe.n_documents == 2
    assert (tmp_path / "p" / "positional_probe.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["show", str(tmp_path / "p" / "positional.safetensors")]) == 0
    assert "held-out R² of the position (trained)" in capsys.readouterr().out
    assert len(WORDS) > 0


def test_command_line_refuses_unknown_analyses(capsys):
    with pytest.raises(SystemExit):
        main(["positional", "--out", "x", "--analyses", "gram,wavelets"])
    assert "unknown analyses" in capsys.readouterr().err


def test_wrapped_models_and_probes_use_the_raw_hugging_face_weights(tmp_path):
    # TransformerLens' weight processing (centring) would change the Gram matrix: the analyses
    # read the Hugging Face model inside a bridge, an nnsight model or a probe.
    import copy

    from equivariance_probe import EquivarianceProbe
    from equivariance_probe.sources.models import load_model
    from equivariance_probe.analyses.positional import gram_toeplitz, position_embedding_table

    path = save_tiny_model_with_tokenizer(tmp_path / "model", kind="gpt2", n_positions=64)
    hf, tokenizer = load_model(path)
    reference = gram_toeplitz(position_embedding_table(hf)[0])
    wrapped = {backend: load_model(path, framework=backend)[0] for backend in ("transformer_lens", "nnsight")}
    for backend, model in wrapped.items():
        assert gram_toeplitz(position_embedding_table(model)[0]).r2_whole == reference.r2_whole, backend
    # nnsight runs the Hugging Face modules; the bridge's own hooks carry the queries and keys transformers'
    # attention call would receive, so both give the Hugging Face model's profile.
    from equivariance_probe.analyses.positional import score_profile

    tokens = torch.randint(3, 60, (1, 8))
    expected = score_profile(hf, tokens)
    for backend, model in wrapped.items():
        got = score_profile(model, tokens)
        assert got.sums.shape == (2, 4, 15) and np.array_equal(got.counts, expected.counts), backend
        np.testing.assert_allclose(got.sums, expected.sums, rtol=1e-5, atol=1e-6, err_msg=backend)
    probe = EquivarianceProbe(copy.deepcopy(hf), tokenizer=tokenizer)
    study = run_positional(probe, docs=["the a of and to in is was for on as with by at from that " * 3] * 2,
                             analyses=("gram", "permutation"), n_prompts=1, prompt_length=12, n_permutations=2,
                             progress=False)
    assert study.parts["gram"].r2_whole == reference.r2_whole
    assert study.parts["permutation"].kl["none"].shape == (1, 2)


POSITIONAL_V1 = __import__("pathlib").Path(__file__).parent / "data" / "positional_format_v1.json"


def test_the_file_round_trips_every_array_bitwise_in_the_result_format_family(gpt2_study, tmp_path):
    from safetensors import safe_open

    path = gpt2_study.save(tmp_path / "study.safetensors")
    with safe_open(str(path), framework="np") as handle:  # what a user sees without the package
        header = json.loads(handle.metadata()["equivariance_probe"])
        names = set(handle.keys())
        gram = handle.get_tensor("parts/gram/gram")
    assert header["kind"] == "equivariance_probe.PositionalStudy" and header["format_version"] == 2
    assert {"parts/gram/gram", "parts/correlation", "parts/tisa/profile/sums"} <= names
    np.testing.assert_array_equal(gram, gpt2_study.parts["gram"].gram)
    loaded = PositionalStudy.load(path)
    assert set(loaded.parts) == set(gpt2_study.parts) and loaded.metadata == gpt2_study.metadata
    for name in ("correlation", "correlation_baseline"):
        np.testing.assert_array_equal(loaded.parts[name], gpt2_study.parts[name])
    np.testing.assert_array_equal(loaded.parts["positional_logits"].scores, gpt2_study.parts["positional_logits"].scores)
    np.testing.assert_array_equal(loaded.parts["positional_logits"].visible, gpt2_study.parts["positional_logits"].visible)
    for stream, values in gpt2_study.parts["shrinkage"].across_documents.items():
        np.testing.assert_array_equal(loaded.parts["shrinkage"].across_documents[stream], values)
    for ablation, values in gpt2_study.parts["permutation"].kl.items():
        np.testing.assert_array_equal(loaded.parts["permutation"].kl[ablation], values)
    fits, fits_loaded = gpt2_study.parts["tisa"]["fits"].fits, loaded.parts["tisa"]["fits"].fits
    np.testing.assert_array_equal(fits_loaded[1][0].c, fits[1][0].c)
    assert fits_loaded[1][0].r2 == fits[1][0].r2
    assert not (tmp_path / "study.safetensors.tmp").exists()
    # the arrays are checked against the header's checksum
    from synthetic import edited_result_file

    edited_result_file(path, tmp_path / "edited.safetensors", lambda h: None,
                       tensors_edit=lambda t: t["parts/correlation"].__setitem__((0, 1, 1), 0.5))
    with pytest.raises(ResultFileError, match="array .parts/correlation. does not match its digest"):
        PositionalStudy.load(tmp_path / "edited.safetensors")


def test_a_version_1_json_file_still_loads():
    data = json.loads(POSITIONAL_V1.read_text())
    assert data["format"] == "equivariance_probe.positional" and data["version"] == 1
    study = PositionalStudy.load(POSITIONAL_V1)
    assert set(study.parts) == set(data["parts"])
    np.testing.assert_array_equal(study.parts["gram"].gram, np.asarray(data["parts"]["gram"]["gram"]))
    assert json.dumps(study.summary(), sort_keys=True) == json.dumps(data["summary"], sort_keys=True)


def test_a_result_file_is_not_a_positional_study(tmp_path):
    from equivariance_probe import EquivarianceProbe

    result = EquivarianceProbe(tiny_gpt2()).run(_windows(2, 8), progress=False)
    with pytest.raises(ResultFileError, match="holds 'equivariance_probe.ProbeResult'.*ProbeResult.load"):
        PositionalStudy.load(result.save(tmp_path / "results.safetensors"))
