"""The command line's shape: every command answers --help, analyze and postprocess offer the same analysis
flags, and exit codes are numbers from traces/exit_status.py only, never literals in a handler."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from fleetscope.cli.analysis_args import ANALYSIS_DESTS
from fleetscope.cli.main import build_parser, main

PACKAGE = Path(__file__).resolve().parents[1]
EXIT_CODES_MODULE = PACKAGE / "traces" / "exit_status.py"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_registered_command_answers_help(command, capsys):
    try:
        code = main([command, "--help"])   # `train` hands --help to the trainer, which returns
    except SystemExit as stopped:          # argparse's --help exits
        code = stopped.code
    assert code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def analysis_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions if action.dest in ANALYSIS_DESTS for flag in action.option_strings}


def test_analyze_and_postprocess_offer_the_same_analysis_flags():
    commands = subcommands()
    analyze, postprocess = analysis_flags(commands["analyze"]), analysis_flags(commands["postprocess"])
    assert analyze == postprocess
    assert len(analyze) == len(ANALYSIS_DESTS)
    own = {flag for action in commands["analyze"]._actions for flag in action.option_strings}
    assert own - analyze == {"-h", "--help", "--json", "--html", "--check"}   # analyze's outputs, not the analysis


def test_postprocess_help_lists_the_analysis_flags():
    text = subcommands()["postprocess"].format_help()
    for flag in ("--no-hta", "--hta-ranks", "--hta-oracle", "--no-cache", "--cache-dir", "--link-peak",
                 "--comm-kernel-pattern"):
        assert flag in text


# --- exit codes: numbers defined once ----------------------------------------------------------------------------

NOT_EXIT_CODES = {("cli/jobargs.py", "nproc_per_node")}
"""cli/ functions annotated `-> int` that return a count, not an exit code."""


def returns_exit_code(function: ast.FunctionDef, path: Path) -> bool:
    """A command handler of cli/ (`handle_*`, or any cli/ function annotated to return an int: what handlers and
    their helpers return is an exit code), or an `exit_code` function or property anywhere."""
    if function.name == "exit_code" or function.name.startswith("handle_"):
        return True
    if (f"{path.parent.name}/{path.name}", function.name) in NOT_EXIT_CODES:
        return False
    annotation = ast.unparse(function.returns) if function.returns is not None else ""
    return path.parent.name == "cli" and annotation in ("int", "int | None")


def literal_returns(function: ast.FunctionDef) -> list[int]:
    """Lines where `function` itself (not a nested function) returns an int literal, plainly or in a conditional."""
    found = []
    nodes = list(ast.iter_child_nodes(function))
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            values = [node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp) else [node.value]
            if any(isinstance(v, ast.Constant) and type(v.value) is int for v in values):
                found.append(node.lineno)
        nodes.extend(ast.iter_child_nodes(node))
    return found


def exit_code_literals(path: Path, source: str) -> list[str]:
    tree = ast.parse(source)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and path != EXIT_CODES_MODULE:   # EXIT_X = 3 outside the one module
            named = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("EXIT_")]
            if named and isinstance(node.value, ast.Constant):
                problems.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {named[0]} = {node.value.value!r}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and returns_exit_code(node, path):
            problems += [f"{path.relative_to(PACKAGE)}:{line}: {node.name} returns an int literal"
                         for line in literal_returns(node)]
    return problems


def package_files() -> list[Path]:
    return [p for folder in ("cli", "analysis", "launcher", "traces", "trainer") for p in (PACKAGE / folder).rglob("*.py")]


def test_exit_codes_come_from_the_one_module():
    problems = [p for path in package_files() for p in exit_code_literals(path, path.read_text())]
    assert problems == []


def test_the_exit_code_scan_finds_a_literal_it_should():
    """The scan itself: a handler, an exit_code property and a constant that each spell a number are found."""
    planted = PACKAGE / "cli" / "planted.py"
    source = ("EXIT_BAD = 4\n"
              "def handle_x(args):\n    return 0 if args else EXIT_OK\n"
              "class R:\n    @property\n    def exit_code(self) -> int:\n        return 1\n"
              "def helper(args) -> int | None:\n    def inner():\n        return 5\n    return None\n")
    assert [p.split(": ", 1)[1] for p in exit_code_literals(planted, source)] == [
        "EXIT_BAD = 4", "handle_x returns an int literal", "exit_code returns an int literal"]


# --- one AnalyzeOptions from the flags; postprocess renders the HTML once ------------------------------------------


def test_analyze_and_postprocess_build_the_same_options_from_the_same_flags(tmp_path):
    from fleetscope.analysis.options import AnalyzeOptions
    from fleetscope.cli.analysis_args import analyze_options_from_args

    flags = ["--no-hta", "--hta-ranks", "0,3", "--no-cache", "--cache-dir", str(tmp_path), "--link-peak", "50",
             "--comm-kernel-pattern", "dispatch"]
    parser = build_parser()
    built = [analyze_options_from_args(parser.parse_args([command, str(tmp_path), *flags]))
             for command in ("analyze", "postprocess")]
    assert built[0] == built[1] == AnalyzeOptions(use_hta=False, hta_ranks=(0, 3), use_cache=False, cache_dir=tmp_path,
                                                  link_peak_gbps=50.0, comm_kernel_pattern="dispatch")
    assert analyze_options_from_args(parser.parse_args(["analyze", str(tmp_path)])) == AnalyzeOptions()


def test_postprocess_with_slurm_refuses_any_analysis_flag_but_the_cache(tmp_path, capsys):
    (tmp_path / "traces").mkdir()
    assert main(["postprocess", str(tmp_path), "--slurm", "--hta-ranks", "all", "--dry-run"]) == 2
    assert "--hta-ranks: not with --slurm" in capsys.readouterr().err


def test_postprocess_renders_the_html_report_once_with_the_merged_traces_steps(tmp_path, monkeypatch):
    import shutil

    from fleetscope.analysis.postprocess import StageEcho, postprocess
    from fleetscope.analysis.render import html

    run = tmp_path / "run"
    shutil.copytree(PACKAGE / "tests" / "fixtures" / "gpu" / "h200-fsdp-1rank", run)
    calls = []
    render = html.render_html
    monkeypatch.setattr(html, "render_html", lambda report, **kw: calls.append(kw) or render(report, **kw))
    result = postprocess(run, echo=StageEcho(), use_hta=False, cache_dir=tmp_path / "cache")
    assert result.errors == [] and "merged_trace" in result.outputs
    assert len(calls) == 1 and calls[0]["trace_ranges"] is not None
    assert (run / "report" / "report.html").is_file()
