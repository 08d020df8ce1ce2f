"""``equivariance-probe scan``: the same text at several context lengths, trained vs baselines, per layer group:
one table and figure, and a result file per length and variant (reused when run again)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common import check_writable, measurement, memory_limit, model_source_of, print_result, read_documents
from ..options import MEASURED, MODEL_OPTIONS, add_shared_options, int_list, positive

NAME = "scan"
#: Its place in ``equivariance-probe --help``.
ORDER = 70
SUMMARY = 'the same text at several context lengths, trained vs baselines, per layer group: one table and figure'
DETAILS = (
    'Each length of --context-lengths reads the same --n-tokens window tokens (in place of --n-docs and '
    '--context-length). Result files are written per length and variant as they are measured, and reused when'
    ' the scan runs again into the same --out (so it needs no --resume or --checkpoint-every); no shards, no '
    "--sample-size (no scatter plot), no --analyses (run 'positional'), and the Hugging Face framework only, "
    'no --framework (every framework gives the same numbers); its table and figure are what it writes, so no '
    '--no-figures.'
    ' No --sink-epsilon: its table reports no sink rate.'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``scan``'s options."""
    from ...runs.scan import DEFAULT_CONTEXT_LENGTHS, DEFAULT_SCAN

    parser.add_argument("--context-lengths", type=int_list, default=list(DEFAULT_CONTEXT_LENGTHS),
                        help=f"comma-separated window lengths (default: {','.join(map(str, DEFAULT_CONTEXT_LENGTHS))})")
    parser.add_argument("--n-tokens", type=positive, default=DEFAULT_SCAN["n_tokens"],
                        help="window tokens per length: N // T_max windows of the longest length, and the same text cut "
                             "into shorter windows at every other length (default %(default)s)")
    add_shared_options(parser, "out", *MODEL_OPTIONS, "corpus", "text_field", "batch_size", "pack", "baselines", *MEASURED,
                       "memory_limit_gib", "no_progress", "json", "figure_format", differ={
        "batch_size": ({"default": None}, f"default {DEFAULT_SCAN['batch_tokens']} // T at each length, at least 1, "
                                          "so that every length's batch holds about as many tokens"),
        "pack": ({"help": "concatenate the documents (tokenised without special tokens, EOS between them) and cut "
                          "windows of exactly T tokens, each after the tokenizer's special prefix"},
                 "default: the first T_max tokens of each document long enough, cut into windows of T"),
        "baselines": ({"default": list(DEFAULT_SCAN["baselines"])},
                      "default random_init: every baseline is measured at every length")})


def handle(args: argparse.Namespace) -> int:
    from ...display.scan import save_scan
    from ...runs.scan import length_folder, scan_context_lengths
    from ...runs.study import result_filename

    out = Path(args.out)
    check_writable(out)
    scan = scan_context_lengths(
        model_source_of(args), context_lengths=args.context_lengths, corpus=read_documents(args), n_tokens=args.n_tokens,
        pack=args.pack, baselines=args.baselines, batch_size=args.batch_size, seed=args.seed,
        options=measurement(args), out=out, memory_limit=memory_limit(args), progress=not args.no_progress,
    )
    paths = save_scan(scan, out, format=args.figure_format)
    measured = [out / length_folder(length) / result_filename(variant) for length, variants in scan.results.items()
                for variant in variants if variant not in scan.reused[length]]
    reused = sum(len(variants) for variants in scan.reused.values())
    note = f"\n\n{reused} results reused from {out}" if reused else ""
    differences = ("Differences with their 95 % intervals, paired span by span:\n\n" + scan.difference_table())
    print_result(args, f"{scan.config['text_description']}\n\n{scan.table()}\n\n{differences}{note}", scan.rows(),
           list(paths.values()) + measured)
    return 0
