"""Busy, idle, communication time and communication/computation overlap of one rank.

Two bases, chosen per trace:

**GPU basis** (the trace holds GPU activity: `kernel`, `gpu_memcpy`, `gpu_memset` events). All GPU activity of
the rank (every device and stream it recorded) is one timeline.
  - span: from the start of the first profiled step to the later of the last step's end and the end of the
    last GPU activity launched before it (by CUDA correlation; by its own start where no launch is
    recorded): the GPU finishing the work the steps queued, however far the host ran ahead. Without step
    annotations: first GPU activity start to last GPU activity end.
  - compute = union of non-communication kernels; memory = union of memcpy/memset;
    busy = union of all GPU activity (compute, communication kernels, memory); idle = span - busy.
  - comm = union of communication kernels (`nccl*`). A GPU job that communicates on the host instead
    (gloo; no communication kernels at all) has its host collectives as comm: `gloo:*` spans and host
    collective ops. Those are not GPU activity, so they are not busy: the GPU idles while they run.
  - overlap = time in comm that is also in compute.

**CPU basis** (no GPU activity, e.g. gloo on CPU). The process's profiled threads are one timeline.
  - span: first step start to last step end; without steps, first to last host op.
  - comm = union of `gloo:*` spans (gloo's runloop threads, the time a collective is in flight) and host
    collective ops (`c10d::*`, functional collectives, `record_param_comms`).
  - compute = union of every other `cpu_op` on any thread, minus the host collective ops (DDP issues its
    all-reduce from inside autograd ops, which must not count as compute).
  - memory = 0 (not measurable on CPU); busy = compute ∪ comm; idle = span - busy (no op running and
    nothing in flight: Python overhead, sleeps, data loading outside ops).
  - overlap = time in comm that is also in compute (the collective hidden behind work on other threads).

On both bases idle_comm_us = idle time while communication was in flight (the resource waiting for a
collective). Everything is clipped to the span. Percentages are of the span, except overlap_pct, which is
of comm_us.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, NO_ID, Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import (
    Intervals,
    clip,
    overlap_us,
    subtract,
    union,
    union_of,
)
from fleetscope.analysis.per_rank.names import (
    is_comm_cpu_op,
    is_comm_kernel,
    is_gloo_span,
)
from fleetscope.analysis.per_rank.steps import StepTiming, waited_in_queue

BASIS_GPU = "gpu"
BASIS_CPU = "cpu"


@dataclass(frozen=True, kw_only=True)
class Utilization:
    """Where one rank's time went during its profiled steps (see the module docstring for definitions)."""

    basis: str
    """"gpu" or "cpu": which definitions were applied."""
    span_us: float
    busy_us: float
    idle_us: float
    compute_us: float
    comm_us: float
    memory_us: float
    overlap_us: float
    """Communication time during which computation also ran."""
    exposed_comm_us: float
    """comm_us - overlap_us: communication nothing else hid."""
    idle_comm_us: float
    """Idle time during which communication was in flight (host collectives of a GPU job)."""
    busy_pct: float
    idle_pct: float
    comm_pct: float
    overlap_pct: float | None
    """overlap_us / comm_us * 100; None when there is no communication."""


@dataclass(frozen=True)
class Timeline:
    """The rank's activity as interval sets (trace clock), by the definitions of its basis."""

    basis: str
    compute: Intervals
    comm_busy: Intervals
    """Communication that occupies the measured resource (GPU: NCCL kernels; CPU: all of it)."""
    comm_other: Intervals
    """Communication elsewhere (a GPU job's host collectives): counts as comm, not as busy."""
    memory: Intervals


def build_timeline(events: TraceEvents, is_comm=is_comm_kernel) -> Timeline:
    """GPU basis when the trace holds GPU activity, CPU basis otherwise (see the module docstring);
    `is_comm(name)` says which kernels communicate (names.comm_kernel_rule)."""
    return _gpu_timeline(events, is_comm) if events.has_gpu_activity else _cpu_timeline(events)


def measure_utilization(events: TraceEvents, steps: list[StepTiming],
                        timeline: Timeline | None = None) -> Utilization | None:
    """Utilization of one rank; None when the trace has nothing to measure (no ops, no kernels)."""
    timeline = timeline or build_timeline(events)
    span = _gpu_span(events, steps) if timeline.basis == BASIS_GPU else _cpu_span(events, steps)
    if span is None or span[1] <= span[0]:
        return None
    return _summarize(timeline, span)


