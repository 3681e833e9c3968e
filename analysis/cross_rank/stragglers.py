"""Which rank holds the others back: slowest steps, and who arrives last at collectives.

At a collective every rank waits inside it until the last one arrives, then all finish at about the same
instant. So for one collective instance (matched across ranks by `CollectiveKey`, times on rank 0's
clock, see arrivals.py and clock_align.py):
  - arrival of a rank = start of its collective (NCCL kernel / gloo span / host op, collectives.py);
  - the last rank is the one with the latest arrival;
  - lateness_us = its arrival - the median arrival of the other ranks (how long it kept them waiting);
  - wait of a rank = last arrival - its own arrival (time it spent waiting for the others);
  - extra_compute_us = the last rank's computation since the previous collective (interval_compute_us,
    collectives.py) - the others' median: close to the lateness when the late rank computed longer (more
    work, or the same work on a slower device: causes.py tells them apart); near zero when it was delayed
    by something else (host, input pipeline, launch overhead, its link).
An instance counts toward a rank being "last" only when the lateness reaches `min_lateness_us`, so the
ordering noise of ranks that arrive together blames nobody.

Waits add up per rank and step as their union (analysis/quantities.py "waiting"): DDP's gradient buckets are
in flight together, and a rank that waits for the same late rank at two of them waits once. The waiting a
rank caused is likewise, per step, the union of its lateness stretches ([the others' median arrival, its
arrival]) at the instances where it was last.

Per rank: score = its share of all the waiting caused (its caused waiting, over the sum for all ranks), in [0, 1]. The verdict names a straggler when one rank causes most of the waiting (its
share and how often it was last are both stated); "spread" only when no rank causes most of it. Why the
straggler is late (work, slow device, host, network, clock) is classified in causes.py.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.cross_rank.arrivals import ArrivalMatrix
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.analysis.quantities import union_by_step_us

DEFAULT_MIN_LATENESS_US = 100.0
WORST_INSTANCES_KEPT = 10
DETAIL_CELL_LIMIT = 50_000
"""Per-rank arrival/wait of every instance goes in the report up to this many ranks x instances."""
CONSISTENT_SHARE = 0.5
EVEN_STEPS_PCT = 1.0
"""The verdict names no "slowest" rank when the slowest is within this of the median rank."""


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
    extra_compute_us: float
    """Last rank's computation since the previous collective minus the others' median (module docstring)."""
    arrival_spread_us: float
    """Last arrival - first arrival."""
    end_spread_us: float
    """Latest end - earliest end; large values mean clocks disagree or ranks were mismatched."""


@dataclass(frozen=True, kw_only=True)
class InstanceDetail:
    """Every rank's arrival and wait at one instance, in the order of `Stragglers.detail_ranks`."""

    step: int
    name: str
    ordinal: int
    arrival_us: list[float | None]
    """Arrival after the first rank's arrival; None: the rank has no such instance."""
    wait_us: list[float | None]
    interval_compute_us: list[float | None]
    first_start_us: float | None = None
    """The first rank's arrival on the window's common clock: with arrival_us and wait_us it places every wait,
    so their union can be checked (analysis/invariants.py). None in reports written before it was kept."""


@dataclass(frozen=True, kw_only=True)
class RankWait:
    rank: int
    collectives: int
    """Matched collective instances this rank took part in."""
    times_last: int
    """Instances where it arrived last by at least min_lateness_us."""
    last_pct: float
    caused_wait_us: float
    """Per step, the union of its lateness stretches at the instances where it was last; summed over steps."""
    median_lateness_us: float | None
    """Median lateness over the instances where it was last."""
    median_extra_compute_us: float | None
    """Median extra_compute_us over the instances where it was last."""
    waited_us: float
    """Time spent inside collectives for later ranks: per step the union of its waits, summed over steps."""
    score: float
    """Share of all waiting caused that this rank caused, 0..1."""


@dataclass(frozen=True, kw_only=True)
class StepWaits:
    """Collectives of one step."""

    step: int
    collectives: int
    most_often_last: int | None
    """The rank last (by min_lateness_us) at most of this step's collectives; None if nobody was."""
    max_lateness_us: float
    total_wait_us: float
    """Sum over ranks of their waiting in the step (each rank's the union of its waits)."""
    wait_by_rank_us: dict[int, float] = field(default_factory=dict)
    """rank -> its waiting in the step: the union of its waits (waiting_by_step)."""


