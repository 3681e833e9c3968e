"""Where the host held the GPU back: syncs, tensor reads, device-to-host copies, input waits, and a cause
for every GPU idle gap inside the profiled steps.

Per step (events assigned by their host start, GPU copies by their launch):
  - sync_count / sync_us: CUDA calls that block the host until the GPU is done (names.HOST_SYNC_CALLS),
    and the host time spent blocked in them;
  - tensor_reads: `aten::_local_scalar_dense` calls (`.item()` and friends; each copies and syncs);
  - dtoh_count / dtoh_us: device-to-host copies and their GPU time;
  - input_wait_us: DataLoader fetches (`enumerate(DataLoader)#...`), host wall time;
  - launch_count / launch_us: launch calls (names.HOST_LAUNCH_CALLS) and the host time inside them: the
    evidence that a GPU waiting for the host waits for launches (and not for other host work);
  - pageable_copy_count / pageable_copy_us: copies from or to pageable host memory and the host time inside
    their copy calls (the call returns when the copy is done: nothing overlaps it).
With `with_stack`, `frames` names the program's own Python frames (names.is_program_frame: the innermost
frame outside torch and other libraries) that hold the host's syncs, tensor reads and pageable copies,
with their count and host time over the profiled steps.
GPU idle gaps are the time inside the steps where no kernel, copy or fill runs. Each gets the first cause
that applies:
  - IDLE_INPUT: at least half of it is covered by a DataLoader fetch;
  - IDLE_HOST_COMM: at least half of it is covered by communication on the host (gloo spans, c10d
    ops): the GPU waits for a collective that runs on the CPU;
  - IDLE_GC: at least half of it is covered by a garbage collection (with_stack traces: torch.profiler's
    `Python GC` events, `gc.collect()` frames; names.is_gc_frame): the interpreter stopped to collect;
  - IDLE_ALLOCATOR: at least half of it the host is inside cudaMalloc / cudaFree (step_work.ALLOCATOR_CALLS): the
    caching allocator went to the driver, and the host's work around those calls (the allocator's own path, a
    cudaFree's device-wide wait) is part of the same gap;
  - IDLE_SYNC: it starts while the host is blocked in a sync, a tensor read or a copy to pageable memory's wait
    for the work queued before it (pageable_read_waits), or within SYNC_SLACK_US after one returns (the GPU
    drained, and waits for the host to launch again);
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

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, LONG_HOST_OP_US, NO_ID, Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import Intervals, clip, covered_between, subtract, union, union_of
from fleetscope.analysis.per_rank.names import (
    is_comm_cpu_op,
    is_compiled_graph_call,
    is_device_to_host_copy,
    is_dynamic_shape_op,
    is_gc_frame,
    is_gloo_span,
    is_host_sync_call,
    is_input_wait,
    is_launch_call,
    is_pageable_copy,
    is_program_frame,
    is_tensor_read_op,
)
from fleetscope.analysis.per_rank.step_work import ALLOCATOR_CALLS, compile_intervals
from fleetscope.analysis.per_rank.steps import StepTiming, in_host_ranges, recorded_op_starts
from fleetscope.analysis.per_rank.utilization import BASIS_CPU, BASIS_GPU, Timeline, gpu_known_from_us

IDLE_INPUT, IDLE_HOST_COMM, IDLE_SYNC = "input wait", "host collective", "host sync"
IDLE_SHORT, IDLE_DEVICE, IDLE_HOST = "short gaps", "device dependency", "host busy elsewhere"
IDLE_GC = "garbage collection"
IDLE_ALLOCATOR = "allocator calls"
IDLE_CAUSES = (IDLE_INPUT, IDLE_HOST_COMM, IDLE_GC, IDLE_ALLOCATOR, IDLE_SYNC, IDLE_SHORT, IDLE_DEVICE, IDLE_HOST)
IDLE_NO_OP = "no op running"
GAP_CAUSES = IDLE_CAUSES + (IDLE_NO_OP,)
"""Every cause an IdleGaps entry can carry, by code."""
SYNC_SLACK_US = 20.0
SHORT_GAP_US = 10.0
DISPATCH_INTERVAL_FACTOR = 4.0
"""An idle gap is the host dispatching when it holds a launch call at least every DISPATCH_INTERVAL_FACTOR x the
host's own median interval between launch calls in the steps: eager PyTorch's host cost per kernel (Python,
dispatch, autograd, the launch; a few us to tens of us, more under the profiler) is what paces its launches,
while a host busy with its own work (Python, a CPU-built batch, I/O) leaves long gaps with few launches.
Never more than DISPATCH_INTERVAL_MAX_US per launch: eager layers profiled with shapes launch every 100-170 us
(measured: bench/planted's launch-bound programs on the H200, 90% of their gaps under 170 us a launch), Python
work between launches takes milliseconds (tokenization, a CPU-built batch: 1-20 ms gaps with a launch or two)."""
DISPATCH_INTERVAL_MAX_US = 300.0


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
    """Launch calls (names.HOST_LAUNCH_CALLS: kernels, graphs, async copies and fills) the host made in the step,
    the pageable copies' calls left out (pageable_copy_count: the call is the copy, not launch overhead)."""
    launch_us: float = 0.0
    """Host time inside them: what replaying the step as a CUDA graph could save on the host."""
    pageable_copy_count: int = 0
    """Copies from or to pageable host memory launched in the step."""
    pageable_copy_us: float = 0.0
    """Host time inside their copy calls."""
    pageable_copy_bytes: int = 0
    """Bytes those copies moved (the copies' `bytes` args; 0 where the trace does not record them)."""
    pageable_copy_gpu_us: float = 0.0
    """GPU time of those copies (the copy itself; the host's call also holds its wait for the GPU work queued
    before it, which the stream would run first anyway)."""
    pageable_copy_queued_us: float = 0.0
    """Host time inside those copy calls, before each copy began, while the GPU ran other work: the wait for the
    work queued before the copy, which a pinned, non-blocking copy waits for on the GPU too."""
    pageable_copy_refill_us: float = 0.0
    """GPU idle right after those copies, each up to its queued wait: the call returned with the GPU's queue
    drained, as after a sync, and the GPU waits while the host launches again; a host that was that far ahead
    would have had the next work queued."""
    sync_dispatch_us: float = 0.0
    """Host time in the outermost data-dependent-shape ops that sync (names.is_dynamic_shape_op: boolean-mask
    indexing, its backward, masked_select, unique), outside their sync calls: the host work that keeping shapes
    static removes, which the step loses where the GPU waits for the host."""


@dataclass(frozen=True, kw_only=True)
class HostFrame:
    """A frame of the program that holds host stalls (with_stack traces)."""

    frame: str
    """`file.py(LINE): function`, as the trace names it."""
    what: str
    """FRAME_SYNC (syncs and tensor reads) or FRAME_PAGEABLE_COPY."""
    count: int
    us: float
    """Host time of those calls over the profiled steps."""


FRAME_SYNC, FRAME_PAGEABLE_COPY = "sync", "pageable copy"
FRAMES_KEPT = 5
"""Frames kept per kind of stall, the costliest first."""
FRAME_CALLS_LOOKED_AT = 2000
"""Stall calls whose frame is looked up per rank (the longest): bounds the work on traces with millions."""


@dataclass(frozen=True, kw_only=True)
class HostStalls:
    """One rank's host stalls over its profiled steps (module docstring)."""

    steps: list[StepStalls] = field(default_factory=list)
    idle_by_cause_us: dict[str, float] = field(default_factory=dict)
    """GPU idle time inside the steps by cause (IDLE_CAUSES); empty for CPU-only traces."""
    idle_gaps_by_cause: dict[str, int] = field(default_factory=dict)
    """Number of idle gaps by cause."""
    frames: list[HostFrame] = field(default_factory=list)
    """with_stack traces: the program's frames that hold its syncs and pageable copies; empty otherwise."""
    steps_span_us: float = 0.0
    """The profiled steps' own spans (each step's bounding span, StepTiming), their union: what the idle gaps
    and the GPU's busy time inside the steps partition (GPU basis)."""
    steps_busy_us: float = 0.0
    """GPU work (kernels, copies, fills) inside those spans, its union: busy + idle by cause = steps_span_us."""
    sync_ops: list[SyncOp] = field(default_factory=list)
    """What made the host sync in the profiled steps, by op (sync_ops), costliest first."""
    launch_paced_idle_us: float = 0.0
    """Of the "host busy elsewhere" idle, the time in gaps during which the host launched work at least every
    DISPATCH_INTERVAL_FACTOR x its median launch interval: the GPU waits for the host to dispatch its next
    kernels (eager per-op overhead),
    not for other work; summed over the profiled steps."""
    dispatch_ops: int = 0
    """Ops, ranges and runtime calls recorded inside the short gaps and the gaps paced by launch calls, summed
    over the profiled steps (the table's and those it leaves out): each lengthened that idle by the profiler's
    cost of recording it."""
    op_held_idle_us: dict[str, float] = field(default_factory=dict)
    """Of the "host busy elsewhere" idle not paced by launch calls, the time the host spent inside one long call
    (LONG_HOST_OP_US) of an op that hands the GPU work, by the innermost such op, summed over the profiled steps,
    largest first (_op_held_idle_us)."""
    launch_idle_us: float = 0.0
    """The host's time inside launch calls (copies from pageable memory left out) while the GPU was idle in the
    steps, summed over the profiled steps (_launch_idle_us)."""
    launch_call_us: float | None = None
    """The median launch call as recorded (CUPTI's callbacks included); None without launches. The host's own
    speed under the profiler, which sets its cost per recorded event too (advise/model.py)."""


@dataclass(frozen=True, kw_only=True)
class SyncOp:
    """The host op that made the host wait for the GPU (sync_ops), over the profiled steps."""

    op: str
    """The op whose copy to the host preceded the sync (`aten::nonzero`, `aten::_local_scalar_dense` for
    `.item()`, `aten::copy_` for `.cpu()` / `.tolist()`), or SYNC_EXPLICIT for a sync after no such copy."""
    count: int
    us: float
    """Host time from the op's first launch to the end of its sync, summed: what the op holds the host for
    once it has started the GPU work it then waits on."""


SYNC_EXPLICIT = "synchronize (no copy to the host before it)"


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
    # each step's own span (the GPU's when it bounds the step: a host that runs ahead ends its range early)
    spans = measured_spans(events, steps, timeline.basis)
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
    syncs = user_syncs(events)
    reads = device_reads(events)
    inputs = host & events.names_matching(is_input_wait)
    host_comm = host & events.names_matching(lambda n: is_gloo_span(n) or is_comm_cpu_op(n))
    collections = events.of_kind(Kind.PYTHON_FUNCTION) & events.names_matching(is_gc_frame)
    allocator = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(lambda n: n in ALLOCATOR_CALLS)
    blocking = syncs | reads
    waits = pageable_read_waits(events)
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    gaps = subtract(spans, union(Intervals(events.start_us[gpu], events.end_us[gpu])))
    queued = queued_before(events, gpu, gaps)
    causes = gap_causes(gaps, Intervals(events.start_us[inputs], events.end_us[inputs]),
                        Intervals(events.start_us[host_comm], events.end_us[host_comm]),
                        union_of(Intervals(events.start_us[blocking], events.end_us[blocking] + SYNC_SLACK_US),
                                 Intervals(waits.starts_us, waits.ends_us + SYNC_SLACK_US)),
                        queued_before=queued,
                        collecting=Intervals(events.start_us[collections], events.end_us[collections]),
                        allocating=Intervals(events.start_us[allocator], events.end_us[allocator]))
    code_of = {cause: code for code, cause in enumerate(GAP_CAUSES)}
    codes = np.fromiter(map(code_of.__getitem__, causes.tolist()), dtype=np.int8, count=len(causes))
    blocked = union_of(Intervals(events.start_us[blocking], events.end_us[blocking]), waits)
    found = _sync_share_of_gaps(IdleGaps(basis=BASIS_GPU, starts_us=gaps.starts_us, ends_us=gaps.ends_us,
                                         cause_codes=codes), blocked, queued)
    return _allocator_share_of_gaps(found, union(Intervals(events.start_us[allocator], events.end_us[allocator])))


def _allocator_share_of_gaps(gaps: IdleGaps, allocating: Intervals) -> IdleGaps:
    """A "host busy elsewhere" gap the host spent partly inside cudaMalloc / cudaFree is the allocator's for
    that time (its first part, drawn so), the host's for the rest: without the calls the gap would be shorter
    by them."""
    host_code = GAP_CAUSES.index(IDLE_HOST)
    busy = np.flatnonzero(gaps.cause_codes == host_code)
    if not busy.size or not len(allocating):
        return gaps
    covered = covered_between(allocating, gaps.starts_us[busy], gaps.ends_us[busy])
    split, covered = busy[covered > 0], covered[covered > 0]
    if not split.size:
        return gaps
    cut = gaps.starts_us[split] + covered
    starts = np.concatenate([gaps.starts_us, cut])
    ends = np.concatenate([gaps.ends_us, gaps.ends_us[split]])
    ends[split] = cut
    codes = gaps.cause_codes.copy()
    codes[split] = GAP_CAUSES.index(IDLE_ALLOCATOR)
    codes = np.concatenate([codes, np.full(split.size, host_code, dtype=np.int8)])
    keep = ends > starts
    order = np.argsort(starts[keep], kind="stable")
    return IdleGaps(basis=gaps.basis, starts_us=starts[keep][order], ends_us=ends[keep][order],
                    cause_codes=codes[keep][order])


def _sync_share_of_gaps(gaps: IdleGaps, blocked: Intervals, queued: np.ndarray | None = None) -> IdleGaps:
    """The GPU idle a sync costs: the host waited in it for the work queued before it (its lead over the GPU),
    and once it returns the GPU idles while the host launches again, until the queue is rebuilt. So the gap after
    a sync is the sync's for as long as the host waited in it, and what that wait leaves is charged to the
    host-paced gaps that follow (the refill: gaps whose next work was not queued before them), until it is spent,
    work was queued again, or a gap of another cause comes (a collection, a checkpoint's host work is that pause's).
    The rest of each gap stays the host's. A host that never led the GPU (a host-bound step) waits in a sync for
    almost nothing, and its syncs are charged almost nothing."""
    sync_code, host_code, short_code = (GAP_CAUSES.index(c) for c in (IDLE_SYNC, IDLE_HOST, IDLE_SHORT))
    codes = gaps.cause_codes
    at_sync = np.flatnonzero(codes == sync_code)
    if not at_sync.size or not len(blocked):
        return gaps
    queued = queued if queued is not None else np.zeros(len(gaps), dtype=bool)
    paced = ((codes == host_code) | (codes == short_code)) & ~queued
    lengths = gaps.ends_us - gaps.starts_us
    slots = np.clip(np.searchsorted(blocked.starts_us, gaps.starts_us[at_sync], side="right") - 1, 0, None)
    leads = blocked.ends_us[slots] - blocked.starts_us[slots]
    taken = np.zeros(len(gaps))
    for _, row, charged in _refill_walk(lengths, paced, at_sync, leads):
        taken[row] = charged
    split = np.flatnonzero(taken > 0)
    if not split.size:
        return gaps
    rest = taken[split] < lengths[split]
    cut = gaps.starts_us[split] + taken[split]
    starts = np.concatenate([gaps.starts_us, cut[rest]])
    ends = np.concatenate([gaps.ends_us, gaps.ends_us[split][rest]])
    ends[split] = cut
    new_codes = codes.copy()
    new_codes[split] = sync_code
    remainder = np.where(codes[split][rest] == sync_code, host_code, codes[split][rest]).astype(np.int8)
    new_codes = np.concatenate([new_codes, remainder])
    order = np.argsort(starts, kind="stable")
    return IdleGaps(basis=gaps.basis, starts_us=starts[order], ends_us=ends[order], cause_codes=new_codes[order])


def _refill_walk(lengths: np.ndarray, paced: np.ndarray, first_rows: np.ndarray,
                leads: np.ndarray) -> Iterator[tuple[int, int, float]]:
    """The one walk of what a wait for the GPU costs after it: from each first gap (the one the wait ends in), the
    gap and then the host-paced gaps that follow (`paced`: the refill, while the host launches again), each
    charged up to what is left of the wait's lead over the GPU, until it is spent or a gap of another cause comes.
    Yields (which wait, gap row, charged us). Only the gaps right after each wait are walked: a Python loop over
    every gap of a rank costs seconds at scale."""
    for which, (row, lead) in enumerate(zip(first_rows.tolist(), leads.tolist())):
        first = row
        while lead > 0.0 and row < len(lengths) and (row == first or paced[row]):
            charged = min(float(lengths[row]), lead)
            yield which, row, charged
            lead -= charged
            row += 1


def queued_before(events: TraceEvents, gpu: np.ndarray, gaps: Intervals) -> np.ndarray:
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
    syncs = user_syncs(events)
    reads = device_reads(events)
    inputs = host & events.names_matching(is_input_wait)
    dtoh = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(is_device_to_host_copy)
    dtoh_launch = events.launch_start_us(dtoh)
    launches = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_launch_call)
    pageable = _PageableCopies.of(events)
    dispatch = _sync_dispatch(events, syncs)
    # a pageable copy's call is the copy (it returns when the copy is done), not launch overhead a graph replays
    per_step = _step_stalls(events, steps, syncs, reads, inputs, dtoh, dtoh_launch, launches & ~pageable_copy_calls(events),
                            pageable, dispatch, gaps)
    idle_us, idle_count = _idle_totals(gaps)
    inside = in_host_ranges(events.start_us, steps)
    # a tensor read holds its sync: the sync calls (where recorded) are the host's blocked time, counted once
    frames = (_frames(events, syncs if syncs.any() else reads, inside, FRAME_SYNC)
              + _frames_of_calls(events, pageable.call_start_us, pageable.call_end_us, pageable.thread, FRAME_PAGEABLE_COPY,
                                 in_host_ranges(pageable.call_start_us, steps)))
    span, busy = _steps_partition(events, steps)
    op_starts = recorded_op_starts(events)
    paced = _paced_gaps(events, gaps, launches, op_starts)
    return HostStalls(steps=per_step, idle_by_cause_us=idle_us, idle_gaps_by_cause=idle_count, frames=frames,
                      steps_span_us=span, steps_busy_us=busy,
                      sync_ops=sync_ops(events, syncs & inside, launches),
                      launch_paced_idle_us=_launch_paced_idle_us(events, paced),
                      dispatch_ops=_dispatch_ops(gaps, paced, op_starts),
                      op_held_idle_us=_op_held_idle_us(events, paced, launches),
                      launch_idle_us=_launch_idle_us(events, gaps, launches & ~pageable_copy_calls(events)),
                      launch_call_us=float(np.median(events.dur_us[launches])) if launches.any() else None)


