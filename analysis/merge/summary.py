"""A compact summary of every rank in the merged trace (planning is pure; `write_rank_summary` writes).

A default merge draws only a focus set in full (focus.py); so that no rank disappears, every rank also
gets a few small tracks, made from its per-rank parse (the RankResult the parsed-trace cache holds; its
trace is never read again), in ONE process named `SUMMARY_PROCESS_NAME`, listed first, with a group track
per rank (`rank R (host)`, its description saying whether the rank is drawn in full and where):

  `rank R: steps`                one slice per window (`window W`: busy/idle/comm % of the window, event
                                 count), the rank's steps nested in it (`step N`: step time, comm %), each
                                 over the span the report times it by (WindowModel.step_spans);
  `rank R: collective arrivals`  an instant where the rank reached each collective (its start, the
                                 collective's name as the report matches it), at most
                                 MAX_ARRIVALS_PER_WINDOW per window, the first ones in time;
  `rank R: step time (ms)`, `rank R: comm (%)`   counters, a sample at each step's start; comm % is the
                                 union of the rank's collective times inside the step over its length;
  `rank R: busy (%)`, `rank R: idle (%)`         counters, a sample at each window's start: the window's
                                 utilization (per_rank/utilization.py; per step it is not recorded).
Times are on the merged clock (the same offsets as the ranks drawn in full), so the summary of a rank
lines up with the full tracks of the others. Memory is one rank's summary at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from fleetscope.analysis.merge.perfetto.writer import SequenceWriter, TrackSpec
from fleetscope.analysis.merge.sources import WindowModel
from fleetscope.analysis.merge.tracks import (
    NO_EVENT,
    OP_BEGIN,
    OP_COUNTER,
    OP_END,
    OP_INSTANT,
    PROCESS_PID_BASE,
    nest_into_lanes,
)
from fleetscope.analysis.merge.window import WindowClock

SUMMARY_PROCESS_NAME = "fleetscope summary (every rank)"
SUMMARY_PID = PROCESS_PID_BASE - 1
SUMMARY_PROCESS_UUID = 1 << 62
SUMMARY_SEQUENCE_ID = 1 << 30
"""One packet sequence for the whole summary (rank sequences are 2 + rank)."""
WINDOW_CATEGORY = "fleetscope.summary.window"
STEP_CATEGORY = "fleetscope.summary.step"
ARRIVAL_CATEGORY = "fleetscope.summary.arrival"
MAX_ARRIVALS_PER_WINDOW = 512
STEPS_TRACK_SUFFIX = ": steps"

_GROUP, _STEPS, _ARRIVALS, _STEP_TIME, _COMM, _BUSY, _IDLE = range(7)
_FIRST_OVERLAP_LANE_ID = 16
_IDS_PER_RANK_SHIFT = 8
_COUNTERS = ((_STEP_TIME, "step time (ms)", "ms"), (_COMM, "comm (%)", "%"), (_BUSY, "busy (%)", "%"),
             (_IDLE, "idle (%)", "%"))


@dataclass(frozen=True, kw_only=True, slots=True)
class SummaryWindow:
    """One trace file of a rank, as the summary draws it."""

    window: int
    clock: WindowClock
    model: WindowModel


@dataclass(kw_only=True)
class RankSummaryPlan:
    rank: int
    tracks: list[TrackSpec] = field(default_factory=list)
    operations: list[tuple] = field(default_factory=list)
    """Time-sorted, in tracks.py's operation format."""
    slice_count: int = 0
    instant_count: int = 0
    counter_sample_count: int = 0
    arrivals_left_out: int = 0
    first_ns: int | None = None
    last_ns: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSummaryCount:
    """What the summary holds for one rank (what verify.py expects to find)."""

    rank: int
    slice_count: int
    instant_count: int
    counter_sample_count: int
    arrivals_left_out: int
    first_ns: int | None
    last_ns: int | None
    in_full: bool


