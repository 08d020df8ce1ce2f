"""``equivariance-probe run``: the whole study on a model and corpus, trained weights against their baselines,
writing results, figures and a summary (:func:`~equivariance_probe.runs.study.run_study`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common import (check_study_fits, check_writable, finished, measurement, model_source_of, positional_into,
                      print_result, read_documents, study_options)
from ...errors import InputError
from ..options import MEASURED, MODEL_OPTIONS, add_shared_options, given_options

NAME = "run"
#: Its place in ``equivariance-probe --help``.
ORDER = 10
SUMMARY = 'run the study on a model and corpus and write results, figures and a summary'
DETAILS = (
    'Trained weights vs baselines over the same windows; checkpoints (--checkpoint-every, --resume, as shift '
    'does) and splits the corpus into shards (--shard).'
)

__all__ = ["NAME", "ORDER", "SUMMARY", "DETAILS", "arguments", "handle", "apply_sink_protocol", "PROTOCOL_OPTIONS"]

#: The options Gu et al.'s protocol sets (``--sink-protocol``): recorded when typed, so that it fills only the others.
PROTOCOL_OPTIONS = ("n_docs", "context_length", "exclude_keys")


def arguments(parser: argparse.ArgumentParser) -> None:
    """``run``'s options."""
    add_shared_options(parser, "out", *MODEL_OPTIONS, "framework", "corpus", "text_field", "n_docs", "context_length",
                       "batch_size", "pack", "baselines", *MEASURED, "sample_size", "memory_limit_gib", "no_progress",
                       "json", differ={"memory_limit_gib": ({"help": "refuse a study whose estimated memory exceeds "
                                                                      "this many GiB"},
                                                             "default: no check, the study runs as loaded")},
                       given=PROTOCOL_OPTIONS)
    add_shared_options(parser, "analyses", differ={"analyses": ({"default": [], "help": (
        "also run positional analyses (at most 8 windows of 256 tokens, one per document; the probes 2 per "
        "document), comma-separated as for 'positional', or 'all'")}, "default none: the study alone, the analyses only when asked for")})
    add_shared_options(parser, "checkpoint_every", "resume")
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help="run only shard I of N (contiguous slices of the documents, I from 0), writing OUT/shard-I-of-N; "
                             "'auto' takes RANK/WORLD_SIZE (torchrun, accelerate) or the Slurm array task "
                             "(SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of SLURM_ARRAY_TASK_COUNT, sbatch --array). "
                             "Merge the shards' results.safetensors")
    parser.add_argument("--sink-protocol", action="store_true",
                        help="Gu et al.'s attention-sink protocol (ICLR 2025, Table 1): 100 documents, 64-token windows "
                             "(one per document, not --pack), no excluded keys, filling --n-docs, --context-length and "
                             "--exclude-keys where they are not given (a given value that differs is refused), so that "
                             "the sink rate compares with their table")
    add_shared_options(parser, "sink_epsilon", "no_figures", "figure_format")


def handle(args: argparse.Namespace) -> int:
    from ...display.figures import heatmaps_figure, save_figures, study_figures
    from ...records.sharding import Shard
    from ...runs.checkpoint import CHECKPOINT_FOLDER, clear_checkpoint, has_checkpoint
    from ...runs.study import run_study

    out = Path(args.out)
    shard = None
    if args.shard is not None:  # each shard writes its own subfolder, so all ranks can share one --out
        shard = Shard.from_environment() if args.shard.strip() == "auto" else Shard.parse(args.shard)
        out = out / f"shard-{shard.index}-of-{shard.count}"
    check_writable(out)
    args.checkpoint_folder = out / CHECKPOINT_FOLDER  # for the note of a run that stops (see main)
    if args.resume and not has_checkpoint(out / CHECKPOINT_FOLDER) and finished(out / "results.safetensors"):
        # Killed after its results were written, while its checkpoint was being cleared: nothing is left to run.
        clear_checkpoint(out / CHECKPOINT_FOLDER)
        print(f"the run in {out} had finished: its results are in {out / 'results.safetensors'}")
        return 0
    if args.sink_protocol:
        apply_sink_protocol(args)
    if args.memory_limit_gib is not None:
        check_study_fits(args)
    documents = read_documents(args)
    study = run_study(
        model_source_of(args),
        **study_options(args, documents),
        options=measurement(args),
        checkpoint_dir=None if args.checkpoint_every == 0 else out / CHECKPOINT_FOLDER,
        checkpoint_every=args.checkpoint_every or None,
        resume=args.resume,
        shard=shard,
        pack=args.pack,
    )
    # results.safetensors is written only here, after every variant finished (complete: true); a run that
    # stops leaves only its checkpoint.
    study.sink_epsilon = args.sink_epsilon
    wrote = list(study.save(out).values()) + [out / "summary.md"]
    if not args.no_figures:
        wrote += save_figures(study_figures(study.trained, study.baselines(), sink_epsilon=args.sink_epsilon), out,
                              format=args.figure_format)
        for name, result in study.baselines().items():
            wrote += save_figures({"heatmaps": heatmaps_figure(result)}, out, prefix=f"baseline_{name}_",
                                  format=args.figure_format)
    numbers = {name: result.summary(epsilon=args.sink_epsilon) for name, result in study.results.items()}
    if args.analyses:
        positional = positional_into(
            out, args, model_name=args.model, analyses=args.analyses, documents=documents,
            n_docs=min(args.n_docs, 8), context_length=min(args.context_length, 256),
            prompt_length=min(args.context_length, 64),
        )
        wrote += positional["wrote"]
        numbers["positional"] = positional["study"].summary()
    print_result(args, study.report_text(), numbers, wrote)
    clear_checkpoint(out / CHECKPOINT_FOLDER)  # only once the results are on disk
    return 0


def apply_sink_protocol(args: argparse.Namespace) -> None:
    """Fill the options of Gu et al.'s protocol (:data:`~equivariance_probe.runs.study.SINK_PROTOCOL`) that were not
    typed; refuse one typed with another value, and ``--pack`` (their windows are each text's first tokens).

    Raises:
        InputError: naming the flag that contradicts the protocol.
    """
    from ...runs.study import SINK_PROTOCOL

    typed = given_options(args)
    for name, value in SINK_PROTOCOL.items():
        if name in typed and getattr(args, name) != value:
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} {_shown(getattr(args, name))} contradicts --sink-protocol, which runs Gu et al.'s "
                             f"protocol with {flag} {_shown(value) or '(none)'}; drop {flag}, or drop --sink-protocol")
        setattr(args, name, value)
    if args.pack:
        raise InputError("--pack contradicts --sink-protocol, whose windows are the first 64 tokens of each text as "
                         "the tokenizer gives them; drop --pack, or drop --sink-protocol")


def _shown(value: object) -> str:
    """An option's value as it is typed (a list comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)