def sync_ops(events: TraceEvents, syncs: np.ndarray, launches: np.ndarray) -> list[SyncOp]:
    """Per op, the syncs it caused: a sync call is charged to the op that launched the last GPU work before it
    on its thread when that work is a copy to the host (the op reads a device value: `.item()`, `.tolist()`,
    boolean-mask indexing's `nonzero` reading its count), else to SYNC_EXPLICIT. Its cost runs from the op's
    first launch to the sync's end."""
    if not syncs.any() or events.external_id is None:
        return []
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS) & (events.correlation != NO_ID)
    by_correlation = dict(zip(events.correlation[gpu].tolist(), np.flatnonzero(gpu).tolist()))
    first_launch: dict[int, float] = {}
    launched_at = events.launch_start_us(gpu)
    for external, at in zip(events.external_id[gpu].tolist(), launched_at.tolist()):
        if external != NO_ID and at < first_launch.get(external, float("inf")):
            first_launch[external] = at
    costs: dict[str, list[float]] = {}
    launch_rows = np.flatnonzero(launches)
    for index in np.flatnonzero(syncs).tolist():
        op, since = _sync_op(events, index, launch_rows, by_correlation, first_launch)
        entry = costs.setdefault(op, [0, 0.0])
        entry[0] += 1
        entry[1] += float(events.end_us[index]) - (since if since is not None else float(events.start_us[index]))
    ranked = sorted(costs.items(), key=lambda item: (-item[1][1], item[0]))
    return [SyncOp(op=op, count=int(count), us=us) for op, (count, us) in ranked]


