"""``equivariance-probe compare``: the study on several models over the same windows, one table and figure
(:func:`~equivariance_probe.runs.compare.compare_models`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common import (check_writable, measurement, memory_limit, model_source_of, print_result, read_documents,
                      study_options)
from ..options import MEASURED, add_shared_options, names

NAME = "compare"
#: Its place in ``equivariance-probe --help``.
ORDER = 60
SUMMARY = 'run the study on several models over the same windows: one table and figure'
DETAILS = (
    'The models are named by --models (not --model). Every model reads the same texts, cut so that each '
    'tokenizer yields T tokens (so no --pack). No checkpoints or shards (--checkpoint-every, --resume: each '
    "model's study is short; use 'run' per model for long ones), no --sample-size (the comparison draws no "
    "scatter plot), no --analyses (run 'positional' per model), and the Hugging Face framework only, no "
    '--framework (every framework gives the same numbers); its table and figure are what it writes, so no '
    '--no-figures.'
    ' No --sink-epsilon: its table reports no sink rate (run "show --sink-epsilon" on a model\'s results).'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``compare``'s options."""
    from ...runs.compare import DEFAULT_COMPARE_MODELS, DEFAULT_COMPARISON

    parser.add_argument("--models", type=names, default=list(DEFAULT_COMPARE_MODELS),
                        help=f"comma-separated packaged model names or local model folders (default: {','.join(DEFAULT_COMPARE_MODELS)})")
    sized = "sized so that the three packaged models, trained and at random initialisation, finish in well under 30 minutes on 2 CPU cores"
    add_shared_options(parser, "out", "cache_dir", "attn_implementation", "device", "dtype", "corpus", "text_field",
                       "n_docs", "context_length", "batch_size", "baselines", *MEASURED, "memory_limit_gib",
                       "no_progress", "json", "figure_format", differ={
        "n_docs": ({"default": DEFAULT_COMPARISON["n_docs"]}, sized),
        "context_length": ({"default": DEFAULT_COMPARISON["context_length"]}, sized),
        "baselines": ({"default": list(DEFAULT_COMPARISON["baselines"])},
                      "default random_init: each model against its own initialisation (every zero model is the same "
                      "uniform attention)")})


def handle(args: argparse.Namespace) -> int:
    from ...display.comparison import save_comparison
    from ...runs.compare import compare_models

    out = Path(args.out)
    check_writable(out)
    comparison = compare_models([model_source_of(args, name) for name in args.models],
                                **study_options(args, read_documents(args)), options=measurement(args),
                                memory_limit=memory_limit(args))
    paths = save_comparison(comparison, out, format=args.figure_format)
    print_result(args, comparison.table(), comparison.rows(), list(paths.values()) + [out / "models"])
    return 0
