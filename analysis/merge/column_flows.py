"""flows.py's arrows for a window planned on columns (column_plan.py).

Launch flows, one per GPU slice, are a join of the slice table on the CUDA correlation id: the launches
are the host slices with a correlation (the longest per id, the first in trace order on a tie), and each
GPU slice takes the next flow id of its launch in trace order. The trace's own flow events are bound to
their threads' slices by searches on the sorted table (ColumnSliceFinder) and chained by sorts. The
collectives and the point-to-point transfers are few: flows.py's functions bind them to the communication
slices of the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from fleetscope.analysis.merge.flows import (
    COLLECTIVE_NAME_STARTS,
    ENCLOSING_SEARCH_LIMIT,
    LAUNCH_FLOWS_COVERED_CATEGORY,
    FlowPlan,
    LaunchFlows,
    Located,
    in_begin_order,
    may_be_collective,
    plan_collective_flows,
)
from fleetscope.analysis.merge.slice_table import SliceTable
from fleetscope.analysis.merge.tracks import emission_ranks

if TYPE_CHECKING:
    from fleetscope.analysis.merge.tracks import RankTracks
    from fleetscope.analysis.merge.window import GroupedEvents, WindowContext


def plan_flows_on_columns(table: SliceTable, grouped: "GroupedEvents", tracks: "RankTracks",
                          context: "WindowContext", *, add_covered: Callable[[], None] | None = None) -> FlowPlan:
    """The arrows of the slices of `table` (flows.py: launch, the trace's own, collective, point-to-point);
    `add_covered` adds the flow events that repeat launch flows (`ac2g`), where there are none."""
    plan = FlowPlan()
    on_gpu = table.on_gpu(grouped)
    if context.options.flows:
        finder = ColumnSliceFinder(table, grouped.gpu_threads)
        plan.launch = launch_flows(table, on_gpu, tracks, finder)
        plan.launch_flow_count = len(plan.launch.ids)
        plan.launch_flows_left_out = plan.launch.left_out
        if not plan.launches_matched and add_covered is not None:
            add_covered()
        plan_trace_flows_on_columns(grouped, tracks, plan, finder)
    plan_collective_flows(communication_slices(table, on_gpu), grouped, context, plan)
    return plan


def launch_flows(table: SliceTable, on_gpu: np.ndarray, tracks: "RankTracks",
                 finder: "ColumnSliceFinder") -> LaunchFlows:
    """One flow from each GPU slice's launch to it, ids given in the GPU slices' trace order."""
    launches = np.flatnonzero(table.has_correlation & ~on_gpu)
    durations = table.ends[launches] - table.starts[launches]
    correlations = table.correlations[launches]
    order = np.lexsort((launches, -durations, correlations))
    first = np.concatenate(([True], correlations[order][1:] != correlations[order][:-1])) if len(order) else order
    chosen = launches[order][first.astype(bool)]
    chosen_correlations = table.correlations[chosen]
    gpu = np.flatnonzero(table.has_correlation & on_gpu)
    at = np.minimum(np.searchsorted(chosen_correlations, table.correlations[gpu]), max(len(chosen) - 1, 0))
    found = chosen_correlations[at] == table.correlations[gpu] if len(chosen) else np.zeros(len(gpu), dtype=bool)
    targets, sources = gpu[found], chosen[at[found]]
    drawable = finder.written_after(targets, sources)  # flows.py's rule: the GPU work's begin after its launch's
    targets, sources = targets[drawable], sources[drawable]
    return LaunchFlows(sources=table.idents[sources], targets=table.idents[targets],
                       ids=tracks.new_flow_ids(len(targets)), left_out=int(len(drawable) - len(targets)))


def communication_slices(table: SliceTable, on_gpu: np.ndarray) -> dict[int, Located]:
    """ident -> Located of the slices a collective or transfer may be bound to, in plan.py's order of
    them (thread by first appearance, then trace order)."""
    candidate = np.array([name.startswith(COLLECTIVE_NAME_STARTS) and may_be_collective(name)
                          for name in table.names], dtype=bool)
    rows = np.flatnonzero(candidate[table.name_ids]) if len(table.names) else np.zeros(0, dtype=np.int64)
    rows = rows[np.lexsort((rows, table.thread_ids[rows]))]
    return {int(table.idents[row]): Located(int(table.starts[row]), int(table.ends[row]), table.names[table.name_ids[row]],
                                            table.categories[table.category_ids[row]], bool(on_gpu[row]))
            for row in rows.tolist()}


def plan_trace_flows_on_columns(grouped: "GroupedEvents", tracks: "RankTracks", plan: FlowPlan,
                                finder: "ColumnSliceFinder") -> None:
    """The trace's own flows, each end bound to a slice of its thread (Chrome JSON's rules: the latest-starting
    slice that encloses it, or for an `f` without `bp: e` the next slice to start), on arrays: each thread's
    flow events bound among its sorted slices by one search, each chain's ends ordered by one sort. Flow
    times are on the writable clock (plan.add_flow_fields), so they fit int64."""
    skip_covered = plan.launches_matched
    events = [event for event in grouped.flow_events
              if not (skip_covered and event[1] == LAUNCH_FLOWS_COVERED_CATEGORY)]
    times = np.array([event[4] for event in events], dtype=np.int64)
    idents = _bound_idents(events, times, finder)
    bound = np.flatnonzero(idents >= 0)
    keys: dict[tuple, int] = {}
    key_ids = np.array([keys.setdefault((events[position][1], events[position][2]), len(keys))
                        for position in bound.tolist()], dtype=np.int64)
    by_text = sorted(range(len(keys)), key=list(map(str, keys)).__getitem__)
    key_rank = np.empty(len(keys), dtype=np.int64)
    key_rank[by_text] = np.arange(len(keys))
    _add_chains(key_rank[key_ids], times[bound], idents[bound], tracks, plan, finder)


def _bound_idents(events: list[tuple], times: np.ndarray, finder: "ColumnSliceFinder") -> np.ndarray:
    """Each flow event's slice (its ident; -1: none), bound thread by thread."""
    by_thread: dict[tuple, list[int]] = {}
    for position, event in enumerate(events):
        by_thread.setdefault(event[3], []).append(position)
    enclosing = np.array([event[5] for event in events], dtype=bool)
    idents = np.full(len(events), -1, dtype=np.int64)
    for thread, positions in by_thread.items():
        rows = np.array(positions, dtype=np.int64)
        idents[rows] = finder.bind(thread, times[rows], enclosing[rows])
    return idents


