"""The nnsight adapter: same statistics as the Hugging Face adapter, locally and on the
remote code path (nnsight's ``remote="local"`` simulation), with eager weights and with
patterns recomputed from queries and keys; what a remote request would import; how much
comes back; and the errors of remote runs. No network: tiny models built from configs.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import linecache
import math
import symtable
import textwrap
import types

import numpy as np
import pytest
import torch

nnsight = pytest.importorskip("nnsight")

from equivariance_probe import EquivarianceProbe  # noqa: E402
from equivariance_probe.adapters import get_adapter  # noqa: E402
from equivariance_probe.adapters.nnsight import NNsightAdapter  # noqa: E402
from equivariance_probe.adapters.nnsight_remote import (  # noqa: E402
    REMOTE_FUNCTIONS,
    REMOTE_MODULES,
    SEGMENT_CHECK_FUNCTIONS,
    SEGMENT_FUNCTIONS,
    reply_nbytes,
)
from equivariance_probe.errors import (  # noqa: E402
    AttentionCaptureError,
    EquivarianceProbeError,
    MissingAPIKeyError,
    RemoteExecutionError,
    UnsupportedModelError,
)
from equivariance_probe.statistics import AttentionStatistics  # noqa: E402
from equivariance_probe.statistics.engines.in_trace import default_log_floor  # noqa: E402

from synthetic import collect_patterns, tiny_gemma3, tiny_gpt2, tiny_llama  # noqa: E402

#: Modules a remote request may import on the server (besides nnsight's own machinery).
#: einops is installed on NDIF's servers (ndif's `ext` extra; nnsight's local simulation keeps it for that reason).
ALLOWED_REMOTE_ROOTS = {"torch", "math", "collections", "builtins", "einops"}
#: What unpickling any nnsight request needs, whatever the trace does.
NNSIGHT_MACHINERY = {"nnsight", "cloudpickle", "copyreg"}

BUILDERS = {
    "gemma3-sliding-gqa": lambda: tiny_gemma3(window=8),  # layers: window 8, 8, full; 4 heads on 2 kv heads
    "llama-gqa": tiny_llama,  # 4 query heads on 2 kv heads
    "gpt2": tiny_gpt2,
}


def tiny_tokenizer(vocab_size: int = 97):
    """A word-level tokenizer ("t0 t5 ...") built offline; TransformersModel wants one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0",
                                   bos_token="t1", eos_token="t2")


def transformers_model(hf_model):
    from nnsight.modeling.transformers import TransformersModel

    return TransformersModel(hf_model, tokenizer=tiny_tokenizer())


def eager(build):
    model = build()
    model.set_attn_implementation("eager")
    return model


def token_windows(n_docs: int = 5, width: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (n_docs, width), generator=torch.Generator().manual_seed(seed))


def run(model_or_adapter, tokens, **kwargs):
    """The probe's run; on the remote path a batch of several windows comes back summed over them,
    so the run drops its interval groups and warns: expected, and asserted, here."""
    kwargs.setdefault("progress", False)
    kwargs.setdefault("batch_size", 2)
    probe = EquivarianceProbe(model_or_adapter)
    if isinstance(model_or_adapter, NNsightAdapter) and model_or_adapter.remote and kwargs["batch_size"] > 1:
        with pytest.warns(UserWarning, match="interval groups dropped"):
            return probe.run(tokens, **kwargs)
    return probe.run(tokens, **kwargs)


def assert_same_statistics(got, expected):
    assert got.statistics.n_windows == expected.statistics.n_windows
    assert got.statistics.log_floor == expected.statistics.log_floor
    assert set(got.statistics.arrays) == set(expected.statistics.arrays)
    # the windows' fingerprints come back from every path, the simulated remote one included
    np.testing.assert_array_equal(got.statistics.window_fingerprints, expected.statistics.window_fingerprints)
    for name, value in expected.statistics.arrays.items():
        assert torch.allclose(got.statistics.arrays[name], value, rtol=1e-5, atol=1e-7), name


# -- same statistics as the Hugging Face adapter ----------------------------------------------


@pytest.mark.parametrize("source", ["weights", "recompute"])
@pytest.mark.parametrize("remote", [False, "local"], ids=["local", "remote-simulated"])
@pytest.mark.parametrize("name", list(BUILDERS))

