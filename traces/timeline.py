"""The whole-run timeline: one fixed-size binary record per step per rank, `metrics/rank<R>.timeline`.

Profiler windows cover a few steps in hundreds; this file covers every step of every rank, for fleetscope's
trainer and for users' programs (`fs.step()`), so that slow ranks, drift and change points can be found
without traces. The trainer's JSON lines (`metrics/rank<R>.jsonl`) stay for what they hold beyond timing.

Why a binary record and not JSON lines: 1,024 ranks x 100,000 steps are 10^8 records. As JSON (~400 bytes a
line, a parse per line) that is ~40 GB and minutes of decoding; as these 32-byte records it is 3.3 GB read by
`np.fromfile`/`np.memmap` at disk speed, any step range of any rank at a computed offset (no index), and an
append costs one small buffered write (no host-device sync: the writer takes plain floats).
A process that appends after a crash completes the cut record first (see _open_for_append).

Layout (little-endian): a 32-byte header, then records of TIMELINE_DTYPE.
  header: magic b"FSTLINE1" (8) | record size u4 | rank u4 | reserved (16 zero bytes)
  record: step i4 | flags u4 | start_us f8 | step_ms f4 | data_ms f4 | first_collective_ms f4 | exposed_comm_ms f4
`start_us` is the rank's own wall clock (`time.time_ns() / 1000`) when the step began; the job's aligned
clock is that plus the rank's measured offset (traces/clock.py), applied by the reader of several ranks.
float64 holds epoch microseconds to 0.25 us. Unknown values are NaN. A resumed run appends to the same file;
a file cut short by a crash ends in a partial record, which readers drop and name.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from .safe_read import entry_problem

MAGIC = b"FSTLINE1"
HEADER = struct.Struct("<8sII16x")
TIMELINE_DTYPE = np.dtype([
    ("step", "<i4"),
    ("flags", "<u4"),
    ("start_us", "<f8"),
    ("step_ms", "<f4"),
    ("data_ms", "<f4"),
    ("first_collective_ms", "<f4"),
    ("exposed_comm_ms", "<f4"),
])
"""One step of one rank. step_ms: the step's wall time as the trainer or program measured it; data_ms: of it,
waiting for input; first_collective_ms: from the step's start to the moment the rank issued its first
gradient collective (NaN: unknown or none); exposed_comm_ms: communication the step waited for (NaN: not
measured in this mode)."""
FLAG_PROFILED = 1
"""The step ran inside a profiler window (its time includes profiler overhead)."""
FLAG_FIRST = 2
"""The rank's first step of this process (warm-up, compilation): not a steady step."""
FLUSH_EVERY = 64
"""Records buffered before a write: a crash loses at most this many steps of timing."""
MAX_TIMELINE_STEP = 2**31 - 1
"""The largest step a record holds (its `step` is an int32)."""
MAX_TIMELINE_RECORDS = 1 << 25
"""Records read from one file (1 GiB, a step a record for 33 million steps): a larger file, such as a sparse one of
a huge size that is mostly holes, is read up to here and the rest named as left out, in bounded time and memory."""
VALIDATE_CHUNK = 1 << 20
"""Records checked at a time, so the temporaries of the checks stay a few tens of MB whatever the file holds."""
MAX_STEP_MS = 1e9
"""A step time beyond ~11.6 days is not believed (a forged or damaged record)."""
MAX_START_US = float(1 << 62) / 1e3
"""A start past 2116 is not believed: a start in [0, MAX_START_US] is an int64 in ns with room to add a step."""

RECORD = struct.Struct("<iIdffff")
"""TIMELINE_DTYPE as a struct, for the writer."""

assert TIMELINE_DTYPE.itemsize == RECORD.size == 32 and HEADER.size == 32


class TimelineWriter:
    """Appends this rank's step records to `path` (creating it with its header), buffered FLUSH_EVERY steps."""

    def __init__(self, path: Path, rank: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._buffer = bytearray(FLUSH_EVERY * RECORD.size)
        self._count = 0
        self._file: IO[bytes] = _open_for_append(path, rank)

    def append(self, *, step: int, start_us: float, step_ms: float, data_ms: float = math.nan,
               first_collective_ms: float = math.nan, exposed_comm_ms: float = math.nan,
               profiled: bool = False, first: bool = False) -> None:
        flags = (FLAG_PROFILED if profiled else 0) | (FLAG_FIRST if first else 0)
        # struct into a reused buffer: ~1 us a step, a numpy record assignment costs ~5
        RECORD.pack_into(self._buffer, self._count * RECORD.size, step, flags, start_us, step_ms, data_ms,
                         first_collective_ms, exposed_comm_ms)
        self._count += 1
        if self._count == FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._count:
            self._file.write(memoryview(self._buffer)[:self._count * RECORD.size])
            self._file.flush()
            self._count = 0

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


def _open_for_append(path: Path, rank: int) -> IO[bytes]:
    """Open for appending; a new or empty file gets its header. An existing file of another rank or format is
    not appended to (its records would be read as this rank's): it is refused with the reason. O_NONBLOCK: a
    FIFO in the file's place is refused (OSError, or not a regular file) instead of waiting for a reader."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    descriptor = os.open(path, flags, 0o644)
    handle = os.fdopen(descriptor, "ab")
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        handle.close()
        raise ValueError(f"{path}: not a regular file")
    if info.st_size == 0:
        handle.write(HEADER.pack(MAGIC, TIMELINE_DTYPE.itemsize, rank))
        handle.flush()
        return handle
    with open(path, "rb") as existing:
        problem = _header_problem(existing.read(HEADER.size), expected_rank=rank)
    if problem:
        handle.close()
        raise ValueError(f"{path}: {problem}: not appended to")
    partial = (info.st_size - HEADER.size) % TIMELINE_DTYPE.itemsize
    if partial:
        # A crash cut the last record: complete it with 0xFF bytes, which make its cut field NaN or a negative
        # step (readers leave it out), so the records appended now stay aligned.
        handle.write(b"\xff" * (TIMELINE_DTYPE.itemsize - partial))
        handle.flush()
    return handle


@dataclass
class Timeline:
    """One rank's records as read (a read-only memmap or array; steps in file order)."""

    path: Path
    rank: int
    records: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=TIMELINE_DTYPE))
    problems: list[str] = field(default_factory=list)
    """What was left out and why (a partial last record, records with impossible values)."""
    record_index: np.ndarray | None = None
    """Each record's index in the file where some were left out; None: records[i] is the file's record i."""


