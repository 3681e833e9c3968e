"""Which rank holds the others back: slowest steps, and who arrives last at collectives.

At a collective every rank waits inside it until the last one arrives, then all finish at about the same
instant. So for one collective instance (matched across ranks by `CollectiveKey`):
  - arrival of a rank = start of its collective (kernel / gloo span / host op, see collectives.py),
    on the common clock;
  - the last rank is the one with the latest arrival;
  - lateness_us = its arrival - the median arrival of the other ranks (how long it kept them waiting);
  - wait of a rank = last arrival - its own arrival (time it spent waiting for the others).
An instance counts toward a rank being "last" only when the lateness reaches `min_lateness_us`, so the
ordering noise of ranks that arrive together blames nobody.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .collectives import CollectiveKey
from .rank import RankResult

DEFAULT_MIN_LATENESS_US = 100.0
WORST_INSTANCES_KEPT = 10


@dataclass(frozen=True, kw_only=True)
class StepTimeRank:
    rank: int
    mean_step_ms: float
    vs_median_pct: float
    """How much slower (+) or faster (-) than the median rank's mean step time."""


@dataclass(frozen=True, kw_only=True)
class CollectiveInstance:
    step: int
    """Step that issued it (-1: outside every step)."""
    name: str
    ordinal: int
    participants: int
    last_rank: int
    lateness_us: float
    arrival_spread_us: float
    """Last arrival - first arrival."""
    end_spread_us: float
    """Latest end - earliest end; large values mean clocks disagree or ranks were mismatched."""


@dataclass(frozen=True, kw_only=True)
class RankWait:
    rank: int
    collectives: int
    """Matched collective instances this rank took part in."""
    times_last: int
    """Instances where it arrived last by at least min_lateness_us."""
    last_pct: float
    caused_wait_us: float
    """Sum of its lateness over the instances where it was last."""
    waited_us: float
    """Sum of its waits: time spent inside collectives for later ranks."""


@dataclass(frozen=True, kw_only=True)
class Stragglers:
    by_step_time: list[StepTimeRank] = field(default_factory=list)
    """Ranks by mean step time, slowest first."""
    slowest_rank: int | None = None
    collective_source: str | None = None
    matched_collectives: int = 0
    """Collective instances found on at least two ranks."""
    unmatched_collectives: int = 0
    """Instances missing on some rank (different step windows, sub-groups, or a trace cut short)."""
    min_lateness_us: float = DEFAULT_MIN_LATENESS_US
    by_wait: list[RankWait] = field(default_factory=list)
    """Ranks by caused_wait_us, largest first."""
    waited_for_rank: int | None = None
    """The rank the others wait for most; None when nobody was late by min_lateness_us."""
    waited_for_median_us: float | None = None
    """Median lateness of waited_for_rank over the instances where it was last."""
    worst_instances: list[CollectiveInstance] = field(default_factory=list)
    verdict: str = ""


@dataclass(frozen=True)
class _ArrivalMatrix:
    ranks: list[int]
    keys: list[CollectiveKey]
    start_us: np.ndarray
    """ranks x instances; NaN where a rank has no such instance."""
    end_us: np.ndarray


def find_stragglers(results: list[RankResult], clock_shift_us: dict[int, float], *,
                    min_lateness_us: float = DEFAULT_MIN_LATENESS_US) -> Stragglers:
    """Straggler ranking of one window. `clock_shift_us[rank]` maps trace time to the common clock."""
    by_step = rank_by_step_time(results)
    matrix = _arrival_matrix(results, clock_shift_us)
    if matrix is None:
        verdict = _verdict(by_step, None, None)
        return Stragglers(by_step_time=by_step, slowest_rank=by_step[0].rank if by_step else None,
                          min_lateness_us=min_lateness_us, verdict=verdict)
    present = ~np.isnan(matrix.start_us)
    shared = present.sum(axis=0) >= 2
    instances = _instances(matrix, shared, min_lateness_us)
    waits = _rank_waits(matrix, shared, instances, min_lateness_us)
    waited_for, median_us = _waited_for(waits, instances, min_lateness_us)
    sources = {r.collectives.source for r in results if r.collectives.source}
    return Stragglers(
        by_step_time=by_step,
        slowest_rank=by_step[0].rank if by_step else None,
        collective_source=", ".join(sorted(sources)) or None,
        matched_collectives=int(shared.sum()),
        unmatched_collectives=int((present.sum(axis=0) < len(matrix.ranks)).sum()),
        min_lateness_us=min_lateness_us,
        by_wait=waits,
        waited_for_rank=waited_for,
        waited_for_median_us=median_us,
        worst_instances=sorted(instances, key=lambda i: -i.lateness_us)[:WORST_INSTANCES_KEPT],
        verdict=_verdict(by_step, waits, waited_for),
    )