def test_nnsight_statistics_equal_huggingface_statistics(name, remote, source):
    hf_model = eager(BUILDERS[name])
    # Uneven lengths: right padding, and a last batch narrower than the context.
    tokens = [row[: 20 - i] for i, row in enumerate(token_windows())]
    expected = run(hf_model, tokens, context_length=20)
    adapter = NNsightAdapter(transformers_model(hf_model), remote=remote, pattern_source=source)
    got = run(adapter, tokens, context_length=20)
    assert_same_statistics(got, expected)
    assert got.metadata["model"]["pattern_source"] == source


@pytest.mark.parametrize("name", list(BUILDERS))
def test_recomputed_pattern_equals_eager_weights_layer_by_layer(name):
    hf_model = eager(BUILDERS[name])
    model = nnsight.NNsight(hf_model)
    tokens = token_windows(3, 24)
    weights = collect_patterns(NNsightAdapter(model, pattern_source="weights"), tokens)
    recomputed = recomputed_patterns(NNsightAdapter(model, pattern_source="recompute"), tokens)
    reference = collect_patterns(get_adapter(hf_model), tokens)
    assert sorted(weights) == sorted(recomputed) == list(range(hf_model.config.num_hidden_layers))
    for layer in weights:
        assert torch.allclose(weights[layer], reference[layer], atol=0, rtol=0)
        assert torch.allclose(recomputed[layer], weights[layer], atol=1e-6, rtol=1e-5)
    if name.startswith("gemma3"):
        # The sliding window is really there: query 20 sees nothing before key 13 in layer 0.
        assert float(recomputed[0][:, :, 20, :13].abs().max()) == 0.0
        assert float(recomputed[2][:, :, 20, :13].min()) > 0.0


def test_recompute_works_where_the_model_runs_sdpa_and_leaves_it_so():
    hf_model = tiny_gemma3(window=8)
    hf_model.set_attn_implementation("sdpa")
    tokens = token_windows()
    expected = run(eager(lambda: tiny_gemma3(window=8)), tokens)
    adapter = NNsightAdapter(transformers_model(hf_model), remote="local")  # auto -> recompute
    assert adapter.source.resolved() == "recompute"
    assert_same_statistics(run(adapter, tokens), expected)
    assert hf_model.config._attn_implementation == "sdpa"


def test_weights_on_a_remote_sdpa_model_say_to_recompute():
    hf_model = tiny_llama()
    hf_model.set_attn_implementation("sdpa")
    adapter = NNsightAdapter(transformers_model(hf_model), remote="local", pattern_source="weights")
    probe = EquivarianceProbe(adapter)
    with pytest.raises(AttentionCaptureError, match="pattern_source='recompute'"):
        probe.run(token_windows(), progress=False)


def test_local_weights_switch_an_sdpa_model_to_eager_and_back():
    hf_model = tiny_llama()
    hf_model.set_attn_implementation("sdpa")
    adapter = NNsightAdapter(nnsight.NNsight(hf_model), pattern_source="weights")
    assert_same_statistics(run(adapter, token_windows()), run(eager(tiny_llama), token_windows()))
    assert hf_model.config._attn_implementation == "sdpa"


def test_dispatch_accepts_nnsight_wrappers():
    hf_model = eager(tiny_gpt2)
    assert isinstance(get_adapter(nnsight.NNsight(hf_model)), NNsightAdapter)
    with pytest.warns(FutureWarning, match="LanguageModel is deprecated"):
        language_model = nnsight.LanguageModel(hf_model, tokenizer=tiny_tokenizer())
    assert isinstance(get_adapter(language_model), NNsightAdapter)


def test_dispatch_accepts_transformers_model():
    # TransformersModel is neither an NNsight nor a LanguageModel subclass in nnsight 0.8.
    assert isinstance(get_adapter(transformers_model(eager(tiny_gpt2))), NNsightAdapter)