@dataclass(frozen=True, kw_only=True)
class Stragglers:
    by_step_time: list[StepTimeRank] = field(default_factory=list)
    """Ranks by mean step time, slowest first."""
    slowest_rank: int | None = None
    collective_source: str | None = None
    matched_collectives: int = 0
    """Collective instances found on at least two ranks."""
    unmatched_collectives: int = 0
    """Instances missing on some rank that issues collectives of that name in the window (different step
    windows, a trace cut short). A sub-group's collectives, named by group (collectives.py), count as
    matched when all the group's members have them."""
    min_lateness_us: float = DEFAULT_MIN_LATENESS_US
    by_wait: list[RankWait] = field(default_factory=list)
    """Ranks by caused_wait_us, largest first."""
    waited_for_rank: int | None = None
    """The rank the others wait for most; None when nobody was late by min_lateness_us."""
    waited_for_median_us: float | None = None
    consistent: bool = False
    """waited_for_rank causes most (>= CONSISTENT_SHARE) of the waiting, however few instances it is last
    at; the verdict then names it, so it never reads "spread" beside a majority share."""
    by_step: list[StepWaits] = field(default_factory=list)
    worst_instances: list[CollectiveInstance] = field(default_factory=list)
    detail_ranks: list[int] = field(default_factory=list)
    details: list[InstanceDetail] = field(default_factory=list)
    """Every instance, when ranks x instances <= DETAIL_CELL_LIMIT (else empty)."""
    verdict: str = ""


def find_stragglers(results: list[RankResult], matrix: ArrivalMatrix | None, *,
                    min_lateness_us: float = DEFAULT_MIN_LATENESS_US,
                    cause_hints: dict[int, str] | None = None) -> Stragglers:
    """Straggler ranking of one window; `matrix` already on the common clock (None: no collectives).
    `cause_hints[rank]`: a cause other analyses know for that rank (e.g. moe_imbalance, cross_rank/moe.py),
    added to the verdict when it is the rank that causes the most waiting."""
    by_step = rank_by_step_time(results)
    slowest = by_step[0].rank if by_step else None
    shared = matrix.present.sum(axis=0) >= 2 if matrix is not None else None
    if matrix is None or not shared.any():
        return Stragglers(by_step_time=by_step, slowest_rank=slowest, min_lateness_us=min_lateness_us,
                          unmatched_collectives=len(matrix.keys) if matrix is not None else 0,
                          collective_source=", ".join(matrix.sources) if matrix is not None else None,
                          verdict=_verdict(by_step, [], None, False))
    shared_matrix = matrix.columns(shared)
    instances = _instances(shared_matrix)
    waits = _rank_waits(shared_matrix, instances, min_lateness_us)
    top = waits[0] if waits and waits[0].times_last else None
    consistent = top is not None and top.score >= CONSISTENT_SHARE
    return Stragglers(
        by_step_time=by_step,
        slowest_rank=slowest,
        collective_source=", ".join(matrix.sources) or None,
        matched_collectives=int(shared.sum()),
        unmatched_collectives=_unmatched(matrix),
        min_lateness_us=min_lateness_us,
        by_wait=waits,
        waited_for_rank=top.rank if top else None,
        waited_for_median_us=top.median_lateness_us if top else None,
        consistent=consistent,
        by_step=_step_waits(shared_matrix, instances, min_lateness_us),
        worst_instances=sorted(instances, key=lambda i: -i.lateness_us)[:WORST_INSTANCES_KEPT],
        detail_ranks=list(shared_matrix.ranks),
        details=_details(shared_matrix),
        verdict=_with_hint(_verdict(by_step, waits, top, consistent), top, cause_hints or {}),
    )


def _with_hint(verdict: str, top: RankWait | None, hints: dict[int, str]) -> str:
    if top is None or top.rank not in hints:
        return verdict
    return f"{verdict.rstrip('.')}; likely cause: {hints[top.rank]}."


def _unmatched(matrix: ArrivalMatrix) -> int:
    """Instances some rank lacks among the ranks that issue that collective name in the window."""
    columns_by_name: dict[str, list[int]] = {}
    for column, key in enumerate(matrix.keys):
        columns_by_name.setdefault(key[1], []).append(column)
    unmatched = 0
    for columns in columns_by_name.values():
        present = matrix.present[:, columns]
        issuers = present.any(axis=1)
        unmatched += int((present[issuers].sum(axis=0) < issuers.sum()).sum())
    return unmatched


