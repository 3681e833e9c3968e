"""Planning one Kineto trace window as Perfetto track events (pure: no I/O).

A Kineto window is a list of Chrome trace events. Planning turns it into

* tracks: one per CPU thread and per GPU stream (and one per counter series), named for people:
  CPU threads by their `thread_name` metadata, GPU streams as `GPU 0 stream 7`;
* lanes: Perfetto needs the slices of a track to nest properly, but Kineto tracks hold events that
  overlap without nesting (GPU annotations across kernels, Python functions across ops). Such an
  event goes to the first extra lane of its track where it nests, a track of its own named
  `<track> [overlap N]`, placed right under its track. The rule is deterministic (events taken by
  start time, longest first), so the same input always gives the same tracks;
* operations: begin/end/instant/counter tuples in time order, with timestamps in nanoseconds on the
  merged clock: `baseTimeNanoseconds + ts_us * 1000 - clock_offset_ns`.

A rank's windows are planned one after another against the same `RankTracks`, so all of them land
in one process and reuse its tracks.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from .perfetto_writer import TrackSpec

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "gpu_instant_event"})
"""Kineto categories of device activity; a (pid, tid) holding any of them is a GPU stream."""

OP_END, OP_BEGIN, OP_INSTANT, OP_COUNTER = 0, 1, 2, 3

MAX_LANE_ORDER = 63
_LANES_PER_TRACK = MAX_LANE_ORDER + 1
_GROUP_STRIDE = 1 << 24
GROUP_MAIN_THREAD, GROUP_CPU_THREAD, GROUP_GPU_STREAM, GROUP_OTHER, GROUP_COUNTER, GROUP_ANALYSIS = range(6)

TrackKey = tuple[str, Any, Any]
"""("cpu" | "gpu" | "other", pid, tid) or ("counter", pid, series name)."""

Slice = tuple[int, int, str, str]
"""(start_ns, end_ns, name, category)."""


@dataclass(kw_only=True, slots=True)
class WindowSpan:
    start_ns: int
    end_ns: int
    last_lane: int


@dataclass(kw_only=True)
class RankTracks:
    """The tracks of one rank's process, shared by all its windows. Track uuids are
    `(rank + 1) << 32 | n`, unique in the merged trace and stable for a given input."""

    rank: int
    process_uuid: int
    _uuids: dict[tuple[TrackKey, int], int] = field(default_factory=dict)
    _base_orders: dict[TrackKey, int] = field(default_factory=dict)
    _names: dict[TrackKey, str] = field(default_factory=dict)
    _spans: dict[TrackKey, list[WindowSpan]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def for_rank(cls, rank: int) -> "RankTracks":
        return cls(rank=rank, process_uuid=(rank + 1) << 32)

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
        new_tracks.append(TrackSpec(
            uuid=uuid, name=name, parent_uuid=self.process_uuid,
            order=self._base_orders[key] + min(lane, MAX_LANE_ORDER),
            is_counter=key[0] == "counter", counter_unit=counter_unit,
        ))
        return uuid

    def first_free_lane(self, key: TrackKey, start_ns: int, end_ns: int) -> int:
        """Lane 0 unless this window overlaps an earlier window of the same track in time."""
        overlapping = [s.last_lane for s in self._spans[key] if s.start_ns < end_ns and start_ns < s.end_ns]
        return max(overlapping) + 1 if overlapping else 0

    def record_span(self, key: TrackKey, start_ns: int, end_ns: int, last_lane: int) -> None:
        self._spans[key].append(WindowSpan(start_ns=start_ns, end_ns=end_ns, last_lane=last_lane))

    @property
    def track_count(self) -> int:
        return len(self._uuids)


@dataclass(kw_only=True)
class WindowPlan:
    """What one window adds to the merged trace, in emission order."""

    new_tracks: list[TrackSpec]
    operations: list[tuple]
    """Time-sorted: (ts_ns, OP_BEGIN, uuid, name, category), (ts_ns, OP_END, uuid),
    (ts_ns, OP_INSTANT, uuid, name, category), (ts_ns, OP_COUNTER, uuid, value)."""
    slice_count: int = 0
    instant_count: int = 0
    counter_sample_count: int = 0
    overlap_lane_count: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Events not written, by reason (e.g. "negative duration clamped to 0" counts fixes, not drops)."""

    @property
    def first_ts_ns(self) -> int | None:
        return self.operations[0][0] if self.operations else None


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowClock:
    """How a window's `ts` (microseconds) maps onto the merged clock (nanoseconds)."""

    base_ns: int
    offset_ns: int = 0

    def to_ns(self, ts_us: float) -> int:
        return self.base_ns + round(ts_us * 1000) - self.offset_ns


