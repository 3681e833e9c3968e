"""Arrows in the merged trace (pure planning).

Three kinds, each attached to slices through Perfetto flow ids:

* launch flows: from the CPU call that launched GPU work (`cudaLaunchKernel`, a memcpy call, ...) to
  the kernel / copy it launched, matched by the CUDA correlation id both events carry;
* the trace's own flows (`ph: s/t/f`, e.g. Kineto's forward->backward `fwdbwd` links): each end is
  bound to the slice of its thread that encloses it (or, for an `f` without `bp: e`, the next slice),
  the way Chrome JSON defines it. Kineto's `ac2g` flows repeat the launch flows and are skipped when
  those exist;
* collective flows: the same collective instance on every rank carries the same flow id, and Perfetto
  joins the slices of one id in time order, so the arrows run from the first rank to arrive to the
  last: the last arrow points at the rank everyone waited for. An instance is the ordinal-th
  collective of a name (and process group, where the trace names it) within a training step, as the
  analysis report matches them (collectives.py):
  NCCL kernels (issued at their CPU launch) when the trace has them, else gloo spans, else host
  collective ops.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from fleetscope.analysis.per_rank.names import collective_name, is_comm_kernel, is_gloo_span

if TYPE_CHECKING:
    from fleetscope.analysis.merge.plan import GroupedEvents, WindowContext
    from fleetscope.analysis.merge.tracks import RankTracks

NO_STEP = -1
LAUNCH_FLOWS_COVERED_CATEGORY = "ac2g"
_HOST_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
_CPU_OP_CATEGORIES = ("cpu_op", "operator")
_ENCLOSING_SEARCH_LIMIT = 256
_COLLECTIVE_FLOW_BIT = 1 << 63

CollectiveKey = tuple[int, str, int]
"""(step or NO_STEP, collective name, ordinal of that name within the step): as in the report."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveHit:
    """One collective instance on this rank."""

    ident: int
    start_ns: int
    issue_ns: int


@dataclass(kw_only=True)
class FlowPlan:
    outgoing: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    """ident -> flow ids that start at (or pass through) the event's slice."""
    terminating: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    """ident -> flow ids that end at the event's slice."""
    collectives: dict[CollectiveKey, CollectiveHit] = field(default_factory=dict)
    collective_source: str | None = None
    launch_end_by_correlation: dict[int, int] = field(default_factory=dict)
    """CUDA correlation id -> when the CPU call that launched it returned."""
    launch_flow_count: int = 0
    trace_flow_count: int = 0
    collective_flow_count: int = 0


def plan_flows(grouped: "GroupedEvents", steps: list[tuple[int, int, int]], tracks: "RankTracks",
               context: "WindowContext") -> FlowPlan:
    """Flow ids for the slices of one window; `steps` are (step, start_ns, end_ns) host step ranges."""
    plan = FlowPlan()
    located = _locate_slices(grouped)
    launches = _launches_by_correlation(grouped, located)
    plan.launch_end_by_correlation = {c: located[ident].end_ns for c, ident in launches.items()}
    if context.options.flows:
        _plan_launch_flows(grouped, located, launches, tracks, plan)
        _plan_trace_flows(grouped, tracks, plan)
    _find_collectives(grouped, located, launches, steps, plan)
    if context.options.collective_flows:
        for key, hit in plan.collectives.items():
            plan.outgoing[hit.ident].append(collective_flow_id(key, context.window_key))
        plan.collective_flow_count = len(plan.collectives)
    return plan


def collective_flow_id(key: CollectiveKey, window_key: int) -> int:
    """The same on every rank for the same instance. Within a step the step number identifies the
    instance; outside steps only the window does."""
    step, name, ordinal = key
    scope = f"step {step}" if step != NO_STEP else f"window {window_key}"
    digest = hashlib.blake2b(f"{scope}|{name}|{ordinal}".encode(), digest_size=8).digest()
    return _COLLECTIVE_FLOW_BIT | (int.from_bytes(digest, "big") >> 1)


class _Located(NamedTuple):
    start_ns: int
    end_ns: int
    name: str
    category: str
    on_gpu: bool


def _locate_slices(grouped: "GroupedEvents") -> dict[int, _Located]:
    """ident -> where its slice is, for the events flows can involve (correlated or communication)."""
    located = {}
    correlated = grouped.correlation_of
    for thread, slices in grouped.slices.items():
        on_gpu = grouped.is_gpu(thread)
        for start, end, name, category, ident, _ in slices:
            if ident in correlated or (name.startswith(_COLLECTIVE_NAME_STARTS) and _may_be_collective(name)):
                located[ident] = _Located(start, end, name, category, on_gpu)
    return located


_COLLECTIVE_NAME_STARTS = ("nccl", "gloo", "c10d", "_c10d")
"""A cheap first test (every name the rules below accept starts so) before the rules themselves."""


def _may_be_collective(name: str) -> bool:
    return is_comm_kernel(name) or is_gloo_span(name) or name.startswith(_HOST_COLLECTIVE_PREFIXES)


def _launches_by_correlation(grouped: "GroupedEvents", located: dict[int, _Located]) -> dict[int, int]:
    """correlation id -> ident of the CPU event that launched it (the longest, if several)."""
    launches: dict[int, int] = {}
    for ident, correlation in grouped.correlation_of.items():
        where = located.get(ident)
        if where is None or where.on_gpu:
            continue
        known = launches.get(correlation)
        if known is None or _duration(located[known]) < _duration(where):
            launches[correlation] = ident
    return launches


