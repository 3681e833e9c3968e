"""Giving every analyzed trace its rank and window, and finding what is missing or duplicated.

Run directories arrive fully placed (the manifest knows rank and window). Foreign directories need work:
  - a trace without `distributedInfo` and without `rank<N>` in its name gets the lowest free rank number
    (in file-name order);
  - a rank with several traces whose times do not overlap (torch's `tensorboard_trace_handler` writes one
    file per profiling cycle) is split into successive windows 0, 1, ... by time;
  - a rank with two traces that overlap in time is a duplicate: the first (by file name) is kept, the
    other is reported.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetscope.traces.validate import membership_problem, missing_below, missing_note

from fleetscope.analysis.inputs.sources import (
    SOURCE_RUN_DIR,
    MissingTrace,
    TraceFailure,
)
from fleetscope.analysis.per_rank.rank import RANK_FROM_ORDER, RankResult
from fleetscope.analysis.inputs.resolve import rank_from_name

if TYPE_CHECKING:
    from fleetscope.analysis.inputs.resolve import AnalysisInput


@dataclass(kw_only=True)
class Placement:
    results: list[RankResult]
    failures: list[TraceFailure] = field(default_factory=list)
    missing: list[MissingTrace] = field(default_factory=list)
    """The first missing ranks of each window (validate.missing_below): a list, bounded."""
    missing_total: int = 0
    """How many rank traces are missing in all, listed or not."""
    notes: list[str] = field(default_factory=list)


def place_foreign_traces(results: list[RankResult]) -> Placement:
    """Ranks and windows for traces from a directory fleetscope did not write."""
    results, strays = _one_job(results)
    numbered, notes = _number_unranked(results)
    placement = _split_windows(numbered)
    placement.failures = strays + placement.failures
    placement.notes = notes + placement.notes
    placement.missing, placement.missing_total = bounded_missing_ranks(placement.results,
                                                                       _world_size(placement.results))
    note = missing_note(len(placement.missing), placement.missing_total)
    placement.notes += [note] if note else []
    return placement


MAX_JOB_SPAN_DAYS = 30
"""Traces of one job were recorded within this many days of the job's median trace: one recorded years apart
(another job's file in the same folder) is not a rank of this one, however its world size reads."""
EPOCH_2000_US = 946_684_800e6
"""A trace whose absolute start is before 2000 has no wall clock (relative times): its date says nothing."""


def _one_job(results: list[RankResult]) -> tuple[list[RankResult], list[TraceFailure]]:
    """The traces of one job: those that declare the majority world size (or none) with a rank below it, the
    majority backend (or none), recorded within MAX_JOB_SPAN_DAYS of the others; the rest (another job's
    traces, a rank beyond the world size) are named, not analyzed."""
    kept, strays = results, []
    for check in (_world_size_problem, _backend_problem, _date_problem):
        judge = check(kept)
        kept, strays = [r for r in kept if judge(r) is None], strays + [
            TraceFailure(label=r.label, window=r.window, rank=r.rank, reason=f"{judge(r)}: not analyzed")
            for r in kept if judge(r) is not None]
    return kept, strays


def _majority(values: list):
    return max(sorted(set(values)), key=values.count)


def _world_size_problem(results: list[RankResult]):
    sizes = [r.world_size for r in results if r.world_size]
    expected = _majority(sizes) if sizes else None
    return lambda r: None if expected is None else membership_problem(r.rank, r.world_size, expected)


def _backend_problem(results: list[RankResult]):
    backends = [r.backend for r in results if r.backend]
    expected = _majority(backends) if backends else None
    return lambda r: (None if expected is None or not r.backend or r.backend == expected else
                      f"its backend {r.backend!r} is not the job's ({expected!r}): another job's trace")


def _date_problem(results: list[RankResult]):
    starts = {id(r): _absolute_start_us(r) for r in results}
    dated = sorted(v for v in starts.values() if v is not None)
    if len(dated) < 2:
        return lambda r: None
    middle = dated[len(dated) // 2]

    def problem(r: RankResult) -> str | None:
        start = starts.get(id(r))
        if start is None or abs(start - middle) <= MAX_JOB_SPAN_DAYS * 86_400e6:
            return None
        return f"recorded {abs(start - middle) / 86_400e6:.0f} days from the other traces: another job's trace"
    return problem


def _absolute_start_us(result: RankResult) -> float | None:
    if result.first_start_us is None:
        return None
    start = result.absolute_us(result.first_start_us)
    return start if start >= EPOCH_2000_US else None


def _number_unranked(results: list[RankResult]) -> tuple[list[RankResult], list[str]]:
    """Traces that name no rank get the lowest free numbers in file-name order, one number per process:
    traces of one process on one host whose times do not overlap (a `tensorboard_trace_handler` file per
    profiling cycle) are that process's windows, split by time in _split_windows."""
    unranked = sorted((r for r in results if r.rank is None), key=lambda r: r.label)
    if not unranked:
        return results, []
    taken = {r.rank for r in results if r.rank is not None}
    free = (n for n in range(len(results) + len(taken)) if n not in taken)
    renumbered, notes = {}, []
    groups = _by_process(unranked)
    for group in groups:
        rank = next(free)
        renumbered.update({id(r): r.with_placement(rank=rank, rank_source=RANK_FROM_ORDER, window=r.window)
                           for r in group})
        if len(group) > 1:
            notes.append(f"{len(group)} traces of one process (host {group[0].host}, pid {group[0].process_id}) "
                         f"are windows of one rank (rank {rank}): " + ", ".join(r.label for r in group[:4])
                         + (" ..." if len(group) > 4 else ""))
    notes.insert(0, f"{len(unranked)} trace(s) name no rank (no rank in distributedInfo, no rank<N> in the file "
                    "name): numbered in file-name order" + ("" if len(groups) == len(unranked) else
                                                             f", one number per process ({len(groups)})"))
    return [renumbered.get(id(r), r) for r in results], notes


def _by_process(unranked: list[RankResult]) -> list[list[RankResult]]:
    """The traces grouped by process (host and pid, where the trace records a pid), in file-name order of their
    first trace; traces of one process that overlap in time are different processes after all (a reused pid
    cannot run twice at once), each its own group."""
    groups: list[list[RankResult]] = []
    by_key: dict[tuple[str, int], list[list[RankResult]]] = {}
    for result in unranked:
        key = (result.host, result.process_id) if result.process_id is not None else None
        home = None
        if key is not None:
            home = next((g for g in by_key.get(key, []) if not any(_overlaps(r, result) for r in g)), None)
        if home is None:
            home = [result]
            groups.append(home)
            if key is not None:
                by_key.setdefault(key, []).append(home)
        else:
            home.append(result)
    return groups


def _split_windows(results: list[RankResult]) -> Placement:
    placement = Placement(results=[])
    by_key: dict[tuple[int | None, int], list[RankResult]] = defaultdict(list)
    for result in results:
        by_key[(result.window, result.rank)].append(result)
    split_any = False
    for (window, rank), group in sorted(by_key.items(), key=lambda kv: (-1 if kv[0][0] is None else kv[0][0], kv[0][1])):
        kept, duplicates = _successive(group)
        placement.failures += duplicates
        if len(kept) > 1 and window is None:
            split_any = True
            kept = [r.with_placement(rank=rank, rank_source=r.rank_source, window=i) for i, r in enumerate(kept)]
        placement.results += kept[:1] if window is not None else kept
        placement.failures += _extra_in_window(kept, window)
    if split_any:
        placement.results = [r if r.window is not None else
                             r.with_placement(rank=r.rank, rank_source=r.rank_source, window=0)
                             for r in placement.results]
        placement.notes.append("ranks with several traces were split into successive windows by time")
    return placement


def _successive(group: list[RankResult]) -> tuple[list[RankResult], list[TraceFailure]]:
    """Traces of one rank sorted by time; those overlapping an earlier one are duplicates."""
    ordered = sorted(group, key=lambda r: (_start(r), r.label))
    kept: list[RankResult] = []
    duplicates = []
    for result in ordered:
        clash = next((k for k in kept if _overlaps(k, result)), None)
        if clash is None:
            kept.append(result)
        else:
            duplicates.append(TraceFailure(label=result.label, window=result.window, rank=result.rank,
                                           reason=f"duplicate rank {result.rank}: {clash.label} covers the same time"))
    return kept, duplicates


def _extra_in_window(kept: list[RankResult], window: int | None) -> list[TraceFailure]:
    """Inside a named window folder a rank has one trace; later ones are reported, not analyzed."""
    if window is None or len(kept) < 2:
        return []
    return [TraceFailure(label=r.label, window=window, rank=r.rank,
                         reason=f"duplicate rank {r.rank} in window {window}: {kept[0].label} analyzed instead")
            for r in kept[1:]]


def _start(result: RankResult) -> float:
    return result.absolute_us(result.first_start_us) if result.first_start_us is not None else float("inf")


def _overlaps(a: RankResult, b: RankResult) -> bool:
    if a.first_start_us is None or b.first_start_us is None:
        return False
    a_start, a_end = a.absolute_us(a.first_start_us), a.absolute_us(a.last_end_us)
    b_start, b_end = b.absolute_us(b.first_start_us), b.absolute_us(b.last_end_us)
    return a_start < b_end and b_start < a_end


def _world_size(results: list[RankResult]) -> int | None:
    sizes = [r.world_size for r in results if r.world_size]
    return max(sizes) if sizes else None


def bounded_missing_ranks(results: list[RankResult], world_size: int | None) -> tuple[list[MissingTrace], int]:
    """Ranks below world_size with no analyzed trace, per window: (the first ones of each window
    (validate.missing_below), how many are missing in all)."""
    if not world_size:
        return [], 0
    present: dict[int | None, set[int]] = defaultdict(set)
    for result in results:
        present[result.window].add(result.rank)
    missing, total = [], 0
    for window in sorted(present, key=lambda w: -1 if w is None else w):
        listed, count = missing_below(world_size, present[window])
        missing += [MissingTrace(rank=rank, window=window) for rank in listed]
        total += count
    return missing, total


def place_traces(inputs: "AnalysisInput", outcomes: list[RankResult | TraceFailure]) -> Placement:
    """Rank and window of every parsed trace: a run directory's manifest already says; foreign traces are
    placed by place_foreign_traces."""
    results = [o for o in outcomes if isinstance(o, RankResult)]
    failures = [o for o in outcomes if isinstance(o, TraceFailure)]
    skipped = [f for f in failures if inputs.kind != SOURCE_RUN_DIR and is_bystander(f)]
    failures = [f for f in failures if f not in skipped]
    if inputs.kind == SOURCE_RUN_DIR:
        placement = Placement(results=results, missing=list(inputs.missing),
                              missing_total=max(inputs.missing_total, len(inputs.missing)))
    else:
        placement = place_foreign_traces(results)
    placement.failures = failures + placement.failures
    if skipped:
        placement.notes = placement.notes + [
            f"{len(skipped)} JSON file(s) beside the traces hold no trace and were skipped: "
            + ", ".join(f.label for f in skipped[:5]) + (" ..." if len(skipped) > 5 else "")]
    return placement


def is_bystander(failure: TraceFailure) -> bool:
    """A file of a folder of traces that is valid JSON but no trace, and whose name does not claim to be one
    (no "trace" in it, no rank): a config or metrics file kept beside the traces, not a damaged trace. A file
    named like a trace that holds none stays a problem."""
    name = failure.label.rsplit("/", 1)[-1].lower()
    return failure.not_a_trace and "trace" not in name and rank_from_name(name) is None
