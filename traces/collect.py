"""Collecting traces a training program wrote itself (zero-line mode: `launch --collect-traces GLOB`).

Programs with their own profiler (torchtitan: `<dump_folder>/profile_trace/iteration_<N>/rank<R>_trace.json`)
leave Kineto traces on each node. After the job, each node runs `collect_traces` over its own disk: every
file the glob matches is read, given a rank and a window, checked, and published into the run directory
like a fleetscope trace (traces/writer.py: gzipped, atomic, never overwriting), so gather, analyze and
merge treat it as one of ours.

  * rank: the trace's `distributedInfo.rank`, else the last `rank<R>` in its file name; when both exist
    they must agree;
  * window: the i-th distinct `iteration_<N>` of the matched paths (by N) is window i; traces with no
    `iteration_<N>` in their path take windows in path order per rank;
  * at most one trace per rank and window; a file that breaks a rule is skipped with the reason;
  * only this job's: a file modified before the job started (or after it ended, once job.json says so) is
    an earlier run's, left in place and named (own_traces.JobSpan); two traces of one rank that cover the
    same steps are both refused, naming each other (two runs' traces: which is this job's cannot be told).

Collecting twice (a node's task end, then a post-processing run; or several nodes that see the same
shared folder) publishes each file once: a claim named by the file's content is created exclusively
under `<run>/logs/collected/` before publishing.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import re
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .kineto import TraceReadError, identify_trace, read_raw
from .layout import RunLayout, collected_claim, parse_trace_file_name, run_holding_traces
from .own_traces import JobSpan, job_span, no_match_hint
from .writer import publish_trace

ITERATION_RE = re.compile(r"iteration_(\d+)")
NAME_RANK_RE = re.compile(r"rank(\d+)")
TRACE_ENDINGS = (".json", ".json.gz")


@dataclass(frozen=True, kw_only=True)
class FoundTrace:
    source: Path
    rank: int
    iteration: int | None
    digest: str
    """sha256 of the file's bytes."""
    steps: tuple[int, ...] = ()
    """Its ProfilerStep numbers."""


@dataclass(frozen=True, kw_only=True)
class CollectedTrace:
    source: Path
    rank: int
    window: int
    iteration: int | None
    published: Path | None
    """Where it was published; None: an earlier collection already published this file."""


@dataclass(kw_only=True)
class Collection:
    pattern: str
    collected: list[CollectedTrace] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(file, why) of matched files that were not collected."""
    span: JobSpan = field(default_factory=lambda: JobSpan(started=None))
    """The job's span the files were judged against."""
    outside_job: list[tuple[str, float, str]] = field(default_factory=list)
    """(file, modification time, "before" | "after") of matched files from outside the job's span: left in place."""
    conflicts: list[tuple[str, str, list[int]]] = field(default_factory=list)
    """(file, other file, shared steps) of one rank's traces that cover the same steps: neither collected."""
    matched: int = 0
    """Files the pattern matched."""
    hint: str = ""
    """Why the pattern matched nothing, and what might (empty when it matched)."""

    @property
    def incomplete(self) -> bool:
        """A matched file of this job was not collected (skipped or refused)."""
        return bool(self.skipped or self.conflicts)


def collect_traces(pattern: str, layout: RunLayout, *, ranks: set[int] | None = None,
                   host: str | None = None, attempt: int = 0, span: JobSpan | None = None) -> Collection:
    """Publish every trace `pattern` matches on this node into the run directory (see the module docstring).
    `ranks`: collect only these ranks (a task that knows its own rank); `host`: the name in the file names;
    `span`: when the job ran (default: what the run's job.json records)."""
    collection = Collection(pattern=pattern, span=span if span is not None else job_span(layout))
    matched = _matches(pattern, collection)
    collection.matched = len(matched)
    if not matched:
        collection.hint = no_match_hint(pattern, collection.span)
    paths = [p for p in _within_job(matched, collection) if not _in_a_runs_traces(p, collection)]
    found = _refuse_conflicts([t for t in (_inspect(Path(p), collection) for p in paths) if t is not None],
                              collection)
    host = host or socket.gethostname()
    for trace, window in _assign_windows(found, collection):
        if ranks is not None and trace.rank not in ranks:
            continue
        published = None
        claim = collected_claim(layout, window, trace.rank, trace.digest)
        if not claim.exists() and _slot_taken(layout, trace, window, collection):
            continue
        if _claim(layout, trace, window):
            published = publish_trace(trace.source, layout, window=window, rank=trace.rank, host=host,
                                      attempt=attempt)
        collection.collected.append(CollectedTrace(source=trace.source, rank=trace.rank, window=window,
                                                   iteration=trace.iteration, published=published))
    return collection


