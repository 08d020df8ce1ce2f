"""``equivariance-probe positional``: where order comes from: position-embedding Gram matrices, TISA kernel fits,
permutation sensitivity, variance shrinkage, position correlations, linear position probes."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...errors import InputError
from ..common import check_writable, positional_into, print_result, read_documents
from ..options import add_shared_options, integer_at_least, positive

NAME = "positional"
#: Its place in ``equivariance-probe --help``.
ORDER = 80
SUMMARY = 'where order comes from: Gram/TISA Toeplitzness, permutation symmetry, variance shrinkage, position correlations, linear position probes'
DETAILS = (
    'The analyses read hidden states and position embeddings of the Hugging Face model (no --framework) in a '
    'few short windows, one per document (no --pack), on the CPU in float32 as loaded (no --device, --dtype '
    'or --memory-limit-gib); no checkpoints or shards (--checkpoint-every, --resume), no --interval-groups or'
    ' --sample-size (their numbers have no intervals and no scatter plot), and no --keep-pattern (the '
    'attention Toeplitz R² keeps the pattern always); its figures are what it writes, so no --no-figures. No '
    '--sink-epsilon: its analyses report no sink rate.'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``positional``'s options."""
    small = "the analyses' windows are few and short, since some keep every hidden state"
    add_shared_options(parser, "out", "model", "cache_dir", "attn_implementation", "corpus", "text_field", "n_docs",
                       "context_length", "batch_size", "exclude_keys", "seed", "analyses", "no_progress", "json",
                       "figure_format", differ={
        "n_docs": ({"default": 8}, small),
        "context_length": ({"default": 256}, small)})
    add_shared_options(parser, "baselines", differ={"baselines": ({"default": ["random_init"]},
                       "random_init (default) also measures shrinkage and correlations at the model's own random "
                       "initialisation, none the trained model only: the positional analyses compare with the "
                       "random initialisation alone")})
    parser.add_argument("--n-prompts", type=positive, default=4, help="prompts for the permutation analysis")
    parser.add_argument("--prompt-length", type=positive, default=64,
                        help="tokens per prompt of the permutation analysis (default %(default)s)")
    parser.add_argument("--n-permutations", type=positive, default=8,
                        help="random orders of each prompt's tokens in the permutation analysis (default %(default)s)")
    parser.add_argument("--kernels", type=positive, default=5, help="S, kernels of the TISA fit")
    parser.add_argument("--probe-positions", type=positive, default=32,
                        help="positions per window of the linear position probes, a stratified sample of 1..T-1 "
                             "(default %(default)s)")
    parser.add_argument("--windows-per-doc", type=positive, default=2,
                        help="consecutive windows of each document for the probes, whose folds hold documents "
                             "out (default %(default)s)")
    parser.add_argument("--folds", type=integer_at_least(2, "an integer of at least 2"), default=5,
                        help="document folds (GroupKFold) of the probes' held-out scores (default %(default)s)")


def handle(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_writable(out)
    positional = positional_into(
        out, args, model_name=args.model, analyses=args.analyses, documents=read_documents(args),
        n_docs=args.n_docs, context_length=args.context_length, n_prompts=args.n_prompts,
        prompt_length=args.prompt_length, n_permutations=args.n_permutations, n_kernels=args.kernels,
        baseline=positional_baseline(args.baselines),
        probe_positions=args.probe_positions, windows_per_doc=args.windows_per_doc, n_folds=args.folds,
    )
    study = positional["study"]
    print_result(args, study.table(), study.summary(), positional["wrote"])
    return 0


def positional_baseline(baselines: list[str]) -> str | None:
    """The one baseline the positional analyses take: ``random_init`` or ``None``."""
    if not baselines:
        return None
    if baselines != ["random_init"]:
        raise InputError(f"the positional analyses compare with the model's random initialisation only; pass "
                         f"--baselines random_init or --baselines none, not {','.join(baselines)}")
    return "random_init"
