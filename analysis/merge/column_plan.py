"""Planning one window (pure): THE merge planner, over arrays of the window's complete events.

It plans every window, under every option (steps, time range, no python functions, no flows or overlays; the
events' args and the Chrome JSON, written from its columns: run._RankEmitter), whichever reader gave it:
  * the columnar decoder (window_decode.decode_window), for every file it takes (Kineto's own);
  * the generic reader (traces/kineto.py), for a file the decoder refuses (another shape, a value of another
    type, invalid UTF-8): event_window.window_of_events sorts its events into the same columns, with plan.py's
    rules for what a value of another type means. The same trace gives the same bytes either way
    (tests/test_merge_column_plan.py).
Any time the trace holds is taken: an event before the clock's zero or beyond 2^63 ns once placed is left out
and counted, a time beyond float64's exact nanoseconds is placed in Python integers; any 64-bit correlation id.

The rules over arrays (window_decode.SliceColumns): grouping per thread and the time filters are masks and
sorts, launch flows a join on the correlation id, and every slice's begin and end an index into those arrays
until the encoder's columns are built. What is rare (instants, counters, metadata, the flow events' fields,
the collective and point-to-point bindings, the overlays) goes through plan.py's, flows.py's and overlays.py's
functions, each rule's one owner.

The orders are fixed, so the same input always gives the same bytes: threads by first appearance, a track's
slices by (start, longest first, thread, trace order), each track's begins and ends in the order its lane
nesting emits them (column_lanes.py, held to tracks.nest_into_lanes's loop), and the window's operations
sorted by time stably over that emission order.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import compress
from typing import Any

import numpy as np
from fleetscope.analysis.merge.column_flows import plan_flows_on_columns
from fleetscope.analysis.merge.column_lanes import track_codes
from fleetscope.analysis.merge.flows import LAUNCH_FLOWS_COVERED_CATEGORY
from fleetscope.analysis.merge.operation_columns import planned_columns
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.overlays import OverlayInputs, plan_overlays
from fleetscope.analysis.merge.plan import (
    GPU_CATEGORIES,
    MAX_WRITABLE_NS,
    OUT_OF_RANGE,
    OUTSIDE_CLOCK,
    PYTHON_FUNCTION_CATEGORY,
    WindowPlan,
    add_flow_fields,
    add_other_event,
    filter_rare_events,
    kept_spans,
    plan_counters,
    plan_instants,
    register_tracks,
    track_key,
)
from fleetscope.analysis.merge.slice_table import SliceOps, SliceTable
from fleetscope.analysis.merge.tracks import RankTracks, TrackKey
from fleetscope.analysis.merge.window import GroupedEvents, WindowClock, WindowContext
from fleetscope.analysis.merge.window_decode import DecodedWindow, in_range, nanoseconds
from fleetscope.analysis.per_rank.names import process_group_label
from msgspec import UNSET


def plan_window_columns(window: DecodedWindow, tracks: RankTracks, context: WindowContext) -> WindowPlan:
    """The plan of `window` onto `tracks` (which it updates), with the operations as the encoder's columns
    (`plan.columns`)."""
    table, grouped, add_covered = group_columns(window, context.clock, context.options)
    origin_ns = context.origin_ns if context.origin_ns is not None else table.first_ts_ns(grouped)
    overlay_inputs = OverlayInputs(steps=list(context.steps))
    spans = kept_spans(context, overlay_inputs, origin_ns)
    if spans is not None:
        grouped.filtered += table.keep_overlapping(spans)
        filter_rare_events(grouped, spans, overlay_inputs)
    register_tracks(table.nonempty_threads() | {t for t, i in grouped.instants.items() if i}, grouped, tracks)
    plan = WindowPlan(new_tracks=[], skipped=grouped.skipped, filtered_count=grouped.filtered,
                      origin_ns=origin_ns)
    if grouped.negative_durations:
        plan.skipped["negative duration clamped to 0 (slice kept)"] += grouped.negative_durations
    plan.flows = plan_flows_on_columns(table, grouped, tracks, context, add_covered=add_covered)
    plan.skipped.update(plan.flows.left_out())
    slice_ops = _plan_slices(table, grouped, tracks, plan)
    rare_ops: list[tuple] = []
    plan_instants(grouped, tracks, plan, rare_ops)
    plan_counters(grouped, tracks, plan, rare_ops)
    if context.options.overlays:
        overlay = plan_overlays(table.overlay_view(grouped), overlay_inputs, plan.flows, tracks, context,
                                plan.new_tracks)
        rare_ops += overlay.operations
        plan.overlay_slice_count += overlay.slice_count
        plan.overlay_instant_count += overlay.instant_count
        plan.step_ranges = overlay.step_ranges
        plan.counter_sample_count += overlay.counter_sample_count
    plan.columns, plan.row_sources = planned_columns(slice_ops, rare_ops, table, plan.flows)
    return plan


# --- grouping ----------------------------------------------------------------------------------

def group_columns(window: DecodedWindow, clock: WindowClock,
                  options: MergeOptions) -> tuple[SliceTable, GroupedEvents, Callable[[], None]]:
    """The window's slices as a SliceTable (trace order), everything else grouped by plan.py's functions, and
    the adding of each flow event that launch flows cover (`ac2g`: added only where there are none)."""
    grouped = GroupedEvents()
    columns = window.slices
    if window.complete_without_time:
        grouped.skipped["complete event without numeric ts/dur"] += window.complete_without_time
    keep = in_range(columns.ts_us) & in_range(columns.dur_us)
    if not keep.all():
        grouped.skipped[OUT_OF_RANGE] += int((~keep).sum())
    categories, category_ids = _interned(columns.categories)
    if options.drop_python_functions and PYTHON_FUNCTION_CATEGORY in categories:
        python = category_ids == categories.index(PYTHON_FUNCTION_CATEGORY)
        grouped.filtered += int((python & keep).sum())
        keep &= ~python
    table = _slice_table(window, keep, categories, category_ids, clock, grouped)
    for ident, event in window.others:
        add_other_event(event, ident, grouped, clock)
    add_covered = _add_flow_events(window.flow_events, grouped, clock)
    for phase, count in window.undrawn.items():
        grouped.skipped[f"phase {phase!r} not merged"] += count
    return table, grouped, add_covered


def _add_flow_events(events: list[Any], grouped: GroupedEvents, clock: WindowClock) -> Callable[[], None]:
    """Add the flow events to `grouped`, but for those launch flows cover (`ac2g`), which the returned call
    adds: plan.py skips them where launch flows are drawn (most GPU traces)."""
    covered = np.array([event.cat == LAUNCH_FLOWS_COVERED_CATEGORY for event in events], dtype=bool)
    covered &= in_range([event.ts for event in events])
    for position in np.flatnonzero(~covered).tolist():
        _add_flow_event(events[position], grouped, clock)
    return partial(_add_flow_events_at, events, np.flatnonzero(covered).tolist(), grouped, clock)


def _add_flow_events_at(events: list[Any], positions: list[int], grouped: GroupedEvents, clock: WindowClock) -> None:
    for position in positions:
        _add_flow_event(events[position], grouped, clock)


def _add_flow_event(event: Any, grouped: GroupedEvents, clock: WindowClock) -> None:
    add_flow_fields(event.ph, event.ts, event.id, event.bp, event.cat, event.pid, event.tid, grouped, clock)


def _slice_table(window: DecodedWindow, keep: np.ndarray, categories: list[str], category_ids: np.ndarray,
                 clock: WindowClock, grouped: GroupedEvents) -> SliceTable:
    columns = window.slices
    kept = np.flatnonzero(keep)
    starts, durations, writable = placed_times(_picked(columns.ts_us, kept), _picked(columns.dur_us, kept),
                                               clock.shift_ns, grouped)
    kept = kept if writable is None else kept[writable]
    pick = partial(_picked, rows=kept)
    threads, thread_ids = _interned_threads(pick(columns.pids), pick(columns.tids))
    names, name_ids = _interned(pick(columns.names))
    args = pick(columns.args)
    category_ids = category_ids[kept]
    correlations, has_correlation = _correlations(args)
    table = SliceTable(idents=columns.idents[kept], starts=starts, ends=starts + durations, names=names,
                       name_ids=name_ids, categories=categories, category_ids=category_ids, threads=threads,
                       thread_ids=thread_ids, correlations=correlations, has_correlation=has_correlation)
    _note_gpu_threads(table, args, grouped)
    _note_groups(table, args, grouped)
    return table


def _picked(values: list, rows: np.ndarray) -> list:
    """values[rows] of a decoded column (a list), without a copy where every row is kept."""
    return values if len(rows) == len(values) else [values[i] for i in rows.tolist()]


_INT64_MAX = np.iinfo(np.int64).max
_CORRELATION_MIN, _CORRELATION_END = -(2**63), 2**64


def placed_times(ts_us: list, dur_us: list, shift_ns: int,
                 grouped: GroupedEvents) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(start ns on the merged clock, duration ns, which events are kept: None for all) of complete events with
    in-range times, placed as plan.py places one (`shift_ns + round(ts * 1000)`): a negative duration is
    clamped to 0 and counted; an event outside [0, MAX_WRITABLE_NS) once placed is left out and counted
    (OUTSIDE_CLOCK), never the whole window."""
    negative = np.fromiter(dur_us, dtype=np.float64, count=len(dur_us)) < 0
    grouped.negative_durations += int(negative.sum())
    starts, durations = nanoseconds(ts_us, shift_ns), nanoseconds(dur_us, 0)
    if starts is None or durations is None:
        return _placed_times_exactly(ts_us, dur_us, negative, shift_ns, grouped)
    durations[negative] = 0
    # within nanoseconds' bounds a start plus a duration fits int64: only a start before zero is outside
    writable = (starts >= 0) & (durations <= _INT64_MAX - np.maximum(starts, 0))
    if writable.all():
        return starts, durations, None
    grouped.skipped[OUTSIDE_CLOCK] += int((~writable).sum())
    return starts[writable], durations[writable], writable


