"""gather: verify every trace of a run directory and write manifest.json.

Nothing is deleted or rewritten: a file that cannot be used is listed with the reason, a rank with
no usable trace in a window is listed as missing, and everything valid is recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from .capture import read_capture_records
from .kineto import TraceIdentity, TraceReadError, identify_trace, read_raw
from .layout import TRACE_SUFFIX, WINDOW_RE, RunLayout, parse_trace_file_name
from .manifest import Manifest, MissingRank, TraceProblem, TraceRecord, save_manifest, split_duplicates
from .safe_read import InputRefused, entry_problem, read_metadata
from .validate import MAX_LISTED_RANKS, UsageError, checked_world_size, membership_problem, missing_below, rank_problem

_PARALLEL_THRESHOLD = 4


class TraceInspector(Protocol):
    """A later stage reading each trace's bytes in the same pass as gather (postprocess: the per-rank parse
    fills its cache here instead of inflating and decoding every file a second time). Runs in gather's
    worker processes, so it must pickle."""

    def identify(self, raw: bytes, path: Path) -> tuple[TraceIdentity, Any] | None:
        """The identity identify_trace would give these bytes, and what `keep` needs; None leaves the file
        to identify_trace (anything odd), and `keep` is then not called."""

    def keep(self, record: TraceRecord, state: Any, root: Path) -> None:
        """Called once the file is accepted, with its manifest record; must not raise."""


@dataclass(frozen=True)
class _Candidate:
    path: Path
    relative: str
    rank: int | None
    host: str | None
    window: int | None
    attempt: int
    root: Path
    """The run directory: the file must resolve inside it."""


def gather(run_dir: str | Path, *, workers: int | None = None, inspector: TraceInspector | None = None) -> Manifest:
    """Build and write `manifest.json` for a run directory; returns the manifest. `inspector` reads each
    trace in the same pass (TraceInspector)."""
    layout = RunLayout.at(run_dir)
    if not layout.root.is_dir():
        raise FileNotFoundError(f"{layout.root}: run directory does not exist")
    if not (layout.job_file.is_file() or layout.traces_dir.is_dir()):
        # a manifest is written only where a run keeps its traces: never into any folder, nor a window of one
        raise UsageError(f"{layout.root}: not a run directory (no job.json and no traces/ folder): nothing written; "
                         "`fleetscope analyze DIR` reads a folder of traces in place")
    manifest = build_manifest(layout, workers=workers, inspector=inspector)
    save_manifest(manifest, layout)
    return manifest


def build_manifest(layout: RunLayout, *, workers: int | None = None,
                   inspector: TraceInspector | None = None) -> Manifest:
    candidates, problems = _find_candidates(layout)
    results = _inspect_all(candidates, workers, inspector)
    traces, duplicates = split_duplicates([r for r in results if isinstance(r, TraceRecord)])
    problems += duplicates + [r for r in results if isinstance(r, TraceProblem)]
    world_size = _expected_world_size(layout, traces)
    traces, foreign = _consistent_with(traces, world_size)
    problems += foreign
    captures, capture_problems = read_capture_records(layout)
    problems += [TraceProblem(path=p.split(":", 1)[0], reason=p.split(": ", 1)[1]) for p in capture_problems]
    missing, missing_total = _missing_ranks(layout, traces, world_size, captures)
    return Manifest(
        run_dir=str(layout.root),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        world_size=world_size,
        traces=sorted(traces, key=lambda t: (t.window or 0, t.rank, t.attempt)),
        problems=sorted(problems, key=lambda p: p.path),
        missing=missing,
        missing_total=missing_total if missing_total > len(missing) else None,
        captures=captures,
    )


def _consistent_with(traces: list[TraceRecord], world_size: int | None) -> tuple[list[TraceRecord], list[TraceProblem]]:
    """Traces that belong to a job of `world_size` ranks; the others (a rank beyond it, another world size
    in distributedInfo: another job's trace) are problems, not silently merged into this run."""
    kept, problems = [], []
    for trace in traces:
        why = rank_problem(trace.rank) or membership_problem(trace.rank, trace.world_size, world_size)
        if why is None:
            kept.append(trace)
        else:
            problems.append(TraceProblem(path=trace.path, rank=trace.rank, window=trace.window,
                                         reason=f"{why}: not used"))
    return kept, problems


def _find_candidates(layout: RunLayout) -> tuple[list[_Candidate], list[TraceProblem]]:
    candidates, problems = [], []
    if not layout.traces_dir.is_dir():
        return candidates, problems
    for path in sorted(layout.traces_dir.rglob("*")):
        relative = layout.relative(path)
        window = _window_of(path.parent)
        odd = entry_problem(path, within=layout.root)
        if odd is not None:
            # a directory named like a window or anything else not named like a trace is just structure
            if path.name.endswith((".json", ".json.gz")):
                problems.append(TraceProblem(path=relative, window=window, reason=odd))
            continue
        if path.name.startswith("."):
            problems.append(TraceProblem(path=relative, window=window,
                                         reason="unfinished publish (temporary file left behind)"))
            continue
        parsed = parse_trace_file_name(path.name)
        if parsed is None:
            if path.name.endswith((".json", ".json.gz")):
                problems.append(TraceProblem(path=relative, window=window,
                                             reason=f"file name does not match rank<R>.<host>{TRACE_SUFFIX}"))
            continue
        candidates.append(_Candidate(path, relative, parsed.rank, parsed.host, window, parsed.attempt, layout.root))
    return candidates, problems


def _window_of(directory: Path) -> int | None:
    match = WINDOW_RE.match(directory.name)
    return int(match["index"]) if match else None


def _inspect_all(candidates: list[_Candidate], workers: int | None,
                 inspector: TraceInspector | None) -> list[TraceRecord | TraceProblem]:
    inspect = partial(_inspect, inspector=inspector)
    if len(candidates) < _PARALLEL_THRESHOLD:
        return [inspect(c) for c in candidates]
    workers = workers or min(len(candidates), os.cpu_count() or 1)
    # one file per task when each is parsed in full: the slowest file no longer waits behind three others
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(inspect, candidates, chunksize=1 if inspector else 4))