def _sync_op(events: TraceEvents, index: int, launch_rows: np.ndarray, by_correlation: dict[int, int],
             first_launch: dict[int, float]) -> tuple[str, float | None]:
    """(op, its first launch) of the sync at `index` (sync_ops)."""
    thread, start = events.thread[index], events.start_us[index]
    mine = launch_rows[(events.thread[launch_rows] == thread) & (events.start_us[launch_rows] <= start)]
    if not mine.size:
        return SYNC_EXPLICIT, None
    last = int(mine[np.argmax(events.start_us[mine])])
    work = by_correlation.get(int(events.correlation[last]))
    if work is None or not is_device_to_host_copy(events.names[events.name_id[work]]):
        return SYNC_EXPLICIT, None
    external = int(events.external_id[work])
    return events.op_of_external.get(external, "unknown op"), first_launch.get(external)


def _sync_dispatch(events: TraceEvents, syncs: np.ndarray) -> Intervals:
    """The host time in the outermost data-dependent-shape ops holding a sync, outside the sync calls
    (StepStalls.sync_dispatch_us), as intervals on the host's clock (every thread's, merged)."""
    dynamic = events.of_kind(Kind.CPU_OP) & events.names_matching(is_dynamic_shape_op)
    if not dynamic.any() or not syncs.any():
        return Intervals.of([], [])
    holding: list[int] = []
    for thread in np.unique(events.thread[dynamic]).tolist():
        ops = np.flatnonzero(dynamic & (events.thread == thread))
        calls = np.sort(events.start_us[syncs & (events.thread == thread)])
        held = np.searchsorted(calls, events.end_us[ops], side="right") > np.searchsorted(calls, events.start_us[ops])
        holding.extend(ops[held].tolist())
    if not holding:
        return Intervals.of([], [])
    rows = np.asarray(holding)
    ops = union(Intervals(events.start_us[rows], events.end_us[rows]))
    waits = union(Intervals(events.start_us[syncs], events.end_us[syncs]))
    return subtract(ops, waits)


