"""Sites and plans: one spelling of a place in a model, bound by every framework.

The linear position probe's residual samples and permutation sensitivity run as plans; through a local nnsight
model (which runs the Hugging Face modules) they equal the Hugging Face run exactly, through a TransformerBridge
(which computes attention itself) to float32 rounding. Tiny models built from configs; no network.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from equivariance_probe.adapters import adapter_of
from equivariance_probe.adapters.plan import Plan, Read, Replace, Stop
from equivariance_probe.adapters.sites import Site, every_head, head_site, parse_site, parse_sites
from equivariance_probe.analyses.order import permutation_sensitivity
from equivariance_probe.analyses.position_probe import probe_positions, residual_samples
from equivariance_probe.errors import AttentionCaptureError, InputError, SiteError

transformers = pytest.importorskip("transformers")

from synthetic import save_tiny_model_with_tokenizer, tiny_gemma3, tiny_gpt2, tiny_llama  # noqa: E402


# -- the grammar ---------------------------------------------------------------------------------------
def test_a_head_has_one_spelling_and_the_short_label_parses_to_it():
    assert parse_site("L4H3") == parse_site("head.4.3") == Site("head", 4, 3)
    assert parse_site("L4H3").name == head_site(4, 3) == "head.4.3"
    assert [site.name for site in parse_sites(every_head(2), n_heads=3)] == ["head.2.0", "head.2.1", "head.2.2"]
    for name in ("embedding", "attention.1", "attention_module.0", "mlp.0", "resid.1", "qk.0", "weights.1", "final",
                 "logits"):
        assert parse_site(name, n_layers=2).name == name


@pytest.mark.parametrize("name, message", [
    ("resid", "is not a site name; the sites are 'embedding'"),
    ("head.1", "is not a site name"),
    ("L4", "is not a site name"),
    ("resid.2", "the model has layers 0 to 1"),
    ("head.0.4", "the model has heads 0 to 3"),
])
def test_a_bad_site_is_refused_by_name_with_the_valid_spellings(name, message):
    with pytest.raises(SiteError, match=message):
        parse_sites(name, n_layers=2, n_heads=4)
    assert issubclass(SiteError, InputError)


def test_every_head_needs_the_head_count_and_names_several_sites():
    with pytest.raises(SiteError, match="needs the model's head count"):
        parse_sites("head.0.*")
    with pytest.raises(SiteError, match="names every head of a layer"):
        parse_site("head.0.*", n_heads=4)


def test_plans_refuse_what_cannot_be_done_before_any_pass():
    with pytest.raises(InputError, match="can be read, not replaced"):
        Plan.of([("qk.0", Replace(torch.zeros(1)))], n_layers=2, n_heads=4)
    with pytest.raises(InputError, match="give Read"):
        Plan.of([("resid.0", print)], n_layers=2, n_heads=4)
    with pytest.raises(InputError, match="unknown ablation"):
        Plan.of([("resid.0", Stop())], n_layers=2, n_heads=4, ablation="no_heads")


# -- one plan, three frameworks --------------------------------------------------------------------------
def _windows(n: int = 4, length: int = 14, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(3, 90, (n, length), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = 1
    return tokens


@pytest.fixture(scope="module", params=["gemma3", "gpt2"])
def bridged(request, tmp_path_factory):
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    path = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp(request.param), kind=request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    bridge = TransformerBridge.boot_transformers(path, hf_model=copy.deepcopy(hf), tokenizer=tokenizer)
    return hf, bridge


def _reads(model, names, tokens, **plan_options):
    """What a plan that reads ``names`` sees, per site name."""
    adapter = adapter_of(model)
    seen: dict[str, torch.Tensor] = {}
    plan = adapter.plan([(name, Read(lambda value, name=name: seen.__setitem__(name, value.clone())))
                         for name in names], **plan_options)
    adapter.run_plan(tokens, plan)
    return seen


def test_residual_samples_and_permutation_sensitivity_through_a_bridge_equal_hugging_face(bridged):
    hf, bridge = bridged
    tokens = _windows()
    positions = probe_positions(len(tokens), tokens.shape[1], 5, seed=1)
    expected = residual_samples(hf, tokens, positions, batch_size=3)
    got = residual_samples(bridge, tokens, positions, batch_size=3)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    mine = permutation_sensitivity(bridge, tokens[:2], n_permutations=3, ablations=("none",))
    theirs = permutation_sensitivity(hf, tokens[:2], n_permutations=3, ablations=("none",))
    np.testing.assert_allclose(mine.total_variation["none"], theirs.total_variation["none"], atol=1e-5)
    np.testing.assert_allclose(mine.hidden_change["none"], theirs.hidden_change["none"], atol=1e-4)
    assert mine.upper_mass["none"] == theirs.upper_mass["none"] == 0.0  # causal weights: nothing above the diagonal


def test_a_bridge_refuses_ablations_before_any_pass(bridged):
    _, bridge = bridged
    fired = []
    handle = bridge.blocks[0].register_forward_hook(lambda *args: fired.append(1))
    try:
        with pytest.raises(AttentionCaptureError, match="'no_mask' acts on transformers' attention call"):
            permutation_sensitivity(bridge, _windows(2), n_permutations=2, ablations=("none", "no_mask"))
        with pytest.raises(AttentionCaptureError, match="'no_positions' acts on transformers' attention call"):
            adapter_of(bridge).check_plan(adapter_of(bridge).plan([("qk.0", Read(len))], ablation="no_positions"))
    finally:
        handle.remove()
    assert not fired


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama, lambda: tiny_gemma3(window=4)])
def test_a_local_nnsight_model_gives_the_hugging_face_numbers_exactly(build):
    nnsight = pytest.importorskip("nnsight")
    hf = build().eval()
    wrapped = nnsight.NNsight(hf)
    tokens = _windows()
    positions = probe_positions(len(tokens), tokens.shape[1], 5, seed=2)
    for ablation in (None, "no_positions", "no_mask+no_positions"):
        assert torch.equal(residual_samples(wrapped, tokens, positions, batch_size=3, ablation=ablation),
                           residual_samples(hf, tokens, positions, batch_size=3, ablation=ablation)), ablation
    mine = permutation_sensitivity(wrapped, tokens[:2], n_permutations=3)
    theirs = permutation_sensitivity(hf, tokens[:2], n_permutations=3)
    for name in theirs.kl:
        assert np.array_equal(mine.kl[name], theirs.kl[name]), name
        assert np.array_equal(mine.hidden_change[name], theirs.hidden_change[name]), name
        assert mine.upper_mass[name] == theirs.upper_mass[name] and mine.effect[name] == theirs.effect[name], name


def test_every_site_reads_the_same_on_hugging_face_and_nnsight_and_heads_add_up():
    nnsight = pytest.importorskip("nnsight")
    hf = tiny_llama().eval()
    names = ["embedding", "head.0.*", "attention_module.0", "attention.0", "mlp.0", "resid.0", "resid.1", "final",
             "logits"]
    tokens = _windows(2)
    expected = _reads(hf, names, tokens)
    got = _reads(nnsight.NNsight(hf), names, tokens)
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # A pre-norm block adds its attention module's output as it is.
    assert torch.equal(expected["attention_module.0"], expected["attention.0"])
    # The block's residual stream is its input plus what its attention and MLP add.
    torch.testing.assert_close(expected["resid.0"], expected["embedding"] + expected["attention.0"] + expected["mlp.0"])


@pytest.mark.parametrize("framework", ["huggingface", "nnsight"])
def test_a_replacement_changes_what_follows_and_a_stop_ends_the_pass(framework):
    hf = tiny_gpt2().eval()
    model = hf if framework == "huggingface" else pytest.importorskip("nnsight").NNsight(hf)
    tokens = _windows(2)
    zero = _reads(model, ["resid.1"], tokens)  # unreplaced
    adapter = adapter_of(model)
    seen: dict[str, torch.Tensor] = {}
    plan = adapter.plan([("resid.0", Replace(lambda hidden: torch.zeros_like(hidden))),
                         ("resid.0", Read(lambda value: seen.__setitem__("resid.0", value))),
                         ("resid.1", Read(lambda value: seen.__setitem__("resid.1", value)))])
    adapter.run_plan(tokens, plan)
    assert torch.equal(seen["resid.0"], torch.zeros_like(seen["resid.0"]))
    # Block 1 sees a zero stream: its output no longer depends on the tokens.
    assert not torch.equal(seen["resid.1"], zero["resid.1"])
    torch.testing.assert_close(seen["resid.1"][0], seen["resid.1"][1])
    reached: list[str] = []
    adapter.run_plan(tokens, adapter.plan([("resid.0", Stop()), ("resid.1", Read(lambda value: reached.append("1")))]))
    assert reached == []


def test_the_position_probe_samples_on_the_remote_path_equal_hugging_face_and_refusals_come_first():
    """nnsight's ``remote="local"`` serialises each request as for a server: the rows are picked there."""
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.errors import RemoteExecutionError
    from test_nnsight_adapter import tiny_tokenizer

    hf = tiny_gemma3(window=4).eval()
    adapter = NNsightAdapter(TransformersModel(hf, tokenizer=tiny_tokenizer()), remote="local")
    tokens = _windows(3)
    positions = probe_positions(len(tokens), tokens.shape[1], 4, seed=3)
    expected = residual_samples(hf, tokens, positions, batch_size=2)
    assert torch.equal(residual_samples(adapter, tokens, positions, batch_size=2), expected)
    for plan_steps, ablation in (([("resid.0", Read(len))], "no_mask"), ([("resid.0", Replace(torch.zeros(1)))], None)):
        with pytest.raises(RemoteExecutionError, match="local nnsight model"):
            adapter.check_plan(adapter.plan(plan_steps, ablation=ablation))
    # A layer's queries and keys do not travel whole: a read of the attention call needs a reduce on the server.
    with pytest.raises(RemoteExecutionError, match="'qk.0'.*reduce="):
        adapter.check_plan(adapter.plan([("qk.0", Read(len))]))
    # The heads' pieces are formed with the output projection's weights, which stay on the server.
    with pytest.raises(RemoteExecutionError, match="'pieces.1'.*output projection's weights.*remote=False"):
        adapter.check_plan(adapter.plan([("pieces.1", Read(len))]))