@dataclass(kw_only=True)
class _Grouped:
    slices: dict[tuple, list[Slice]] = field(default_factory=lambda: defaultdict(list))
    instants: dict[tuple, list[tuple[int, str, str]]] = field(default_factory=lambda: defaultdict(list))
    counters: dict[tuple, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    gpu_threads: dict[tuple, tuple[Any, Any]] = field(default_factory=dict)
    """(pid, tid) -> (device, stream) for tracks that hold device activity."""
    thread_names: dict[tuple, list[str]] = field(default_factory=lambda: defaultdict(list))
    process_names: dict[Any, str] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    negative_durations: int = 0


def plan_window(events: list[Any], tracks: RankTracks, clock: WindowClock) -> WindowPlan:
    """Plan the events of one Kineto window onto `tracks` (which it updates)."""
    grouped = _group_events(events, clock)
    _register_tracks(grouped, tracks)
    plan = WindowPlan(new_tracks=[], operations=[], skipped=grouped.skipped)
    if grouped.negative_durations:
        plan.skipped["negative duration clamped to 0 (slice kept)"] += grouped.negative_durations
    _plan_slices(grouped, tracks, plan)
    _plan_instants(grouped, tracks, plan)
    _plan_counters(grouped, tracks, plan)
    plan.operations.sort(key=_timestamp)
    return plan


def _timestamp(operation: tuple) -> int:
    return operation[0]


def _group_events(events: Iterable[Any], clock: WindowClock) -> _Grouped:
    grouped = _Grouped()
    for event in events:
        if not isinstance(event, dict):
            grouped.skipped["not a JSON object"] += 1
            continue
        phase = event.get("ph")
        if phase == "X":
            _add_complete(event, grouped, clock)
        elif phase in ("i", "I"):
            _add_instant(event, grouped, clock)
        elif phase == "C":
            _add_counter(event, grouped, clock)
        elif phase == "M":
            _add_metadata(event, grouped)
        else:
            grouped.skipped[f"phase {phase!r} not merged"] += 1
    return grouped


def _thread_of(event: dict) -> tuple:
    return (_hashable(event.get("pid", "")), _hashable(event.get("tid", "")))


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (int, str)) else str(value)


def _add_complete(event: dict, grouped: _Grouped, clock: WindowClock) -> None:
    ts, dur = event.get("ts"), event.get("dur", 0)
    if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
        grouped.skipped["complete event without numeric ts/dur"] += 1
        return
    if dur < 0:
        grouped.negative_durations += 1
        dur = 0
    start_ns = clock.to_ns(ts)
    thread = _thread_of(event)
    category = event.get("cat") or ""
    if category in GPU_CATEGORIES and thread not in grouped.gpu_threads:
        grouped.gpu_threads[thread] = _device_stream(event, thread)
    grouped.slices[thread].append((start_ns, start_ns + round(dur * 1000), _text(event.get("name")), _text(category)))


def _device_stream(event: dict, thread: tuple) -> tuple[Any, Any]:
    args = event.get("args")
    args = args if isinstance(args, dict) else {}
    return args.get("device", thread[0]), args.get("stream", thread[1])


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _add_instant(event: dict, grouped: _Grouped, clock: WindowClock) -> None:
    ts = event.get("ts")
    if not isinstance(ts, (int, float)):
        grouped.skipped["instant event without numeric ts"] += 1
        return
    grouped.instants[_thread_of(event)].append((clock.to_ns(ts), _text(event.get("name")), _text(event.get("cat"))))


def _add_counter(event: dict, grouped: _Grouped, clock: WindowClock) -> None:
    ts, args = event.get("ts"), event.get("args")
    if not isinstance(ts, (int, float)) or not isinstance(args, dict):
        grouped.skipped["counter event without numeric ts or args"] += 1
        return
    name = _text(event.get("name"))
    for series, value in args.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            label = name if len(args) == 1 else f"{name} {series}"
            grouped.counters[(_hashable(event.get("pid", "")), label)].append((clock.to_ns(ts), float(value)))


def _add_metadata(event: dict, grouped: _Grouped) -> None:
    args = event.get("args")
    if not isinstance(args, dict):
        return
    name = args.get("name")
    if not isinstance(name, str):
        return
    if event.get("name") == "thread_name":
        grouped.thread_names[_thread_of(event)].append(name.strip())
    elif event.get("name") == "process_name":
        grouped.process_names[_hashable(event.get("pid", ""))] = name.strip()


def best_thread_name(names: list[str], process_name: str | None) -> str | None:
    """Kineto may name a thread twice: `thread 9 (python)` when it starts, `thread 9 (pt_gloo_runloop)`
    once it renames itself. The last name that is not just the process's name wins."""
    own = [n for n in names if not process_name or not n.endswith(f"({process_name})")]
    return (own or names or [None])[-1]