def test_bfloat16_weights_and_recomputed_pattern_agree_to_bf16_rounding_and_share_the_floor():
    hf_model = eager(tiny_llama).to(torch.bfloat16)
    model = nnsight.NNsight(hf_model)
    tokens = token_windows(2, 16)
    weights = collect_patterns(NNsightAdapter(model, pattern_source="weights"), tokens)
    recomputed = recomputed_patterns(NNsightAdapter(model, pattern_source="recompute"), tokens)
    for layer in weights:
        assert weights[layer].dtype == torch.bfloat16 and recomputed[layer].dtype == torch.float32
        assert torch.allclose(recomputed[layer], weights[layer].float(), atol=2e-2)
    # bf16 has float32's exponent range: the same log floor, log eps = -87.34.
    assert default_log_floor(torch.bfloat16) == default_log_floor(torch.float32)
    assert math.log(default_log_floor(torch.bfloat16)) == pytest.approx(-87.336, abs=1e-3)


# -- what travels: imports and size ----------------------------------------------------------------


def _function(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


#: Every function any remote request runs on the server.
SHIPPED = sorted(set(REMOTE_FUNCTIONS) | set(SEGMENT_FUNCTIONS) | set(SEGMENT_CHECK_FUNCTIONS))


@pytest.mark.parametrize("dotted", SHIPPED)
def test_remote_functions_use_only_torch_builtins_and_each_other(dotted):
    function = _function(dotted)
    source = textwrap.dedent(inspect.getsource(function))
    tree = ast.parse(source)
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], "imports inside"
    table = next(t for t in symtable.symtable(source, "<f>", "exec").get_children() if t.get_type() == "function")

    def global_names(t):
        names = {s.get_name() for s in t.get_symbols() if s.is_global()}
        for child in t.get_children():
            names |= global_names(child)
        return names

    shipped = {f.rsplit(".", 1)[1] for f in SHIPPED}
    for name in global_names(table):
        if name in shipped or hasattr(builtins, name):
            continue
        value = function.__globals__[name]
        if isinstance(value, (int, float, str, tuple, type(None))):
            continue
        root = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", "")
        assert root.split(".")[0] in ALLOWED_REMOTE_ROOTS, f"{dotted} uses {name} from {root}"


def recorded_payloads(monkeypatch) -> list[bytes]:
    """Every request nnsight serialises (as for NDIF) from here on."""
    from nnsight.schema.request import RequestModel

    blobs: list[bytes] = []
    serialize = RequestModel.serialize.__func__

    def spy(cls, tracer, compress=False):
        blob = serialize(cls, tracer, compress)
        blobs.append(blob)
        return blob

    monkeypatch.setattr(RequestModel, "serialize", classmethod(spy))
    return blobs


def assert_payload_imports_only_torch_math_collections(blob: bytes, model, functions) -> None:
    """Unpickle a request as the server would and list every import it needs: torch, math, collections and
    nnsight's machinery only; the functions shipped by value are exactly ``functions``, without imports."""
    from nnsight.intervention.serialization import CustomCloudUnpickler
    from nnsight.schema.request import RequestModel

    classes: set[str] = set()
    imported: set[str] = set()
    by_value: dict[str, str] = {}

    class Recording(CustomCloudUnpickler):
        def find_class(self, module, name):
            found = super().find_class(module, name)
            classes.add(module)
            if name == "subimport":  # cloudpickle: import a module by name
                return lambda module_name: (imported.add(module_name), found(module_name))[1]
            if name == "_load_function":  # nnsight: a function shipped as source
                return lambda source, fname, *rest: (by_value.__setitem__(fname, source), found(source, fname, *rest))[1]
            return found

    # deserialize() registers the block's source in linecache under the adapter's file
    # name (a server has no such file); put the real entries back afterwards.
    lines = dict(linecache.cache)
    try:
        RequestModel.deserialize(blob, model._remoteable_persistent_objects(), compress=False, unpickler=Recording)
    finally:
        linecache.cache.clear()
        linecache.cache.update(lines)
    roots = {m.split(".")[0] for m in classes | imported}
    assert "equivariance_probe" not in roots  # shipped by value, not imported
    assert roots <= ALLOWED_REMOTE_ROOTS | NNSIGHT_MACHINERY, roots - ALLOWED_REMOTE_ROOTS - NNSIGHT_MACHINERY
    assert {m.split(".")[0] for m in imported} <= ALLOWED_REMOTE_ROOTS | {"nnsight"}
    assert set(by_value) == {f.rsplit(".", 1)[1] for f in functions}
    for name, source in by_value.items():
        assert not [n for n in ast.walk(ast.parse(textwrap.dedent(source)))
                    if isinstance(n, (ast.Import, ast.ImportFrom))], name
    # Registration for pickling by value is undone after the request.
    from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES

    assert not set(REMOTE_MODULES) & set(_PICKLE_BY_VALUE_MODULES)