def rank_by_step_time(results: list[RankResult]) -> list[StepTimeRank]:
    means = {r.rank: float(np.mean([s.step_time_ms for s in r.steps])) for r in results if r.steps}
    if not means:
        return []
    median = float(np.median(list(means.values())))
    ranking = [StepTimeRank(rank=rank, mean_step_ms=mean,
                            vs_median_pct=100.0 * (mean - median) / median if median > 0 else 0.0)
               for rank, mean in means.items()]
    return sorted(ranking, key=lambda r: (-r.mean_step_ms, r.rank))


def _arrival_matrix(results: list[RankResult], clock_shift_us: dict[int, float]) -> _ArrivalMatrix | None:
    with_calls = sorted((r for r in results if len(r.collectives)), key=lambda r: r.rank)
    if len(with_calls) < 2:
        return None
    keys = sorted({key for r in with_calls for key in r.collectives.keys})
    column = {key: index for index, key in enumerate(keys)}
    starts = np.full((len(with_calls), len(keys)), np.nan)
    ends = np.full((len(with_calls), len(keys)), np.nan)
    for row, result in enumerate(with_calls):
        columns = np.fromiter((column[k] for k in result.collectives.keys), dtype=np.int64,
                              count=len(result.collectives))
        shift = clock_shift_us.get(result.rank, 0.0)
        starts[row, columns] = result.collectives.start_us + shift
        ends[row, columns] = result.collectives.end_us + shift
    return _ArrivalMatrix([r.rank for r in with_calls], keys, starts, ends)


def _instances(matrix: _ArrivalMatrix, shared: np.ndarray, min_lateness_us: float) -> list[CollectiveInstance]:
    starts, ends = matrix.start_us[:, shared], matrix.end_us[:, shared]
    keys = [k for k, keep in zip(matrix.keys, shared) if keep]
    last_row = np.nanargmax(starts, axis=0)
    others = starts.copy()
    others[last_row, np.arange(others.shape[1])] = np.nan
    lateness = np.nanmax(starts, axis=0) - np.nanmedian(others, axis=0)
    spread = np.nanmax(starts, axis=0) - np.nanmin(starts, axis=0)
    end_spread = np.nanmax(ends, axis=0) - np.nanmin(ends, axis=0)
    participants = (~np.isnan(starts)).sum(axis=0)
    return [
        CollectiveInstance(step=key[0], name=key[1], ordinal=key[2], participants=int(participants[i]),
                           last_rank=matrix.ranks[last_row[i]], lateness_us=float(lateness[i]),
                           arrival_spread_us=float(spread[i]), end_spread_us=float(end_spread[i]))
        for i, key in enumerate(keys)
    ]


def _rank_waits(matrix: _ArrivalMatrix, shared: np.ndarray, instances: list[CollectiveInstance],
                min_lateness_us: float) -> list[RankWait]:
    starts = matrix.start_us[:, shared]
    waited = np.nansum(np.nanmax(starts, axis=0) - starts, axis=1)
    taken = (~np.isnan(starts)).sum(axis=1)
    waits = []
    for row, rank in enumerate(matrix.ranks):
        late = [i.lateness_us for i in instances if i.last_rank == rank and i.lateness_us >= min_lateness_us]
        waits.append(RankWait(
            rank=rank, collectives=int(taken[row]), times_last=len(late),
            last_pct=100.0 * len(late) / int(taken[row]) if taken[row] else 0.0,
            caused_wait_us=float(sum(late)), waited_us=float(waited[row]),
        ))
    return sorted(waits, key=lambda w: (-w.caused_wait_us, w.rank))


def _waited_for(waits: list[RankWait], instances: list[CollectiveInstance],
                min_lateness_us: float) -> tuple[int | None, float | None]:
    if not waits or waits[0].times_last == 0:
        return None, None
    rank = waits[0].rank
    late = [i.lateness_us for i in instances if i.last_rank == rank and i.lateness_us >= min_lateness_us]
    return rank, float(np.median(late))


def _verdict(by_step: list[StepTimeRank], waits: list[RankWait] | None, waited_for: int | None) -> str:
    parts = []
    if by_step and len(by_step) > 1:
        slowest = by_step[0]
        parts.append(f"rank {slowest.rank} has the slowest steps ({slowest.mean_step_ms:.2f} ms mean, "
                     f"{slowest.vs_median_pct:+.1f}% vs the median rank)")
    if waits is None:
        parts.append("no collectives matched across ranks")
    elif waited_for is None:
        parts.append("no rank keeps the others waiting at collectives")
    else:
        top = waits[0]
        parts.append(f"the others wait for rank {waited_for} at collectives: last at {top.times_last} of "
                     f"{top.collectives} ({top.last_pct:.0f}%), {top.caused_wait_us / 1000:.2f} ms of waiting in all")
    return "; ".join(parts) + "." if parts else "nothing to rank."
