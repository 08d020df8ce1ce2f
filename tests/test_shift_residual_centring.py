"""The residual stream's shift-test shares are taken about its mean vector: known answers.

A vector-valued representation's variation is ``Σ ‖x − x̄‖²`` (multivariate analysis of variance), so its shares
do not move when one vector is added to every residual or the hidden basis is rotated, and a residual stream
whose only variation is a constant per dimension has no variation at all, however large the constant.
"""

import json

import numpy as np
import pytest
import torch

from synthetic import tiny_gemma3
from test_shift import design, run
from test_shift_decomposition import stream as stream_grid

from equivariance_probe import ShiftResult
from equivariance_probe.errors import IncompatibleResultsError, InputError, SupersededSumsError
from equivariance_probe.maths.shift import (
    SHARES,
    centre_about_mean_vector,
    decomposition,
    shares,
    vector_decomposition_sums,
)
from equivariance_probe.records.container import read_container, read_tensors, tensor_checksum, write_container
from equivariance_probe.shift_result import SHIFT_KIND
from equivariance_probe.sources.shift_grid import shift_grid
from equivariance_probe.statistics.shift import ShiftConfig, ShiftStatistics

SEGMENTS, CONTEXTS, OFFSETS, LAYERS, TOKENS, DIMS = 6, 3, 4, 2, 5, 8


def residual_grid(seed: int = 0) -> np.ndarray:
    """``[G, F, S, L, I, D]``: token, offset, context and interaction effects on a few huge, nearly constant
    dimensions, as Gemma's residual stream has them."""
    rng = np.random.default_rng(seed)
    shape = (SEGMENTS, CONTEXTS, OFFSETS, LAYERS, TOKENS, DIMS)
    constant = np.zeros(DIMS)
    constant[:2] = [3e3, -5e2]
    return (constant + rng.normal(size=(SEGMENTS, 1, 1, LAYERS, TOKENS, DIMS))
            + 0.3 * rng.normal(size=(SEGMENTS, 1, OFFSETS, LAYERS, TOKENS, DIMS))
            + 0.2 * rng.normal(size=(SEGMENTS, CONTEXTS, 1, LAYERS, TOKENS, DIMS))
            + 0.05 * rng.normal(size=shape))


def direct_terms(y: np.ndarray) -> dict[str, np.ndarray]:
    """``[G, F, S, L, I, D]`` -> per layer, the five sums of squares straight from their definitions, about the
    mean vector of each layer."""
    centre = y.mean(axis=(0, 1, 2, 4), keepdims=True)               # x̄: one mean per (layer, dimension)
    cell = y.mean(axis=(1, 2), keepdims=True)                       # x̄_{g,i}
    by_offset = y.mean(axis=1, keepdims=True)
    by_context = y.mean(axis=2, keepdims=True)
    n_contexts, n_offsets = y.shape[1:3]
    rest = y - by_offset - by_context + cell
    over = (0, 1, 2, 4, 5)
    return {"all": ((y - centre) ** 2).sum(over),
            "pair": n_contexts * n_offsets * ((cell - centre) ** 2).sum(over),
            "offset": n_contexts * ((by_offset - cell) ** 2).sum(over),
            "context": n_offsets * ((by_context - cell) ** 2).sum(over),
            "residual": (rest ** 2).sum(over)}


def stream(y: np.ndarray, fingerprints, groups: int = 3) -> ShiftStatistics:
    """The residual stream ``y [G, F, S, L, I, D]`` through the streaming sums, as a run adds it."""
    return stream_grid(y, fingerprints, groups, attention=())


def result_of(y: np.ndarray) -> ShiftResult:
    return ShiftResult(stream(y, range(10, 10 + y.shape[0])), {"complete": True})


