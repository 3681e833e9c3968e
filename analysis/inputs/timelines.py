"""The whole-run timelines (`metrics/rank<R>.timeline`, traces/timeline.py) as the whole-run scan reads them.

A run's timelines can be large (1,024 ranks x 100,000 steps): they are listed once (TimelineFiles), each
opened and validated once into a TimelineSource (its runs of consecutive steps, and the file's device and
inode), and the scan (cross_rank/whole_run.py) reads their records block by block with `records_into`, never
holding a whole file. The one reader of these files for the analysis.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetscope.traces.layout import RunLayout
from fleetscope.traces.safe_read import OPEN_FLAGS, entry_problem
from fleetscope.traces.timeline import (
    HEADER,
    MAGIC,
    MAX_TIMELINE_RECORDS,
    TIMELINE_DTYPE,
    last_of_each_step,
    read_timeline,
)


@dataclass(frozen=True, kw_only=True)
class TimelineFiles:
    """The run's timelines, listed once: the ranks that have one."""

    layout: RunLayout
    ranks: tuple[int, ...] = ()

    @classmethod
    def of(cls, layout: RunLayout) -> "TimelineFiles":
        return cls(layout=layout, ranks=tuple(layout.timeline_ranks()))

    def records_of(self, rank: int) -> np.ndarray:
        """One rank's whole timeline, read and validated (raises OSError or ValueError naming the file): for a
        reader that needs a rank's records at once (the merge's whole-run counters, bounded per rank)."""
        return read_timeline(self.layout.timeline_file(rank), within=self.layout.root, expected_rank=rank).records

    def sources(self, notes: list[str], *, check_records: bool) -> dict[int, "TimelineSource"]:
        """Each usable timeline, opened and validated (every record checked with `check_records`, else left for
        the scan to check as it reads); a file that cannot be used is named in `notes`."""
        return timeline_sources(self.layout, self.ranks, notes, check_records)


@dataclass(frozen=True, kw_only=True)
class TimelineSource:
    """One rank's records: `runs` of (first step, first record, count), later runs overriding earlier ones;
    read from `path` (a timeline) or `records` (held in memory: a JSONL fallback)."""

    rank: int
    runs: list[tuple[int, int, int]]
    path: Path | None = None
    identity: tuple[int, int] | None = None
    records: np.ndarray | None = None
    offset_us: float | None = None
    lowest_step: int = 0
    checked: bool = True
    """False: a timeline read without looking at its records (_unchecked_source); the pass checks each record
    as it reads it (_check_records)."""


def timeline_sources(layout: RunLayout, ranks: tuple[int, ...], notes: list[str],
                     check_records: bool) -> dict[int, TimelineSource]:
    found = {}
    for rank in ranks:
        source = None if check_records else _unchecked_source(layout, rank)
        source = source or _checked_source(layout, rank, notes)
        if source is not None:
            found[rank] = source
    return found


def _checked_source(layout: RunLayout, rank: int, notes: list[str]) -> TimelineSource | None:
    path = layout.timeline_file(rank)
    try:
        timeline = read_timeline(path, within=layout.root, expected_rank=rank)
    except (ValueError, OSError) as error:
        notes.append(f"{layout.relative(path)}: not used ({str(error).replace(str(path) + ': ', '')[:200]})")
        return None
    notes += [f"metrics/{problem}" for problem in timeline.problems]
    records = timeline.records
    if records.size == 0:
        notes.append(f"{layout.relative(path)}: no valid record")
        return None
    info = os.stat(path)
    steps = np.asarray(records["step"], dtype=np.int64)
    if isinstance(records, np.memmap) and steps[-1] - steps[0] == steps.size - 1 and np.all(np.diff(steps) == 1):
        runs = [(int(steps[0]), 0, int(steps.size))]
    else:
        indices = timeline.record_index if timeline.record_index is not None else np.arange(steps.size)
        runs = runs_of(steps, indices)
    return TimelineSource(rank=rank, runs=runs, path=path, identity=(info.st_dev, info.st_ino),
                   lowest_step=int(steps.min()))


def _unchecked_source(layout: RunLayout, rank: int) -> TimelineSource | None:
    """The rank's timeline with its records left for the pass to check (read_timeline's check of every record
    costs a fifth of the analysis at 1,024 ranks), when it is a regular file (no symlink) of whole records
    under this rank's header whose first record's step is >= 0 and whose last one's is count - 1 later: one
    run of consecutive steps if every record is valid. None: read it checked (_timeline_source), which names
    what is wrong."""
    path = layout.timeline_file(rank)
    if entry_problem(path, within=layout.root) is not None:
        return None
    try:
        descriptor = os.open(path, OPEN_FLAGS)
    except OSError:
        return None
    try:
        info = os.fstat(descriptor)
        count, partial = divmod(info.st_size - HEADER.size, TIMELINE_DTYPE.itemsize)
        if not stat.S_ISREG(info.st_mode) or partial or not 1 <= count <= MAX_TIMELINE_RECORDS:
            return None
        header = os.pread(descriptor, HEADER.size, 0)
        ends = (os.pread(descriptor, TIMELINE_DTYPE.itemsize, HEADER.size)
                + os.pread(descriptor, TIMELINE_DTYPE.itemsize, HEADER.size + (count - 1) * TIMELINE_DTYPE.itemsize))
    finally:
        os.close(descriptor)
    if header != HEADER.pack(MAGIC, TIMELINE_DTYPE.itemsize, rank) or len(ends) != 2 * TIMELINE_DTYPE.itemsize:
        return None
    first, last = (int(step) for step in np.frombuffer(ends, dtype=TIMELINE_DTYPE)["step"])
    if first < 0 or last - first != count - 1:
        return None
    return TimelineSource(rank=rank, runs=[(first, 0, count)], path=path, identity=(info.st_dev, info.st_ino),
                   lowest_step=first, checked=False)


def runs_of(steps: np.ndarray, indices: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of consecutive steps at consecutive records; a repeated step (a resumed run) keeps its last record."""
    last = last_of_each_step(steps)
    steps, indices = steps[last], indices[last]
    breaks = np.flatnonzero((np.diff(steps) != 1) | (np.diff(indices) != 1)) + 1
    bounds = np.concatenate([[0], breaks, [steps.size]])
    return [(int(steps[a]), int(indices[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]




def records_into(source: TimelineSource, start: int, out: np.ndarray) -> None:
    """Records start.. of the rank into `out`. A timeline's runs hold only records read_timeline found valid;
    the file is the one it read (same device and inode), and only records it counted are read."""
    if source.records is not None:
        out[:] = source.records[start:start + out.size]
        return
    descriptor = os.open(source.path, OPEN_FLAGS)
    try:
        info = os.fstat(descriptor)
        if (info.st_dev, info.st_ino) != source.identity:
            raise ValueError(f"{source.path}: replaced while being read")
        read = os.preadv(descriptor, [out.view(np.uint8)], HEADER.size + start * TIMELINE_DTYPE.itemsize)
    finally:
        os.close(descriptor)
    if read < out.nbytes:
        out["step"][read // TIMELINE_DTYPE.itemsize:] = -1  # cut short since: those steps are missing