def _inspect(candidate: _Candidate, inspector: TraceInspector | None = None) -> TraceRecord | TraceProblem:
    state = None
    try:
        raw = read_raw(candidate.path, within=candidate.root)
        inspected = inspector.identify(raw, candidate.path) if inspector is not None else None
        if inspected is not None:
            identity, state = inspected
        else:
            identity = identify_trace(raw, candidate.path)
    except TraceReadError as error:
        return TraceProblem(path=candidate.relative, rank=candidate.rank, window=candidate.window, reason=error.reason)
    except (RecursionError, MemoryError) as error:  # one bad file is that file's problem only
        return TraceProblem(path=candidate.relative, rank=candidate.rank, window=candidate.window,
                            reason=f"could not be read: {type(error).__name__}")
    trace_rank = identity.rank
    if trace_rank is not None and candidate.rank is not None and trace_rank != candidate.rank:
        return TraceProblem(
            path=candidate.relative, rank=candidate.rank, window=candidate.window,
            reason=f"file name says rank {candidate.rank} but distributedInfo says rank {trace_rank}",
        )
    record = TraceRecord(
        path=candidate.relative,
        rank=candidate.rank if candidate.rank is not None else (trace_rank or 0),
        host=str(identity.host_name or candidate.host or "unknown-host"),
        window=candidate.window,
        attempt=candidate.attempt,
        steps=identity.steps,
        bytes=len(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
        world_size=identity.world_size,
        event_count=identity.event_count,
    )
    if inspector is not None and state is not None:
        inspector.keep(record, state, candidate.root)
    return record


def _expected_world_size(layout: RunLayout, traces: list[TraceRecord]) -> int | None:
    """The job's world size from job.json when the launcher wrote one, else what the traces say."""
    try:
        declared = checked_world_size(json.loads(read_metadata(layout.job_file, within=layout.root)).get("world_size"))
        if declared:
            return declared
    except (InputRefused, ValueError, AttributeError, RecursionError):
        pass
    sizes = [t.world_size for t in traces if t.world_size]
    if sizes:
        return max(set(sizes), key=sizes.count)  # the majority: a stray trace of another job stands out
    return checked_world_size(max((t.rank for t in traces), default=-1) + 1 or None)


def _missing_ranks(layout: RunLayout, traces: list[TraceRecord], world_size: int | None,
                   captures: list | None = None) -> tuple[list[MissingRank], int]:
    """(the first missing ranks of each window, how many are missing in all): bounded whatever size is
    declared; a requested window limited to some ranks expects only those."""
    if not world_size:
        return [], 0
    chosen = {c.window: set(c.ranks) for c in captures or [] if c.ranks is not None}
    windows = sorted({t.window for t in traces if t.window is not None})
    if not windows and layout.traces_dir.is_dir():
        windows = sorted(_window_of(d) for d in layout.traces_dir.glob("window*") if _window_of(d) is not None)
    missing, total = [], 0
    for window in windows or [None]:
        present = {t.rank for t in traces if t.window == window}
        if window in chosen:
            absent = sorted(chosen[window] - present)
            listed, count = absent[:MAX_LISTED_RANKS], len(absent)
        else:
            listed, count = missing_below(world_size, present)
        missing += [MissingRank(rank=r, window=window) for r in listed]
        total += count
    return missing, total
