"""The legacy TransformerLens 2.x adapter, run in .venv-legacy (see tests/test_legacy_environment.py).

Tiny HookedTransformer models are built from HookedTransformerConfig with seeded random weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from equivariance_probe import EquivarianceProbe
from equivariance_probe.adapters import get_adapter
from equivariance_probe.adapters.passes import pattern_pass
from equivariance_probe.adapters.transformer_lens import HookedTransformerAdapter


def tiny(local: bool = False, seed: int = 0) -> HookedTransformer:
    torch.manual_seed(seed)
    config = HookedTransformerConfig(
        n_layers=3, d_model=32, d_head=8, n_heads=4, d_vocab=50, n_ctx=32, act_fn="gelu",
        attn_only=False, normalization_type="LN",
        **({"use_local_attn": True, "window_size": 5, "attn_types": ["local", "global", "local"]} if local else {}),
    )
    return HookedTransformer(config).eval()


def test_patterns_match_run_with_cache_and_layout():
    model = tiny()
    adapter = get_adapter(model)
    assert isinstance(adapter, HookedTransformerAdapter)
    assert adapter.layout.sliding_windows == (None, None, None) and adapter.layout.max_context == 32
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    captured = {}
    pattern_pass(adapter, tokens, lambda layer, pattern: captured.__setitem__(layer, pattern.clone()))
    _, cache = model.run_with_cache(tokens)
    for layer in range(3):
        assert torch.allclose(captured[layer], cache["pattern", layer], atol=1e-6)
        assert torch.allclose(captured[layer].sum(-1), torch.ones(2, 4, 12), atol=1e-5)
        assert torch.all(captured[layer].triu(1) == 0)


def test_local_attention_windows_and_unembed_skipped():
    model = tiny(local=True)
    fired = []
    handle = model.unembed.register_forward_hook(lambda *args: fired.append(1))
    model.train()
    result = EquivarianceProbe(model).run(torch.randint(0, 50, (3, 16)), progress=False)
    handle.remove()
    assert not fired and model.training
    assert result.statistics.sliding_windows == (5, None, 5)
    counts = result.statistics.arrays["query_count"].numpy()
    assert np.array_equal(counts[0], 3 * np.minimum(np.arange(1, 17), 5))
    assert np.array_equal(counts[1], 3 * np.arange(1, 17))


def test_zero_weights_give_r2_one():
    model = tiny()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    result = EquivarianceProbe(model).run(torch.randint(0, 50, (2, 16)), progress=False)
    for scale in ("log", "raw"):
        for form in ("prior", "fitted", "eta2"):
            assert result.query_position_r2(scale, form) == pytest.approx(1.0, abs=1e-9)


def test_the_shift_test_and_a_mechanism_run_through_the_hook_points():
    """The shift test runs on a HookedTransformer through its binder (scores at ``attn.hook_attn_scores``, the
    residual stream, the logits it returns): a mechanism of one's own, the mean norm of block 1's MLP output at the
    segment, equals the one read by hand from ``run_with_cache`` at every offset."""
    from equivariance_probe.features.mechanisms import SegmentMechanism, mechanism_by_offset
    from equivariance_probe.sources.shift_grid import shift_grid

    model = tiny()
    generator = torch.Generator().manual_seed(2)
    segments = [torch.randint(0, 50, (5,), generator=generator).tolist() for _ in range(2)]
    contexts = [torch.randint(0, 50, (12,), generator=generator).tolist() for _ in range(2)]
    offsets = [0, 4, 9]

    def norm(rows):
        return rows.to(torch.float64).norm(dim=-1).mean()

    result = EquivarianceProbe(model).shift(segments, contexts, offsets=offsets, segment_length=5, batch_size=2,
                                            progress=False, interval_groups=2,
                                            mechanisms=[SegmentMechanism("mlp", "mlp.1", norm)])
    assert result.metadata["complete"] is True and np.isfinite(result.share("residual", "offset"))
    grid = shift_grid(segments, contexts, None, offsets=offsets, segment_length=5)
    by_hand = []
    for offset in offsets:
        values = []
        for g in range(2):
            for c in range(2):
                window, _ = grid.window(g, c, offset)
                _, cache = model.run_with_cache(torch.tensor([window]))
                values.append(float(norm(cache["blocks.1.hook_mlp_out"][0, -5:])))
        by_hand.append(np.mean(values))
    np.testing.assert_allclose(mechanism_by_offset(result.metadata, "mlp")["mean"], by_hand, rtol=1e-5)


def test_what_a_hooked_transformer_cannot_give_is_refused_by_name():
    from equivariance_probe.errors import AttentionCaptureError

    with pytest.raises(AttentionCaptureError, match="takes no position ids"):
        EquivarianceProbe(tiny()).shift([[1, 2, 3, 4, 5]], None, mode="position_ids", offsets=[0, 3],
                                        segment_length=5, progress=False)
