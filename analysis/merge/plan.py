"""What planning one Kineto window gives (WindowPlan), and the rules for its few events (pure: no I/O).

A Kineto window is a list of Chrome trace events. Planning turns it into

* tracks: one per CPU thread and per GPU stream (and one per counter series), named for people:
  CPU threads by their `thread_name` metadata, GPU streams as `GPU 0 stream 7` (register_tracks);
* lanes: Perfetto needs the slices of a track to nest properly, but Kineto tracks hold events that
  overlap without nesting (GPU annotations across kernels, Python functions across ops). Such an
  event goes to the first extra lane of its track where it nests, a track of its own named
  `<track> [overlap N]`, placed right under its track. The rule is deterministic (events taken by
  start time, longest first), so the same input always gives the same tracks;
* track events in time order, with timestamps in nanoseconds on the merged clock:
  `baseTimeNanoseconds + ts_us * 1000 - clock_offset_ns`;
* flows (flows.py, column_flows.py) and the analysis overlay and counters (overlays.py).

The planner is column_plan.py: it plans every window, over arrays of its complete events (most of a trace).
The window's few other events are planned by the functions here, their one owner, which it calls: instants
and memory samples, counters, metadata (add_other_event, plan_instants, plan_counters), a flow event's fields
(add_flow_fields), the time filters of those events (filter_rare_events, kept_spans), the writable clock range
(MAX_WRITABLE_NS, OUTSIDE_CLOCK), and the tracks' order and names (register_tracks).

A rank's windows are planned one after another against the same `RankTracks`, so all of them land
in one process and reuse its tracks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET

from fleetscope.traces.kineto_schema import INSTANT_PHASES
from fleetscope.traces.validate import is_finite_number
from fleetscope.analysis.merge.flows import FlowPlan
from fleetscope.analysis.per_rank.events import GPU_TRACK_CATEGORIES
from fleetscope.analysis.merge.overlays import OverlayInputs
from fleetscope.analysis.merge.perfetto.columnar import TrackEventColumns
from fleetscope.analysis.merge.perfetto.writer import TrackSpec
from fleetscope.analysis.merge.tracks import (
    GROUP_COUNTER,
    GROUP_CPU_THREAD,
    GROUP_GPU_STREAM,
    GROUP_MAIN_THREAD,
    GROUP_OTHER,
    OP_COUNTER,
    OP_INSTANT,
    PROFILER_TRACK,
    RankTracks,
    TrackKey,
    track_key,
)
from fleetscope.analysis.merge.window import GroupedEvents, WindowClock, WindowContext

GPU_CATEGORIES = GPU_TRACK_CATEGORIES | {"gpu_instant_event"}
"""The parse's GPU categories (per_rank/events.py, every Kineto generation) and GPU instants."""
"""Kineto categories of device activity; a (pid, tid) holding any of them is a GPU stream."""
PYTHON_FUNCTION_CATEGORY = "python_function"
MEMORY_EVENT_NAME = "[memory]"
_DEVICE_TYPE_NAMES = {0: "CPU", 1: "GPU"}
_MIB = float(1 << 20)



@dataclass(kw_only=True)
class WindowPlan:
    """What one window adds to the merged trace, in emission order."""

    new_tracks: list[TrackSpec]
    flows: FlowPlan = field(default_factory=FlowPlan)
    slice_count: int = 0
    """Slices of Kineto events (overlay slices are counted in overlay_slice_count)."""
    overlay_slice_count: int = 0
    instant_count: int = 0
    """Instants of Kineto events (overlay marks are counted in overlay_instant_count)."""
    overlay_instant_count: int = 0
    step_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, start ns, end ns) of the window's steps on the merged clock (with overlays)."""
    counter_sample_count: int = 0
    overlap_lane_count: int = 0
    filtered_count: int = 0
    """Events left out on purpose (options: python functions, steps, time window)."""
    origin_ns: int | None = None
    skipped: Counter = field(default_factory=Counter)
    """Events that could not be merged or had to be repaired, by reason."""
    columns: TrackEventColumns | None = None
    """The window's track events as the encoder's columns, time-sorted (column_plan.py)."""
    row_sources: Any = None
    """Each row's Kineto event and a begin's end (operation_columns.RowSources)."""

    @property
    def first_ts_ns(self) -> int | None:
        return int(self.columns.timestamps_ns[0]) if self.columns is not None and self.columns.row_count else None

    @property
    def last_ts_ns(self) -> int | None:
        return int(self.columns.timestamps_ns[-1]) if self.columns is not None and self.columns.row_count else None


# --- grouping -------------------------------------------------------------------------------

def add_other_event(event: dict, ident: int, grouped: GroupedEvents, clock: WindowClock) -> None:
    """An instant, counter or metadata event (any other phase is counted as not merged)."""
    phase = event.get("ph")
    if phase in INSTANT_PHASES:
        _add_instant(event, ident, grouped, clock)
    elif phase == "C":
        _add_counter(event, grouped, clock)
    elif phase == "M":
        _add_metadata(event, grouped)
    else:
        grouped.skipped[f"phase {phase!r} not merged"] += 1


