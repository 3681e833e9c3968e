"""One rank's Kineto trace as a columnar event table (numpy arrays plus a string table).

Only complete events (`"ph": "X"`) are kept; they are what every analysis here uses. Names are
interned into `names` and referenced by `name_id`, so classifying events is done once per distinct
name, not once per event. Timestamps stay in the trace's own clock (microseconds relative to
`base_time_ns`), which keeps float64 precision at the sub-microsecond level.
"""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Kind(enum.IntEnum):
    """What an event is, from its Kineto category."""

    OTHER = 0
    CPU_OP = 1
    USER_ANNOTATION = 2
    GPU_USER_ANNOTATION = 3
    KERNEL = 4
    GPU_MEMCPY = 5
    GPU_MEMSET = 6
    CUDA_RUNTIME = 7
    PYTHON_FUNCTION = 8


_KIND_OF_CATEGORY = {
    "cpu_op": Kind.CPU_OP,
    "operator": Kind.CPU_OP,
    "user_annotation": Kind.USER_ANNOTATION,
    "gpu_user_annotation": Kind.GPU_USER_ANNOTATION,
    "kernel": Kind.KERNEL,
    "gpu_memcpy": Kind.GPU_MEMCPY,
    "gpu_memset": Kind.GPU_MEMSET,
    "cuda_runtime": Kind.CUDA_RUNTIME,
    "cuda_driver": Kind.CUDA_RUNTIME,
    "python_function": Kind.PYTHON_FUNCTION,
}

GPU_ACTIVITY_KINDS = (Kind.KERNEL, Kind.GPU_MEMCPY, Kind.GPU_MEMSET)
NO_ID = -1


@dataclass(frozen=True, kw_only=True)
class TraceEvents:
    """Complete events of one trace, one row per event, sorted by start time."""

    names: list[str]
    """String table: `names[name_id[i]]` is the name of event i."""
    thread_names: dict[int, str]
    """Thread key -> thread name from the trace's metadata (may be empty)."""
    name_id: np.ndarray
    kind: np.ndarray
    """`Kind` codes (int8)."""
    start_us: np.ndarray
    dur_us: np.ndarray
    thread: np.ndarray
    """CPU thread key (the trace's tid) or, for GPU activity, the stream."""
    device: np.ndarray
    """GPU device index for GPU activity, -1 for host events."""
    correlation: np.ndarray
    """CUDA correlation id linking a launch to its GPU activity, -1 when absent."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Events left out, by reason (negative duration, non-numeric time)."""

    def __len__(self) -> int:
        return int(self.start_us.size)

    @property
    def end_us(self) -> np.ndarray:
        return self.start_us + self.dur_us

    def names_matching(self, predicate) -> np.ndarray:
        """Boolean mask over events whose name satisfies `predicate(name)`."""
        by_id = np.fromiter((bool(predicate(n)) for n in self.names), dtype=bool, count=len(self.names))
        return by_id[self.name_id] if len(self.names) else np.zeros(len(self), dtype=bool)

    def of_kind(self, *kinds: Kind) -> np.ndarray:
        return np.isin(self.kind, np.asarray(kinds, dtype=np.int8))

    @property
    def has_gpu_activity(self) -> bool:
        return bool(self.of_kind(*GPU_ACTIVITY_KINDS).any())


class _Columns:
    """Row-wise accumulation of the columns, turned into arrays once."""

    def __init__(self) -> None:
        self.name_index: dict[str, int] = {}
        self.name_id: list[int] = []
        self.kind: list[int] = []
        self.start: list[float] = []
        self.dur: list[float] = []
        self.thread: list[int] = []
        self.device: list[int] = []
        self.correlation: list[int] = []
        self.dropped: dict[str, int] = {}

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def extract_events(document: dict[str, Any]) -> TraceEvents:
    """Build the event table of a parsed Kineto trace document."""
    columns = _Columns()
    thread_names: dict[int, str] = {}
    for event in document["traceEvents"]:
        if not isinstance(event, dict):
            columns.drop("not a JSON object")
            continue
        phase = event.get("ph")
        if phase == "X":
            _add_complete_event(columns, event)
        elif phase == "M" and event.get("name") == "thread_name":
            _add_thread_name(thread_names, event)
    return _to_table(columns, thread_names)


def _add_complete_event(columns: _Columns, event: dict[str, Any]) -> None:
    start, dur = event.get("ts"), event.get("dur", 0)
    if not _is_number(start) or not _is_number(dur):
        columns.drop("missing or non-numeric ts/dur")
        return
    if dur < 0:
        columns.drop("negative duration")
        return
    name = event.get("name")
    name = name if isinstance(name, str) else str(name)
    name_id = columns.name_index.setdefault(name, len(columns.name_index))
    kind = _KIND_OF_CATEGORY.get(event.get("cat"), Kind.OTHER)
    args = event.get("args")
    args = args if isinstance(args, dict) else {}
    columns.name_id.append(name_id)
    columns.kind.append(kind)
    columns.start.append(float(start))
    columns.dur.append(float(dur))
    if kind in GPU_ACTIVITY_KINDS or kind == Kind.GPU_USER_ANNOTATION:
        columns.thread.append(_int_or(args.get("stream"), _int_or(event.get("tid"), NO_ID)))
        columns.device.append(_int_or(args.get("device"), _int_or(event.get("pid"), 0)))
    else:
        columns.thread.append(_thread_key(event.get("tid")))
        columns.device.append(NO_ID)
    columns.correlation.append(_int_or(args.get("correlation"), NO_ID))


def _add_thread_name(thread_names: dict[int, str], event: dict[str, Any]) -> None:
    args = event.get("args")
    if isinstance(args, dict) and isinstance(args.get("name"), str):
        key = _thread_key(event.get("tid"))
        # Kineto may name a thread twice ("python3" and "pt_gloo_runloop"): keep the specific one.
        if key not in thread_names or thread_names[key].endswith(("(python3)", "(python)")):
            thread_names[key] = args["name"]


def _to_table(columns: _Columns, thread_names: dict[int, str]) -> TraceEvents:
    start = np.asarray(columns.start, dtype=np.float64)
    order = np.argsort(start, kind="stable")
    names = [""] * len(columns.name_index)
    for name, index in columns.name_index.items():
        names[index] = name
    return TraceEvents(
        names=names,
        thread_names=thread_names,
        name_id=np.asarray(columns.name_id, dtype=np.int32)[order],
        kind=np.asarray(columns.kind, dtype=np.int8)[order],
        start_us=start[order],
        dur_us=np.asarray(columns.dur, dtype=np.float64)[order],
        thread=np.asarray(columns.thread, dtype=np.int64)[order],
        device=np.asarray(columns.device, dtype=np.int32)[order],
        correlation=np.asarray(columns.correlation, dtype=np.int64)[order],
        dropped=columns.dropped,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_INT64_MAX = 2**63 - 1


def _int_or(value: Any, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _INT64_MAX:
        return default
    return value


def _thread_key(tid: Any) -> int:
    """Kineto tids are ints, or strings for its own pseudo-threads; strings get a stable negative key."""
    if isinstance(tid, int) and not isinstance(tid, bool) and abs(tid) <= _INT64_MAX:
        return tid
    return -zlib.crc32(str(tid).encode()) - 2