def _add_chains(key_rank: np.ndarray, times: np.ndarray, idents: np.ndarray, tracks: "RankTracks",
                plan: FlowPlan, finder: "ColumnSliceFinder") -> None:
    """One flow per chain (the bound ends of one (category, id), in key order as text) with two slices or
    more that Perfetto can join (flows.in_begin_order): through its slices in (time, ident) order, each
    slice once (at its first end)."""
    order = np.lexsort((idents, times, key_rank))
    keys, slices = key_rank[order], idents[order]
    by_pair = np.lexsort((np.arange(len(order)), slices, keys))
    repeat = (keys[by_pair][1:] == keys[by_pair][:-1]) & (slices[by_pair][1:] == slices[by_pair][:-1])
    first = np.ones(len(order), dtype=bool)
    first[by_pair[1:][repeat]] = False
    keys, slices = keys[first], slices[first]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if len(keys) else keys
    bounds = np.append(starts, len(keys))
    lengths = np.diff(bounds)
    chains = np.flatnonzero(lengths >= 2)
    rows = finder.rows_of(slices)
    # a chain whose slices' begins are written in its order is drawn as it is; only the others go through
    # the rule one slice at a time
    earlier = np.zeros(len(slices), dtype=bool)
    earlier[1:] = ~finder.written_after(rows[1:], rows[:-1])
    earlier[starts] = False
    unordered = np.add.reduceat(earlier, starts) > 0 if len(starts) else np.zeros(0, dtype=bool)
    slice_list, bound_list, unordered_list = slices.tolist(), bounds.tolist(), unordered.tolist()
    drawn = []
    for chain in chains.tolist():
        begin, end = bound_list[chain], bound_list[chain + 1]
        steps = slice_list[begin:end]
        if unordered_list[chain]:
            steps = in_begin_order(steps, dict(zip(steps, finder.begins(rows[begin:end]))).__getitem__, plan)
        if len(steps) >= 2:
            drawn.append(steps)
    for steps, flow_id in zip(drawn, tracks.new_flow_ids(len(drawn)).tolist()):
        for ident in steps[:-1]:
            plan.outgoing[ident].append(flow_id)
        plan.terminating[steps[-1]].append(flow_id)
    plan.trace_flow_count += len(drawn)


