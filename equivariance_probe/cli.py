"""The command-line program ``equivariance-probe``.

Subcommands:

* ``run``    — the whole study on a model and corpus (default: Gemma 3 270M on the
  packaged Wikipedia articles, trained vs random-init vs zero), writing results, figures
  and a summary table.
* ``merge``  — add result files of shards of one study into one.
* ``report`` — an offline HTML report from a results file (``--views``: with CircuitsVis views
  of the most and least position-bound heads, reloading the model the results name).
* ``compare`` — the study on several models over the same windows, in one table and figure
  (default: the three packaged models, trained vs their own random initialisation).
* ``positional`` — where order comes from (issue 6): position-embedding Gram matrices, TISA
  kernel fits, permutation sensitivity, variance shrinkage, position correlations.

Bad arguments exit with status 2 and a message that names the problem and the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import EquivarianceProbeError

__all__ = ["main", "build_parser"]


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


def build_parser() -> argparse.ArgumentParser:
    from .checkpoint import DEFAULT_CHECKPOINT_EVERY
    from .study import BASELINES, DEFAULT_STUDY

    parser = argparse.ArgumentParser(
        prog="equivariance-probe",
        description="How much does attention depend on absolute position? Exact, streaming attention statistics.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the study on a model and corpus and write results and figures")
    run.add_argument("--out", required=True, help="output folder (created if missing)")
    run.add_argument("--model", default="gemma-3-270m",
                     help="packaged model name, local model folder, or a hub name already cached (default: gemma-3-270m)")
    run.add_argument("--backend", default="huggingface", choices=["huggingface", "transformer_lens", "nnsight"])
    run.add_argument("--corpus", default=None,
                     help="text file, folder of .txt, .jsonl, or a datasets save_to_disk folder (default: packaged Wikipedia articles)")
    run.add_argument("--text-field", default="text", help="JSONL field / dataset column holding the text")
    run.add_argument("--n-docs", type=_positive, default=DEFAULT_STUDY["n_docs"], help="documents, one window each")
    run.add_argument("--context-length", type=_positive, default=DEFAULT_STUDY["context_length"], help="window length in tokens")
    run.add_argument("--batch-size", type=_positive, default=DEFAULT_STUDY["batch_size"])
    run.add_argument("--baselines", default=",".join(BASELINES),
                     help=f"comma-separated baselines from {sorted(BASELINES)}, or 'none'")
    run.add_argument("--exclude-keys", type=_int_list, default=[],
                     help="key positions excluded from every statistic, e.g. '0' for the first token (attention sink)")
    run.add_argument("--seed", type=int, default=0, help="seed of the random-init baseline and the entry sample")
    run.add_argument("--sample-size", type=int, default=20000, help="entries sampled for the scatter plot")
    run.add_argument("--cache-dir", default=None, help="where converted packaged models are cached")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    # issue 6: the positional analyses into the same folder (positional.json, the report's section)
    run.add_argument("--analyses", type=_analyses, default=[],
                     help="also run positional analyses (at most 8 windows of 256 tokens), comma-separated from "
                     "gram,positional_logits,tisa,permutation,shrinkage,correlation, or 'all' (see 'positional')")
    # -- issue 7: runs that survive --
    run.add_argument("--checkpoint-every", type=_non_negative, default=DEFAULT_CHECKPOINT_EVERY,
                     help="save a checkpoint in OUT/checkpoint every N documents (0: never; default %(default)s)")
    run.add_argument("--resume", action="store_true",
                     help="continue the interrupted run whose checkpoint is in OUT/checkpoint (same model, corpus, options)")
    run.add_argument("--shard", default=None, metavar="I/N",
                     help="run only shard I of N (contiguous slices of the documents, I from 0), writing OUT/shard-I-of-N; "
                          "'auto' takes RANK/WORLD_SIZE (torchrun, accelerate). Merge the shards' results.json")
    run.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N")
    run.add_argument("--no-figures", action="store_true", help="write results and summary only (e.g. for shards)")
    run.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="the model's parameter dtype (default: as loaded, float32)")

    merge = commands.add_parser("merge", help="merge result files of shards into one")
    merge.add_argument("inputs", nargs="+", help="results.json files to merge")
    merge.add_argument("-o", "--output", required=True, help="merged results file")

    report = commands.add_parser("report", help="write an offline HTML report from a results file")
    report.add_argument("results", help="a results.json written by 'run'")
    report.add_argument("-o", "--output", default=None, help="HTML file (default: next to the results, report.html)")
    # Head views (issue 5): reload the model and one document to draw heads with CircuitsVis.
    report.add_argument("--views", action="store_true",
                        help="add CircuitsVis views of heads: reloads the model named in the results (offline) and one document")
    report.add_argument("--heads", default=None, help="heads to view, e.g. 'L4H3,L5H1' (default: the 2 most and 2 least position-bound)")
    report.add_argument("--document", type=int, default=0, help="index of the corpus document to view (default 0)")
    report.add_argument("--corpus", default=None, help="corpus to take the document from (default: the study's)")
    report.add_argument("--start", type=int, default=0, help="first position shown")
    report.add_argument("--stop", type=int, default=None, help="position after the last shown (default: start + 128)")
    report.add_argument("--decimals", type=int, default=3, help="round view values to this many decimals (default 3)")
    _add_compare_parser(commands)
    _add_positional_parser(commands)
    return parser


# --- compare (issue 8) ------------------------------------------------------------------


def _add_compare_parser(commands: argparse._SubParsersAction) -> None:
    from .compare import DEFAULT_COMPARE_MODELS, DEFAULT_COMPARISON

    compare = commands.add_parser("compare", help="run the study on several models over the same windows: one table and figure")
    compare.add_argument("--out", required=True, help="output folder (created if missing)")
    compare.add_argument("--models", default=",".join(DEFAULT_COMPARE_MODELS),
                         help="comma-separated packaged model names or local model folders "
                              f"(default: {','.join(DEFAULT_COMPARE_MODELS)})")
    compare.add_argument("--corpus", default=None, help="text file, folder of .txt, .jsonl, or a datasets folder "
                                                        "(default: packaged Wikipedia articles)")
    compare.add_argument("--n-docs", type=_positive, default=DEFAULT_COMPARISON["n_docs"], help="windows, one per document")
    compare.add_argument("--context-length", type=_positive, default=DEFAULT_COMPARISON["context_length"],
                         help="tokens per window, the same for every model")
    compare.add_argument("--batch-size", type=_positive, default=DEFAULT_COMPARISON["batch_size"])
    compare.add_argument("--baselines", default=",".join(DEFAULT_COMPARISON["baselines"]),
                         help="comma-separated baselines (random_init, zero), or 'none'")
    compare.add_argument("--exclude-keys", type=_int_list, default=[], help="key positions excluded from every statistic")
    compare.add_argument("--seed", type=int, default=0, help="seed of the random initialisations")
    compare.add_argument("--memory-limit-gib", type=float, default=None,
                         help="refuse models whose estimated need exceeds this (default: the memory available)")
    compare.add_argument("--cache-dir", default=None, help="where converted packaged models are cached")
    compare.add_argument("--no-progress", action="store_true", help="no progress bars")


def _compare(args: argparse.Namespace) -> int:
    from .compare import compare_models

    out = Path(args.out)
    _check_writable(out)
    _check_corpus(args.corpus)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    baselines = _baselines(args.baselines)
    comparison = compare_models(
        models,
        corpus=args.corpus,
        n_docs=args.n_docs,
        context_length=args.context_length,
        batch_size=args.batch_size,
        baselines=baselines,
        exclude_keys=args.exclude_keys,
        seed=args.seed,
        cache_dir=args.cache_dir,
        memory_limit=None if args.memory_limit_gib is None else int(args.memory_limit_gib * 2**30),
        progress=not args.no_progress,
    )
    paths = comparison.save(out)
    print(comparison.table())
    print(f"wrote {', '.join(str(p) for p in paths.values())} and per-model results under {out / 'models'}")
    return 0


# --- end compare ------------------------------------------------------------------------


# -- issue 6: the ``positional`` command ------------------------------------------------------
def _analyses(text: str) -> list[str]:
    from .positional_study import ANALYSES

    names = list(ANALYSES) if text.strip().lower() == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ANALYSES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown analyses {unknown}; choose from {', '.join(ANALYSES)} or 'all'")
    return names


def _add_positional_parser(commands) -> None:
    positional = commands.add_parser(
        "positional", help="where order comes from: Gram/TISA Toeplitzness, permutation symmetry, variance shrinkage")
    positional.add_argument("--out", required=True, help="output folder: positional.json, positional.html, figures")
    positional.add_argument("--model", default="gemma-3-270m",
                            help="packaged model (gemma-3-270m, all-minilm-l6-v2), local folder, or cached hub name")
    positional.add_argument("--analyses", type=_analyses, default="all",
                            help="comma-separated from gram,positional_logits,tisa,permutation,shrinkage,correlation, or 'all'")
    positional.add_argument("--corpus", default=None, help="text file, folder of .txt, .jsonl or dataset folder")
    positional.add_argument("--n-docs", type=_positive, default=8, help="windows for tisa, shrinkage, correlation")
    positional.add_argument("--context-length", type=_positive, default=256)
    positional.add_argument("--n-prompts", type=_positive, default=4, help="prompts for the permutation analysis")
    positional.add_argument("--prompt-length", type=_positive, default=64)
    positional.add_argument("--n-permutations", type=_positive, default=8)
    positional.add_argument("--kernels", type=_positive, default=5, help="S, kernels of the TISA fit")
    positional.add_argument("--baseline", default="random_init", choices=["random_init", "none"],
                            help="shrinkage and correlations also at the model's own random initialisation")
    positional.add_argument("--batch-size", type=_positive, default=4)
    positional.add_argument("--exclude-keys", type=_int_list, default=[],
                            help="key positions left out of the tisa profiles, e.g. '0' (attention sink)")
    positional.add_argument("--seed", type=int, default=0)
    positional.add_argument("--cache-dir", default=None)


def _positional_into(out: Path, *, model_name: str, analyses: list[str], corpus: str | None, cache_dir: str | None,
                     **settings) -> list[Path]:
    from .figures import save_figures
    from .positional_report import render_positional_page
    from .positional_study import load_positional_model, run_positional

    model, tokenizer = load_positional_model(model_name, cache_dir=cache_dir)
    docs = None
    if corpus is not None:
        from .corpus import load_corpus

        docs = load_corpus(corpus)
    study = run_positional(model, tokenizer, docs=docs, analyses=analyses, **settings)
    paths = [study.save(out / "positional.json")]
    paths += save_figures(study.figures(), out, prefix="positional_")
    page = out / "positional.html"
    page.write_text(render_positional_page(study), encoding="utf-8")
    print(json.dumps(study.summary(), indent=1, default=float)[:4000])
    return paths + [page]


def _positional(args: argparse.Namespace) -> int:
    out = Path(args.out)
    _check_writable(out)
    _check_corpus(args.corpus)
    paths = _positional_into(
        out, model_name=args.model, analyses=args.analyses, corpus=args.corpus, cache_dir=args.cache_dir,
        n_docs=args.n_docs, context_length=args.context_length, n_prompts=args.n_prompts,
        prompt_length=args.prompt_length, n_permutations=args.n_permutations, n_kernels=args.kernels,
        baseline=None if args.baseline == "none" else args.baseline, batch_size=args.batch_size,
        exclude_keys=args.exclude_keys, seed=args.seed,
    )
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _baselines(text: str) -> list[str]:
    """``--baselines``: comma-separated names, or ``none``."""
    return [] if text.strip().lower() == "none" else [b.strip() for b in text.split(",") if b.strip()]


def _check_corpus(corpus: str | None) -> None:
    if corpus is not None and not Path(corpus).exists():
        raise EquivarianceProbeError(f"corpus {corpus!r} does not exist; pass a text file, a folder, a .jsonl file or a dataset folder")


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe_file = folder / ".write_test"
        probe_file.write_text("")
        probe_file.unlink()
    except OSError as error:
        raise EquivarianceProbeError(
            f"cannot write to the output folder {str(folder)!r} ({error.strerror or error}); choose a writable --out"
        ) from None


def _run(args: argparse.Namespace) -> int:
    from .checkpoint import CHECKPOINT_FOLDER, clear_checkpoint
    from .sharding import Shard
    from .study import run_study

    out = Path(args.out)
    shard = None
    if args.shard is not None:  # each shard writes its own subfolder, so all ranks can share one --out
        shard = Shard.from_environment() if args.shard.strip() == "auto" else Shard.parse(args.shard)
        out = out / f"shard-{shard.index}-of-{shard.count}"
    _check_writable(out)
    baselines = _baselines(args.baselines)
    corpus = args.corpus
    _check_corpus(corpus)
    if corpus is not None and args.text_field != "text":
        from .corpus import load_corpus

        corpus = load_corpus(corpus, text_field=args.text_field)
    study = run_study(
        args.model,
        backend=args.backend,
        corpus=corpus,
        n_docs=args.n_docs,
        context_length=args.context_length,
        batch_size=args.batch_size,
        baselines=baselines,
        exclude_keys=args.exclude_keys,
        seed=args.seed,
        sample_size=args.sample_size,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        checkpoint_dir=None if args.checkpoint_every == 0 else out / CHECKPOINT_FOLDER,
        checkpoint_every=args.checkpoint_every or None,
        resume=args.resume,
        shard=shard,
        device=args.device,
        dtype=args.dtype,
    )
    # results.json is written only here, after every variant finished (complete: true); a run that
    # stops leaves only its checkpoint.
    paths = study.save(out)
    figures: list = []
    if not args.no_figures:
        from .figures import heatmaps_figure, save_figures, study_figures

        figures = save_figures(study_figures(study.trained, study.baselines()), out)
        for name, result in study.baselines().items():
            figures += save_figures({"heatmaps": heatmaps_figure(result)}, out, prefix=f"baseline_{name}_")
    print(study.table())
    print(study.heads())
    print(f"wrote {', '.join(str(p) for p in list(paths.values()) + figures)} and {out / 'summary.md'}")
    if args.analyses:  # issue 6
        written = _positional_into(
            out, model_name=args.model, analyses=args.analyses, corpus=args.corpus, cache_dir=args.cache_dir,
            n_docs=min(args.n_docs, 8), context_length=min(args.context_length, 256),
            prompt_length=min(args.context_length, 64), seed=args.seed,
        )
        print(f"wrote {', '.join(str(p) for p in written)}")
    clear_checkpoint(out / CHECKPOINT_FOLDER)  # only once the results are on disk
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .result import ProbeResult

    results = [ProbeResult.load(path) for path in args.inputs]
    for path, result in zip(args.inputs, results):
        if not result.complete:
            raise EquivarianceProbeError(
                f"{path} is the partial result of a run that stopped (complete: false); finish it "
                "(equivariance-probe run ... --resume) before merging"
            )
    merged = results[0]
    for other in results[1:]:
        merged = merged + other
    output = merged.save(args.output)
    shards = merged.metadata.get("shards")
    missing = sorted(set(range(shards["count"])) - set(shards["indices"])) if shards else []
    note = f"; shards {missing} of {shards['count']} are still missing" if missing else ""
    print(f"merged {len(results)} results ({merged.n_windows} windows, {merged.n_tokens} tokens) into {output}{note}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .result import ProbeResult

    result = ProbeResult.load(args.results)
    output = Path(args.output) if args.output else Path(args.results).with_name("report.html")
    views = None
    if args.views:
        from .errors import ModelNotFoundError
        from .views import parse_heads, views_for_result

        heads = parse_heads(args.heads) if args.heads else None  # bad heads: exit 2, not a silent report
        try:
            views, note = views_for_result(result, heads=heads, document=args.document, corpus=args.corpus,
                                           start=args.start, stop=args.stop, decimals=args.decimals)
            print(note)
        except ModelNotFoundError as error:
            print(f"writing the report without views: {error}", file=sys.stderr)
    from .report import positional_sections  # issue 6: positional.json beside the results

    output.write_text(result.to_html(views=views, extra_sections=positional_sections(args.results)), encoding="utf-8")
    print(f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"run": _run, "merge": _merge, "report": _report, "compare": _compare, "positional": _positional}
    try:
        return handlers[args.command](args)
    except EquivarianceProbeError as error:
        print(f"equivariance-probe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
