"""How much of a saving in GPU time reaches the end of the step: the one owner of that what-if.

A kernel that runs faster ends earlier, and the GPU work queued behind it starts earlier: the GPU's timeline
moves earlier by the saving so far. The host's timeline moves only where the host waited for the GPU (a sync, a
read of a device value, cudaFree's implicit sync): it resumes when the GPU is done, so from there on it is as
early as the GPU. An idle gap in which the GPU waits for a launch the host makes on its own schedule (busy with
work of its own, not waiting for the GPU) takes the GPU's lead back by its own length, no further than the
host's lead: on the profiled timeline the next kernel starts when the host launches it, so all of the lead is
lost there, but the profiler slows the host, and a host only just behind the GPU for one launch (most such gaps
are a few microseconds) is ahead of it unprofiled; charging each gap its length is the estimate that holds in
both regimes. A gap behind another stream's work (a device dependency) keeps it. Walking a step's GPU work
and its idle gaps in time order (host_stalls.find_idle_gaps), what the GPU's timeline has gained at the step's
end is the step's saving. So a host-bound step gains nothing from faster kernels before its host waits, and a
step whose host syncs at its end gains all of it. A change that removes GPU work also removes its launches:
the host time inside those launch calls (a few microseconds each, or far more where the call blocked in the
driver) leaves the host's timeline, which then runs earlier by it, and a gap in which the GPU waited for the
host gives the GPU back up to that lead (never more than the gap and the GPU's own lead: a kernel cannot start
before the work ahead of it ends). A change that removes ops, not only kernels (one fused kernel for a chain of
passes), removes their host work too: from the launch before each to its own (dispatch_host_saving). Other host
time the GPU does not wait for is none of this (the rules that save host time bound their gain by the GPU's idle
instead).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fleetscope.analysis.per_rank.host_stalls import (GAP_CAUSES, IDLE_ALLOCATOR, IDLE_DEVICE, IDLE_SYNC,
                                                      IdleGaps, queued_before, user_syncs)
from fleetscope.analysis.per_rank.intervals import Intervals, covered_between, union
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, NO_ID, Kind, TraceEvents
from fleetscope.analysis.per_rank.names import is_device_to_host_copy, is_pageable_copy, is_tensor_read_op
from fleetscope.analysis.per_rank.step_work import (TENSOR_CORE_SPEEDUP, StepWork, fp32_math_rows, routed_loop_rows,
                                                    score_gemm_excess, score_pass_rows)
from fleetscope.analysis.per_rank.steps import StepTiming
from fleetscope.analysis.per_rank.utilization import BASIS_GPU

HOST_WAITED_CAUSES = frozenset((IDLE_SYNC, IDLE_ALLOCATOR))
"""Gap causes in which the host waited for the GPU: the host's timeline catches up with the GPU's."""
KEPT_CAUSES = frozenset((IDLE_DEVICE,))
"""Gap causes in which the GPU waited for its own work (another stream): the GPU keeps its lead."""
_WAITED = 0
_KEPT = 1
_PACED = 2
_AT_US = 1e-3
_KIND_OF_CODE = np.array([_WAITED if cause in HOST_WAITED_CAUSES else _KEPT if cause in KEPT_CAUSES else _PACED
                          for cause in GAP_CAUSES], dtype=np.int8)


@dataclasses.dataclass(frozen=True)
class HostSaving:
    """Host time a change removes: `savings_us` of the host's own time, each ending at `ends_us`."""

    ends_us: np.ndarray
    savings_us: np.ndarray