def summary_process() -> TrackSpec:
    return TrackSpec(uuid=SUMMARY_PROCESS_UUID, name=SUMMARY_PROCESS_NAME, pid=SUMMARY_PID, order=-1,
                     description="a compact summary of every rank, drawn in full or not")


def steps_track_name(rank: int) -> str:
    return f"rank {rank}{STEPS_TRACK_SUFFIX}"


def plan_rank_summary(rank: int, host: str, windows: Iterable[SummaryWindow], *, note: str,
                      steps: frozenset[int] | None = None) -> RankSummaryPlan:
    """The summary tracks of one rank; `note` goes into its group's description; `steps` keeps only
    those steps (MergeOptions.steps)."""
    plan = RankSummaryPlan(rank=rank)
    group = _uuid(rank, _GROUP)
    plan.tracks.append(TrackSpec(uuid=group, name=f"rank {rank} ({host})", parent_uuid=SUMMARY_PROCESS_UUID,
                                 order=rank, description=note))
    slices: list[tuple] = []
    samples: dict[int, list[tuple[int, float]]] = {kind: [] for kind, _, _ in _COUNTERS}
    arrivals: list[tuple[int, str]] = []
    for window in windows:
        slices += _window_slices(window, steps, samples)
        arrivals += _arrivals(window, steps, plan)
    _plan_steps_track(rank, group, slices, plan)
    _plan_arrivals(rank, group, arrivals, plan)
    _plan_counters(rank, group, samples, plan)
    plan.operations.sort(key=lambda operation: operation[0])
    if plan.operations:
        plan.first_ns, plan.last_ns = plan.operations[0][0], plan.operations[-1][0]
    return plan


def write_rank_summary(writer: SequenceWriter, plan: RankSummaryPlan) -> None:
    for spec in plan.tracks:
        writer.track(spec)
    for operation in plan.operations:
        kind = operation[1]
        if kind == OP_BEGIN:
            writer.slice_begin(operation[0], operation[2], operation[3], operation[4], annotations=operation[7])
        elif kind == OP_END:
            writer.slice_end(operation[0], operation[2])
        elif kind == OP_INSTANT:
            writer.instant(operation[0], operation[2], operation[3], operation[4])
        elif kind == OP_COUNTER:
            writer.counter(operation[0], operation[2], operation[3])


def estimated_summary_bytes(models: Iterable[WindowModel]) -> int:
    """About what one rank's summary takes in the file (descriptors, a slice per window and step,
    counters, arrival marks); measured on GPU and CPU traces, rounded up."""
    total = 800
    for model in models:
        total += 300 + 220 * len(model.steps) + 30 * min(len(model.collectives), MAX_ARRIVALS_PER_WINDOW)
    return total


def _uuid(rank: int, kind: int) -> int:
    return SUMMARY_PROCESS_UUID | ((rank + 1) << _IDS_PER_RANK_SHIFT) | kind


def _window_slices(window: SummaryWindow, steps: frozenset[int] | None,
                   samples: dict[int, list[tuple[int, float]]]) -> list[tuple]:
    model, clock = window.model, window.clock
    kept = [s for s in model.step_spans or model.steps if steps is None or s[0] in steps]   # the report's spans
    intervals = sorted(zip((start for start, _ in model.collectives), model.collective_ends_us))
    slices = []
    for step, start_us, end_us in kept:
        comm_pct = 100.0 * _covered_us(intervals, start_us, end_us) / (end_us - start_us) if end_us > start_us else 0.0
        start_ns, end_ns = clock.to_ns(start_us), clock.to_ns(end_us)
        slices.append((start_ns, end_ns, f"step {step}", STEP_CATEGORY, NO_EVENT,
                       {"step": step, "step_time_ms": round((end_us - start_us) / 1000.0, 3),
                        "comm_pct": round(comm_pct, 2)}))
        samples[_STEP_TIME].append((start_ns, (end_us - start_us) / 1000.0))
        samples[_COMM].append((start_ns, comm_pct))
    bounds = _window_bounds(model, kept)
    if bounds is None:
        return slices
    start_ns, end_ns = clock.to_ns(bounds[0]), clock.to_ns(bounds[1])
    notes: dict = {"window": window.window, "events": model.event_count, "steps": len(kept)}
    if model.utilization is not None:
        busy, idle, comm = model.utilization
        notes.update(busy_pct=round(busy, 2), idle_pct=round(idle, 2), comm_pct=round(comm, 2))
        samples[_BUSY].append((start_ns, busy))
        samples[_IDLE].append((start_ns, idle))
    slices.append((start_ns, end_ns, f"window {window.window}", WINDOW_CATEGORY, NO_EVENT, notes))
    return slices


