"""What-if by simulation on a job's own traces (trace_model): how long would its steps take without its
stragglers, and how much of that is each rank's doing?

  replayed     each step replayed with every op's recorded own time (what the model explains of the measured)
  ideal        every rank's compute op at the ranks' lower median for that op, collectives at their transfer
               times; the lower median, not the paper's mean: with the few ranks of a small job one straggler
               would move a mean (or a two-rank median) halfway to itself. A pipeline step's ranks run
               different ops (each its stage's), so there each rank's compute is scaled to the ranks' lower
               median of their compute per step (a stage's work by the other stages', op for op in proportion)
  S            replayed / ideal
  S_w          the ideal with one rank's recorded compute put back, over the ideal (the paper's S_w)
  what-if      of a rank: the replayed step with that rank's compute at its peers' lower median, the rest as
               recorded: the step time were that rank as fast as the others
Step times are means over the modeled steps; each quantity has one function here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .simulate import replay
from .trace_model import StepModel, TraceModel


@dataclasses.dataclass(frozen=True, slots=True)
class RankWhatIf:
    rank: int
    slowdown: float
    """S_w."""
    compute_ms: float
    """Its compute per step (the sum of its compute ops), mean over the steps."""
    peers_compute_ms: float
    """The same at its peers' lower median, op by op."""
    what_if_step_ms: float
    """Mean step time with its compute at its peers' lower median."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepReplay:
    window: int | None
    step: int
    measured_ms: float
    replayed_ms: float
    ideal_ms: float
    slowest_what_if_ms: float
    """The step with the job's slowest rank (largest S_w) at its peers' compute."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceWhatIf:
    source: str
    ranks: int
    measured_step_ms: float
    """Mean of each step's slowest rank's step time."""
    replayed_step_ms: float
    ideal_step_ms: float
    slowdown: float
    """S."""
    by_rank: tuple[RankWhatIf, ...]
    """Largest S_w first."""
    steps: tuple[StepReplay, ...]
    skipped: tuple[str, ...]
    pipeline_steps: int = 0
    """Of the steps, those with pipeline sends and receives (trace_pipeline.py: each rank a stage)."""

    @property
    def slowest(self) -> RankWhatIf:
        return self.by_rank[0]


def trace_what_if(modeled: TraceModel) -> TraceWhatIf:
    """Every what-if quantity of the modeled steps (module docstring)."""
    ranks = sorted({rank for step in modeled.steps for rank in step.ranks})
    replayed = np.array([_step_time(step, step.own_s) for step in modeled.steps])
    ideal = np.array([_step_time(step, ideal_own_times(step)) for step in modeled.steps])
    by_rank = sorted((_rank_what_if(modeled, rank, ideal) for rank in ranks), key=lambda r: (-r.slowdown, r.rank))
    slowest = by_rank[0].rank
    steps = tuple(StepReplay(window=step.window, step=step.step, measured_ms=step.measured_s * 1e3,
                             replayed_ms=float(a * 1e3), ideal_ms=float(b * 1e3),
                             slowest_what_if_ms=_what_if_step_s(step, slowest) * 1e3)
                  for step, a, b in zip(modeled.steps, replayed, ideal))
    return TraceWhatIf(source=modeled.source, ranks=len(ranks),
                       measured_step_ms=float(np.mean([s.measured_s for s in modeled.steps]) * 1e3),
                       replayed_step_ms=float(replayed.mean() * 1e3), ideal_step_ms=float(ideal.mean() * 1e3),
                       slowdown=float(replayed.mean() / ideal.mean()), by_rank=tuple(by_rank), steps=steps,
                       skipped=modeled.skipped,
                       pipeline_steps=sum(step.node_rank is not None for step in modeled.steps))


def ideal_own_times(step: StepModel) -> np.ndarray:
    """Every rank's compute ops at the ranks' lower median, op by op (a pipeline step: each rank's scaled to the
    ranks' lower median compute); transfers and collectives as recorded."""
    ideal = step.own_s.copy()
    if step.node_rank is not None:
        totals = _compute_totals(step)
        target = float(np.quantile(totals, 0.5, method="lower"))
        for index, total in enumerate(totals):
            _scale_compute(step, ideal, index, target, total)
        return ideal
    compute = step.compute_nodes
    ideal[compute] = np.quantile(step.own_s[compute], 0.5, axis=2, method="lower", keepdims=True)
    return ideal


def peers_own_times(step: StepModel, rank: int) -> np.ndarray:
    """The recorded own times with `rank`'s compute ops at its peers' lower median (its own where it has none;
    a pipeline step: scaled to its peers' lower median compute)."""
    index = step.ranks.index(rank)
    own = step.own_s.copy()
    if len(step.ranks) < 2:
        return own
    if step.node_rank is not None:
        totals = _compute_totals(step)
        target = float(np.quantile(np.delete(totals, index), 0.5, method="lower"))
        _scale_compute(step, own, index, target, totals[index])
        return own
    peers = np.delete(step.own_s, index, axis=2)
    compute = step.compute_nodes
    own[compute, :, index] = np.quantile(peers[compute], 0.5, axis=2, method="lower")
    return own


def _compute_totals(step: StepModel) -> np.ndarray:
    """Each rank's compute in the step (s), in the order of `step.ranks`."""
    return np.array([step.own_s[step.compute_mask(index)].sum() for index in range(len(step.ranks))])


def _scale_compute(step: StepModel, own: np.ndarray, index: int, target: float, total: float) -> None:
    """The compute ops of the rank at `index` scaled so that they sum to `target` (as they are without any)."""
    if total > 0:
        mask = step.compute_mask(index)
        own[mask] = step.own_s[mask] * (target / total)


def _step_time(step: StepModel, own_s: np.ndarray) -> float:
    return float(replay(step.model, own_s).step_time_s[0])


def _what_if_step_s(step: StepModel, rank: int) -> float:
    return _step_time(step, peers_own_times(step, rank)) if rank in step.ranks else _step_time(step, step.own_s)


def rank_saving_ms(step: StepModel, rank: int) -> float:
    """How much shorter the replayed step is with `rank`'s compute at its peers' lower median, the rest as
    recorded, ms (the report's what-if: analysis/quantities.py)."""
    return (_step_time(step, step.own_s) - _what_if_step_s(step, rank)) * 1e3


def _rank_what_if(modeled: TraceModel, rank: int, ideal_s: np.ndarray) -> RankWhatIf:
    put_back, own, peers, what_if = [], [], [], []
    for step in modeled.steps:
        if rank not in step.ranks:
            continue
        mask = step.compute_mask(step.ranks.index(rank))
        ideal = ideal_own_times(step)
        ideal[mask] = step.own_s[mask]
        put_back.append(_step_time(step, ideal))
        own.append(step.own_s[mask].sum())
        peers.append(peers_own_times(step, rank)[mask].sum())
        what_if.append(_what_if_step_s(step, rank))
    present = [i for i, step in enumerate(modeled.steps) if rank in step.ranks]
    return RankWhatIf(rank=rank, slowdown=float(np.mean(put_back) / np.mean(ideal_s[present])),
                      compute_ms=float(np.mean(own) * 1e3), peers_compute_ms=float(np.mean(peers) * 1e3),
                      what_if_step_ms=float(np.mean(what_if) * 1e3))
