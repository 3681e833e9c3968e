"""The tracks of one rank's process in the merged trace, and the ids that must be unique in it.

Track uuids are `(rank + 1) << 32 | n`; flow ids of one rank are `(rank + 1) << 40 | n`; both are
unique in the merged trace and stable for a given input. Flow ids that join ranks (the same
collective instance on every rank) are made by `perfetto_flows.collective_flow_id` and have the top
bit set, so they never meet a rank's own ids.

Tracks of a process are ordered in groups (analysis overlay, counters, main thread, other CPU
threads, GPU streams, anything else); within a group by when they were first registered (a window
registers its new tracks in a fixed order), and an overlap lane right under its track.

A CPU thread is a real thread track (its descriptor names the rank's process pid and a thread id of
the merged trace, `synthetic_tid`), so the trace processor's `thread` table lists it; the Kineto pid
and tid are kept in the track's description. GPU streams, counters, the analysis overlay and the
overlap lanes of any track (threads included) are tracks of the rank's process.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from fleetscope.analysis.merge.column_lanes import nest_codes

from fleetscope.analysis.merge.perfetto.writer import TrackSpec

MAX_LANE_ORDER = 63
_LANES_PER_TRACK = MAX_LANE_ORDER + 1
_GROUP_STRIDE = 1 << 24
GROUP_ANALYSIS, GROUP_COUNTER, GROUP_MAIN_THREAD, GROUP_CPU_THREAD, GROUP_GPU_STREAM, GROUP_OTHER = range(6)

TrackKey = tuple[str, Any, Any]
"""("cpu" | "gpu" | "other", pid, tid), ("counter", source, label) or ("analysis", name, "")."""


def track_key(thread: tuple, gpu_threads: dict[tuple, Any]) -> TrackKey:
    """The track a thread's slices are drawn on: its GPU stream, its CPU thread, or Kineto's profiler track."""
    pid, tid = thread
    if thread in gpu_threads:
        return ("gpu", pid, tid)
    if isinstance(pid, int) and isinstance(tid, int):
        return ("cpu", pid, tid)
    if pid in KINETO_PROFILER_PIDS:
        return PROFILER_TRACK
    return ("other", pid, tid)


KINETO_PROFILER_PIDS = frozenset({"Spans", "Traces", ""})
"""Kineto's pseudo-processes for the profiler's own span and markers: they share one track."""
PROFILER_TRACK = ("other", "profiler", "")


def emission_ranks(threads: Iterable[tuple], gpu_threads: dict[tuple, Any]) -> dict[tuple, int]:
    """Each thread's place in the order the planners write tracks at one instant: the first appearance of
    its track among `threads` (in the order the planners list them). Both planners write a window's tracks
    one after the other and then sort the operations by time, stably, so at one timestamp a track that
    appears first is written first (plan._plan_slices, column_plan._rows_by_track)."""
    order: dict[TrackKey, int] = {}
    return {thread: order.setdefault(track_key(thread, gpu_threads), len(order)) for thread in threads}


_RANK_FLOW_SHIFT = 40

PROCESS_PID_BASE = 1_000_000
"""Process ids in the merged trace are `PROCESS_PID_BASE + rank`: unique, never 0, and the UI's
`rank 3 (node7) 1000003` still ends in the rank. Real pids would collide across hosts."""
THREAD_TID_BASE = 10_000_000
THREADS_PER_RANK = 4096
"""Thread ids in the merged trace are `THREAD_TID_BASE + rank * THREADS_PER_RANK + n` for the n-th
CPU thread of a rank: unique across ranks, above every process id, and within int32 up to ~520k ranks."""


def synthetic_tid(rank: int, index: int) -> int:
    if not 0 <= index < THREADS_PER_RANK:
        raise ValueError(f"rank {rank} has more than {THREADS_PER_RANK} CPU threads")
    return THREAD_TID_BASE + rank * THREADS_PER_RANK + index

OP_END, OP_BEGIN, OP_INSTANT, OP_COUNTER = 0, 1, 2, 3
"""Planned operations: (ts_ns, OP_BEGIN, uuid, name, category, end_ns, ident, annotations),
(ts_ns, OP_END, uuid), (ts_ns, OP_INSTANT, uuid, name, category, ident, annotations),
(ts_ns, OP_COUNTER, uuid, value)."""
NO_EVENT = -1
"""The `ident` of slices and instants the merge made up (overlays): they have no Kineto event."""
FIRST_MADE_UP_IDENT = -2
"""Made-up slices that carry flows get idents counting down from here (unique in their window, so the
window's FlowPlan can key their flows); every ident < 0 is a made-up slice."""

Slice = tuple[int, int, str, str, int, Any]
"""(start_ns, end_ns, name, category, ident, annotations): ident is the event's index in the
window's event list (NO_EVENT for made-up slices); annotations a dict or None."""


@dataclass(kw_only=True, slots=True)
class WindowSpan:
    start_ns: int
    end_ns: int
    last_lane: int


@dataclass(kw_only=True)
class RankTracks:
    """The tracks of one rank's process, shared by all its windows."""

    rank: int
    process_uuid: int
    pid: int
    _thread_tids: dict[TrackKey, int] = field(default_factory=dict)
    _uuids: dict[tuple[TrackKey, int], int] = field(default_factory=dict)
    _base_orders: dict[TrackKey, int] = field(default_factory=dict)
    _names: dict[TrackKey, str] = field(default_factory=dict)
    _spans: dict[TrackKey, list[WindowSpan]] = field(default_factory=lambda: defaultdict(list))
    _flow_count: int = 0

    @classmethod
    def for_rank(cls, rank: int) -> "RankTracks":
        return cls(rank=rank, process_uuid=(rank + 1) << 32, pid=PROCESS_PID_BASE + rank)

    def register(self, key: TrackKey, name: str, group: int) -> None:
        """Give a track its place in the process (the first name seen wins)."""
        if key not in self._base_orders:
            index = len(self._base_orders)
            self._base_orders[key] = group * _GROUP_STRIDE + index * _LANES_PER_TRACK
            self._names[key] = name

    def uuid(self, key: TrackKey, lane: int, new_tracks: list[TrackSpec], *, counter_unit: str | None = None) -> int:
        """The uuid of a lane of a registered track; a first use appends its descriptor to `new_tracks`."""
        existing = self._uuids.get((key, lane))
        if existing is not None:
            return existing
        uuid = self.process_uuid | (len(self._uuids) + 1)
        self._uuids[(key, lane)] = uuid
        name = self._names[key] if lane == 0 else f"{self._names[key]} [overlap {lane}]"
        thread = key[0] == "cpu" and lane == 0
        new_tracks.append(TrackSpec(
            uuid=uuid, name=name, parent_uuid=self.process_uuid,
            order=self._base_orders[key] + min(lane, MAX_LANE_ORDER),
            is_counter=key[0] == "counter", counter_unit=counter_unit,
            tid=self._thread_tid(key) if thread else None, thread_pid=self.pid if thread else None,
            thread_name=name if thread else None,
            description=f"Kineto pid {key[1]} tid {key[2]}" if key[0] == "cpu" else None,
        ))
        return uuid

    def _thread_tid(self, key: TrackKey) -> int:
        tid = self._thread_tids.get(key)
        if tid is None:
            tid = self._thread_tids[key] = synthetic_tid(self.rank, len(self._thread_tids))
        return tid

    def first_free_lane(self, key: TrackKey, start_ns: int, end_ns: int) -> int:
        """Lane 0 unless this window overlaps an earlier window of the same track in time."""
        overlapping = [s.last_lane for s in self._spans[key] if s.start_ns < end_ns and start_ns < s.end_ns]
        return max(overlapping) + 1 if overlapping else 0

    def record_span(self, key: TrackKey, start_ns: int, end_ns: int, last_lane: int) -> None:
        self._spans[key].append(WindowSpan(start_ns=start_ns, end_ns=end_ns, last_lane=last_lane))

    def new_flow_id(self) -> int:
        self._flow_count += 1
        return ((self.rank + 1) << _RANK_FLOW_SHIFT) | self._flow_count

    def new_flow_ids(self, count: int) -> np.ndarray:
        """`count` new flow ids at once (uint64), as `count` calls of new_flow_id give them."""
        first = self._flow_count + 1
        self._flow_count += count
        return np.uint64((self.rank + 1) << _RANK_FLOW_SHIFT) | np.arange(first, first + count, dtype=np.uint64)

    @property
    def track_count(self) -> int:
        return len(self._uuids)

    @property
    def thread_count(self) -> int:
        """CPU threads with a thread track (what the trace processor's `thread` table lists)."""
        return len(self._thread_tids)


def lay_out_track(key: TrackKey, slices: list[Slice], tracks: RankTracks, operations: list[tuple],
                  new_tracks: list[TrackSpec]) -> int:
    """Put one track's slices on lanes of `key` (a later window that overlaps an earlier one in time
    starts above the earlier one's lanes); appends operations and new track descriptors, returns the
    lane count."""
    slices.sort(key=_start_then_longest)
    window_start, window_end = slices[0][0], max(s[1] for s in slices)
    first_lane = tracks.first_free_lane(key, window_start, window_end)
    lane_count = nest_into_lanes(slices, operations, lane_id=lambda lane: tracks.uuid(key, first_lane + lane, new_tracks))
    tracks.record_span(key, window_start, window_end, first_lane + lane_count - 1)
    return lane_count


def _start_then_longest(item: Slice) -> tuple[int, int]:
    return (item[0], -item[1])


def nest_into_lanes(slices: list[Slice], operations: list[tuple], *,
                    lane_id: Callable[[int], int] = lambda lane: lane) -> int:
    """Lay out slices sorted by (start, -end) on lanes where they nest properly; returns the lane count.

    Appends (ts_ns, OP_BEGIN, lane id, name, category, end_ns, ident, annotations) and
    (ts_ns, OP_END, lane id) to `operations`, in an order that is time-sorted within every lane.
    Each slice goes to the first lane whose innermost open slice contains it (or that has none open):
    column_lanes.nest_codes, the rule's one owner; `lane_id(n)` names lane n, in lane order.
    """
    codes, lanes, lane_count = nest_codes([s[0] for s in slices], [s[1] for s in slices])
    ids = [lane_id(lane) for lane in range(lane_count)]
    for code in codes:
        if code >= 0:
            start, end, name, category, ident, annotations = slices[code]
            operations.append((start, OP_BEGIN, ids[lanes[code]], name, category, end, ident, annotations))
        else:
            operations.append((slices[~code][1], OP_END, ids[lanes[~code]]))
    return lane_count