def _duration(where: _Located) -> int:
    return where.end_ns - where.start_ns


def _plan_launch_flows(grouped: "GroupedEvents", located: dict[int, _Located], launches: dict[int, int],
                       tracks: "RankTracks", plan: FlowPlan) -> None:
    for ident in sorted(grouped.correlation_of):
        where = located.get(ident)
        launch = launches.get(grouped.correlation_of[ident])
        if where is None or not where.on_gpu or launch is None:
            continue
        flow_id = tracks.new_flow_id()
        plan.outgoing[launch].append(flow_id)
        plan.terminating[ident].append(flow_id)
        plan.launch_flow_count += 1


def _plan_trace_flows(grouped: "GroupedEvents", tracks: "RankTracks", plan: FlowPlan) -> None:
    chains: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    finder = _SliceFinder(grouped)
    for phase, category, flow_id, thread, ts_ns, enclosing in grouped.flow_events:
        if category == LAUNCH_FLOWS_COVERED_CATEGORY and plan.launch_flow_count:
            continue
        ident = finder.enclosing(thread, ts_ns) if enclosing else finder.next_starting(thread, ts_ns)
        if ident is not None:
            chains[(category, flow_id)].append((ts_ns, ident))
    for key in sorted(chains, key=str):
        idents = list(dict.fromkeys(ident for _, ident in sorted(chains[key])))
        if len(idents) < 2:
            continue
        flow_id = tracks.new_flow_id()
        for ident in idents[:-1]:
            plan.outgoing[ident].append(flow_id)
        plan.terminating[idents[-1]].append(flow_id)
        plan.trace_flow_count += 1


class _SliceFinder:
    """The slice of a thread at a time, for binding flow events (Chrome JSON's rules)."""

    def __init__(self, grouped: "GroupedEvents"):
        self._grouped = grouped
        self._starts: dict[tuple, list[int]] = {}

    def _sorted(self, thread: tuple) -> tuple[list, list[int]]:
        slices = self._grouped.slices.get(thread, [])
        if thread not in self._starts:
            slices.sort(key=lambda s: (s[0], -s[1]))
            self._starts[thread] = [s[0] for s in slices]
        return slices, self._starts[thread]

    def enclosing(self, thread: tuple, ts_ns: int) -> int | None:
        """The latest-starting slice of the thread that contains `ts_ns`."""
        slices, starts = self._sorted(thread)
        index = bisect_right(starts, ts_ns) - 1
        for candidate in range(index, max(index - _ENCLOSING_SEARCH_LIMIT, -1), -1):
            if slices[candidate][1] >= ts_ns:
                return slices[candidate][4]
        return None

    def next_starting(self, thread: tuple, ts_ns: int) -> int | None:
        slices, starts = self._sorted(thread)
        index = bisect_left(starts, ts_ns)
        return slices[index][4] if index < len(slices) else None


def _find_collectives(grouped: "GroupedEvents", located: dict[int, _Located], launches: dict[int, int],
                      steps: list[tuple[int, int, int]], plan: FlowPlan) -> None:
    source, chosen = _collective_source(located)
    if not chosen:
        return
    issued = [(_issue_ns(ident, located, launches, grouped), ident) for ident in chosen]
    issued.sort()
    ordinals: dict[tuple[int, str], int] = defaultdict(int)
    for issue_ns, ident in issued:
        step = step_at(issue_ns, steps)
        name = collective_name(located[ident].name, grouped.group_of.get(ident))
        key = (step, name, ordinals[(step, name)])
        ordinals[(step, name)] += 1
        plan.collectives[key] = CollectiveHit(ident=ident, start_ns=located[ident].start_ns, issue_ns=issue_ns)
    plan.collective_source = source


def _collective_source(located: dict[int, _Located]) -> tuple[str | None, list[int]]:
    """The same precedence as the report: NCCL kernels, else gloo spans, else host collective ops."""
    kernels = [i for i, w in located.items() if w.on_gpu and w.category == "kernel" and is_comm_kernel(w.name)]
    if kernels:
        return "nccl kernels", kernels
    gloo = [i for i, w in located.items() if is_gloo_span(w.name)]
    if gloo:
        return "gloo spans", gloo
    host = [i for i, w in located.items() if not w.on_gpu and w.category in _CPU_OP_CATEGORIES
            and w.name.startswith(_HOST_COLLECTIVE_PREFIXES) and "wait" not in w.name]
    return ("host collective ops", host) if host else (None, [])


def _issue_ns(ident: int, located: dict[int, _Located], launches: dict[int, int], grouped: "GroupedEvents") -> int:
    """A kernel is issued when the CPU launched it; anything else when it starts."""
    correlation = grouped.correlation_of.get(ident)
    launch = launches.get(correlation) if correlation is not None else None
    if located[ident].on_gpu and launch is not None:
        return located[launch].start_ns
    return located[ident].start_ns


def step_at(ts_ns: int, steps: list[tuple[int, int, int]]) -> int:
    """The step whose host range [start, end) contains `ts_ns`; NO_STEP outside every step."""
    starts = [start for _, start, _ in steps]
    slot = bisect_right(starts, ts_ns) - 1
    if slot >= 0 and ts_ns < steps[slot][2]:
        return steps[slot][0]
    return NO_STEP

