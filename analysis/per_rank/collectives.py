"""Collective calls of one rank, keyed so the same collective can be found on every rank.

A collective instance is identified by `(step, name, ordinal)`: the ordinal-th collective of that name issued
during that step. Every rank issues a process group's collectives in the same order, so the key matches
across ranks without relying on clocks. Where the trace names each collective's process group (NCCL kernels
in recent PyTorch carry `Process Group Name`), the group is part of the name: a tensor-parallel all-reduce
of ranks {0,1} and one of ranks {2,3} are different instances, and each is compared among its own members
only. gloo spans and host ops name no group: there, all ranks' collectives are matched in issue order,
which is exact for data-parallel runs and pairs up corresponding groups' collectives in 2-D runs.
Newer PyTorch also numbers each collective of a group (`Seq`, names.SEQUENCE_ARG): where every member's
calls of a group carry that number, cross_rank/matching.py keys the group's instances by it instead of the
ordinal (exact even when a rank's window starts a collective later or misses one); `sequence` keeps it.

Where a rank's collective time comes from, by what the trace holds:
  - GPU traces: communication kernels (`ncclKernel_*`, `ncclDevKernel_*`); start = when the GPU reached the
    collective (an early rank's kernel starts early and spins until the last rank arrives), end = when data
    was exchanged. The step is the one that launched the kernel (CUDA correlation), else the one it ran in.
  - gloo traces: `gloo:*` spans on the `pt_gloo_runloop` threads.
  - otherwise: host collective ops (`c10d::*`, functional collectives).
Point-to-point sends and receives are no collectives and are left out (p2p.py keeps them).
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.comm_bytes import MessageSizes, message_sizes
from fleetscope.analysis.per_rank.events import Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import Intervals, covered_between
from fleetscope.analysis.per_rank.names import (
    PHASES,
    TRAIN_STEP,
    collective_name,
    is_comm_kernel,
    is_gloo_span,
)
from fleetscope.analysis.per_rank.p2p import point_to_point_mask
from fleetscope.analysis.per_rank.steps import StepTiming

SOURCE_NCCL = "nccl kernels"
SOURCE_GLOO = "gloo spans"
SOURCE_HOST = "host collective ops"
NO_STEP = -1


def step_label(step: int, prefix: str = "") -> str:
    """How reports name a step ("3", or with prefix "step 3"); collectives issued outside every
    profiled step carry NO_STEP and read "outside steps"."""
    return "outside steps" if step == NO_STEP else f"{prefix}{step}"


CollectiveKey = tuple[int, str, int]
"""(step or NO_STEP, collective name, ordinal of that name within the step); for a group matched by
sequence numbers (cross_rank/matching.py) the third element is the group's sequence number instead."""


@dataclass(frozen=True, kw_only=True)
class CollectiveCalls:
    """One rank's collectives in issue order; times in the trace's own clock (microseconds)."""

    source: str | None
    keys: list[CollectiveKey]
    start_us: np.ndarray
    end_us: np.ndarray
    interval_compute_us: np.ndarray
    """Computation (the rank's compute set, utilization.py) between the end of its previous collective
    (or the start of the trace) and the end of this one. Collectives end at a common instant on every
    rank, so ranks are compared over the same interval: a rank with more work shows more of it."""
    sizes: MessageSizes | None = None
    """Bytes, type and group of each call (comm_bytes.py); None for traces without collectives."""
    compute_before_us: np.ndarray = field(default_factory=lambda: np.empty(0))
    """Computation from the later of the previous collective's end and the start of the collective's step
    to the collective's start: what the rank did in its step before arriving (critical_path.py)."""
    previous_end_us: np.ndarray = field(default_factory=lambda: np.empty(0))
    """End of the rank's previous collective: the latest end, among those issued before it, at or before its start
    (_previous_ends); -inf where none."""
    phases: tuple[str, ...] = ()
    """The phase (`forward`, `backward`, `optimizer_step`; "" for none) whose host range contains each
    collective's issue time: DDP's gradient-bucket all-reduces are issued inside `backward`."""
    sequence: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    """The process group's sequence number of each call (names.SEQUENCE_ARG), -1 where the trace records
    none; empty for traces without collectives."""

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def none(cls) -> "CollectiveCalls":
        return cls(source=None, keys=[], start_us=np.empty(0), end_us=np.empty(0), interval_compute_us=np.empty(0))


