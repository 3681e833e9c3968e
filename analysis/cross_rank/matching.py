"""Which calls of different ranks are one collective instance: by the process group's sequence numbers where
every member records them, else by issue order.

per_rank/collectives.py keys each rank's calls by order, (step, name, ordinal of the name in the step): exact
when every rank's window holds the same collectives, wrong from the first difference on (a rank whose window
starts a collective later pairs its first call with the others' first, and so on to the end of the step, or
of the window without step markers). Newer PyTorch numbers each collective of a process group on every
member alike (`Seq`, names.SEQUENCE_ARG, on the NCCL kernels), which names an instance exactly. The rule,
per process group of a window (the group label of the calls, comm_bytes.MessageSizes.group):

  - METHOD_SEQUENCE when every rank that issues collectives of the group records a sequence number on each
    of them and numbers no two alike: each call is keyed (step, name, sequence number), step and name being
    the instance's on most of its ranks (a real step before NO_STEP among equals, then the lowest rank's);
  - METHOD_ORDER otherwise, and always for calls that name no group (gloo spans, host ops): the keys of
    per_rank/collectives.py as they are.

Every reader of instance keys (the report's cross-rank stages, build.py; the merge's arrows and summary,
merge/sources.py) takes a window's results through `match_collectives` first, so they agree. Applying it
twice gives the same keys.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.collectives import NO_STEP, CollectiveKey
from fleetscope.analysis.per_rank.rank import RankResult

METHOD_SEQUENCE = "sequence numbers"
METHOD_ORDER = "order"
METHOD_MIXED = "sequence numbers and order"
"""A window's method when some of its groups are matched one way and some the other."""
NO_GROUP = ""
"""The group entry of calls whose trace names no process group."""


@dataclass(frozen=True, kw_only=True)
class GroupMatching:
    group: str
    """Process group label (names.process_group_label); NO_GROUP for calls that name none."""
    method: str
    """METHOD_SEQUENCE or METHOD_ORDER."""
    ranks: int
    """Ranks of the window issuing collectives of the group."""
    instances: int
    """Distinct instances of the group after matching."""
    reason: str = ""
    """Why the group is matched by order ("" when by sequence numbers)."""


@dataclass(frozen=True, kw_only=True)
class CollectiveMatching:
    method: str | None = None
    """METHOD_SEQUENCE, METHOD_ORDER or METHOD_MIXED over the window's groups; None: no collectives."""
    groups: list[GroupMatching] = field(default_factory=list)


def match_collectives(results: list[RankResult]) -> tuple[list[RankResult], CollectiveMatching]:
    """The window's results with every collective keyed by the rule of the module docstring (same order),
    and how each group was matched."""
    members = _calls_by_group(results)
    if not members:
        return list(results), CollectiveMatching()
    by_rank = {r.rank: r for r in results}
    new_keys: dict[int, list[CollectiveKey]] = {}
    groups = []
    for label in sorted(members):
        calls = members[label]
        reason = _order_reason(label, calls, by_rank)
        if not reason:
            _key_by_sequence(calls, by_rank, new_keys)
        keys = {key for rank, indices in calls.items()
                for key in _keys_at(new_keys.get(rank) or by_rank[rank].collectives.keys, indices)}
        groups.append(GroupMatching(group=label, method=METHOD_ORDER if reason else METHOD_SEQUENCE,
                                    ranks=len(calls), instances=len(keys), reason=reason))
    methods = {g.method for g in groups}
    matching = CollectiveMatching(method=methods.pop() if len(methods) == 1 else METHOD_MIXED, groups=groups)
    return [_rekeyed(r, new_keys[r.rank]) if r.rank in new_keys else r for r in results], matching


def match_by_window(results: list[RankResult]) -> list[RankResult]:
    """Each window's results through `match_collectives`, in the order of `results`."""
    positions: dict[int | None, list[int]] = {}
    for position, result in enumerate(results):
        positions.setdefault(result.window, []).append(position)
    matched = list(results)
    for window_positions in positions.values():
        for position, result in zip(window_positions, match_collectives([results[p] for p in window_positions])[0]):
            matched[position] = result
    return matched


def _calls_by_group(results: list[RankResult]) -> dict[str, dict[int, np.ndarray]]:
    """group label -> rank -> indices of its calls of that group (issue order)."""
    found: dict[str, dict[int, list[int]]] = {}
    for result in results:
        calls = result.collectives
        if not len(calls):
            continue
        labels = calls.sizes.group if calls.sizes is not None else [None] * len(calls)
        for index, label in enumerate(labels):
            found.setdefault(label or NO_GROUP, {}).setdefault(result.rank, []).append(index)
    return {label: {rank: np.asarray(indices, dtype=np.int64) for rank, indices in ranks.items()}
            for label, ranks in found.items()}


def _order_reason(label: str, calls: dict[int, np.ndarray], by_rank: dict[int, RankResult]) -> str:
    """Why the group cannot be matched by sequence numbers; "" when it can."""
    if label == NO_GROUP:
        return "the trace names no process group"
    for rank in sorted(calls):
        numbers = _sequence(by_rank[rank], calls[rank])
        if numbers is None or (numbers < 0).any():
            return f"rank {rank} records no sequence numbers"
        if np.unique(numbers).size != numbers.size:
            return f"rank {rank} numbers two collectives alike"
    return ""


def _sequence(result: RankResult, indices: np.ndarray) -> np.ndarray | None:
    sequence = result.collectives.sequence
    return sequence[indices] if sequence.size == len(result.collectives) else None


def _key_by_sequence(calls: dict[int, np.ndarray], by_rank: dict[int, RankResult],
                     new_keys: dict[int, list[CollectiveKey]]) -> None:
    """Key the group's calls (step, name, sequence number), step and name by the instance's ranks."""
    seen: dict[int, Counter] = {}
    for rank in sorted(calls):
        keys = by_rank[rank].collectives.keys
        for index, number in zip(calls[rank].tolist(), _sequence(by_rank[rank], calls[rank]).tolist()):
            seen.setdefault(number, Counter())[keys[index][:2]] += 1
    chosen = {number: _most_common(votes) for number, votes in seen.items()}
    for rank in sorted(calls):
        keys = new_keys.setdefault(rank, list(by_rank[rank].collectives.keys))
        for index, number in zip(calls[rank].tolist(), _sequence(by_rank[rank], calls[rank]).tolist()):
            step, name = chosen[number]
            keys[index] = (step, name, number)


def _most_common(votes: Counter) -> tuple[int, str]:
    """The (step, name) most ranks give; a real step before NO_STEP among equals, then the first seen (the
    lowest rank's)."""
    if len(votes) == 1:
        return next(iter(votes))
    return max(votes, key=lambda item: (votes[item], item[0] != NO_STEP))


def _keys_at(keys: list[CollectiveKey], indices: np.ndarray) -> list[CollectiveKey]:
    return [keys[i] for i in indices.tolist()]


def _rekeyed(result: RankResult, keys: list[CollectiveKey]) -> RankResult:
    """`result` with its collectives (and the MoE all-to-alls that name them) under `keys`."""
    renamed = dict(zip(result.collectives.keys, keys))
    moe = result.moe
    if moe is not None and moe.all_to_alls:
        moe = dataclasses.replace(moe, all_to_alls=[dataclasses.replace(a, key=renamed.get(a.key, a.key))
                                                    for a in moe.all_to_alls])
    return dataclasses.replace(result, collectives=dataclasses.replace(result.collectives, keys=keys), moe=moe)
