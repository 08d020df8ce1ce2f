"""The shift test through nnsight (local, and remote in nnsight's ``remote="local"`` simulation of a server) and a
TransformerLens TransformerBridge: the same numbers as the plain Hugging Face model each wraps, in text mode and in
position-ids mode, on tiny float64 models built from configs. (Against a real NDIF server: tests/ndif.)

Tolerance: the models run in float64, so every array of the result (attention sums, residual stream sums,
prediction sums, counts) agrees to ``rtol=1e-9, atol=1e-12``. The absolute part covers sums that are zero in
exact arithmetic (centred logits sum to 0 over each row) and come out at float64 rounding (1e-16) with a
different sign from each framework. The bridge softmaxes in float32 for every dtype, as transformers' eager
attention does, so it is compared with the Hugging Face model under eager attention. One float32 bridge run
shows what float32 rounding leaves: ``rtol=1e-5``, and Jensen–Shannon sums within 1e-6 nats a position.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from synthetic import bridged_tiny_model, save_tiny_model_with_tokenizer, tiny_gemma3, tiny_gpt2, tiny_llama

from equivariance_probe import EquivarianceProbe
from equivariance_probe.errors import RemoteExecutionError, UnsupportedModelError
from equivariance_probe.features.segments import segment_pass

pytest.importorskip("nnsight")
pytest.importorskip("transformer_lens")

M = 10
OFFSETS = [0, 7, 30]
RTOL, ATOL = 1e-9, 1e-12
BUILDERS = {"gemma3-sliding-gqa": tiny_gemma3, "llama-gqa": tiny_llama, "gpt2": tiny_gpt2}


def design(vocab_top: int = 80, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(3, vocab_top, (M,), generator=generator).tolist() for _ in range(3)]
    contexts = [torch.randint(3, vocab_top, (30,), generator=generator).tolist() for _ in range(2)]
    return segments, contexts


def shift(probe: EquivarianceProbe, mode: str):
    segments, contexts = design()
    # batch_size=2: right-padded batches of windows of different lengths, with logits kept for the longest stretch
    return probe.shift(segments, contexts if mode == "text" else None, mode=mode, offsets=OFFSETS, segment_length=M,
                       batch_size=2, progress=False, interval_groups=3)


def assert_same_result(got, expected):
    assert set(got.statistics.arrays) == set(expected.statistics.arrays)
    assert any("nll_sum" in name for name in expected.statistics.arrays)  # the predictions are compared too
    for name, value in expected.statistics.arrays.items():
        np.testing.assert_allclose(np.asarray(got.statistics.arrays[name]), np.asarray(value), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    for representation in ("centred_logits", "residual"):
        np.testing.assert_allclose(got.share(representation, "offset", by="layer"),
                                   expected.share(representation, "offset", by="layer"), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.loss_by_offset(), expected.loss_by_offset(), rtol=1e-9)


def tiny_tokenizer():
    from test_nnsight_adapter import tiny_tokenizer as build

    return build()


@pytest.mark.parametrize("mode", ["text", "position_ids"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_nnsight_shift_equals_hugging_face(name, mode):
    from nnsight.modeling.transformers import TransformersModel

    model = BUILDERS[name]().to(torch.float64)
    model.set_attn_implementation("sdpa")
    tokenizer = tiny_tokenizer()
    expected = shift(EquivarianceProbe(model, tokenizer=tokenizer), mode)
    wrapped = TransformersModel(model, tokenizer=tokenizer)
    model.train()
    got = shift(EquivarianceProbe(wrapped), mode)
    assert model.training and model.config._attn_implementation == "sdpa"  # left as it was found
    assert_same_result(got, expected)
    assert got.metadata["model"]["framework"] == "nnsight"
    assert "nnsight trace" in got.metadata["capture"]
    assert got.metadata["recompute_check"]["passed"] is True
    assert got.metadata["check"]["rotary"] == (name != "gpt2") == expected.metadata["check"]["rotary"]
    if mode == "position_ids" and name == "gpt2":  # learned positions: the ids reached the model's table
        assert got.share("residual", "offset") > 1e-3


@pytest.mark.parametrize("mode", ["text", "position_ids"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_remote_nnsight_shift_equals_hugging_face(name, mode, monkeypatch):
    """``remote="local"``: each segment's grid is serialised as one nnsight session for a server (the functions
    shipped by value, equivariance_probe hidden), run here, and only its sums come back."""
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.adapters.nnsight_remote import segment_reply_nbytes
    from equivariance_probe.statistics.shift import ShiftStatistics

    model = BUILDERS[name]().to(torch.float64)
    tokenizer = tiny_tokenizer()
    expected = shift(EquivarianceProbe(model, tokenizer=tokenizer), mode)
    replies: list[dict] = []
    add_segment_sums = ShiftStatistics.add_segment_sums
    monkeypatch.setattr(ShiftStatistics, "add_segment_sums",
                        lambda self, fingerprint, group, sums: (replies.append(sums), add_segment_sums(self, fingerprint, group, sums))[1])
    probe = EquivarianceProbe(NNsightAdapter(TransformersModel(model, tokenizer=tokenizer), remote="local"))
    got = shift(probe, mode)
    assert_same_result(got, expected)
    assert "on the server" in got.metadata["capture"]
    check = got.metadata["recompute_check"]
    assert check["passed"] is True and check["max_difference"] < 1e-12 and "server kernel" in check["compared"]
    # one reply per segment, float64 sums of the shapes SegmentGrid.sums gives: no block, stream or distribution
    assert len(replies) == 3
    layout = probe.adapter.layout
    for reply in replies:
        assert all(value.dtype == np.float64 for value in reply.values())
        assert sum(value.nbytes for value in reply.values()) == segment_reply_nbytes(
            layout.n_layers, layout.n_heads, len(OFFSETS), hidden_size=model.config.hidden_size)
        assert reply["centred_logits/offset"].shape == (layout.n_layers, layout.n_heads)
        assert reply["js_offset_sum"].shape == (len(OFFSETS), len(OFFSETS))


def test_remote_nnsight_shift_without_predictions_stops_each_trace_after_the_last_block():
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter

    model = tiny_llama().to(torch.float64)
    tokenizer = tiny_tokenizer()
    segments, contexts = design()
    options = dict(offsets=OFFSETS, segment_length=M, batch_size=2, progress=False, predictions=False)
    expected = EquivarianceProbe(model, tokenizer=tokenizer).shift(segments, contexts, **options)
    got = EquivarianceProbe(NNsightAdapter(TransformersModel(model, tokenizer=tokenizer), remote="local")).shift(
        segments, contexts, **options)
    assert not got.statistics.arrays["nll_count"].any()
    for name, value in expected.statistics.arrays.items():
        np.testing.assert_allclose(got.statistics.arrays[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_remote_check_of_the_recomputation_refuses_a_mask_other_than_the_model_s(monkeypatch):
    """The server-side check compares attention outputs: told that Gemma 3's sliding layers see every key, the
    recomputed weights of a segment 30 tokens in spread over keys the model's window hides, and the run stops
    before any segment with the error and its numbers."""
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.base import AttentionLayout
    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.errors import AttentionCaptureError

    adapter = NNsightAdapter(TransformersModel(tiny_gemma3().to(torch.float64), tokenizer=tiny_tokenizer()),
                             remote="local")
    real = adapter.layout
    assert real.sliding_windows[0] is not None
    wrong = AttentionLayout(n_layers=real.n_layers, n_heads=real.n_heads, sliding_windows=(None,) * real.n_layers,
                            max_context=real.max_context, causal=real.causal)
    monkeypatch.setattr(NNsightAdapter, "layout", property(lambda self: wrong))
    probe = EquivarianceProbe(adapter)
    with pytest.raises(AttentionCaptureError, match="server kernel"):
        shift(probe, "text")
    assert probe.last_result.metadata["complete"] is False and probe.last_result.statistics.n_segments == 0


def test_remote_segment_blocks_are_refused_with_the_fix():
    """The blocks themselves (what the shift view draws) stay on the server: the segment pass names the fix."""
    from nnsight.modeling.transformers import TransformersModel

    from equivariance_probe.adapters.nnsight import NNsightAdapter

    adapter = NNsightAdapter(TransformersModel(tiny_gemma3().to(torch.float64), tokenizer=tiny_tokenizer()),
                             remote="local")
    with pytest.raises(RemoteExecutionError, match="remote='local'.*remote=False"):
        segment_pass(adapter, torch.tensor([[5, 6, 7, 8]]), torch.tensor([4]), 2, on_attention=lambda *args: None)


@pytest.fixture(scope="module", params=["gemma3", "gpt2"])
def bridged(request, tmp_path_factory):
    return request.param, *bridged_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("mode", ["text", "position_ids"])
def test_transformer_bridge_shift_equals_hugging_face(bridged, mode):
    kind, hf, bridge, tokenizer = bridged
    expected = shift(EquivarianceProbe(hf, tokenizer=tokenizer), mode)
    got = shift(EquivarianceProbe(bridge), mode)
    assert_same_result(got, expected)
    assert got.metadata["model"]["framework"] == "transformer_lens"
    assert "hook_attn_scores" in got.metadata["capture"]
    # the bridge's scores against its own pattern: its float32 softmax rounds a float64 model's weights
    assert got.metadata["recompute_check"]["passed"] is True
    assert got.metadata["recompute_check"]["max_difference"] < 1e-6
    if kind == "gemma3":
        assert got.metadata["check"]["rotary"] is True and got.metadata["check"]["passed"] is True
    elif mode == "position_ids":  # learned positions: the ids reached the model's table through the bridge
        assert got.share("residual", "offset") > 1e-3


def test_bridge_segment_capture_equals_the_bridge_s_own_pattern_and_logits(bridged):
    """The segment pass straight: its blocks are the bridge's hook_pattern, its log-probabilities its full logits'."""
    _, _, bridge, _ = bridged
    probe = EquivarianceProbe(bridge)
    tokens = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], [6, 10, 14, 18, 22, 26, 30, 34, 38, 0, 0, 0]])
    lengths = torch.tensor([12, 9])
    weights: dict[int, torch.Tensor] = {}
    log_probs = segment_pass(probe.adapter, tokens, lengths, 4, predictions=True,
                             on_attention=lambda layer, s, z, sink: weights.setdefault(layer, torch.exp(s - z[..., None])))
    _, cache = bridge.run_with_cache(tokens)
    logits = bridge(tokens)
    windows = probe.adapter.layout.sliding_windows
    offsets = torch.arange(4).view(-1, 1) - torch.arange(4).view(1, -1)
    for layer, block in weights.items():
        visible = (offsets >= 0) & (offsets < (windows[layer] or 4))
        for b, length in enumerate(lengths.tolist()):
            own = cache[f"blocks.{layer}.attn.hook_pattern"][b, :, length - 4 : length, length - 4 : length]
            torch.testing.assert_close(block[b] * visible, own * visible, rtol=1e-6, atol=1e-7)  # its float32 softmax
    for b, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(log_probs[b], torch.log_softmax(logits[b, length - 4 : length], -1),
                                   rtol=1e-12, atol=1e-12)


def test_an_adapter_without_segment_capture_names_the_frameworks_that_run_it():
    from equivariance_probe.adapters.base import Adapter, AttentionLayout

    class Other(Adapter):
        framework = "other"

        def __init__(self, model):
            super().__init__(model)
            self._layout = AttentionLayout(n_layers=1, n_heads=1, sliding_windows=(None,))


    with pytest.raises(UnsupportedModelError, match="binds no sites.*a TransformerBridge or an nnsight model"):
        segment_pass(Other(torch.nn.Linear(1, 1)), torch.zeros((1, 3), dtype=torch.long), torch.tensor([3]), 2,
                     on_attention=lambda *args: None)


def test_transformer_bridge_shift_equals_hugging_face_in_float32(tmp_path):
    """In float32 the two frameworks' logits differ at float32 rounding (the bridge reimplements attention), and
    a float32 Jensen–Shannon divergence is resolved to about 1e-6 nats a position: JS sums agree to that, every
    other array to rtol=1e-5."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_model_with_tokenizer(tmp_path, kind="gpt2")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    bridge = TransformerBridge.boot_transformers(path, hf_model=copy.deepcopy(hf), tokenizer=tokenizer,
                                                 dtype=torch.float32)
    expected = shift(EquivarianceProbe(hf, tokenizer=tokenizer), "text")
    got = shift(EquivarianceProbe(bridge), "text")
    assert_same_in_float32(got, expected)


