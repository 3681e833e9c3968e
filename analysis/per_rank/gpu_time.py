"""Where one rank's GPU time went: by training phase, by user range, by kernel category.

Every GPU activity (kernel, memcpy, memset) is attributed to the host range that LAUNCHED it: its CUDA
correlation id leads to the `cudaLaunchKernel`-style runtime call, and the launch time falls inside
  - a phase: the innermost of `forward` / `backward` / `optimizer_step` / `train_step` containing it
    (by time, whatever the launching thread: autograd launches backward kernels from its own thread
    while the main thread is inside `backward`); inside a step but no phase: PHASE_OTHER; outside every
    step: PHASE_OUTSIDE;
  - a user range: the innermost `record_function` range (user annotation other than steps and phases)
    on the launching thread containing it; none: no range;
  - a host op: the innermost op that launched it, by the `External id` Kineto gives both (host ops are
    left out of GPU traces' event tables, but their External ids and names are kept for this).
Activity without a recorded launch counts by its own start. Durations are summed (concurrent kernels on
different streams each count), in microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, NO_ID, Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import inside_any
from fleetscope.analysis.per_rank.names import (
    CATEGORY_MEMORY,
    KERNEL_CATEGORIES,
    PHASES,
    kernel_category,
    profiler_step_number,
)
from fleetscope.analysis.per_rank.steps import StepTiming

PHASE_OTHER = "in step, outside phases"
PHASE_OUTSIDE = "outside steps"
TOP_RANGES_KEPT = 15


@dataclass(frozen=True, kw_only=True)
class GpuTime:
    """One rank's GPU activity time, summed over its profiled window."""

    total_us: float
    by_phase_us: dict[str, float] = field(default_factory=dict)
    by_category_us: dict[str, float] = field(default_factory=dict)
    category_counts: dict[str, int] = field(default_factory=dict)
    by_range_us: dict[str, float] = field(default_factory=dict)
    """The TOP_RANGES_KEPT user ranges with the most GPU time launched inside them."""
    by_op_us: dict[str, float] = field(default_factory=dict)
    """The TOP_RANGES_KEPT host ops (`aten::mm`, ...) with the most GPU time: the innermost op that
    launched each activity (its `External id`); empty where the trace links none."""


def measure_gpu_time(events: TraceEvents, steps: list[StepTiming]) -> GpuTime | None:
    """None for a trace without GPU activity."""
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    if not gpu.any():
        return None
    indices = np.flatnonzero(gpu)
    launch_us, launch_thread = _launches(events, gpu)
    durations = events.dur_us[indices]
    categories = _categories(events, indices)
    return GpuTime(
        total_us=float(durations.sum()),
        by_phase_us=_summed(_phase_of(events, steps, launch_us), durations),
        by_category_us=_summed(categories, durations),
        category_counts=_counts(categories),
        by_range_us=_top(_summed(_range_of(events, launch_us, launch_thread), durations), TOP_RANGES_KEPT),
        by_op_us=_top(_summed(_op_of(events, indices), durations), TOP_RANGES_KEPT),
    )


@dataclass(frozen=True)
class _Labels:
    """A label for each GPU event, as codes into `names` (-1: none), so that sums are numpy's."""

    codes: np.ndarray
    names: list[str]


def _op_of(events: TraceEvents, indices: np.ndarray) -> _Labels:
    """The host op that launched each GPU event (by `External id`), none where unknown."""
    if events.external_id is None or not events.op_of_external:
        return _Labels(np.full(indices.size, -1, dtype=np.int64), [])
    op_of, code_of = events.op_of_external.get, {}
    codes = np.fromiter((-1 if (op := op_of(external)) is None else code_of.setdefault(op, len(code_of))
                         for external in events.external_id[indices].tolist()), dtype=np.int64, count=indices.size)
    return _Labels(codes, list(code_of))


