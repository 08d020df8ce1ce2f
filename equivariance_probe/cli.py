"""The command-line program ``equivariance-probe``.

Place in the seams: the top floor, argparse only. Each subcommand composes a run
(:mod:`equivariance_probe.runs`) with its display (:mod:`equivariance_probe.display`), prints a
short human summary (a table; ``--json`` prints the numbers for machines instead) and says which
files it wrote.

* ``run``        — the whole study on a model and corpus (default: Gemma 3 270M on the packaged
  Wikipedia articles, trained vs random init vs zero), writing results, figures and a summary.
* ``merge``      — add result files of shards of one study into one.
* ``show``       — the headline numbers of result files, read from their headers (no array is loaded).
* ``report``     — an offline HTML report from a results file (``--views``: with CircuitsVis
  views of the most and least position-bound heads, reloading the model the results name).
* ``compare``    — the study on several models over the same windows, one table and figure.
* ``scan``       — the same text at several context lengths, trained vs baselines, per layer group:
  one table and figure, and a result file per length and variant (reused when run again).
* ``positional`` — where order comes from: position-embedding Gram matrices, TISA kernel fits,
  permutation sensitivity, variance shrinkage, position correlations.

Options shared by several commands are declared once, in parent parsers. Bad arguments exit with
status 2 and a message that names the problem and the fix in this program's flags
(:data:`FLAGS` tells :func:`~equivariance_probe.errors.option` how the API's arguments are spelt here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import EquivarianceProbeError, InputError, ModelNotFoundError, command_line_options
from .records.fileformat import jsonable

__all__ = ["main", "build_parser", "FLAGS"]

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
    "attn_implementation": "--attn-implementation",
    "document": "--document",
    "allow_duplicate_windows": "--allow-duplicate-windows",
    "pack": "--pack",
    "context_lengths": "--context-lengths",
    "n_tokens": "--n-tokens",
    "interval_groups": "--interval-groups",
    "offsets": "--offsets",
    "segment_length": "--segment-length",
    "n_segments": "--n-segments",
    "n_contexts": "--n-contexts",
    "mode": "--mode",
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


def _parent(*arguments: tuple[tuple[str, ...], dict[str, Any]]) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    for flags, options in arguments:
        parent.add_argument(*flags, **options)
    return parent


def build_parser() -> argparse.ArgumentParser:
    from .runs.checkpoint import DEFAULT_CHECKPOINT_EVERY
    from .runs.compare import DEFAULT_COMPARE_MODELS, DEFAULT_COMPARISON
    from .runs.scan import DEFAULT_CONTEXT_LENGTHS, DEFAULT_SCAN
    from . import __version__
    from .runs.positional import ANALYSES
    from .runs.study import BASELINES, DEFAULT_STUDY
    from .statistics.groups import DEFAULT_INTERVAL_GROUPS

    # One function per shared option group: argparse shares a parent's actions with every child,
    # so each subcommand gets its own copy (its defaults differ).
    def output() -> argparse.ArgumentParser:
        return _parent((("-o", "--out"), {"required": True, "help": "output folder (created if missing)"}))

    def model() -> argparse.ArgumentParser:
        return _parent(
            (("--model",), {"default": "gemma-3-270m",
                            "help": "packaged model name, local model folder, or a hub name already cached (default: gemma-3-270m)"}),
            (("--cache-dir",), {"default": None, "help": "where converted packaged models are cached"}),
        )

    def kernel() -> argparse.ArgumentParser:
        return _parent((("--attn-implementation",), {
            "default": "sdpa", "help": "the attention kernel the model runs: sdpa (default), eager or flash_attention_2; "
                                       "the probe reads queries and keys whatever the kernel"}))

    def corpus() -> argparse.ArgumentParser:
        return _parent(
            (("--corpus",), {"default": None, "help": "text file, folder of .txt, .jsonl, or a datasets save_to_disk folder "
                                                      "(default: the packaged Wikipedia articles)"}),
            (("--text-field",), {"default": "text", "help": "JSONL field / dataset column holding the text"}),
        )

    def windows(n_docs: int, context_length: int, batch_size: int) -> argparse.ArgumentParser:
        return _parent(
            (("--n-docs",), {"type": _positive, "default": n_docs, "help": "documents, one window each (default %(default)s)"}),
            (("--context-length",), {"type": _positive, "default": context_length,
                                     "help": "window length in tokens (default %(default)s)"}),
            (("--batch-size",), {"type": _positive, "default": batch_size, "help": "windows per forward pass (default %(default)s)"}),
        )

    def measured() -> argparse.ArgumentParser:
        return _parent(
            (("--exclude-keys",), {"type": _int_list, "default": [],
                                   "help": "key positions left out of every statistic, e.g. '0' for the first token (attention sink)"}),
            (("--seed",), {"type": int, "default": 0, "help": "seed of random initialisations, samples and permutations"}),
        )

    def intervals() -> argparse.ArgumentParser:
        return _parent((("--interval-groups",), {
            "type": _non_negative, "default": DEFAULT_INTERVAL_GROUPS,
            "help": "groups of windows (by fingerprint) for the 95%% intervals, a delete-a-group jackknife; "
                    "0 for none (default %(default)s)"}))

    def baselines(default: Sequence[str]) -> argparse.ArgumentParser:
        return _parent((("--baselines",), {"type": _names, "default": list(default),
                                           "help": f"comma-separated baselines from {sorted(BASELINES)}, or 'none' "
                                                   f"(default: {','.join(default)})"}))

    def packing(default: str) -> argparse.ArgumentParser:
        return _parent((("--pack",), {
            "action": "store_true",
            "help": "concatenate the documents (tokenised without special tokens, EOS between them) and cut windows of "
                    "exactly T tokens, each after the tokenizer's special prefix (BOS for Gemma and Llama), as "
                    f"TransformerLens' tokenize_and_concatenate; default: {default}"}))

    def memory() -> argparse.ArgumentParser:
        return _parent((("--memory-limit-gib",), {
            "type": float, "default": None,
            "help": "refuse work whose estimated memory exceeds this many GiB (default: the memory available)"}))

    def display() -> argparse.ArgumentParser:
        return _parent(
            (("--no-progress",), {"action": "store_true", "help": "no progress bars"}),
            (("--json",), {"action": "store_true", "help": "print the numbers as JSON instead of a table"}),
        )

    parser = argparse.ArgumentParser(
        prog="equivariance-probe",
        description="How much does attention depend on absolute position? Exact, streaming attention statistics.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", parents=[output(), model(), kernel(), corpus(), windows(**DEFAULT_STUDY),
                                              packing("one window per document, its first T tokens"),
                                              baselines(BASELINES), measured(), intervals(), display()],
                              help="run the study on a model and corpus and write results and figures")
    run.set_defaults(handler=_run)
    run.add_argument("--backend", default="huggingface", choices=["huggingface", "transformer_lens", "nnsight"],
                     help="the framework that runs the model: huggingface (default), transformer_lens (a TransformerBridge) "
                          "or nnsight (local); every backend gives the same numbers")
    run.add_argument("--sample-size", type=_non_negative, default=20000, help="entries sampled for the scatter plot")
    run.add_argument("--keep-pattern", action="store_true",
                     help="also keep the window-summed pattern (8*L*H*T^2 bytes per variant, in memory and in each "
                          "result file) for the Toeplitz R² of the document-averaged pattern")
    run.add_argument("--analyses", type=_analyses, default=[],
                     help="also run positional analyses (at most 8 windows of 256 tokens), comma-separated from "
                     f"{','.join(ANALYSES)}, or 'all' (see 'positional')")
    run.add_argument("--checkpoint-every", type=_non_negative, default=DEFAULT_CHECKPOINT_EVERY,
                     help="save a checkpoint in OUT/checkpoint every N documents (0: never; default %(default)s)")
    run.add_argument("--resume", action="store_true",
                     help="continue the interrupted run whose checkpoint is in OUT/checkpoint (same model, corpus, options)")
    run.add_argument("--shard", default=None, metavar="I/N",
                     help="run only shard I of N (contiguous slices of the documents, I from 0), writing OUT/shard-I-of-N; "
                          "'auto' takes RANK/WORLD_SIZE (torchrun, accelerate). Merge the shards' results.safetensors")
    run.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N")
    run.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="the model's parameter dtype (default: as loaded, float32)")
    run.add_argument("--no-figures", action="store_true", help="write results and summary only (e.g. for shards)")

    merge = commands.add_parser("merge", parents=[display()], help="merge result files of shards into one")
    merge.set_defaults(handler=_merge)
    merge.add_argument("inputs", nargs="+", help="result files to merge (any format version)")
    merge.add_argument("-o", "--out", default=None,
                       help="the merged result file (required; the folder-writing commands take a folder as --out)")
    merge.add_argument("--output", dest="out", action=_Deprecated, help="deprecated spelling of -o/--out")
    merge.add_argument("--allow-duplicate-windows", action="store_true",
                       help="merge results that share windows (the same token ids), counting those windows twice "
                            "(default: refused, naming how many are shared)")

    show = commands.add_parser("show", help="print the headline numbers of result files (header only: instant, "
                                            "whatever the file's size)")
    show.set_defaults(handler=_show)
    show.add_argument("results", nargs="+", help="result files (any format version), one column each")
    show.add_argument("--json", action="store_true", help="print the stored summaries as JSON instead of a table")

    report = commands.add_parser("report", help="write an offline HTML report from a results file")
    report.set_defaults(handler=_report)
    report.add_argument("results", help="a results.safetensors written by 'run' (or a result file of any version)")
    report.add_argument("-o", "--out", default=None, help="the HTML file (default: report.html next to the results)")
    report.add_argument("--output", dest="out", action=_Deprecated, help="deprecated spelling of -o/--out")
    report.add_argument("--views", action="store_true",
                        help="add CircuitsVis views of heads: reloads the model named in the results (offline) and one document")
    report.add_argument("--heads", default=None, help="heads to view, e.g. 'L4H3,L5H1' (default: the 2 most and 2 least position-bound)")
    report.add_argument("--document", type=_non_negative, default=0, help="index of the corpus document to view (default 0)")
    report.add_argument("--corpus", default=None, help="corpus to take the document from (default: the study's)")
    report.add_argument("--start", type=_non_negative, default=0, help="first position shown")
    report.add_argument("--stop", type=_positive, default=None, help="position after the last shown (default: start + 128)")
    report.add_argument("--decimals", type=int, default=3, help="round view values to this many decimals (default 3)")

    sizes = {key: DEFAULT_COMPARISON[key] for key in ("n_docs", "context_length", "batch_size")}
    compare = commands.add_parser("compare", parents=[output(), kernel(), corpus(), windows(**sizes),
                                                      baselines(DEFAULT_COMPARISON["baselines"]), measured(), memory(), intervals(),
                                                      display()],
                                  help="run the study on several models over the same windows: one table and figure")
    compare.set_defaults(handler=_compare)
    compare.add_argument("--models", type=_names, default=list(DEFAULT_COMPARE_MODELS),
                         help=f"comma-separated packaged model names or local model folders (default: {','.join(DEFAULT_COMPARE_MODELS)})")
    compare.add_argument("--cache-dir", default=None, help="where converted packaged models are cached")

    scan = commands.add_parser(
        "scan", parents=[output(), model(), kernel(), corpus(),
                         packing("the first T_max tokens of each document long enough, cut into windows of T"),
                         baselines(DEFAULT_SCAN["baselines"]), measured(), memory(), display()],
        help="the same text at several context lengths, trained vs baselines, per layer group: one table and figure")
    scan.set_defaults(handler=_scan)
    scan.add_argument("--context-lengths", type=_int_list, default=list(DEFAULT_CONTEXT_LENGTHS),
                      help=f"comma-separated window lengths (default: {','.join(map(str, DEFAULT_CONTEXT_LENGTHS))})")
    scan.add_argument("--n-tokens", type=_positive, default=DEFAULT_SCAN["n_tokens"],
                      help="window tokens per length: N // T_max windows of the longest length, and the same text cut "
                           "into shorter windows at every other length (default %(default)s)")
    scan.add_argument("--batch-size", type=_positive, default=None,
                      help=f"windows per forward pass at every length (default: {DEFAULT_SCAN['batch_tokens']} // T, at least 1)")

    positional = commands.add_parser(
        "positional", parents=[output(), model(), corpus(), windows(n_docs=8, context_length=256, batch_size=4), measured(),
                               display()],
        help="where order comes from: Gram/TISA Toeplitzness, permutation symmetry, variance shrinkage")
    positional.set_defaults(handler=_positional)
    positional.add_argument("--analyses", type=_analyses, default="all",
                            help=f"comma-separated from {','.join(ANALYSES)}, or 'all' (default)")
    positional.add_argument("--n-prompts", type=_positive, default=4, help="prompts for the permutation analysis")
    positional.add_argument("--prompt-length", type=_positive, default=64,
                            help="tokens per prompt of the permutation analysis (default %(default)s)")
    positional.add_argument("--n-permutations", type=_positive, default=8,
                            help="random orders of each prompt's tokens in the permutation analysis (default %(default)s)")
    positional.add_argument("--kernels", type=_positive, default=5, help="S, kernels of the TISA fit")
    positional.add_argument("--baselines", default="random_init", choices=["random_init", "none"],
                            help="random_init (default): shrinkage and correlations also at the model's own random "
                                 "initialisation; none: the trained model only (one baseline at most here: the "
                                 "positional analyses compare with the random initialisation alone)")
    positional.add_argument("--baseline", dest="baselines", choices=["random_init", "none"], action=_Deprecated,
                            help="deprecated spelling of --baselines (removed in the next release)")
    _add_shift_command(commands, [output(), model(), kernel(), corpus(), baselines(("none",)), intervals(), display()])
    return parser


# -- shared checks -------------------------------------------------------------------------------
def _check_corpus(corpus: str | None) -> None:
    if corpus is not None and not Path(corpus).exists():
        raise InputError(f"corpus {corpus!r} does not exist; pass a text file, a folder, a .jsonl file or a dataset folder")


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe_file = folder / ".write_test"
        probe_file.write_text("")
        probe_file.unlink()
    except OSError as error:
        raise InputError(
            f"cannot write to the output folder {str(folder)!r} ({error.strerror or error}); choose a writable --out"
        ) from None


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


def _study_options(args: argparse.Namespace, documents: Any) -> dict[str, Any]:
    """The keyword arguments ``run`` and ``compare`` pass alike to their study function."""
    return dict(corpus=documents, n_docs=args.n_docs, context_length=args.context_length, batch_size=args.batch_size,
                baselines=args.baselines, exclude_keys=args.exclude_keys, seed=args.seed, cache_dir=args.cache_dir,
                progress=not args.no_progress, attn_implementation=args.attn_implementation,
                interval_groups=args.interval_groups)


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
    if args.resume and not has_checkpoint(out / CHECKPOINT_FOLDER) and _finished(out / "results.safetensors"):
        # Killed after its results were written, while its checkpoint was being cleared: nothing is left to run.
        clear_checkpoint(out / CHECKPOINT_FOLDER)
        print(f"the run in {out} had finished: its results are in {out / 'results.safetensors'}")
        return 0
    documents = _documents(args)
    study = run_study(
        args.model,
        **_study_options(args, documents),
        backend=args.backend,
        sample_size=args.sample_size,
        keep_pattern=args.keep_pattern,
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
        wrote += save_figures(study_figures(study.trained, study.baselines()), out)
        for name, result in study.baselines().items():
            wrote += save_figures({"heatmaps": heatmaps_figure(result)}, out, prefix=f"baseline_{name}_")
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
    from .result import ProbeResult
    from .runs.study import BASELINES
    from .runs.tables import summary_table

    results = {str(path): ProbeResult.load(path) for path in args.results}
    if args.json:
        print(json.dumps(jsonable({path: {"model": result.model_name, "variant": result.metadata.get("label"),
                                          "complete": result.complete, "metadata": result.metadata,
                                          "summary": result.summary()}
                                   for path, result in results.items()}), indent=1))
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
    return 0


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
                                           start=args.start, stop=args.stop, decimals=args.decimals)
            print(note)
        except ModelNotFoundError as error:
            print(f"writing the report without views: {error}", file=sys.stderr)
    # The positional analyses' section, when the study wrote them beside its results.
    candidates = [Path(args.results).with_name(name) for name in ("positional.safetensors", "positional.json")]
    positional = next((path for path in candidates if path.is_file()), None)
    extra = [positional_report_section(PositionalStudy.load(positional))] if positional is not None else []
    output.write_text(render_report(result, baselines=baselines, views=views, extra_sections=extra), encoding="utf-8")
    print(f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB)")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .display.comparison import save_comparison
    from .runs.compare import compare_models

    out = Path(args.out)
    _check_writable(out)
    comparison = compare_models(args.models, **_study_options(args, _documents(args)), memory_limit=_memory_limit(args))
    paths = save_comparison(comparison, out)
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
        pack=args.pack, baselines=args.baselines, batch_size=args.batch_size, exclude_keys=args.exclude_keys,
        seed=args.seed, out=out, cache_dir=args.cache_dir, memory_limit=_memory_limit(args),
        progress=not args.no_progress, attn_implementation=args.attn_implementation,
    )
    paths = save_scan(scan, out)
    measured = [out / length_folder(length) / result_filename(variant) for length, variants in scan.results.items()
                for variant in variants if variant not in scan.reused[length]]
    reused = sum(len(variants) for variants in scan.reused.values())
    note = f"\n\n{reused} results reused from {out}" if reused else ""
    differences = ("Differences with their 95 % intervals, paired span by span:\n\n" + scan.difference_table())
    _print(args, f"{scan.config['text_description']}\n\n{scan.table()}\n\n{differences}{note}", scan.rows(),
           list(paths.values()) + measured)
    return 0


def _positional_into(out: Path, args: argparse.Namespace, *, model_name: str, analyses: list[str], documents: Any,
                     **settings: Any) -> dict[str, Any]:
    """Run the positional analyses into ``out``: ``positional.safetensors``, one PNG per analysis, ``positional.html``."""
    from .display.figures import save_figures
    from .display.positional import positional_figures, render_positional_page
    from .runs.positional import run_positional
    from .sources.corpus import load_corpus
    from .sources.models import load_positional_model

    model, tokenizer = load_positional_model(model_name, cache_dir=args.cache_dir)
    docs = load_corpus(documents) if isinstance(documents, (str, Path)) else documents
    study = run_positional(model, tokenizer, docs=docs, analyses=analyses, batch_size=args.batch_size,
                           exclude_keys=args.exclude_keys, seed=args.seed, progress=not args.no_progress, **settings)
    wrote = [study.save(out / "positional.safetensors")]
    wrote += save_figures(positional_figures(study), out, prefix="positional_")
    page = out / "positional.html"
    page.write_text(render_positional_page(study), encoding="utf-8")
    return {"study": study, "wrote": wrote + [page]}


def _positional(args: argparse.Namespace) -> int:
    out = Path(args.out)
    _check_writable(out)
    positional = _positional_into(
        out, args, model_name=args.model, analyses=args.analyses, documents=_documents(args),
        n_docs=args.n_docs, context_length=args.context_length, n_prompts=args.n_prompts,
        prompt_length=args.prompt_length, n_permutations=args.n_permutations, n_kernels=args.kernels,
        baseline=None if args.baselines == "none" else args.baselines,
    )
    study = positional["study"]
    _print(args, study.table(), study.summary(), positional["wrote"])
    return 0


# -- the shift test: the same text moved through the window ---------------------------------------------
def _add_shift_command(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    from .sources.shift_grid import DEFAULT_SHIFT, SHIFT_MODES

    shift = commands.add_parser(
        "shift", parents=parents,
        help="move the same texts through the window: what their attention, residual stream and predictions owe to "
             "the offset, to what precedes them and to the tokens themselves")
    shift.set_defaults(handler=_shift)
    shift.add_argument("--n-segments", type=_positive, default=DEFAULT_SHIFT["n_segments"],
                       help="texts to move, one per document (default %(default)s)")
    shift.add_argument("--n-contexts", type=_positive, default=DEFAULT_SHIFT["n_contexts"],
                       help="preceding texts, from other documents (default %(default)s)")
    shift.add_argument("--segment-length", type=_positive, default=DEFAULT_SHIFT["segment_length"],
                       help="tokens per segment (default %(default)s)")
    shift.add_argument("--offsets", type=_int_list, default=None,
                       help="comma-separated offsets (default: 6 from 0 to a 1024-token window, both sides of a sliding window)")
    shift.add_argument("--mode", choices=SHIFT_MODES, default="text",
                       help="text (default): context tokens precede the segment; position_ids: the segment alone with its "
                            "position ids moved")
    shift.add_argument("--batch-size", type=_positive, default=1, help="windows per forward pass (default %(default)s)")
    shift.add_argument("--seed", type=int, default=0, help="seed of the random-initialisation baseline")
    shift.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N")
    shift.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                       help="the model's dtype (default float32; bfloat16 against float32 measures rounding)")
    shift.add_argument("--no-figures", action="store_true",
                       help="write results and the table only: no figures, no shift_report.html")
    shift.add_argument("--heads", default=None,
                       help="the head of the report's CircuitsVis view, e.g. 'L4H3' (default: the head whose centred "
                            "logits the offset moves most)")


def _shift(args: argparse.Namespace) -> int:
    """``equivariance-probe shift``: the shift test on the trained model and each baseline; one
    ``shift_<variant>.safetensors`` per variant and a table (``--json``: the summaries)."""
    import torch

    from .probe import EquivarianceProbe
    from .sources.baselines import random_init_like, zero_like
    from .sources.corpus import load_corpus
    from .sources.devices import resolve_device
    from .sources.models import load_model
    from .sources.packing import special_prefix
    from .sources.shift_grid import default_offsets, split_documents

    out = Path(args.out)
    _check_writable(out)
    unknown = [name for name in args.baselines if name not in ("random_init", "zero", "none")]
    if unknown:
        raise InputError(f"unknown baselines {unknown}; choose from random_init, zero, or none")
    model, tokenizer = load_model(args.model, cache_dir=args.cache_dir, dtype=getattr(torch, args.dtype),
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
    variants = {"trained": model}
    variants.update({name: random_init_like(model, seed=args.seed) if name == "random_init" else zero_like(model)
                     for name in args.baselines if name != "none"})
    results, wrote = {}, []
    for name, variant in variants.items():
        results[name] = EquivarianceProbe(variant, tokenizer=tokenizer).shift(
            segments, None if args.mode == "position_ids" else contexts,
            progress=False if args.no_progress else f"{name}: segments", **options)
        wrote.append(results[name].save(out / f"shift_{name}.safetensors"))
    if not args.no_figures:
        wrote += _shift_display(out, probe, results, segments, None if args.mode == "position_ids" else contexts,
                                args.heads)
    table = "\n\n".join(f"[{name}]\n{result.table()}" for name, result in results.items())
    _print(args, table, {name: result.summary() for name, result in results.items()}, wrote)
    return 0


def _shift_display(out: Path, probe: Any, results: dict[str, Any], segments: list[Any], contexts: list[Any] | None,
                   head: str | None) -> list[Path]:
    """The shift run's figures (``shift_*.png``, the trained model beside its baselines) and
    ``shift_report.html`` with the CircuitsVis view of one head at the smallest and largest offsets."""
    from .display.figures import save_figures
    from .display.shift import render_shift_report, shift_figures, shift_view

    trained = results["trained"]
    baselines = {name: result for name, result in results.items() if name != "trained"}
    wrote = save_figures(shift_figures(trained, baselines), out)
    view = shift_view(probe, segments, contexts, result=trained, head=head)
    report = out / "shift_report.html"
    report.write_text(render_shift_report(trained, baselines, view=view), encoding="utf-8")
    return wrote + [report]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    args = build_parser().parse_args(argv)
    try:
        with command_line_options(FLAGS):
            status = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at the interpreter's exit
        return status
    except EquivarianceProbeError as error:
        print(f"equivariance-probe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`show ... | head`): what it read is all it wanted. Point stdout at
        # /dev/null so that the interpreter's final flush does not raise again (Python's documented recipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
