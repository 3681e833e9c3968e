"""What the merge adds on top of the recorded events (pure planning): per rank, a `fleetscope
analysis` track and counters.

The analysis track holds
  * one slice per training step: the steps the per-rank parse found (per_rank/steps.py);
  * idle gaps inside the steps, drawn when at least `min_idle_gap_us` long, named by their category:
      GPU traces (idle = no kernel, memcpy or memset on any stream of the rank):
        `idle: host launch`  the next GPU work was launched only after the GPU ran out of work;
        `idle: dependency`   the next GPU work was already launched: it waited on a sync, an event
                             or another stream;
        `idle: nothing queued` no GPU work until the step's end;
      CPU traces (idle = no `cpu_op` and no gloo collective in flight on any thread):
        `idle: no op running`;
  * straggler marks from the analysis report, when one is given: where this rank arrived last at a
    collective (and how late), and a summary with the report's verdict as debug annotations;
  * hot-expert marks from the report's MoE findings (moe_overlays.py).
Counters: `step time (ms)` and `idle (%)`, one sample at each step's start. A step's range runs to the
next step's start (the last one to its own end), so idle % covers the gaps between steps too. MoE runs
also get `tokens: expert <E>` counters, one per local expert (moe_overlays.py).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetscope.analysis.merge.tracks import (
    GROUP_ANALYSIS,
    GROUP_COUNTER,
    NO_EVENT,
    OP_COUNTER,
    OP_INSTANT,
    RankTracks,
    Slice,
    lay_out_track,
)
from fleetscope.analysis.merge.window import ReportView, StepRange
from fleetscope.analysis.per_rank.names import is_gloo_span

if TYPE_CHECKING:
    from fleetscope.analysis.merge.flows import FlowPlan
    from fleetscope.analysis.merge.perfetto.writer import TrackSpec
    from fleetscope.analysis.merge.window import GroupedEvents, WindowContext

ANALYSIS_TRACK_NAME = "fleetscope analysis"
ANALYSIS_TRACK = ("analysis", ANALYSIS_TRACK_NAME, "")
STEP_TIME_TRACK = ("counter", "fleetscope", "step time (ms)")
IDLE_TRACK = ("counter", "fleetscope", "idle (%)")
STEP_CATEGORY = "fleetscope.step"
IDLE_CATEGORY = "fleetscope.idle"
STRAGGLER_CATEGORY = "fleetscope.straggler"

IDLE_HOST_LAUNCH = "host launch"
IDLE_DEPENDENCY = "dependency"
IDLE_NOTHING_QUEUED = "nothing queued"
IDLE_NO_OP = "no op running"
_GPU_ACTIVITY_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_CPU_OP_CATEGORIES = ("cpu_op", "operator")




@dataclass(kw_only=True)
class OverlayInputs:
    steps: list[StepRange]
    """Host step ranges, by start: the per-rank parse's steps (per_rank/steps.py) on the merged clock."""

    def step_ranges(self) -> list[StepRange]:
        """Each step runs to the next one's start; the last one to its own end."""
        ranges = []
        for index, (step, start, end) in enumerate(self.steps):
            following = self.steps[index + 1][1] if index + 1 < len(self.steps) else end
            ranges.append((step, start, following if following > start else end))
        return ranges

    def keep_steps(self, spans: list[tuple[int, int]]) -> None:
        self.steps = [s for s in self.steps if any(s[1] < e and s[2] > b for b, e in spans)]


