"""What the subcommands share: argument types, the options declared once, the help formatter, and the
flags that spell the Python API's arguments here (:func:`api_flags`, read from the parser itself).

Every option that several subcommands take is declared once (:func:`shared_options`), and each subcommand takes
them with :func:`add_shared_options`, so a flag has one spelling and one meaning everywhere; where a default
differs, its help says why (after :data:`WHY`).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from ..errors import InputError, command_line_options

__all__ = ["shared_options", "add_shared_options", "HelpFormatter", "WHY", "api_flags", "API_NAMES",
           "MODEL_OPTIONS", "MEASURED", "int_list", "integer_at_least", "positive", "non_negative", "names", "declared_for",
           "Given", "given_options", "weight_threshold"]

#: The Python API's arguments whose flag is spelt otherwise (API name -> the flag's ``dest``), so that an
#: error raised under a command names the flag the user typed (:func:`~equivariance_probe.errors.option`).
API_NAMES = {
    "source": "corpus",
    "checkpoint_dir": "out",
    "memory_limit": "memory_limit_gib",
    "head": "view_head",
    "format": "figure_format",
    "name": "model",
}

#: The shared options that say which model runs and how it is loaded, and those that say what is measured.
MODEL_OPTIONS = ("model", "cache_dir", "attn_implementation", "device", "dtype")
MEASURED = ("exclude_keys", "seed", "interval_groups", "keep_pattern")


def api_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """API argument -> the flag that sets it, read from ``parser`` and its subcommands (a flag's longest
    spelling), with :data:`API_NAMES` for the arguments spelt otherwise."""
    flags: dict[str, str] = {}
    parsers = [parser]
    while parsers:
        current = parsers.pop(0)
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.dest != "help":
                flags.setdefault(action.dest, max(action.option_strings, key=len))
    flags.update({api: flags[dest] for api, dest in API_NAMES.items() if dest in flags})
    return flags


# -- argument types ----------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as '0' or '0,1', got {text!r}") from None


def integer_at_least(minimum: int, name: str):
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


positive = integer_at_least(1, "a positive integer")
non_negative = integer_at_least(0, "a non-negative integer")


def analyses(text: str) -> list[str]:
    from ..runs.positional import ANALYSES

    names = list(ANALYSES) if text.strip().lower() == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ANALYSES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown analyses {unknown}; choose from {', '.join(ANALYSES)} or 'all'")
    return names


def figure_formats(text: str) -> str:
    """``--figure-format``: checked here, so that a wrong format is refused before any model loads."""
    from ..display.figures import figure_formats

    with command_line_options({"format": "--figure-format"}):
        try:
            return ",".join(figure_formats(text))
        except InputError as error:
            raise argparse.ArgumentTypeError(str(error)) from None


def names(text: str) -> list[str]:
    """Comma-separated names; ``none`` for none."""
    return [] if text.strip().lower() == "none" else [part.strip() for part in text.split(",") if part.strip()]


def weight_threshold(text: str) -> float:
    """An attention-weight threshold in ``[0, 1)`` (the sink rate's ``ε``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected an attention weight in [0, 1) such as 0.3, got {text!r}")
    return value


# -- the parser ----------------------------------------------------------------------------------
class Given(argparse._StoreAction):
    """A stored option that also records that it was typed (:func:`given_options`), so that a preset such as
    ``--sink-protocol`` can tell a value the user gave from a default and refuse to overwrite it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, "given_options", given_options(namespace) | {self.dest})
        super().__call__(parser, namespace, values, option_string)


def given_options(args: argparse.Namespace) -> set[str]:
    """The ``dest`` of every :class:`Given` option typed on the command line."""
    return set(getattr(args, "given_options", ()))


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

    A declaration's keywords may also say ``"commands"``: the subcommands that take it without naming it
    (:func:`declared_for`), so that a new option is one declaration here.

    A subcommand takes them with :func:`add_shared_options`, naming the ones that make sense for it
    and, where its default differs, the default and why.
    """
    from ..adapters.registry import DEFAULT_FRAMEWORK, framework_names
    from ..runs.checkpoint import DEFAULT_CHECKPOINT_EVERY
    from ..runs.positional import ANALYSES
    from ..maths.sinks import SINK_EPSILON
    from ..runs.study import BASELINES, DEFAULT_STUDY
    from ..statistics.groups import DEFAULT_INTERVAL_GROUPS

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
        "n_docs": (("--n-docs",), {"type": positive, "default": DEFAULT_STUDY["n_docs"], "help": "documents, one window each "
                                   "(default %(default)s)"}),
        "context_length": (("--context-length",), {"type": positive, "default": DEFAULT_STUDY["context_length"],
                                                   "help": "window length in tokens (default %(default)s)"}),
        "batch_size": (("--batch-size",), {"type": positive, "default": DEFAULT_STUDY["batch_size"],
                                           "help": "windows per forward pass (default %(default)s)"}),
        "pack": (("--pack",), {"action": "store_true", "help": (
            "concatenate the documents (tokenised without special tokens, EOS between them) and cut windows of "
            "exactly T tokens, each after the tokenizer's special prefix (BOS for Gemma and Llama), as "
            "TransformerLens' tokenize_and_concatenate; default: one window per document, its first T tokens")}),
        "baselines": (("--baselines",), {"type": names, "default": list(BASELINES), "help": (
            f"comma-separated baselines from {','.join(sorted(BASELINES))}, or 'none' (default: {','.join(BASELINES)})")}),
        "exclude_keys": (("--exclude-keys",), {"type": int_list, "default": [], "help": (
            "key positions left out of every statistic, e.g. '0' for the first token (attention sink)")}),
        "seed": (("--seed",), {"type": int, "default": 0,
                               "help": "seed of random initialisations, samples and permutations (default %(default)s)"}),
        "sample_size": (("--sample-size",), {"type": non_negative, "default": 20000,
                                             "help": "entries sampled for the scatter plot (default %(default)s)"}),
        "keep_pattern": (("--keep-pattern",), {"action": "store_true", "help": (
            "also keep the window-summed pattern (8*L*H*T^2 bytes per variant, in memory and in each result file) "
            "for the Toeplitz R² of the document-averaged pattern")}),
        "interval_groups": (("--interval-groups",), {"type": non_negative, "default": DEFAULT_INTERVAL_GROUPS, "help": (
            "groups of windows (by fingerprint) for the 95%% intervals, a delete-a-group jackknife; 0 for none "
            "(default %(default)s)")}),
        "memory_limit_gib": (("--memory-limit-gib",), {"type": float, "default": None, "help": (
            "refuse work whose estimated memory exceeds this many GiB (default: the memory available)")}),
        "analyses": (("--analyses",), {"type": analyses, "default": "all", "help": (
            f"positional analyses, comma-separated from {','.join(ANALYSES)}, or 'all' (default)")}),
        "checkpoint_every": (("--checkpoint-every",), {"type": non_negative, "default": DEFAULT_CHECKPOINT_EVERY, "help": (
            "save a checkpoint in OUT/checkpoint every N documents (0: never; default %(default)s)")}),
        "resume": (("--resume",), {"action": "store_true", "help": (
            "continue the interrupted run whose checkpoint is in OUT/checkpoint (same model, corpus, options)")}),
        "threads": (("--threads",), {"type": positive, "default": None, "commands": (
            "run", "shift", "compare", "scan", "positional"), "help": (
            "torch's CPU threads (torch.set_num_threads), set before the model loads (default: torch's, one per core); "
            "on cores another process also uses, fewer threads avoid oversubscription (docs/guide/cost.md)")}),
        "no_progress": (("--no-progress",), {"action": "store_true", "help": "no progress bars"}),
        "sink_epsilon": (("--sink-epsilon",), {"type": weight_threshold, "default": SINK_EPSILON, "metavar": "EPS", "help": (
            "the attention-sink threshold: a head is a sink in a window when its mean weight on the window's first "
            "token is above it; the sink rate is the share of (window, head) pairs that are (default %(default)s, "
            "Gu et al.'s)")}),
        "json": (("--json",), {"action": "store_true", "help": "print the numbers as JSON instead of a table"}),
        "no_figures": (("--no-figures",), {"action": "store_true", "help": (
            "write the results and their summary or table only: no figures, no report (e.g. for shards)")}),
        "figure_format": (("--figure-format",), {"type": figure_formats, "default": "png", "metavar": "FORMATS", "help": (
            "the figures' files, comma-separated from png,svg,pdf (e.g. png,svg,pdf for a paper: SVG text as paths, "
            "PDF fonts embedded; default png)")}),
    }