def _summarize(timeline: Timeline, span: tuple[float, float]) -> Utilization:
    start, end = span
    compute, comm_busy, comm_other, memory = (
        union(clip(s, start, end))
        for s in (timeline.compute, timeline.comm_busy, timeline.comm_other, timeline.memory))
    comm = union_of(comm_busy, comm_other)
    span_us = end - start
    busy = union_of(compute, comm_busy, memory)
    busy_us = busy.total_us
    comm_us = comm.total_us
    hidden_us = overlap_us(comm, compute)
    return Utilization(
        basis=timeline.basis,
        span_us=span_us,
        busy_us=busy_us,
        idle_us=span_us - busy_us,
        compute_us=compute.total_us,
        comm_us=comm_us,
        memory_us=memory.total_us,
        overlap_us=hidden_us,
        exposed_comm_us=comm_us - hidden_us,
        idle_comm_us=subtract(comm, busy).total_us,
        busy_pct=100.0 * busy_us / span_us,
        idle_pct=100.0 * (span_us - busy_us) / span_us,
        comm_pct=100.0 * comm_us / span_us,
        overlap_pct=100.0 * hidden_us / comm_us if comm_us > 0 else None,
    )


def _intervals(events: TraceEvents, mask: np.ndarray) -> Intervals:
    return Intervals(events.start_us[mask], events.end_us[mask])


def _gpu_timeline(events: TraceEvents, is_comm=is_comm_kernel) -> Timeline:
    kernels = events.of_kind(Kind.KERNEL)
    comm = kernels & events.names_matching(is_comm)
    return Timeline(
        basis=BASIS_GPU,
        compute=_intervals(events, kernels & ~comm),
        comm_busy=_intervals(events, comm),
        comm_other=_host_comm(events) if not comm.any() else Intervals.empty(),
        memory=_intervals(events, events.of_kind(Kind.GPU_MEMCPY, Kind.GPU_MEMSET)),
    )


def _host_comm(events: TraceEvents) -> Intervals:
    """gloo spans and host collective ops: the collectives of a job that communicates on the host."""
    comm_ops = events.of_kind(Kind.CPU_OP) & events.names_matching(is_comm_cpu_op)
    return union_of(_intervals(events, events.names_matching(is_gloo_span)), _intervals(events, comm_ops))


def _gpu_span(events: TraceEvents, steps: list[StepTiming]) -> tuple[float, float] | None:
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    if not steps:
        return float(events.start_us[gpu].min()), float(events.end_us[gpu].max())
    # a GPU-bound step's span starts with its own first kernel: before it the GPU ran the work of a step
    # launched before the window (its launches are not in the trace), which is no idle time
    start = max(min(s.span_start_us for s in steps), gpu_known_from_us(events))
    last_end = max(s.end_us for s in steps)
    launched_in_steps = events.launch_start_us(gpu) < last_end
    ends = events.end_us[gpu][launched_in_steps]
    last_end = max(last_end, max(s.span_end_us for s in steps))
    return start, max(last_end, float(ends.max())) if ends.size else last_end


def gpu_known_from_us(events: TraceEvents) -> float:
    """Where the recorded GPU timeline starts being known: the first recorded GPU activity, when its launch is not
    in the trace (made before the capture, whose records the profiler's warm-up drops) or when it waited in the
    queue after its launch: either way the GPU was busy before it with work the trace does not hold, which is
    no idle time. Otherwise -inf: the GPU was idle until that launch, and that idle counts. The one start of
    every GPU-basis measure of idle (utilization here, the idle gaps of host_stalls.py)."""
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    if not gpu.any():
        return float("-inf")
    rows = np.flatnonzero(gpu)
    first = int(rows[np.argmin(events.start_us[rows])])
    launches = events.of_kind(Kind.CUDA_RUNTIME) & (events.correlation == events.correlation[first])
    if events.correlation[first] == NO_ID or not launches.any():
        return float(events.start_us[first])
    return float(events.start_us[first]) if waited_in_queue(events, np.array([first])) else float("-inf")


def _cpu_timeline(events: TraceEvents) -> Timeline:
    ops = events.of_kind(Kind.CPU_OP)
    comm_ops = ops & events.names_matching(is_comm_cpu_op)
    gloo = events.names_matching(is_gloo_span)
    comm_op_time = _intervals(events, comm_ops)
    return Timeline(
        basis=BASIS_CPU,
        compute=subtract(_intervals(events, ops & ~comm_ops & ~gloo), comm_op_time),
        comm_busy=union_of(_intervals(events, gloo), comm_op_time),
        comm_other=Intervals.empty(),
        memory=Intervals.empty(),
    )


def _cpu_span(events: TraceEvents, steps: list[StepTiming]) -> tuple[float, float] | None:
    if steps:
        return steps[0].start_us, max(s.end_us for s in steps)
    ops = events.of_kind(Kind.CPU_OP)
    if not ops.any():
        return None
    return float(events.start_us[ops].min()), float(events.end_us[ops].max())