def _register_tracks(grouped: _Grouped, tracks: RankTracks) -> None:
    threads = set(grouped.slices) | set(grouped.instants)
    for thread in sorted(threads, key=lambda t: _thread_sort_key(t, grouped)):
        key = track_key(thread, grouped.gpu_threads)
        tracks.register(key, _track_name(key, thread, grouped), _track_group(key))
    for pid, label in sorted(grouped.counters, key=str):
        tracks.register(("counter", pid, label), label, GROUP_COUNTER)


def track_key(thread: tuple, gpu_threads: dict[tuple, Any]) -> TrackKey:
    pid, tid = thread
    if thread in gpu_threads:
        return ("gpu", pid, tid)
    return ("cpu", pid, tid) if isinstance(pid, int) and isinstance(tid, int) else ("other", pid, tid)


def _thread_sort_key(thread: tuple, grouped: _Grouped) -> tuple:
    pid, tid = thread
    group = _track_group(track_key(thread, grouped.gpu_threads))
    if thread in grouped.gpu_threads:
        device, stream = grouped.gpu_threads[thread]
        return (group, str(type(device)), str(device).zfill(8), str(stream).zfill(12))
    return (group, str(type(tid)), str(tid).zfill(12))


def _track_group(key: TrackKey) -> int:
    kind, pid, tid = key
    if kind == "gpu":
        return GROUP_GPU_STREAM
    if kind == "cpu":
        return GROUP_MAIN_THREAD if pid == tid else GROUP_CPU_THREAD
    return GROUP_COUNTER if kind == "counter" else GROUP_OTHER


def _track_name(key: TrackKey, thread: tuple, grouped: _Grouped) -> str:
    kind, pid, tid = key
    if kind == "gpu":
        device, stream = grouped.gpu_threads[thread]
        return f"GPU {device} stream {stream}"
    named = best_thread_name(grouped.thread_names.get(thread, []), grouped.process_names.get(pid))
    if named:
        return named
    if kind == "cpu":
        return f"thread {tid}"
    return str(tid or pid or "profiler")


def _plan_slices(grouped: _Grouped, tracks: RankTracks, plan: WindowPlan) -> None:
    for thread, slices in grouped.slices.items():
        key = track_key(thread, grouped.gpu_threads)
        slices.sort(key=_start_then_longest)
        window_start = slices[0][0]
        window_end = max(end for _, end, _, _ in slices)
        first_lane = tracks.first_free_lane(key, window_start, window_end)
        lane_operations, lane_count = nest_into_lanes(slices)
        lane_uuids = [tracks.uuid(key, first_lane + lane, plan.new_tracks) for lane in range(lane_count)]
        for operation in lane_operations:
            plan.operations.append((operation[0], operation[1], lane_uuids[operation[2]], *operation[3:]))
        tracks.record_span(key, window_start, window_end, first_lane + lane_count - 1)
        plan.slice_count += len(slices)
        plan.overlap_lane_count += lane_count - 1


def _start_then_longest(item: Slice) -> tuple[int, int]:
    return (item[0], -item[1])


def nest_into_lanes(slices: list[Slice]) -> tuple[list[tuple], int]:
    """Lay out slices sorted by (start, -end) on lanes where they nest properly.

    Returns (operations, lane_count); operations are (ts_ns, OP_BEGIN, lane, name, category) and
    (ts_ns, OP_END, lane), in an order that is time-sorted within every lane. Each slice goes to the
    first lane whose innermost open slice contains it (or that has none open).
    """
    open_ends: list[list[int]] = []
    operations: list[tuple] = []
    for start, end, name, category in slices:
        lane = _first_nesting_lane(open_ends, start, end, operations)
        if lane == len(open_ends):
            open_ends.append([])
        open_ends[lane].append(end)
        operations.append((start, OP_BEGIN, lane, name, category))
    for lane, ends in enumerate(open_ends):
        while ends:
            operations.append((ends.pop(), OP_END, lane))
    return operations, len(open_ends)


def _first_nesting_lane(open_ends: list[list[int]], start: int, end: int, operations: list[tuple]) -> int:
    for lane, ends in enumerate(open_ends):
        while ends and ends[-1] <= start:
            operations.append((ends.pop(), OP_END, lane))
        if not ends or ends[-1] >= end:
            return lane
    return len(open_ends)


def _plan_instants(grouped: _Grouped, tracks: RankTracks, plan: WindowPlan) -> None:
    for thread, instants in grouped.instants.items():
        uuid = tracks.uuid(track_key(thread, grouped.gpu_threads), 0, plan.new_tracks)
        plan.operations.extend((ts, OP_INSTANT, uuid, name, category) for ts, name, category in instants)
        plan.instant_count += len(instants)


def _plan_counters(grouped: _Grouped, tracks: RankTracks, plan: WindowPlan) -> None:
    for (pid, label), samples in grouped.counters.items():
        uuid = tracks.uuid(("counter", pid, label), 0, plan.new_tracks)
        plan.operations.extend((ts, OP_COUNTER, uuid, value) for ts, value in samples)
        plan.counter_sample_count += len(samples)