def test_a_remote_plan_ships_its_reducers_by_value_and_brings_back_only_what_they_pick(monkeypatch):
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.adapters.nnsight_remote import PLAN_FUNCTIONS
    from test_nnsight_adapter import assert_payload_imports_only_torch_math_collections, recorded_payloads, tiny_tokenizer

    blobs = recorded_payloads(monkeypatch)
    model = TransformersModel(tiny_llama().eval(), tokenizer=tiny_tokenizer())
    tokens = _windows(2)
    positions = probe_positions(2, tokens.shape[1], 3, seed=4)
    samples = residual_samples(NNsightAdapter(model, remote="local"), tokens, positions, batch_size=2)
    assert len(blobs) == 1 and samples.shape == (3, 2 * 3, 32)
    # The probe's reducer (which rows to keep) travels as source beside the shipped reader; nothing is imported.
    assert_payload_imports_only_torch_math_collections(blobs[0], model, (*PLAN_FUNCTIONS, "position_probe.picked"))


def test_permutation_sensitivity_on_the_remote_path_equals_hugging_face():
    """Remotely the attention weights are recomputed from queries and keys where the model runs, and only the
    largest mass on later keys comes back; an ablation is refused before any request."""
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.errors import RemoteExecutionError
    from test_nnsight_adapter import tiny_tokenizer

    hf = tiny_gemma3(window=4).eval()
    adapter = NNsightAdapter(TransformersModel(hf, tokenizer=tiny_tokenizer()), remote="local")
    tokens = _windows(2)
    mine = permutation_sensitivity(adapter, tokens, n_permutations=3, ablations=("none",))
    theirs = permutation_sensitivity(hf, tokens, n_permutations=3, ablations=("none",))
    np.testing.assert_allclose(mine.total_variation["none"], theirs.total_variation["none"], atol=1e-6)
    np.testing.assert_allclose(mine.hidden_change["none"], theirs.hidden_change["none"], atol=1e-5)
    assert mine.upper_mass["none"] == theirs.upper_mass["none"] == 0.0
    with pytest.raises(RemoteExecutionError, match="ablation 'no_mask'"):
        permutation_sensitivity(adapter, tokens, n_permutations=3)