def _window_bounds(model: WindowModel, kept: list[tuple[int, float, float]]) -> tuple[float, float] | None:
    """The trace's events' span, stretched over the kept steps (a slice must hold its steps)."""
    spans = [(s[1], s[2]) for s in kept] + ([model.bounds_us] if model.bounds_us is not None else [])
    if not spans:
        return None
    return min(s[0] for s in spans), max(s[1] for s in spans)


def _covered_us(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `intervals` (sorted by start) inside [start, end]."""
    covered, reach = 0.0, start
    for first, last in intervals:
        if first >= end:
            break
        first, last = max(first, reach), min(last, end)
        if last > first:
            covered += last - first
            reach = last
    return covered


def _arrivals(window: SummaryWindow, steps: frozenset[int] | None, plan: RankSummaryPlan) -> list[tuple[int, str]]:
    calls = sorted((start, key) for start, key in window.model.collectives if steps is None or key[0] in steps)
    plan.arrivals_left_out += max(0, len(calls) - MAX_ARRIVALS_PER_WINDOW)
    return [(window.clock.to_ns(start), key[1]) for start, key in calls[:MAX_ARRIVALS_PER_WINDOW]]


def _plan_steps_track(rank: int, group: int, slices: list[tuple], plan: RankSummaryPlan) -> None:
    if not slices:
        return
    slices.sort(key=lambda s: (s[0], -s[1]))

    def lane_id(lane: int) -> int:
        uuid = _uuid(rank, _STEPS if lane == 0 else min(_FIRST_OVERLAP_LANE_ID + lane, 255))
        name = steps_track_name(rank) + (f" [overlap {lane}]" if lane else "")
        plan.tracks.append(TrackSpec(uuid=uuid, name=name, parent_uuid=group, order=lane))
        return uuid

    nest_into_lanes(slices, plan.operations, lane_id=lane_id)
    plan.slice_count += len(slices)


def _plan_arrivals(rank: int, group: int, arrivals: list[tuple[int, str]], plan: RankSummaryPlan) -> None:
    if not arrivals:
        return
    uuid = _uuid(rank, _ARRIVALS)
    plan.tracks.append(TrackSpec(uuid=uuid, name=f"rank {rank}: collective arrivals", parent_uuid=group, order=100))
    plan.operations += [(ts, OP_INSTANT, uuid, name, ARRIVAL_CATEGORY, NO_EVENT, None) for ts, name in arrivals]
    plan.instant_count += len(arrivals)


def _plan_counters(rank: int, group: int, samples: dict[int, list[tuple[int, float]]], plan: RankSummaryPlan) -> None:
    for order, (kind, label, unit) in enumerate(_COUNTERS):
        if not samples[kind]:
            continue
        uuid = _uuid(rank, kind)
        plan.tracks.append(TrackSpec(uuid=uuid, name=f"rank {rank}: {label}", parent_uuid=group, order=200 + order,
                                     is_counter=True, counter_unit=unit))
        plan.operations += [(ts, OP_COUNTER, uuid, value) for ts, value in samples[kind]]
        plan.counter_sample_count += len(samples[kind])
