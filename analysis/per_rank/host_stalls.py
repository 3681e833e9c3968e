"""Where the host held the GPU back: syncs, tensor reads, device-to-host copies, input waits, and a cause
for every GPU idle gap inside the profiled steps.

Per step (events assigned by their host start, GPU copies by their launch):
  - sync_count / sync_us: CUDA calls that block the host until the GPU is done (names.HOST_SYNC_CALLS),
    and the host time spent blocked in them;
  - tensor_reads: `aten::_local_scalar_dense` calls (`.item()` and friends; each copies and syncs);
  - dtoh_count / dtoh_us: device-to-host copies and their GPU time;
  - input_wait_us: DataLoader fetches (`enumerate(DataLoader)#...`), host wall time;
  - launch_count / launch_us: launch calls (names.HOST_LAUNCH_CALLS) and the host time inside them: the
    evidence that a GPU waiting for the host waits for launches (and not for other host work).
GPU idle gaps are the time inside the steps where no kernel, copy or fill runs. Each gets the first cause
that applies:
  - IDLE_INPUT: at least half of it is covered by a DataLoader fetch;
  - IDLE_HOST_COMM: at least half of it is covered by communication on the host (gloo spans, c10d
    ops): the GPU waits for a collective that runs on the CPU;
  - IDLE_SYNC: it starts while the host is blocked in a sync or a tensor read, or within SYNC_SLACK_US
    after one returns (the GPU drained, and waits for the host to launch again);
  - IDLE_SHORT: shorter than SHORT_GAP_US (launch overhead between back-to-back kernels);
  - IDLE_DEVICE: the GPU work that ends it had been launched (its launch call had returned) before the
    gap began: the GPU waited on an event, another stream or a peer, not on the host;
  - IDLE_HOST: otherwise: the host was busy elsewhere (Python, launches, a sleep) and launched late.
CPU traces (no GPU activity) have idle gaps on the CPU basis of utilization.py (no op and no collective
running on any thread inside the steps), all with the cause IDLE_NO_OP, which idle_by_cause_us holds too:
the report's idle by cause and the merged trace's `idle:` slices are the same gaps on either basis.
`find_idle_gaps` is the one rule for idle gaps and their causes: the report's totals and the merged trace's
`idle: <cause>` slices both come from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import Intervals, covered_between, subtract, union, union_of
from fleetscope.analysis.per_rank.names import (
    is_comm_cpu_op,
    is_device_to_host_copy,
    is_gloo_span,
    is_host_sync_call,
    is_input_wait,
    is_launch_call,
    is_tensor_read_op,
)
from fleetscope.analysis.per_rank.steps import StepTiming
from fleetscope.analysis.per_rank.utilization import BASIS_CPU, BASIS_GPU, Timeline

IDLE_INPUT, IDLE_HOST_COMM, IDLE_SYNC = "input wait", "host collective", "host sync"
IDLE_SHORT, IDLE_DEVICE, IDLE_HOST = "short gaps", "device dependency", "host busy elsewhere"
IDLE_CAUSES = (IDLE_INPUT, IDLE_HOST_COMM, IDLE_SYNC, IDLE_SHORT, IDLE_DEVICE, IDLE_HOST)
IDLE_NO_OP = "no op running"
GAP_CAUSES = IDLE_CAUSES + (IDLE_NO_OP,)
"""Every cause an IdleGaps entry can carry, by code."""
SYNC_SLACK_US = 20.0
SHORT_GAP_US = 10.0


@dataclass(frozen=True, kw_only=True)
class StepStalls:
    step: int
    sync_count: int
    sync_us: float
    tensor_reads: int
    dtoh_count: int
    dtoh_us: float
    input_wait_us: float
    launch_count: int = 0
    """Launch calls (names.HOST_LAUNCH_CALLS: kernels, graphs, async copies and fills) the host made in the step."""
    launch_us: float = 0.0
    """Host time inside them: what replaying the step as a CUDA graph could save on the host."""


@dataclass(frozen=True, kw_only=True)
class HostStalls:
    """One rank's host stalls over its profiled steps (module docstring)."""

    steps: list[StepStalls] = field(default_factory=list)
    idle_by_cause_us: dict[str, float] = field(default_factory=dict)
    """GPU idle time inside the steps by cause (IDLE_CAUSES); empty for CPU-only traces."""
    idle_gaps_by_cause: dict[str, int] = field(default_factory=dict)
    """Number of idle gaps by cause."""


