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
before the work ahead of it ends). Other host time the GPU does not wait for is none of this (the rules that
save host time bound their gain by the GPU's idle instead).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fleetscope.analysis.per_rank.host_stalls import (GAP_CAUSES, IDLE_ALLOCATOR, IDLE_DEVICE, IDLE_SYNC,
                                                      IdleGaps, queued_before)
from fleetscope.analysis.per_rank.intervals import Intervals
from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, Kind, TraceEvents
from fleetscope.analysis.per_rank.names import is_device_to_host_copy, is_pageable_copy
from fleetscope.analysis.per_rank.step_work import TENSOR_CORE_SPEEDUP, StepWork, fp32_math_rows, score_pass_rows
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
        total += _gained_by_end(gaps, kinds, step.span_start_us, step.span_end_us, ends_us, savings_us, host)
    return total / len(steps)


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
    fp32 math TENSOR_CORE_SPEEDUP times faster) and StepWork.score_saving_us (the passes over a score matrix
    gone, fused into one attention kernel)."""
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
        rows = score_pass_rows(events, steps)
        changes["score_saving_us"] = step_saving_us(gaps, steps, events.end_us[rows], events.dur_us[rows], queued, waited,
                                                    launch_calls(events, rows))
    return dataclasses.replace(work, **changes) if changes else work


def launch_calls(events: TraceEvents, rows: np.ndarray) -> HostSaving:
    """The host time inside the launch calls of the GPU work at `rows` (none where no launch is recorded)."""
    starts, ends = events.launch_start_us(rows), events.launch_end_us(rows)
    return HostSaving(ends_us=ends, savings_us=np.clip(ends - starts, 0.0, None))


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