def step_saving_us(gaps: IdleGaps | None, steps: list[StepTiming], ends_us: np.ndarray,
                   savings_us: np.ndarray, queued: np.ndarray | None = None,
                   waited: np.ndarray | None = None, host: HostSaving | None = None) -> float | None:
    """The mean per step of the saving that reaches each step's end when GPU activities ending at `ends_us` each
    run `savings_us` shorter (module docstring); None without GPU idle gaps to judge by. `queued`: per gap, the
    work after it had been launched before it began (host_stalls.queued_before): whatever the gap's cause, the
    GPU then waited on itself, not on a launch, and keeps its lead. `waited`: per gap, the host waited for the GPU
    just before it whatever its cause says (after_blocking_copies). `host`: the host time the change removes
    with that GPU work (its launch calls)."""
    if gaps is None or gaps.basis != BASIS_GPU or not steps:
        return None
    kinds = _KIND_OF_CODE[gaps.cause_codes.astype(np.int64)]
    if queued is not None:
        kinds = np.where(queued & (kinds == _PACED), np.int8(_KEPT), kinds)
    if waited is not None:
        kinds = np.where(waited, np.int8(_WAITED), kinds)
    total = 0.0
    for step in steps:
        total += _gained_by_end(gaps, kinds, *gpu_span(step), ends_us, savings_us, host)
    return total / len(steps)


def gpu_span(step: StepTiming) -> tuple[float, float]:
    """Where a step's saving is walked: the GPU's span of the step (its work launched inside the host's range)
    where the trace has one, since the walk moves the GPU's timeline; a host far ahead of the queue ends its range
    long before the GPU runs that work (a GPU-bound step the host times as long as the GPU does). Else the span
    that is the step time."""
    if step.gpu_start_us is None or step.gpu_ms is None:
        return step.span_start_us, step.span_end_us
    return step.gpu_start_us, step.gpu_start_us + step.gpu_ms * 1000.0


_GPU_SAVING, _HOST_SAVING = -2, -1


def _gained_by_end(gaps: IdleGaps, kinds: np.ndarray, start_us: float, end_us: float, ends_us: np.ndarray,
                   savings_us: np.ndarray, host: HostSaving | None = None) -> float:
    # (time, what: a saving that arrives on the GPU or the host, else the gap's kind; the saving or the gap's length)
    moments = _savings_between(ends_us, savings_us, start_us, end_us, _GPU_SAVING)
    if host is not None:
        moments += _savings_between(host.ends_us, host.savings_us, start_us, end_us, _HOST_SAVING)
    mine = (gaps.starts_us >= start_us) & (gaps.starts_us < end_us)
    moments += [(a, int(k), b - a) for a, b, k in zip(gaps.starts_us[mine].tolist(), gaps.ends_us[mine].tolist(),
                                                      kinds[mine].tolist())]
    gpu_lead = host_lead = 0.0
    for _, what, amount in sorted(moments):
        if what == _GPU_SAVING:
            gpu_lead += amount
        elif what == _HOST_SAVING:
            host_lead += amount
        elif what == _WAITED:
            host_lead = gpu_lead
        elif what == _PACED:
            gpu_lead = max(min(host_lead, gpu_lead + amount), gpu_lead - amount)
    return gpu_lead


def _savings_between(ends_us: np.ndarray, savings_us: np.ndarray, start_us: float, end_us: float,
                     what: int) -> list[tuple[float, int, float]]:
    inside = (ends_us > start_us) & (ends_us <= end_us) & (savings_us > 0)
    return [(t, what, s) for t, s in zip(ends_us[inside].tolist(), savings_us[inside].tolist())]


def with_savings(work: StepWork | None, events: TraceEvents, steps: list[StepTiming],
                 gaps: IdleGaps | None) -> StepWork | None:
    """`work` with the savings the rules read, as far as they reach the step's end: StepWork.fp32_saving_us (the
    fp32 math TENSOR_CORE_SPEEDUP times faster), StepWork.score_saving_us (the passes over a score matrix
    gone, fused into one attention kernel with the score GEMMs' excess, their ops' dispatch with them) and StepWork.value_use_saving_us (the
    host's use of the values its syncs read gone)."""
    if work is None or gaps is None:
        return work
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    queued = queued_before(events, gpu, Intervals(gaps.starts_us, gaps.ends_us))
    waited = after_blocking_copies(events, gaps)
    changes = {}
    if work.gemm_us_by_precision.get("fp32") or work.conv_fp32_us:
        rows = fp32_math_rows(events, steps)
        changes["fp32_saving_us"] = step_saving_us(gaps, steps, events.end_us[rows],
                                                   events.dur_us[rows] * (1.0 - 1.0 / TENSOR_CORE_SPEEDUP), queued, waited)
    if work.score_pass_us and not work.fused_attention_us:
        passes = score_pass_rows(events, steps)
        gemms, excess = score_gemm_excess(events, steps)
        rows = np.concatenate([passes, gemms])
        savings = np.concatenate([events.dur_us[passes], excess])
        changes["score_saving_us"] = step_saving_us(gaps, steps, events.end_us[rows], savings, queued, waited,
                                                    dispatch_host_saving(events, rows, user_syncs(events)))
    syncs = user_syncs(events)
    changes["value_use_saving_us"] = value_use_saving_us(events, steps, gaps, syncs)
    if work.routed_gemm_weights:
        changes["routed_loop_saving_us"] = routed_loop_saving_us(events, steps, gaps, syncs,
                                                                 routed_loop_rows(events, steps))
    return dataclasses.replace(work, **changes) if changes else work


