"""What the merge adds on top of the recorded events (pure planning): per rank, a `fleetscope
analysis` track and counters.

The analysis track holds
  * one slice per training step, `step N`, over the span the report times it by (per_rank/steps.py
    StepTiming.span_start_us / span_end_us: the host's `ProfilerStep`/`train_step` range, or the GPU's span
    where the GPU bounds the step), so its length is the report's step_time_ms;
  * one slice for the time between two steps of a window (`between steps`, or `between steps: <names>`
    naming the collectives that run there, such as a trainer's stop-flag all-reduce outside
    `ProfilerStep`): in no step time of the report, and not idle;
  * idle gaps inside the steps, named `idle: <cause>`: the gaps and causes of the per-rank analysis
    (host_stalls.find_idle_gaps, the one rule for both the report and this track), every one by default
    (`min_idle_gap_us` 0), so a rank's idle slices sum to the report's idle_by_cause_us: GPU traces (no
    kernel, memcpy or memset on any stream) `input wait`, `host collective`, `host sync`, `short gaps`,
    `device dependency`, `host busy elsewhere`; CPU traces (no `cpu_op` and no collective in flight on any
    thread) `no op running`;
  * straggler marks from the analysis report, when one is given: where this rank arrived last at a
    collective (and how late), and a summary with the report's verdict as debug annotations;
  * hot-expert marks from the report's MoE findings (moe_overlays.py);
  * host-stall marks and per-step evidence counters from the report (evidence_overlays.py).
A `critical path` track holds the report's critical-path segments on this rank (critical_path_overlays.py); the
report's replay of those steps without stragglers is a process of its own (ideal_overlays.py).
Counters: `step time (ms)` and `idle (%)`, one sample at each step's start: the step's span as drawn (the
report's step time), and the analysis's idle gaps inside it in percent of it. MoE runs also get
`tokens: expert <E>` counters, one per local expert (moe_overlays.py).

The filters (MergeOptions.steps, plan.kept_spans) keep their own step ranges (a host step to the next one's
start, OverlayInputs.step_ranges): they choose events, not how a step is timed.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from fleetscope.analysis.merge.critical_path_overlays import plan_path_track
from fleetscope.analysis.merge.evidence_overlays import EVIDENCE_CATEGORY, sync_marks
from fleetscope.analysis.merge.tracks import (
    FIRST_MADE_UP_IDENT,
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
BETWEEN_CATEGORY = "fleetscope.between_steps"
BETWEEN_STEPS = "between steps"
BETWEEN_NAMES_SHOWN = 3
"""Collective names a `between steps` slice's name lists (all of them are in its annotations)."""
STRAGGLER_CATEGORY = "fleetscope.straggler"




@dataclass(kw_only=True)
class OverlayInputs:
    steps: list[StepRange]
    """Host step ranges, by start: the per-rank parse's steps (per_rank/steps.py) on the merged clock."""

    def step_ranges(self) -> list[StepRange]:
        """The filters' step ranges (MergeOptions.steps: which events a step keeps): each step runs to the
        next one's start; the last one to its own end. Not a step's time: drawn_spans is."""
        ranges = []
        for index, (step, start, end) in enumerate(self.steps):
            following = self.steps[index + 1][1] if index + 1 < len(self.steps) else end
            ranges.append((step, start, following if following > start else end))
        return ranges

    def keep_steps(self, spans: list[tuple[int, int]]) -> None:
        self.steps = [s for s in self.steps if any(s[1] < e and s[2] > b for b, e in spans)]

    def drawn_spans(self, context: "WindowContext") -> list[StepRange]:
        """The kept steps (those `keep_steps` left), each over the span the report times it by
        (WindowContext.step_spans; the host range where the context has no spans), by start."""
        kept = {step for step, _, _ in self.steps}
        spans = context.step_spans or tuple(self.steps)
        return sorted((s for s in spans if s[0] in kept), key=lambda s: (s[1], s[2], s[0]))


