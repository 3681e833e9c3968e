"""The ideal step in the merged trace (pure planning, then one writer): one process, `IDEAL_PROCESS_NAME`, with a
thread per rank holding the report's replay of the windows' critical-path steps (whatif/ideal_steps.py): that
rank's compute, collective transfers and pipeline transfers as they would run with every rank's compute at the
ranks' lower median, placed at each step's start on the merged clock, so the recorded ranks and the job
without stragglers sit side by side. Slices are named by the op (`compute before ...`, the collective's or the
transfer's name) and annotated with the window, the step, the op's kind, and the step's recorded and ideal
times. A report without the replay (an older report, a window without a step the model holds) draws nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from fleetscope.analysis.merge.critical_path_overlays import MAX_START_NS
from fleetscope.analysis.merge.perfetto.writer import SequenceWriter, TrackSpec
from fleetscope.analysis.merge.tracks import (MAX_LANE_ORDER, NO_EVENT, OP_BEGIN, OP_END, PROCESS_PID_BASE,
                                              nest_into_lanes)
from fleetscope.traces.validate import bounded_name, finite_number

if TYPE_CHECKING:
    from fleetscope.analysis.whatif.ideal_steps import IdealOp, IdealReplay, IdealStep

IDEAL_PROCESS_NAME = "what-if: ideal replay (all ranks)"
IDEAL_PID = PROCESS_PID_BASE - 3
IDEAL_PROCESS_UUID = (1 << 62) + (1 << 60)
IDEAL_SEQUENCE_ID = (1 << 30) + 2
"""One packet sequence for the ideal process (the summary's is 1 << 30, the whole run's + 1, ranks' 2 + rank)."""
IDEAL_TID_BASE = 500_000
"""A rank's ideal thread is IDEAL_TID_BASE + rank: below every process id (PROCESS_PID_BASE - 3 and up) and the
ranks' own threads (tracks.THREAD_TID_BASE and up)."""
MAX_IDEAL_RANK = IDEAL_PID - IDEAL_TID_BASE - 1
IDEAL_CATEGORY = "fleetscope.what_if"
MAX_OP_US = 1e12
"""Bound of a replayed op's times (microseconds after its step's start) a report may place."""


@dataclass(frozen=True, kw_only=True)
class IdealSlice:
    start_ns: int
    end_ns: int
    name: str
    step: int
    annotations: dict[str, Any]


@dataclass(kw_only=True)
class IdealProcess:
    """The ideal process's slices, by rank, on the merged clock."""

    slices: dict[int, list[IdealSlice]] = field(default_factory=dict)

    @property
    def slice_count(self) -> int:
        return sum(len(pieces) for pieces in self.slices.values())

    @property
    def bounds_ns(self) -> tuple[int, int] | None:
        pieces = [piece for rank in self.slices.values() for piece in rank]
        return (min(p.start_ns for p in pieces), max(p.end_ns for p in pieces)) if pieces else None


def report_ideal_slices(replay: "IdealReplay | None", *, window: int | None = None) -> dict[int, list[IdealSlice]]:
    """rank -> its ops of a window's ideal replay on the report's clock; {} without any."""
    found: dict[int, list[IdealSlice]] = {}
    for step in replay.steps if replay is not None else []:
        for rank, piece in _step_slices(step, window):
            found.setdefault(rank, []).append(piece)
    return found


def plan_ideal_process(windows: "list[tuple[int | None, IdealReplay | None]]",
                       shift_ns: Callable[[int, int | None], int | None],
                       steps: frozenset[int] | None = None) -> IdealProcess:
    """The ideal process of every (window key, ideal replay) of the report: each rank's slices moved
    by `shift_ns(rank, window key)` (the report's clock offset less the one the merge removed; None: the rank is
    not in the merge, and is left out); only `steps` where given (the merge's --steps)."""
    plan = IdealProcess()
    for window_key, replay in windows:
        for rank, pieces in report_ideal_slices(replay, window=window_key).items():
            shift = shift_ns(rank, window_key)
            if shift is None or not 0 <= rank <= MAX_IDEAL_RANK:
                continue
            plan.slices.setdefault(rank, []).extend(
                IdealSlice(start_ns=p.start_ns + shift, end_ns=p.end_ns + shift, name=p.name, step=p.step,
                           annotations=p.annotations) for p in pieces
                if steps is None or p.step in steps)
    plan.slices = {rank: pieces for rank, pieces in sorted(plan.slices.items()) if pieces}
    return plan


def write_ideal_process(writer: SequenceWriter, plan: IdealProcess) -> None:
    """The process, a thread per rank (overlapping slices on `[overlap n]` tracks under it), and the slices."""
    writer.track(TrackSpec(uuid=IDEAL_PROCESS_UUID, name=IDEAL_PROCESS_NAME, pid=IDEAL_PID, order=-3,
                           description="each rank's critical-path steps replayed with every rank's compute at the "
                                       "ranks' lower median (the analysis report's ideal_replay)"))
    for order, (rank, pieces) in enumerate(plan.slices.items()):
        operations: list[tuple] = []
        lanes: list[TrackSpec] = []

        def lane_uuid(lane: int, rank: int = rank, order: int = order) -> int:
            uuid = IDEAL_PROCESS_UUID + 1 + rank * (MAX_LANE_ORDER + 1) + min(lane, MAX_LANE_ORDER)
            name = f"rank {rank}" if lane == 0 else f"rank {rank} [overlap {lane}]"
            thread = lane == 0
            lanes.append(TrackSpec(uuid=uuid, name=name, parent_uuid=IDEAL_PROCESS_UUID,
                                   order=order * (MAX_LANE_ORDER + 1) + min(lane, MAX_LANE_ORDER),
                                   tid=IDEAL_TID_BASE + rank if thread else None,
                                   thread_pid=IDEAL_PID if thread else None, thread_name=name if thread else None))
            return uuid

        slices = sorted(((p.start_ns, p.end_ns, p.name, IDEAL_CATEGORY, NO_EVENT, p.annotations) for p in pieces),
                        key=lambda item: (item[0], -item[1]))
        nest_into_lanes(slices, operations, lane_id=lane_uuid)
        for spec in lanes:
            writer.track(spec)
        for operation in sorted(operations, key=lambda op: (op[0], op[1] != OP_END)):
            if operation[1] == OP_BEGIN:
                writer.slice_begin(operation[0], operation[2], operation[3], operation[4], annotations=operation[7])
            else:
                writer.slice_end(operation[0], operation[2])


def _step_slices(step: "IdealStep", window: int | None) -> list[tuple[int, IdealSlice]]:
    if not 0 <= step.start_ns < MAX_START_NS:
        return []
    notes = {**({"window": window} if window is not None else {}), "step": step.step,
             "recorded_step_ms": _number(step.measured_ms), "ideal_step_ms": _number(step.ideal_ms),
             "ideal": "every rank's compute at the ranks' lower median, collectives and transfers as recorded"}
    found = []
    for op in step.ops:
        if not _valid_op(op):
            continue
        start = step.start_ns + round(op.start_us * 1000)
        end = step.start_ns + round(op.end_us * 1000)
        if end > start:
            found.append((op.rank, IdealSlice(start_ns=start, end_ns=end, name=bounded_name(op.name), step=step.step,
                                              annotations={**notes, "kind": bounded_name(op.kind)})))
    return found


def _valid_op(op: "IdealOp") -> bool:
    return all(_number(value) is not None and 0 <= value < MAX_OP_US for value in (op.start_us, op.end_us))


def _number(value: Any) -> float | None:
    number = finite_number(value)
    return number if number is not None and abs(number) < 1e15 else None