def _placed_times_exactly(ts_us: list, dur_us: list, negative: np.ndarray, shift_ns: int,
                          grouped: GroupedEvents) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """placed_times in Python integers, for a window with a time beyond nanoseconds' float64 bounds (rare)."""
    starts = [shift_ns + round(ts * 1000) for ts in ts_us]
    durations = [0 if clamped else round(dur * 1000) for dur, clamped in zip(dur_us, negative.tolist())]
    writable = np.array([0 <= start and start + duration < MAX_WRITABLE_NS
                         for start, duration in zip(starts, durations)], dtype=bool)
    grouped.skipped[OUTSIDE_CLOCK] += int((~writable).sum())
    kept = writable.tolist()
    return (np.array(list(compress(starts, kept)), dtype=np.int64),
            np.array(list(compress(durations, kept)), dtype=np.int64), writable)


def _interned(values: list) -> tuple[list, np.ndarray]:
    """The distinct values in first-appearance order, and each value's index among them."""
    distinct = list(dict.fromkeys(values))
    index = {value: position for position, value in enumerate(distinct)}
    return distinct, np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))


def _interned_threads(pids: list, tids: list) -> tuple[list[tuple], np.ndarray]:
    """_interned over (pid, tid) pairs, without a tuple per event: pids and tids interned apart, then pairs."""
    pid_values, pid_ids = _interned(pids)
    tid_values, tid_ids = _interned(tids)
    pairs = pid_ids * len(tid_values) + tid_ids
    distinct, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
    by_appearance = np.argsort(first, kind="stable")
    rank = np.empty(len(distinct), dtype=np.int64)
    rank[by_appearance] = np.arange(len(distinct))
    threads = [(pid_values[pair // len(tid_values)], tid_values[pair % len(tid_values)])
               for pair in distinct[by_appearance].tolist()]
    return threads, rank[inverse.reshape(-1)]


def _correlations(args: list) -> tuple[np.ndarray, np.ndarray]:
    """Each event's CUDA correlation id (a 64-bit int, signed or unsigned, as plan.py takes it from the generic
    reader, which reads a larger one as a float) and whether it has one. Flows join on equal ids only, so ids
    beyond int64 are numbered by first appearance instead."""
    found = [a.correlation if a is not None and type(a.correlation) is int and _CORRELATION_MIN <= a.correlation
             < _CORRELATION_END else None for a in args]
    has = np.fromiter((c is not None for c in found), dtype=bool, count=len(found))
    present = [c if c is not None else 0 for c in found]
    try:
        return np.array(present, dtype=np.int64), has
    except OverflowError:
        return _interned(present)[1], has


def _note_gpu_threads(table: SliceTable, args: list, grouped: GroupedEvents) -> None:
    """A thread holding device activity is a GPU stream, named by its first such event's args."""
    gpu_categories = np.array([c in GPU_CATEGORIES for c in table.categories], dtype=bool)
    on_gpu = gpu_categories[table.category_ids] if len(table.categories) else np.zeros(0, dtype=bool)
    if not on_gpu.any():
        return
    rows = np.flatnonzero(on_gpu)
    _, first = np.unique(table.thread_ids[rows], return_index=True)
    for position in np.sort(first).tolist():
        row = int(rows[position])
        thread = table.threads[table.thread_ids[row]]
        grouped.gpu_threads[thread] = _device_stream(args[row], thread)


def _device_stream(args: Any, thread: tuple) -> tuple[Any, Any]:
    if args is None:
        return thread
    device = thread[0] if args.device is UNSET else args.device
    stream = thread[1] if args.stream is UNSET else args.stream
    return device, stream


def _note_groups(table: SliceTable, args: list, grouped: GroupedEvents) -> None:
    """ident -> process group label of the events whose args name one (collectives: a few)."""
    for row, each in enumerate(args):
        if each is not None and each.group_name is not UNSET:
            group = process_group_label(each.group_name, each.group_description)
            if group is not None:
                grouped.group_of[int(table.idents[row])] = group

# --- slices on lanes ---------------------------------------------------------------------------

def _plan_slices(table: SliceTable, grouped: GroupedEvents, tracks: RankTracks, plan: WindowPlan) -> SliceOps:
    by_track = _rows_by_track(table, grouped)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for key, rows in by_track.items():
        if not len(rows):
            continue
        order, first_lane, lane_count = _lay_out(key, rows, table, tracks)
        uuids = np.array([tracks.uuid(key, first_lane + lane, plan.new_tracks) for lane in range(lane_count)],
                         dtype=np.uint64)
        parts.append((order[0], order[1], uuids[order[2]]))
        plan.slice_count += len(rows)
        plan.overlap_lane_count += lane_count - 1
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return SliceOps(rows=empty, begins=empty.astype(bool), uuids=empty.astype(np.uint64))
    return SliceOps(rows=np.concatenate([p[0] for p in parts]), begins=np.concatenate([p[1] for p in parts]),
                    uuids=np.concatenate([p[2] for p in parts]))


def _rows_by_track(table: SliceTable, grouped: GroupedEvents) -> dict[TrackKey, np.ndarray]:
    """Each track's slice rows sorted as lay_out_track sorts them: (start, longest first), then the order
    plan.py lists them in (thread by first appearance, then trace order)."""
    keys = [track_key(thread, grouped.gpu_threads) for thread in table.threads]
    track_of_key: dict[TrackKey, int] = {}
    track_ids = np.array([track_of_key.setdefault(key, len(track_of_key)) for key in keys], dtype=np.int64)
    row_track = track_ids[table.thread_ids]
    order = np.lexsort((np.arange(len(table.starts)), table.thread_ids, -table.ends, table.starts, row_track))
    bounds = np.searchsorted(row_track[order], np.arange(len(track_of_key) + 1))
    return {key: order[bounds[index]:bounds[index + 1]] for key, index in track_of_key.items()}


def _lay_out(key: TrackKey, rows: np.ndarray, table: SliceTable,
             tracks: RankTracks) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int, int]:
    """tracks.lay_out_track on columns: ((rows, begins, lane) in emission order, first lane, lane count)."""
    starts, ends = table.starts[rows], table.ends[rows]
    window_start, window_end = int(starts[0]), int(ends.max())
    first_lane = tracks.first_free_lane(key, window_start, window_end)
    codes, lanes, lane_count = track_codes(starts, ends)
    tracks.record_span(key, window_start, window_end, first_lane + lane_count - 1)
    begins = codes >= 0
    positions = np.where(begins, codes, ~codes)
    return (rows[positions], begins, lanes[positions]), first_lane, lane_count
