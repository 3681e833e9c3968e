"""Which Kineto traces are this job's: the job's time span, and the traces a program left where nobody collects.

    job_span(layout)          when the job started (and ended, once job.json says so), from job.json
    find_kineto_traces(root)  `*.pt.trace.json[.gz]` files under a folder, modified since a time (bounded walk)
    suggested_glob(paths)     the `--collect-traces` pattern that matches those files, relative to a folder

A program that writes its own traces (`tensorboard_trace_handler('./tb_traces')`) names every file uniquely,
so a folder reused from run to run holds earlier runs' traces too: only files modified within the job's span
are this job's.
"""

from __future__ import annotations

import os
import shlex
import stat
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from .jobfile import read_job_record
from .layout import RunLayout, run_holding_traces

CLOCK_SLACK_S = 2.0
"""Seconds a file's modification time may lie before the recorded start (job.json keeps whole seconds; a
shared file system's clock may differ a little) and still count as this job's."""
KINETO_ENDINGS = (".pt.trace.json", ".pt.trace.json.gz")
"""What torch.profiler's `tensorboard_trace_handler` names its files."""
MAX_LOOKED_DIRS = 2000
MAX_LOOKED_DEPTH = 6
SKIPPED_DIR_NAMES = frozenset({"node_modules", "__pycache__", "site-packages"})


@dataclass(frozen=True, kw_only=True)
class JobSpan:
    """When a job ran, in seconds since the epoch (None: not recorded)."""

    started: float | None
    """The start job.json records (a batch job: its submission, which comes earlier)."""
    ended: float | None = None
    """The end job.json records; None while the job runs (a node collecting right after its program)."""

    def outside(self, mtime: float) -> str | None:
        """"before" / "after" for a modification time outside the span, None inside it."""
        if self.started is not None and mtime < self.started - CLOCK_SLACK_S:
            return "before"
        if self.ended is not None and mtime > self.ended + CLOCK_SLACK_S:
            return "after"
        return None


def job_span(layout: RunLayout) -> JobSpan:
    """The span job.json records: `started_at` (else `submitted_at`, else `created_at`) to `finished_at`."""
    try:
        record = read_job_record(layout)
    except ValueError:
        record = {}
    start = next((record[name] for name in ("started_at", "submitted_at", "created_at") if record.get(name)), None)
    return JobSpan(started=_epoch(start), ended=_epoch(record.get("finished_at")))


def _epoch(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def find_kineto_traces(root: Path, *, since: float | None, exclude: Path | None = None) -> list[Path]:
    """Regular `*.pt.trace.json[.gz]` files under `root` modified at or after `since` (less CLOCK_SLACK_S),
    outside `exclude` and outside any run's traces/; hidden folders, symlinked folders and package folders
    are not entered, and at most MAX_LOOKED_DIRS folders, MAX_LOOKED_DEPTH deep, are listed (a hint, not a
    collection: a cut-short walk just finds fewer)."""
    found: list[Path] = []
    pending, listed = [(Path(root), 0)], 0
    skip = os.path.realpath(exclude) if exclude is not None else None
    while pending and listed < MAX_LOOKED_DIRS:
        directory, depth = pending.pop(0)
        listed += 1
        try:
            with os.scandir(directory) as scan:
                entries = sorted(scan, key=lambda entry: entry.name)
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") or entry.name in SKIPPED_DIR_NAMES:
                continue
            if entry.is_dir(follow_symlinks=False):
                if depth < MAX_LOOKED_DEPTH and os.path.realpath(entry.path) != skip:
                    pending.append((Path(entry.path), depth + 1))
            elif entry.name.endswith(KINETO_ENDINGS) and _new_regular_file(entry, since):
                found.append(Path(entry.path))
    return [path for path in found if run_holding_traces(path) is None]


def _new_regular_file(entry: os.DirEntry, since: float | None) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and (since is None or info.st_mtime >= since - CLOCK_SLACK_S)


def suggested_glob(paths: list[Path], base: Path) -> str:
    """A pattern, relative to `base` when the files lie under it, that matches every one of `paths`."""
    folders = {path.parent for path in paths}
    common = Path(os.path.commonpath([str(folder) for folder in folders]))
    ending = ".pt.trace.json.gz" if all(p.name.endswith(".gz") for p in paths) else (
        ".pt.trace.json" if not any(p.name.endswith(".gz") for p in paths) else ".pt.trace.json*")
    name = f"*{ending}" if folders == {common} else f"**/*{ending}"
    try:
        prefix = common.relative_to(base)
    except ValueError:
        prefix = common
    return str(prefix / name) if str(prefix) != "." else name


UNCOLLECTED_FIELD = "uncollected_traces"
"""job.json's field holding the hint uncollected_traces_hint printed, so that the run's report carries it too."""
MAX_HINT_CHARS = 2000


def recorded_uncollected_hint(record: dict) -> str | None:
    """The hint a launch recorded in job.json (UNCOLLECTED_FIELD), bounded; None where there is none."""
    hint = record.get(UNCOLLECTED_FIELD)
    return hint[:MAX_HINT_CHARS] if isinstance(hint, str) and hint else None


def uncollected_traces_hint(workdir: Path, run_dir: Path, span: JobSpan) -> list[str]:
    """Lines naming the Kineto traces a program wrote under `workdir` during the job, outside the run
    directory, with the exact flag (and command) that files them; no lines when there are none."""
    if span.started is None:
        return []
    found = [path for path in find_kineto_traces(workdir, since=span.started, exclude=run_dir)
             if span.outside(path.stat().st_mtime) is None]
    if not found:
        return []
    pattern = suggested_glob(found, workdir)
    where = sorted({str(path.parent) for path in found})
    return [f"fleetscope: found {len(found)} new Kineto trace(s) this job wrote in {', '.join(where[:3])}"
            f"{' ...' if len(where) > 3 else ''}, not filed into the run: rerun with --collect-traces "
            f"{shlex.quote(pattern)}, or file them now: fleetscope collect-traces {shlex.quote(str(run_dir))} "
            f"{shlex.quote(pattern)} (from {shlex.quote(str(workdir))}), or use "
            f"on_trace_ready=fs.trace_handler() (fleetscope.trainer.user_profiling) in your script"]


def no_match_hint(pattern: str, span: JobSpan) -> str:
    """Why a pattern matched nothing: the first folder of its literal part that does not exist, and the
    Kineto traces this job wrote near it, as a pattern to use instead."""
    parts = Path(pattern).parts
    literal = Path(*parts[:next((i for i, part in enumerate(parts) if _magic(part)), len(parts))])
    missing = next((folder for folder in (*reversed(literal.parents), literal) if not folder.exists()), None)
    near = (missing.parent if missing is not None else literal) if literal.parts else Path.cwd()
    words = [f"no folder {missing}" if missing is not None and missing != Path(pattern) else "no file matches it"]
    found = find_kineto_traces(near, since=span.started) if near.is_dir() else []
    if found:
        words.append(f"this job wrote {len(found)} Kineto trace(s) under {near}: try "
                     f"{shlex.quote(str(near / suggested_glob(found, near)))}")
    else:
        words.append("a relative pattern is relative to the directory launch ran in; quote it so the shell "
                     "does not expand it")
    return "; ".join(words)


def _magic(part: str) -> bool:
    return any(char in part for char in "*?[")
