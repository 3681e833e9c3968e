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

Per rank: score = its share of all the waiting caused (its caused waiting, over the sum for all ranks), in [0, 1].

Significance before blame (`significance`, analysis/quantities.py "stands out"): a rank is named only when its
lateness stands out from the step-to-step spread. Per profiled step (collectives outside every step count only
when no step has any; with fewer than two steps each instance counts on its own), its signed lateness vs peers is
the mean, over the step's instances it took part in, of its arrival - the median arrival of the other
participants (negative: it was early). Steps, not instances, are the unit: one late backward delays every
gradient bucket of its step at once. Over the n steps, mean d
and a spread s, the larger of
  - its own step-to-step standard deviation (n - 1 degrees of freedom), and
  - with 3 ranks or more, the other ranks' spread: their per-step lateness vs peers with this rank left out, about
    each one's own mean (what a rank without a fault wanders by from step to step), pooled;
t = d / (s / sqrt(n)) must reach the one-sided Student t quantile at SIGNIFICANCE_ALPHA / ranks (Bonferroni: the
rank the others wait for most is the largest of `ranks` draws) for the spread's degrees of freedom. Without a
spread (one step of two ranks) nothing can stand out. A rank late in some steps only (a pause every other step)
is judged by those (`_intermittent`): its lateness in its late steps against its earliness in the others, Welch's
t at the same level (without a fault both sides are alike: the peers' noise mirrors its own). The TESTED_RANKS
ranks causing the most waiting are tested.
Confidence of a rank that stands out (`straggler_confidence`): "high" with at least HIGH_STEPS steps, HIGH_RANKS
ranks (with two, one rank's lateness is the other's earliness: its own spread is the only baseline) and t at
least HIGH_MARGIN x the quantile; "medium" with at least MEDIUM_STEPS steps; "low" below (2-3 steps).

The verdict names a straggler when one rank causes most of the waiting and stands out (its share, how often it
was last and the significance are stated); "nothing stands out" when the rank causing the most waiting does not;
"spread" when no rank causes most of it. Where that sentence names a rank, the step-time clause names none
(`step_time_clause`; in a synchronous job a rank's step time mostly shows where its wait falls): one verdict,
one rank. Why the straggler is late (work, slow device, host, network, clock) is classified in causes.py.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from statistics import NormalDist

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
SIGNIFICANCE_ALPHA = 0.05
"""Family-wise: the chance that a job without a straggler gets one named, over all its ranks (module docstring)."""
TESTED_RANKS = 5
"""The ranks causing the most waiting whose significance is tested; the others are never named."""
MEDIUM_STEPS = 4
HIGH_STEPS = 8
HIGH_RANKS = 3
HIGH_MARGIN = 2.0
"""Confidence rule (module docstring): steps and ranks for "medium" / "high", and t over its quantile for "high"."""
MANY_STEPS = 30
"""A rank whose t would pass with this many degrees of freedom, but not its own, is told "too few steps"."""
T_SHOWN_MAX = 1000.0
"""t is kept up to this (a spread of zero gives an infinite t; the report's JSON holds finite numbers)."""
SPREAD_OWN = "its own"
SPREAD_OTHERS = "the other ranks'"
SPREAD_INTERMITTENT = "its late steps against its early ones"
INTERMITTENT_MIN_STEPS = 2
"""Steps needed on each side (late, early) before a rank late in some steps only is judged by them."""


@dataclass(frozen=True, kw_only=True)
class Significance:
    """Whether a rank's lateness stands out from the step-to-step spread (module docstring)."""

    rank: int
    steps: int
    """Profiled steps with an instance it took part in: the test's n."""
    ranks: int
    """Ranks of the window with collectives: the Bonferroni count."""
    lateness_vs_peers_us: float
    """Mean over the steps of its signed lateness vs peers (negative: early on average)."""
    spread_us: float | None
    """The step-to-step spread it is judged against (None: no spread could be measured)."""
    spread_source: str = ""
    """SPREAD_OWN or SPREAD_OTHERS: the larger of the two."""
    degrees_of_freedom: int = 0
    t: float | None = None
    """lateness / (spread / sqrt(steps)), at most T_SHOWN_MAX; None without a spread."""
    needed_t: float | None = None
    """The one-sided Student t quantile at SIGNIFICANCE_ALPHA / ranks for degrees_of_freedom."""
    stands_out: bool = False
    confidence: str = ""
    """"high", "medium" or "low" when it stands out (straggler_confidence), else ""."""

    def evidence(self) -> str:
        """The figures the test rests on, as the verdict prints them."""
        late = (f"{self.lateness_vs_peers_us / 1000:.2f} ms late per step on average over {self.steps} "
                f"step{'s' if self.steps != 1 else ''}")
        if self.spread_us is None or self.t is None or self.needed_t is None:
            return f"{late}, too few steps and ranks to measure how it varies"
        t = f">= {T_SHOWN_MAX:g}" if self.t >= T_SHOWN_MAX else f"{self.t:.2f}"
        return (f"{late}, varying by {self.spread_us / 1000:.2f} ms from step to step ({self.spread_source}): "
                f"t {t}, {self.needed_t:.2f} needed")


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
    significance: Significance | None = None
    """Whether its lateness stands out (module docstring); None: not tested (not among TESTED_RANKS, never last)."""


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
    """The rank the others wait for most; None when nobody was late by min_lateness_us, or when its lateness does
    not stand out from the step-to-step spread (`significance`: nothing stands out)."""
    waited_for_median_us: float | None = None
    consistent: bool = False
    """waited_for_rank causes most (>= CONSISTENT_SHARE) of the waiting, however few instances it is last
    at, and stands out; the verdict then names it, so it never reads "spread" beside a majority share."""
    significance: Significance | None = None
    """The test of the rank causing the most waiting (by_wait[0]), whether or not it stands out."""
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
    leader = waits[0] if waits and waits[0].times_last else None
    top = leader if leader is not None and leader.significance is not None and leader.significance.stands_out else None
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
        significance=leader.significance if leader is not None else None,
        by_step=_step_waits(shared_matrix, instances, min_lateness_us),
        worst_instances=sorted(instances, key=lambda i: -i.lateness_us)[:WORST_INSTANCES_KEPT],
        detail_ranks=list(shared_matrix.ranks),
        details=_details(shared_matrix),
        verdict=_with_hint(_verdict(by_step, waits, top, consistent, leader), top, cause_hints or {}),
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
    ordered = sorted(waits, key=lambda w: (-w.caused_wait_us, w.rank))
    tested = {w.rank for w in ordered[:TESTED_RANKS] if w.times_last}
    return [dataclasses.replace(w, significance=significance(m, m.ranks.index(w.rank))) if w.rank in tested else w
            for w in ordered]


# -- significance: does a rank's lateness stand out from the step-to-step spread (module docstring) --------


def others_median_each(values: np.ndarray) -> np.ndarray:
    """Per entry, the median of the other present values of its column (NaN where it or all others are missing):
    others_median for every row at once, from each column's sorted order."""
    rows = values.shape[0]
    order = np.argsort(values, axis=0)                      # NaN last
    ordered = np.take_along_axis(values, order, axis=0)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.broadcast_to(np.arange(rows)[:, None], order.shape), axis=0)
    remaining = np.sum(~np.isnan(values), axis=0) - 1       # the others present, per column
    lo, hi = (remaining - 1) // 2, remaining // 2           # their median's indices among the others
    # the others in sorted order skip the entry's own position
    lo_index = np.clip(lo[None, :] + (lo[None, :] >= position), 0, rows - 1)
    hi_index = np.clip(hi[None, :] + (hi[None, :] >= position), 0, rows - 1)
    median = (np.take_along_axis(ordered, lo_index, axis=0) + np.take_along_axis(ordered, hi_index, axis=0)) / 2
    median[np.isnan(values) | (remaining[None, :] < 1)] = np.nan
    return median


def lateness_by_step(m: ArrivalMatrix) -> np.ndarray:
    """ranks x units: each rank's signed lateness vs peers per step (module docstring), NaN where it took part in
    none of the step's instances. Instances outside every step (-1) count only when there is no step; with fewer
    than two steps each instance is a unit (the only repetition there is)."""
    steps = np.asarray([key[0] for key in m.keys])
    signed = m.start_us - others_median_each(m.start_us)
    units = sorted(set(steps.tolist()) - {-1})
    if len(units) < 2:
        return signed
    by_step = np.full((len(m.ranks), len(units)), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # a rank with none of the step's instances
        for column, step in enumerate(units):
            by_step[:, column] = np.nanmean(signed[:, steps == step], axis=1)
    return by_step


def significance(m: ArrivalMatrix, row: int) -> Significance:
    """The test of the module docstring for the rank of `row`, on the matrix of the instances found on 2+ ranks."""
    ranks = len(m.ranks)
    own = lateness_by_step(m)[row]
    own = own[np.isfinite(own)]
    steps = int(own.size)
    mean = float(own.mean()) if steps else 0.0
    spreads = []                                            # (spread, source, degrees of freedom)
    if steps >= 2:
        spreads.append((float(np.std(own, ddof=1)), SPREAD_OWN, steps - 1))
    if ranks >= 3:
        spreads += _others_spread(_without_row_lateness(m, row))
    if not spreads or steps == 0:
        return Significance(rank=m.ranks[row], steps=steps, ranks=ranks, lateness_vs_peers_us=mean, spread_us=None)
    spread, source, freedom = max(spreads, key=lambda s: (s[0], -s[2]))
    if spread > 0:
        t = min(mean / (spread / math.sqrt(steps)), T_SHOWN_MAX)
    else:
        t = T_SHOWN_MAX if mean > 0 else 0.0
    needed = t_quantile(SIGNIFICANCE_ALPHA / ranks, freedom)
    stands_out = mean > 0 and t >= needed
    if not stands_out:
        intermittent = _intermittent(own, ranks)
        if intermittent is not None:
            t, needed, spread, source, freedom = intermittent
            stands_out = True
    return Significance(rank=m.ranks[row], steps=steps, ranks=ranks, lateness_vs_peers_us=mean, spread_us=spread,
                        spread_source=source, degrees_of_freedom=freedom, t=t, needed_t=needed, stands_out=stands_out,
                        confidence=straggler_confidence(steps, ranks, t, needed) if stands_out else "")


def series_significance(rank: int, lateness_us: np.ndarray, ranks: int) -> Significance:
    """The test of the module docstring on a rank's signed lateness vs peers per step given directly (the whole
    run's per-step excess of a slow rank, whole_run.py): against its own step-to-step spread, at the same level,
    with the same confidence rule. Unknown steps (NaN) are left out."""
    own = np.asarray(lateness_us, dtype=np.float64)
    own = own[np.isfinite(own)]
    steps = int(own.size)
    mean = float(own.mean()) if steps else 0.0
    if steps < 2:
        return Significance(rank=rank, steps=steps, ranks=ranks, lateness_vs_peers_us=mean, spread_us=None)
    spread = float(np.std(own, ddof=1))
    t = min(mean / (spread / math.sqrt(steps)), T_SHOWN_MAX) if spread > 0 else (T_SHOWN_MAX if mean > 0 else 0.0)
    needed = t_quantile(SIGNIFICANCE_ALPHA / max(ranks, 1), steps - 1)
    stands_out = mean > 0 and t >= needed
    return Significance(rank=rank, steps=steps, ranks=ranks, lateness_vs_peers_us=mean, spread_us=spread,
                        spread_source=SPREAD_OWN, degrees_of_freedom=steps - 1, t=t, needed_t=needed,
                        stands_out=stands_out,
                        confidence=straggler_confidence(steps, ranks, t, needed) if stands_out else "")


def _intermittent(own: np.ndarray, ranks: int) -> tuple[float, float, float, str, int] | None:
    """A rank late in some steps only (a pause every other step, a periodic checkpoint): the mean test above
    averages its late steps with its early ones. Without a straggler a rank's lateness is as large when it is
    late as when it is early (the peers' noise mirrors its own); so it stands out when its lateness in its late
    steps exceeds its earliness in the others by Welch's t at the same level. (t, needed, spread, source,
    degrees of freedom), or None when it does not or there are too few steps on either side."""
    late, early = own[own > 0], -own[own < 0]
    if late.size < INTERMITTENT_MIN_STEPS or early.size < INTERMITTENT_MIN_STEPS or late.mean() <= early.mean():
        return None
    var_late, var_early = late.var(ddof=1) / late.size, early.var(ddof=1) / early.size
    error = math.sqrt(var_late + var_early)
    if error <= 0:
        return None
    t = min(float((late.mean() - early.mean()) / error), T_SHOWN_MAX)
    freedom = int((var_late + var_early) ** 2 / (var_late ** 2 / (late.size - 1) + var_early ** 2 / (early.size - 1))
                  ) if var_late + var_early > 0 and (var_late > 0 or var_early > 0) else late.size + early.size - 2
    freedom = max(freedom, 1)
    needed = t_quantile(SIGNIFICANCE_ALPHA / ranks, freedom)
    if t < needed:
        return None
    return t, needed, float(np.std(own, ddof=1)), SPREAD_INTERMITTENT, freedom


def _others_spread(others: np.ndarray) -> list[tuple[float, str, int]]:
    """The other ranks' step-to-step spread: their per-step lateness about each one's own mean (a rank that is always
    a little late, e.g. after waiting for the straggler in a sub-group, varies by nothing), pooled. Degrees of
    freedom: the values less one per rank, times (ranks - 1) / ranks (two ranks' lateness mirror each other)."""
    kept = [values[np.isfinite(values)] for values in others]
    kept = [values for values in kept if values.size]
    residual = sum(float(np.sum((values - values.mean()) ** 2)) for values in kept)
    pooled = sum(values.size for values in kept) - len(kept)
    freedom = int(pooled * (len(kept) - 1) / len(kept)) if kept else 0
    if pooled < 1 or freedom < 1:
        return []
    return [(math.sqrt(residual / pooled), SPREAD_OTHERS, freedom)]


def _without_row_lateness(m: ArrivalMatrix, row: int) -> np.ndarray:
    """The other ranks' lateness by step, with the rank of `row` left out of their peers."""
    keep = np.arange(len(m.ranks)) != row
    starts = m.start_us[keep]
    shared = np.sum(~np.isnan(starts), axis=0) >= 2
    rest = ArrivalMatrix([r for r, on in zip(m.ranks, keep) if on], [h for h, on in zip(m.hosts, keep) if on],
                         [k for k, on in zip(m.keys, shared) if on], starts[:, shared], m.end_us[keep][:, shared],
                         m.interval_compute_us[keep][:, shared], m.sources)
    return lateness_by_step(rest) if rest.keys else np.empty((len(rest.ranks), 0))


def straggler_confidence(steps: int, ranks: int, t: float, needed: float) -> str:
    """The confidence rule of the module docstring, for a rank that stands out."""
    if steps >= HIGH_STEPS and ranks >= HIGH_RANKS and t >= HIGH_MARGIN * needed:
        return "high"
    return "medium" if steps >= MEDIUM_STEPS else "low"


def t_quantile(alpha: float, freedom: int) -> float:
    """The one-sided upper `alpha` quantile of Student's t with `freedom` degrees of freedom: exact for 1 and 2,
    else the Cornish-Fisher expansion around the normal quantile (Abramowitz & Stegun 26.7.5): within 0.5% from 3
    degrees of freedom at 2.5%, up to 3% low far in the tail (3 degrees, 0.1%)."""
    if freedom < 1:
        return math.inf
    if freedom == 1:
        return math.tan(math.pi * (0.5 - alpha))
    p = 1.0 - alpha
    if freedom == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z, v = NormalDist().inv_cdf(p), float(freedom)
    terms = ((z ** 3 + z) / 4, (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96,
             (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384,
             (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160)
    return z + sum(term / v ** (power + 1) for power, term in enumerate(terms))


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
    is no median rank to speak of, so against the other one, unnamed ("+4.9% vs the other rank"): a verdict
    names one rank."""
    if len(mean_ms_by_rank) == 2:
        base = min(mean_ms_by_rank.values())
        return f"{100.0 * (slowest_ms - base) / base if base > 0 else 0.0:+.1f}% vs the other rank"
    median = float(np.median(list(mean_ms_by_rank.values())))
    return f"{100.0 * (slowest_ms - median) / median if median > 0 else 0.0:+.1f}% vs the median rank"


def step_time_clause(means: dict[int, float], collectives_name_a_rank: bool) -> str:
    """The verdict's step-time clause (module docstring): "step times are even across ranks (...)"; where the
    collectives' sentence names a rank (a straggler, the rank waited for most), the spread without a rank ("mean step
    99.10-106.07 ms across ranks (7.0% apart ...)"): who holds the others back is the collectives' to say, and a
    synchronous rank's step time mostly shows where its wait falls; else the slowest rank by mean step time."""
    if len(means) < 2:
        return ""
    slowest = max(means, key=lambda rank: (means[rank], -rank))
    median = float(np.median(list(means.values())))
    fastest = min(means.values())
    apart = 100.0 * (means[slowest] - fastest) / fastest if fastest > 0 else 0.0
    if median <= 0 or 100.0 * (means[slowest] - median) / median < EVEN_STEPS_PCT:
        # no rank named: the collectives' sentence may name one, and a verdict names one rank
        return f"step times are even across ranks ({fastest:.2f}-{means[slowest]:.2f} ms mean, {apart:.1f}% apart)"
    if collectives_name_a_rank:
        return (f"mean step {fastest:.2f}-{means[slowest]:.2f} ms across ranks ({apart:.1f}% apart: in a synchronous "
                "job that is mostly where each rank's wait falls)")
    return f"rank {slowest} has the slowest steps ({means[slowest]:.2f} ms mean, {versus_typical(means[slowest], means)})"


def _verdict(by_step: list[StepTimeRank], waits: list[RankWait], top: RankWait | None, consistent: bool,
             leader: RankWait | None = None) -> str:
    parts = [step_time_clause({r.rank: r.mean_step_ms for r in by_step}, collectives_name_a_rank=leader is not None)]
    if not waits:
        parts.append("no collectives matched across ranks")
    elif leader is None:
        parts.append("no rank keeps the others waiting at collectives")
    elif top is None:
        parts.append(nothing_stands_out(leader.rank, leader.significance))
    elif consistent:
        parts.append(f"{_straggler_sentence(top)} (stands out: {top.significance.evidence()})")
    else:
        shares = ", ".join(f"rank {w.rank} {100 * w.score:.0f}%" for w in waits[:3] if w.times_last)
        parts.append(f"no single straggler at collectives: the waiting is spread ({shares} of it)")
    parts = [p for p in parts if p]
    return "; ".join(parts) + "." if parts else "nothing to rank."


def nothing_stands_out(rank: int, significance: Significance | None) -> str:
    """The verdict when the rank the others wait for most does not pass the test (module docstring)."""
    if significance is None:
        return "nothing stands out at collectives"
    if significance.t is not None and significance.t >= t_quantile(SIGNIFICANCE_ALPHA / significance.ranks, MANY_STEPS):
        return (f"nothing stands out at collectives yet: rank {rank} is the rank waited for most, but "
                f"{significance.steps} step{'s are' if significance.steps != 1 else ' is'} too few to tell its lateness "
                f"from noise ({significance.evidence()}); profile more steps")
    return (f"nothing stands out at collectives: the rank waited for most, rank {rank}, is within the noise "
            f"({significance.evidence()})")


def _straggler_sentence(top: RankWait) -> str:
    """Names the rank that causes most of the waiting, with how often it was last (which may be a minority
    of the collectives: a few long delays outweigh many short ones). Why it is late: causes.py."""
    return (f"the others wait for rank {top.rank} at collectives: it causes {100 * top.score:.0f}% of all "
            f"waiting ({top.caused_wait_us / 1000:.2f} ms), last at {top.times_last} of {top.collectives} "
            f"({top.last_pct:.0f}%), a median {top.median_lateness_us / 1000:.2f} ms late")
