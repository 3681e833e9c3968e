"""Training steps of one rank: where each step lies in the trace and how long its phases took."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, NO_ID, Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import Intervals, inside_any, union
from fleetscope.analysis.per_rank.names import PHASES, TRAIN_STEP, profiler_step_number
from fleetscope.traces.formats import STEP_SOURCE_CAPTURE

BOUND_HOST, BOUND_GPU = "host", "gpu"
GPU_SPAN_ANNOTATED = "the GPU's ProfilerStep range"
GPU_SPAN_LAUNCHED = "the kernels launched in the host's step"
STEP_SOURCE_PROFILER = "ProfilerStep"
STEP_SOURCE_TRAIN_STEP = "train_step"
# STEP_SOURCE_CAPTURE (traces/formats.py): a trace without step ranges (a benchmark, a profiler without
# `prof.step()`) has its capture taken as one step, numbered 0, so idle, stalls and findings still come out
DATA_LOADER_PREFIX = "enumerate(DataLoader)#"
"""torch.utils.data names the range of each batch fetch `enumerate(DataLoader)#<iterator>.__next__`."""


@dataclass(frozen=True, kw_only=True)
class StepTiming:
    """One training step on one rank.

    A step has two spans: the host's (its `ProfilerStep#N` or `train_step` range) and the GPU's (the first
    start to the last end of the GPU work launched inside the host's range: gpu_step_spans). The step time is the longer one: a host that runs ahead of the
    CUDA queue ends its range long before its kernels do, and the GPU's span is then the step (`bound`).
    The GPU bounds the step when its busy time alone (the union of the step's GPU work) outlasts the host's
    range: a host-bound step's last kernels also end a little after the host's range, but the GPU was idle
    for longer than that inside the step, waiting for launches. It bounds it too when the step's first kernel
    waited in the queue and started only after the host's range ended: the GPU was still busy with earlier
    steps' work (the host far ahead, its launch calls blocked on the full queue)."""

    step: int
    """The step number (N of `ProfilerStep#N`; with only `train_step` ranges, their order in the trace)."""
    start_us: float
    """Start of the host's range, in the trace's own clock (microseconds after the trace's base time)."""
    step_time_ms: float
    """The step's time: gpu_ms where the GPU bounds the step, else host_ms (class docstring)."""
    host_ms: float | None = None
    """Wall time of the step annotation on the host (None: as step_time_ms, for records written before)."""
    gpu_start_us: float | None = None
    """Start of the GPU's span (None: no GPU work in the step)."""
    gpu_ms: float | None = None
    """Length of the GPU's span."""
    gpu_busy_ms: float | None = None
    """Time inside the GPU's span with GPU work running (the union of its kernels, copies and fills)."""
    gpu_span_source: str = ""
    """Where the GPU's span comes from (gpu_step_spans; "" without one)."""
    bound: str = BOUND_HOST
    """Which span is the step time: BOUND_HOST or BOUND_GPU."""
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Summed wall time of each `train_step`/`forward`/`backward`/`optimizer_step` range in this step."""
    data_loader_ms: float | None = None
    """Summed wall time of the DataLoader's `enumerate(DataLoader)#...__next__` ranges that start in this
    step (fetching its batch on the host); None when the trace records none."""
    host_events: int | None = None
    """Host events the profiler recorded starting in the step's host range, every thread (ops, annotations,
    runtime calls, Python functions): what the profiler's cost per recorded event lengthened."""
    data_loader_events: int | None = None
    """Of host_events, those starting inside the DataLoader ranges; None when the trace records none."""

    @property
    def end_us(self) -> float:
        """End of the host's range: host events are assigned to the step by [start_us, end_us)."""
        return self.start_us + (self.host_ms if self.host_ms is not None else self.step_time_ms) * 1000.0

    @property
    def span_start_us(self) -> float:
        """Start of the span that is the step time (the GPU's when it bounds the step)."""
        return self.gpu_start_us if self.bound == BOUND_GPU and self.gpu_start_us is not None else self.start_us

    @property
    def span_end_us(self) -> float:
        return self.span_start_us + self.step_time_ms * 1000.0


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """Statistics of step_time_ms over the steps of one rank (or of all ranks)."""

    count: int
    mean_ms: float
    median_ms: float
    min_ms: float
    max_ms: float
    std_ms: float
    """Population standard deviation (0 for a single step)."""

    @classmethod
    def of(cls, times_ms: list[float]) -> "StepStats | None":
        if not times_ms:
            return None
        values = np.asarray(times_ms, dtype=np.float64)
        return cls(
            count=int(values.size),
            mean_ms=float(values.mean()),
            median_ms=float(np.median(values)),
            min_ms=float(values.min()),
            max_ms=float(values.max()),
            std_ms=float(values.std()),
        )


def in_host_ranges(times_us: np.ndarray, steps: list[StepTiming]) -> np.ndarray:
    """Which times fall inside a step's host range [start_us, end_us): what "in the step" means for host events
    and for GPU work by its launch."""
    return inside_any([s.start_us for s in steps], [s.end_us for s in steps], times_us)


def find_steps(events: TraceEvents) -> tuple[list[StepTiming], str | None]:
    """The steps of a trace and where they came from (`ProfilerStep`, `train_step`, or None)."""
    host_ranges = events.of_kind(Kind.USER_ANNOTATION, Kind.CPU_OP)
    windows = _profiler_step_windows(events, host_ranges)
    source = STEP_SOURCE_PROFILER
    if not windows:
        windows = _train_step_windows(events, host_ranges)
        source = STEP_SOURCE_TRAIN_STEP
    if not windows:
        windows = _capture_window(events)
        source = STEP_SOURCE_CAPTURE
    if not windows:
        return [], None
    phase_masks = {phase: host_ranges & events.names_matching(lambda n, p=phase: n == p) for phase in PHASES}
    loader = host_ranges & events.names_matching(lambda n: n.startswith(DATA_LOADER_PREFIX))
    recorded = events.of_kind(*HOST_EVENT_KINDS)
    gpu_spans, gpu_source = (_whole_gpu_span(events) if source == STEP_SOURCE_CAPTURE
                             else gpu_step_spans(events, windows))
    steps = []
    for step, start, dur in windows:
        host_ms = dur / 1000.0
        gpu_start, gpu_end, busy_us = gpu_spans.get(step, (None, None, None))
        gpu_ms = (gpu_end - gpu_start) / 1000.0 if gpu_start is not None else None
        busy_ms = busy_us / 1000.0 if busy_us is not None else None
        bound = BOUND_GPU if gpu_ms is not None and gpu_ms > host_ms and busy_ms > host_ms else BOUND_HOST
        if _held_back_by_the_gpu(events, start + dur, host_ms, gpu_start, busy_ms):
            bound = BOUND_GPU
        if source == STEP_SOURCE_CAPTURE and gpu_ms is not None:
            # the whole capture: the GPU's span, first recorded activity to last. Before it the GPU may have run
            # work queued before the capture (a host that runs ahead launches long before its kernels run), and
            # a host that ends the capture waiting for the GPU adds nothing the GPU did not
            bound = BOUND_GPU
        steps.append(StepTiming(
            step=step, start_us=start, step_time_ms=gpu_ms if bound == BOUND_GPU else host_ms, host_ms=host_ms,
            gpu_start_us=gpu_start, gpu_ms=gpu_ms, gpu_busy_ms=busy_ms,
            gpu_span_source=gpu_source if gpu_ms is not None else "",
            bound=bound, phases_ms=_phase_times_ms(events, phase_masks, start, start + dur),
            data_loader_ms=_phase_times_ms(events, {"data": loader}, start, start + dur).get("data")
            if loader.any() else None,
            **_host_event_counts(events, recorded, loader, start, start + dur)))
    return steps, source


HOST_EVENT_KINDS = (Kind.CPU_OP, Kind.USER_ANNOTATION, Kind.CUDA_RUNTIME, Kind.PYTHON_FUNCTION)
"""The host-side events the profiler records, each at a cost of its own."""


PROFILED_OP_KINDS = (Kind.CPU_OP, Kind.USER_ANNOTATION, Kind.CUDA_RUNTIME)
"""The host events the profiler records at an op's cost: ops, ranges and runtime calls; a Python frame under
with_stack costs a fraction of one (bench/profiler_cost_results.md: 0.3 us against 0.6-4.3)."""


def recorded_op_starts(events: TraceEvents) -> np.ndarray:
    """The start of every op, range and runtime call the profiler recorded, sorted: the table's and those a GPU
    trace's table leaves out (events.py omitted_host_op_start_us)."""
    starts = events.start_us[events.of_kind(*PROFILED_OP_KINDS)]
    if events.omitted_host_op_start_us is not None:
        starts = np.concatenate((starts, events.omitted_host_op_start_us))
    return np.sort(starts)


def _host_event_counts(events: TraceEvents, recorded: np.ndarray, loader: np.ndarray, start_us: float,
                       end_us: float) -> dict[str, int | None]:
    """StepTiming.host_events and data_loader_events of the step whose host range is [start_us, end_us)."""
    inside = recorded & (events.start_us >= start_us) & (events.start_us < end_us)
    # a GPU trace's table leaves most host ops out (events.py omitted_host_op_start_us); each was recorded
    omitted = events.omitted_host_op_start_us
    if omitted is not None:
        lo, hi = np.searchsorted(omitted, [start_us, end_us], side="left")
        omitted = omitted[lo:hi]
    counts: dict[str, int | None] = {"host_events": int(inside.sum()) + (0 if omitted is None else int(omitted.size)),
                                     "data_loader_events": None}
    ranges = loader & (events.start_us >= start_us) & (events.start_us < end_us)
    if ranges.any():
        starts = events.start_us[inside] if omitted is None else np.concatenate((events.start_us[inside], omitted))
        within = inside_any(events.start_us[ranges], events.end_us[ranges], starts)
        counts["data_loader_events"] = int(within.sum()) - int(ranges.sum())   # not the ranges themselves
    return counts


QUEUED_US = 500.0
"""A GPU activity that starts this long after its launch call returned waited in the queue behind other work: ten
times the longest launch latency of an idle GPU (a few to tens of us; a first launch that loads its module, more)."""


def _held_back_by_the_gpu(events: TraceEvents, host_end_us: float, host_ms: float, gpu_start_us: float | None,
                          busy_ms: float | None) -> bool:
    """The step's first kernel waited in the queue and started only after the host's range ended, and the step's
    own GPU work takes at least half that range: the host ran ahead and its range stretched to the GPU's pace
    (launch calls blocking on the full queue), so the GPU's span is the step's. A step that launches little
    (its GPU busy with work from elsewhere) keeps its host range."""
    if gpu_start_us is None or busy_ms is None or gpu_start_us < host_end_us or busy_ms < host_ms / 2:
        return False
    return _waited_in_queue(events, gpu_start_us)


def _waited_in_queue(events: TraceEvents, start_us: float) -> bool:
    """The GPU work starting at `start_us` waited in the queue after its launch (waited_in_queue): the GPU was
    busy with earlier work. A step whose first kernel so started only after the host's range ended was held back
    by the GPU, not the host (whose launch calls may even have blocked on the full queue, lengthening its range)."""
    return waited_in_queue(events, events.of_kind(*GPU_ACTIVITY_KINDS) & (events.start_us == start_us))


def waited_in_queue(events: TraceEvents, selected: np.ndarray) -> bool:
    """Some selected GPU activity started QUEUED_US or more after its launch call returned: it waited behind
    other work on the GPU (the one rule of it, for the steps' bound and utilization.gpu_known_from_us)."""
    return bool(np.any(events.start_us[selected] - events.launch_end_us(selected) > QUEUED_US))


def _whole_gpu_span(events: TraceEvents) -> tuple[dict[int, tuple[float, float, float]], str]:
    """The whole capture's GPU span (step 0): every recorded GPU activity, whoever launched it and when."""
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    if not gpu.any():
        return {}, ""
    starts, ends = events.start_us[gpu], events.end_us[gpu]
    busy = union(Intervals(starts, ends)).total_us
    return {0: (float(starts.min()), float(ends.max()), busy)}, "every GPU activity of the capture"


def gpu_step_spans(events: TraceEvents,
                   windows: list[tuple[int, float, float]]) -> tuple[dict[int, tuple[float, float, float]], str]:
    """step -> (start, end, busy time) of the GPU's span of each host step, and where the spans come from: the
    first start to the last end of the GPU work launched inside the host's range (by its launch call's start;
    work without a launch record by its own start only where the trace records no launches at all). Only a trace where no GPU work is found so takes the
    device's own `ProfilerStep#N` ranges (gpu_user_annotation): Kineto draws them over the kernels launched
    directly inside the host's range, outside nested annotations (7 us of an 80 ms step on a trainer whose
    step is all forward/backward/optimizer ranges), and, with the host steps ahead of the queue, over spans
    that start before the previous step's kernels (seen on the H200)."""
    spans: dict[int, tuple[float, float, float]] = {}
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    launched_here = gpu & np.isin(events.correlation, events.correlation[events.of_kind(Kind.CUDA_RUNTIME)
                                                                         & (events.correlation != NO_ID)])
    if launched_here.any():
        # work whose launch is not in the trace ran for a step before the window (launched while the
        # profiler warmed up): by its own start it would land in a profiled step
        gpu = launched_here
    if gpu.any():
        launched, starts, ends = events.launch_start_us(gpu), events.start_us[gpu], events.end_us[gpu]
        order = np.argsort(launched, kind="stable")
        launched, starts, ends = launched[order], starts[order], ends[order]
        for step, start, dur in windows:
            first, last = np.searchsorted(launched, [start, start + dur], side="left")
            if last > first:
                busy = union(Intervals(starts[first:last], ends[first:last])).total_us
                spans[step] = (float(starts[first:last].min()), float(ends[first:last].max()), busy)
    if spans:
        return spans, GPU_SPAN_LAUNCHED
    # no GPU work found by launch: the device's own ranges, taken as busy (it ran something all along)
    annotated = _annotated_gpu_steps(events, {step for step, _, _ in windows})
    return {step: (start, end, end - start) for step, (start, end) in annotated.items()}, \
        (GPU_SPAN_ANNOTATED if annotated else "")


def _annotated_gpu_steps(events: TraceEvents, wanted: set[int]) -> dict[int, tuple[float, float]]:
    """step -> (first start, last end) of the device's `ProfilerStep#N` ranges (one per stream it ran on)."""
    marks = events.of_kind(Kind.GPU_USER_ANNOTATION) & events.names_matching(
        lambda n: profiler_step_number(n) is not None)
    spans: dict[int, tuple[float, float]] = {}
    for index in np.flatnonzero(marks).tolist():
        step = profiler_step_number(events.names[events.name_id[index]])
        if step not in wanted:
            continue
        start, end = float(events.start_us[index]), float(events.end_us[index])
        known = spans.get(step)
        spans[step] = (min(start, known[0]), max(end, known[1])) if known else (start, end)
    return spans


def _profiler_step_windows(events: TraceEvents, host_ranges: np.ndarray) -> list[tuple[int, float, float]]:
    """(step, start, duration) of each ProfilerStep range. The duration is the event's own: an end minus a
    start loses the nanoseconds of epoch timestamps (~1.7e15 us keep 0.25 us in a float64), the
    duration keeps them (ns-resolution traces write both with 3 decimals)."""
    numbers = [profiler_step_number(n) for n in events.names]
    is_step = events.names_matching(lambda n: profiler_step_number(n) is not None) & host_ranges
    seen: dict[int, tuple[int, float, float]] = {}
    for index in np.flatnonzero(is_step):
        step = numbers[events.name_id[index]]
        if step not in seen:  # a step annotated twice (e.g. a nested profiler) counts once
            seen[step] = (step, float(events.start_us[index]), float(events.dur_us[index]))
    return sorted(seen.values(), key=lambda w: w[1])


def _capture_window(events: TraceEvents) -> list[tuple[int, float, float]]:
    """The whole capture as one step: from the first event's start to the last one's end (none: no events)."""
    if not len(events):
        return []
    start, end = float(events.start_us.min()), float(events.end_us.max())
    return [(0, start, end - start)] if end > start else []


def _train_step_windows(events: TraceEvents, host_ranges: np.ndarray) -> list[tuple[int, float, float]]:
    is_step = events.names_matching(lambda n: n == TRAIN_STEP) & host_ranges
    starts, durs = events.start_us[is_step], events.dur_us[is_step]
    return [(index, float(s), float(d)) for index, (s, d) in enumerate(zip(starts, durs))]


def _phase_times_ms(events: TraceEvents, phase_masks: dict[str, np.ndarray],
                    start_us: float, end_us: float) -> dict[str, float]:
    inside = (events.start_us >= start_us) & (events.start_us < end_us)
    times = {}
    for phase, mask in phase_masks.items():
        selected = mask & inside
        if selected.any():
            times[phase] = float(events.dur_us[selected].sum()) / 1000.0
    return times
