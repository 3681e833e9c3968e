"""The one place that judges values read from files fleetscope did not write itself: traces, manifests,
job.json, clock files, cache entries. Every reader asks here, so a bound is set once and said once.

Declared sizes are what a hostile or corrupt file controls most cheaply (`"world_size": 1e9` is eleven
bytes), so what a declared size may allocate is bounded here: a world size beyond MAX_WORLD_SIZE is not
believed, and lists derived from one (missing ranks) keep at most MAX_LISTED_RANKS entries plus a count.
"""

from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath
from typing import Any

MAX_WORLD_SIZE = 1 << 20
"""Larger than any job that exists; beyond it a declared world size is a damaged or hostile value."""
MAX_LISTED_RANKS = 64
"""Missing ranks listed by number per window; the rest are counted."""
MAX_CLOCK_OFFSET_US = 3600e6
"""One hour: hosts of one job disagree by milliseconds; a larger measured offset is not a clock offset."""
MAX_TIME_US = (2**63 - 1) / 1000.0
"""Times beyond this many microseconds cannot be nanoseconds of any real clock."""


class UsageError(ValueError):
    """A bad argument or a refused request: the command starts nothing (exit code 2)."""


def is_int(value: Any) -> bool:
    """A JSON integer (bools are not)."""
    return type(value) is int


def finite(value: Any) -> float | None:
    """A real, finite number as float; None for anything else (bools, NaN, inf, strings, None, an int beyond
    float range). THE finiteness check of every value read from records, reports, settings and traces' args
    (numpy scalars count); vectorised numpy code masks arrays with np.isfinite instead."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_numpy_number(value):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):   # an int too large for a float
        return None
    return number if math.isfinite(number) else None


def _is_numpy_number(value: Any) -> bool:
    kind = type(value)
    return kind.__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iuf"


def is_bounded_number(value: Any) -> bool:
    """An int or float (not bool) inside the int64-nanosecond clock range: NaN and inf are outside it, so this
    needs no finiteness check of its own (it runs once per trace event)."""
    kind = type(value)
    return (kind is int or kind is float) and -MAX_TIME_US < value < MAX_TIME_US


finite_number = finite
is_finite_number = is_bounded_number
"""Old names, kept for the analysis/merge/ readers until they import `finite` / `is_bounded_number`."""


def world_size_problem(value: Any) -> str | None:
    """Why a declared world size cannot be used, or None when it can (absent is fine: None)."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        return f"world size {value!r} is not a positive integer"
    if value > MAX_WORLD_SIZE:
        return f"world size {value} is beyond {MAX_WORLD_SIZE} (the sanity bound): not believed"
    return None


def checked_world_size(value: Any) -> int | None:
    return value if value is not None and world_size_problem(value) is None else None


def rank_problem(value: Any, world_size: int | None = None) -> str | None:
    if not is_int(value) or value < 0:
        return f"rank {value!r} is not a non-negative integer"
    if value >= MAX_WORLD_SIZE:
        return f"rank {value} is beyond {MAX_WORLD_SIZE} (the sanity bound)"
    if world_size is not None and value >= world_size:
        return f"rank {value} is not below the world size {world_size}"
    return None


def membership_problem(rank: Any, declared_world_size: Any, world_size: int | None) -> str | None:
    """Why a trace is not one of this job's ranks: it declares another world size than the job's (another
    job's trace?), or its rank is not below the world size; None when it belongs. One rule for run
    directories (gather) and foreign trace directories (placement)."""
    if world_size and declared_world_size and declared_world_size != world_size:
        return (f"distributedInfo says world size {declared_world_size}, the run's is {world_size} "
                "(another job's trace?)")
    return rank_problem(rank, world_size) if rank is not None else None


def clock_offset_problem(offset_us: Any, uncertainty_us: Any) -> str | None:
    if not is_bounded_number(offset_us) or not is_bounded_number(uncertainty_us) or uncertainty_us < 0:
        return "offset or uncertainty is not a finite number"
    if abs(offset_us) > MAX_CLOCK_OFFSET_US or uncertainty_us > MAX_CLOCK_OFFSET_US:
        return (f"offset {offset_us:.0f} us is beyond {MAX_CLOCK_OFFSET_US / 3600e6:g} hour: "
                "not a clock offset, not used")
    return None


def relative_path_problem(text: Any) -> str | None:
    """Why a path named by a run directory's own metadata may not be read: it must stay inside."""
    if not isinstance(text, str) or not text or "\0" in text:
        return "path is not a non-empty string"
    path = PurePosixPath(text)
    if path.is_absolute() or text.startswith("\\") or (len(text) > 1 and text[1] == ":"):
        return f"absolute path {text!r}: manifest paths are relative to the run directory"
    if ".." in path.parts:
        return f"path {text!r} leaves the run directory"
    return None


def is_inside(path: Path, root: Path) -> bool:
    """Whether `path`, with every symlink resolved, lies inside `root` (resolved too)."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def missing_note(listed: int, total: int | None) -> str | None:
    """What a report says when only the first `listed` of `total` missing rank traces are listed."""
    if not total or total <= listed:
        return None
    return f"{total} rank trace(s) missing in all; the first {listed} are listed"




def missing_below(world_size: int, present: set[int]) -> tuple[list[int], int]:
    """(the first MAX_LISTED_RANKS ranks below `world_size` not in `present`, how many are missing in all):
    memory stays bounded whatever world size a file declares."""
    listed = []
    for rank in range(world_size):
        if len(listed) >= MAX_LISTED_RANKS:
            break
        if rank not in present:
            listed.append(rank)
    total = world_size - len({r for r in present if is_int(r) and 0 <= r < world_size})
    return listed, total


MAX_NAME_CHARS = 4096
"""Every name a trace gives (events, ops, threads) is kept to this many characters, the rest counted: the one
bound on names for every output (a kernel name of deep C++ templates runs to a few thousand characters; a 20 MB
frame name in a 96 KB trace made advise print 40 MB). Names cut alike keep their own ids: nothing is merged."""


def bounded_name(name: str) -> str:
    """`name` within MAX_NAME_CHARS, and writable: a lone surrogate (JSON allows `\\ud800`, UTF-8 does not) is
    kept as its escape, so no cache entry, report or merged trace fails on the name."""
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            name = name.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
    if len(name) <= MAX_NAME_CHARS:
        return name
    return f"{name[:MAX_NAME_CHARS]}... ({len(name) - MAX_NAME_CHARS:,} more characters)"
