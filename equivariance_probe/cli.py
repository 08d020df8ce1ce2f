"""The command-line program ``equivariance-probe``.

Place in the seams: the top floor, argparse only. Each subcommand composes a run
(:mod:`equivariance_probe.runs`) with its display (:mod:`equivariance_probe.display`), prints a
short human summary (a table; ``--json`` prints the numbers for machines instead) and says which
files it wrote.

* ``run``        — the whole study on a model and corpus (default: Gemma 3 270M on the packaged
  Wikipedia articles, trained vs random init vs zero), writing results, figures and a summary.
* ``merge``      — add result files of shards of one study into one.
* ``show``       — the headline numbers of result files, read from their headers (no array is loaded;
  ``--verify`` reads every array and checks it against its digest).
* ``verify``     — read every array of result files and check it against the digest stored when it was written.
* ``report``     — an offline HTML report from a results file (``--views``: with CircuitsVis
  views of the most and least position-bound heads, reloading the model the results name).
* ``compare``    — the study on several models over the same windows, one table and figure.
* ``scan``       — the same text at several context lengths, trained vs baselines, per layer group:
  one table and figure, and a result file per length and variant (reused when run again).
* ``positional`` — where order comes from: position-embedding Gram matrices, TISA kernel fits,
  permutation sensitivity, variance shrinkage, position correlations, linear position probes.

Options shared by several commands are declared once (:func:`shared_options`) and each subcommand takes
them with :func:`add_shared_options`, so a flag has one spelling and one meaning everywhere; where a
default differs, its help says why. Bad arguments exit with status 2 and a message that names the problem and the fix in this program's flags
(:data:`FLAGS` tells :func:`~equivariance_probe.errors.option` how the API's arguments are spelt here).
A command that writes into an output folder holds that folder's lock while it runs
(:func:`~equivariance_probe.runs.checkpoint.lock_output_folder`); SIGTERM stops a run before its next
batch and exits with status 143 (128 + 15, what a shell reports for a process the signal ended).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from .errors import EquivarianceProbeError, FileWriteError, InputError, ModelNotFoundError, StopRequested, command_line_options
from .records.fileformat import jsonable, write_text_atomically

__all__ = ["main", "build_parser", "shared_options", "add_shared_options", "HelpFormatter", "FLAGS"]

#: While a command runs (:func:`main`): the output folders' locks it holds, released when it ends.
_HELD: ContextVar[contextlib.ExitStack | None] = ContextVar("equivariance_probe_held_locks", default=None)

#: API argument -> the flag that sets it here, so that error messages name the flag.
FLAGS = {
    "model": "--model",
    "models": "--models",
    "source": "--corpus",
    "corpus": "--corpus",
    "text_field": "--text-field",
    "n_docs": "--n-docs",
    "context_length": "--context-length",
    "batch_size": "--batch-size",
    "baselines": "--baselines",
    "exclude_keys": "--exclude-keys",
    "seed": "--seed",
    "sample_size": "--sample-size",
    "keep_pattern": "--keep-pattern",
    "checkpoint_dir": "--out",
    "checkpoint_every": "--checkpoint-every",
    "resume": "--resume",
    "shard": "--shard",
    "device": "--device",
    "dtype": "--dtype",
    "analyses": "--analyses",
    "memory_limit": "--memory-limit-gib",
    "heads": "--heads",
    "head": "--view-head",
    "attn_implementation": "--attn-implementation",
    "document": "--document",
    "allow_duplicate_windows": "--allow-duplicate-windows",
    "pack": "--pack",
    "context_lengths": "--context-lengths",
    "n_tokens": "--n-tokens",
    "interval_groups": "--interval-groups",
    "backend": "--framework",
    "framework": "--framework",
    "offsets": "--offsets",
    "segment_length": "--segment-length",
    "n_segments": "--n-segments",
    "n_contexts": "--n-contexts",
    "mode": "--mode",
    "format": "--figure-format",
}


# -- argument types ----------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as '0' or '0,1', got {text!r}") from None


def _integer_at_least(minimum: int, name: str):
    """An argparse type: an integer >= ``minimum``, else a message naming ``name``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {name}, got {value}")
        return value

    return parse


_positive = _integer_at_least(1, "a positive integer")
_non_negative = _integer_at_least(0, "a non-negative integer")


def _analyses(text: str) -> list[str]:
    from .runs.positional import ANALYSES

    names = list(ANALYSES) if text.strip().lower() == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ANALYSES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown analyses {unknown}; choose from {', '.join(ANALYSES)} or 'all'")
    return names


def _figure_formats(text: str) -> str:
    """``--figure-format``: checked here, so that a wrong format is refused before any model loads."""
    from .display.figures import figure_formats

    with command_line_options(FLAGS):
        try:
            return ",".join(figure_formats(text))
        except InputError as error:
            raise argparse.ArgumentTypeError(str(error)) from None


def _names(text: str) -> list[str]:
    """Comma-separated names; ``none`` for none."""
    return [] if text.strip().lower() == "none" else [part.strip() for part in text.split(",") if part.strip()]