def test_remote_payload_imports_only_torch_math_collections(monkeypatch):
    """Serialise a real request (as for NDIF) and list every import unpickling it needs."""
    blobs = recorded_payloads(monkeypatch)
    model = transformers_model(eager(lambda: tiny_gemma3(window=8)))
    run(NNsightAdapter(model, remote="local"), token_windows(2, 12))
    assert len(blobs) == 1
    assert_payload_imports_only_torch_math_collections(blobs[0], model, REMOTE_FUNCTIONS)


def test_remote_shift_payloads_import_only_torch_math_collections(monkeypatch):
    """The shift test's requests: the check of the recomputation (one trace) and one session per segment."""
    blobs = recorded_payloads(monkeypatch)
    model = transformers_model(tiny_gemma3(window=8))
    generator = torch.Generator().manual_seed(0)
    segments = [torch.randint(3, 97, (6,), generator=generator).tolist() for _ in range(2)]
    contexts = [torch.randint(3, 97, (12,), generator=generator).tolist() for _ in range(2)]
    EquivarianceProbe(NNsightAdapter(model, remote="local")).shift(
        segments, contexts, offsets=[0, 5, 12], segment_length=6, batch_size=2, progress=False)
    assert len(blobs) == 3  # the check, then one request per segment, whatever the contexts and offsets
    assert_payload_imports_only_torch_math_collections(blobs[0], model, SEGMENT_CHECK_FUNCTIONS)
    for blob in blobs[1:]:
        assert_payload_imports_only_torch_math_collections(blob, model, SEGMENT_FUNCTIONS)


def test_reply_size_is_independent_of_documents_and_far_below_the_patterns(monkeypatch):
    replies: list[int] = []
    add_batch_sums = AttentionStatistics.add_batch_sums

    def spy(self, sums, width):
        replies.append(sum(v.numel() * v.element_size() for v in sums.values()))
        return add_batch_sums(self, sums, width)

    monkeypatch.setattr(AttentionStatistics, "add_batch_sums", spy)
    hf_model = eager(tiny_llama)
    adapter = NNsightAdapter(transformers_model(hf_model), remote="local")
    width, layers, heads = 24, 2, 4
    for batch_size in (1, 4):
        replies.clear()
        run(adapter, token_windows(4, width), batch_size=batch_size, keep_pattern=False)
        # The same sums whatever the batch, but each window's first-token weight (L·H of them a window).
        assert set(replies) == {reply_nbytes(layers, heads, width, windows=batch_size)}
    patterns_per_batch_of_4 = 4 * layers * heads * width**2 * 4  # float32 patterns
    assert replies[-1] < patterns_per_batch_of_4
    # At scale (Llama-3.1-70B: 80 layers, 64 query heads, context 1024) the reply is
    # ~240 MiB per trace whatever its batch (key-lag sums in 64 key bins, the first token's weights; 40 KiB a
    # window of them per window), vs 10 GiB of bf16 patterns per document.
    assert reply_nbytes(80, 64, 1024) == 210_363_008 + 8 * 80 * 64 * 1024 + 8 * 80 * 64
    assert reply_nbytes(80, 64, 1024, keep_first_key=False) == 210_363_008
    assert 2 * 80 * 64 * 1024**2 / reply_nbytes(80, 64, 1024) > 42