@dataclass(kw_only=True)
class OverlayPlan:
    operations: list[tuple] = field(default_factory=list)
    slice_count: int = 0
    instant_count: int = 0
    counter_sample_count: int = 0
    step_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, start ns, end ns) on the merged clock, as drawn on the analysis track."""


def plan_overlays(grouped: "GroupedEvents", inputs: OverlayInputs, flows: "FlowPlan", tracks: RankTracks,
                  context: "WindowContext", new_tracks: list["TrackSpec"]) -> OverlayPlan:
    plan = OverlayPlan()
    ranges = inputs.step_ranges()
    plan.step_ranges = list(ranges)
    basis, busy = _busy_union(grouped)
    slices: list[Slice] = []
    step_samples, idle_samples = [], []
    for step, start, end in ranges:
        gaps = idle_gaps(busy, start, end)
        idle_pct = 100.0 * sum(b - a for a, b, _ in gaps) / (end - start) if end > start else 0.0
        slices.append((start, end, f"step {step}", STEP_CATEGORY, NO_EVENT, {
            "step": step, "step_time_ms": (end - start) / 1e6, "idle_pct": round(idle_pct, 2), "idle_basis": basis}))
        slices += _gap_slices(gaps, basis, grouped, flows, context.options.min_idle_gap_us)
        step_samples.append((start, (end - start) / 1e6))
        idle_samples.append((start, idle_pct))
    instants = _report_marks(context.report, flows, ranges, grouped)
    if context.moe is not None:
        instants += context.moe.marks(ranges[0][1] if ranges else grouped.first_ts_ns())
    if not slices and not instants:
        return plan
    tracks.register(ANALYSIS_TRACK, ANALYSIS_TRACK_NAME, GROUP_ANALYSIS)
    if slices:
        lay_out_track(ANALYSIS_TRACK, slices, tracks, plan.operations, new_tracks)
        plan.slice_count = len(slices)
    if instants:
        uuid = tracks.uuid(ANALYSIS_TRACK, 0, new_tracks)
        plan.operations += [(ts, OP_INSTANT, uuid, name, STRAGGLER_CATEGORY, NO_EVENT, notes) for ts, name, notes in instants]
        plan.instant_count = len(instants)
    _add_counter(STEP_TIME_TRACK, "ms", step_samples, tracks, plan, new_tracks)
    _add_counter(IDLE_TRACK, "%", idle_samples, tracks, plan, new_tracks)
    for key, unit, samples in context.moe.counters(ranges) if context.moe is not None else ():
        _add_counter(key, unit, samples, tracks, plan, new_tracks)
    return plan


def _add_counter(key: tuple, unit: str, samples: list[tuple[int, float]], tracks: RankTracks,
                 plan: OverlayPlan, new_tracks: list["TrackSpec"]) -> None:
    if not samples:
        return
    tracks.register(key, key[2], GROUP_COUNTER)
    uuid = tracks.uuid(key, 0, new_tracks, counter_unit=unit)
    plan.operations += [(ts, OP_COUNTER, uuid, value) for ts, value in samples]
    plan.counter_sample_count += len(samples)


# --- idle gaps --------------------------------------------------------------------------------

def _busy_union(grouped: "GroupedEvents") -> tuple[str, list[tuple[int, int, int]]]:
    """("gpu" | "cpu", union of busy intervals as (start, end, ident of the event that opened it))."""
    gpu = [(s[0], s[1], s[4]) for thread, slices in grouped.slices.items() if grouped.is_gpu(thread)
           for s in slices if s[3] in _GPU_ACTIVITY_CATEGORIES]
    if gpu:
        return "gpu", merge_intervals(gpu)
    cpu = [(s[0], s[1], s[4]) for thread, slices in grouped.slices.items() if not grouped.is_gpu(thread)
           for s in slices if s[3] in _CPU_OP_CATEGORIES or is_gloo_span(s[2])]
    return "cpu", merge_intervals(cpu)


def merge_intervals(intervals: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Union of (start, end, ident) intervals; each union interval keeps the ident of its first member."""
    merged: list[tuple[int, int, int]] = []
    for start, end, ident in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end, merged[-1][2])
        else:
            merged.append((start, end, ident))
    return merged


def idle_gaps(busy: list[tuple[int, int, int]], start: int, end: int) -> list[tuple[int, int, int]]:
    """Gaps of [start, end) not covered by `busy`, as (gap_start, gap_end, ident of the work after the
    gap or NO_EVENT when nothing starts before `end`)."""
    gaps = []
    cursor = start
    index = max(bisect_left(busy, (start,)) - 1, 0)
    while index < len(busy) and busy[index][0] < end:
        busy_start, busy_end, ident = busy[index]
        if busy_start > cursor:
            gaps.append((cursor, busy_start, ident))
        cursor = max(cursor, busy_end)
        index += 1
    if cursor < end:
        gaps.append((cursor, end, NO_EVENT))
    return gaps


def _gap_slices(gaps: list[tuple[int, int, int]], basis: str, grouped: "GroupedEvents", flows: "FlowPlan",
                min_gap_us: float) -> list[Slice]:
    drawn = []
    for gap_start, gap_end, next_ident in gaps:
        if gap_end - gap_start < min_gap_us * 1000:
            continue
        category = gap_category(basis, gap_start, next_ident, grouped, flows)
        drawn.append((gap_start, gap_end, f"idle: {category}", IDLE_CATEGORY, NO_EVENT,
                      {"idle_us": (gap_end - gap_start) / 1000}))
    return drawn


def gap_category(basis: str, gap_start: int, next_ident: int, grouped: "GroupedEvents", flows: "FlowPlan") -> str:
    if basis == "cpu":
        return IDLE_NO_OP
    if next_ident == NO_EVENT:
        return IDLE_NOTHING_QUEUED
    launch_end = flows.launch_end_by_correlation.get(grouped.correlation_of.get(next_ident))
    if launch_end is None or launch_end > gap_start:
        return IDLE_HOST_LAUNCH
    return IDLE_DEPENDENCY


# --- marks from the analysis report -----------------------------------------------------------

def _report_marks(report: ReportView | None, flows: "FlowPlan", ranges: list[StepRange],
                  grouped: "GroupedEvents") -> list[tuple[int, str, dict]]:
    """(ts_ns, name, annotations) instants for the analysis track."""
    if report is None:
        return []
    anchor = ranges[0][1] if ranges else grouped.first_ts_ns()
    if anchor is None:
        return []
    marks = []
    if report.rank_summary is not None:
        marks.append((anchor, "rank summary", _summary_notes(report)))
    if report.waited_for or report.slowest:
        what = "the others wait for this rank" if report.waited_for else "slowest steps"
        marks.append((anchor, f"straggler: {what}", {"verdict": report.window_verdict, **(report.wait or {})}))
    for instance in report.late_instances:
        key = (instance.get("step"), instance.get("name"), instance.get("ordinal"))
        hit = flows.collectives.get(key)
        if hit is not None:
            marks.append((hit.start_ns, f"arrived last: {key[1]} (step {key[0]} #{key[2]})", dict(instance)))
    return marks


def _summary_notes(report: ReportView) -> dict[str, Any]:
    summary = dict(report.rank_summary or {})
    step_time = summary.pop("step_time", None)
    if isinstance(step_time, dict):
        summary["mean_step_ms"] = step_time.get("mean_ms")
    summary["verdict"] = report.report_verdict
    return {k: v for k, v in summary.items() if v is not None}