@dataclass(frozen=True, kw_only=True)
class IdleGaps:
    """Every idle gap of one rank inside its profiled steps (trace clock), with its cause."""

    basis: str
    """BASIS_GPU | BASIS_CPU (utilization.py): what was idle."""
    starts_us: np.ndarray
    ends_us: np.ndarray
    cause_codes: np.ndarray
    """Index into GAP_CAUSES, per gap."""

    def __len__(self) -> int:
        return int(self.starts_us.size)

    def causes(self) -> list[str]:
        return [GAP_CAUSES[code] for code in self.cause_codes.tolist()]


def find_idle_gaps(events: TraceEvents, steps: list[StepTiming], timeline: Timeline) -> IdleGaps | None:
    """The gaps of the steps not covered by the timeline's busy time, each with its cause (module
    docstring); None without steps or without anything measured."""
    if not steps:
        return None
    spans = union(Intervals.of([s.start_us for s in steps], [s.end_us for s in steps]))
    if timeline.basis == BASIS_CPU:
        busy = union_of(timeline.compute, timeline.comm_busy)
        if not len(busy):
            return None
        gaps = subtract(spans, busy)
        return IdleGaps(basis=BASIS_CPU, starts_us=gaps.starts_us, ends_us=gaps.ends_us,
                        cause_codes=np.full(len(gaps), GAP_CAUSES.index(IDLE_NO_OP), dtype=np.int8))
    return _gpu_idle_gaps(events, spans)


def _gpu_idle_gaps(events: TraceEvents, spans: Intervals) -> IdleGaps:
    host = events.of_kind(Kind.CUDA_RUNTIME, Kind.CPU_OP, Kind.USER_ANNOTATION)
    syncs = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_host_sync_call)
    reads = events.of_kind(Kind.CPU_OP) & events.names_matching(is_tensor_read_op)
    inputs = host & events.names_matching(is_input_wait)
    host_comm = host & events.names_matching(lambda n: is_gloo_span(n) or is_comm_cpu_op(n))
    blocking = syncs | reads
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    gaps = subtract(spans, union(Intervals(events.start_us[gpu], events.end_us[gpu])))
    causes = gap_causes(gaps, Intervals(events.start_us[inputs], events.end_us[inputs]),
                        Intervals(events.start_us[host_comm], events.end_us[host_comm]),
                        Intervals(events.start_us[blocking], events.end_us[blocking] + SYNC_SLACK_US),
                        queued_before=_queued_before(events, gpu, gaps))
    code_of = {cause: code for code, cause in enumerate(GAP_CAUSES)}
    codes = np.fromiter(map(code_of.__getitem__, causes.tolist()), dtype=np.int8, count=len(causes))
    return IdleGaps(basis=BASIS_GPU, starts_us=gaps.starts_us, ends_us=gaps.ends_us, cause_codes=codes)


def _queued_before(events: TraceEvents, gpu: np.ndarray, gaps: Intervals) -> np.ndarray:
    """Per gap: the GPU work starting at its end had been launched (launch call returned) before it began."""
    if not len(gaps) or not gpu.any():
        return np.zeros(len(gaps), dtype=bool)
    starts = events.start_us[gpu]
    launched = events.launch_end_us(gpu)
    order = np.argsort(starts, kind="stable")
    starts, launched = starts[order], launched[order]
    slot = np.clip(np.searchsorted(starts, gaps.ends_us), 0, starts.size - 1)
    follows = np.abs(starts[slot] - gaps.ends_us) < 1e-6
    return follows & (launched[slot] <= gaps.starts_us)


