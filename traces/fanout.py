"""The records of a parse fanned out over a Slurm array job (the one owner of their format).

Each array task writes `task<I>.json` when it has parsed its share of the traces into the parsed-trace
cache; the reduce step writes `reduce.json` when it has built the report and the merged trace from the cache.
Both live in <run>/logs/slurm/fanout-<array job>/ (layout.fanout_dir). A task that died (time limit, node
failure, out of memory) leaves no record: readers treat a missing or unreadable record as "did not complete".
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .layout import RunLayout, fanout_reduce_record, fanout_task_record
from .safe_read import read_metadata
from .writer import write_bytes_atomically


@dataclass(frozen=True, kw_only=True)
class TraceProblem:
    label: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ParseCounts:
    """What one parse pass did with its traces."""

    traces: int = 0
    hits: int = 0
    """Found in the parsed-trace cache (nothing parsed)."""
    parsed: int = 0
    """Parsed (a cache miss), the result stored in the cache."""
    failed: list[TraceProblem] = field(default_factory=list)
    """Traces that could not be read or analyzed (never cached: each reader names them again)."""


@dataclass(frozen=True, kw_only=True)
class TaskRecord:
    """One array task: where it ran, which ranks it took, what it parsed."""

    array_job_id: str
    task: int
    tasks: int
    node: str
    ranks: list[int | str]
    """Its share (shard keys: a rank, or a trace's label when the rank is unknown)."""
    counts: ParseCounts
    cache_dir: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TaskRecord":
        counts = dict(data["counts"])
        counts["failed"] = [TraceProblem(**problem) for problem in counts.get("failed", [])]
        return cls(**{**data, "counts": ParseCounts(**counts)})


@dataclass(frozen=True, kw_only=True)
class IncompleteTask:
    """An array task that left no valid record."""

    task: int
    ranks: list[int | str]
    log_path: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ReduceRecord:
    """The reduce step: the counts of its analyze pass (all hits when every task completed) and outputs."""

    array_job_id: str
    tasks: int
    incomplete: list[IncompleteTask]
    counts: ParseCounts
    outputs: dict[str, str]
    errors: list[str]
    seconds: dict[str, float]
    complete: bool
    """The post-processing's own verdict: manifest and report complete, no stage failed."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ReduceRecord":
        counts = dict(data["counts"])
        counts["failed"] = [TraceProblem(**problem) for problem in counts.get("failed", [])]
        return cls(**{**data, "counts": ParseCounts(**counts),
                      "incomplete": [IncompleteTask(**task) for task in data.get("incomplete", [])]})


def write_task_record(layout: RunLayout, record: TaskRecord) -> Path:
    path = fanout_task_record(layout, record.array_job_id, record.task)
    _write_json(record.to_json(), path)
    return path


def write_reduce_record(layout: RunLayout, record: ReduceRecord) -> Path:
    path = fanout_reduce_record(layout, record.array_job_id)
    _write_json(record.to_json(), path)
    return path


def read_task_record(layout: RunLayout, array_job_id: str, task: int) -> tuple[TaskRecord | None, str]:
    """The task's record, or (None, why there is none)."""
    path = fanout_task_record(layout, array_job_id, task)
    if not os.path.lexists(path):
        return None, f"no record {path} (the task did not finish)"
    try:
        record = TaskRecord.from_json(_read_json(path, layout))
    except (OSError, ValueError, TypeError, KeyError) as error:
        return None, f"{path}: unreadable record: {type(error).__name__}: {str(error)[:200]}"
    if (record.array_job_id, record.task) != (array_job_id, task):
        return None, f"{path}: record of another task ({record.array_job_id}_{record.task})"
    return record, ""


def read_reduce_record(layout: RunLayout, array_job_id: str) -> ReduceRecord | None:
    path = fanout_reduce_record(layout, array_job_id)
    try:
        return ReduceRecord.from_json(_read_json(path, layout))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically((json.dumps(data, indent=1, allow_nan=False) + "\n").encode(), path)


def _read_json(path: Path, layout: RunLayout) -> dict[str, Any]:
    data = json.loads(read_metadata(path, within=layout.root))
    if not isinstance(data, dict):
        raise ValueError(f"top level is {type(data).__name__}, expected an object")
    return data
