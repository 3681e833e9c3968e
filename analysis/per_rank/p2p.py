"""Point-to-point sends and receives of one rank, and the pipeline stage compute around them.

Sends and receives are not collectives (names.point_to_point_kind): collectives.py leaves them out, and
this module keeps them for the pipeline analysis (cross_rank/pipeline.py). Where the time comes from:
  - gloo: the `gloo:send` / `gloo:recv` spans; a recv span lasts until the data has arrived, so it is
    the time the rank waited for its peer (the schedule blocks on it before the next compute);
  - NCCL: the `SendRecv` kernels (not the all-to-alls, names.py);
  - otherwise the `c10d::send` / `c10d::recv_` host ops.
fleetscope's pipeline stages also write, right before each op, a `pp_p2p[...]` marker naming its peer,
micro-batch and direction, and once per step a `pp_schedule[...]` marker (traces/formats.py); the k-th
marker of a kind (send / recv) in a step belongs to the k-th op of that kind in that step. The stage's
compute of each micro-batch is its `pp_forward` / `pp_backward` ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.events import Kind, TraceEvents
from fleetscope.analysis.per_rank.names import (P2P_RECV, P2P_SEND, is_all_to_all_call, is_comm_cpu_op, is_comm_kernel,
                                                point_to_point_kind)
from fleetscope.analysis.per_rank.steps import StepTiming
from fleetscope.traces.formats import (P2P_MARKER_PREFIX, PP_BACKWARD, PP_FORWARD, PP_SCHEDULE_PREFIX,
                                       ScheduleMarker, parse_p2p_marker, parse_schedule_marker)

SOURCE_GLOO = "gloo spans"
SOURCE_NCCL = "nccl SendRecv kernels"
SOURCE_HOST = "host send/recv ops"
OUTSIDE_STEPS = -1


@dataclass(frozen=True, kw_only=True)
class P2PCall:
    """One send or receive; times in the trace's own clock (microseconds)."""

    step: int
    """The step it was issued in (OUTSIDE_STEPS: none)."""
    kind: str
    """names.P2P_SEND, P2P_RECV or P2P_UNKNOWN."""
    ordinal: int
    """Its place among the rank's calls of this kind in this step."""
    start_us: float
    end_us: float
    peer: int | None = None
    """Global rank of the other side (from the stage's marker; None without one)."""
    direction: str | None = None
    """forward (activations) or backward (gradients), from the marker."""
    microbatch: int | None = None


@dataclass(frozen=True, kw_only=True)
class StageCompute:
    """One `pp_forward` / `pp_backward` range: a stage's compute of one micro-batch."""

    step: int
    direction: str
    """forward or backward"""
    duration_us: float


@dataclass(frozen=True, kw_only=True)
class PointToPoint:
    """A rank's point-to-point traffic and pipeline bookkeeping in one trace."""

    source: str | None
    calls: list[P2PCall] = field(default_factory=list)
    compute: list[StageCompute] = field(default_factory=list)
    schedule: ScheduleMarker | None = None
    """The pipeline schedule the rank's marker names (None: no fleetscope pipeline marker)."""

    @classmethod
    def none(cls) -> "PointToPoint":
        return cls(source=None)


def point_to_point_kinds(events: TraceEvents) -> dict[int, str]:
    """Event index -> kind of every send or receive (names.point_to_point_kind); decided per distinct name,
    and per event only for NCCL SendRecv kernels (whose arg or launching op may say all-to-all)."""
    named = events.names_matching(lambda n: point_to_point_kind(n) is not None)
    kinds = {}
    inside_all_to_all = _launched_inside_all_to_all(events, named & events.of_kind(Kind.KERNEL))
    for index in np.flatnonzero(named):
        name = events.names[events.name_id[index]]
        if is_comm_kernel(name):
            if inside_all_to_all.get(int(index)):
                continue
            message = events.message_of(int(index))
            launching = None
            if events.external_id is not None and events.external_id[index] >= 0:
                launching = events.op_of_external.get(int(events.external_id[index]))
            kind = point_to_point_kind(name, message[0] if message else None, launching)
        else:
            kind = point_to_point_kind(name)
        if kind is not None:
            kinds[int(index)] = kind
    return kinds