def measured_spans(events: TraceEvents, steps: list[StepTiming], basis: str) -> Intervals:
    """The union of the steps' spans that idle and busy partition: on the GPU basis, from where the recorded GPU
    timeline is known (utilization.gpu_known_from_us: before it the GPU ran work the trace does not hold)."""
    spans = union(Intervals.of([s.span_start_us for s in steps], [s.span_end_us for s in steps]))
    return spans if basis == BASIS_CPU else clip(spans, gpu_known_from_us(events), float("inf"))


def _steps_partition(events: TraceEvents, steps: list[StepTiming]) -> tuple[float, float]:
    """(the steps' measured spans, the GPU work inside them) in us; busy 0 on a CPU trace."""
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    if not gpu.any():
        return measured_spans(events, steps, BASIS_CPU).total_us, 0.0
    spans = measured_spans(events, steps, BASIS_GPU)
    busy = union(Intervals(events.start_us[gpu], events.end_us[gpu]))
    inside = sum(float(covered_between(busy, np.array([a]), np.array([b]))[0])
                 for a, b in zip(spans.starts_us.tolist(), spans.ends_us.tolist()))
    return spans.total_us, inside


def user_syncs(events: TraceEvents) -> np.ndarray:
    """Sync calls of the program: those outside torch.compile's ranges (Inductor's benchmarking of candidate
    kernels while it compiles syncs too; that is compilation, found by step_work.py, not the program's sync),
    and not a host-to-device copy's own (copy_owned_syncs)."""
    syncs = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_host_sync_call)
    syncs &= ~copy_owned_syncs(events, syncs)
    regions = compile_intervals(events)
    if not syncs.any() or not len(regions):
        return syncs
    inside = covered_between(regions, events.start_us, np.maximum(events.end_us, events.start_us + 1e-3)) > 0
    return syncs & ~inside


