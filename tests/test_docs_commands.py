"""The commands the documentation shows: every flag exists on its command, every `--set` field exists, and
every `fleetscope launch` / `config` example runs (launches as `--dry-run`: the exact command, nothing started)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from helpers import REPO

from fleetscope.cli.config_command import field_docs
from fleetscope.cli.main import build_parser, main
from fleetscope.trainer.config import build_arg_parser

DOCS = [REPO / "README.md", REPO / "slurm" / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "docs" / "examples").glob("*.py"))]
_FENCE = re.compile(r"^\s*```")
_SET_FIELD = re.compile(r"--set[ =]'?([a-z_]+(?:\.[a-z0-9_]+)+)=")


def example_lines(path: Path) -> list[str]:
    """Lines inside code blocks (markdown fences; a Python file's module docstring), continuations joined."""
    lines, inside = [], path.suffix == ".py"
    for line in path.read_text().splitlines():
        if path.suffix == ".py" and line.startswith('"""') and lines:
            break
        if _FENCE.match(line):
            inside = not inside
            continue
        if inside:
            lines.append(line.strip())
    joined, pending = [], ""
    for line in lines:
        pending = f"{pending} {line}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        joined.append(pending)
        pending = ""
    return joined


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `fleetscope`) of every documented `fleetscope ...` command."""
    found = []
    for path in DOCS:
        for line in example_lines(path):
            if line.startswith("fleetscope "):
                found.append((f"{path.relative_to(REPO)}: {line[:60]}", shlex.split(line, comments=True)[1:]))
    return found


def parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {**sub.choices, "train": build_arg_parser()}


def documented_flags(argv: list[str]) -> list[str]:
    """The options of a documented command line ([optional] brackets dropped, values and the program after
    `--` left out)."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    return [word.strip("[]").split("=")[0] for word in words if word.strip("[").startswith("-")]


def test_the_documentation_shows_commands():
    where = {name.split(":")[0] for name, _ in documented_commands()}
    assert {"README.md", "slurm/README.md"} <= where
    assert len(documented_commands()) >= 30


@pytest.mark.parametrize("where, argv", documented_commands(), ids=[w for w, _ in documented_commands()])
def test_every_documented_flag_exists_on_its_command(where, argv):
    commands = parsers()
    assert argv[0] in commands, f"{where}: no command {argv[0]!r}"
    options = commands[argv[0]]._option_string_actions
    unknown = [flag for flag in documented_flags(argv[1:]) if flag != "..." and flag not in options]
    assert unknown == [], f"{where}: {unknown} are not options of `fleetscope {argv[0]}`"


def test_every_documented_set_field_exists():
    fields = {f.key for f in field_docs()}
    for path in DOCS:
        for key in _SET_FIELD.findall(path.read_text()):
            if not key.startswith("section."):
                assert key in fields, f"{path.relative_to(REPO)}: --set {key} is not a field (fleetscope config)"


def runnable(argv: list[str]) -> bool:
    """Launch and config examples without placeholders (`...`, RUN_DIR-like capitals)."""
    return argv[0] in ("launch", "config") and not any("..." in word or re.fullmatch(r"[A-Z_]{3,}", word)
                                                       for word in argv)


def without_optional(argv: list[str]) -> list[str]:
    """The command without its `[--optional VALUE]` parts."""
    kept, depth = [], 0
    for word in argv:
        depth += word.startswith("[")
        if not depth:
            kept.append(word)
        depth -= word.endswith("]") and depth > 0
    return kept


@pytest.mark.parametrize("where, argv", [c for c in documented_commands() if runnable(c[1])],
                         ids=[w for w, a in documented_commands() if runnable(a)])
def test_every_documented_launch_runs_as_a_dry_run(where, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = without_optional(argv)
    scripts = []
    if argv[0] == "launch":
        words = argv[:argv.index("--")] if "--" in argv else argv
        program = argv[len(words):]
        argv = [*words, "--dry-run", *program]
        scripts = stage_scripts(program, tmp_path)
    assert main(argv) == 0, f"{where}: {capsys.readouterr().err}"
    assert capsys.readouterr().out.strip()
    written = sorted(path for path in tmp_path.rglob("*") if path.is_file())
    assert written == scripts, f"{where}: the dry run wrote {written}"


def stage_scripts(program: list[str], folder: Path) -> list[Path]:
    """The user's script a documented command names, as a stub in `folder` (the dry run checks that it
    exists, as the launch does; it never runs it)."""
    scripts = [folder / word for word in program if word.endswith(".py") and not Path(word).is_absolute()][:1]
    for script in scripts:
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text("raise SystemExit('a dry run ran the program')\n")
    return scripts


def test_the_readme_names_every_multicast_variable_launch_sets():
    from fleetscope.launcher.spec import DEFAULT_ENV

    text = " ".join((REPO / "README.md").read_text().split())
    multicast = {name: value for name, value in DEFAULT_ENV.items() if "NVLS" in name or "MULTICAST" in name}
    assert len(multicast) == 3
    for name, value in multicast.items():
        assert f"`{name}={value}`" in text or f"{name}={value}`" in text, name