def _matches(pattern: str, collection: Collection) -> list[str]:
    """The regular files `pattern` matches (glob syntax, `**` any depth), each file once (by inode). Symlinked
    directories below the pattern's literal prefix are not followed (two links to a parent would make a
    recursive glob endless); at most MAX_WALKED_DIRS directories are listed and MAX_MATCHES files kept,
    and a walk cut short is said in `collection.skipped`."""
    parts = Path(pattern).parts
    literal = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    root, rest = Path(*parts[:literal]) if literal else Path("."), list(parts[literal:])
    budget = _WalkBudget()
    candidates = _walk(root, rest, budget, 0) if rest else iter([root])
    found: dict[tuple[int, int], str] = {}
    for path in candidates:
        if not str(path).endswith(TRACE_ENDINGS):
            continue
        try:
            info = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found.setdefault((info.st_dev, info.st_ino), str(path))
        if len(found) >= MAX_MATCHES:
            budget.cut = f"stopped at {MAX_MATCHES} matching files"
            break
    if budget.cut:
        collection.skipped.append((pattern, f"{budget.cut}: the rest of the pattern's matches were not looked at"))
    return sorted(found.values())


MAX_WALKED_DIRS = 100_000
MAX_MATCHES = 100_000
MAX_DEPTH = 64


@dataclass
class _WalkBudget:
    dirs_left: int = MAX_WALKED_DIRS
    cut: str = ""


def _walk(directory: Path, parts: list[str], budget: _WalkBudget, depth: int):
    """Paths under `directory` matching the pattern components `parts` (glob rules: `*` skips dot names)."""
    head, rest = parts[0], parts[1:]
    if head == "**":
        if rest:
            yield from _walk(directory, rest, budget, depth)
        for entry in _listing(directory, budget, depth):
            if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                yield from _walk(Path(entry.path), parts, budget, depth + 1)
        return
    for entry in _listing(directory, budget, depth):
        if entry.name.startswith(".") and not head.startswith("."):
            continue
        if not fnmatch.fnmatchcase(entry.name, head):
            continue
        if not rest:
            yield Path(entry.path)
        elif entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path), rest, budget, depth + 1)


def _listing(directory: Path, budget: _WalkBudget, depth: int) -> list[os.DirEntry]:
    if depth > MAX_DEPTH:
        budget.cut = budget.cut or f"stopped at {MAX_DEPTH} directory levels"
        return []
    if budget.dirs_left <= 0:
        budget.cut = budget.cut or f"stopped after listing {MAX_WALKED_DIRS} directories"
        return []
    budget.dirs_left -= 1
    try:
        with os.scandir(directory) as entries:
            return sorted(entries, key=lambda entry: entry.name)
    except OSError:
        return []


def _within_job(paths: list[str], collection: Collection) -> list[str]:
    """The paths modified within the job's span; the others go to `collection.outside_job`, untouched."""
    kept = []
    for path in paths:
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue
        where = collection.span.outside(mtime)
        if where is None:
            kept.append(path)
        else:
            collection.outside_job.append((path, mtime, where))
    return kept


def _refuse_conflicts(found: list[FoundTrace], collection: Collection) -> list[FoundTrace]:
    """Drop every trace that shares a step with another trace of its rank and `iteration_<N>` (both named in
    `collection.conflicts`: two runs' traces); traces in different `iteration_<N>` folders are that many
    windows, whatever their step numbers (a program may start a profiler, and its step count, per window).
    A byte-identical copy of a trace is skipped as such, not a conflict."""
    first_of_step: dict[tuple[int, int | None, int], FoundTrace] = {}
    seen_digest: dict[str, Path] = {}
    refused: set[Path] = set()
    kept: list[FoundTrace] = []
    for trace in found:
        if trace.digest in seen_digest:
            collection.skipped.append((str(trace.source), f"the same bytes as {seen_digest[trace.digest]}"))
            continue
        seen_digest[trace.digest] = trace.source
        kept.append(trace)
        others: dict[Path, list[int]] = {}
        for step in trace.steps:
            other = first_of_step.setdefault((trace.rank, trace.iteration, step), trace)
            if other is not trace:
                others.setdefault(other.source, []).append(step)
        for other, steps in others.items():
            collection.conflicts.append((str(trace.source), str(other), steps))
            refused.update((trace.source, other))
    return [trace for trace in kept if trace.source not in refused]


