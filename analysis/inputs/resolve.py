"""What to analyze: the trace files behind a path, with what is known about them before reading.

A path is one of:
  - a fleetscope run directory (manifest.json, or traces/ from which a manifest is built in memory;
    nothing is written);
  - any directory of Kineto trace files (`*.json`, `*.json.gz`, searched recursively; a `window<N>`
    folder names the window);
  - a single trace file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from fleetscope.analysis.inputs.sources import (
    SOURCE_RUN_DIR,
    SOURCE_TRACE_DIR,
    SOURCE_TRACE_FILE,
    MeasuredOffset,
    MissingTrace,
    TraceFailure,
    TraceSource,
)
from fleetscope.analysis.inputs.records import RunRecords, read_run_records
from fleetscope.traces.gather import build_manifest
from fleetscope.traces.kineto import find_trace_like_entries
from fleetscope.traces.safe_read import entry_problem
from fleetscope.traces.validate import missing_note
from fleetscope.traces.layout import WINDOW_RE, RunLayout
from fleetscope.traces.manifest import TraceRecord
from fleetscope.traces.outputs import is_own_output


@dataclass(kw_only=True)
class AnalysisInput:
    root: Path
    kind: str
    """run_dir, trace_dir or trace_file."""
    sources: list[TraceSource]
    failures: list[TraceFailure] = field(default_factory=list)
    """Files already known to be unusable (from the manifest)."""
    missing: list[MissingTrace] = field(default_factory=list)
    missing_total: int = 0
    """Rank traces missing in all (the manifest lists the first ones only)."""
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)
    layout: RunLayout | None = None
    measured_offsets: dict[int, MeasuredOffset] = field(default_factory=dict)
    """Clock offsets from the run's clock/rank<R>.json files."""
    clock_problems: list[str] = field(default_factory=list)
    """Clock files that could not be used, as 'file: reason' (also in `notes`)."""
    records: RunRecords | None = None
    """What the run directory states besides its traces, read once (None: not a run directory)."""


def resolve_input(path: str | Path, *, records: RunRecords | None = None) -> AnalysisInput:
    """Find the traces behind `path`; raises FileNotFoundError / ValueError for a path that holds none.
    `records`: the run directory's records when the caller has read them (read here otherwise)."""
    root = Path(path).expanduser().absolute()
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such file or directory")
    if not root.is_dir():
        # a FIFO or a device given as the path is refused by the reader, named, never opened
        return AnalysisInput(root=root, kind=SOURCE_TRACE_FILE,
                             sources=[TraceSource(path=root, label=root.name, window=None)])
    layout = RunLayout.at(root)
    if layout.manifest_file.is_file() or layout.traces_dir.is_dir():
        return _run_dir_input(layout, records if records is not None else read_run_records(layout))
    return _trace_dir_input(root)


def _run_dir_input(layout: RunLayout, run: RunRecords) -> AnalysisInput:
    manifest, notes = _manifest_of(layout, run)
    records, superseded = _latest_attempts(manifest.traces)
    if superseded:
        notes.append(f"{len(superseded)} trace(s) from earlier attempts of a requeued job were not analyzed")
    notes += [n for n in [missing_note(len(manifest.missing), manifest.missing_total)] if n]
    sources = [record_source(r, layout.root) for r in records]
    failures = [TraceFailure(label=p.path, window=p.window, rank=p.rank, reason=p.reason) for p in manifest.problems]
    clock_files, clock_problems = run.clock, list(run.clock_problems)
    return AnalysisInput(
        root=layout.root, kind=SOURCE_RUN_DIR, sources=sources, failures=failures,
        missing=[MissingTrace(rank=m.rank, window=m.window) for m in manifest.missing],
        missing_total=max(manifest.missing_total or 0, len(manifest.missing)),
        world_size=manifest.world_size, notes=notes + clock_problems, layout=layout, clock_problems=clock_problems,
        measured_offsets={rank: MeasuredOffset(offset_us=c.offset_us, uncertainty_us=c.uncertainty_us)
                          for rank, c in clock_files.items()},
        records=run,
    )


def record_source(record: TraceRecord, run_dir: Path) -> TraceSource:
    """How analyze reads the trace a manifest record names (also what the parsed-trace cache is keyed by)."""
    path = Path(record.path)
    return TraceSource(path=path if path.is_absolute() else run_dir / path, label=record.path, window=record.window,
                       rank=record.rank, host=record.host, within=run_dir, expected_bytes=record.bytes,
                       expected_sha256=record.sha256)


def _manifest_of(layout: RunLayout, run: RunRecords):
    """The run's manifest and notes about it: a manifest that cannot be used (truncated, damaged, of an
    unexpected shape) must not stop the analysis of intact traces, so traces/ is scanned instead."""
    if not run.manifest_present:
        return build_manifest(layout), ["no manifest.json: traces were verified in memory "
                                        "(run `fleetscope gather` to write one)"]
    if run.manifest is not None:
        return run.manifest, []
    return build_manifest(layout), [f"{run.manifest_problem}; traces/ was scanned instead (run `fleetscope gather` "
                                    "to write a new manifest)"]


def _latest_attempts(records: list[TraceRecord]) -> tuple[list[TraceRecord], list[TraceRecord]]:
    """Per (window, rank), the trace of the latest attempt, and the ones it replaces."""
    latest: dict[tuple[int | None, int], TraceRecord] = {}
    for record in records:
        key = (record.window, record.rank)
        if key not in latest or record.attempt > latest[key].attempt:
            latest[key] = record
    kept = set(id(r) for r in latest.values())
    return list(latest.values()), [r for r in records if id(r) not in kept]


def _trace_dir_input(root: Path) -> AnalysisInput:
    entries = find_trace_like_entries(root)
    own = [e for e in entries if is_own_output(e)]
    odd = [(e, entry_problem(e, within=root)) for e in entries if e not in own]
    files = [e for e, problem in odd if problem is None]
    if not files and len(odd) == len(files):
        raise ValueError(f"{root}: no trace files (*.json, *.json.gz) found")
    sources = [
        TraceSource(path=f, label=f.relative_to(root).as_posix(), window=_window_of(f, root), within=root)
        for f in files
    ]
    failures = [TraceFailure(label=e.relative_to(root).as_posix(), window=_window_of(e, root), rank=None,
                             reason=problem) for e, problem in odd if problem is not None]
    notes = [f"{len(own)} fleetscope output(s) among the traces were not read as traces: "
             + ", ".join(e.relative_to(root).as_posix() for e in own[:5])] if own else []
    return AnalysisInput(root=root, kind=SOURCE_TRACE_DIR, sources=sources, failures=failures, notes=notes)


_RANK_IN_NAME_RE = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def rank_from_name(file_name: str) -> int | None:
    """The rank a trace's file name states (`rank3`, `rank_3`, `worker0_rank3.pt.trace.json`), if any: the
    rule every reader applies after the manifest and the trace's own `distributedInfo`."""
    match = _RANK_IN_NAME_RE.search(file_name)
    return int(match.group(1)) if match else None


def _window_of(path: Path, root: Path) -> int | None:
    for part in path.relative_to(root).parts[:-1]:
        match = WINDOW_RE.match(part)
        if match:
            return int(match["index"])
    return None
