"""Flight Recorder dumps and hang markers in the run directory (flight_recorder/).

    flight_recorder/rank<R>.json       one rank's Flight Recorder buffer, as JSON: {rank, reason, at, step,
                                       version, pg_config, entries[]} (entries as PyTorch records them:
                                       profiling_name, process_group [name, desc], collective_seq_id, input_sizes,
                                       input_dtypes, state, frames[] {name, filename, line}, ...)
    flight_recorder/hang.rank<R>.json  rank R saw no step progress for `seconds`: {rank, step, seconds, at}
    flight_recorder/dump-requested     any rank creates it; every rank's watchdog then dumps its buffer

The trainer writes JSON (not PyTorch's pickle) so that reading a run directory never unpickles anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .atomic import write_bytes_atomically
from .safe_read import read_input, read_metadata
from .layout import RunLayout
from .validate import MAX_WORLD_SIZE, finite
from .jsontext import strict_dumps

MAX_DUMP_BYTES = 256 * 2**20
DUMP_REASONS = ("hang", "dump_requested", "error", "stop_signal")


@dataclass(frozen=True, kw_only=True)
class HangMarker:
    rank: int
    step: int
    """Steps this rank had completed."""
    seconds: float
    """Seconds without progress when it gave up."""
    at: str


def write_dump(layout: RunLayout, rank: int, document: dict[str, Any]) -> Path:
    path = layout.flight_recorder_file(rank)
    write_bytes_atomically((strict_dumps(document, default=str) + "\n").encode(), path)
    return path


def write_hang_marker(layout: RunLayout, marker: HangMarker) -> None:
    write_bytes_atomically((strict_dumps(asdict(marker)) + "\n").encode(), layout.hang_marker(marker.rank))


@dataclass(frozen=True, kw_only=True)
class Dumps:
    """What a run directory holds: dumps by rank, hang markers, and why any file was not used."""

    by_rank: dict[int, dict[str, Any]]
    markers: list[HangMarker]
    problems: list[str]


def read_dumps(layout: RunLayout) -> Dumps:
    by_rank, markers, problems = {}, [], []
    directory = layout.flight_recorder_dir
    for path in sorted(directory.glob("rank*.json")):
        try:
            document = json.loads(read_input(path, within=layout.root, max_bytes=MAX_DUMP_BYTES))
            rank = _dump_problem(document, path)
        except (OSError, ValueError, RecursionError) as error:
            problems.append(f"{path.name}: unusable Flight Recorder dump ({error})")
            continue
        by_rank[rank] = document
    for path in sorted(directory.glob("hang.rank*.json")):
        try:
            markers.append(_marker(json.loads(read_metadata(path, within=layout.root)), path))
        except (OSError, ValueError, KeyError, TypeError, RecursionError, OverflowError) as error:
            problems.append(f"{path.name}: unusable hang marker ({error})")
    return Dumps(by_rank=by_rank, markers=markers, problems=problems)


def _marker(data: Any, path: Path) -> HangMarker:
    """A hang marker as the trainer writes it; raises ValueError saying what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    rank, step, seconds = data.get("rank"), data.get("step"), data.get("seconds")
    if type(rank) is not int or path.name != f"hang.rank{rank}.json" or not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"rank {rank!r} does not match the file name")
    if type(step) is not int or step < 0:
        raise ValueError(f"step {step!r} is not a step")
    if type(seconds) not in (int, float) or finite(seconds) is None or seconds < 0:
        raise ValueError(f"seconds {seconds!r} is not a finite number of seconds")
    return HangMarker(rank=rank, step=step, seconds=float(seconds), at=str(data.get("at", ""))[:64])


def _dump_problem(document: Any, path: Path) -> int:
    """The dump's rank; raises ValueError saying what is wrong with it."""
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    rank = document.get("rank")
    if type(rank) is not int or path.name != f"rank{rank}.json" or not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"rank {rank!r} does not match the file name")
    entries = document.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("entries is not a list of objects")
    for entry in entries:
        if type(entry.get("collective_seq_id")) is not int or not isinstance(entry.get("profiling_name"), str):
            raise ValueError("an entry without an integer collective_seq_id and a profiling_name")
    for name in ("pg_config", "pg_status"):
        if not isinstance(document.get(name, {}), dict):
            raise ValueError(f"{name} is not an object")
    return rank
