"""What-if by simulation (the OSDI'25 straggler paper's method): how fast would the job be without its
stragglers, and whose slowness is it?

  ideal        every op takes its type's typical time: the mean over all workers and steps for computation,
               the median for communication (its recorded time carries waits); replayed, the ideal step time
  S            the slowdown: the replayed step time (recorded op times, no launch gaps) over the ideal one
  S_t, S_w     the slowdown one op type, DP rank, stage or worker causes alone: the ideal with that part's
               recorded times put back, over the ideal
  M_W, M_S     the share of (actual - ideal) that goes away when the few slowest workers (by S_w), or the
               last pipeline stage, take ideal times (the rest staying as recorded)
Every step time is a mean over the trace's steps; each quantity has one function here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...traces.op_timeline import OP_TYPES, OpTimeline
from .pipeline_model import COMMUNICATION_TYPES, ModeledTimeline, as_op_timeline
from .simulate import replay, own_times

ATTRIBUTION_NAME = {"forward-send": "forward-pp-comm", "forward-recv": "forward-pp-comm",
                    "backward-send": "backward-pp-comm", "backward-recv": "backward-pp-comm"}
"""Op types attributed together: a pipeline message's send and receive are one transfer."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WhatIfConfig:
    computation_statistic: str = "mean"
    """The ideal time of a computation op type: 'mean' (the paper's) or 'median' over all its ops."""
    communication_statistic: str = "median"
    """The ideal time of a communication op type: 'median' (the paper's) or 'mean'."""
    worker_share: float = 0.03
    """M_W takes the slowest ceil(share x workers) workers by S_w (the paper: 3%)."""

    def __post_init__(self) -> None:
        for field in ("computation_statistic", "communication_statistic"):
            if getattr(self, field) not in ("mean", "median"):
                raise ValueError(f"{field} must be 'mean' or 'median', not {getattr(self, field)!r}")
        if not 0 < self.worker_share <= 1:
            raise ValueError(f"worker_share must be in (0, 1], not {self.worker_share}")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSlowdown:
    rank: int
    dp_rank: int
    stage: int
    slowdown: float
    """S_w: the ideal step with this worker's recorded times put back, over the ideal step."""


@dataclasses.dataclass(frozen=True, slots=True)
class WhatIfResult:
    source: str
    steps: int
    stages: int
    dp_ranks: int
    measured_step_s: float
    """Mean recorded step time (first op's start to last op's end)."""
    replayed_step_s: float
    """Mean step time replayed with the recorded op times (what the model explains of the measured)."""
    ideal_step_s: float
    slowdown: float
    """S = replayed / ideal."""
    slowdown_by_op_type: dict[str, float]
    """S_t, largest first."""
    slowdown_by_dp_rank: dict[int, float]
    slowdown_by_stage: dict[int, float]
    slowdown_by_worker: tuple[WorkerSlowdown, ...]
    """S_w, largest first."""
    worker_share_explained: float
    """M_W (1.0 = 100%)."""
    workers_explaining: tuple[int, ...]
    """The ranks M_W replaced."""
    stage_share_explained: float
    """M_S: the share the last stage explains (stage partitioning imbalance)."""
    per_step_slowdown: dict[int, float]


def what_if(modeled: ModeledTimeline, config: WhatIfConfig | None = None) -> WhatIfResult:
    """Every what-if quantity of the modeled timeline."""
    config = config or WhatIfConfig()
    model = modeled.model
    actual = own_times(model, modeled.start_s, modeled.end_s)
    ideal = ideal_own_times(modeled, actual, config)
    replayed = replay(model, actual).step_time_s
    ideal_steps = replay(model, ideal).step_time_s

    def put_back(mask: np.ndarray) -> float:
        return slowdown(replay(model, np.where(mask, actual, ideal)).step_time_s, ideal_steps)

    stage_of = model.node_stage[:, None, None]
    replica_of = np.arange(model.replicas)[None, None, :]
    workers = _worker_slowdowns(modeled, put_back)
    chosen = workers[:math.ceil(config.worker_share * len(workers) - 1e-9)]
    chosen_mask = np.zeros(stage_of.shape[:1] + (1, model.replicas), dtype=bool)
    for worker in chosen:
        chosen_mask |= (stage_of == worker.stage) & (replica_of == _replica(modeled, worker.dp_rank))
    return WhatIfResult(
        source=modeled.source, steps=len(model.steps), stages=model.stages, dp_ranks=model.replicas,
        measured_step_s=float(measured_step_times(modeled).mean()), replayed_step_s=float(replayed.mean()),
        ideal_step_s=float(ideal_steps.mean()), slowdown=slowdown(replayed, ideal_steps),
        slowdown_by_op_type=_largest_first({name: put_back(mask) for name, mask in _type_masks(modeled).items()}),
        slowdown_by_dp_rank=_largest_first({int(dp): put_back(replica_of == index)
                                            for index, dp in enumerate(modeled.dp_ranks)}),
        slowdown_by_stage=_largest_first({stage: put_back(stage_of == stage) for stage in range(model.stages)}),
        slowdown_by_worker=tuple(workers),
        worker_share_explained=share_explained(modeled, actual, ideal, chosen_mask, replayed, ideal_steps),
        workers_explaining=tuple(worker.rank for worker in chosen),
        stage_share_explained=share_explained(modeled, actual, ideal, stage_of == model.stages - 1, replayed,
                                              ideal_steps),
        per_step_slowdown={int(step): float(a / b) for step, a, b in zip(model.steps, replayed, ideal_steps)})


