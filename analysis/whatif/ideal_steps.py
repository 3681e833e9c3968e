"""The ideal step, replayed, as a timeline the merged trace draws beside the recorded one.

For a few profiled steps of a window (the critical path's: cross_rank/critical_path.py), the step's dependency
model (trace_model.py) is replayed with every rank's compute at the ranks' lower median, op by op, and the
collectives as recorded (trace_whatif.ideal_own_times: the ideal that S is measured against). Each rank's ops
of that replay are kept with their times from the step's start: its compute from when it could start to its
end, each collective's transfer from when the last rank arrived to its end. The merge places them at the
step's start on its clock (the critical path's `start_ns`), in a process of its own with a thread per rank
(merge/ideal_overlays.py), so the recorded steps and the ones without stragglers sit side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetscope.analysis.cross_rank.critical_path import CriticalPaths
from fleetscope.analysis.per_rank.rank import RankResult

from .simulate import replay
from .trace_model import StepModel, model_window
from .trace_pipeline import COLLECTIVE, COMPUTE, TRANSFER
from .trace_whatif import ideal_own_times

MAX_RANKS_DRAWN = 256
"""Ranks whose ideal ops a step keeps (the report stays small at thousands of ranks; the merge draws the rest as
their recorded steps only)."""
OP_COMPUTE, OP_COLLECTIVE, OP_TRANSFER = "compute", "collective", "transfer"


_OP_KIND = {COMPUTE: OP_COMPUTE, COLLECTIVE: OP_COLLECTIVE, TRANSFER: OP_TRANSFER}


@dataclass(frozen=True, kw_only=True)
class IdealOp:
    rank: int
    kind: str
    """OP_COMPUTE, OP_COLLECTIVE (the transfer, once every rank has arrived) or OP_TRANSFER (a pipeline message,
    once both sides have issued their call)."""
    name: str
    start_us: float
    """From the step's start, in the ideal replay."""
    end_us: float


@dataclass(frozen=True, kw_only=True)
class IdealStep:
    step: int
    start_ns: int
    """The step's start on the report's common clock (the critical path's start_ns): where the merge draws it."""
    measured_ms: float
    """The step as recorded (the slowest rank's trace step time)."""
    ideal_ms: float
    """The step replayed with every rank's compute at the ranks' lower median."""
    ops: list[IdealOp] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class IdealReplay:
    steps: list[IdealStep] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Steps of the critical path not replayed, each with why."""


def ideal_replay(window: int | None, results: list[RankResult], paths: CriticalPaths) -> IdealReplay | None:
    """The ideal replay of the window's critical-path steps; None where there is nothing to replay (no path, no
    step the model holds)."""
    starts = {path.step: path.start_ns for path in paths.steps if path.start_ns > 0}
    if not starts:
        return None
    modeled, skipped = model_window(window, results, set(starts))
    steps = [_ideal_step(model, starts[model.step]) for model in modeled if model.step in starts]
    if not steps:
        return None
    return IdealReplay(steps=steps, skipped=[f"step {step}: {why}" for step, why in sorted(skipped.items())])


def _ideal_step(model: StepModel, start_ns: int) -> IdealStep:
    own = ideal_own_times(model)
    replayed = replay(model.model, own)
    ops = []
    for index, rank in enumerate(model.ranks[:MAX_RANKS_DRAWN]):
        nodes, replica = model.rank_cells(index)
        for node in nodes:
            end = float(replayed.end_s[node, 0, replica])
            kind = int(model.model.node_type[node])
            start = float(replayed.ready_s[node, 0, replica]) if kind == COMPUTE else end - float(own[node, 0, replica])
            if end > start:
                ops.append(IdealOp(rank=rank, kind=_OP_KIND[kind], name=model.node_names[node],
                                   start_us=start * 1e6, end_us=end * 1e6))
    return IdealStep(step=model.step, start_ns=start_ns, measured_ms=model.measured_s * 1e3,
                     ideal_ms=float(replayed.step_time_s[0]) * 1e3, ops=ops)