def rank_by_step_time(results: list[RankResult]) -> list[StepTimeRank]:
    means = {r.rank: float(np.mean([s.step_time_ms for s in r.steps])) for r in results if r.steps}
    if not means:
        return []
    median = float(np.median(list(means.values())))
    ranking = [StepTimeRank(rank=rank, mean_step_ms=mean,
                            vs_median_pct=100.0 * (mean - median) / median if median > 0 else 0.0)
               for rank, mean in means.items()]
    return sorted(ranking, key=lambda r: (-r.mean_step_ms, r.rank))


def others_median(values: np.ndarray, excluded_row: np.ndarray) -> np.ndarray:
    """Per column, the median of the values of every row except `excluded_row[column]`."""
    others = values.copy()
    others[excluded_row, np.arange(values.shape[1])] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a column whose only other value is missing
        return np.nanmedian(others, axis=0)


def _instances(m: ArrivalMatrix) -> list[CollectiveInstance]:
    last_row = np.nanargmax(m.start_us, axis=0)
    columns = np.arange(m.start_us.shape[1])
    lateness = m.start_us[last_row, columns] - others_median(m.start_us, last_row)
    extra = m.interval_compute_us[last_row, columns] - others_median(m.interval_compute_us, last_row)
    spread = np.nanmax(m.start_us, axis=0) - np.nanmin(m.start_us, axis=0)
    end_spread = np.nanmax(m.end_us, axis=0) - np.nanmin(m.end_us, axis=0)
    participants = m.present.sum(axis=0)
    return [
        CollectiveInstance(step=key[0], name=key[1], ordinal=key[2], participants=int(participants[i]),
                           last_rank=m.ranks[last_row[i]], lateness_us=float(lateness[i]),
                           extra_compute_us=float(np.nan_to_num(extra[i])), arrival_spread_us=float(spread[i]),
                           end_spread_us=float(end_spread[i]))
        for i, key in enumerate(m.keys)
    ]


def waiting_by_step(m: ArrivalMatrix) -> dict[int, dict[int, float]]:
    """step -> rank -> its waiting in the step, us: the union of its waits [its arrival, the last arrival] at the
    step's instances (analysis/quantities.py "waiting"); every figure of waiting is taken from here."""
    last = np.nanmax(m.start_us, axis=0)
    steps = [key[0] for key in m.keys]
    by_step: dict[int, dict[int, float]] = {}
    for row, rank in enumerate(m.ranks):
        present = m.present[row]
        for step, us in union_by_step_us(np.asarray(steps)[present], m.start_us[row, present], last[present]).items():
            by_step.setdefault(step, {})[rank] = us
    return by_step


def caused_by_step(m: ArrivalMatrix, columns: np.ndarray, caused_us: np.ndarray) -> dict[int, float]:
    """step -> the waiting a late rank caused at `columns`, us: the union of the stretches of `caused_us` that end
    at its arrival (the last one) at each of them (analysis/quantities.py "waiting caused")."""
    arrival = np.nanmax(m.start_us[:, columns], axis=0)
    steps = np.asarray([m.keys[c][0] for c in columns], dtype=np.int64)
    return union_by_step_us(steps, arrival - np.maximum(caused_us, 0.0), arrival)


def _rank_waits(m: ArrivalMatrix, instances: list[CollectiveInstance], min_lateness_us: float) -> list[RankWait]:
    by_step = waiting_by_step(m)
    taken = m.present.sum(axis=1)
    late_by_rank: dict[int, list[int]] = {rank: [] for rank in m.ranks}
    for column, instance in enumerate(instances):
        if instance.lateness_us >= min_lateness_us:
            late_by_rank[instance.last_rank].append(column)
    caused_by_rank = {rank: _caused_us(m, instances, columns) for rank, columns in late_by_rank.items()}
    total_caused = sum(caused_by_rank.values())
    waits = []
    for row, rank in enumerate(m.ranks):
        late = [instances[c] for c in late_by_rank[rank]]
        caused = caused_by_rank[rank]
        waits.append(RankWait(
            rank=rank, collectives=int(taken[row]), times_last=len(late),
            last_pct=100.0 * len(late) / int(taken[row]) if taken[row] else 0.0,
            caused_wait_us=caused,
            median_lateness_us=float(np.median([i.lateness_us for i in late])) if late else None,
            median_extra_compute_us=float(np.median([i.extra_compute_us for i in late])) if late else None,
            waited_us=float(sum(ranks.get(rank, 0.0) for ranks in by_step.values())),
            score=caused / total_caused if total_caused > 0 else 0.0,
        ))
    return sorted(waits, key=lambda w: (-w.caused_wait_us, w.rank))