def assert_same_in_float32(got, expected):
    """Every array of two float32 shift results within float32 rounding: ``rtol=1e-5``, and Jensen–Shannon sums
    within 1e-6 nats a position counted."""
    arrays = expected.statistics.arrays
    assert set(got.statistics.arrays) == set(arrays)
    for name, value in arrays.items():
        difference = np.abs(np.asarray(got.statistics.arrays[name]) - np.asarray(value))
        # a JS sum adds one divergence per position counted beside it
        allowed = 1e-5 * np.abs(np.asarray(value)) + (1e-6 * np.asarray(arrays[name.replace("_sum", "_count")])
                                                      if name.startswith("js_") and name.endswith("_sum") else 1e-9)
        assert (difference <= allowed).all(), (name, float(difference.max()))


def test_the_shift_command_gives_the_same_numbers_through_every_framework(tiny_model_folder, text_corpus, tmp_path):
    """``equivariance-probe shift --framework``: the trained model and its random initialisation (built from the
    wrapped model and wrapped the same way) run through nnsight and a TransformerBridge give the Hugging Face
    model's arrays. The command loads float32 models, so the comparison is at float32 rounding
    (:func:`assert_same_in_float32`); every framework runs eager attention, the bridge's own."""
    from equivariance_probe import ShiftResult
    from equivariance_probe.cli import main

    common = ["--model", tiny_model_folder("gemma3", n_positions=128), "--corpus", text_corpus(n_docs=5, words=60),
              "--n-segments", "3", "--n-contexts", "2", "--segment-length", "8", "--offsets", "0,5,20",
              "--interval-groups", "3", "--baselines", "random_init", "--seed", "1", "--attn-implementation", "eager",
              "--no-progress", "--no-figures", "--json"]
    results = {}
    for framework in ("huggingface", "nnsight", "transformer_lens"):
        assert main(["shift", "-o", str(tmp_path / framework), "--framework", framework, *common]) == 0
        results[framework] = {variant: ShiftResult.load(tmp_path / framework / f"shift_{variant}.safetensors")
                              for variant in ("trained", "random_init")}
    for framework in ("nnsight", "transformer_lens"):
        for variant, expected in results["huggingface"].items():
            got = results[framework][variant]
            assert got.metadata["model"]["framework"] == framework, variant
            assert expected.metadata["model"]["framework"] == "huggingface"
            assert got.n_segments == expected.n_segments == 3
            assert_same_in_float32(got, expected)
    trained, initial = (results["huggingface"][variant].statistics.arrays for variant in ("trained", "random_init"))
    assert any(not np.array_equal(np.asarray(trained[name]), np.asarray(initial[name])) for name in trained)


def test_the_shift_view_through_a_bridge_equals_the_hugging_face_view(bridged):
    """The CircuitsVis view captures its two blocks through the segment pass too: one head's block at two offsets."""
    from equivariance_probe.display.shift import shift_view

    _, hf, bridge, tokenizer = bridged
    segments, contexts = design()
    options = dict(head=(1, 0), offsets=(0, 30), segment_length=M)
    expected = shift_view(hf, segments, contexts, tokenizer=tokenizer, **options)
    got = shift_view(bridge, segments, contexts, **options)
    np.testing.assert_allclose(got.conditional, expected.conditional, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got.centred, expected.centred, rtol=RTOL, atol=ATOL)
    assert np.abs(expected.centred[0] - expected.centred[1]).max() > 1e-6  # layer 1 sees the context: it moves
