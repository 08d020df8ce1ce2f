"""A mechanism of one's own in the shift test, added without touching an adapter: the mean norm of an MLP's output
at the segment, by offset, on every local framework (the NDIF server: tests/ndif/test_ndif_shift.py).

Ground truth: the same windows run through the Hugging Face model here, the MLP's output taken by a hook of this
test's own, the norm averaged over the segment's rows and over every window at each offset.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from synthetic import bridged_tiny_model, tiny_gemma3, tiny_llama

from equivariance_probe import EquivarianceProbe
from equivariance_probe.adapters.components import block_parts
from equivariance_probe.errors import InputError
from equivariance_probe.features.mechanisms import SegmentMechanism, mechanism_by_offset
from equivariance_probe.sources.shift_grid import shift_grid

M, OFFSETS, LAYER = 5, [0, 4, 11], 1


def mean_norm(rows: torch.Tensor) -> torch.Tensor:
    return rows.to(torch.float64).norm(dim=-1).mean()


MECHANISM = SegmentMechanism("mlp_norm", f"mlp.{LAYER}", mean_norm)


def design():
    generator = torch.Generator().manual_seed(4)
    segments = [torch.randint(3, 80, (M,), generator=generator).tolist() for _ in range(3)]
    contexts = [torch.randint(3, 80, (20,), generator=generator).tolist() for _ in range(2)]
    return segments, contexts


def run(model, mode="text", mechanisms=(MECHANISM,), tokenizer=None):
    segments, contexts = design()
    return EquivarianceProbe(model, tokenizer=tokenizer).shift(segments, contexts if mode == "text" else None, mode=mode, offsets=OFFSETS,
                                          segment_length=M, batch_size=2, progress=False, interval_groups=3,
                                          mechanisms=mechanisms)


def by_hand(model, mode="text") -> np.ndarray:
    """Each window run alone, the MLP's output read by a hook here; the mean norm at each offset."""
    segments, contexts = design()
    grid = shift_grid(segments, contexts if mode == "text" else None, None, offsets=OFFSETS, segment_length=M,
                      mode=mode)
    seen = {}
    handle = block_parts(model)[LAYER].mlp_out.register_forward_hook(
        lambda module, args, output: seen.__setitem__("out", output[0] if isinstance(output, tuple) else output))
    means = np.zeros(len(OFFSETS))
    try:
        for index, offset in enumerate(grid.offsets):
            values = []
            for g in range(len(segments)):
                for c in range(grid.n_contexts):
                    window, start = grid.window(g, c, offset)
                    ids = torch.tensor([window])
                    position_ids = (start + torch.arange(len(window))).view(1, -1)
                    with torch.no_grad():
                        model(ids, position_ids=position_ids)
                    values.append(float(mean_norm(seen["out"][0, -M:])))
            means[index] = np.mean(values)
    finally:
        handle.remove()
    return means


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("mode", ["text", "position_ids"])
def test_a_toy_mechanism_by_offset_equals_a_computation_by_hand(build, mode):
    model = build().to(torch.float64)
    result = run(model, mode)
    got = mechanism_by_offset(result.metadata, "mlp_norm")
    assert list(got["offsets"]) == OFFSETS
    assert (got["count"] == 3 * (2 if mode == "text" else 1)).all()
    np.testing.assert_allclose(got["mean"], by_hand(model, mode), rtol=1e-12)


def test_the_mechanism_is_the_same_through_a_bridge_and_nnsight(tmp_path):
    from nnsight.modeling.transformers import TransformersModel

    from test_nnsight_adapter import tiny_tokenizer

    # Each framework's tokenizer puts its special prefix before every window, so each is compared with the
    # Hugging Face run of the same weights under the same tokenizer.
    hf, bridge, tokenizer = bridged_tiny_model(tmp_path / "gemma3", "gemma3")
    expected = mechanism_by_offset(run(hf, tokenizer=tokenizer).metadata, "mlp_norm")["mean"]
    np.testing.assert_allclose(mechanism_by_offset(run(bridge).metadata, "mlp_norm")["mean"], expected, rtol=1e-10)
    traced = TransformersModel(tiny_gemma3().to(torch.float64), tokenizer=tiny_tokenizer())
    local = mechanism_by_offset(run(traced).metadata, "mlp_norm")["mean"]
    here = run(tiny_gemma3().to(torch.float64), tokenizer=tiny_tokenizer())
    np.testing.assert_array_equal(local, mechanism_by_offset(here.metadata, "mlp_norm")["mean"])


def test_mechanisms_saved_with_the_run_load_with_it(tmp_path):
    result = run(tiny_llama().to(torch.float64))
    path = result.save(tmp_path / "run")
    from equivariance_probe import ShiftResult

    loaded = ShiftResult.load(path)
    np.testing.assert_array_equal(mechanism_by_offset(loaded.metadata, "mlp_norm")["mean"],
                                  mechanism_by_offset(result.metadata, "mlp_norm")["mean"])


def test_a_mechanism_is_refused_by_name_where_it_cannot_be_read():
    with pytest.raises(InputError, match="measure must be a function"):
        SegmentMechanism("x", "mlp.0", 3)
    with pytest.raises(InputError, match="read no mechanism 'other'"):
        mechanism_by_offset(run(tiny_llama()).metadata, "other")
    with pytest.raises(InputError, match="names must differ"):
        run(tiny_llama(), mechanisms=[MECHANISM, MECHANISM])