#: A shared option's "(default ...)" clause, one level of parentheses inside allowed.
_DEFAULT_CLAUSE = re.compile(r"\s*\(default\b[^()]*(?:\([^()]*\)[^()]*)*\)")


def declared_for(command: str) -> list[str]:
    """The shared options whose declaration names ``command`` among its ``"commands"``: a new option is then one
    declaration, added to those commands by :func:`~equivariance_probe.cli.program.build_parser`."""
    return [name for name, (_, keywords) in shared_options().items() if command in keywords.get("commands", ())]


def add_shared_options(parser: argparse.ArgumentParser, *names: str,
                       differ: dict[str, tuple[dict[str, Any], str]] | None = None,
                       given: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """Give ``parser`` the shared options ``names`` (:func:`shared_options`), spelt and explained as everywhere.

    Args:
        parser: a subcommand's parser.
        names: the options that make sense for it.
        differ: ``{name: (changes, why)}`` for an option whose default (or meaning) differs on this
            subcommand: the argparse keywords that change, and why, which the help then says.
        given: options whose use is recorded (:class:`Given`, :func:`given_options`): stored values that a preset
            of the subcommand must not overwrite.
    """
    declared = shared_options()
    differ = differ or {}
    unknown = sorted((set(names) | set(differ)) - set(declared))
    if unknown:
        raise ValueError(f"no shared options {unknown}; declare them in shared_options()")
    for name in names:
        flags, keywords = declared[name]
        keywords = {key: value for key, value in keywords.items() if key != "commands"}
        if name in differ:
            changes, why = differ[name]
            keywords.update(changes)
            help_text = changes.get("help", keywords["help"])
            if "default" in changes:  # the shared help's default is not this command's: one default, stated once
                help_text = _DEFAULT_CLAUSE.sub("", help_text)
                if "default" not in why:
                    help_text += " (default %(default)s)"
            keywords["help"] = f"{help_text}; {WHY}: {why}"
        if name in given:
            keywords["action"] = Given
        parser.add_argument(*flags, **keywords)
    return parser
