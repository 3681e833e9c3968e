"""Which ranks a default merge draws in full: the focus set (pure planning, no I/O).

A merged trace of every rank in full outgrows what ui.perfetto.dev can open (a tab holds about 2 GB and
needs 2-4x the file), so by default the merge draws in full only the ranks worth looking at, and a
compact summary of every rank (summary.py) so that none disappears. Candidates, in priority order:

  1. the ranks the analysis report names (report_view.report_named_ranks: hang late ranks, the rank
     others wait for, the slowest rank, straggler causes, critical-path ranks, hot-expert holders);
     without a report, the ranks the same findings name when the merge runs the cross-rank stages itself
     (stages.py; each reason says so), else the rank with the slowest median step (`fallback_named`);
  2. the median rank by step time (what a normal rank looks like);
  3. process-group peers of each named rank: only its smallest group (fewest members), nearest ranks
     first, at most `FocusConfig.max_peers` per named rank;
  4. one rank per host (its lowest rank), hosts by their lowest rank.

A rank found by several rules keeps every reason and its earliest place. Candidates are taken in that
order while the estimated output (the summary plus the ranks taken so far) stays within the budget; one
that does not fit is left out for the budget and the next is tried. The first candidate is always
taken, so the file shows at least one rank in full. When every rank fits, every rank is taken.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping

DEFAULT_BUDGET_BYTES = 400_000_000
"""The whole default output (summary included). The UI needs up to 4x the file in a tab of about 2 GB,
and the trace processor about 3x it (bench/merge_scale_results.md): 400 MB stays well under both."""
DEFAULT_MAX_PEERS = 8
FULL_BYTES_PER_EVENT = 70
"""Output bytes per parsed event of a rank drawn in full (packets, flows, overlays), default options:
59 measured on the H200 GPU fixture, 66 on the gloo CPU one; rounded up."""

REASON_ALL_FIT = "all ranks fit the size budget"
REASON_MEDIAN = "median step time"
REASON_SLOWEST_NO_REPORT = "slowest median step (no analysis report)"


def peer_reason(rank: int, group: str) -> str:
    return f"process-group peer of rank {rank} ({group})"


def host_reason(host: str) -> str:
    return f"first rank of host {host}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFacts:
    """What the planner knows of one rank (from the per-rank parse)."""

    rank: int
    host: str
    estimated_bytes: int
    """Estimated size of this rank drawn in full (summary.estimated_full_bytes)."""
    median_step_ms: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class NamedRank:
    rank: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class FocusConfig:
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    """Estimated size of the whole output the focus set may take (summary included)."""
    max_peers: int = DEFAULT_MAX_PEERS
    """Process-group peers taken per named rank."""

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {self.budget_bytes}")
        if self.max_peers < 0:
            raise ValueError(f"max_peers must be >= 0, got {self.max_peers}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FocusChoice:
    rank: int
    reasons: tuple[str, ...]
    estimated_bytes: int


@dataclass(frozen=True, kw_only=True)
class FocusPlan:
    budget_bytes: int
    summary_bytes: int
    """Estimated size of the summary of every rank."""
    chosen: tuple[FocusChoice, ...]
    """Ranks drawn in full, in rank order."""
    over_budget: tuple[FocusChoice, ...] = ()
    """Candidates left out because they did not fit, in priority order."""
    left_out: tuple[int, ...] = ()
    """Every rank not drawn in full (summary only), in rank order."""

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(choice.rank for choice in self.chosen)

    @property
    def estimated_bytes(self) -> int:
        return self.summary_bytes + sum(choice.estimated_bytes for choice in self.chosen)


def plan_focus(facts: Iterable[RankFacts], named: Iterable[NamedRank], *,
               groups: Mapping[str, Iterable[int]] | None = None, config: FocusConfig = FocusConfig(),
               summary_bytes: int = 0) -> FocusPlan:
    """The focus set of `facts`' ranks (module docstring); `groups`: process group label -> member ranks."""
    by_rank = {fact.rank: fact for fact in sorted(facts, key=lambda f: f.rank)}
    named = [n for n in named if n.rank in by_rank]
    if all_fit(by_rank.values(), summary_bytes, config):
        reasons = _reasons_in_order(named)
        chosen = tuple(FocusChoice(rank=r, reasons=tuple(reasons.get(r, [])) + (REASON_ALL_FIT,),
                                   estimated_bytes=f.estimated_bytes) for r, f in by_rank.items())
        return FocusPlan(budget_bytes=config.budget_bytes, summary_bytes=summary_bytes, chosen=chosen)
    candidates = _candidates(by_rank, named, {k: sorted(set(v)) for k, v in (groups or {}).items()}, config)
    return _fit(candidates, by_rank, config.budget_bytes, summary_bytes)


