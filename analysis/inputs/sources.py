"""What the inputs stage hands on: the trace files to read, what was known about each before reading
it, the files already known to be unusable, the ranks that have no trace, and measured clock offsets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SOURCE_RUN_DIR = "run_dir"
SOURCE_TRACE_DIR = "trace_dir"
SOURCE_TRACE_FILE = "trace_file"
"""What was analyzed: a fleetscope run directory, a directory of traces, or one trace file."""


@dataclass(frozen=True, kw_only=True)
class TraceSource:
    """A trace file to analyze and what is known about it before opening it."""

    path: Path
    label: str
    """How reports name the file (relative to the analyzed directory)."""
    window: int | None
    rank: int | None = None
    """Rank known from the manifest; None to take it from the trace or its file name."""
    host: str | None = None
    within: Path | None = None
    """The directory the file must resolve inside (no symlink or `..` escape); None for a lone file."""
    expected_bytes: int | None = None
    expected_sha256: str | None = None
    """Size and digest the manifest recorded at gather: a file that differs is not analyzed."""


@dataclass(frozen=True, kw_only=True)
class TraceFailure:
    """A trace that could not be analyzed, and why."""

    label: str
    window: int | None
    rank: int | None
    reason: str
    not_a_trace: bool = False
    """The file is valid JSON but no trace document (traces/kineto.py NotATrace)."""


@dataclass(frozen=True, kw_only=True)
class MissingTrace:
    rank: int
    window: int | None


@dataclass(frozen=True, kw_only=True)
class MeasuredOffset:
    offset_us: float
    uncertainty_us: float