def after_blocking_copies(events: TraceEvents, gaps: IdleGaps) -> np.ndarray:
    """Per gap, whether the GPU activity it follows is a copy to pageable host memory: the host's copy call
    returns only when that copy is done (`.cpu()`, torch.save of device tensors), so the host waited for the GPU
    there although no sync call is recorded."""
    copies = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(
        lambda n: is_pageable_copy(n) and is_device_to_host_copy(n))
    if not copies.any() or not len(gaps):
        return np.zeros(len(gaps), dtype=bool)
    ends = np.sort(events.end_us[copies])
    slot = np.clip(np.searchsorted(ends, gaps.starts_us), 0, ends.size - 1)
    return np.abs(ends[slot] - gaps.starts_us) < _AT_US


PYTHON_US_PER_VALUE = 0.1
"""The most host time the program's use of one value read to the host takes: a Python loop over a `.tolist()`
compares or sums each element in tens of nanoseconds. It bounds the host work right after a read that the read
exists for (nothing consumes a value kept on the device)."""
VALUE_BYTES = 8
"""The widest common element: a read's bytes over it count its values from below."""


def routed_loop_saving_us(events: TraceEvents, steps: list[StepTiming], gaps: IdleGaps,
                          syncs: np.ndarray, rows: np.ndarray) -> float | None:
    """What a loop over routed groups (`rows`: its kernels, step_work.routed_loop_rows) costs at the end of each
    step, mean per step, beyond the idle its reads leave: one grouped launch per GEMM does the groups' work
    without the host dispatching each group's ops, and without reading the counts. Each of the loop's kernels
    takes its launch's host time with it: from the previous launch on its thread to its own launch's end, less
    the sync calls in it. Walked with the syncs' waits gone too, less the waits alone (as value_use_saving_us).
    None without GPU idle gaps or such kernels."""
    if gaps.basis != BASIS_GPU or not steps or not rows.size:
        return None
    dispatch = dispatch_host_saving(events, rows, syncs)
    kinds = _walk_kinds(events, gaps, syncs)
    none = np.zeros(0)
    at_us, _, wait_us, _ = _reads(events, syncs) if syncs.any() else (none, none, none, none)

    def walk(host: HostSaving) -> float:
        return sum(_gained_by_end(gaps, kinds, *gpu_span(s), none, none, host)
                   for s in steps) / len(steps)

    both = HostSaving(ends_us=np.concatenate([at_us, dispatch.ends_us]),
                      savings_us=np.concatenate([wait_us, dispatch.savings_us]))
    return max(walk(both) - walk(HostSaving(ends_us=at_us, savings_us=wait_us)), 0.0)


