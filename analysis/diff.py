"""`fleetscope diff A B`: where a step's time moved between two runs, trace directories or trace files.

Each side's profiled steps are partitioned the way the report partitions them (analysis/quantities.py, the
per-rank step spans of per_rank/steps.py): inside each step's span the GPU is busy or idle, and the busy time is the
GPU activities' time less the time they overlap one another. So, per step (the mean over every rank's profiled
steps), `span = sum of the activities' time - overlap + idle`, and between A and B the span's change is exactly the
sum of each activity's change, less the overlap's change, plus the idle's change. Activities are keyed by kernel (or
copy, or fill) name and launch shape (grid and block), so a kernel that moved to other grids shows as one that
vanished and one that is new.

Beside the partition (each sums time another way, so none adds up to the span): the host's CUDA calls inside the
steps, the GPU time launched in each phase and by each host op (the report's attribution, per_rank/gpu_time.py),
and each collective by op, process group and message size. Each change carries its noise: NOISE_Z standard errors
from the item's spread over the profiled steps.

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
from fleetscope.traces.validate import finite

KIND_ACTIVITY, KIND_IDLE, KIND_OVERLAP = "GPU activity", "GPU idle", "overlap"
KIND_HOST_CALL = "host call"
KIND_PHASE, KIND_OP, KIND_COLLECTIVE = "phase", "host op", "collective"
"""Views beside the partition (each sums GPU time another way, so none adds up to the span): the GPU time launched
in each training phase, by each host op (`aten::mm`, ...), and each collective by op, group and message size."""
NOISE_Z = 1.96
"""A change's noise: this many standard errors of the difference of the per-step means (95%)."""
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
    """Calls per step (for phases and host ops: 1 where the side has the item, 0 where not)."""
    b_count: float = 0.0
    noise_ms: float = 0.0
    """NOISE_Z standard errors of the change, from the item's spread over the profiled steps (0: not known)."""

    @property
    def change_ms(self) -> float:
        """This item's contribution to the change of the step: the overlap's counts against it."""
        sign = -1.0 if self.kind == KIND_OVERLAP else 1.0
        return sign * (self.b_ms - self.a_ms)

    @property
    def status(self) -> str:
        if self.kind not in (KIND_ACTIVITY, KIND_HOST_CALL, KIND_OP, KIND_COLLECTIVE):
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
    span_spread_ms: float = 0.0
    """Standard deviation of the step span over every rank's profiled steps."""
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
    phases: list[DiffItem] = field(default_factory=list)
    """KIND_PHASE items: the GPU time launched in each phase, per step (not part of the partition)."""
    ops: list[DiffItem] = field(default_factory=list)
    """KIND_OP items: the GPU time each host op launched, per step, largest |change| first."""
    collectives: list[DiffItem] = field(default_factory=list)
    """KIND_COLLECTIVE items: each collective (op, group, size), its time and calls per step."""

    @property
    def span_change_ms(self) -> float:
        return self.b.span_ms - self.a.span_ms

    @property
    def span_noise_ms(self) -> float:
        """NOISE_Z standard errors of the span's change."""
        return NOISE_Z * float(np.hypot(self.a.span_spread_ms / np.sqrt(max(self.a.steps, 1)),
                                        self.b.span_spread_ms / np.sqrt(max(self.b.steps, 1))))

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


IDLE_KEY, OVERLAP_KEY, SPAN_KEY = ("", "idle"), ("", "overlap"), ("", "span")


