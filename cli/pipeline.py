"""`postprocess` as the command line runs it: analysis/postprocess.py with each stage's outcome printed and
progress on stderr."""

from __future__ import annotations

from pathlib import Path

from ..analysis.quantities import step_ranges
from ..traces.validate import missing_note
from .progress import counting, progress_callback
from .terminal_text import escape_controls


def postprocess(run_dir: str | Path, options=None, *, echo: bool = True, **keywords):
    """analysis.postprocess.postprocess, printing what each stage found when `echo` (progress always)."""
    from ..analysis.options import AnalyzeOptions
    from ..analysis.postprocess import postprocess as run_postprocess

    return run_postprocess(run_dir, options or AnalyzeOptions(), echo=terminal_echo(print_stages=echo), **keywords)


def terminal_echo(*, print_stages: bool = True):
    """The StageEcho of the command line: progress on stderr; with `print_stages`, each stage's outcome on
    stdout."""
    from ..analysis.postprocess import StageEcho

    if not print_stages:
        return StageEcho(progress=progress_callback, merge_progress=counting)
    return StageEcho(manifest=lambda manifest: print(describe_manifest(manifest)), report=_print_report,
                     merged=_print_merge, progress=progress_callback, merge_progress=counting)


def _print_report(report) -> None:
    from ..analysis.render.terminal import render_terminal

    print(escape_controls(render_terminal(report)))   # names from traces are untrusted text


def _print_merge(merged) -> None:
    from .merge_messages import describe_merge

    print("\n".join(describe_merge(merged)))


def describe_manifest(manifest) -> str:
    lines = [f"gathered {len(manifest.traces)} trace(s) of world size {manifest.world_size} "
             f"in {len(manifest.windows)} window(s)"]
    lines += [f"  unreadable: {p.path}: {p.reason}" for p in manifest.problems]
    by_window: dict = {}
    for entry in manifest.missing:
        by_window.setdefault(entry.window, set()).add(entry.rank)
    total = manifest.missing_total or len(manifest.missing)
    for window, ranks in sorted(by_window.items(), key=lambda item: item[0] or 0):
        count = total if len(by_window) == 1 else len(ranks)
        of = f" of {manifest.world_size}" if manifest.world_size else ""
        where = "" if window is None else f" in window {window}"
        if count > len(ranks) and manifest.world_size:  # the list is capped: the whole set when it is every gap
            present = {t.rank for t in manifest.traces if t.window == window}
            every = [r for r in range(manifest.world_size) if r not in present]
            ranks = set(every) if len(every) == count else ranks
        lines.append(f"  missing{where}: {count}{of} ranks ({step_ranges(sorted(ranks))})")
    counted = missing_note(len(manifest.missing), manifest.missing_total)
    return "\n".join(lines + ([f"  missing: {counted}"] if counted else []))