def _launched_inside_all_to_all(events: TraceEvents, kernels: np.ndarray) -> dict[int, bool]:
    """Per SendRecv kernel, whether its launch call ran inside an all-to-all call on its thread (`nccl:all_to_all`,
    `c10d::alltoall_base_`, `all_to_all_single`): the whole launching stack, not only the innermost op, which in
    PyTorch 2.0-2.2 traces is a `record_param_comms` naming no collective. NCCL runs all-to-alls as SendRecv."""
    calls = (events.of_kind(Kind.CPU_OP, Kind.USER_ANNOTATION)
             & events.names_matching(lambda n: is_comm_cpu_op(n) and is_all_to_all_call(n)))
    if not kernels.any() or not calls.any():
        return {}
    launched_at, threads = events.launch_start_us(kernels), events.launch_thread(kernels)
    rows = np.flatnonzero(kernels)
    found = {}
    for thread in np.unique(threads).tolist():
        mine = calls & (events.thread == thread)
        if not mine.any():
            continue
        order = np.argsort(events.start_us[mine], kind="stable")
        starts, reach = events.start_us[mine][order], np.maximum.accumulate(events.end_us[mine][order])
        at = launched_at[threads == thread]
        last = np.searchsorted(starts, at, side="right") - 1    # the latest call started by then
        inside = (last >= 0) & (reach[np.clip(last, 0, None)] >= at)
        found.update(zip(rows[threads == thread].tolist(), inside.tolist()))
    return found


def point_to_point_mask(events: TraceEvents) -> np.ndarray:
    """Events that are sends or receives, for leaving them out of collectives."""
    mask = np.zeros(len(events), dtype=bool)
    mask[list(point_to_point_kinds(events))] = True
    return mask


def find_point_to_point(events: TraceEvents, steps: list[StepTiming]) -> PointToPoint:
    """The rank's sends and receives from the best source, with their markers, and its stage compute."""
    kinds = point_to_point_kinds(events)
    if not kinds and not events.names_matching(lambda n: n.startswith("pp_")).any():
        return PointToPoint.none()
    name_of = lambda i: events.names[events.name_id[i]]  # noqa: E731
    candidates = {
        SOURCE_NCCL: [i for i in kinds if events.kind[i] == Kind.KERNEL],
        SOURCE_GLOO: [i for i in kinds if name_of(i).startswith("gloo:")],
        SOURCE_HOST: [i for i in kinds if name_of(i).startswith("c10d::")],
    }
    source, chosen = next(((s, c) for s, c in candidates.items() if c), (None, []))
    return PointToPoint(source=source, calls=_calls(events, kinds, chosen, steps, _markers(events, steps)),
                        compute=_compute(events, steps), schedule=_schedule(events))


def _step_of(time_us: float, steps: list[StepTiming]) -> int:
    for step in steps:
        if step.start_us <= time_us < step.end_us:
            return step.step
    return OUTSIDE_STEPS


def _markers(events: TraceEvents, steps: list[StepTiming]) -> dict[tuple[int, str], list]:
    """(step, send|recv) -> the markers of that kind in issue order."""
    found: dict[tuple[int, str], list] = {}
    rows = np.flatnonzero(events.names_matching(lambda n: n.startswith(P2P_MARKER_PREFIX)))
    for index in sorted(rows, key=lambda i: events.start_us[i]):
        marker = parse_p2p_marker(events.names[events.name_id[index]])
        if marker is not None:
            found.setdefault((_step_of(float(events.start_us[index]), steps), marker.kind), []).append(marker)
    return found


def _calls(events: TraceEvents, kinds: dict[int, str], chosen: list[int], steps: list[StepTiming],
           markers: dict[tuple[int, str], list]) -> list[P2PCall]:
    calls, counts = [], {}
    for index in sorted(chosen, key=lambda i: events.start_us[i]):
        start = float(events.start_us[index])
        step, kind = _step_of(start, steps), kinds[index]
        ordinal = counts.get((step, kind), 0)
        counts[(step, kind)] = ordinal + 1
        listed = markers.get((step, kind), []) if kind in (P2P_SEND, P2P_RECV) else []
        marker = listed[ordinal] if ordinal < len(listed) else None
        calls.append(P2PCall(step=step, kind=kind, ordinal=ordinal, start_us=start,
                             end_us=start + float(events.dur_us[index]),
                             peer=marker.peer if marker else None, direction=marker.direction if marker else None,
                             microbatch=marker.microbatch if marker else None))
    return calls


def _compute(events: TraceEvents, steps: list[StepTiming]) -> list[StageCompute]:
    directions = {PP_FORWARD: "forward", PP_BACKWARD: "backward"}
    rows = np.flatnonzero(events.names_matching(lambda n: n in directions) & events.of_kind(Kind.USER_ANNOTATION))
    return [StageCompute(step=_step_of(float(events.start_us[i]), steps),
                         direction=directions[events.names[events.name_id[i]]], duration_us=float(events.dur_us[i]))
            for i in rows]


def _schedule(events: TraceEvents) -> ScheduleMarker | None:
    for name in events.names:
        if name.startswith(PP_SCHEDULE_PREFIX):
            marker = parse_schedule_marker(name)
            if marker is not None:
                return marker
    return None