@dataclass
class _Totals:
    """One side's sums over every rank's profiled steps, in us."""

    activity_us: dict[tuple[str, str], float] = field(default_factory=dict)
    step_values: list[dict[tuple[str, str], float]] = field(default_factory=list)
    """Each profiled step's time (us) per partition item: activities by key, IDLE_KEY, OVERLAP_KEY, SPAN_KEY."""
    phase_us: dict[str, float] = field(default_factory=dict)
    op_us: dict[str, float] = field(default_factory=dict)
    collective_us: dict[str, float] = field(default_factory=dict)
    collective_count: dict[str, int] = field(default_factory=dict)
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
    return TraceDiff(a=sides[0], b=sides[1], items=_items(*totals), host_calls=_host_items(*totals),
                     phases=_named_items(KIND_PHASE, *(t.phase_us for t in totals), *totals, limit=None),
                     ops=_named_items(KIND_OP, *(t.op_us for t in totals), *totals),
                     collectives=_collective_items(*totals))


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
        _add_step(totals, keys, starts, ends, step.span_start_us, step.span_end_us)
    _add_launch_views(totals, events, steps)
    _add_collectives(totals, events, steps)


def _add_step(totals: _Totals, keys: list[tuple[str, str]], starts: np.ndarray, ends: np.ndarray,
              low: float, high: float) -> None:
    """One profiled step's partition: each activity's time clipped to the step's span, the overlap, the idle."""
    clipped = np.clip(np.minimum(ends, high) - np.maximum(starts, low), 0.0, None)
    inside = np.flatnonzero(clipped > 0)
    busy = covered_us(union(Intervals(np.maximum(starts[inside], low), np.minimum(ends[inside], high))))
    values: dict[tuple[str, str], float] = {}
    for index in inside.tolist():
        key = keys[index]
        values[key] = values.get(key, 0.0) + float(clipped[index])
        totals.activity_count[key] = totals.activity_count.get(key, 0) + 1
    for key, value in values.items():
        totals.activity_us[key] = totals.activity_us.get(key, 0.0) + value
    span = high - low
    overlap, idle = float(clipped[inside].sum()) - busy, span - busy
    values.update({OVERLAP_KEY: overlap, IDLE_KEY: idle, SPAN_KEY: span})
    totals.step_values.append(values)
    totals.overlap_us += overlap
    totals.idle_us += idle
    totals.span_us += span
    totals.steps += 1


def _add_launch_views(totals: _Totals, events: TraceEvents, steps) -> None:
    """GPU time by the phase and by the host op that launched it (per_rank/gpu_time.py, the report's
    attribution); work launched outside every step is left out, as the partition leaves it out."""
    from fleetscope.analysis.per_rank.gpu_time import PHASE_OUTSIDE, measure_gpu_time

    gpu_time = measure_gpu_time(events, steps)
    if gpu_time is None:
        return
    for phase, us in gpu_time.by_phase_us.items():
        if phase != PHASE_OUTSIDE:
            totals.phase_us[phase] = totals.phase_us.get(phase, 0.0) + us
    for op, us in gpu_time.by_op_us.items():
        totals.op_us[op] = totals.op_us.get(op, 0.0) + us


def _add_collectives(totals: _Totals, events: TraceEvents, steps) -> None:
    """Each collective call inside the profiled steps, keyed by op, process group and message size."""
    from fleetscope.analysis.per_rank.collectives import NO_STEP, find_collectives

    calls = find_collectives(events, steps)
    sizes = calls.sizes
    for index, key in enumerate(calls.keys):
        if key[0] == NO_STEP:
            continue
        label = _collective_label(key[1], sizes, index)
        totals.collective_us[label] = totals.collective_us.get(label, 0.0) + float(
            calls.end_us[index] - calls.start_us[index])
        totals.collective_count[label] = totals.collective_count.get(label, 0) + 1


def _collective_label(name: str, sizes, index: int) -> str:
    if sizes is None:
        return name
    kind = sizes.collective[index] or name
    group = sizes.group[index]
    moved = float(sizes.bytes[index])
    parts = [kind] + ([f"group {group}"] if group else []) + ([_bytes_text(moved)] if finite(moved) is not None else [])
    return ", ".join(parts)