def find_host_stalls(events: TraceEvents, steps: list[StepTiming], gaps: IdleGaps | None = None) -> HostStalls | None:
    """None without steps (nothing to assign the stalls to); the idle causes are those of `gaps`
    (find_idle_gaps), on the GPU basis or the CPU one ("no op running")."""
    if not steps:
        return None
    host = events.of_kind(Kind.CUDA_RUNTIME, Kind.CPU_OP, Kind.USER_ANNOTATION)
    syncs = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_host_sync_call)
    reads = events.of_kind(Kind.CPU_OP) & events.names_matching(is_tensor_read_op)
    inputs = host & events.names_matching(is_input_wait)
    dtoh = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(is_device_to_host_copy)
    dtoh_launch = events.launch_start_us(dtoh)
    launches = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_launch_call)
    per_step = [_step_stalls(events, step, syncs, reads, inputs, dtoh, dtoh_launch, launches) for step in steps]
    idle_us, idle_count = _idle_totals(gaps)
    return HostStalls(steps=per_step, idle_by_cause_us=idle_us, idle_gaps_by_cause=idle_count)


def _step_stalls(events: TraceEvents, step: StepTiming, syncs: np.ndarray, reads: np.ndarray,
                 inputs: np.ndarray, dtoh: np.ndarray, dtoh_launch_us: np.ndarray, launches: np.ndarray) -> StepStalls:
    inside = (events.start_us >= step.start_us) & (events.start_us < step.end_us)
    copies = (dtoh_launch_us >= step.start_us) & (dtoh_launch_us < step.end_us)
    return StepStalls(
        step=step.step,
        sync_count=int(np.count_nonzero(syncs & inside)),
        sync_us=float(events.dur_us[syncs & inside].sum()),
        tensor_reads=int(np.count_nonzero(reads & inside)),
        dtoh_count=int(np.count_nonzero(copies)),
        dtoh_us=float(events.dur_us[dtoh][copies].sum()),
        input_wait_us=float(events.dur_us[inputs & inside].sum()),
        launch_count=int(np.count_nonzero(launches & inside)),
        launch_us=float(events.dur_us[launches & inside].sum()),
    )


def _idle_totals(gaps: IdleGaps | None) -> tuple[dict[str, float], dict[str, int]]:
    if gaps is None or not len(gaps):
        return {}, {}
    lengths = gaps.ends_us - gaps.starts_us
    codes = gaps.cause_codes
    idle_us = {c: float(lengths[codes == GAP_CAUSES.index(c)].sum()) for c in GAP_CAUSES
               if np.any(codes == GAP_CAUSES.index(c))}
    idle_count = {c: int(np.count_nonzero(codes == GAP_CAUSES.index(c))) for c in idle_us}
    return idle_us, idle_count


def gap_causes(gaps: Intervals, input_time: Intervals, comm_time: Intervals, blocked: Intervals,
               queued_before: np.ndarray | None = None) -> np.ndarray:
    """The cause (IDLE_CAUSES) of each gap; `blocked`: host syncs and tensor reads, slack included;
    `queued_before`: per gap, the work after it was launched before it began (None: unknown)."""
    lengths = gaps.ends_us - gaps.starts_us
    by_input = covered_between(input_time, gaps.starts_us, gaps.ends_us) >= 0.5 * lengths
    by_comm = covered_between(comm_time, gaps.starts_us, gaps.ends_us) >= 0.5 * lengths
    blocked = union(blocked)
    slot = np.searchsorted(blocked.starts_us, gaps.starts_us, side="right") - 1
    by_sync = (slot >= 0) & (blocked.ends_us[np.clip(slot, 0, None)] >= gaps.starts_us) if len(blocked) else \
        np.zeros(len(gaps), dtype=bool)
    by_device = queued_before if queued_before is not None else np.zeros(len(gaps), dtype=bool)
    return np.select([by_input, by_comm, by_sync, lengths < SHORT_GAP_US, by_device],
                     [IDLE_INPUT, IDLE_HOST_COMM, IDLE_SYNC, IDLE_SHORT, IDLE_DEVICE], default=IDLE_HOST)
