"""flows.py's arrows for a window planned on columns (column_plan.py).

Launch flows, one per GPU slice, are a join of the slice table on the CUDA correlation id: the launches
are the host slices with a correlation (the longest per id, the first in trace order on a tie), and each
GPU slice takes the flow id of its launch in trace order, as flows.py numbers them. The trace's own flow
events, the collectives and the point-to-point transfers are few: flows.py's functions bind them, given a
slice finder and the communication slices of the table.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from fleetscope.analysis.merge.flows import (
    COLLECTIVE_NAME_STARTS,
    ENCLOSING_SEARCH_LIMIT,
    FlowPlan,
    LaunchFlows,
    Located,
    may_be_collective,
    plan_collective_flows,
    plan_trace_flows,
)
from fleetscope.analysis.merge.slice_table import SliceTable

if TYPE_CHECKING:
    from fleetscope.analysis.merge.tracks import RankTracks
    from fleetscope.analysis.merge.window import GroupedEvents, WindowContext


def plan_flows_on_columns(table: SliceTable, grouped: "GroupedEvents", tracks: "RankTracks",
                          context: "WindowContext", *, add_covered: Callable[[], None] | None = None) -> FlowPlan:
    """flows.plan_flows for the slices of `table`; `add_covered` adds the flow events that repeat launch flows
    (flows.py skips those where there are launch flows)."""
    plan = FlowPlan()
    on_gpu = table.on_gpu(grouped)
    if context.options.flows:
        plan.launch = launch_flows(table, on_gpu, tracks)
        plan.launch_flow_count = len(plan.launch.ids)
        if not plan.launch_flow_count and add_covered is not None:
            add_covered()
        plan_trace_flows(grouped, tracks, plan, ColumnSliceFinder(table))
    plan_collective_flows(communication_slices(table, on_gpu), grouped, context, plan)
    return plan


def launch_flows(table: SliceTable, on_gpu: np.ndarray, tracks: "RankTracks") -> LaunchFlows:
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
    return LaunchFlows(sources=table.idents[sources], targets=table.idents[targets],
                       ids=tracks.new_flow_ids(len(targets)))


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


class ColumnSliceFinder:
    """flows._SliceFinder on the table: a thread's slices sorted by (start, -end), trace order on ties."""

    def __init__(self, table: SliceTable):
        self._table = table
        self._thread_of = {thread: index for index, thread in enumerate(table.threads)}
        self._sorted: dict[int, tuple[list[int], list[int], list[int]]] = {}

    def _thread(self, thread: tuple) -> tuple[list[int], list[int], list[int]]:
        index = self._thread_of.get(thread)
        if index is None:
            return [], [], []
        found = self._sorted.get(index)
        if found is None:
            table = self._table
            table.sorted_threads.add(index)
            rows = np.flatnonzero(table.thread_ids == index)
            rows = rows[np.lexsort((rows, -table.ends[rows], table.starts[rows]))]
            found = self._sorted[index] = (table.starts[rows].tolist(), table.ends[rows].tolist(),
                                           table.idents[rows].tolist())
        return found

    def enclosing(self, thread: tuple, ts_ns: int) -> int | None:
        starts, ends, idents = self._thread(thread)
        index = bisect_right(starts, ts_ns) - 1
        for candidate in range(index, max(index - ENCLOSING_SEARCH_LIMIT, -1), -1):
            if ends[candidate] >= ts_ns:
                return idents[candidate]
        return None

    def next_starting(self, thread: tuple, ts_ns: int) -> int | None:
        starts, _, idents = self._thread(thread)
        index = bisect_left(starts, ts_ns)
        return idents[index] if index < len(starts) else None