# -- the parser ----------------------------------------------------------------------------------
class _Deprecated(argparse.Action):
    """An old spelling of an option: stores the value under the new one and says so on stderr."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        new = "--" + self.dest.replace("_", "-")
        print(f"equivariance-probe: {option_string} is deprecated; use {new} (the old spelling goes in the next "
              "release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping a comma-separated list (``gram,attention_toeplitz,...``) after a
    comma instead of inside a name: argparse's own wrapping (textwrap) breaks only at spaces, so a
    list without spaces is cut wherever the line ends ("correlati" / "on")."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        lines: list[str] = []
        line = ""
        # Pieces end at a space or right after a comma; a piece after a comma joins without a space.
        for match in re.finditer(r"[^\s,]*,(?=\S)|\S+?(?=\s|$)|\S+", text):
            piece = match.group()
            joint = "" if not line or (match.start() > 0 and not text[match.start() - 1].isspace()) else " "
            if line and len(line) + len(joint) + len(piece) > width:
                lines.append(line)
                line = piece
            else:
                line += joint + piece
        return lines + [line] if line else lines


#: Where an option's default on a subcommand differs from its default elsewhere, its help says why,
#: after this word (checked by the tests: one spelling and one meaning for every shared option).
WHY = "here"


def shared_options() -> dict[str, tuple[tuple[str, ...], dict[str, Any]]]:
    """Every option that several subcommands take, declared once: name -> ``(flags, argparse keywords)``.

    A subcommand takes them with :func:`add_shared_options`, naming the ones that make sense for it
    and, where its default differs, the default and why.
    """
    from .runs.positional import ANALYSES
    from .adapters.registry import DEFAULT_FRAMEWORK, framework_names
    from .runs.study import BASELINES, DEFAULT_STUDY
    from .statistics.groups import DEFAULT_INTERVAL_GROUPS

    return {
        "out": (("-o", "--out"), {"required": True, "help": "output folder (created if missing)"}),
        "model": (("--model",), {"default": "gemma-3-270m", "help": "packaged model name, local model folder, or a "
                                 "hub name already cached (default: gemma-3-270m)"}),
        "cache_dir": (("--cache-dir",), {"default": None, "help": "where converted packaged models are cached"}),
        "framework": (("--framework",), {
            "default": DEFAULT_FRAMEWORK, "choices": list(framework_names()),
            "help": f"the framework that runs the model: {DEFAULT_FRAMEWORK} (default), transformer_lens (a TransformerBridge) "
                    "or nnsight (local); every framework gives the same numbers"}),
        "attn_implementation": (("--attn-implementation",), {
            "default": "sdpa", "help": "the attention kernel the model runs: sdpa (default), eager or flash_attention_2; "
                                       "the probe reads queries and keys whatever the kernel"}),
        "device": (("--device",), {"default": "auto", "help": "where the model runs: auto (CUDA if available, else CPU), "
                                                               "cpu, cuda or cuda:N (default auto)"}),
        "dtype": (("--dtype",), {"default": None, "choices": ["float32", "bfloat16", "float16"],
                                 "help": "the model's parameter dtype (default: as loaded, float32)"}),
        "corpus": (("--corpus",), {"default": None, "help": "text file, folder of .txt, .jsonl, or a datasets "
                                   "save_to_disk folder (default: the packaged Wikipedia articles)"}),
        "text_field": (("--text-field",), {"default": "text", "help": "JSONL field / dataset column holding the text"}),
        "n_docs": (("--n-docs",), {"type": _positive, "default": DEFAULT_STUDY["n_docs"], "help": "documents, one window each "
                                   "(default %(default)s)"}),
        "context_length": (("--context-length",), {"type": _positive, "default": DEFAULT_STUDY["context_length"],
                                                   "help": "window length in tokens (default %(default)s)"}),
        "batch_size": (("--batch-size",), {"type": _positive, "default": DEFAULT_STUDY["batch_size"],
                                           "help": "windows per forward pass (default %(default)s)"}),
        "pack": (("--pack",), {"action": "store_true", "help": (
            "concatenate the documents (tokenised without special tokens, EOS between them) and cut windows of "
            "exactly T tokens, each after the tokenizer's special prefix (BOS for Gemma and Llama), as "
            "TransformerLens' tokenize_and_concatenate; default: one window per document, its first T tokens")}),
        "baselines": (("--baselines",), {"type": _names, "default": list(BASELINES), "help": (
            f"comma-separated baselines from {','.join(sorted(BASELINES))}, or 'none' (default: {','.join(BASELINES)})")}),
        "exclude_keys": (("--exclude-keys",), {"type": _int_list, "default": [], "help": (
            "key positions left out of every statistic, e.g. '0' for the first token (attention sink)")}),
        "seed": (("--seed",), {"type": int, "default": 0,
                               "help": "seed of random initialisations, samples and permutations (default %(default)s)"}),
        "sample_size": (("--sample-size",), {"type": _non_negative, "default": 20000,
                                             "help": "entries sampled for the scatter plot (default %(default)s)"}),
        "keep_pattern": (("--keep-pattern",), {"action": "store_true", "help": (
            "also keep the window-summed pattern (8*L*H*T^2 bytes per variant, in memory and in each result file) "
            "for the Toeplitz R² of the document-averaged pattern")}),
        "interval_groups": (("--interval-groups",), {"type": _non_negative, "default": DEFAULT_INTERVAL_GROUPS, "help": (
            "groups of windows (by fingerprint) for the 95%% intervals, a delete-a-group jackknife; 0 for none "
            "(default %(default)s)")}),
        "memory_limit_gib": (("--memory-limit-gib",), {"type": float, "default": None, "help": (
            "refuse work whose estimated memory exceeds this many GiB (default: the memory available)")}),
        "analyses": (("--analyses",), {"type": _analyses, "default": "all", "help": (
            f"positional analyses, comma-separated from {','.join(ANALYSES)}, or 'all' (default)")}),
        "no_progress": (("--no-progress",), {"action": "store_true", "help": "no progress bars"}),
        "json": (("--json",), {"action": "store_true", "help": "print the numbers as JSON instead of a table"}),
        "no_figures": (("--no-figures",), {"action": "store_true", "help": (
            "write the results and their summary or table only: no figures, no report (e.g. for shards)")}),
        "figure_format": (("--figure-format",), {"type": _figure_formats, "default": "png", "metavar": "FORMATS", "help": (
            "the figures' files, comma-separated from png,svg,pdf (e.g. png,svg,pdf for a paper: SVG text as paths, "
            "PDF fonts embedded; default png)")}),
    }


#: A shared option's "(default ...)" clause, one level of parentheses inside allowed.
_DEFAULT_CLAUSE = re.compile(r"\s*\(default\b[^()]*(?:\([^()]*\)[^()]*)*\)")


def add_shared_options(parser: argparse.ArgumentParser, *names: str,
                       differ: dict[str, tuple[dict[str, Any], str]] | None = None) -> argparse.ArgumentParser:
    """Give ``parser`` the shared options ``names`` (:func:`shared_options`), spelt and explained as everywhere.

    Args:
        parser: a subcommand's parser.
        names: the options that make sense for it.
        differ: ``{name: (changes, why)}`` for an option whose default (or meaning) differs on this
            subcommand: the argparse keywords that change, and why, which the help then says.
    """
    declared = shared_options()
    differ = differ or {}
    unknown = sorted((set(names) | set(differ)) - set(declared))
    if unknown:
        raise ValueError(f"no shared options {unknown}; declare them in shared_options()")
    for name in names:
        flags, keywords = declared[name]
        keywords = dict(keywords)
        if name in differ:
            changes, why = differ[name]
            keywords.update(changes)
            help_text = changes.get("help", keywords["help"])
            if "default" in changes:  # the shared help's default is not this command's: one default, stated once
                help_text = _DEFAULT_CLAUSE.sub("", help_text)
                if "default" not in why:
                    help_text += " (default %(default)s)"
            keywords["help"] = f"{help_text}; {WHY}: {why}"
        parser.add_argument(*flags, **keywords)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .runs.checkpoint import DEFAULT_CHECKPOINT_EVERY
    from .runs.compare import DEFAULT_COMPARE_MODELS, DEFAULT_COMPARISON
    from .runs.scan import DEFAULT_CONTEXT_LENGTHS, DEFAULT_SCAN

    parser = argparse.ArgumentParser(
        prog="equivariance-probe", formatter_class=HelpFormatter,
        description="How much does attention depend on absolute position? Exact, streaming attention statistics.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str, details: str = "") -> argparse.ArgumentParser:
        """A subcommand whose help starts with its one-line ``summary`` (``details``: what it leaves out, and why)."""
        return commands.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}. {details}".strip(),
                                   formatter_class=HelpFormatter)

    model_options = ("model", "cache_dir", "attn_implementation", "device", "dtype")
    measured = ("exclude_keys", "seed", "interval_groups", "keep_pattern")

    run = command("run", "run the study on a model and corpus and write results, figures and a summary",
                  "Trained weights vs baselines over the same windows; the only command that checkpoints "
                  "(--checkpoint-every, --resume) and splits the corpus into shards (--shard).")
    add_shared_options(run, "out", *model_options, "framework", "corpus", "text_field", "n_docs", "context_length",
                       "batch_size", "pack", "baselines", *measured, "sample_size", "memory_limit_gib", "no_progress",
                       "json", differ={"memory_limit_gib": ({"help": "refuse a study whose estimated memory exceeds "
                                                                      "this many GiB"},
                                                             "default: no check, the study runs as loaded")})
    run.set_defaults(handler=_run)
    run.add_argument("--backend", dest="framework", choices=shared_options()["framework"][1]["choices"],
                     action=_Deprecated, help="deprecated spelling of --framework (removed in the next release)")
    add_shared_options(run, "analyses", differ={"analyses": ({"default": [], "help": (
        "also run positional analyses (at most 8 windows of 256 tokens, one per document; the probes 2 per "
        "document), comma-separated as for 'positional', or 'all'")}, "default none: the study alone, the analyses only when asked for")})
    run.add_argument("--checkpoint-every", type=_non_negative, default=DEFAULT_CHECKPOINT_EVERY,
                     help="save a checkpoint in OUT/checkpoint every N documents (0: never; default %(default)s)")
    run.add_argument("--resume", action="store_true",
                     help="continue the interrupted run whose checkpoint is in OUT/checkpoint (same model, corpus, options)")
    run.add_argument("--shard", default=None, metavar="I/N",
                     help="run only shard I of N (contiguous slices of the documents, I from 0), writing OUT/shard-I-of-N; "
                          "'auto' takes RANK/WORLD_SIZE (torchrun, accelerate) or the Slurm array task "
                          "(SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of SLURM_ARRAY_TASK_COUNT, sbatch --array). "
                          "Merge the shards' results.safetensors")
    run.add_argument("--sink-protocol", action="store_true",
                     help="Gu et al.'s attention-sink protocol (ICLR 2025, Table 1): 100 documents, 64-token windows, no "
                          "excluded keys, in place of --n-docs, --context-length and --exclude-keys, so that the sink "
                          "rate (share of heads with α₁ > 0.3) compares with their table")
    add_shared_options(run, "no_figures", "figure_format")

    merge = command("merge", "merge result files of shards into one",
                    "Reads and writes result files only: no model, corpus or progress bar.")
    add_shared_options(merge, "json")
    merge.set_defaults(handler=_merge)
    merge.add_argument("inputs", nargs="+", help="result files to merge (any format version)")
    merge.add_argument("-o", "--out", default=None,
                       help=f"the merged result file (required); {WHY}: a file, not a folder, since merge writes one result")
    merge.add_argument("--output", dest="out", action=_Deprecated, help="deprecated spelling of -o/--out")
    merge.add_argument("--allow-duplicate-windows", action="store_true",
                       help="merge results that share windows (the same token ids), counting those windows twice "
                            "(default: refused, naming how many are shared)")

    show = command("show", "print the headline numbers of result files",
                   "Reads each file's header only: instant, whatever the file's size. Shift results "
                   "(shift_<variant>.safetensors, from 'shift') print as one table, a row per file, read whole; "
                   "positional studies (positional.safetensors) as their table. --csv prints any of them in long "
                   "form.")
    show.set_defaults(handler=_show)
    show.add_argument("results", nargs="+", help="result files (any format version), one column each; or shift "
                                                 "results, one row each")
    add_shared_options(show, "json", differ={"json": ({"help": "print the stored summaries as JSON instead of a table"},
                                                      "the whole stored summary and metadata of each file")})
    show.add_argument("--csv", action="store_true",
                      help="print every file's numbers as one long table in CSV, a row per statistic and split (model, "
                           "layer group, layer, head) with its interval and the run's model, variant and run id: "
                           "the rows of to_dataframe(), which --json also gives under 'rows'")
    show.add_argument("--explain", action="store_true",
                      help="under the shift results' table, a plain reading of each of its columns (what pair η² "
                           "is, the residual stream's unit, ...)")
    show.add_argument("--verify", action="store_true",
                      help="also read every array and check it against the digest stored when the file was written "
                           "(a few MB hashed per default result file; see 'verify')")

    verify = command("verify", "read every array of result files and check it against its digest",
                     "Reads each file whole and refuses one whose data does not match the digest stored when it was "
                     "written, naming the file and the array.")
    verify.set_defaults(handler=_verify)
    verify.add_argument("results", nargs="+", help="result files (any format version)")

    report = command("report", "write an offline HTML report from a results file",
                     "With --views, CircuitsVis views of the most and least position-bound heads, reloading the "
                     "model the results name (offline).")
    report.set_defaults(handler=_report)
    report.add_argument("results", help="a results.safetensors written by 'run' (or a result file of any version)")
    report.add_argument("-o", "--out", default=None,
                        help=f"the HTML file; {WHY}: a file, not a folder, since a report is one page "
                             "(default: report.html next to the results)")
    report.add_argument("--output", dest="out", action=_Deprecated, help="deprecated spelling of -o/--out")
    add_shared_options(report, "cache_dir", "corpus", "no_progress", differ={
        "no_progress": ({}, "a report draws no progress bar (it reloads at most one model and one document); the "
                            "flag is taken so that a script can pass the same flags to every command"),
        "corpus": ({"help": (
        "corpus to take the viewed document from")}, "default: the study's")})
    report.add_argument("--views", action="store_true",
                        help="add CircuitsVis views of heads: reloads the model named in the results (offline) and one document")
    report.add_argument("--heads", default=None, help="heads to view, e.g. 'L4H3,L5H1' (default: the 2 most and 2 least position-bound)")
    report.add_argument("--document", type=_non_negative, default=0, help="index of the corpus document to view (default 0)")
    report.add_argument("--start", type=_non_negative, default=0, help="first position shown")
    report.add_argument("--stop", type=_positive, default=None, help="position after the last shown (default: start + 128)")
    report.add_argument("--decimals", type=int, default=3, help="round view values to this many decimals (default 3)")

    compare = command("compare", "run the study on several models over the same windows: one table and figure",
                      "The models are named by --models (not --model). Every model reads the same texts, cut so "
                      "that each tokenizer yields T tokens (so no --pack). "
                      "No checkpoints or shards (each model's study is short: use 'run' per model for long ones), no "
                      "--sample-size (the comparison draws no scatter plot), no --analyses (run 'positional' per "
                      "model), and the Hugging Face framework only, no --framework (every framework gives the same "
                      "numbers); its table and figure are what it writes, so no --no-figures.")
    compare.set_defaults(handler=_compare)
    compare.add_argument("--models", type=_names, default=list(DEFAULT_COMPARE_MODELS),
                         help=f"comma-separated packaged model names or local model folders (default: {','.join(DEFAULT_COMPARE_MODELS)})")
    sized = "sized so that the three packaged models, trained and at random initialisation, finish in well under 30 minutes on 2 CPU cores"
    add_shared_options(compare, "out", "cache_dir", "attn_implementation", "device", "dtype", "corpus", "text_field",
                       "n_docs", "context_length", "batch_size", "baselines", *measured, "memory_limit_gib",
                       "no_progress", "json", "figure_format", differ={
        "n_docs": ({"default": DEFAULT_COMPARISON["n_docs"]}, sized),
        "context_length": ({"default": DEFAULT_COMPARISON["context_length"]}, sized),
        "baselines": ({"default": list(DEFAULT_COMPARISON["baselines"])},
                      "default random_init: each model against its own initialisation (every zero model is the same "
                      "uniform attention)")})

    scan = command("scan", "the same text at several context lengths, trained vs baselines, per layer group: one "
                   "table and figure",
                   "Each length of --context-lengths reads the same --n-tokens window tokens (in place of --n-docs "
                   "and --context-length). Result files are written per length and variant as they are measured, "
                   "and reused when the scan runs again into the same --out (so it needs no --resume); no shards, "
                   "no --sample-size (no scatter plot), no --analyses (run 'positional'), and the Hugging Face "
                   "framework only, no --framework (every framework gives the same numbers); its table and figure "
                   "are what it writes, so no --no-figures.")
    scan.set_defaults(handler=_scan)
    scan.add_argument("--context-lengths", type=_int_list, default=list(DEFAULT_CONTEXT_LENGTHS),
                      help=f"comma-separated window lengths (default: {','.join(map(str, DEFAULT_CONTEXT_LENGTHS))})")
    scan.add_argument("--n-tokens", type=_positive, default=DEFAULT_SCAN["n_tokens"],
                      help="window tokens per length: N // T_max windows of the longest length, and the same text cut "
                           "into shorter windows at every other length (default %(default)s)")
    add_shared_options(scan, "out", *model_options, "corpus", "text_field", "batch_size", "pack", "baselines", *measured,
                       "memory_limit_gib", "no_progress", "json", "figure_format", differ={
        "batch_size": ({"default": None}, f"default {DEFAULT_SCAN['batch_tokens']} // T at each length, at least 1, "
                                          "so that every length's batch holds about as many tokens"),
        "pack": ({"help": "concatenate the documents (tokenised without special tokens, EOS between them) and cut "
                          "windows of exactly T tokens, each after the tokenizer's special prefix"},
                 "default: the first T_max tokens of each document long enough, cut into windows of T"),
        "baselines": ({"default": list(DEFAULT_SCAN["baselines"])},
                      "default random_init: every baseline is measured at every length")})

    positional = command("positional", "where order comes from: Gram/TISA Toeplitzness, permutation symmetry, "
                         "variance shrinkage, position correlations, linear position probes",
                         "The analyses read hidden states and position embeddings of the Hugging Face model (no "
                         "--framework) in a few short windows, one per document (no --pack), on the CPU in float32 as "
                         "loaded (no --device, --dtype or --memory-limit-gib); no checkpoints or shards, no "
                         "--interval-groups or --sample-size (their numbers have no intervals and no scatter plot), "
                         "and no --keep-pattern (the attention Toeplitz R² keeps the pattern always); its figures are "
                         "what it writes, so no --no-figures.")
    positional.set_defaults(handler=_positional)
    small = "the analyses' windows are few and short, since some keep every hidden state"
    add_shared_options(positional, "out", "model", "cache_dir", "attn_implementation", "corpus", "text_field", "n_docs",
                       "context_length", "batch_size", "exclude_keys", "seed", "analyses", "no_progress", "json",
                       "figure_format", differ={
        "n_docs": ({"default": 8}, small),
        "context_length": ({"default": 256}, small)})
    add_shared_options(positional, "baselines", differ={"baselines": ({"default": ["random_init"]},
                       "random_init (default) also measures shrinkage and correlations at the model's own random "
                       "initialisation, none the trained model only: the positional analyses compare with the "
                       "random initialisation alone")})
    positional.add_argument("--n-prompts", type=_positive, default=4, help="prompts for the permutation analysis")
    positional.add_argument("--prompt-length", type=_positive, default=64,
                            help="tokens per prompt of the permutation analysis (default %(default)s)")
    positional.add_argument("--n-permutations", type=_positive, default=8,
                            help="random orders of each prompt's tokens in the permutation analysis (default %(default)s)")
    positional.add_argument("--kernels", type=_positive, default=5, help="S, kernels of the TISA fit")
    positional.add_argument("--probe-positions", type=_positive, default=32,
                            help="positions per window of the linear position probes, a stratified sample of 1..T-1 "
                                 "(default %(default)s)")
    positional.add_argument("--windows-per-doc", type=_positive, default=2,
                            help="consecutive windows of each document for the probes, whose folds hold documents "
                                 "out (default %(default)s)")
    positional.add_argument("--folds", type=_integer_at_least(2, "an integer of at least 2"), default=5,
                            help="document folds (GroupKFold) of the probes' held-out scores (default %(default)s)")
    positional.add_argument("--baseline", dest="baselines", type=_names, action=_Deprecated,
                            help="deprecated spelling of --baselines (removed in the next release)")
    _add_shift_command(command("shift", "move the same texts through the window: what their attention, residual stream "
                                        "and predictions owe to the offset, to what precedes them and to the tokens themselves",
                               "Trained weights vs baselines on one grid of segments, contexts and offsets, each run "
                               "through --framework. Not taken: "
                               "--context-length and --n-docs (each window is the special prefix, an offset's worth of "
                               "context and a segment: --offsets, --segment-length, --n-segments, --n-contexts), --pack, "
                               "--exclude-keys, --keep-pattern, --sample-size and --analyses (they shape the study's "
                               "windows and sums, not the shift grid's), --memory-limit-gib (the grid's memory is "
                               "one segment's, measured in the guide) and --resume, --shard, --checkpoint-every "
                               "(run's only)."), model_options)
    return parser


# -- shared checks -------------------------------------------------------------------------------
def _check_corpus(corpus: str | None) -> None:
    if corpus is not None and not Path(corpus).exists():
        raise InputError(f"corpus {corpus!r} does not exist; pass a text file, a folder, a .jsonl file or a dataset folder")


def _check_writable(folder: Path) -> None:
    """Refuse an output folder that cannot be written, then hold its lock until the command ends."""
    from .runs.checkpoint import lock_output_folder

    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe_file = folder / ".write_test"
        probe_file.write_text("")
        probe_file.unlink()
    except OSError as error:
        raise InputError(
            f"cannot write to the output folder {str(folder)!r} ({error.strerror or error}); choose a writable --out"
        ) from None
    held = _HELD.get()
    if held is not None:
        held.enter_context(lock_output_folder(folder))


def _checkpoint_note(args: argparse.Namespace) -> str:
    """How to continue a ``run`` that stopped: from its checkpoint with ``--resume`` where it has one."""
    from .runs.checkpoint import has_checkpoint

    folder = getattr(args, "checkpoint_folder", None)
    if folder is not None and has_checkpoint(folder):
        return f"the checkpoint in {folder} is intact: run the same command with --resume to continue from it"
    if args.command == "run":
        return "no checkpoint was written yet: run the same command again"
    return "run the same command again"


def _finished(path: Path) -> bool:
    """Whether ``path`` is a complete result file (a finished run's)."""
    from .result import ProbeResult

    try:
        return path.is_file() and ProbeResult.load(path).complete
    except EquivarianceProbeError:
        return False


def _documents(args: argparse.Namespace) -> Any:
    """The corpus the command reads: ``None`` (the packaged one), a path, or texts read with ``--text-field``."""
    _check_corpus(args.corpus)
    if args.corpus is not None and args.text_field != "text":
        from .sources.corpus import load_corpus

        return load_corpus(args.corpus, text_field=args.text_field)
    return args.corpus


def _measurement(args: argparse.Namespace, **changes: Any) -> Any:
    """The :class:`~equivariance_probe.probe.MeasurementOptions` the command's flags set (each subcommand
    has the flags that make sense for it; ``changes`` sets what it decides itself)."""
    from .probe import MEASUREMENT_FIELDS, MeasurementOptions

    # --device places the model (the sums follow it), so it is not the options' device of the sums.
    given = {name: getattr(args, name) for name in MEASUREMENT_FIELDS
             if name != "device" and getattr(args, name, None) is not None}
    return MeasurementOptions(**{**given, **changes})


def _study_options(args: argparse.Namespace, documents: Any) -> dict[str, Any]:
    """The keyword arguments ``run`` and ``compare`` pass alike to their study function."""
    return dict(corpus=documents, n_docs=args.n_docs, baselines=args.baselines, seed=args.seed, cache_dir=args.cache_dir,
                progress=not args.no_progress, attn_implementation=args.attn_implementation)


def _check_study_fits(args: argparse.Namespace) -> None:
    """Refuse a study whose model, at ``--context-length`` and ``--batch-size``, would need more than ``--memory-limit-gib``."""
    from .sources.devices import parse_dtype
    from .sources.resources import check_fits, estimate_memory_of

    estimate = estimate_memory_of(args.model, context_length=args.context_length, batch_size=args.batch_size,
                                  copies=2 if args.baselines else 1, dtype=parse_dtype(args.dtype),
                                  keep_pattern=args.keep_pattern, cache_dir=args.cache_dir)
    check_fits({args.model: estimate}, _memory_limit(args), what="",
               fix="Lower --batch-size or --context-length, or raise --memory-limit-gib.")


def _memory_limit(args: argparse.Namespace) -> int | None:
    """``--memory-limit-gib`` in bytes (``None``: the memory available)."""
    return None if args.memory_limit_gib is None else int(args.memory_limit_gib * 2**30)


def _print(args: argparse.Namespace, table: str, numbers: Any, wrote: Sequence[Path]) -> None:
    print(json.dumps(jsonable(numbers), indent=1) if args.json else table)
    if wrote:
        print(f"wrote {', '.join(str(path) for path in wrote)}", file=sys.stderr if args.json else sys.stdout)


# -- the commands --------------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    from .display.figures import heatmaps_figure, save_figures, study_figures
    from .records.sharding import Shard
    from .runs.checkpoint import CHECKPOINT_FOLDER, clear_checkpoint, has_checkpoint
    from .runs.study import run_study

    out = Path(args.out)
    shard = None
    if args.shard is not None:  # each shard writes its own subfolder, so all ranks can share one --out
        shard = Shard.from_environment() if args.shard.strip() == "auto" else Shard.parse(args.shard)
        out = out / f"shard-{shard.index}-of-{shard.count}"
    _check_writable(out)
    args.checkpoint_folder = out / CHECKPOINT_FOLDER  # for the note of a run that stops (see main)
    if args.resume and not has_checkpoint(out / CHECKPOINT_FOLDER) and _finished(out / "results.safetensors"):
        # Killed after its results were written, while its checkpoint was being cleared: nothing is left to run.
        clear_checkpoint(out / CHECKPOINT_FOLDER)
        print(f"the run in {out} had finished: its results are in {out / 'results.safetensors'}")
        return 0
    if args.sink_protocol:
        from .runs.study import SINK_PROTOCOL

        for name, value in SINK_PROTOCOL.items():
            setattr(args, name, value)
    if args.memory_limit_gib is not None:
        _check_study_fits(args)
    documents = _documents(args)
    study = run_study(
        args.model,
        **_study_options(args, documents),
        options=_measurement(args),
        framework=args.framework,
        checkpoint_dir=None if args.checkpoint_every == 0 else out / CHECKPOINT_FOLDER,
        checkpoint_every=args.checkpoint_every or None,
        resume=args.resume,
        shard=shard,
        device=args.device,
        dtype=args.dtype,
        pack=args.pack,
    )
    # results.safetensors is written only here, after every variant finished (complete: true); a run that
    # stops leaves only its checkpoint.
    wrote = list(study.save(out).values()) + [out / "summary.md"]
    if not args.no_figures:
        wrote += save_figures(study_figures(study.trained, study.baselines()), out, format=args.figure_format)
        for name, result in study.baselines().items():
            wrote += save_figures({"heatmaps": heatmaps_figure(result)}, out, prefix=f"baseline_{name}_",
                                  format=args.figure_format)
    numbers = {name: result.summary() for name, result in study.results.items()}
    if args.analyses:
        positional = _positional_into(
            out, args, model_name=args.model, analyses=args.analyses, documents=documents,
            n_docs=min(args.n_docs, 8), context_length=min(args.context_length, 256),
            prompt_length=min(args.context_length, 64),
        )
        wrote += positional["wrote"]
        numbers["positional"] = positional["study"].summary()
    _print(args, study.report_text(), numbers, wrote)
    clear_checkpoint(out / CHECKPOINT_FOLDER)  # only once the results are on disk
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .result import ProbeResult

    if args.out is None:
        raise InputError("merge needs the file to write: -o/--out merged.safetensors")
    results = [ProbeResult.load(path) for path in args.inputs]
    for result in results:
        result.statistics  # every input's arrays read and checksum-verified before anything is merged
    partial = [path for path, result in zip(args.inputs, results) if not result.complete]
    merged = results[0]
    for other in results[1:]:
        merged = merged.merge(other, allow_duplicate_windows=args.allow_duplicate_windows)
    output = merged.save(args.out)
    if partial:  # the numbers are exact sums of what was measured; the file says it is partial
        print(f"equivariance-probe merge: note: {', '.join(map(str, partial))} "
              f"{'is a partial result' if len(partial) == 1 else 'are partial results'} of a run that stopped, "
              "so the merged result is partial (complete: false)", file=sys.stderr)
    shards = merged.metadata.get("shards")
    missing = sorted(set(range(shards["count"])) - set(shards["indices"])) if shards else []
    note = f"; shards {missing} of {shards['count']} are still missing" if missing else ""
    table = f"merged {len(results)} results ({merged.n_windows} windows, {merged.n_tokens} tokens){note}"
    _print(args, table, {"summary": merged.summary(), "missing_shards": missing}, [output])
    return 0


def _show(args: argparse.Namespace) -> int:
    from .records.container import file_kind, header_kind
    from .result import ProbeResult
    from .runs.positional import POSITIONAL_KIND
    from .runs.study import BASELINES
    from .runs.tables import summary_table
    from .shift_result import SHIFT_KIND

    for path in args.results:
        file_kind(path)  # a file that cannot be read is named as such, whatever kind the others are
    if args.csv and args.json:
        raise InputError("show prints one form: pass --csv (the long table) or --json (the summaries and the same "
                         "rows), not both")
    if args.csv:
        return _show_rows(args)
    # Shift results and positional studies each print as their own table, never beside probe results.
    for kind, handler, plural, one in ((SHIFT_KIND, _show_shift, "shift results", "a shift result"),
                                       (POSITIONAL_KIND, _show_positional, "positional studies", "a positional study")):
        files = [path for path in args.results if header_kind(path) == kind]
        if files:
            if len(files) != len(args.results):
                others = [str(path) for path in args.results if path not in files]
                raise InputError(f"show puts {plural} and probe results in different tables; {others[0]!r} is not "
                                 f"{one}: show each kind on its own")
            return handler(args)
    results = {str(path): ProbeResult.load(path) for path in args.results}
    if args.verify:
        for result in results.values():
            result.verify()  # every array read and checked against its digest before anything is printed
    if args.json:
        print(json.dumps(jsonable({path: {"model": result.model_name, "variant": result.metadata.get("label"),
                                          "complete": result.complete, "integrity": result.integrity,
                                          "arrays_verified": args.verify, "metadata": result.metadata,
                                          "summary": result.summary(), "rows": result.to_rows()}
                                   for path, result in results.items()}), indent=1))
        print(_verification_note(results, args.verify), file=sys.stderr)
        return 0
    # The study's order, whatever the shell's glob gave: the trained model first, then its baselines.
    def study_order(item: tuple[int, tuple[str, ProbeResult]]) -> tuple[int, int]:
        index, (_, result) = item
        label = result.metadata.get("label")
        return (0 if label == "trained" else 1 if label in BASELINES else 2, index)

    ordered = [pair for _, pair in sorted(enumerate(results.items()), key=study_order)]
    columns: dict[str, dict[str, Any]] = {}
    for path, result in ordered:
        label = str(result.metadata.get("label") or Path(path).name)
        label = label if label not in columns else f"{label} ({path})"
        summary = result.summary()
        if summary.get("n_windows", 0) == 0:
            raise InputError(f"{path} holds no windows (an empty result): there is nothing to show")
        columns[label] = summary
        state = "" if result.complete else " (PARTIAL: the run stopped before the end)"
        named = path if label == Path(path).name else f"{label} ({path})"
        print(f"{named}: model {result.model_name}, {summary['n_windows']} windows, log floor eps = "
              f"{result.log_floor:.3g}, excluded keys {list(result.excluded_keys) or 'none'}{state}")
    print("\nQuery-position R² over every visible entry (log scale: y = log max(a, eps)), with 95 % intervals over "
          "windows where the file has them\n")
    print(summary_table(columns, extended=True))
    print("\n" + _verification_note(results, args.verify))
    return 0


def _verification_note(results: dict[str, Any], verified: bool) -> str:
    """What ``show`` read of the files: their headers alone, or every array checked too."""
    older = [path for path, result in results.items() if result.integrity != "digests"]
    note = ("every array was read and matches its digest" if verified else
            "read from the headers alone: the arrays were not read or checked (--verify, or the 'verify' command, "
            "checks every array against its digest)")
    if older:
        note += (f"; unverified array by array: {', '.join(older)} "
                 f"{'was' if len(older) == 1 else 'were'} written before per-array digests"
                 + (" (a whole-file checksum, where the format has one, was checked instead)" if verified else ""))
    return note


def _show_positional(args: argparse.Namespace) -> int:
    """``show`` of positional studies (``positional.safetensors``): each file's table of analyses, read whole (its
    arrays checked against its checksum), or with ``--json`` the stored summaries."""
    from .runs.positional import PositionalStudy

    studies = {str(path): PositionalStudy.load(path) for path in args.results}
    if args.json:
        print(json.dumps(jsonable({path: {"model": study.model_name, "metadata": study.metadata,
                                          "summary": study.summary(), "skipped": study.skipped,
                                          "rows": study.to_rows()}
                                   for path, study in studies.items()}), indent=1))
        return 0
    for path, study in studies.items():
        print(f"{path}: positional analyses of {study.model_name}\n")
        print(study.table() + "\n")
    return 0


def _show_shift(args: argparse.Namespace) -> int:
    """``show`` of shift results: one row per file, labelled ``<folder>/<variant>`` (the shift command writes
    ``shift_<variant>.safetensors``), as :func:`~equivariance_probe.runs.tables.shift_table`; every file is read
    whole, its arrays checked against its checksum."""
    from .runs.tables import shift_column_readings, shift_table
    from .shift_result import ShiftResult

    # The study's order whatever the shell's glob gave: folders as given, in each the trained model first.
    folder_of = {path: Path(path).resolve().parent for path in args.results}
    folders = list(dict.fromkeys(folder_of.values()))
    ordered = sorted(args.results, key=lambda path: (folders.index(folder_of[path]), Path(path).stem != "shift_trained"))
    summaries = {}
    for path in ordered:
        result = ShiftResult.load(path)
        label = f"{folder_of[path].name}/{Path(path).stem.removeprefix('shift_')}"
        dtype = result.metadata.get("model", {}).get("dtype")
        summaries[label if label not in summaries else str(path)] = {**result.summary(), "file": str(path),
                                                                     "dtype": dtype, "rows": result.to_rows()}
    if args.json:
        print(json.dumps(jsonable(summaries), indent=1))
        return 0
    for label, summary in summaries.items():
        state = "" if summary["complete"] else " (PARTIAL: the run stopped before the end)"
        print(f"{label}: {summary['file']}: model {summary['model']} ({summary['dtype']}), {summary['mode']} mode, "
              f"offsets {summary['offsets']}{state}")
    print("\nThe shift test: shares of the variance of the segment's centred attention logits and of its residual "
          "stream, with 95 % intervals over segments where the file has them\n")
    print(shift_table(summaries))
    if args.explain:
        print("\n" + shift_column_readings())
    else:
        print("\n(--explain gives a plain reading of each column)")
    return 0


def _show_rows(args: argparse.Namespace) -> int:
    """``show --csv``: every file's long-form rows (``to_rows()`` of its result, whatever its kind) as one CSV table."""
    from .analyses.tidy import COLUMNS
    from .records.container import header_kind
    from .result import ProbeResult
    from .runs.positional import POSITIONAL_KIND, PositionalStudy
    from .runs.tables import csv_text
    from .shift_result import SHIFT_KIND, ShiftResult

    rows = []
    for path in args.results:
        kind = header_kind(path)
        result = (ShiftResult.load(path) if kind == SHIFT_KIND else
                  PositionalStudy.load(path) if kind == POSITIONAL_KIND else ProbeResult.load(path))
        if args.verify and isinstance(result, ProbeResult):
            result.verify()
        rows += result.to_rows()
    sys.stdout.write(csv_text(rows) if rows else ",".join(COLUMNS) + "\n")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .result import ProbeResult

    failed = 0
    for path in args.results:
        try:
            integrity = ProbeResult.load(path).verify()
        except EquivarianceProbeError as error:
            print(f"equivariance-probe verify: error: {error}", file=sys.stderr)
            failed += 1
            continue
        print({"digests": f"{path}: every array matches its digest",
               "checksum": f"{path}: unverified array by array (written before per-array digests); its arrays match "
                           "its whole-file checksum",
               "unverified": f"{path}: unverified (format 1 holds no checksum to check against)"}[integrity])
    return 2 if failed else 0


def _report(args: argparse.Namespace) -> int:
    from .display.positional import positional_report_section
    from .display.report import render_report
    from .display.views import parse_heads, views_for_result
    from .result import ProbeResult
    from .runs.positional import PositionalStudy
    from .runs.study import load_study_baselines

    result = ProbeResult.load(args.results)
    output = Path(args.out) if args.out else Path(args.results).with_name("report.html")
    # A study's trained result: its baselines lie beside it, shown side by side.
    baselines, missing = load_study_baselines(args.results, result)
    if missing:
        print(f"the study's baselines {missing} are not beside {args.results}; reporting without them", file=sys.stderr)
    views = None
    if args.views:
        heads = parse_heads(args.heads) if args.heads else None  # bad heads: exit 2, not a silent report
        try:
            views, note = views_for_result(result, heads=heads, document=args.document, corpus=args.corpus,
                                           start=args.start, stop=args.stop, decimals=args.decimals,
                                           cache_dir=args.cache_dir)
            print(note)
        except ModelNotFoundError as error:
            print(f"writing the report without views: {error}", file=sys.stderr)
    # The positional analyses' section, when the study wrote them beside its results.
    candidates = [Path(args.results).with_name(name) for name in ("positional.safetensors", "positional.json")]
    positional = next((path for path in candidates if path.is_file()), None)
    extra = [positional_report_section(PositionalStudy.load(positional))] if positional is not None else []
    render_report(result, baselines=baselines, views=views, extra_sections=extra).save(output)
    print(f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB)")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .display.comparison import save_comparison
    from .runs.compare import compare_models

    out = Path(args.out)
    _check_writable(out)
    comparison = compare_models(args.models, **_study_options(args, _documents(args)), options=_measurement(args),
                                memory_limit=_memory_limit(args), device=args.device, dtype=args.dtype)
    paths = save_comparison(comparison, out, format=args.figure_format)
    _print(args, comparison.table(), comparison.rows(), list(paths.values()) + [out / "models"])
    return 0


def _scan(args: argparse.Namespace) -> int:
    from .display.scan import save_scan
    from .runs.scan import length_folder, scan_context_lengths
    from .runs.study import result_filename

    out = Path(args.out)
    _check_writable(out)
    scan = scan_context_lengths(
        args.model, context_lengths=args.context_lengths, corpus=_documents(args), n_tokens=args.n_tokens,
        pack=args.pack, baselines=args.baselines, batch_size=args.batch_size, seed=args.seed,
        options=_measurement(args), out=out, cache_dir=args.cache_dir,
        memory_limit=_memory_limit(args), device=args.device, dtype=args.dtype,
        progress=not args.no_progress, attn_implementation=args.attn_implementation,
    )
    paths = save_scan(scan, out, format=args.figure_format)
    measured = [out / length_folder(length) / result_filename(variant) for length, variants in scan.results.items()
                for variant in variants if variant not in scan.reused[length]]
    reused = sum(len(variants) for variants in scan.reused.values())
    note = f"\n\n{reused} results reused from {out}" if reused else ""
    differences = ("Differences with their 95 % intervals, paired span by span:\n\n" + scan.difference_table())
    _print(args, f"{scan.config['text_description']}\n\n{scan.table()}\n\n{differences}{note}", scan.rows(),
           list(paths.values()) + measured)
    return 0


def _positional_into(out: Path, args: argparse.Namespace, *, model_name: str, analyses: list[str], documents: Any,
                     context_length: int, **settings: Any) -> dict[str, Any]:
    """Run the positional analyses into ``out``: ``positional.safetensors``, one PNG per analysis, ``positional.html``."""
    from .display.figures import save_figures
    from .display.positional import positional_figures, render_positional_page
    from .probe import MeasurementOptions
    from .runs.positional import run_positional
    from .sources.corpus import load_corpus
    from .sources.models import load_positional_model

    model, tokenizer = load_positional_model(model_name, cache_dir=args.cache_dir,
                                             attn_implementation=args.attn_implementation)
    docs = load_corpus(documents) if isinstance(documents, (str, Path)) else documents
    study = run_positional(model, tokenizer, docs=docs, analyses=analyses, seed=args.seed, progress=not args.no_progress,
                           options=MeasurementOptions(context_length=context_length, batch_size=args.batch_size,
                                                      exclude_keys=args.exclude_keys), **settings)
    wrote = [study.save(out / "positional.safetensors")]
    wrote += save_figures(positional_figures(study), out, prefix="positional_", format=args.figure_format)
    page = out / "positional.html"
    write_text_atomically(page, render_positional_page(study))
    return {"study": study, "wrote": wrote + [page]}


def _positional_baseline(baselines: list[str]) -> str | None:
    """The one baseline the positional analyses take: ``random_init`` or ``None``."""
    if not baselines:
        return None
    if baselines != ["random_init"]:
        raise InputError(f"the positional analyses compare with the model's random initialisation only; pass "
                         f"--baselines random_init or --baselines none, not {','.join(baselines)}")
    return "random_init"


def _positional(args: argparse.Namespace) -> int:
    out = Path(args.out)
    _check_writable(out)
    positional = _positional_into(
        out, args, model_name=args.model, analyses=args.analyses, documents=_documents(args),
        n_docs=args.n_docs, context_length=args.context_length, n_prompts=args.n_prompts,
        prompt_length=args.prompt_length, n_permutations=args.n_permutations, n_kernels=args.kernels,
        baseline=_positional_baseline(args.baselines),
        probe_positions=args.probe_positions, windows_per_doc=args.windows_per_doc, n_folds=args.folds,
    )
    study = positional["study"]
    _print(args, study.table(), study.summary(), positional["wrote"])
    return 0


# -- the shift test: the same text moved through the window ---------------------------------------------
def _add_shift_command(shift: argparse.ArgumentParser, model_options: tuple[str, ...]) -> None:
    from .sources.shift_grid import DEFAULT_SHIFT, SHIFT_MODES

    shift.set_defaults(handler=_shift)
    add_shared_options(shift, "out", *model_options, "framework", "corpus", "text_field", "batch_size", "baselines", "seed",
                       "interval_groups", "no_progress", "json", differ={
                           "baselines": ({"default": []}, "default none: each baseline is a second run of the whole "
                                                          "grid; random_init for the model's own initialisation"),
                           "batch_size": ({"default": 1}, "default 1: a segment's windows differ in length by "
                                                          "their offsets, and padding them costs more than it saves "
                                                          "on a CPU"),
                       })
    shift.add_argument("--n-segments", type=_positive, default=DEFAULT_SHIFT["n_segments"],
                       help="texts to move, one per document (default %(default)s)")
    shift.add_argument("--n-contexts", type=_positive, default=DEFAULT_SHIFT["n_contexts"],
                       help="preceding texts, from other documents (default %(default)s)")
    shift.add_argument("--segment-length", type=_positive, default=DEFAULT_SHIFT["segment_length"],
                       help="tokens per segment (default %(default)s)")
    shift.add_argument("--offsets", type=_int_list, default=None,
                       help="comma-separated offsets (default: 6 from 0 to a 1024-token window, both sides of a sliding "
                            "window)")
    shift.add_argument("--mode", choices=SHIFT_MODES, default="text",
                       help="text (default): context tokens precede the segment; position_ids: the segment alone with its "
                            "position ids moved")
    add_shared_options(shift, "no_figures", "figure_format")
    shift.add_argument("--view-head", default=None,
                       help="the head of the report's CircuitsVis view, e.g. 'L4H3' (default: the head whose centred "
                            "logits the offset moves most)")


def _shift(args: argparse.Namespace) -> int:
    """``equivariance-probe shift``: the shift test on the trained model and each baseline; one
    ``shift_<variant>.safetensors`` per variant and a table (``--json``: the summaries)."""
    from .probe import EquivarianceProbe
    from .runs.study import check_baselines, variant_builders
    from .runs.tables import shift_result_readings
    from .sources.corpus import load_corpus
    from .sources.devices import parse_dtype, resolve_device
    from .sources.models import PACKAGED_ENCODERS, load_model, load_positional_model
    from .sources.packing import special_prefix
    from .sources.shift_grid import check_shift_options, default_offsets, split_documents

    out = Path(args.out)
    _check_writable(out)
    check_baselines(args.baselines)
    # Everything that needs no model is checked before one loads (a minute for a packaged model's first load).
    check_shift_options(offsets=args.offsets, segment_length=args.segment_length, mode=args.mode,
                        n_contexts=args.n_contexts)
    # Loaded as run_study loads it: the Hugging Face model wrapped for --framework; each baseline is built from it
    # and wrapped the same way, so trained and baselines run through one framework.
    if args.model in PACKAGED_ENCODERS:  # the packaged BERT encoder: the segment ends the window, attention both ways
        if args.framework != "huggingface":
            raise InputError(f"the packaged encoder {args.model!r} runs as a Hugging Face model only; drop --framework "
                             f"{args.framework}")
        model, tokenizer = load_positional_model(args.model, cache_dir=args.cache_dir)
        model = model.to(device=resolve_device(args.device), dtype=parse_dtype(args.dtype))
    else:
        model, tokenizer = load_model(args.model, args.framework, cache_dir=args.cache_dir, dtype=parse_dtype(args.dtype),
                                      attn_implementation=args.attn_implementation, device=resolve_device(args.device))
    probe = EquivarianceProbe(model, tokenizer=tokenizer)
    offsets = args.offsets or default_offsets(probe.adapter.layout.max_context, len(special_prefix(tokenizer)),
                                              args.segment_length, probe.adapter.layout.sliding_windows)
    documents = _documents(args)
    documents = load_corpus(documents) if documents is None or isinstance(documents, (str, Path)) else documents
    segments, contexts = split_documents(
        documents, tokenizer, n_segments=args.n_segments, n_contexts=1 if args.mode == "position_ids" else args.n_contexts,
        segment_length=args.segment_length, context_length=max(offsets))
    options = dict(offsets=offsets, segment_length=args.segment_length, mode=args.mode, batch_size=args.batch_size,
                   interval_groups=args.interval_groups)
    results, wrote = {}, []
    for name, build in variant_builders(model, args.baselines, args.seed):  # one baseline in memory at a time
        results[name] = EquivarianceProbe(build(), tokenizer=tokenizer).shift(
            segments, None if args.mode == "position_ids" else contexts,
            progress=False if args.no_progress else f"{name}: segments", **options)
        results[name].metadata["study"] = {"model": args.model, "variant": name}  # as the user named them
        wrote.append(results[name].save(out / f"shift_{name}.safetensors"))
    if not args.no_figures:
        wrote += _shift_display(out, probe, results, segments, None if args.mode == "position_ids" else contexts,
                                args.view_head, args.figure_format)
    table = "\n\n".join(f"[{name}]\n{result.table()}" for name, result in results.items())
    _print(args, f"{table}\n\n{shift_result_readings()}", {name: result.summary() for name, result in results.items()},
           wrote)
    return 0


def _shift_display(out: Path, probe: Any, results: dict[str, Any], segments: list[Any], contexts: list[Any] | None,
                   head: str | None, figure_format: str) -> list[Path]:
    """The shift run's figures (``shift_*.png``, or the ``figure_format`` files; the trained model beside its baselines) and
    ``shift_report.html`` with the CircuitsVis view of one head at the smallest and largest offsets."""
    from .display.figures import save_figures
    from .display.shift import render_shift_report, shift_figures, shift_view

    trained = results["trained"]
    baselines = {name: result for name, result in results.items() if name != "trained"}
    wrote = save_figures(shift_figures(trained, baselines), out, format=figure_format)
    view = shift_view(probe, segments, contexts, result=trained, head=head)
    return wrote + [render_shift_report(trained, baselines, view=view).save(out / "shift_report.html")]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input or a file that cannot be written,
    130 interrupted, 143 stopped by SIGTERM)."""
    args = build_parser().parse_args(argv)
    try:
        with command_line_options(FLAGS), _stop_on_sigterm(), contextlib.ExitStack() as held:
            token = _HELD.set(held)
            try:
                status = args.handler(args)
            finally:
                _HELD.reset(token)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at the interpreter's exit
        return status
    except EquivarianceProbeError as error:
        if isinstance(error, FileWriteError) and args.command == "run":  # the checkpoint is intact: say how to go on
            error = f"{error}; {_checkpoint_note(args)}"
        print(f"equivariance-probe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except StopRequested:
        print(f"equivariance-probe {args.command}: stopped by SIGTERM before the next batch; {_checkpoint_note(args)}",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`show ... | head`): what it read is all it wanted. Point stdout at
        # /dev/null so that the interpreter's final flush does not raise again (Python's documented recipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


@contextlib.contextmanager
def _stop_on_sigterm():
    """While the command runs, SIGTERM (what Slurm and Kubernetes send before SIGKILL) asks every run
    to stop before its next batch (:data:`~equivariance_probe.probe.STOP_REQUESTED`), so that what the
    checkpoint holds is kept and the stop says how to resume; a second SIGTERM ends the process at once."""
    from .probe import STOP_REQUESTED

    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def request_stop(signum: int, frame: Any) -> None:
        STOP_REQUESTED.set()
        signal.signal(signum, signal.SIG_DFL)

    previous = signal.signal(signal.SIGTERM, request_stop)
    try:
        yield
    finally:
        # None: the previous handler was not set from Python; the default is what Python starts with.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        STOP_REQUESTED.clear()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