def dispatch_host_saving(events: TraceEvents, rows: np.ndarray, syncs: np.ndarray) -> HostSaving:
    """The host time that dispatched the GPU work at `rows`: each launch's, from the previous launch on its thread
    to its own launch's end (the op's work on the host, its launch call), less the sync calls in it. A change that
    removes those ops (not only their kernels) removes that time from the host's timeline."""
    selected = np.zeros(len(events), dtype=bool)
    selected[rows] = True
    ends, threads = events.launch_end_us(selected), events.launch_thread(selected)
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    all_ends, all_threads = events.launch_end_us(gpu), events.launch_thread(gpu)
    waits = union(Intervals(events.start_us[syncs], events.end_us[syncs]))
    dispatch = np.zeros(ends.size)
    for thread in np.unique(threads[threads != NO_ID]).tolist():
        launched = np.unique(all_ends[all_threads == thread])
        mine = np.flatnonzero(threads == thread)
        slot = np.searchsorted(launched, ends[mine], side="left") - 1
        previous = np.where(slot >= 0, launched[np.clip(slot, 0, None)], ends[mine])
        dispatch[mine] = (ends[mine] - previous) - covered_between(waits, previous, ends[mine])
    return HostSaving(ends_us=ends, savings_us=np.clip(dispatch, 0.0, None))


def _walk_kinds(events: TraceEvents, gaps: IdleGaps, syncs: np.ndarray) -> np.ndarray:
    """The gaps' kinds for a walk in which the syncs are gone: the gaps they left are paced by the host's
    launches, a gap behind queued work keeps the GPU's lead, one after a blocking copy other than the syncs'
    reads still waits."""
    sync_code = GAP_CAUSES.index(IDLE_SYNC)
    kinds = _KIND_OF_CODE[gaps.cause_codes.astype(np.int64)]
    kinds = np.where(gaps.cause_codes == sync_code, np.int8(_PACED), kinds)
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    queued = queued_before(events, gpu, Intervals(gaps.starts_us, gaps.ends_us))
    kinds = np.where(queued & (kinds == _PACED), np.int8(_KEPT), kinds)
    if syncs.any():
        # the copies the reads made no longer hold the host: only other blocking copies (a checkpoint's) still do
        at_us, until_us, _, _ = _reads(events, syncs)
        reads = union(Intervals(at_us, np.maximum(until_us, at_us)))
        in_read = covered_between(reads, gaps.starts_us, gaps.starts_us + _AT_US) > 0
    else:
        in_read = np.zeros(len(gaps), dtype=bool)
    waited = after_blocking_copies(events, gaps) & (gaps.cause_codes != sync_code) & ~in_read
    return np.where(waited, np.int8(_WAITED), kinds)


def value_use_saving_us(events: TraceEvents, steps: list[StepTiming], gaps: IdleGaps | None,
                        syncs: np.ndarray) -> float | None:
    """What the program's use of the values its syncs read (`syncs`: host_stalls.user_syncs) costs at the end of
    each step, mean per step: the host time right after each read, up to the next host event on its thread and
    at most PYTHON_US_PER_VALUE per value read (a `.tolist()` looped over in Python), which reading nothing
    removes. Walked with the waits gone too, less the waits alone (the module docstring's walk, with the gaps
    the syncs left paced by the host's launches): the waits' own cost is the idle charged to the syncs
    (host_stalls.py). None without GPU idle gaps or syncs."""
    if gaps is None or gaps.basis != BASIS_GPU or not steps or not syncs.any():
        return None
    at_us, _, wait_us, use_us = _reads(events, syncs)
    if not use_us.any():
        return 0.0
    kinds = _walk_kinds(events, gaps, syncs)
    none = np.zeros(0)

    def walk(savings_us: np.ndarray) -> float:
        host = HostSaving(ends_us=at_us, savings_us=savings_us)
        return sum(_gained_by_end(gaps, kinds, *gpu_span(s), none, none, host)
                   for s in steps) / len(steps)

    return max(walk(wait_us + use_us) - walk(wait_us), 0.0)


