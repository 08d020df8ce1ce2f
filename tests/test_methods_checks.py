"""The checks docs/methods.md#checks lists, each against an answer computed independently here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from equivariance_probe import EquivarianceProbe, toeplitz_r2
from equivariance_probe.adapters.huggingface import HuggingFaceAdapter

from synthetic import (
    SyntheticAdapter,
    causal_mask,
    collect_patterns,
    lag_only_pattern,
    random_causal_pattern,
    tiny_gemma3,
    tiny_gpt2,
    uniform_pattern,
)

FORMS = ("prior", "fitted", "eta2")
SCALES = ("log", "raw")


def run(model_or_adapter, tokens, **kwargs):
    kwargs.setdefault("progress", False)
    kwargs.setdefault("keep_pattern", True)  # the Toeplitz checks read the document-averaged pattern
    return EquivarianceProbe(model_or_adapter).run(tokens, **kwargs)


@pytest.mark.parametrize("build", [lambda: tiny_gpt2(zero=True), lambda: tiny_gemma3(zero=True, window=8)],
                         ids=["gpt2", "gemma3-sliding"])
def test_zero_weights_give_r2_one_everywhere_and_persistence_equal_to_prior(build):
    tokens = torch.randint(0, 97, (5, 24), generator=torch.Generator().manual_seed(1))
    result = run(build(), tokens, batch_size=2)
    for scale in SCALES:
        for form in FORMS:
            assert result.query_position_r2(scale, form) == pytest.approx(1.0, abs=1e-9)
            assert np.allclose(result.query_position_r2(scale, form, by="head"), 1.0, atol=1e-9)
            assert np.allclose(result.query_position_r2(scale, form, by="layer"), 1.0, atol=1e-9)
    for by in (None, "layer", "head", "key_position"):
        curves = result.persistence(by=by) if by != "key_position" else result.persistence(by=by, bins=4)
        has = curves.count > 0
        assert np.allclose(curves.curve[has], curves.prior[has], rtol=1e-6)
    assert result.persistence().fits["prior"].r2 == pytest.approx(1.0, abs=1e-9)
    assert result.floored() == 0


def test_uniform_pattern_closed_form_toeplitz_and_lag_only_pattern_scores_one():
    n = 12
    uniform = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    # Closed form, written out independently: diagonal d holds 1/(k+d+1) for k = 0..n-1-d.
    values = [(d, 1.0 / (k + d + 1)) for d in range(n) for k in range(n - d)]
    grand = sum(v for _, v in values) / len(values)
    means = {d: np.mean([v for dd, v in values if dd == d]) for d in range(n)}
    expected = 1 - sum((v - means[d]) ** 2 for d, v in values) / sum((v - grand) ** 2 for _, v in values)
    assert toeplitz_r2(uniform, causal_mask(n).numpy()) == pytest.approx(expected, rel=1e-12)
    assert expected < 0.9

    adapter = SyntheticAdapter(
        lambda layer, tokens: (uniform_pattern(tokens.shape[1]) if layer == 0 else lag_only_pattern(tokens.shape[1]))
        .expand(tokens.shape[0], 2, -1, -1),
        n_layers=2, n_heads=2,
    )
    result = run(adapter, torch.zeros((3, n), dtype=torch.long))
    by_head = result.toeplitz_r2(by="head")
    per_doc = result.toeplitz_r2(estimator="per_doc")
    # The probe sees float32 patterns: 1/(q+1) rounded to 24 bits.
    assert np.allclose(by_head[0], expected, rtol=1e-6) and np.allclose(per_doc[0], expected, rtol=1e-6)
    assert np.allclose(by_head[1], 1.0) and np.allclose(per_doc[1], 1.0)


def test_previous_token_head_is_toeplitz_once_the_first_key_is_excluded():
    n = 10
    previous = torch.zeros(n, n)
    previous[0, 0] = 1.0
    previous[torch.arange(1, n), torch.arange(0, n - 1)] = 1.0
    adapter = SyntheticAdapter(lambda layer, tokens: previous.expand(tokens.shape[0], 1, -1, -1), n_layers=1, n_heads=1)
    tokens = torch.zeros((2, n), dtype=torch.long)
    assert run(adapter, tokens).toeplitz_r2()[0, 0] < 1.0  # row 0 puts its mass on diagonal 0
    excluded = run(adapter, tokens, exclude_keys=[0])
    assert excluded.toeplitz_r2()[0, 0] == pytest.approx(1.0)
    assert excluded.excluded_keys == (0,)


def _reference_r2(patterns, windows, scale, eps, lengths, excluded=()):
    """Brute force: list every visible entry, then compute the three forms with numpy.

    Agreement is to ~1e-7 relative: the probe squares float32 deviations before summing
    them in float64.
    """
    ys, xs, groups, heads = [], [], [], []
    for layer, pattern in patterns.items():
        batch, n_heads, n, _ = pattern.shape
        for b in range(batch):
            for h in range(n_heads):
                for q in range(int(lengths[b])):
                    size = q + 1 if windows[layer] is None else min(q + 1, windows[layer])
                    for k in range(q - size + 1, q + 1):
                        if k in excluded:
                            continue
                        a = float(pattern[b, h, q, k])
                        # The probe takes logs in the pattern's dtype (float32), as the model produced it.
                        ys.append(float(np.log(np.float32(max(a, eps)))) if scale == "log" else a)
                        xs.append(np.log(1.0 / size) if scale == "log" else 1.0 / size)
                        groups.append((q, size))
                        heads.append((layer, h))
    y, x = np.array(ys), np.array(xs)
    tss = np.sum((y - y.mean()) ** 2)
    prior = 1 - np.sum((y - x) ** 2) / tss
    fitted = np.corrcoef(x, y)[0, 1] ** 2
    keys = {g: i for i, g in enumerate(sorted(set(groups)))}
    gid = np.array([keys[g] for g in groups])
    group_mean = np.bincount(gid, weights=y) / np.bincount(gid)
    eta2 = 1 - np.sum((y - group_mean[gid]) ** 2) / tss
    return {"prior": prior, "fitted": fitted, "eta2": eta2}


@pytest.mark.parametrize("scale", SCALES)
def test_query_position_r2_equals_brute_force_on_a_sliding_window_model(scale):
    model = tiny_gemma3(window=5)
    tokens = torch.randint(3, 97, (3, 14), generator=torch.Generator().manual_seed(2))
    patterns = collect_patterns(HuggingFaceAdapter(model), tokens)
    result = run(model, tokens, batch_size=2)
    reference = _reference_r2(patterns, result.statistics.sliding_windows, scale, result.log_floor, [14, 14, 14])
    for form in FORMS:
        assert result.query_position_r2(scale, form) == pytest.approx(reference[form], rel=1e-7, abs=1e-12)
    # Per head: the same brute force restricted to one head's entries.
    layer, head = 2, 1
    one = {layer: patterns[layer][:, head : head + 1]}
    reference_head = _reference_r2(one, result.statistics.sliding_windows, scale, result.log_floor, [14, 14, 14])
    for form in FORMS:
        assert result.query_position_r2(scale, form, by="head")[layer, head] == pytest.approx(reference_head[form], rel=1e-7)


def test_excluded_keys_and_short_documents_match_brute_force():
    adapter = SyntheticAdapter(lambda layer, tokens: random_causal_pattern(tokens, 2, seed=layer), n_layers=2, n_heads=2)
    tokens = torch.randint(0, 97, (4, 11), generator=torch.Generator().manual_seed(3))
    rows = [tokens[0].tolist(), tokens[1, :7].tolist(), tokens[2].tolist(), tokens[3, :4].tolist()]
    result = run(adapter, rows, context_length=11, batch_size=4, exclude_keys=[0])
    # The same windows, padded to 11, as the probe padded them.
    padded = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = torch.tensor(row)
    patterns = {layer: random_causal_pattern(padded, 2, seed=layer) for layer in range(2)}
    reference = _reference_r2(patterns, (None, None), "log", result.log_floor, [11, 7, 11, 4], excluded={0})
    for form in FORMS:
        assert result.query_position_r2("log", form) == pytest.approx(reference[form], rel=1e-7)
    assert result.n_tokens == 11 + 7 + 11 + 4


def test_eta2_bounds_fitted_r2_which_is_non_negative():
    model = tiny_gpt2(seed=4, n_layer=3)
    tokens = torch.randint(0, 97, (4, 20), generator=torch.Generator().manual_seed(4))
    result = run(model, tokens)
    for scale in SCALES:
        eta2 = result.query_position_r2(scale, "eta2", by="head")
        fitted = result.query_position_r2(scale, "fitted", by="head")
        assert np.all(fitted >= -1e-12) and np.all(eta2 >= fitted - 1e-12)
        assert result.query_position_r2(scale, "eta2") >= result.query_position_r2(scale, "fitted") - 1e-12


def test_streaming_batches_and_merged_shards_equal_one_run():
    model = tiny_gemma3(window=6)
    tokens = torch.randint(3, 97, (7, 18), generator=torch.Generator().manual_seed(5))
    whole = run(model, tokens, batch_size=7)
    for batch_size in (1, 3):
        other = run(model, tokens, batch_size=batch_size)
        for name, value in whole.statistics.arrays.items():
            assert torch.allclose(other.statistics.arrays[name], value, rtol=1e-9, atol=1e-9), name
    shards = run(model, tokens[:3], batch_size=2) + run(model, tokens[3:5]) + run(model, tokens[5:], batch_size=1)
    assert shards.n_windows == 7 and shards.n_tokens == 7 * 18
    for name, value in whole.statistics.arrays.items():
        assert torch.allclose(shards.statistics.arrays[name], value, rtol=1e-9, atol=1e-9), name
    for form in FORMS:
        assert shards.query_position_r2("log", form) == pytest.approx(whole.query_position_r2("log", form), rel=1e-9)


def test_sliding_window_statistics_never_read_outside_the_window():
    n, window = 16, 4
    clean = uniform_pattern(n, window)
    poisoned = clean.clone()
    poisoned[~causal_mask(n, window)] = float("nan")  # anything read outside V(q) would poison the sums
    make = lambda pattern: SyntheticAdapter(  # noqa: E731
        lambda layer, tokens: pattern.expand(tokens.shape[0], 2, -1, -1), n_layers=1, n_heads=2, sliding_windows=[window]
    )
    tokens = torch.zeros((2, n), dtype=torch.long)
    a, b = run(make(clean), tokens), run(make(poisoned), tokens)
    for name, value in a.statistics.arrays.items():
        assert torch.equal(b.statistics.arrays[name], value), name
    sizes = torch.clamp(torch.arange(1, n + 1), max=window).double()
    assert torch.equal(a.statistics.arrays["query_count"][0], 2 * sizes)
    assert a.query_position_r2("log", "prior") == pytest.approx(1.0)


def test_gemma3_sliding_layers_count_only_window_entries():
    model = tiny_gemma3(window=4)
    tokens = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(6))
    result = run(model, tokens)
    counts = result.statistics.arrays["query_count"]
    q = torch.arange(12).double()
    assert torch.equal(counts[0], 2 * torch.clamp(q + 1, max=4))
    assert torch.equal(counts[2], 2 * (q + 1))
    assert result.statistics.sliding_windows == (4, 4, None)
