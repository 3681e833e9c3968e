"""What a run directory states, read once: `read_run_records(layout)` -> RunRecords.

Every file a stage of the analysis needs besides the traces themselves (the manifest, job.json, the clock
files, each rank's step metrics, compile and MoE records, the capture records, the Flight Recorder dumps
and what the hang report shows beside them) is read here, through the safe reader (traces/safe_read.py) and
each format's one reader; the stages in per_rank/ and cross_rank/ are functions of the result. A file that
cannot be used is kept as data (its path and the reason), never raised. The whole-run timelines are large:
they are listed and opened by inputs/timelines.py, whose handles the whole-run scan reads block by block.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetscope.analysis.inputs.timelines import TimelineFiles
from fleetscope.traces.capture import CaptureRecord, read_capture_records
from fleetscope.traces.clock import ClockOffset, read_clock_offsets
from fleetscope.traces.flight_recorder import Dumps, read_dumps
from fleetscope.traces.formats import MetricRecords, MoeRecords, read_metric_records, read_moe_file
from fleetscope.traces.jobfile import read_job_record
from fleetscope.traces.layout import STEP_METRICS_RE, WINDOW_RE, RunLayout
from fleetscope.traces.manifest import Manifest, load_manifest
from fleetscope.traces.safe_read import entry_problem, read_metadata

LOG_READ_BYTES = 64 * 1024
"""The tail of each log file kept for the hang report."""
MAX_LOG_FILES = 4096


@dataclass(frozen=True, kw_only=True)
class StepMetricsFile:
    """One rank's `metrics/rank<R>.jsonl`: its StepRecords (traces/formats.py), or why it could not be read."""

    rank: int
    path: Path
    read: MetricRecords | None
    error: str = ""
    """The reader's message (None read): the path and the reason."""
    reason: str = ""
    """The reason alone (the safe reader's, else the message)."""
    is_file: bool = True
    """The entry is a regular file (or a link to one) when listed."""


@dataclass(frozen=True, kw_only=True)
class CompileFile:
    """One rank's `metrics/rank<R>.compile.json`: its JSON document, or why it could not be read."""

    rank: int
    path: Path
    document: Any = None
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class MoeFile:
    """One rank's `metrics/rank<R>.moe.jsonl`: its records, or why the entry was not opened."""

    rank: int
    path: Path
    read: MoeRecords | None
    problem: str = ""


@dataclass(frozen=True, kw_only=True)
class WindowFolder:
    index: int
    name: str
    files: int
    """Entries in it (hidden ones left out)."""


@dataclass(frozen=True, kw_only=True)
class HangContext:
    """What the hang report shows beside the dumps: the window folders, the last one's size, the logs' tails.
    Read only when the run holds a Flight Recorder dump."""

    windows: tuple[WindowFolder, ...] = ()
    window_problems: tuple[str, ...] = ()
    log_tails: tuple[str, ...] = ()
    """The last LOG_READ_BYTES of each log under logs/, in path order."""


@dataclass(frozen=True, kw_only=True)
class RunRecords:
    """Everything a run directory states besides its traces, as read once."""

    layout: RunLayout
    manifest: Manifest | None = None
    manifest_present: bool = False
    """manifest.json exists (as a file or a link)."""
    manifest_problem: str = ""
    """Why a present manifest could not be used (manifest None)."""
    job: dict[str, Any] = field(default_factory=dict)
    job_problem: str = ""
    clock: dict[int, ClockOffset] = field(default_factory=dict)
    clock_problems: tuple[str, ...] = ()
    record_ranks: frozenset[int] = frozenset()
    """Ranks with any record file under metrics/ (RunLayout.ranks_with_records)."""
    step_metrics: tuple[StepMetricsFile, ...] = ()
    """By rank."""
    compiles: dict[int, CompileFile] = field(default_factory=dict)
    moe: dict[int, MoeFile] = field(default_factory=dict)
    captures: tuple[CaptureRecord, ...] = ()
    """The run's own captures/ records (the manifest's, validated by its reader, come first where it has any)."""
    capture_problems: tuple[str, ...] = ()
    dumps: Dumps = field(default_factory=lambda: Dumps(by_rank={}, markers=[], problems=[]))
    hang: HangContext = field(default_factory=HangContext)
    timelines: TimelineFiles | None = None

    @property
    def root(self) -> Path:
        return self.layout.root

    def metrics_of(self, rank: int) -> StepMetricsFile | None:
        return next((m for m in self.step_metrics if m.rank == rank), None)

    def job_value(self, key: str, default: Any = None) -> Any:
        return self.job.get(key, default)