def _reads(events: TraceEvents, syncs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per sync call: (when its read began, when it ended, the host's wait in the call, the use of the values
    read). The read: the tensor-read op around the call (names.is_tensor_read_op: `.item()`'s), else from the
    launch of the last copy to
    the host on the thread since its previous sync (`.cpu()`, `.tolist()`: GPU traces keep few host ops, their
    copies' launches always), else the call alone (an explicit synchronize). The use: value_use_saving_us."""
    rows = np.flatnonzero(syncs)
    at, until, wait = events.start_us[rows].copy(), events.end_us[rows].copy(), events.dur_us[rows].copy()
    use = np.zeros(rows.size)
    reading = events.of_kind(Kind.CPU_OP) & events.names_matching(is_tensor_read_op)
    host = events.of_kind(Kind.CPU_OP, Kind.CUDA_RUNTIME)
    copies = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(is_device_to_host_copy)
    copy_at, copy_thread = events.launch_start_us(copies), events.launch_thread(copies)
    copy_bytes = (np.maximum(events.copy_bytes[copies], 0).astype(np.float64) if events.copy_bytes is not None
                  else np.zeros(int(np.count_nonzero(copies))))
    for thread in np.unique(events.thread[rows]).tolist():
        mine = np.flatnonzero(events.thread[rows] == thread)
        mine = mine[np.argsort(events.start_us[rows[mine]], kind="stable")]
        call_start, call_end = events.start_us[rows[mine]], events.end_us[rows[mine]]
        ops = _outermost(events, np.flatnonzero(reading & (events.thread == thread)))
        start = _read_starts(events, ops, call_start, call_end, np.sort(copy_at[copy_thread == thread]))
        end = call_end.copy()
        if ops.size:
            slot = np.searchsorted(events.start_us[ops], call_start, side="right") - 1
            held = (slot >= 0) & (events.end_us[ops[np.clip(slot, 0, None)]] >= call_end)
            end[held] = np.maximum(end[held], events.end_us[ops[slot[held]]])
        next_host = np.sort(events.start_us[host & (events.thread == thread)])
        following = next_host[np.clip(np.searchsorted(next_host, end, side="left"), 0, next_host.size - 1)]
        gap = np.where(following >= end, following - end, 0.0)
        values = _bytes_launched(copy_at[copy_thread == thread], copy_bytes[copy_thread == thread], start, end) / VALUE_BYTES
        at[mine], until[mine] = start, end
        use[mine] = np.minimum(gap, values * PYTHON_US_PER_VALUE)
    return at, until, wait, use


def _read_starts(events: TraceEvents, ops: np.ndarray, call_start: np.ndarray, call_end: np.ndarray,
                 copy_launches: np.ndarray) -> np.ndarray:
    """Per sync call of one thread (sorted by start), where its read began (_reads; `ops`: the outermost read ops
    of the thread)."""
    start = call_start.copy()
    previous_end = np.concatenate([[-np.inf], call_end[:-1]])
    if copy_launches.size:
        slot = np.searchsorted(copy_launches, call_start, side="right") - 1
        launched = copy_launches[np.clip(slot, 0, None)]
        read = (slot >= 0) & (launched > previous_end)
        start[read] = launched[read]
    if ops.size:
        slot = np.searchsorted(events.start_us[ops], call_start, side="right") - 1
        held = (slot >= 0) & (events.end_us[ops[np.clip(slot, 0, None)]] >= call_end)
        start[held] = np.minimum(start[held], events.start_us[ops[slot[held]]])
    return start


def _outermost(events: TraceEvents, rows: np.ndarray) -> np.ndarray:
    """Of ops on one thread, those no other of them encloses, sorted by start."""
    if not rows.size:
        return rows
    rows = rows[np.argsort(events.start_us[rows], kind="stable")]
    ends = events.end_us[rows]
    reach = np.maximum.accumulate(ends)
    nested = np.zeros(rows.size, dtype=bool)
    nested[1:] = events.start_us[rows[1:]] < reach[:-1]
    return rows[~nested]


def _bytes_launched(at_us: np.ndarray, nbytes: np.ndarray, starts_us: np.ndarray, ends_us: np.ndarray) -> np.ndarray:
    """Per interval, the bytes of the copies launched inside it."""
    order = np.argsort(at_us, kind="stable")
    total = np.concatenate([[0.0], np.cumsum(nbytes[order])])
    sorted_at = at_us[order]
    return total[np.searchsorted(sorted_at, ends_us, side="right")] - total[np.searchsorted(sorted_at, starts_us, side="left")]
