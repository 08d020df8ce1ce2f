"""The position probe's fits against the forward passes that produced their features, before and after.

    python benchmarks/probe_fit_cost.py [--models minilm,smollm2,gemma-3-270m] [--old-layers 4]

For each packaged model, in one process and on the same windows as the guide's table (16 documents of the
packaged corpus, 2 consecutive windows of 256 tokens each, 32 positions per window, 5 document folds):

* ``forward``: :func:`~equivariance_probe.analyses.position_probe.residual_samples`, the forward passes
  that keep every layer's residual stream at the sampled positions;
* ``old``: per layer, the fits the probe made before: scikit-learn's ``StandardScaler`` + ``RidgeCV``
  pipeline per fold (both targets, :data:`~equivariance_probe.maths.probing.RIDGE_ALPHAS`), timed on the
  first ``--old-layers`` layers and scaled to every layer (each layer's fits cost the same: same rows, same
  features);
* ``new``: :func:`~equivariance_probe.maths.probing.grouped_ridge_scores` on every layer, the jackknife
  replicates' refits (20 groups of documents) included.

Prints one JSON line per model: the seconds of each, the ratios ``old/forward``, ``new/forward`` and
``old/new``, and the largest difference between the two fits' per-fold held-out R² on the layers both ran
(and whether every chosen penalty agreed).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SETTINGS = {"n_docs": 16, "context_length": 256, "probe_positions": 32, "windows_per_doc": 2, "n_folds": 5}


def old_fits(features: np.ndarray, targets: np.ndarray, groups: np.ndarray, n_folds: int) -> tuple[np.ndarray, np.ndarray]:
    """Per fold, the held-out R² of both targets and the chosen penalties, as the probe's scikit-learn pipeline fit them."""
    from sklearn.linear_model import RidgeCV
    from sklearn.metrics import r2_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from equivariance_probe.maths.probing import RIDGE_ALPHAS, grouped_folds

    x = features.astype(np.float64)
    folds = grouped_folds(groups, n_folds)
    r2, alpha = np.empty((targets.shape[1], len(folds))), np.empty((targets.shape[1], len(folds)))
    for fold, (train, test) in enumerate(folds):
        pipeline = make_pipeline(StandardScaler(), RidgeCV(alphas=RIDGE_ALPHAS, alpha_per_target=True))
        predicted = pipeline.fit(x[train], targets[train]).predict(x[test])
        r2[:, fold] = [r2_score(targets[test, c], predicted[:, c]) for c in range(targets.shape[1])]
        alpha[:, fold] = pipeline[-1].alpha_
    return r2, alpha


def measure(name: str, old_layers: int) -> dict:
    import torch

    from equivariance_probe import load_corpus, load_positional_model
    from equivariance_probe.analyses.position_probe import probe_positions, residual_samples
    from equivariance_probe.maths.probing import grouped_ridge_scores
    from equivariance_probe.runs.positional import _probe_windows

    import sklearn.linear_model, sklearn.model_selection  # noqa: F401  (imported before any clock starts)

    model, tokenizer = load_positional_model(name)
    tokens, documents = _probe_windows(list(load_corpus()), tokenizer, SETTINGS["context_length"], SETTINGS["n_docs"],
                                       SETTINGS["windows_per_doc"])
    positions = probe_positions(len(tokens), tokens.shape[1], SETTINGS["probe_positions"])
    started = time.perf_counter()
    features = residual_samples(model, tokens, positions, batch_size=4)
    forward = time.perf_counter() - started
    position = positions.reshape(-1).numpy().astype(np.float64)
    targets = np.stack([position, np.log1p(position)], axis=1)
    groups = np.repeat(documents, positions.shape[1])
    eps = float(torch.finfo(next(model.parameters()).dtype).eps)
    started = time.perf_counter()
    new = [grouped_ridge_scores(features[layer].numpy(), targets, groups, n_folds=SETTINGS["n_folds"],
                                inverse=(None, np.expm1), eps=eps) for layer in range(features.shape[0])]
    new_seconds = time.perf_counter() - started
    timed = min(old_layers, features.shape[0])
    started = time.perf_counter()
    old = [old_fits(features[layer].numpy(), targets, groups, SETTINGS["n_folds"]) for layer in range(timed)]
    old_seconds = (time.perf_counter() - started) * features.shape[0] / timed
    compared = [layer for layer in range(timed) if new[layer]["constant"].max() == 0]  # the same features in both
    difference = max((float(np.abs(old[layer][0] - new[layer]["r2"]).max()) for layer in compared), default=float("nan"))
    same_alpha = all(np.array_equal(old[layer][1], new[layer]["alpha"]) for layer in compared)
    return {"model": name, "layers": int(features.shape[0]), "rows": int(features.shape[1]),
            "features": int(features.shape[2]), "forward_seconds": round(forward, 2),
            "old_fit_seconds": round(old_seconds, 1), "old_fit_layers_timed": timed,
            "new_fit_seconds": round(new_seconds, 2), "old_over_forward": round(old_seconds / forward, 2),
            "new_over_forward": round(new_seconds / forward, 2), "old_over_new": round(old_seconds / new_seconds, 1),
            "max_r2_difference": difference, "same_penalties": same_alpha, "layers_compared": compared}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="minilm,smollm2,gemma-3-270m")
    parser.add_argument("--old-layers", type=int, default=10**6, help="layers on which the old fits are timed")
    args = parser.parse_args()
    for name in args.models.split(","):
        print(json.dumps(measure(name.strip(), args.old_layers)), flush=True)


if __name__ == "__main__":
    main()
