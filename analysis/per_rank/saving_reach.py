"""How much of a saving in GPU time reaches the end of the step: the one owner of that what-if.

A kernel that runs faster ends earlier, and the GPU work queued behind it starts earlier, until the GPU next
waits for the host: an idle gap in which the GPU waits for the host's launches (the host was busy with work of
its own) absorbs the saving, as the next kernel is launched when the host gets to it, no sooner. A gap in which
the host waited for the GPU (a sync, a read of a device value, cudaFree's implicit sync) and everything the host
did after that wait passes the saving on: the host resumes as soon as the GPU is done. A gap behind another
stream's work (a device dependency) passes it on too. So, walking a step's GPU work and its idle gaps in time
order (host_stalls.find_idle_gaps), a saving is carried forward, reduced by each absorbing gap, and what is left at
the step's end is the step's saving. Host time the GPU does not wait for is none of this (the rules that save
host time bound their gain by the GPU's idle instead).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fleetscope.analysis.per_rank.host_stalls import (GAP_CAUSES, IDLE_ALLOCATOR, IDLE_DEVICE, IDLE_SYNC,
                                                      IdleGaps)
from fleetscope.analysis.per_rank.events import TraceEvents
from fleetscope.analysis.per_rank.step_work import TENSOR_CORE_SPEEDUP, StepWork, fp32_math_rows
from fleetscope.analysis.per_rank.steps import StepTiming
from fleetscope.analysis.per_rank.utilization import BASIS_GPU

PASSING_CAUSES = frozenset((IDLE_SYNC, IDLE_ALLOCATOR, IDLE_DEVICE))
"""Gap causes in which the host (or another stream) waited for the GPU: an earlier end passes through them."""
_PASSING_CODES = np.array([cause in PASSING_CAUSES for cause in GAP_CAUSES], dtype=bool)
_CONTIGUOUS_US = 1e-3


def step_saving_us(gaps: IdleGaps | None, steps: list[StepTiming], ends_us: np.ndarray,
                   savings_us: np.ndarray) -> float | None:
    """The mean per step of the saving that reaches each step's end when GPU activities ending at `ends_us` each
    run `savings_us` shorter (module docstring); None without GPU idle gaps to judge by."""
    if gaps is None or gaps.basis != BASIS_GPU or not steps:
        return None
    passing = _passing(gaps)
    total = 0.0
    for step in steps:
        total += _carried_to_end(gaps, passing, step.span_start_us, step.span_end_us, ends_us, savings_us)
    return total / len(steps)


def with_fp32_saving(work: StepWork | None, events: TraceEvents, steps: list[StepTiming],
                     gaps: IdleGaps | None) -> StepWork | None:
    """`work` with StepWork.fp32_saving_us: the fp32 math TENSOR_CORE_SPEEDUP times faster, what reaches the end."""
    if work is None or not (work.gemm_us_by_precision.get("fp32") or work.conv_fp32_us):
        return work
    rows = fp32_math_rows(events, steps)
    saving = step_saving_us(gaps, steps, events.end_us[rows], events.dur_us[rows] * (1.0 - 1.0 / TENSOR_CORE_SPEEDUP))
    return dataclasses.replace(work, fp32_saving_us=saving)


def _passing(gaps: IdleGaps) -> np.ndarray:
    """Per gap, whether it passes a saving on: its cause's, or (for the part of a gap after a sync that
    host_stalls splits off as the host's own) the gap it continues without a break."""
    passing = _PASSING_CODES[gaps.cause_codes.astype(np.int64)]
    for index in range(1, len(gaps)):
        if not passing[index] and passing[index - 1] \
                and abs(gaps.starts_us[index] - gaps.ends_us[index - 1]) <= _CONTIGUOUS_US:
            passing[index] = True
    return passing


def _carried_to_end(gaps: IdleGaps, passing: np.ndarray, start_us: float, end_us: float, ends_us: np.ndarray,
                    savings_us: np.ndarray) -> float:
    inside = (ends_us > start_us) & (ends_us <= end_us) & (savings_us > 0)
    mine = (gaps.starts_us >= start_us) & (gaps.starts_us < end_us) & ~passing
    # (time, 0 = a saving that arrives, 1 = a gap that absorbs; amount)
    moments = sorted([(t, 0, s) for t, s in zip(ends_us[inside].tolist(), savings_us[inside].tolist())]
                     + [(a, 1, b - a) for a, b in zip(gaps.starts_us[mine].tolist(), gaps.ends_us[mine].tolist())])
    carried = 0.0
    for _, what, amount in moments:
        carried = carried + amount if what == 0 else max(carried - amount, 0.0)
    return carried