def test_brute_force_equals_streaming_merged_shards_and_the_direct_computation_about_the_mean_vector():
    y = residual_grid()
    expected = direct_terms(y)
    brute = decomposition(centre_about_mean_vector(vector_decomposition_sums(y)))
    whole = result_of(y)
    streamed = whole.decomposition("residual", by="layer")
    shards = ShiftResult(stream(y[:2], range(10, 12)) + stream(y[2:], range(12, 16)), {"complete": True})
    merged = shards.decomposition("residual", by="layer")
    for name, value in expected.items():
        np.testing.assert_allclose(brute[name], value, rtol=1e-9, err_msg=name)
        np.testing.assert_allclose(streamed[name], value, rtol=1e-9, err_msg=name)
        np.testing.assert_allclose(merged[name], value, rtol=1e-9, err_msg=name)
    # The identity holds exactly, as for attention.
    np.testing.assert_allclose(streamed["pair"] + streamed["offset"] + streamed["context"] + streamed["residual"],
                               streamed["all"], rtol=1e-12)
    # The model's share sums the layers' sums of squares, each about its own layer's mean vector.
    assert whole.share("residual", "offset") == pytest.approx(expected["offset"].sum() / expected["all"].sum(),
                                                              rel=1e-9)
    # The grand mean over tokens and dimensions would add the mean vector's spread to SS_all: here 99.9 % of it.
    grand = decomposition(vector_decomposition_sums(y))
    assert (grand["all"] - expected["all"]).min() > 100 * expected["all"].max()


def test_adding_one_vector_or_rotating_the_hidden_basis_changes_no_share():
    y = residual_grid(seed=1)
    rng = np.random.default_rng(7)
    shifted = y + 1e4 * rng.normal(size=DIMS)
    rotation, _ = np.linalg.qr(rng.normal(size=(DIMS, DIMS)))
    rotated = y @ rotation
    base = result_of(y)
    for values in (shifted, rotated):
        other = result_of(values)
        # Rounding: SS_pair is Σ Y² less the mean vector's square, so float64 resolves the shares to a few ulps of
        # Σ Y² relative to SS_all (1e8 times larger once 1e4 is added to every coordinate).
        rounding = 8 * np.finfo(np.float64).eps * (values ** 2).sum() / other.decomposition("residual")["all"]
        for term in SHARES:
            np.testing.assert_allclose(other.share("residual", term, by="layer"), base.share("residual", term, by="layer"),
                                       rtol=0, atol=rounding, err_msg=term)
            assert other.share("residual", term, interval=0.95).estimate == pytest.approx(
                base.share("residual", term), rel=0, abs=rounding)
    # Unlike the grand mean over tokens and dimensions, which the shift moves many times over.
    grand = [shares(vector_decomposition_sums(values))["offset"] for values in (y, shifted)]
    assert np.all(grand[1] < 0.1 * grand[0])


@pytest.mark.parametrize("scale", [1.0, 1e4, 1e8])
def test_a_residual_stream_that_is_one_constant_vector_has_undefined_shares_however_large(scale):
    constant = scale * np.random.default_rng(3).normal(size=DIMS)
    y = np.broadcast_to(constant, (SEGMENTS, CONTEXTS, OFFSETS, LAYERS, TOKENS, DIMS)).copy()
    result = result_of(y)
    for term in SHARES:
        assert np.all(np.isnan(result.share("residual", term, by="layer"))), term
    assert "residual" in result.undefined
    assert result.summary()["representations"]["residual"]["offset_eta2"]["estimate"] is None
    # Around one grand mean the constant's spread over dimensions would have looked like content: pair η² = 1.
    grand = shares(vector_decomposition_sums(y))
    np.testing.assert_allclose(grand["pair"], 1.0)


