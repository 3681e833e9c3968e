"""The records of a parse fanned out over a Slurm array job (the one owner of their format).

Each array task writes `task<I>.json` when it has parsed its share of the traces into the parsed-trace
cache; the reduce step writes `reduce.json` when it has built the report and the merged trace from the cache.
Both live in <run>/logs/slurm/fanout-<array job>/ (layout.fanout_dir). A task that died (time limit, node
failure, out of memory) leaves no record: readers treat a missing or unreadable record as "did not complete".
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .layout import FANOUT_FORMAT, RunLayout, fanout_reduce_record, fanout_task_record, slurm_logs_dir
from .safe_read import read_metadata
from .validate import MAX_WORLD_SIZE, is_bounded_number, is_inside, is_int
from .writer import write_bytes_atomically


ARRAY_JOB_ID = "[1-9][0-9]{0,19}"
"""A Slurm job id as the records, their folders and the scripts spell it (the one pattern writer and reader
share: an id the writer takes is one the reader finds)."""
MAX_TRACE_COUNT = 1 << 31
"""More traces than any parse pass counts: a record saying otherwise is forged."""


def is_array_job_id(text: object) -> bool:
    return isinstance(text, str) and re.fullmatch(ARRAY_JOB_ID, text) is not None


@dataclass(frozen=True, kw_only=True)
class ShardTraceProblem:
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
    failed: list[ShardTraceProblem] = field(default_factory=list)
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
        """The record `to_json` wrote; a ValueError names the first field that is not what it wrote."""
        _require_fields(cls, data)
        for name in ("node", "cache_dir"):
            _require(isinstance(data[name], str), name, "not text")
        _require(is_array_job_id(data["array_job_id"]), "array_job_id", "not a Slurm job id")
        for name in ("task", "tasks"):
            _require(is_int(data[name]) and 0 <= data[name] <= MAX_WORLD_SIZE, name,
                     f"not an integer from 0 to {MAX_WORLD_SIZE}")
        _require(is_bounded_number(data["seconds"]), "seconds", "not a finite number")
        return cls(**{**data, "ranks": _shard_keys(data["ranks"], "ranks"), "counts": _counts(data["counts"])})


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
        _require_fields(cls, data)
        _require(is_array_job_id(data["array_job_id"]), "array_job_id", "not a Slurm job id")
        _require(is_int(data["tasks"]) and 0 <= data["tasks"] <= MAX_WORLD_SIZE, "tasks",
                 f"not an integer from 0 to {MAX_WORLD_SIZE}")
        _require(isinstance(data["complete"], bool), "complete", "not true or false")
        for name, kind in (("outputs", str), ("seconds", float)):
            values = data[name]
            _require(isinstance(values, dict) and all(
                isinstance(v, str) if kind is str else is_bounded_number(v) for v in values.values()), name,
                f"not an object of {'paths' if kind is str else 'seconds'}")
        _require(isinstance(data["errors"], list) and all(isinstance(e, str) for e in data["errors"]), "errors",
                 "not a list of text")
        return cls(**{**data, "counts": _counts(data["counts"]),
                      "incomplete": [_incomplete(task) for task in _list(data["incomplete"], "incomplete")]})


# --- what a record read back must hold (another user or a broken job may have written it) -----------


def _require(condition: bool, field_name: str, why: str) -> None:
    if not condition:
        raise ValueError(f"field {field_name}: {why}")


def _require_fields(cls: type, data: Any) -> None:
    _require(isinstance(data, dict), "(top level)", "not an object")
    names = {f.name for f in dataclasses.fields(cls)}
    missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
    _require(not missing, missing[0] if missing else "", "missing")
    _require(not unknown, unknown[0] if unknown else "", "not a field of this record")


def _list(value: Any, field_name: str) -> list:
    _require(isinstance(value, list) and len(value) <= MAX_WORLD_SIZE, field_name,
             f"not a list of at most {MAX_WORLD_SIZE} entries")
    return value


def _shard_keys(value: Any, field_name: str) -> list[int | str]:
    keys = _list(value, field_name)
    _require(all((is_int(k) and 0 <= k < MAX_WORLD_SIZE) or isinstance(k, str) for k in keys), field_name,
             "holds something that is neither a rank nor a trace label")
    return keys


def _problem(value: Any, field_name: str) -> ShardTraceProblem:
    _require(isinstance(value, dict) and set(value) == {"label", "reason"}
             and all(isinstance(v, str) for v in value.values()), field_name, "not a {label, reason} object")
    return ShardTraceProblem(**value)


def _counts(value: Any) -> ParseCounts:
    _require(isinstance(value, dict) and set(value) <= {"traces", "hits", "parsed", "failed"}, "counts",
             "not an object of parse counts")
    for name in ("traces", "hits", "parsed"):
        _require(is_int(value.get(name, 0)) and 0 <= value.get(name, 0) <= MAX_TRACE_COUNT, f"counts.{name}",
                 f"not an integer from 0 to {MAX_TRACE_COUNT}")
    failed = [_problem(p, "counts.failed") for p in _list(value.get("failed", []), "counts.failed")]
    counts = ParseCounts(**{**value, "failed": failed})
    _require(counts.hits + counts.parsed + len(counts.failed) == counts.traces, "counts",
             f"{counts.hits} from the cache + {counts.parsed} parsed + {len(counts.failed)} unreadable is not "
             f"its {counts.traces} trace(s)")
    return counts


def _incomplete(value: Any) -> IncompleteTask:
    _require(isinstance(value, dict) and set(value) == {"task", "ranks", "log_path", "reason"}, "incomplete",
             "not an incomplete-task object")
    _require(is_int(value["task"]) and value["task"] >= 0, "incomplete.task", "not a non-negative integer")
    _require(isinstance(value["log_path"], str) and isinstance(value["reason"], str), "incomplete",
             "log_path or reason is not text")
    return IncompleteTask(**{**value, "ranks": _shard_keys(value["ranks"], "incomplete.ranks")})


def write_task_record(layout: RunLayout, record: TaskRecord) -> Path:
    path = fanout_task_record(layout, record.array_job_id, record.task)
    _write_json(record.to_json(), path, layout)
    return path


def write_reduce_record(layout: RunLayout, record: ReduceRecord) -> Path:
    path = fanout_reduce_record(layout, record.array_job_id)
    _write_json(record.to_json(), path, layout)
    return path


def read_task_record(layout: RunLayout, array_job_id: str, task: int) -> tuple[TaskRecord | None, str]:
    """The task's record, or (None, why there is none)."""
    path = fanout_task_record(layout, array_job_id, task)
    if not os.path.lexists(path):
        return None, f"no record {path} (the task did not finish)"
    try:
        record = TaskRecord.from_json(_read_json(path, layout))
    except (OSError, ValueError, RecursionError) as error:
        return None, f"{path}: unreadable record: {type(error).__name__}: {str(error)[:200]}"
    if (record.array_job_id, record.task) != (array_job_id, task):
        return None, f"{path}: record of another task ({record.array_job_id}_{record.task})"
    return record, ""