def ideal_own_times(modeled: ModeledTimeline, actual: np.ndarray, config: WhatIfConfig) -> np.ndarray:
    """Each op's ideal time: its type's mean (computation) or median (communication) over every worker and step."""
    ideal = np.empty_like(actual)
    types = modeled.model.node_type
    for op_type in np.unique(types):
        nodes = types == op_type
        statistic = config.communication_statistic if op_type in COMMUNICATION_TYPES else config.computation_statistic
        ideal[nodes] = (np.median if statistic == "median" else np.mean)(actual[nodes])
    return ideal


def measured_step_times(modeled: ModeledTimeline) -> np.ndarray:
    """Each recorded step's time: from its first op's start to its last op's end."""
    return modeled.end_s.max(axis=(0, 2)) - modeled.start_s.min(axis=(0, 2))


def slowdown(step_times_s: np.ndarray, ideal_step_times_s: np.ndarray) -> float:
    """Mean step time over the mean ideal step time."""
    return float(np.mean(step_times_s) / np.mean(ideal_step_times_s))


def share_explained(modeled: ModeledTimeline, actual: np.ndarray, ideal: np.ndarray, mask: np.ndarray,
                    replayed_s: np.ndarray, ideal_s: np.ndarray) -> float:
    """The share of (replayed - ideal) that goes when the masked ops take their ideal times: 1.0 = all of it."""
    removed = replay(modeled.model, np.where(mask, ideal, actual)).step_time_s
    gap = np.mean(replayed_s) - np.mean(ideal_s)
    return float((np.mean(replayed_s) - np.mean(removed)) / gap) if gap > 0 else 0.0


def _worker_slowdowns(modeled: ModeledTimeline, put_back) -> list[WorkerSlowdown]:
    stage_of = modeled.model.node_stage[:, None, None]
    replica_of = np.arange(modeled.model.replicas)[None, None, :]
    found = [WorkerSlowdown(rank=int(modeled.worker_rank[stage, index]), dp_rank=int(dp), stage=stage,
                            slowdown=put_back((stage_of == stage) & (replica_of == index)))
             for stage in range(modeled.model.stages) for index, dp in enumerate(modeled.dp_ranks)]
    return sorted(found, key=lambda worker: (-worker.slowdown, worker.rank))


def _replica(modeled: ModeledTimeline, dp_rank: int) -> int:
    return int(np.flatnonzero(modeled.dp_ranks == dp_rank)[0])


def _type_masks(modeled: ModeledTimeline) -> dict[str, np.ndarray]:
    names = np.array([ATTRIBUTION_NAME.get(OP_TYPES[t], OP_TYPES[t]) for t in modeled.model.node_type])
    return {str(name): (names == name)[:, None, None] for name in np.unique(names)}


def _largest_first(values: dict) -> dict:
    return dict(sorted(values.items(), key=lambda item: -item[1]))


def ideal_timeline(modeled: ModeledTimeline, config: WhatIfConfig | None = None) -> OpTimeline:
    """The replayed ideal as an op timeline; each op drawn over its own time (a collective from its transfer's
    start), each step at the recorded step's start, to sit beside the recorded timeline."""
    actual = own_times(modeled.model, modeled.start_s, modeled.end_s)
    ideal = ideal_own_times(modeled, actual, config or WhatIfConfig())
    end = replay(modeled.model, ideal).end_s
    return as_op_timeline(modeled, end - ideal, end, source=f"ideal of {modeled.source}")