def _in_a_runs_traces(path: str, collection: Collection) -> bool:
    """A match inside a run directory's traces/ (fleetscope's own traces of this or another run) is skipped."""
    run = run_holding_traces(path)
    if run is not None:
        collection.skipped.append((path, f"inside the traces/ of the run {run}: fleetscope's own trace, "
                                         "not a program's (not collected)"))
    return run is not None


def _slot_taken(layout: RunLayout, trace: FoundTrace, window: int, collection: Collection) -> bool:
    """Whether the run already holds a trace of this rank in this window that no collection of this file
    filed (publishing would make it an earlier attempt, silently replaced): then skipped with the reason."""
    directory = layout.window_dir(window)
    try:
        names = os.listdir(directory) if directory.is_dir() else []
    except OSError:
        names = []
    held = sorted(n for n in names if (parsed := parse_trace_file_name(n)) and parsed.rank == trace.rank)
    if held:
        collection.skipped.append((str(trace.source), f"the run's {directory.name}/ already holds rank {trace.rank}'s "
                                                      f"trace {held[0]}: not collected over it"))
    return bool(held)


def _inspect(path: Path, collection: Collection) -> FoundTrace | None:
    try:
        raw = read_raw(path)
        identity = identify_trace(raw, path)
        info_rank = identity.rank
    except TraceReadError as error:
        collection.skipped.append((str(path), error.reason))
        return None
    named = NAME_RANK_RE.findall(path.name)
    name_rank = int(named[-1]) if named else None
    if info_rank is not None and name_rank is not None and info_rank != name_rank:
        collection.skipped.append((str(path), f"file name says rank {name_rank} but distributedInfo says rank "
                                              f"{info_rank}"))
        return None
    rank = info_rank if info_rank is not None else name_rank
    if rank is None:
        collection.skipped.append((str(path), "no rank: neither distributedInfo nor rank<R> in the file name"))
        return None
    iterations = ITERATION_RE.findall(str(path))
    return FoundTrace(source=path, rank=rank, iteration=int(iterations[-1]) if iterations else None,
                      digest=hashlib.sha256(raw).hexdigest(), steps=tuple(identity.steps))


def _assign_windows(found: list[FoundTrace], collection: Collection) -> list[tuple[FoundTrace, int]]:
    """(trace, window) pairs; a second trace of the same rank and window is skipped with the reason."""
    iterations = sorted({trace.iteration for trace in found if trace.iteration is not None})
    window_of_iteration = {iteration: index for index, iteration in enumerate(iterations)}
    per_rank_count: dict[int, int] = {}
    assigned: list[tuple[FoundTrace, int]] = []
    taken: dict[tuple[int, int], Path] = {}
    for trace in sorted(found, key=lambda t: (t.iteration is not None, t.iteration or 0, str(t.source))):
        if trace.iteration is not None:
            window = window_of_iteration[trace.iteration]
        else:
            window = per_rank_count.get(trace.rank, 0)
            per_rank_count[trace.rank] = window + 1
        if (trace.rank, window) in taken:
            collection.skipped.append((str(trace.source), f"a second trace of rank {trace.rank} in window {window} "
                                                          f"(first: {taken[trace.rank, window]})"))
            continue
        taken[trace.rank, window] = trace.source
        assigned.append((trace, window))
    return assigned


def _claim(layout: RunLayout, trace: FoundTrace, window: int) -> bool:
    """True for the first collection of this file's content as this rank and window."""
    claim = collected_claim(layout, window, trace.rank, trace.digest)
    claim.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as handle:
        handle.write(f"{trace.source}\n")
    return True