def _caused_us(m: ArrivalMatrix, instances: list[CollectiveInstance], columns: list[int]) -> float:
    if not columns:
        return 0.0
    lateness = np.asarray([instances[c].lateness_us for c in columns])
    return float(sum(caused_by_step(m, np.asarray(columns), lateness).values()))


def _step_waits(m: ArrivalMatrix, instances: list[CollectiveInstance], min_lateness_us: float) -> list[StepWaits]:
    by_step = waiting_by_step(m)
    steps = np.asarray([key[0] for key in m.keys])
    summary = []
    for step in sorted(set(steps.tolist())):
        in_step = steps == step
        late = Counter(i.last_rank for i, on in zip(instances, in_step) if on and i.lateness_us >= min_lateness_us)
        step_waits = {rank: by_step.get(step, {}).get(rank, 0.0) for rank in m.ranks}
        summary.append(StepWaits(
            step=int(step), collectives=int(in_step.sum()),
            most_often_last=late.most_common(1)[0][0] if late else None,
            max_lateness_us=max(i.lateness_us for i, on in zip(instances, in_step) if on),
            total_wait_us=float(sum(step_waits.values())),
            wait_by_rank_us=step_waits,
        ))
    return summary


def _details(m: ArrivalMatrix) -> list[InstanceDetail]:
    if m.start_us.size > DETAIL_CELL_LIMIT:
        return []
    first = np.nanmin(m.start_us, axis=0)
    last = np.nanmax(m.start_us, axis=0)

    def column(values: np.ndarray) -> list[float | None]:
        return [None if np.isnan(v) else float(v) for v in values]

    return [
        InstanceDetail(step=key[0], name=key[1], ordinal=key[2], arrival_us=column(m.start_us[:, i] - first[i]),
                       wait_us=column(last[i] - m.start_us[:, i]), interval_compute_us=column(m.interval_compute_us[:, i]),
                       first_start_us=float(first[i]))
        for i, key in enumerate(m.keys)
    ]


def versus_typical(slowest_ms: float, mean_ms_by_rank: dict[int, float]) -> str:
    """The slowest rank's mean step against a typical rank's: "+2.4% vs the median rank"; with two ranks there
    is no median rank to speak of, so against the other one: "+4.9% vs rank 0, the fastest"."""
    if len(mean_ms_by_rank) == 2:
        fastest = min(mean_ms_by_rank, key=lambda rank: (mean_ms_by_rank[rank], rank))
        base = mean_ms_by_rank[fastest]
        return f"{100.0 * (slowest_ms - base) / base if base > 0 else 0.0:+.1f}% vs rank {fastest}, the fastest"
    median = float(np.median(list(mean_ms_by_rank.values())))
    return f"{100.0 * (slowest_ms - median) / median if median > 0 else 0.0:+.1f}% vs the median rank"


def _verdict(by_step: list[StepTimeRank], waits: list[RankWait], top: RankWait | None, consistent: bool) -> str:
    parts = []
    means = {r.rank: r.mean_step_ms for r in by_step}
    if len(by_step) > 1 and by_step[0].vs_median_pct < EVEN_STEPS_PCT:
        parts.append(f"step times are even across ranks ({by_step[0].mean_step_ms:.2f} ms mean at most, "
                     f"{versus_typical(by_step[0].mean_step_ms, means)})")
    elif len(by_step) > 1:
        slowest = by_step[0]
        parts.append(f"rank {slowest.rank} has the slowest steps ({slowest.mean_step_ms:.2f} ms mean, "
                     f"{versus_typical(slowest.mean_step_ms, means)})")
    if not waits:
        parts.append("no collectives matched across ranks")
    elif top is None:
        parts.append("no rank keeps the others waiting at collectives")
    elif consistent:
        parts.append(_straggler_sentence(top))
    else:
        shares = ", ".join(f"rank {w.rank} {100 * w.score:.0f}%" for w in waits[:3] if w.times_last)
        parts.append(f"no single straggler at collectives: the waiting is spread ({shares} of it)")
    return "; ".join(parts) + "." if parts else "nothing to rank."


def _straggler_sentence(top: RankWait) -> str:
    """Names the rank that causes most of the waiting, with how often it was last (which may be a minority
    of the collectives: a few long delays outweigh many short ones). Why it is late: causes.py."""
    return (f"the others wait for rank {top.rank} at collectives: it causes {100 * top.score:.0f}% of all "
            f"waiting ({top.caused_wait_us / 1000:.2f} ms), last at {top.times_last} of {top.collectives} "
            f"({top.last_pct:.0f}%), a median {top.median_lateness_us / 1000:.2f} ms late")