def copy_owned_syncs(events: TraceEvents, syncs: np.ndarray) -> np.ndarray:
    """The syncs that finish a copy from host memory: the last launch on the sync's thread before it put a
    host-to-device copy on the GPU (`tensor.to('cuda')` from pageable memory copies, then synchronizes the
    stream before the host buffer may change). That wait is the copy's (pinned_copies), not a read of a
    device value."""
    owned = np.zeros(len(events), dtype=bool)
    copies = events.of_kind(Kind.GPU_MEMCPY) & (events.correlation != NO_ID)
    if not syncs.any() or not copies.any():
        return owned
    from_host = {int(c) for c, name in zip(events.correlation[copies].tolist(), events.name_id[copies].tolist())
                 if _is_host_to_device(events.names[name])}
    if not from_host:
        return owned
    launches = np.flatnonzero(events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_launch_call)
                              & (events.correlation != NO_ID))
    for thread in np.unique(events.thread[syncs]).tolist():
        mine = launches[events.thread[launches] == thread]
        if not mine.size:
            continue
        rows = np.flatnonzero(syncs & (events.thread == thread))
        previous = np.searchsorted(events.start_us[mine], events.start_us[rows], side="left") - 1
        known = previous >= 0
        last = events.correlation[mine[np.clip(previous, 0, None)]]
        owned[rows] = known & np.fromiter((int(c) in from_host for c in last.tolist()), dtype=bool, count=rows.size)
    return owned


def _is_host_to_device(name: str) -> bool:
    return name.startswith("Memcpy HtoD")


def device_reads(events: TraceEvents) -> np.ndarray:
    """Tensor reads (`aten::_local_scalar_dense`) of device tensors: those holding a CUDA runtime call (the copy
    to the host and its sync) on their thread. `.item()` of a CPU tensor (an optimizer's step counter, a
    Python-side metric) reads host memory and waits for nothing. A trace without runtime calls cannot tell:
    every read counts."""
    reads = events.of_kind(Kind.CPU_OP) & events.names_matching(is_tensor_read_op)
    regions = compile_intervals(events)
    if reads.any() and len(regions):
        reads &= ~(covered_between(regions, events.start_us, np.maximum(events.end_us, events.start_us + 1e-3)) > 0)
    runtime = events.of_kind(Kind.CUDA_RUNTIME)
    if not reads.any() or not runtime.any():
        return reads
    held = np.zeros(len(events), dtype=bool)
    for thread in np.unique(events.thread[reads]).tolist():
        calls = np.sort(events.start_us[runtime & (events.thread == thread)])
        mine = np.flatnonzero(reads & (events.thread == thread))
        first = np.searchsorted(calls, events.start_us[mine], side="left")
        last = np.searchsorted(calls, events.end_us[mine], side="right")
        held[mine] = last > first
    return held


def _launch_paced_idle_us(events: TraceEvents, paced: PacedGaps | None) -> float:
    """The "host busy elsewhere" idle time in gaps paced by launch calls (DISPATCH_INTERVAL_FACTOR), and in other
    gaps with a launch the part the host spent inside a compiled graph's call: that is the generated wrapper
    launching the graph's next kernel (names.COMPILED_GRAPH_CALL), which a CUDA graph's replay removes however
    long it takes."""
    if paced is None:
        return 0.0
    starts, ends, is_paced, count = paced
    wrapper = np.where((count > 0) & ~is_paced, _inside_compiled_calls_us(events, starts, ends), 0.0)
    return float((ends - starts)[is_paced].sum() + wrapper.sum())


PacedGaps = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""The "host busy elsewhere" gaps' starts and ends, which are paced (dispatch), and the launch calls in each."""


def _paced_gaps(events: TraceEvents, gaps: IdleGaps | None, launches: np.ndarray,
                op_starts: np.ndarray) -> PacedGaps | None:
    """The "host busy elsewhere" gaps (starts, ends), which of them are paced by launch calls, and the launch
    calls in each; None where no gap or fewer than two launches."""
    if gaps is None or not len(gaps) or gaps.basis != BASIS_GPU or np.count_nonzero(launches) < 2:
        return None
    busy = gaps.cause_codes == GAP_CAUSES.index(IDLE_HOST)
    starts, ends = gaps.starts_us[busy], gaps.ends_us[busy]
    count, by_launches = _paced_by(np.sort(events.start_us[launches]), starts, ends)
    ops, by_ops = _paced_by(op_starts, starts, ends)
    # a gap with a launch whose ops come as often as the host's ops do is dispatch too: the ops between its
    # launches (views, casts, autograd's bookkeeping) launch nothing and cost the host as much each
    return starts, ends, (count > 0) & (by_launches | (by_ops & (ops > 0))), count


