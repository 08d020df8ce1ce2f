"""The command-line program end to end on a tiny model saved to disk, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from equivariance_probe import ProbeResult
from equivariance_probe.cli import main



@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_folder, text_corpus):
    return tmp_path_factory.mktemp("cli"), tiny_model_folder("gemma3", 64), text_corpus(n_docs=5, words=60)


def test_run_writes_results_baselines_figures_and_summary(tiny, capsys):
    root, model, corpus = tiny
    out = root / "out"
    status = main(["run", "--out", str(out), "--model", model, "--corpus", corpus, "--n-docs", "4",
                   "--context-length", "32", "--batch-size", "3", "--exclude-keys", "0", "--no-progress",
                   "--sample-size", "500"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "| log | eta2 |" in printed and "most position-bound head" in printed
    for name in ("results.safetensors", "baseline_random_init.safetensors", "baseline_zero.safetensors", "summary.md",
                 "persistence.png", "head_curves.png", "fit_by_key.png", "scatter.png", "heatmaps.png",
                 "baseline_zero_heatmaps.png"):
        assert (out / name).stat().st_size > 0, name
    trained = ProbeResult.load(out / "results.safetensors")
    assert trained.n_windows == 4 and trained.excluded_keys == (0,)
    assert trained.metadata["study"]["context_length"] == 32
    zero = ProbeResult.load(out / "baseline_zero.safetensors")
    for scale in ("log", "raw"):
        for form in ("prior", "fitted", "eta2"):
            assert zero.query_position_r2(scale, form) == pytest.approx(1.0, abs=1e-9)


def test_merge_command(tiny, tmp_path, capsys):
    root, model, corpus = tiny
    for shard, docs in (("a", "2"), ("b", "3")):
        assert main(["run", "--out", str(tmp_path / shard), "--model", model, "--corpus", corpus, "--n-docs", docs,
                     "--context-length", "16", "--baselines", "none", "--no-progress", "--sample-size", "0"]) == 0
    # b's first two documents are a's two: the merge is refused, naming them ...
    inputs = [str(tmp_path / "a" / "results.safetensors"), str(tmp_path / "b" / "results.safetensors")]
    assert main(["merge", *inputs, "-o", str(tmp_path / "all.safetensors")]) == 2
    assert "2 of the 3 windows" in capsys.readouterr().err and not (tmp_path / "all.safetensors").exists()
    # ... unless they are meant to count twice
    status = main(["merge", *inputs, "-o", str(tmp_path / "all.safetensors"), "--allow-duplicate-windows"])
    assert status == 0
    assert ProbeResult.load(tmp_path / "all.safetensors").n_windows == 5


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--model", "no-such-model-anywhere"], "no-such-model-anywhere"),
        (["--context-length", "100"], "maximum context of 64"),
        (["--corpus", "EMPTY"], "empty|no document"),
        (["--corpus", "MISSING"], "does not exist"),
        (["--baselines", "bogus"], "unknown baselines"),
        (["--memory-limit-gib", "0.000001"], "not enough memory"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(tiny, tmp_path, capsys, arguments, message):
    root, model, corpus = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    arguments = [a.replace("EMPTY", str(empty)).replace("MISSING", str(tmp_path / "missing")) for a in arguments]
    base = {"--model": model, "--corpus": corpus, "--context-length": "16"}
    for flag, value in zip(arguments[::2], arguments[1::2]):
        base[flag] = value
    argv = ["run", "--out", str(tmp_path / "out"), "--no-progress", "--n-docs", "2"]
    for flag, value in base.items():
        argv += [flag, value]
    assert main(argv) == 2
    assert __import__("re").search(message, capsys.readouterr().err, flags=__import__("re").I)


def test_unwritable_output_folder_exits_2(tiny, tmp_path, capsys):
    root, model, corpus = tiny
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    assert main(["run", "--out", str(blocker / "out"), "--model", model, "--corpus", corpus]) == 2
    assert "cannot write to the output folder" in capsys.readouterr().err


def test_argument_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["run", "--out", "x", "--n-docs", "0"])
    assert caught.value.code == 2
    assert "positive integer" in capsys.readouterr().err


def test_report_command_writes_a_self_contained_html_file(tiny, tmp_path, capsys):
    root, model, corpus = tiny
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--model", model, "--corpus", corpus, "--n-docs", "2",
                 "--context-length", "16", "--baselines", "none", "--no-progress", "--sample-size", "200"]) == 0
    assert main(["report", str(out / "results.safetensors")]) == 0
    page = (out / "report.html").read_text()
    assert "Query-position R²" in page and page.count("data:image/png;base64,") >= 4
    assert "<script src=" not in page and "http://" not in page and "https://" not in page
    (tmp_path / "broken.json").write_text('{"format_version": 1')
    assert main(["report", str(tmp_path / "broken.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_show_puts_trained_first_names_each_file_once_and_survives_a_closed_pipe(tmp_path):
    """`show results/*.safetensors | head`: the glob's order puts baseline_* before results; the reader
    closes the pipe after a line."""
    import subprocess
    import sys as system

    from equivariance_probe import EquivarianceProbe

    from synthetic import tiny_gpt2

    tokens = torch.randint(3, 90, (4, 16), generator=torch.Generator().manual_seed(0))
    for label, seed in (("trained", 0), ("random_init", 1)):
        result = EquivarianceProbe(tiny_gpt2(seed)).run(tokens, progress=False)
        result.metadata["label"] = label
        result.save(tmp_path / ("results.safetensors" if label == "trained" else f"baseline_{label}.safetensors"))
    files = sorted(str(path) for path in tmp_path.glob("*.safetensors"))  # baseline_random_init first
    shown = subprocess.run([system.executable, "-m", "equivariance_probe.cli", "show", *files],
                           capture_output=True, text=True, check=True).stdout
    header = [line for line in shown.splitlines() if line.startswith("| scale")][0]
    assert header.index("trained") < header.index("random_init")
    first = shown.splitlines()[0]
    assert first.startswith("trained (") and first.count("results.safetensors") == 1
    # A reader that is gone before the table is written (`| head` after its lines): no traceback, exit status 0.
    piped = subprocess.Popen([system.executable, "-m", "equivariance_probe.cli", "show", *files],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    piped.stdout.close()
    assert piped.wait(timeout=120) == 0
    assert "Traceback" not in piped.stderr.read().decode()


def test_each_progress_bar_names_its_variant_and_reaches_100_percent_once(tiny, tmp_path, capsys):
    root, model, corpus = tiny
    assert main(["run", "--out", str(tmp_path / "out"), "--model", model, "--corpus", corpus, "--n-docs", "3",
                 "--context-length", "16", "--batch-size", "1", "--sample-size", "0", "--no-figures"]) == 0
    bars = capsys.readouterr().err.replace("\r", "\n")
    for variant in ("trained", "random_init", "zero"):
        finished = [line for line in bars.splitlines() if line.startswith(f"{variant}: documents") and "100%" in line]
        assert len(finished) == 1, (variant, bars)


def test_every_option_of_every_command_has_help_and_there_is_a_version(capsys):
    import argparse

    from equivariance_probe import __version__
    from equivariance_probe.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {'/'.join(action.option_strings) or action.dest} has no help"
    analyses = next(action for action in commands.choices["positional"]._actions if action.dest == "analyses")
    assert "attention_toeplitz" in analyses.help
    with pytest.raises(SystemExit):
        main(["--version"])
    assert __version__ in capsys.readouterr().out


def test_merge_and_report_write_to_out_and_spellings_never_released_are_refused(tiny, tmp_path, capsys):
    root, model, corpus = tiny
    out = tmp_path / "a"
    assert main(["run", "-o", str(out), "--model", model, "--corpus", corpus, "--n-docs", "2", "--context-length", "16",
                 "--baselines", "none", "--no-progress", "--sample-size", "0", "--no-figures"]) == 0
    capsys.readouterr()
    merged = tmp_path / "merged.safetensors"
    assert main(["merge", str(out / "results.safetensors"), "--out", str(merged)]) == 0 and merged.exists()
    for command in ("merge", "report"):
        with pytest.raises(SystemExit, match="2"):
            main([command, str(out / "results.safetensors"), "--output", str(merged)])
        assert "unrecognized arguments: --output" in capsys.readouterr().err
    assert main(["merge", str(out / "results.safetensors")]) == 2
    assert "-o/--out" in capsys.readouterr().err
    assert main(["report", str(out / "results.safetensors"), "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").exists()


def test_every_shared_option_has_one_spelling_and_one_meaning_and_every_command_a_description():
    """A flag that several subcommands take is the same flag on each: the same name, destination, type,
    choices and action, and the same default and help, unless its help says why it differs here."""
    import argparse

    from equivariance_probe.cli import WHY, build_parser, shared_options

    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    by_flag: dict[str, list[tuple[str, argparse.Action]]] = {}
    spellings: dict[str, set[tuple[str, ...]]] = {}
    for name, command in commands.choices.items():
        assert command.description and command.description.strip(), f"{name} has no description line"
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            spellings.setdefault(action.dest, set()).add(tuple(action.option_strings))
            for flag in action.option_strings:
                by_flag.setdefault(flag, []).append((name, action))
    for dest, found in spellings.items():
        assert len(found) == 1, f"{dest} is spelt {sorted(found)} on different subcommands"
    shared = {flag: uses for flag, uses in by_flag.items() if len(uses) > 1}
    assert {"--out", "--model", "--context-length", "--exclude-keys", "--interval-groups", "--no-progress"} <= set(shared)
    reference = argparse.ArgumentParser(add_help=False)  # each shared option as declared
    actions = [reference.add_argument(*flags, **{k: v for k, v in keywords.items() if k != "commands"})
               for flags, keywords in shared_options().values()]
    declared = {flag: action for action in actions for flag in action.option_strings}
    for flag, uses in shared.items():
        assert flag in declared, f"{flag} is on {[name for name, _ in uses]} but not declared once in shared_options()"
        # the argparse action a flag is stored by (Given, which also records that it was typed, stores as argparse's)
        meaning = {(action.dest, action.type, tuple(action.choices or ()),
                    next(kind.__name__ for kind in type(action).__mro__ if kind.__module__ == "argparse"))
                   for _, action in uses}
        assert len(meaning) == 1, f"{flag} means different things: {meaning}"
        for name, action in uses:
            if action.default != declared[flag].default or action.help != declared[flag].help:
                assert f"; {WHY}: " in action.help, f"{name} {flag} differs from its declaration without saying why"


def test_an_option_whose_default_differs_on_a_command_states_one_default(capsys):
    """The shared help's default is dropped where a command changes it, so that the help never says
    "(default: random_init,zero); here: default none"."""
    import argparse

    from equivariance_probe.cli import WHY, build_parser

    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    differing = 0
    for name, command in commands.choices.items():
        for action in command._actions:
            if action.help and f"; {WHY}: " in action.help:
                differing += 1
                assert action.help.replace("%(default)s", "").count("default") <= 1, (name, action.option_strings)
    assert differing >= 15
    with pytest.raises(SystemExit):
        main(["shift", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "'none'; here: default none: each baseline" in shown and "(default: random_init,zero)" not in shown
    assert "windows per forward pass; here: default 1: a segment's" in shown


def test_a_command_that_runs_a_model_takes_every_shared_option_or_says_why_not():
    import argparse
    import re

    from equivariance_probe.cli import build_parser, shared_options

    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    flags = [flags[-1] for flags, _ in shared_options().values()]
    for name in ("run", "compare", "scan", "positional", "shift"):
        command = commands.choices[name]
        taken = {flag for action in command._actions for flag in action.option_strings}
        for flag in flags:
            if flag not in taken:
                assert re.search(re.escape(flag) + r"(?![\w-])", command.description), \
                    f"'{name}' has no {flag} and its description does not say why"


def test_help_wraps_a_list_between_its_names(capsys):
    with pytest.raises(SystemExit):
        main(["positional", "--help"])
    printed = capsys.readouterr().out
    from equivariance_probe.runs.positional import ANALYSES

    lines = [line.strip() for line in printed.splitlines()]
    for name in ANALYSES:  # each name whole on one line
        assert any(name in line.replace(",", " ").split() for line in lines), name


def test_the_framework_is_recorded_and_fingerprinted_under_the_file_format_s_key(tiny, tmp_path, capsys):
    root, model, corpus = tiny
    out = tmp_path / "a"
    assert main(["run", "-o", str(out), "--model", model, "--corpus", corpus, "--n-docs", "2", "--context-length", "16",
                 "--baselines", "none", "--no-progress", "--sample-size", "0", "--no-figures",
                 "--framework", "huggingface"]) == 0
    with pytest.raises(SystemExit, match="2"):
        main(["run", "-o", str(out), "--backend", "huggingface"])
    assert "unrecognized arguments: --backend" in capsys.readouterr().err
    metadata = ProbeResult.load(out / "results.safetensors").metadata
    assert metadata["study"]["framework"] == "huggingface"
    # The fingerprint hashes the framework under its old key, so shards written before still merge.
    from equivariance_probe.records.provenance import config_fingerprint

    measured = {"backend": "huggingface", "context_length": 16, "exclude_keys": [], "seed": 0}
    assert metadata["provenance"]["config_sha256"] == config_fingerprint(measured)


@pytest.mark.parametrize("typed, refused", [
    (["--n-docs", "100", "--context-length", "64", "--exclude-keys", ""], None),
    (["--n-docs", "5"], "--n-docs 5 contradicts --sink-protocol"),
    (["--context-length", "128"], "--context-length 128 contradicts --sink-protocol"),
    (["--exclude-keys", "0,1"], "--exclude-keys 0,1 contradicts --sink-protocol"),
    (["--pack"], "--pack contradicts --sink-protocol"),
])
def test_the_sink_protocol_fills_only_what_was_not_typed_and_refuses_a_contradiction(typed, refused):
    from equivariance_probe.cli.commands.run import PROTOCOL_OPTIONS, apply_sink_protocol
    from equivariance_probe.cli.program import build_parser
    from equivariance_probe.errors import InputError
    from equivariance_probe.runs.study import SINK_PROTOCOL

    assert PROTOCOL_OPTIONS == tuple(SINK_PROTOCOL)
    args = build_parser().parse_args(["run", "-o", "out", "--sink-protocol", *typed])
    if refused is None:
        apply_sink_protocol(args)
        assert (args.n_docs, args.context_length, args.exclude_keys) == (100, 64, [])
    else:
        with pytest.raises(InputError, match=refused):
            apply_sink_protocol(args)


@pytest.mark.parametrize("command", ["run", "show", "report"])
def test_sink_epsilon_is_a_weight_below_one_on_every_command_that_reports_a_sink_rate(command, capsys):
    from equivariance_probe.cli.program import build_parser
    from equivariance_probe.maths.sinks import SINK_EPSILON

    given = ["-o", "out"] if command == "run" else ["results.safetensors"]
    assert build_parser().parse_args([command, *given]).sink_epsilon == SINK_EPSILON
    assert build_parser().parse_args([command, *given, "--sink-epsilon", "0.2"]).sink_epsilon == 0.2
    for bad in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, *given, "--sink-epsilon", bad])
        assert "expected an attention weight in [0, 1)" in capsys.readouterr().err


def test_run_with_the_sink_protocol_measures_64_token_windows_without_exclusions(tiny, capsys):
    from equivariance_probe import ProbeResult

    root, model, corpus = tiny
    out = root / "sinks"
    common = ["--model", model, "--corpus", corpus, "--baselines", "zero", "--no-progress", "--sample-size", "0"]
    # A typed value that differs from the protocol's is refused, naming the flag, before anything runs.
    assert main(["run", "-o", str(out), "--sink-protocol", "--exclude-keys", "0", *common]) == 2
    assert "--exclude-keys 0 contradicts --sink-protocol" in capsys.readouterr().err
    assert main(["run", "-o", str(out), "--sink-protocol", "--context-length", "64", "--sink-epsilon", "0.25",
                 *common]) == 0
    printed = capsys.readouterr().out
    assert "| attention sinks | sink rate: share of (window, head) with α₁ > 0.25 (Gu et al.) |" in printed
    assert "| attention sinks | pooled sink rate: share of heads with window-averaged α₁ > 0.25 |" in printed
    assert "attention sinks (Gu et al.'s sink rate):" in printed and (out / "sink_rate.png").exists() and (out / "first_token.png").exists()
    result = ProbeResult.load(out / "results.safetensors")
    assert result.context_length == 64 and result.excluded_keys == () and result.metadata["study"]["n_docs"] == 5
    assert "BOS token '<bos>'" in result.first_token  # Gemma's tokenizer puts BOS first
    zero = ProbeResult.load(out / "baseline_zero.safetensors")
    assert zero.sink_rate() == 0.0  # uniform heads: α₁ = mean 1/(q + 1) < 0.3 over a long enough window


def test_report_renders_a_shift_result_and_a_positional_study_into_their_pages(tiny, tmp_path, capsys,
                                                                                tiny_model_folder, text_corpus):
    from equivariance_probe.records.container import header_kind
    from equivariance_probe.runs.positional import PositionalStudy
    from equivariance_probe.shift_result import ShiftResult

    root, model, corpus = tiny
    shift = tmp_path / "shift"
    assert main(["shift", "-o", str(shift), "--model", tiny_model_folder("gemma3", n_positions=128),
                 "--corpus", text_corpus(n_docs=6, words=60), "--n-segments", "2", "--n-contexts", "2",
                 "--segment-length", "8", "--offsets", "0,20", "--interval-groups", "2", "--baselines", "random_init",
                 "--no-progress", "--no-figures"]) == 0
    capsys.readouterr()
    assert main(["report", str(shift / "shift_trained.safetensors")]) == 0
    page = (shift / "shift_trained_report.html").read_text(encoding="utf-8")
    assert "wrote " + str(shift / "shift_trained_report.html") in capsys.readouterr().out
    trained = ShiftResult.load(shift / "shift_trained.safetensors")
    assert f"shift test: {trained.model_name}" in page and "random_init" in page and "trained − random_init" in page
    assert page.count("data:image/png;base64,") >= 4 and "http://" not in page and "https://" not in page
    assert not (shift / "shift_report.html").exists()  # 'shift' alone writes that one, with its view
    assert main(["report", str(shift / "shift_random_init.safetensors"), "-o", str(tmp_path / "r.html")]) == 0
    assert "trained − " not in (tmp_path / "r.html").read_text(encoding="utf-8")

    positional = tmp_path / "positional"
    assert main(["positional", "--out", str(positional), "--model", tiny_model_folder("gpt2", 64), "--corpus",
                 text_corpus(n_docs=4, words=40), "--analyses", "tisa,correlation,probe", "--n-docs", "2",
                 "--context-length", "12", "--kernels", "2", "--probe-positions", "4", "--windows-per-doc", "3",
                 "--folds", "2", "--baseline", "none"]) == 0
    assert header_kind(positional / "positional.safetensors") is not None
    assert main(["report", str(positional / "positional.safetensors")]) == 0
    page = (positional / "positional_report.html").read_text(encoding="utf-8")
    study = PositionalStudy.load(positional / "positional.safetensors")
    assert f"positional analyses: {study.model_name}" in page and "held-out R²" in page
    assert "data:image/png;base64," in page

    capsys.readouterr()
    assert main(["report", str(shift / "shift_trained.safetensors"), "--views"]) == 2
    assert "--views draws heads of a probe result's model" in capsys.readouterr().err


def test_report_help_says_what_it_reads_and_names_the_page_shift_writes(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("shift_<variant>.safetensors", "shift_report.html", "positional.safetensors", "results.safetensors"):
        assert words in text, words