def find_collectives(events: TraceEvents, steps: list[StepTiming],
                     compute: Intervals | None = None, is_comm=is_comm_kernel) -> CollectiveCalls:
    """The rank's collective calls from the best source its trace offers; `compute` is the rank's
    computation (for interval_compute_us; none given: zeros); `is_comm(name)`: which kernels communicate
    (names.comm_kernel_rule)."""
    compute = compute if compute is not None else Intervals.empty()
    collective = ~point_to_point_mask(events)
    kernels = events.of_kind(Kind.KERNEL) & events.names_matching(is_comm) & collective
    if kernels.any():
        return _keyed(events, kernels, events.launch_start_us(kernels), steps, compute, SOURCE_NCCL)
    gloo = events.names_matching(is_gloo_span) & collective
    if gloo.any():
        return _keyed(events, gloo, events.start_us[gloo], steps, compute, SOURCE_GLOO)
    host = events.of_kind(Kind.CPU_OP) & events.names_matching(_is_host_collective) & collective
    if host.any():
        return _keyed(events, host, events.start_us[host], steps, compute, SOURCE_HOST)
    return CollectiveCalls.none()


def _is_host_collective(name: str) -> bool:
    issued = name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::"))
    return issued and "wait" not in name


def _keyed(events: TraceEvents, mask: np.ndarray, issue_us: np.ndarray,
           steps: list[StepTiming], compute: Intervals, source: str) -> CollectiveCalls:
    indices = np.flatnonzero(mask)
    order = np.argsort(issue_us, kind="stable")
    indices, issue_us = indices[order], issue_us[order]
    step_of = _step_numbers(issue_us, steps)
    counts: dict[tuple[int, str], int] = {}
    keys = []
    for index, step in zip(indices, step_of):
        name = collective_name(events.names[events.name_id[index]], events.group_of(index))
        ordinal = counts.get((step, name), 0)
        counts[(step, name)] = ordinal + 1
        keys.append((int(step), name, ordinal))
    starts, ends = events.start_us[indices], events.end_us[indices]
    previous_end = _previous_ends(starts, ends)
    lower = np.maximum(previous_end, _step_starts(step_of, steps))
    return CollectiveCalls(source=source, keys=keys, start_us=starts, end_us=ends,
                           interval_compute_us=covered_between(compute, previous_end, ends),
                           sizes=message_sizes(events, indices),
                           compute_before_us=covered_between(compute, np.minimum(lower, starts), starts),
                           previous_end_us=previous_end, phases=_phases_at(events, issue_us),
                           sequence=events.sequence_of(indices))


def _previous_ends(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per collective (issue order), the latest end among the collectives issued before it that ended by its
    start; -inf where none did. The one issued just before may still be running (DDP's gradient buckets
    overlap): its end, after this start, would make the gap before this collective negative and its "carried"
    lateness the other bucket's."""
    previous = np.full(len(starts), -np.inf)
    ended: list[float] = []
    for index, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        position = bisect.bisect_right(ended, start)
        if position:
            previous[index] = ended[position - 1]
        bisect.insort(ended, end)
    return previous


def _step_starts(step_of: np.ndarray, steps: list[StepTiming]) -> np.ndarray:
    """Start of each collective's step; -inf outside every step."""
    start_of = {s.step: s.start_us for s in steps}
    return np.asarray([start_of.get(int(step), -np.inf) for step in step_of], dtype=np.float64)


def _phases_at(events: TraceEvents, times_us: np.ndarray) -> tuple[str, ...]:
    """The innermost-named phase range (other than train_step) around each time; "" outside all."""
    found = [""] * times_us.size
    host = events.of_kind(Kind.USER_ANNOTATION, Kind.CPU_OP)
    for phase in PHASES:
        if phase == TRAIN_STEP:
            continue
        mask = host & events.names_matching(lambda n, p=phase: n == p)
        starts, ends = events.start_us[mask], events.end_us[mask]
        if not starts.size:
            continue
        order = np.argsort(starts)
        starts, ends = starts[order], ends[order]
        slot = np.searchsorted(starts, times_us, side="right") - 1
        inside = (slot >= 0) & (times_us < ends[np.clip(slot, 0, None)])
        for index in np.flatnonzero(inside):
            found[index] = phase
    return tuple(found)


def _step_numbers(times_us: np.ndarray, steps: list[StepTiming]) -> np.ndarray:
    """The step whose host range contains each time; NO_STEP outside every step."""
    if not steps:
        return np.full(times_us.size, NO_STEP, dtype=np.int64)
    starts = np.asarray([s.start_us for s in steps])
    ends = np.asarray([s.end_us for s in steps])
    numbers = np.asarray([s.step for s in steps], dtype=np.int64)
    slot = np.searchsorted(starts, times_us, side="right") - 1
    inside = (slot >= 0) & (times_us < ends[np.clip(slot, 0, None)])
    return np.where(inside, numbers[np.clip(slot, 0, None)], NO_STEP)