def thread_of(event: dict) -> tuple:
    return _thread(event.get("pid", ""), event.get("tid", ""))


def _thread(pid: Any, tid: Any) -> tuple:
    if type(pid) in _PLAIN_IDS and type(tid) in _PLAIN_IDS:
        return (pid, tid)
    return (hashable_id(pid), hashable_id(tid))


_PLAIN_IDS = (int, str)


def hashable_id(value: Any) -> Any:
    """A pid, tid or flow id as the merge keys it: an int or a string as it is, anything else as its text."""
    return value if isinstance(value, (int, str)) else str(value)


def text_of(value: Any) -> str:
    """A name or category as drawn: a string as it is, None as "", anything else as its text."""
    return value if isinstance(value, str) else ("" if value is None else str(value))


NOT_AN_OBJECT = "not a JSON object"
OUT_OF_RANGE = "event with a non-finite time or one beyond int64 nanoseconds"
OUTSIDE_CLOCK = "event before the trace clock's zero or beyond 2^63 ns once placed on it (a merged trace's times are unsigned)"
MAX_WRITABLE_NS = 2**63
"""The one range every timestamp the merge writes must fall in: [0, MAX_WRITABLE_NS) (Perfetto's are uint64, and
the engine reads them as int64). An event placed outside it is left out and counted, never the whole trace."""


def writable_ns(ns: int) -> bool:
    return 0 <= ns < MAX_WRITABLE_NS


def _add_instant(event: dict, ident: int, grouped: GroupedEvents, clock: WindowClock) -> None:
    ts = event.get("ts")
    if not isinstance(ts, (int, float)):
        grouped.skipped["instant event without numeric ts"] += 1
        return
    if not is_finite_number(ts):
        grouped.skipped[OUT_OF_RANGE] += 1
        return
    if not writable_ns(clock.to_ns(ts)):
        grouped.skipped[OUTSIDE_CLOCK] += 1
        return
    if event.get("name") == MEMORY_EVENT_NAME and _add_memory_sample(event, grouped, clock.to_ns(ts)):
        return
    grouped.instants[thread_of(event)].append((clock.to_ns(ts), text_of(event.get("name")), text_of(event.get("cat")), ident))


def _add_memory_sample(event: dict, grouped: GroupedEvents, ts_ns: int) -> bool:
    """Kineto's `[memory]` instants carry the allocator's totals: they become memory counters."""
    args = event.get("args")
    if not isinstance(args, dict) or not is_finite_number(args.get("Total Allocated")):
        return False
    device_type, device_id = args.get("Device Type"), args.get("Device Id")
    device = _DEVICE_TYPE_NAMES.get(device_type, f"device type {device_type}")
    if device != "CPU" and isinstance(device_id, int) and device_id >= 0:
        device = f"{device} {device_id}"
    grouped.memory[f"{device} memory allocated (MiB)"].append((ts_ns, args["Total Allocated"] / _MIB))
    if is_finite_number(args.get("Total Reserved")) and device != "CPU":
        grouped.memory[f"{device} memory reserved (MiB)"].append((ts_ns, args["Total Reserved"] / _MIB))
    return True


def _add_counter(event: dict, grouped: GroupedEvents, clock: WindowClock) -> None:
    ts, args = event.get("ts"), event.get("args")
    if not isinstance(ts, (int, float)) or not isinstance(args, dict):
        grouped.skipped["counter event without numeric ts or args"] += 1
        return
    if not is_finite_number(ts):
        grouped.skipped[OUT_OF_RANGE] += 1
        return
    if not writable_ns(clock.to_ns(ts)):
        grouped.skipped[OUTSIDE_CLOCK] += 1
        return
    name = text_of(event.get("name"))
    for series, value in args.items():
        if is_finite_number(value):
            label = name if len(args) == 1 else f"{name} {series}"
            grouped.counters[(hashable_id(event.get("pid", "")), label)].append((clock.to_ns(ts), float(value)))


def add_flow_fields(phase: str, ts: Any, flow_id: Any, binding_point: Any, category: Any, pid: Any, tid: Any,
                    grouped: GroupedEvents, clock: WindowClock) -> None:
    """A flow event (`s`, `t`, `f`) from its fields (None or msgspec.UNSET where the trace has none)."""
    if not is_finite_number(ts) or flow_id is None or flow_id is UNSET:
        grouped.skipped["flow event without numeric ts or id"] += 1
        return
    if not writable_ns(clock.to_ns(ts)):
        grouped.skipped[OUTSIDE_CLOCK] += 1
        return
    enclosing = phase != "f" or binding_point == "e"
    grouped.flow_events.append((phase, text_of(None if category is UNSET else category), hashable_id(flow_id),
                                _thread("" if pid is UNSET else pid, "" if tid is UNSET else tid),
                                clock.to_ns(ts), enclosing))