def read_run_records(layout: RunLayout) -> RunRecords:
    """Read every record file of the run in `layout` once; problems are kept, never raised."""
    manifest, present, manifest_problem = read_manifest_once(layout)
    job, job_problem = read_job(layout)
    clock, clock_problems = read_clock_offsets(layout)
    dumps = read_dumps(layout)
    captures, capture_problems = read_capture_records(layout)
    ranks = frozenset(layout.ranks_with_records())
    return RunRecords(
        layout=layout, manifest=manifest, manifest_present=present, manifest_problem=manifest_problem,
        job=job, job_problem=job_problem, clock=clock, clock_problems=tuple(clock_problems), record_ranks=ranks,
        step_metrics=read_step_metrics(layout), compiles=read_compile_files(layout, ranks),
        moe=read_moe_files(layout, ranks), captures=tuple(captures), capture_problems=tuple(capture_problems),
        dumps=dumps, hang=read_hang_context(layout) if dumps.by_rank else HangContext(),
        timelines=TimelineFiles.of(layout))


def read_manifest_once(layout: RunLayout) -> tuple[Manifest | None, bool, str]:
    """(the manifest, whether manifest.json exists, why it cannot be used)."""
    if not layout.manifest_file.exists() and not layout.manifest_file.is_symlink():
        return None, False, ""
    try:
        return load_manifest(layout), True, ""
    except ValueError as error:
        return None, True, str(error)


def read_job(layout: RunLayout) -> tuple[dict[str, Any], str]:
    """job.json ({} when absent) and why it cannot be read."""
    try:
        return read_job_record(layout), ""
    except ValueError as error:
        return {}, str(error)


def read_step_metrics_only(layout: RunLayout) -> RunRecords:
    """The run's records with its step metrics alone read: for a caller that needs nothing else (the gate over
    many runs, compare of a report's run directory)."""
    return RunRecords(layout=layout, step_metrics=read_step_metrics(layout))


def read_step_metrics(layout: RunLayout) -> tuple[StepMetricsFile, ...]:
    found = []
    for path in layout.step_metrics_files():
        rank = int(STEP_METRICS_RE.match(path.name)["rank"])
        is_file = path.is_file()
        try:
            found.append(StepMetricsFile(rank=rank, path=path, read=read_metric_records(path, within=layout.root),
                                         is_file=is_file))
        except (ValueError, OSError) as error:
            found.append(StepMetricsFile(rank=rank, path=path, read=None, error=str(error),
                                         reason=str(getattr(error, "reason", error)), is_file=is_file))
    return tuple(found)


def read_compile_files(layout: RunLayout, ranks: frozenset[int]) -> dict[int, CompileFile]:
    found = {}
    for rank in sorted(ranks):
        path = layout.compile_file(rank)
        if not path.is_file():
            continue
        try:
            found[rank] = CompileFile(rank=rank, path=path, document=json.loads(read_metadata(path, within=layout.root)))
        except (OSError, ValueError, RecursionError) as error:
            found[rank] = CompileFile(rank=rank, path=path, error=str(error))
    return found


def read_moe_files(layout: RunLayout, ranks: frozenset[int] | set[int]) -> dict[int, MoeFile]:
    found = {}
    for rank in sorted(ranks):
        path = layout.moe_file(rank)
        if not os.path.lexists(path):
            continue
        problem = entry_problem(path, within=layout.root)
        found[rank] = MoeFile(rank=rank, path=path, read=None if problem else read_moe_file(path), problem=problem or "")
    return found


def read_hang_context(layout: RunLayout) -> HangContext:
    windows, problems = _window_folders(layout)
    return HangContext(windows=tuple(windows), window_problems=tuple(problems), log_tails=tuple(_log_tails(layout)))


def _window_folders(layout: RunLayout) -> tuple[list[WindowFolder], list[str]]:
    """The run's window folders (real directories inside the run), and why any window* entry is not one."""
    windows, problems = [], []
    if layout.traces_dir.is_symlink() or not layout.traces_dir.is_dir():
        return windows, problems
    for entry in sorted(layout.traces_dir.glob("window*")):
        if not (match := WINDOW_RE.match(entry.name)):
            continue
        if entry.is_symlink() or not entry.is_dir():
            problems.append(f"{layout.relative(entry)}: {'a symlink' if entry.is_symlink() else 'not a directory'}, "
                            "not a window folder: not read")
            continue
        try:
            files = sum(1 for p in entry.iterdir() if not p.name.startswith("."))
        except OSError:
            files = 0
        windows.append(WindowFolder(index=int(match["index"]), name=entry.name, files=files))
    return sorted(windows, key=lambda w: (w.index, w.name)), problems


def _log_tails(layout: RunLayout) -> list[str]:
    logs = layout.logs_dir
    paths = sorted(logs.rglob("*.log"))[:MAX_LOG_FILES] if logs.is_dir() and not logs.is_symlink() else []
    return [_tail(path, layout) for path in paths]


def _tail(path: Path, layout: RunLayout) -> str:
    """The last LOG_READ_BYTES of a log: a regular file inside the run (lstat first, never a FIFO or a link
    out of the run, opened with O_NOFOLLOW | O_NONBLOCK); "" for anything else."""
    if entry_problem(path, within=layout.root) is not None or path.is_symlink():
        return ""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            return ""
        try:
            handle.seek(max(0, info.st_size - LOG_READ_BYTES))
            return handle.read(LOG_READ_BYTES).decode(errors="replace")
        except OSError:
            return ""