class ColumnSliceFinder:
    """The slices of a thread at a time, on the table: a thread's slices sorted by (start, -end), trace order
    on ties."""

    def __init__(self, table: SliceTable, gpu_threads: dict[tuple, object] | None = None):
        self._table = table
        self._thread_of = {thread: index for index, thread in enumerate(table.threads)}
        ranks = emission_ranks(table.threads, gpu_threads or {})
        thread_ranks = np.array([ranks[thread] for thread in table.threads], dtype=np.int64)
        self._row_ranks = thread_ranks[table.thread_ids] if len(table.threads) else np.zeros(0, dtype=np.int64)
        self._sorted: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _thread_arrays(self, thread: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        index = self._thread_of.get(thread)
        if index is None:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        found = self._sorted.get(index)
        if found is None:
            table = self._table
            table.sorted_threads.add(index)
            rows = np.flatnonzero(table.thread_ids == index)
            rows = rows[np.lexsort((rows, -table.ends[rows], table.starts[rows]))]
            found = self._sorted[index] = (table.starts[rows], table.ends[rows], table.idents[rows])
        return found

    def bind(self, thread: tuple, times_ns: np.ndarray, enclosing: np.ndarray) -> np.ndarray:
        """The ident each flow event of `thread` binds to (-1: none): the enclosing slice where `enclosing`
        is set, else the next slice to start."""
        starts, ends, idents = self._thread_arrays(thread)
        found = np.full(len(times_ns), -1, dtype=np.int64)
        if not len(starts):
            return found
        after = np.searchsorted(starts, times_ns, side="left")
        starting = ~enclosing & (after < len(starts))
        found[starting] = idents[after[starting]]
        latest = np.searchsorted(starts, times_ns, side="right") - 1
        open_ = enclosing.copy()
        for back in range(ENCLOSING_SEARCH_LIMIT):
            candidates = latest - back
            live = np.flatnonzero(open_ & (candidates >= 0))
            if not len(live):
                break
            hit = live[ends[candidates[live]] >= times_ns[live]]
            found[hit] = idents[candidates[hit]]
            open_[hit] = False
        return found

    def rows_of(self, idents: np.ndarray) -> np.ndarray:
        """The table rows of events `idents` (each one a row)."""
        return np.searchsorted(self._table.idents, idents)

    def begins(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """flows.Begin of each row."""
        return list(zip(self._table.starts[rows].tolist(), self._row_ranks[rows].tolist()))

    def written_after(self, rows: np.ndarray, before: np.ndarray) -> np.ndarray:
        """Whether each of `rows` has its begin written after the begin of the row in `before` (flows.Begin
        compared on arrays)."""
        starts, ranks = self._table.starts, self._row_ranks
        return (starts[rows] > starts[before]) | ((starts[rows] == starts[before]) & (ranks[rows] > ranks[before]))