def test_an_adapter_that_binds_no_sites_is_refused_by_name_before_any_pass():
    from equivariance_probe.adapters import Adapter, AttentionLayout
    from equivariance_probe.analyses.order import representation_sums
    from equivariance_probe.errors import UnsupportedModelError

    class Bare(Adapter):
        framework = "bare"

        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(2, 2))
            self._layout = AttentionLayout(n_layers=2, n_heads=4, sliding_windows=(None, None))


    tokens = _windows(2)
    with pytest.raises(UnsupportedModelError, match="the bare adapter binds no sites"):
        residual_samples(Bare(), tokens, probe_positions(2, tokens.shape[1], 3))
    with pytest.raises(UnsupportedModelError, match="the bare adapter binds no sites"):
        representation_sums(Bare(), tokens)
    with pytest.raises(UnsupportedModelError, match="the bare adapter binds no sites"):
        permutation_sensitivity(Bare(), tokens, n_permutations=2)


def test_the_attention_module_s_output_comes_before_a_post_norm_on_every_framework(bridged):
    """Gemma 3 norms its attention's output before adding it: ``attention_module.{l}`` is the norm's input,
    ``attention.{l}`` its output; a bridge and a local nnsight model read the same places."""
    nnsight = pytest.importorskip("nnsight")
    hf, bridge = bridged
    tokens = _windows(2)
    names = ["attention_module.0", "attention.0", "attention_module.1"]
    expected = _reads(hf, names, tokens)
    for got in (_reads(bridge, names, tokens), _reads(nnsight.NNsight(hf), names, tokens)):
        for name in names:
            torch.testing.assert_close(got[name], expected[name], atol=2e-5, rtol=1e-4)
    post = hf.model.layers[0].post_attention_layernorm if hasattr(hf, "model") else None
    if post is not None and hasattr(hf.model.layers[0], "post_feedforward_layernorm"):
        with torch.no_grad():
            torch.testing.assert_close(post(expected["attention_module.0"]), expected["attention.0"])
    else:  # GPT-2 is pre-norm: the two are one tensor
        assert torch.equal(expected["attention_module.0"], expected["attention.0"])
