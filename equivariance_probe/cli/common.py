"""What several commands do alike: check and lock the output folder, read the corpus, turn flags into
measurement options, print a table or JSON, and say how a stopped run goes on.

A command that writes into an output folder holds that folder's lock while it runs
(:func:`~equivariance_probe.runs.checkpoint.lock_output_folder`), released when the command ends
(:data:`HELD`, set by :func:`~equivariance_probe.cli.program.main`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ..errors import EquivarianceProbeError, InputError
from ..records.fileformat import jsonable, write_text_atomically

__all__ = ["HELD", "check_corpus", "check_writable", "checkpoint_note", "finished", "read_documents", "measurement",
           "study_options", "model_source_of", "check_study_fits", "memory_limit", "print_result", "positional_into"]

#: While a command runs: the output folders' locks it holds, released when it ends.
HELD: ContextVar[contextlib.ExitStack | None] = ContextVar("equivariance_probe_held_locks", default=None)


def check_corpus(corpus: str | None) -> None:
    if corpus is not None and not Path(corpus).exists():
        raise InputError(f"corpus {corpus!r} does not exist; pass a text file, a folder, a .jsonl file or a dataset folder")


def check_writable(folder: Path) -> None:
    """Refuse an output folder that cannot be written, then hold its lock until the command ends."""
    from ..runs.checkpoint import lock_output_folder

    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe_file = folder / ".write_test"
        probe_file.write_text("")
        probe_file.unlink()
    except OSError as error:
        raise InputError(
            f"cannot write to the output folder {str(folder)!r} ({error.strerror or error}); choose a writable --out"
        ) from None
    held = HELD.get()
    if held is not None:
        held.enter_context(lock_output_folder(folder))


def checkpoint_note(args: argparse.Namespace) -> str:
    """How to continue a ``run`` or ``shift`` that stopped: from its checkpoint with ``--resume`` where it has one."""
    from ..runs.checkpoint import has_checkpoint

    folder = getattr(args, "checkpoint_folder", None)
    if folder is not None and has_checkpoint(folder):
        return f"the checkpoint in {folder} is intact: run the same command with --resume to continue from it"
    if args.command in ("run", "shift"):
        return "no checkpoint was written yet: run the same command again"
    return "run the same command again"


def finished(path: Path) -> bool:
    """Whether ``path`` is a complete result file (a finished run's)."""
    from ..result import ProbeResult

    try:
        return path.is_file() and ProbeResult.load(path).complete
    except EquivarianceProbeError:
        return False


def read_documents(args: argparse.Namespace) -> Any:
    """The corpus the command reads: ``None`` (the packaged one), a path, or texts read with ``--text-field``."""
    check_corpus(args.corpus)
    if args.corpus is not None and args.text_field != "text":
        from ..sources.corpus import load_corpus

        return load_corpus(args.corpus, text_field=args.text_field)
    return args.corpus


def measurement(args: argparse.Namespace, **changes: Any) -> Any:
    """The :class:`~equivariance_probe.probe.MeasurementOptions` the command's flags set (each subcommand
    has the flags that make sense for it; ``changes`` sets what it decides itself)."""
    from ..probe import MEASUREMENT_FIELDS, MeasurementOptions

    # --device places the model (the sums follow it), so it is not the options' device of the sums.
    given = {name: getattr(args, name) for name in MEASUREMENT_FIELDS
             if name != "device" and getattr(args, name, None) is not None}
    return MeasurementOptions(**{**given, **changes})


def study_options(args: argparse.Namespace, documents: Any) -> dict[str, Any]:
    """The keyword arguments ``run`` and ``compare`` pass alike to their study function."""
    return dict(corpus=documents, n_docs=args.n_docs, baselines=args.baselines, seed=args.seed,
                progress=not args.no_progress)


def model_source_of(args: argparse.Namespace, name: str | None = None) -> Any:
    """The :class:`~equivariance_probe.sources.model_source.ModelSource` the command's model options say (``name``: a
    model other than ``--model``, as ``compare``'s ``--models``); an option the command does not take keeps the
    spec's default."""
    from ..sources.model_source import ModelSource

    given = {key: getattr(args, key) for key in ("framework", "cache_dir", "device", "dtype", "attn_implementation",
                                                 "threads") if getattr(args, key, None) is not None}
    return ModelSource(args.model if name is None else name, **given)


def check_study_fits(args: argparse.Namespace) -> None:
    """Refuse a study whose model, at ``--context-length`` and ``--batch-size``, would need more than ``--memory-limit-gib``."""
    from ..sources.devices import parse_dtype
    from ..sources.resources import check_fits, estimate_memory_of

    estimate = estimate_memory_of(args.model, context_length=args.context_length, batch_size=args.batch_size,
                                  copies=2 if args.baselines else 1, dtype=parse_dtype(args.dtype),
                                  keep_pattern=args.keep_pattern, cache_dir=args.cache_dir)
    check_fits({args.model: estimate}, memory_limit(args), what="",
               fix="Lower --batch-size or --context-length, or raise --memory-limit-gib.")


def memory_limit(args: argparse.Namespace) -> int | None:
    """``--memory-limit-gib`` in bytes (``None``: the memory available)."""
    return None if args.memory_limit_gib is None else int(args.memory_limit_gib * 2**30)


def print_result(args: argparse.Namespace, table: str, numbers: Any, wrote: Sequence[Path]) -> None:
    print(json.dumps(jsonable(numbers), indent=1) if args.json else table)
    if wrote:
        print(f"wrote {', '.join(str(path) for path in wrote)}", file=sys.stderr if args.json else sys.stdout)


def positional_into(out: Path, args: argparse.Namespace, *, model_name: str, analyses: list[str], documents: Any,
                     context_length: int, **settings: Any) -> dict[str, Any]:
    """Run the positional analyses into ``out``: ``positional.safetensors``, one PNG per analysis, ``positional.html``."""
    from ..display.figures import save_figures
    from ..display.positional import positional_figures, render_positional_page
    from ..probe import MeasurementOptions
    from ..runs.positional import run_positional
    from ..sources.corpus import load_corpus
    from ..sources.models import load_positional_model

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