def read_timeline(path: Path, *, within: Path | None = None, expected_rank: int | None = None,
                  memmap: bool = True) -> Timeline:
    """The valid records of one timeline file. Raises ValueError naming the file when it cannot be read at all
    (not a regular file, outside `within`, a bad header); otherwise damaged records are left out and named."""
    problem = entry_problem(path, within=within)
    if problem:
        raise ValueError(f"{path}: {problem}")
    size = os.stat(path).st_size
    with open(path, "rb") as handle:
        header = handle.read(HEADER.size)
    problem = _header_problem(header, expected_rank=expected_rank)
    if problem:
        raise ValueError(f"{path}: {problem}")
    rank = HEADER.unpack(header)[2]
    count, partial = divmod(size - HEADER.size, TIMELINE_DTYPE.itemsize)
    timeline = Timeline(path=path, rank=rank)
    if partial:
        timeline.problems.append(f"{path.name}: a partial last record ({partial} bytes) left out")
    if count == 0:
        return timeline
    if count > MAX_TIMELINE_RECORDS:
        timeline.problems.append(f"{path.name}: {count} records, more than the {MAX_TIMELINE_RECORDS} a timeline is "
                                 f"read up to; the first {MAX_TIMELINE_RECORDS} read, the rest left out")
        count = MAX_TIMELINE_RECORDS
    if memmap:
        records = np.memmap(path, dtype=TIMELINE_DTYPE, mode="r", offset=HEADER.size, shape=(count,))
    else:
        records = np.fromfile(path, dtype=TIMELINE_DTYPE, count=count, offset=HEADER.size)
    valid = np.concatenate([valid_records(records[start:start + VALIDATE_CHUNK])
                            for start in range(0, count, VALIDATE_CHUNK)])
    if not valid.all():
        bad = int((~valid).sum())
        first = int(np.flatnonzero(~valid)[0])
        timeline.problems.append(f"{path.name}: {bad} record(s) with impossible values left out (first: record "
                                 f"{first}, step {int(records['step'][first])})")
        records = records[valid]
        timeline.record_index = np.flatnonzero(valid)
    timeline.records = records
    return timeline


def last_of_each_step(steps: np.ndarray) -> np.ndarray:
    """Indices (in file order) of each step's last record: a resumed run appends the steps it repeats, and
    the later record of a step is the one that counts (its earlier one ran before the restart)."""
    steps = np.asarray(steps)
    if steps.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.sort(steps.size - 1 - np.unique(steps[::-1], return_index=True)[1])


def valid_records(records: np.ndarray) -> np.ndarray:
    """Mask of records whose values can be true: a step >= 0, a start in [0, MAX_START_US] (epoch us), a step
    time in (0, MAX_STEP_MS], parts (data, first collective, exposed communication) NaN or within [0, step time]."""
    step_ms = records["step_ms"].astype(np.float64)
    start_us = records["start_us"]
    ok = ((records["step"] >= 0) & (start_us >= 0) & (start_us <= MAX_START_US) & (step_ms > 0)
          & (step_ms <= MAX_STEP_MS))
    for name in ("data_ms", "first_collective_ms", "exposed_comm_ms"):
        part = records[name].astype(np.float64)
        ok &= np.isnan(part) | ((part >= 0) & (part <= step_ms * 1.001 + 1e-3))
    return ok


def _header_problem(header: bytes, *, expected_rank: int | None) -> str | None:
    if len(header) < HEADER.size:
        return f"shorter than the {HEADER.size}-byte timeline header"
    magic, record_size, rank = HEADER.unpack(header)
    if magic != MAGIC:
        return "not a fleetscope timeline (bad magic)"
    if record_size != TIMELINE_DTYPE.itemsize:
        return f"record size {record_size}, this reader knows {TIMELINE_DTYPE.itemsize}"
    if expected_rank is not None and rank != expected_rank:
        return f"written by rank {rank}, its name says rank {expected_rank}"
    return None