def _bytes_text(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _activity_keys(events: TraceEvents, rows: np.ndarray) -> list[tuple[str, str]]:
    """(name, grid and block) of each activity: the launching op's input shapes are left out of the key, so a
    kernel run on more rows is one item that takes longer, and one on other grids two (one vanished, one new)."""
    shapes = events.launch_shape_id
    labels = [label.split(INPUTS_MARK, 1)[0] for label in events.launch_shapes]
    return [(events.names[events.name_id[row]], labels[shapes[row]] if shapes is not None and shapes[row] >= 0 else "")
            for row in rows.tolist()]


def _side(label: str, totals: _Totals, report_step_ms: float | None) -> Side:
    spans = [values[SPAN_KEY] for values in totals.step_values]
    return Side(label=label, ranks=totals.ranks, steps=totals.steps,
                span_ms=totals.span_us / max(totals.steps, 1) / 1000.0,
                span_spread_ms=float(np.std(spans, ddof=1)) / 1000.0 if len(spans) > 1 else 0.0,
                report_step_ms=report_step_ms, problems=totals.problems)


def _noise_ms(a: _Totals, b: _Totals, key: tuple[str, str]) -> float:
    """NOISE_Z standard errors of the difference of the item's per-step means (0 with fewer than 2 steps a side)."""
    spreads = []
    for side in (a, b):
        values = np.asarray([step.get(key, 0.0) for step in side.step_values])
        if values.size < 2:
            return 0.0
        spreads.append(float(np.std(values, ddof=1)) / np.sqrt(values.size))
    return NOISE_Z * float(np.hypot(*spreads)) / 1000.0


def _named_items(kind: str, a_us: dict[str, float], b_us: dict[str, float], a: _Totals, b: _Totals, *,
                 limit: int | None = LISTED) -> list[DiffItem]:
    per_a, per_b = 1000.0 * max(a.steps, 1), 1000.0 * max(b.steps, 1)
    items = [DiffItem(kind=kind, name=name, a_ms=a_us.get(name, 0.0) / per_a, b_ms=b_us.get(name, 0.0) / per_b,
                      a_count=float(name in a_us), b_count=float(name in b_us))
             for name in set(a_us) | set(b_us)]
    return sorted(items, key=lambda item: (-abs(item.change_ms), item.name))[:limit]


def _collective_items(a: _Totals, b: _Totals) -> list[DiffItem]:
    per_a, per_b = 1000.0 * max(a.steps, 1), 1000.0 * max(b.steps, 1)
    items = [DiffItem(kind=KIND_COLLECTIVE, name=name, a_ms=a.collective_us.get(name, 0.0) / per_a,
                      b_ms=b.collective_us.get(name, 0.0) / per_b,
                      a_count=a.collective_count.get(name, 0) * 1000.0 / per_a,
                      b_count=b.collective_count.get(name, 0) * 1000.0 / per_b)
             for name in set(a.collective_us) | set(b.collective_us)]
    return sorted(items, key=lambda item: (-abs(item.change_ms), item.name))[:LISTED]


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
                           b_count=b.activity_count.get(key, 0) * 1000.0 / per_b, noise_ms=_noise_ms(a, b, key))
                  for key in set(a.activity_us) | set(b.activity_us)]
    activities.sort(key=lambda item: (-abs(item.change_ms), item.name, item.shape))
    listed, rest = activities[:LISTED], activities[LISTED:]
    items = listed + [DiffItem(kind=KIND_IDLE, name="GPU idle inside the steps", a_ms=a.idle_us / per_a,
                               b_ms=b.idle_us / per_b, noise_ms=_noise_ms(a, b, IDLE_KEY)),
                      DiffItem(kind=KIND_OVERLAP, name="GPU activities overlapping one another", a_ms=a.overlap_us / per_a,
                               b_ms=b.overlap_us / per_b, noise_ms=_noise_ms(a, b, OVERLAP_KEY))]
    if rest:
        items.append(DiffItem(kind=KIND_ACTIVITY, name=f"{len(rest)} other activities",
                              a_ms=sum(i.a_ms for i in rest), b_ms=sum(i.b_ms for i in rest),
                              a_count=sum(i.a_count for i in rest), b_count=sum(i.b_count for i in rest)))
    return sorted(items, key=lambda item: -abs(item.change_ms))