def all_fit(facts: Iterable[RankFacts], summary_bytes: int, config: FocusConfig) -> bool:
    """Every rank in full fits the budget with the summary: then every rank is taken, whatever is named."""
    return summary_bytes + sum(f.estimated_bytes for f in facts) <= config.budget_bytes


def fallback_named(facts: Iterable[RankFacts]) -> list[NamedRank]:
    """Without a report: the rank with the slowest median step (the lowest rank among equals)."""
    timed = [f for f in facts if f.median_step_ms is not None]
    if not timed:
        return []
    slowest = min(timed, key=lambda f: (-f.median_step_ms, f.rank))
    return [NamedRank(rank=slowest.rank, reason=REASON_SLOWEST_NO_REPORT)]


def median_rank(facts: Iterable[RankFacts]) -> int | None:
    """The rank whose median step time is the (lower) median over ranks; ties by rank."""
    timed = sorted((f.median_step_ms, f.rank) for f in facts if f.median_step_ms is not None)
    return timed[(len(timed) - 1) // 2][1] if timed else None


def rank_median_step_ms(step_times_ms: Iterable[float]) -> float | None:
    times = list(step_times_ms)
    return float(statistics.median(times)) if times else None


def _reasons_in_order(named: list[NamedRank]) -> dict[int, list[str]]:
    reasons: dict[int, list[str]] = {}
    for item in named:
        listed = reasons.setdefault(item.rank, [])
        if item.reason not in listed:
            listed.append(item.reason)
    return reasons


def _candidates(by_rank: dict[int, RankFacts], named: list[NamedRank], groups: dict[str, list[int]],
                config: FocusConfig) -> dict[int, list[str]]:
    """rank -> reasons, in priority order (dicts keep insertion order)."""
    candidates = _reasons_in_order(named)
    middle = median_rank(by_rank.values())
    if middle is not None:
        candidates.setdefault(middle, []).append(REASON_MEDIAN)
    for rank in list(dict.fromkeys(n.rank for n in named)):
        for peer, reason in _peers(rank, groups, by_rank, config.max_peers):
            candidates.setdefault(peer, []).append(reason)
    for host, rank in _host_leaders(by_rank.values()):
        candidates.setdefault(rank, []).append(host_reason(host))
    return candidates


def _peers(rank: int, groups: dict[str, list[int]], by_rank: dict[int, RankFacts],
           max_peers: int) -> list[tuple[int, str]]:
    """Up to `max_peers` members of the smallest group holding `rank` (of more than one rank), nearest first."""
    holding = [(len(members), label, members) for label, members in groups.items()
               if rank in members and len(members) > 1]
    if not holding or max_peers == 0:
        return []
    _, label, members = min(holding)
    nearest = sorted((m for m in members if m != rank and m in by_rank), key=lambda m: (abs(m - rank), m))
    return [(peer, peer_reason(rank, label)) for peer in nearest[:max_peers]]


def _host_leaders(facts: Iterable[RankFacts]) -> list[tuple[str, int]]:
    leaders: dict[str, int] = {}
    for fact in sorted(facts, key=lambda f: f.rank):
        leaders.setdefault(fact.host, fact.rank)
    return sorted(leaders.items(), key=lambda item: item[1])


def _fit(candidates: dict[int, list[str]], by_rank: dict[int, RankFacts], budget: int,
         summary_bytes: int) -> FocusPlan:
    used, chosen, over = summary_bytes, [], []
    for rank, reasons in candidates.items():
        choice = FocusChoice(rank=rank, reasons=tuple(reasons), estimated_bytes=by_rank[rank].estimated_bytes)
        if not chosen or used + choice.estimated_bytes <= budget:
            chosen.append(choice)
            used += choice.estimated_bytes
        else:
            over.append(choice)
    taken = {c.rank for c in chosen}
    return FocusPlan(budget_bytes=budget, summary_bytes=summary_bytes,
                     chosen=tuple(sorted(chosen, key=lambda c: c.rank)), over_budget=tuple(over),
                     left_out=tuple(r for r in by_rank if r not in taken))
