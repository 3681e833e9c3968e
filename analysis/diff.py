"""`fleetscope diff A B`: where a step's time moved between two runs, trace directories or trace files.

Each side's profiled steps are partitioned the way the report partitions them (analysis/quantities.py, the
per-rank step spans of per_rank/steps.py): inside each step's span the GPU is busy or idle, and the busy time is the
GPU activities' time less the time they overlap one another. So, per step (the mean over every rank's profiled
steps), `span = sum of the activities' time - overlap + idle`, and between A and B the span's change is exactly the
sum of each activity's change, less the overlap's change, plus the idle's change. Activities are keyed by kernel (or
copy, or fill) name and launch shape (grid and block), so a kernel that moved to other grids shows as one that
vanished and one that is new.

The step time the report prints (the slowest rank's per step, median over steps) changes by its own amount; what
the partition does not account for of that change (the slowest rank is not the mean one) is shown as unexplained.
Analysis only: returns data, prints nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fleetscope.analysis.inputs.resolve import resolve_input
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import Intervals, covered_us, union
from fleetscope.analysis.per_rank.rank import read_decoded
from fleetscope.analysis.per_rank.step_work import INPUTS_MARK
from fleetscope.analysis.per_rank.steps import find_steps, in_host_ranges
from fleetscope.traces.kineto import TraceReadError, read_raw

KIND_ACTIVITY, KIND_IDLE, KIND_OVERLAP = "GPU activity", "GPU idle", "overlap"
KIND_HOST_CALL = "host call"
"""A CUDA runtime or driver call of the host (launches, syncs, copies, cudaMalloc / cudaFree) inside the host's
steps: the host side of a change (an allocator that gave memory back, a per-parameter optimizer's launches), shown
beside the partition, never in it (the host's calls overlap the GPU's work)."""
"""What a DiffItem is: a kernel, copy or fill; the GPU idle inside the steps; the time activities overlap (it counts
against the step: busy = activities - overlap)."""
LISTED = 25
"""Items kept, largest change first (the rest are summed into one "other activities" item)."""


@dataclass(frozen=True, kw_only=True)
class DiffItem:
    kind: str
    name: str
    shape: str = ""
    a_ms: float
    """Per step (mean over every rank's profiled steps) in A; for KIND_OVERLAP, the overlap itself."""
    b_ms: float
    a_count: float = 0.0
    """Calls per step."""
    b_count: float = 0.0

    @property
    def change_ms(self) -> float:
        """This item's contribution to the change of the step: the overlap's counts against it."""
        sign = -1.0 if self.kind == KIND_OVERLAP else 1.0
        return sign * (self.b_ms - self.a_ms)

    @property
    def status(self) -> str:
        if self.kind not in (KIND_ACTIVITY, KIND_HOST_CALL):
            return ""
        return "new" if self.a_count == 0 else "vanished" if self.b_count == 0 else ""


@dataclass(frozen=True, kw_only=True)
class Side:
    label: str
    ranks: int
    steps: int
    """Profiled steps, over all ranks."""
    span_ms: float
    """Mean step span (per rank and profiled step): what the items partition."""
    report_step_ms: float | None
    """The step time as the report defines it (slowest rank per step, median over steps), None without steps."""
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class TraceDiff:
    a: Side
    b: Side
    items: list[DiffItem]
    """Largest |change| first: GPU activities, the GPU idle and the overlap, then "other activities" (the rest)."""
    host_calls: list[DiffItem] = field(default_factory=list)
    """KIND_HOST_CALL items, largest |change| first (not part of the partition)."""

    @property
    def span_change_ms(self) -> float:
        return self.b.span_ms - self.a.span_ms

    @property
    def report_change_ms(self) -> float | None:
        if self.a.report_step_ms is None or self.b.report_step_ms is None:
            return None
        return self.b.report_step_ms - self.a.report_step_ms

    @property
    def unexplained_ms(self) -> float | None:
        """The report's step change less what the items sum to (the slowest rank is not the mean one)."""
        change = self.report_change_ms
        return None if change is None else change - sum(item.change_ms for item in self.items)


@dataclass
class _Totals:
    """One side's sums over every rank's profiled steps, in us."""

    activity_us: dict[tuple[str, str], float] = field(default_factory=dict)
    host_us: dict[str, float] = field(default_factory=dict)
    host_count: dict[str, int] = field(default_factory=dict)
    activity_count: dict[tuple[str, str], int] = field(default_factory=dict)
    idle_us: float = 0.0
    overlap_us: float = 0.0
    span_us: float = 0.0
    steps: int = 0
    ranks: int = 0
    problems: list[str] = field(default_factory=list)


def diff(a: str | Path, b: str | Path) -> TraceDiff:
    """The step partition of A and of B and each item's change (module docstring). Raises FileNotFoundError /
    ValueError for a side that holds no trace; traces that cannot be read are named in the side's problems."""
    totals = [_side_totals(Path(path)) for path in (a, b)]
    sides = [_side(str(path), t, _report_step_ms(Path(path))) for path, t in zip((a, b), totals)]
    return TraceDiff(a=sides[0], b=sides[1], items=_items(*totals), host_calls=_host_items(*totals))


def _report_step_ms(path: Path) -> float | None:
    """The step time exactly as the report defines and prints it (quantities.py: the trace's, slowest rank per
    step, median), from the same analysis `analyze` runs (its parsed-trace cache makes it cheap)."""
    from fleetscope.analysis.analyze import analyze

    report = analyze(path, write_default_outputs=False, use_hta=False)
    return report.step_time.median_ms if report.step_time is not None else None


def _side_totals(path: Path) -> _Totals:
    inputs = resolve_input(path)
    totals = _Totals(problems=[f"{f.label}: {f.reason}" for f in inputs.failures])
    for source in inputs.sources:
        try:
            decoded = read_decoded(source.path, read_raw(source.path, within=source.within))
        except TraceReadError as error:
            totals.problems.append(f"{source.label}: {error.reason}")
            continue
        _add_rank(totals, decoded.events)
    return totals


def _add_rank(totals: _Totals, events: TraceEvents) -> None:
    steps, _ = find_steps(events)
    if not steps or not events.has_gpu_activity:
        return
    totals.ranks += 1
    gpu = np.flatnonzero(events.of_kind(*GPU_ACTIVITY_KINDS))
    starts, ends = events.start_us[gpu], events.end_us[gpu]
    keys = _activity_keys(events, gpu)
    calls = events.of_kind(Kind.CUDA_RUNTIME) & in_host_ranges(events.start_us, steps)
    for row in np.flatnonzero(calls).tolist():
        name = events.names[events.name_id[row]]
        totals.host_us[name] = totals.host_us.get(name, 0.0) + float(events.dur_us[row])
        totals.host_count[name] = totals.host_count.get(name, 0) + 1
    for step in steps:
        low, high = step.span_start_us, step.span_end_us
        clipped = np.clip(np.minimum(ends, high) - np.maximum(starts, low), 0.0, None)
        inside = np.flatnonzero(clipped > 0)
        busy = covered_us(union(Intervals(np.maximum(starts[inside], low), np.minimum(ends[inside], high))))
        for index in inside.tolist():
            key = keys[index]
            totals.activity_us[key] = totals.activity_us.get(key, 0.0) + float(clipped[index])
            totals.activity_count[key] = totals.activity_count.get(key, 0) + 1
        span = high - low
        totals.overlap_us += float(clipped[inside].sum()) - busy
        totals.idle_us += span - busy
        totals.span_us += span
        totals.steps += 1


def _activity_keys(events: TraceEvents, rows: np.ndarray) -> list[tuple[str, str]]:
    """(name, grid and block) of each activity: the launching op's input shapes are left out of the key, so a
    kernel run on more rows is one item that takes longer, and one on other grids two (one vanished, one new)."""
    shapes = events.launch_shape_id
    labels = [label.split(INPUTS_MARK, 1)[0] for label in events.launch_shapes]
    return [(events.names[events.name_id[row]], labels[shapes[row]] if shapes is not None and shapes[row] >= 0 else "")
            for row in rows.tolist()]


def _side(label: str, totals: _Totals, report_step_ms: float | None) -> Side:
    return Side(label=label, ranks=totals.ranks, steps=totals.steps,
                span_ms=totals.span_us / max(totals.steps, 1) / 1000.0, report_step_ms=report_step_ms,
                problems=totals.problems)


def _host_items(a: _Totals, b: _Totals) -> list[DiffItem]:
    per_a, per_b = 1000.0 * max(a.steps, 1), 1000.0 * max(b.steps, 1)
    items = [DiffItem(kind=KIND_HOST_CALL, name=name, a_ms=a.host_us.get(name, 0.0) / per_a,
                      b_ms=b.host_us.get(name, 0.0) / per_b, a_count=a.host_count.get(name, 0) * 1000.0 / per_a,
                      b_count=b.host_count.get(name, 0) * 1000.0 / per_b)
             for name in set(a.host_us) | set(b.host_us)]
    return sorted(items, key=lambda item: (-abs(item.change_ms), item.name))[:LISTED]


def _items(a: _Totals, b: _Totals) -> list[DiffItem]:
    per_a, per_b = 1000.0 * max(a.steps, 1), 1000.0 * max(b.steps, 1)
    activities = [DiffItem(kind=KIND_ACTIVITY, name=key[0], shape=key[1],
                           a_ms=a.activity_us.get(key, 0.0) / per_a, b_ms=b.activity_us.get(key, 0.0) / per_b,
                           a_count=a.activity_count.get(key, 0) * 1000.0 / per_a,
                           b_count=b.activity_count.get(key, 0) * 1000.0 / per_b)
                  for key in set(a.activity_us) | set(b.activity_us)]
    activities.sort(key=lambda item: (-abs(item.change_ms), item.name, item.shape))
    listed, rest = activities[:LISTED], activities[LISTED:]
    items = listed + [DiffItem(kind=KIND_IDLE, name="GPU idle inside the steps", a_ms=a.idle_us / per_a,
                               b_ms=b.idle_us / per_b),
                      DiffItem(kind=KIND_OVERLAP, name="GPU activities overlapping one another", a_ms=a.overlap_us / per_a,
                               b_ms=b.overlap_us / per_b)]
    if rest:
        items.append(DiffItem(kind=KIND_ACTIVITY, name=f"{len(rest)} other activities",
                              a_ms=sum(i.a_ms for i in rest), b_ms=sum(i.b_ms for i in rest),
                              a_count=sum(i.a_count for i in rest), b_count=sum(i.b_count for i in rest)))
    return sorted(items, key=lambda item: -abs(item.change_ms))