def _launches(events: TraceEvents, gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(launch time, launching thread) of the selected GPU events; own start and NO_ID without a launch."""
    launch_us = events.launch_start_us(gpu)
    thread = np.full(launch_us.size, NO_ID, dtype=np.int64)
    runtime = np.flatnonzero(events.of_kind(Kind.CUDA_RUNTIME) & (events.correlation != NO_ID))
    if runtime.size:
        order = np.argsort(events.correlation[runtime], kind="stable")
        ids, threads = events.correlation[runtime][order], events.thread[runtime][order]
        wanted = events.correlation[gpu]
        slot = np.clip(np.searchsorted(ids, wanted), 0, ids.size - 1)
        found = (ids[slot] == wanted) & (wanted != NO_ID)
        thread = np.where(found, threads[slot], NO_ID)
    return launch_us, thread


_PHASE_LABELS = [PHASE_OUTSIDE, PHASE_OTHER, *PHASES]


def _phase_of(events: TraceEvents, steps: list[StepTiming], times_us: np.ndarray) -> _Labels:
    codes = np.zeros(times_us.size, dtype=np.int64)
    codes[inside_any([s.start_us for s in steps], [s.end_us for s in steps], times_us)] = 1
    host = events.of_kind(Kind.USER_ANNOTATION, Kind.CPU_OP)
    for code, phase in enumerate(PHASES, start=2):   # train_step first: the phases inside it overwrite it
        mask = host & events.names_matching(lambda n, p=phase: n == p)
        codes[inside_any(events.start_us[mask], events.end_us[mask], times_us)] = code
    return _Labels(codes, _PHASE_LABELS)


def _range_of(events: TraceEvents, times_us: np.ndarray, threads: np.ndarray) -> _Labels:
    """Innermost user range on the launching thread containing each launch (codes are name ids); one
    sweep per thread (ranges of one thread nest, so a stack holds the open ones)."""
    user = np.flatnonzero(events.of_kind(Kind.USER_ANNOTATION) & events.names_matching(_is_user_range))
    codes = np.full(times_us.size, -1, dtype=np.int64)
    for thread in np.unique(events.thread[user]).tolist():
        ranges = user[events.thread[user] == thread]          # sorted by start, as the table is
        launches = np.flatnonzero(threads == thread)
        launches = launches[np.argsort(times_us[launches], kind="stable")]
        for slot, name_id in _innermost(events.start_us[ranges].tolist(), events.end_us[ranges].tolist(),
                                        events.name_id[ranges].tolist(), times_us[launches].tolist()):
            codes[int(launches[slot])] = name_id
    return _Labels(codes, list(events.names))


def _innermost(starts: list[float], ends: list[float], name_ids: list[int], times: list[float]):
    """(index into `times`, name id of the innermost range containing it) for sorted nested ranges and
    sorted times."""
    stack: list[tuple[float, int]] = []
    next_range = 0
    for slot, time in enumerate(times):
        while next_range < len(starts) and starts[next_range] <= time:
            stack.append((ends[next_range], name_ids[next_range]))
            next_range += 1
        while stack and stack[-1][0] <= time:
            stack.pop()
        if stack:
            yield slot, stack[-1][1]


def _is_user_range(name: str) -> bool:
    return name not in PHASES and profiler_step_number(name) is None


_CATEGORY_LABELS = sorted({*KERNEL_CATEGORIES, CATEGORY_MEMORY})


def _categories(events: TraceEvents, indices: np.ndarray) -> _Labels:
    code_of = {category: code for code, category in enumerate(_CATEGORY_LABELS)}
    by_name = np.asarray([code_of[kernel_category(name)] for name in events.names], dtype=np.int64)
    codes = by_name[events.name_id[indices]] if by_name.size else np.zeros(indices.size, dtype=np.int64)
    codes[np.isin(events.kind[indices], (int(Kind.GPU_MEMCPY), int(Kind.GPU_MEMSET)))] = code_of[CATEGORY_MEMORY]
    return _Labels(codes, _CATEGORY_LABELS)


def _summed(labels: _Labels, durations: np.ndarray) -> dict[str, float]:
    """Duration per label, largest first (equal sums: the label seen first first); labels no event has
    are left out. np.bincount adds in event order, as a loop would."""
    present = labels.codes >= 0
    codes = labels.codes[present]
    if not codes.size:
        return {}
    totals = np.bincount(codes, weights=durations[present], minlength=len(labels.names))
    seen, first = np.unique(codes, return_index=True)
    order = sorted(range(seen.size), key=lambda i: (-totals[seen[i]], first[i]))
    return {labels.names[seen[i]]: float(totals[seen[i]]) for i in order}


def _counts(labels: _Labels) -> dict[str, int]:
    """Events per label, labels in alphabetical order."""
    counts = np.bincount(labels.codes[labels.codes >= 0], minlength=len(labels.names))
    return {labels.names[code]: int(counts[code]) for code in sorted(np.flatnonzero(counts).tolist(),
                                                                      key=labels.names.__getitem__)}


def _top(totals: dict[str, float], keep: int) -> dict[str, float]:
    return dict(list(totals.items())[:keep])


def combine_gpu_time(per_rank: list[GpuTime | None]) -> GpuTime | None:
    """The sum over ranks (ranges: each rank's top ranges, summed)."""
    present = [g for g in per_rank if g is not None]
    if not present:
        return None

    def summed(attribute: str) -> dict:
        total: dict = {}
        for item in present:
            for key, value in getattr(item, attribute).items():
                total[key] = total.get(key, 0) + value
        return dict(sorted(total.items(), key=lambda kv: -kv[1]))

    return GpuTime(total_us=sum(g.total_us for g in present), by_phase_us=summed("by_phase_us"),
                   by_category_us=summed("by_category_us"), category_counts=summed("category_counts"),
                   by_range_us=_top(summed("by_range_us"), TOP_RANGES_KEPT),
                   by_op_us=_top(summed("by_op_us"), TOP_RANGES_KEPT))