def test_remote_batches_keep_interval_groups_only_when_each_reply_is_one_group():
    """A reply sums its batch's windows: with one window per batch the groups are exact; a batch of
    windows of several groups drops them, with a warning, and the intervals then say why."""
    hf_model = eager(tiny_gpt2)
    tokens = token_windows(6, 12)
    local = run(hf_model, tokens)
    single = run(NNsightAdapter(transformers_model(hf_model), remote="local"), tokens, batch_size=1)
    assert np.array_equal(single.statistics.groups.ids, local.statistics.groups.ids)
    found, expected = single.interval("log_fitted"), local.interval("log_fitted")
    assert (found.low, found.high) == pytest.approx((expected.low, expected.high), rel=1e-5)
    # Each window's first-token weight comes home from the trace, whatever the batch: the per-window sink rate.
    for remote in (single, run(NNsightAdapter(transformers_model(hf_model), remote="local"), tokens, batch_size=3)):
        np.testing.assert_array_equal(remote.statistics.window_sinks.keys, local.statistics.window_sinks.keys)
        np.testing.assert_allclose(remote.statistics.window_sinks.alpha, local.statistics.window_sinks.alpha,
                                   rtol=1e-5, atol=1e-7)
    with pytest.warns(UserWarning, match="interval groups dropped"):
        mixed = EquivarianceProbe(NNsightAdapter(transformers_model(hf_model), remote="local")).run(
            tokens, batch_size=3, progress=False)
    with pytest.raises(EquivarianceProbeError, match="reduced remotely"):
        mixed.interval("log_fitted")


# -- remote errors ----------------------------------------------------------------------------


@pytest.fixture
def no_api_key(monkeypatch):
    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(nnsight.CONFIG.API, "APIKEY", None)


def test_missing_api_key_fails_before_any_work(no_api_key):
    model = transformers_model(eager(tiny_llama))
    model.repo_id = "meta-llama/Llama-3.1-8B"  # as if built from the hub (nothing is fetched)
    with pytest.raises(MissingAPIKeyError, match="NDIF API key.*NDIF_API_KEY"):
        NNsightAdapter(model, remote=True)
    with pytest.raises(EquivarianceProbeError, match="set_default_api_key"):
        NNsightAdapter(model, remote="https://ndif.example.org")  # a host URL needs a key too
    NNsightAdapter(model, remote="local")  # the simulation needs no key


def test_only_models_named_by_hub_id_can_go_remote(monkeypatch):
    monkeypatch.setenv("NDIF_API_KEY", "test-key")
    with pytest.raises(RemoteExecutionError, match="hub id"):
        NNsightAdapter(nnsight.NNsight(eager(tiny_gpt2)), remote=True)
    with pytest.raises(RemoteExecutionError, match="hub id.*in-memory model"):
        NNsightAdapter(transformers_model(eager(tiny_gpt2)), remote=True)


def test_unreachable_server_keeps_complete_batches(monkeypatch):
    """First batch on the simulated remote path, then the server goes away."""
    import nnsight.modeling.huggingface as hf_wrapper

    monkeypatch.setenv("NDIF_API_KEY", "test-key")
    monkeypatch.setattr(nnsight.CONFIG.APP, "REMOTE_LOGGING", False)
    hf_model = eager(tiny_llama)
    model = transformers_model(hf_model)
    # The model key is the canonical hub id, looked up online; fake it (no network here).
    monkeypatch.setitem(hf_wrapper._ID_CACHE, model.repo_id, "tiny/llama")
    adapter = NNsightAdapter(model, remote="local")
    rows = token_windows(4, 16)

    def documents():
        yield rows[0]
        yield rows[1]  # batch 1 runs here
        adapter.remote = "http://127.0.0.1:9"  # nothing listens on the discard port
        yield rows[2]
        yield rows[3]

    probe = EquivarianceProbe(adapter)
    with pytest.raises(RemoteExecutionError, match="failed.*complete batches before it are kept") as caught, \
            pytest.warns(UserWarning, match="interval groups dropped"):  # the first batch's two windows, summed
        probe.run(documents(), batch_size=2, progress=False, context_length=16)
    assert caught.value.partial_result is probe.last_result
    assert probe.last_result.metadata["complete"] is False
    assert_same_statistics(probe.last_result, run(hf_model, rows[:2], context_length=16))


def recomputed_patterns(adapter, tokens):
    """Each layer's pattern recomputed from the queries and keys its attention call receives inside the trace
    (the function a remote request runs on the server), under the layer's own window."""
    from equivariance_probe.adapters.nnsight_remote import recompute_pattern
    from equivariance_probe.adapters.passes import call_pass

    patterns = {}
    windows = adapter.layout.sliding_windows
    call_pass(adapter, tokens, lambda call: patterns.__setitem__(
        call.layer, recompute_pattern(call.query, call.key, call.scaling, call.softcap, windows[call.layer])))
    return patterns