@dataclass(kw_only=True)
class OverlayPlan:
    operations: list[tuple] = field(default_factory=list)
    slice_count: int = 0
    instant_count: int = 0
    counter_sample_count: int = 0
    step_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, start ns, end ns) on the merged clock, as drawn on the analysis track (the report's span)."""


def plan_overlays(grouped: "GroupedEvents", inputs: OverlayInputs, flows: "FlowPlan", tracks: RankTracks,
                  context: "WindowContext", new_tracks: list["TrackSpec"]) -> OverlayPlan:
    plan = OverlayPlan()
    ranges = inputs.drawn_spans(context)
    plan.step_ranges = list(ranges)
    slices, step_samples, idle_samples = _step_slices(ranges, context)
    report = context.report
    evidence = report.evidence if report is not None else None
    instants = _instants(grouped, inputs, flows, ranges, context)
    if slices or instants:
        tracks.register(ANALYSIS_TRACK, ANALYSIS_TRACK_NAME, GROUP_ANALYSIS)
    if slices:
        lay_out_track(ANALYSIS_TRACK, slices, tracks, plan.operations, new_tracks)
        plan.slice_count += len(slices)
    if instants:
        uuid = tracks.uuid(ANALYSIS_TRACK, 0, new_tracks)
        plan.operations += [(ts, OP_INSTANT, uuid, name, category, NO_EVENT, notes)
                            for ts, name, notes, category in instants]
        plan.instant_count = len(instants)
    path_slices, _ = plan_path_track(report.critical_path if report is not None else None, context.clock.offset_ns,
                                     tracks, plan.operations, new_tracks, flows, FIRST_MADE_UP_IDENT)
    plan.slice_count += path_slices
    if not slices and not instants:
        return plan
    _add_counter(STEP_TIME_TRACK, "ms", step_samples, tracks, plan, new_tracks)
    _add_counter(IDLE_TRACK, "%", idle_samples, tracks, plan, new_tracks)
    for key, unit, samples in context.moe.counters(ranges) if context.moe is not None else ():
        _add_counter(key, unit, samples, tracks, plan, new_tracks)
    for key, unit, samples in evidence.counter_samples(ranges) if evidence is not None else ():
        _add_counter(key, unit, samples, tracks, plan, new_tracks)
    return plan


def _step_slices(ranges: list[StepRange], context: "WindowContext") -> tuple[list[Slice], list, list]:
    """The steps (the report's spans), the time between them, their idle gaps (the analysis's, each drawn
    once where spans overlap), and the step-time and idle-% samples."""
    gaps = sorted(context.idle_gaps)
    basis = context.idle_basis
    slices: list[Slice] = []
    step_samples, idle_samples = [], []
    for step, start, end in ranges:
        idle_ns = sum(b - a for a, b, _ in gaps_within(gaps, start, end))
        idle_pct = 100.0 * idle_ns / (end - start) if end > start else 0.0
        slices.append((start, end, f"step {step}", STEP_CATEGORY, NO_EVENT, {
            "window": context.window_key, "step": step, "step_time_ms": (end - start) / 1e6,
            "idle_ms": idle_ns / 1e6, "idle_pct": round(idle_pct, 2), "idle_basis": basis}))
        step_samples.append((start, (end - start) / 1e6))
        if basis is not None:
            idle_samples.append((start, idle_pct))
    for start, end in _union([(start, end) for _, start, end in ranges]):
        slices += _gap_slices(gaps_within(gaps, start, end), context.options.min_idle_gap_us)
    slices += between_step_slices(ranges, context)
    return slices, step_samples, idle_samples


def between_step_slices(ranges: list[StepRange], context: "WindowContext") -> list[Slice]:
    """A slice from each drawn step's end to the next one's start (none where they touch or overlap), named
    by the collectives that run there (the per-rank parse's, NO_STEP ones included)."""
    calls = sorted((start, end, key[1]) for (start, key), end in zip(context.collectives, context.collective_ends_ns))
    order = {step: position for position, (step, _, _) in enumerate(sorted(context.step_spans or ranges,
                                                                            key=lambda s: (s[1], s[2], s[0])))}
    slices: list[Slice] = []
    for (step, _, end), (following, start, _) in zip(ranges, ranges[1:]):
        if start <= end or order.get(following) != order.get(step, -2) + 1:   # touching, or a step left out
            continue
        inside = [(max(a, end), min(b, start), name) for a, b, name in calls if a < start and b > end]
        names = list(dict.fromkeys(name for _, _, name in inside))
        shown = ", ".join(names[:BETWEEN_NAMES_SHOWN]) + (f" +{len(names) - BETWEEN_NAMES_SHOWN} more"
                                                          if len(names) > BETWEEN_NAMES_SHOWN else "")
        covered = sum(b - a for a, b in _union([(a, b) for a, b, _ in inside]))
        slices.append((end, start, f"{BETWEEN_STEPS}: {shown}" if names else BETWEEN_STEPS, BETWEEN_CATEGORY,
                       NO_EVENT, {"window": context.window_key, "after_step": step, "before_step": following,
                                  "between_ms": (start - end) / 1e6, "collectives": ", ".join(names),
                                  "collective_count": len(inside), "collective_ms": covered / 1e6}))
    return slices


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of [start, end) spans, as sorted disjoint spans."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _instants(grouped: "GroupedEvents", inputs: OverlayInputs, flows: "FlowPlan", ranges: list[StepRange],
              context: "WindowContext") -> list[tuple[int, str, dict, str]]:
    """(ts_ns, name, annotations, category) of every mark on the analysis track."""
    report = context.report
    marks = [(ts, name, notes, STRAGGLER_CATEGORY) for ts, name, notes in _report_marks(report, flows, ranges, grouped)]
    if context.moe is not None:
        marks += [(ts, name, notes, STRAGGLER_CATEGORY)
                  for ts, name, notes in context.moe.marks(ranges[0][1] if ranges else grouped.first_ts_ns())]
    evidence = report.evidence if report is not None else None
    found = evidence.stall_marks(ranges) + evidence.collective_marks(flows.collectives) if evidence is not None else []
    return marks + [(ts, name, notes, EVIDENCE_CATEGORY) for ts, name, notes in found + sync_marks(grouped, inputs.steps)]