def hidden_after_blocks(model, tokens: list[int], segment_length: int) -> np.ndarray:
    """``[L, m, d]`` the residual stream after every block at the window's last ``m`` tokens, from forward hooks."""
    found = []
    hooks = [layer.register_forward_hook(lambda module, args, output: found.append(
        (output[0] if isinstance(output, tuple) else output)[0, -segment_length:].detach().double().numpy()))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return np.stack(found)


def test_a_real_model_s_residual_shares_equal_the_direct_computation_from_its_hidden_states():
    model = tiny_gemma3().to(torch.float64)
    segments, contexts = design()
    result = run(model, segments, contexts, interval_groups=2)
    grid = shift_grid(segments, contexts, None, offsets=[0, 7, 30], segment_length=10, mode="text",
                      max_context=None)
    y = np.stack([np.stack([np.stack([hidden_after_blocks(model, grid.window(g, f, s)[0], 10)
                                      for s in grid.offsets]) for f in range(len(contexts))])
                  for g in range(len(segments))])                     # [G, F, S, L, m, d]
    expected = direct_terms(y)
    found = result.decomposition("residual", by="layer")
    for name, value in expected.items():
        np.testing.assert_allclose(found[name], value, rtol=1e-9, err_msg=name)
    assert result.config.hidden_size == model.config.hidden_size
    assert result.config.residual_centre == "mean_vector"


def write_grand_mean_file(result: ShiftResult, path) -> None:
    """``result`` written as files were before the mean vector was kept: format 1, no per-dimension sums, no
    ``hidden_size`` or ``residual_centre`` in the configuration (re-signed, as such a file was)."""
    written = path.with_suffix(".new.safetensors")
    result.save(written)
    container = read_container(written, SHIFT_KIND)
    header = container.header
    tensors = {name: value for name, value in read_tensors(container).items() if not name.endswith("total_by_dim")}
    config = {key: value for key, value in header["config"].items() if key not in ("hidden_size", "residual_centre")}
    old = {"kind": SHIFT_KIND, "format_version": 1, "checksum": tensor_checksum(tensors), "config": config,
           "metadata": header["metadata"], "summary": header["summary"]}
    write_container(path, tensors, json.loads(json.dumps(old)))


def test_a_file_of_the_grand_mean_definition_loads_and_names_why_its_residual_shares_are_gone(tmp_path):
    segments, contexts = design()
    model = tiny_gemma3().to(torch.float64)
    result = run(model, segments, contexts)
    path = tmp_path / "old.safetensors"
    write_grand_mean_file(result, path)
    old = ShiftResult.load(path)
    assert old.config.residual_centre == "grand_mean" and old.config.hidden_size == 0
    with pytest.raises(SupersededSumsError, match="mean vector.*Run the shift test again"):
        old.share("residual", "offset")
    with pytest.raises(SupersededSumsError):
        old.decomposition("residual")
    with pytest.raises(SupersededSumsError):
        old.paired_difference(old, "residual")
    # Every other number stays available, and equal to the new run's.
    assert old.share("centred_logits", "offset", interval=0.95).estimate == pytest.approx(
        result.share("centred_logits", "offset"), rel=1e-12)
    assert old.offset_rms("residual") == pytest.approx(result.offset_rms("residual"), rel=1e-12)
    np.testing.assert_allclose(old.loss_by_offset(), result.loss_by_offset(), rtol=1e-12)
    summary = old.summary()
    assert summary["representations"]["residual"]["offset_eta2"] is None
    assert summary["representations"]["centred_logits"]["offset_eta2"] is not None
    assert "run the shift test again" in old.undefined["residual"].lower()
    assert "residual offset η²=undefined" in repr(old)
    # A new file records its definition, and the two definitions never merge.
    new_path = tmp_path / "new.safetensors"
    result.save(new_path)
    assert read_container(new_path, SHIFT_KIND).header["config"]["residual_centre"] == "mean_vector"
    with pytest.raises(IncompatibleResultsError, match="residual_centre"):
        old.statistics.merge(ShiftResult.load(new_path).statistics)


def test_the_mean_vector_needs_the_hidden_size():
    with pytest.raises(InputError, match="hidden_size=0.*width"):
        ShiftConfig(n_layers=1, n_heads=1, offsets=(0, 1), n_contexts=1, segment_length=3)