def _add_metadata(event: dict, grouped: GroupedEvents) -> None:
    args = event.get("args")
    name = args.get("name") if isinstance(args, dict) else None
    if not isinstance(name, str):
        return
    if event.get("name") == "thread_name":
        grouped.thread_names[thread_of(event)].append(name.strip())
    elif event.get("name") == "process_name":
        grouped.process_names[hashable_id(event.get("pid", ""))] = name.strip()


def best_thread_name(names: list[str], process_name: str | None) -> str | None:
    """Kineto may name a thread twice: `thread 9 (python)` when it starts, `thread 9 (pt_gloo_runloop)`
    once it renames itself. The last name that is not just the process's name wins."""
    own = [n for n in names if not process_name or not n.endswith(f"({process_name})")]
    return (own or names or [None])[-1]


# --- filters (options.steps, options.time_window_s) -------------------------------------------

def filter_rare_events(grouped: GroupedEvents, spans: list[tuple[int, int]], overlay_inputs: OverlayInputs) -> None:
    """The time filters on the instants, counters and steps (everything but the slices)."""
    for thread, instants in grouped.instants.items():
        kept = [i for i in instants if _overlaps(i[0], i[0], spans)]
        grouped.filtered += len(instants) - len(kept)
        grouped.instants[thread] = kept
    for table in (grouped.counters, grouped.memory):
        for key, samples in table.items():
            table[key] = [s for s in samples if _overlaps(s[0], s[0], spans)]
    overlay_inputs.keep_steps(spans)


def kept_spans(context: WindowContext, overlay_inputs: OverlayInputs, origin_ns: int | None) -> list[tuple[int, int]] | None:
    """[start, end) intervals of the merged clock whose events are kept; None keeps everything."""
    options = context.options
    spans = None
    if options.steps is not None:
        spans = [(start, end) for step, start, end in overlay_inputs.step_ranges() if step in options.steps]
    if options.time_window_s is not None and origin_ns is not None:
        window = (origin_ns + round(options.time_window_s[0] * 1e9), origin_ns + round(options.time_window_s[1] * 1e9))
        spans = [window] if spans is None else [(max(s, window[0]), min(e, window[1])) for s, e in spans
                                                if max(s, window[0]) < min(e, window[1])]
    return spans


def _overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return any(start < span_end and max(end, start + 1) > span_start for span_start, span_end in spans)


# --- tracks and slices ------------------------------------------------------------------------

def register_tracks(threads: set[tuple], grouped: GroupedEvents, tracks: RankTracks) -> None:
    """The tracks of `threads` (those with a slice or an instant) and of the counters, in their fixed order."""
    for thread in sorted(threads, key=lambda t: _thread_sort_key(t, grouped)):
        key = track_key(thread, grouped.gpu_threads)
        tracks.register(key, _track_name(key, thread, grouped), _track_group(key))
    for pid, label in sorted((k for k, v in grouped.counters.items() if v), key=str):
        tracks.register(("counter", pid, label), label, GROUP_COUNTER)
    for label in sorted(k for k, v in grouped.memory.items() if v):
        tracks.register(("counter", MEMORY_EVENT_NAME, label), label, GROUP_COUNTER)


def _thread_sort_key(thread: tuple, grouped: GroupedEvents) -> tuple:
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
    return GROUP_OTHER


def _track_name(key: TrackKey, thread: tuple, grouped: GroupedEvents) -> str:
    kind, pid, tid = key
    if kind == "gpu":
        device, stream = grouped.gpu_threads[thread]
        return f"GPU {device} stream {stream}"
    named = best_thread_name(grouped.thread_names.get(thread, []), grouped.process_names.get(pid))
    if named:
        return named
    if kind == "cpu":
        return f"thread {tid}"
    return "PyTorch Profiler" if key == PROFILER_TRACK else f"{pid} {tid}".strip()


def plan_instants(grouped: GroupedEvents, tracks: RankTracks, plan: WindowPlan, operations: list[tuple]) -> None:
    for thread, instants in grouped.instants.items():
        if not instants:
            continue
        uuid = tracks.uuid(track_key(thread, grouped.gpu_threads), 0, plan.new_tracks)
        operations.extend((ts, OP_INSTANT, uuid, name, category, ident, None)
                               for ts, name, category, ident in instants)
        plan.instant_count += len(instants)


def plan_counters(grouped: GroupedEvents, tracks: RankTracks, plan: WindowPlan, operations: list[tuple]) -> None:
    for (pid, label), samples in grouped.counters.items():
        if not samples:
            continue
        uuid = tracks.uuid(("counter", pid, label), 0, plan.new_tracks)
        operations.extend((ts, OP_COUNTER, uuid, value) for ts, value in samples)
        plan.counter_sample_count += len(samples)
    for label, samples in grouped.memory.items():
        if not samples:
            continue
        uuid = tracks.uuid(("counter", MEMORY_EVENT_NAME, label), 0, plan.new_tracks, counter_unit="MiB")
        operations.extend((ts, OP_COUNTER, uuid, value) for ts, value in samples)
        plan.counter_sample_count += len(samples)
