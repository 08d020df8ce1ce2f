"""The framework registry: adapters declare their framework, and dispatch, wrapping and choices read it."""

from __future__ import annotations

import sys

import pytest
import torch

from equivariance_probe import EquivarianceProbe, InputError, ProbeResult, UnsupportedModelError, get_adapter
from equivariance_probe.adapters import SUPPORTED_MODELS, Adapter
from equivariance_probe.adapters.base import LANGUAGE_MODEL_HEAD, RUNS_REMOTELY
from equivariance_probe.adapters.huggingface import HuggingFaceAdapter
from equivariance_probe.adapters.registry import (
    adapter_classes,
    adapter_for,
    framework_adapter,
    framework_names,
    unwrap_model,
    wrap_model,
)
from equivariance_probe.cli import shared_options


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=11, attn_implementation="eager")
    return GPT2LMHeadModel(config).eval()


def test_the_frameworks_are_the_adapters_declarations_default_first():
    assert framework_names() == ("huggingface", "transformer_lens", "nnsight")
    assert shared_options()["framework"][1]["choices"] == list(framework_names())
    assert len(SUPPORTED_MODELS) == len(adapter_classes()) == 4
    assert framework_adapter("transformer_lens").load_attention == "eager"
    assert RUNS_REMOTELY in framework_adapter("nnsight").capabilities
    assert LANGUAGE_MODEL_HEAD in framework_adapter("nnsight").capabilities


def test_finding_an_adapter_imports_no_framework():
    model = _gpt2()
    before = {name for name in ("transformer_lens", "nnsight") if name in sys.modules}
    assert adapter_for(model) is HuggingFaceAdapter
    assert {name for name in ("transformer_lens", "nnsight") if name in sys.modules} == before


def test_a_hugging_face_model_wraps_and_unwraps_to_itself_and_its_head_decides_predictions():
    model = _gpt2()
    assert wrap_model(model, None, framework="huggingface", source="tiny", dtype=torch.float32, device="cpu") is model
    assert unwrap_model(model) == (model, "huggingface")
    assert get_adapter(model).has_language_model_head
    assert not get_adapter(model.transformer).has_language_model_head  # a bare decoder: no head


def test_an_unknown_framework_or_model_type_is_refused_naming_the_known_ones():
    with pytest.raises(InputError, match="Unknown framework 'jax'; choose one of huggingface, transformer_lens, nnsight"):
        framework_adapter("jax")
    with pytest.raises(UnsupportedModelError, match=r"Supported: .*transformers\.PreTrainedModel"):
        get_adapter(torch.nn.Linear(2, 2))


def test_an_adapter_defined_elsewhere_registers_itself_by_subclassing():
    class Toy(torch.nn.Module):
        pass

    class ToyAdapter(HuggingFaceAdapter):
        framework = "toy"
        model_types = ((__name__, ("Toy",)),)
        detection_order = -1

        @classmethod
        def wrap(cls, model, tokenizer, *, source, dtype, device):
            return model

    globals()["Toy"] = Toy  # where model_types points
    try:
        assert adapter_for(Toy()) is ToyAdapter
        assert "toy" in framework_names()
    finally:
        del globals()["Toy"]
        del ToyAdapter
        import gc

        gc.collect()
    assert "toy" not in framework_names()


def test_a_variant_that_only_inherits_model_types_does_not_compete_with_its_parent():
    class Variant(HuggingFaceAdapter):
        pass

    assert Variant not in adapter_classes()
    assert adapter_for(_gpt2()) is HuggingFaceAdapter


def test_wrap_model_takes_the_framework_by_name_with_hugging_face_by_default():
    model = _gpt2()
    assert wrap_model(model, None, source="tiny", dtype=torch.float32, device="cpu") is model
    assert wrap_model(model, None, framework="huggingface", source="tiny", dtype=torch.float32, device="cpu") is model
    with pytest.raises(InputError, match="Unknown framework 'keras'"):
        wrap_model(model, None, framework="keras", source="t", dtype=torch.float32, device="cpu")


def test_a_result_written_with_the_backend_key_reads_as_framework(tmp_path):
    model = _gpt2()
    result = EquivarianceProbe(model).run([torch.arange(8) % 11], context_length=8, sample_size=0)
    result.metadata["study"] = {"model": "tiny", "backend": "nnsight"}
    result.save(tmp_path / "old.safetensors")
    study = ProbeResult.load(tmp_path / "old.safetensors").metadata["study"]
    assert study["framework"] == study["backend"] == "nnsight"


def test_every_adapter_class_declares_a_framework():
    for cls in adapter_classes():
        assert issubclass(cls, Adapter) and cls.framework and cls.supported_models


def test_what_a_framework_can_do_is_read_from_its_adapter_not_its_name():
    from equivariance_probe.adapters.base import RUNS_ENCODERS
    from equivariance_probe.adapters.registry import framework_can, frameworks_that
    from equivariance_probe.runs.study import _remote_options
    from equivariance_probe.sources.model_source import ModelSource

    assert frameworks_that(RUNS_REMOTELY) == ("nnsight",)
    assert frameworks_that(RUNS_ENCODERS) == ("huggingface",)
    assert framework_can("nnsight", RUNS_REMOTELY) and not framework_can("huggingface", RUNS_REMOTELY)
    with pytest.raises(InputError, match="Unknown framework 'jax'"):
        framework_can("jax", RUNS_REMOTELY)
    with pytest.raises(InputError, match="which the nnsight framework does: pass ModelSource.*framework='nnsight'"):
        _remote_options(True, None, ModelSource("gpt2", framework="huggingface"), object(), ())
    assert _remote_options(True, None, ModelSource("gpt2", framework="nnsight"), object(), ())["remote"] is True