def read_reduce_record(layout: RunLayout, array_job_id: str) -> ReduceRecord | None:
    return _reduce_record_or_why(layout, array_job_id)[0]


def _reduce_record_or_why(layout: RunLayout, array_job_id: str) -> tuple[ReduceRecord | None, str]:
    path = fanout_reduce_record(layout, array_job_id)
    if not os.path.lexists(path):
        return None, "no record yet (waiting for the tasks, running, or it died)"
    try:
        return ReduceRecord.from_json(_read_json(path, layout)), ""
    except (OSError, ValueError, RecursionError) as error:
        return None, f"{path}: unreadable record: {type(error).__name__}: {str(error)[:200]}"


# --- what the records say of each fan-out of a run (fleetscope status) --------------------------------


@dataclass(frozen=True, kw_only=True)
class FanoutState:
    """One fan-out as its records show it (no scheduler asked: this holds after Slurm forgot the jobs)."""

    array_job_id: str
    directory: str
    planned_tasks: int | None
    """From the records (each holds the array's task count); None while none is written."""
    finished: list[TaskRecord]
    """Tasks with a valid record, by task number."""
    unreadable: list[str] = field(default_factory=list)
    """Task records present but not usable: why, one line each."""
    reduce: ReduceRecord | None = None
    reduce_problem: str = ""

    @property
    def missing_tasks(self) -> list[int]:
        """Planned tasks without a valid record (still running, pending, or died)."""
        done = {record.task for record in self.finished}
        return [task for task in range(self.planned_tasks or 0) if task not in done]


_FANOUT_DIR = re.compile("^" + re.escape(FANOUT_FORMAT).replace(re.escape("{array_job_id}"), f"({ARRAY_JOB_ID})") + "$")
_TASK_RECORD = re.compile(r"^task([0-9]{1,7})\.json$")


def fanout_states(layout: RunLayout) -> list[FanoutState]:
    """Every fan-out of the run, by array job id; a folder that is not a fan-out's (another name, a
    symlink) is not read."""
    try:
        entries = list(os.scandir(slurm_logs_dir(layout)))
    except OSError:
        return []
    found = sorted(((int(m.group(1)), m.group(1)), entry.path) for entry in entries
                   if (m := _FANOUT_DIR.match(entry.name)) and entry.is_dir(follow_symlinks=False))
    return [_fanout_state(layout, job, Path(path)) for (_, job), path in found]


def _fanout_state(layout: RunLayout, array_job_id: str, directory: Path) -> FanoutState:
    tasks = sorted(int(m.group(1)) for name in _names_in(directory) if (m := _TASK_RECORD.match(name)))
    finished, unreadable = [], []
    for task in tasks[:MAX_WORLD_SIZE]:
        record, why = read_task_record(layout, array_job_id, task)
        if record is None:
            unreadable.append(why)
        else:
            finished.append(record)
    reduce, reduce_problem = _reduce_record_or_why(layout, array_job_id)
    if reduce is not None:
        # the reduce's word is the later one: a task it found incomplete is not done, whatever its record says
        incomplete = {task.task: task.reason for task in reduce.incomplete}
        unreadable += [f"task {record.task}: the reduce found it incomplete ({incomplete[record.task]})"
                       for record in finished if record.task in incomplete]
        finished = [record for record in finished if record.task not in incomplete]
    counts = [record.tasks for record in finished] + ([reduce.tasks] if reduce is not None else [])
    return FanoutState(array_job_id=array_job_id, directory=str(directory),
                       planned_tasks=max(counts) if counts else None, finished=finished, unreadable=unreadable,
                       reduce=reduce, reduce_problem=reduce_problem)


def _names_in(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _write_json(data: dict[str, Any], path: Path, layout: RunLayout) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not is_inside(path.parent, layout.root):
        # logs/slurm/fanout-<job> replaced by a symlink: a record is never written outside the run
        raise OSError(f"{path.parent}: resolves outside {layout.root} (symlink?): the record {path.name} is not "
                      "written there")
    write_bytes_atomically((json.dumps(data, indent=1, allow_nan=False) + "\n").encode(), path)


def _read_json(path: Path, layout: RunLayout) -> dict[str, Any]:
    data = json.loads(read_metadata(path, within=layout.root))
    if not isinstance(data, dict):
        raise ValueError(f"top level is {type(data).__name__}, expected an object")
    return data