def _paced_by(calls: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per gap, the calls (sorted starts) inside it, and whether they pace it: at least one every
    DISPATCH_INTERVAL_FACTOR x the median interval between the calls (at most DISPATCH_INTERVAL_MAX_US)."""
    count = np.searchsorted(calls, ends, side="right") - np.searchsorted(calls, starts, side="left")
    if calls.size < 2:
        return count, np.zeros(starts.size, dtype=bool)
    typical = min(float(np.median(np.diff(calls))) * DISPATCH_INTERVAL_FACTOR, DISPATCH_INTERVAL_MAX_US)
    return count, (ends - starts) <= typical * np.maximum(count, 1)


def _launch_idle_us(events: TraceEvents, gaps: IdleGaps | None, launches: np.ndarray) -> float:
    """The host's time inside launch calls while the GPU was idle in the steps (GPU basis), summed over the
    profiled steps: the launch overhead that holds the GPU back, where the calls while it runs cost nothing."""
    if gaps is None or not len(gaps) or gaps.basis != BASIS_GPU or not launches.any():
        return 0.0
    calls = union(Intervals(events.start_us[launches], events.end_us[launches]))
    return float(covered_between(calls, gaps.starts_us, gaps.ends_us).sum())


def _op_held_idle_us(events: TraceEvents, paced: PacedGaps | None, launches: np.ndarray) -> dict[str, float]:
    """Of the "host busy elsewhere" idle not paced by launch calls, the part the host spent inside one call of an
    op that hands the GPU work (a launch call inside it) and lasted at least LONG_HOST_OP_US, by the innermost
    such op, summed over the profiled steps, largest first: the host held by that op's own host side (cuDNN
    building a plan or autotuning for a new shape, a library's setup), not work of the program's that launches
    nothing."""
    calls = _long_launching_calls(events, launches)
    if paced is None or calls is None:
        return {}
    starts, ends, is_paced, _ = paced
    starts, ends = starts[~is_paced], ends[~is_paced]
    names, call_starts, call_ends = calls
    held: dict[str, float] = {}
    names = np.asarray(names, dtype=object)
    for name in set(names.tolist()):
        mine = names == name
        covered = float(covered_between(union(Intervals(call_starts[mine], call_ends[mine])), starts, ends).sum())
        if covered > 0.0:
            held[name] = covered
    return dict(sorted(held.items(), key=lambda item: -item[1]))


def _long_launching_calls(events: TraceEvents, launches: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """The innermost host op calls of at least LONG_HOST_OP_US that hold a launch call on their thread: those the
    table keeps and those it leaves out (events.py long_host_ops). None where there is none."""
    kept = np.flatnonzero(events.of_kind(Kind.CPU_OP) & (events.dur_us >= LONG_HOST_OP_US))
    names = [events.names[i] for i in events.name_id[kept].tolist()]
    starts, ends, threads = events.start_us[kept], events.end_us[kept], events.thread[kept]
    if events.long_host_ops is not None:
        names += events.long_host_ops.names
        starts = np.concatenate((starts, events.long_host_ops.start_us))
        ends = np.concatenate((ends, events.long_host_ops.end_us))
        threads = np.concatenate((threads, events.long_host_ops.thread))
    if not names:
        return None
    launching = np.zeros(len(names), dtype=bool)
    for thread in np.unique(threads).tolist():
        mine = threads == thread
        at = np.sort(events.start_us[launches & (events.thread == thread)])
        launching[mine] = np.searchsorted(at, ends[mine]) > np.searchsorted(at, starts[mine])
    # innermost: ordered by thread, start and longest first, a call whose next call on its thread starts inside
    # it holds that call (a thread's ops nest)
    order = np.lexsort((-(ends - starts), starts, threads))
    order = order[launching[order]]
    if not order.size:
        return None
    holds = np.zeros(order.size, dtype=bool)
    holds[:-1] = (threads[order][1:] == threads[order][:-1]) & (starts[order][1:] < ends[order][:-1])
    inner = order[~holds]
    return [names[i] for i in inner.tolist()], starts[inner], ends[inner]


def _dispatch_ops(gaps: IdleGaps | None, paced: PacedGaps | None, op_starts: np.ndarray) -> int:
    """Ops, ranges and runtime calls recorded inside the dispatch gaps (short gaps and gaps paced by launch
    calls), summed over the profiled steps: the events whose recording the profiler added to that idle."""
    if gaps is None or not len(gaps) or gaps.basis != BASIS_GPU:
        return 0
    short = gaps.cause_codes == GAP_CAUSES.index(IDLE_SHORT)
    starts, ends = [gaps.starts_us[short]], [gaps.ends_us[short]]
    if paced is not None:
        starts.append(paced[0][paced[2]])
        ends.append(paced[1][paced[2]])
    low, high = np.concatenate(starts), np.concatenate(ends)
    return int((np.searchsorted(op_starts, high, side="left") - np.searchsorted(op_starts, low, side="left")).sum())


def _inside_compiled_calls_us(events: TraceEvents, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How much of each gap the host spent inside a compiled graph's call."""
    called = events.of_kind(Kind.USER_ANNOTATION, Kind.CPU_OP) & events.names_matching(is_compiled_graph_call)
    if not called.any():
        return np.zeros(starts.size)
    return covered_between(union(Intervals(events.start_us[called], events.end_us[called])), starts, ends)


_AT_GAP_US = 1e-3
"""A gap starting this close to a copy's end follows it."""


@dataclass(frozen=True, kw_only=True)
class _PageableCopies:
    """Pageable copies with their copy calls on the host (matched by correlation id)."""

    call_start_us: np.ndarray
    call_end_us: np.ndarray
    thread: np.ndarray
    copied_bytes: np.ndarray
    gpu_us: np.ndarray
    queued_us: np.ndarray
    gpu_end_us: np.ndarray
    to_device: np.ndarray
    """Per copy: from the host to the device (the host then has nothing to wait for; a copy to the host is a
    read, pageable_read_waits)."""

    @classmethod
    def of(cls, events: TraceEvents) -> "_PageableCopies":
        copies = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(is_pageable_copy)
        starts, ends = events.launch_start_us(copies), events.launch_end_us(copies)
        called = ends > starts          # a copy without its call (no cuda_runtime event) has no host time
        threads = events.launch_thread(copies)
        sizes = (np.maximum(events.copy_bytes[copies], 0) if events.copy_bytes is not None
                 else np.zeros(starts.size, dtype=np.int64))
        other = events.of_kind(*GPU_ACTIVITY_KINDS) & ~copies
        before = np.clip(np.minimum(events.start_us[copies][called], ends[called]), starts[called], None)
        queued = (covered_between(union(Intervals(events.start_us[other], events.end_us[other])), starts[called], before)
                  if other.any() else np.zeros(before.size))
        return cls(call_start_us=starts[called], call_end_us=ends[called], thread=threads[called],
                   copied_bytes=sizes[called], gpu_us=events.dur_us[copies][called], queued_us=queued,
                   gpu_end_us=events.end_us[copies][called],
                   to_device=np.array([_is_host_to_device(events.names[n]) for n in events.name_id[copies][called]],
                                      dtype=bool))

    def refill_us(self, gaps: "IdleGaps | None") -> np.ndarray:
        """Per copy from the host to the device, the idle gap starting where it ended and the host-paced gaps
        after it, up to the copy's queued wait (pageable_copy_refill_us; the refill _sync_share_of_gaps charges a
        sync). After a copy to the host the GPU idles while the host uses what it read: that refill is the
        read's (pageable_read_waits), which pinned memory would not remove."""
        refill = np.zeros(self.gpu_end_us.size)
        if gaps is None or not len(gaps) or not refill.size:
            return refill
        paced = np.isin(gaps.cause_codes, [GAP_CAUSES.index(IDLE_HOST), GAP_CAUSES.index(IDLE_SHORT)])
        lengths = gaps.ends_us - gaps.starts_us
        slot = np.clip(np.searchsorted(gaps.starts_us, self.gpu_end_us - _AT_GAP_US), 0, len(gaps) - 1)
        follows = np.abs(gaps.starts_us[slot] - self.gpu_end_us) < _AT_GAP_US
        walked = np.flatnonzero(follows & (self.queued_us > 0) & self.to_device)
        for which, _, charged in _refill_walk(lengths, paced, slot[walked], self.queued_us[walked]):
            refill[walked[which]] += charged
        return refill


def pageable_copy_calls(events: TraceEvents) -> np.ndarray:
    """The host calls (matched by correlation id) of the copies from or to pageable memory."""
    copies = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(is_pageable_copy) & (events.correlation != NO_ID)
    calls = np.zeros(len(events), dtype=bool)
    if copies.any():
        runtime = events.of_kind(Kind.CUDA_RUNTIME) & (events.correlation != NO_ID)
        calls[runtime] = np.isin(events.correlation[runtime], events.correlation[copies])
    return calls


def pageable_read_waits(events: TraceEvents) -> Intervals:
    """The host's waits in its copies from the device to pageable memory (`.cpu()`, `.tolist()`, `.numpy()`):
    each call returns only when its copy is done, after all the work queued before it, so from the call until
    its copy begins the host waits for the GPU as in a sync, and the values it then uses are what it waited
    for. A pinned, non-blocking copy would move that wait to the first use, not remove it: the GPU's idle after
    the call is the read's (host_syncs), not the copy's. The copy's own transfer is no wait for other work (a
    checkpoint's copies of an idle GPU's tensors wait for nothing)."""
    copies = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(
        lambda n: is_pageable_copy(n) and is_device_to_host_copy(n))
    if not copies.any():
        return Intervals(np.empty(0), np.empty(0))
    starts, ends = events.launch_start_us(copies), events.launch_end_us(copies)
    called = ends > starts          # a copy without its call (no cuda_runtime event) has no host wait
    began = np.clip(events.start_us[copies], starts, ends)
    return union(Intervals(starts[called], began[called]))


def _frames(events: TraceEvents, calls: np.ndarray, inside: np.ndarray, what: str) -> list[HostFrame]:
    chosen = calls & inside
    return _frames_of_calls(events, events.start_us[chosen], events.end_us[chosen], events.thread[chosen], what,
                            np.ones(int(chosen.sum()), dtype=bool))


def _frames_of_calls(events: TraceEvents, starts: np.ndarray, ends: np.ndarray, threads: np.ndarray, what: str,
                     inside: np.ndarray) -> list[HostFrame]:
    """The innermost program frame enclosing each call on its thread, summed per frame."""
    python = events.of_kind(Kind.PYTHON_FUNCTION)
    if not python.any() or not inside.any():
        return []
    program = python & events.names_matching(is_program_frame)
    f_start, f_end = events.start_us[program], events.end_us[program]
    f_thread, f_name = events.thread[program], events.name_id[program]
    starts, ends, threads = starts[inside], ends[inside], threads[inside]
    longest = np.argsort(starts - ends, kind="stable")[:FRAME_CALLS_LOOKED_AT]
    totals: dict[int, list[float]] = {}
    for index in longest.tolist():
        holds = (f_start <= starts[index]) & (f_end >= ends[index]) & (f_thread == threads[index])
        if not holds.any():
            continue
        candidates = np.flatnonzero(holds)
        innermost = candidates[np.argmax(f_start[candidates])]
        entry = totals.setdefault(int(f_name[innermost]), [0, 0.0])
        entry[0] += 1
        entry[1] += float(ends[index] - starts[index])
    ranked = sorted(totals.items(), key=lambda item: (-item[1][1], events.names[item[0]]))[:FRAMES_KEPT]
    return [HostFrame(frame=events.names[name], what=what, count=int(count), us=us) for name, (count, us) in ranked]


def _step_stalls(events: TraceEvents, steps: list[StepTiming], syncs: np.ndarray, reads: np.ndarray,
                 inputs: np.ndarray, dtoh: np.ndarray, dtoh_launch_us: np.ndarray, launches: np.ndarray,
                 pageable: _PageableCopies, dispatch: Intervals, gaps: IdleGaps | None = None) -> list[StepStalls]:
    """Each step's stalls: every event is placed in its step once (a search over the steps' starts), then summed
    per step, so the cost is linear in events whatever the number of steps."""
    count = len(steps)
    of_event = _step_index(events.start_us, steps)
    of_copy = _step_index(dtoh_launch_us, steps)
    of_paged = _step_index(pageable.call_start_us, steps)

    def per_step(index: np.ndarray, mask: np.ndarray | None, values: np.ndarray | None) -> np.ndarray:
        chosen = index >= 0 if mask is None else mask & (index >= 0)
        weights = None if values is None else values[chosen]
        return np.bincount(index[chosen], weights=weights, minlength=count)

    dur = events.dur_us
    dispatch_us = (covered_between(dispatch, np.array([s.start_us for s in steps]), np.array([s.end_us for s in steps]))
                   if len(dispatch) else np.zeros(count))
    columns = dict(
        sync_count=per_step(of_event, syncs, None), sync_us=per_step(of_event, syncs, dur),
        tensor_reads=per_step(of_event, reads, None),
        dtoh_count=per_step(of_copy, None, None), dtoh_us=per_step(of_copy, None, dur[dtoh]),
        input_wait_us=per_step(of_event, inputs, dur),
        launch_count=per_step(of_event, launches, None), launch_us=per_step(of_event, launches, dur),
        pageable_copy_count=per_step(of_paged, None, None),
        pageable_copy_us=per_step(of_paged, None, pageable.call_end_us - pageable.call_start_us),
        pageable_copy_bytes=per_step(of_paged, None, pageable.copied_bytes.astype(np.float64)),
        pageable_copy_gpu_us=per_step(of_paged, None, pageable.gpu_us),
        pageable_copy_queued_us=per_step(of_paged, None, pageable.queued_us),
        pageable_copy_refill_us=per_step(of_paged, None, pageable.refill_us(gaps)))
    counted = {"sync_count", "tensor_reads", "dtoh_count", "launch_count", "pageable_copy_count", "pageable_copy_bytes"}
    return [StepStalls(step=step.step, sync_dispatch_us=float(dispatch_us[i]),
                       **{name: int(round(values[i])) if name in counted else float(values[i])
                          for name, values in columns.items()})
            for i, step in enumerate(steps)]


def _step_index(times_us: np.ndarray, steps: list[StepTiming]) -> np.ndarray:
    """Index (into `steps`) of the step whose host range [start, end) holds each time, -1 outside every step;
    where ranges overlap, the latest-starting one."""
    starts = np.asarray([s.start_us for s in steps], dtype=np.float64)
    ends = np.asarray([s.end_us for s in steps], dtype=np.float64)
    order = np.argsort(starts, kind="stable")
    slot = np.searchsorted(starts[order], times_us, side="right") - 1
    index = order[np.clip(slot, 0, None)] if order.size else np.zeros(np.shape(times_us), dtype=np.int64)
    inside = (slot >= 0) & (times_us < ends[index]) if order.size else np.zeros(np.shape(times_us), dtype=bool)
    return np.where(inside, index, -1)


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
               queued_before: np.ndarray | None = None, collecting: Intervals | None = None,
               allocating: Intervals | None = None) -> np.ndarray:
    """The cause (IDLE_CAUSES) of each gap; `blocked`: host syncs and tensor reads, slack included;
    `queued_before`: per gap, the work after it was launched before it began (None: unknown); `collecting`:
    the host's garbage collections (None: none recorded); `allocating`: the host's cudaMalloc / cudaFree calls
    (None: none)."""
    lengths = gaps.ends_us - gaps.starts_us
    by_input = covered_between(input_time, gaps.starts_us, gaps.ends_us) >= 0.5 * lengths
    by_comm = covered_between(comm_time, gaps.starts_us, gaps.ends_us) >= 0.5 * lengths
    by_gc, by_allocator = (_half_covered(during, gaps, lengths) for during in (collecting, allocating))
    blocked = union(blocked)
    slot = np.searchsorted(blocked.starts_us, gaps.starts_us, side="right") - 1
    by_sync = (slot >= 0) & (blocked.ends_us[np.clip(slot, 0, None)] >= gaps.starts_us) if len(blocked) else \
        np.zeros(len(gaps), dtype=bool)
    by_device = queued_before if queued_before is not None else np.zeros(len(gaps), dtype=bool)
    return np.select([by_input, by_comm, by_gc, by_allocator, by_sync, lengths < SHORT_GAP_US, by_device],
                     [IDLE_INPUT, IDLE_HOST_COMM, IDLE_GC, IDLE_ALLOCATOR, IDLE_SYNC, IDLE_SHORT, IDLE_DEVICE],
                     default=IDLE_HOST)


def _half_covered(during: Intervals | None, gaps: Intervals, lengths: np.ndarray) -> np.ndarray:
    """Per gap: `during` (host intervals; None: none recorded) covers at least half of it."""
    if during is None or not len(during):
        return np.zeros(len(gaps), dtype=bool)
    return covered_between(union(during), gaps.starts_us, gaps.ends_us) >= 0.5 * lengths