def _add_counter(key: tuple, unit: str, samples: list[tuple[int, float]], tracks: RankTracks,
                 plan: OverlayPlan, new_tracks: list["TrackSpec"]) -> None:
    if not samples:
        return
    tracks.register(key, key[2], GROUP_COUNTER)
    uuid = tracks.uuid(key, 0, new_tracks, counter_unit=unit)
    plan.operations += [(ts, OP_COUNTER, uuid, value) for ts, value in samples]
    plan.counter_sample_count += len(samples)


# --- idle gaps (the per-rank analysis's, host_stalls.find_idle_gaps) ---------------------------

def gaps_within(gaps: list[tuple[int, int, str]], start: int, end: int) -> list[tuple[int, int, str]]:
    """The sorted `gaps` clipped to [start, end)."""
    index = max(bisect_left(gaps, (start,)) - 1, 0)
    stop = bisect_right(gaps, (end,))
    inside = []
    for gap_start, gap_end, cause in gaps[index:stop]:
        clipped = (max(gap_start, start), min(gap_end, end))
        if clipped[1] > clipped[0]:
            inside.append((clipped[0], clipped[1], cause))
    return inside


def _gap_slices(gaps: list[tuple[int, int, str]], min_gap_us: float) -> list[Slice]:
    return [(gap_start, gap_end, f"idle: {cause}", IDLE_CATEGORY, NO_EVENT, {"idle_us": (gap_end - gap_start) / 1000})
            for gap_start, gap_end, cause in gaps if gap_end - gap_start >= min_gap_us * 1000]


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
        wait = asdict(report.wait) if report.wait is not None else {}
        marks.append((anchor, f"straggler: {what}", {"verdict": report.window_verdict, **wait}))
    for instance in report.late_instances:
        key = (instance.step, instance.name, instance.ordinal)
        hit = flows.collectives.get(key)
        if hit is not None:
            marks.append((hit.start_ns, f"arrived last: {key[1]} (step {key[0]} #{key[2]})", asdict(instance)))
    return marks


def _summary_notes(report: ReportView) -> dict[str, Any]:
    """The `rank summary` mark's annotations: the report's figures of the rank (its mean step time in place
    of its step-time statistics) and verdict."""
    rank = report.rank_summary
    summary = {item.name: getattr(rank, item.name) for item in fields(rank) if item.name != "step_time"} \
        if rank is not None else {}
    if rank is not None and rank.step_time is not None:
        summary["mean_step_ms"] = rank.step_time.mean_ms
    summary["verdict"] = report.report_verdict
    return {k: v for k, v in summary.items() if v is not None}
