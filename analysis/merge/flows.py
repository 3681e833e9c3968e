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
  last: the last arrow points at the rank everyone waited for. The instances are the ones the per-rank
  parse found and the report matches (per_rank/collectives.py, handed over in `WindowContext`): this
  module only finds the slice each was parsed from;
* point-to-point flows: an arrow from each send to the receive that took its data (the pair the pipeline
  analysis makes from the stages' markers, cross_rank/pipeline.py), one flow id per transfer.

Here: what a window's arrows are (FlowPlan), the collective and point-to-point bindings, the flow ids, and
the rule of which arrow ends Perfetto can join (in_begin_order). The launch flows and the trace's own flows
are found on the slice table's arrays, in column_flows.py.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from fleetscope.analysis.per_rank.names import (
    collective_name,
    is_comm_kernel,
    is_gloo_span,
    point_to_point_kind,
)

if TYPE_CHECKING:
    from fleetscope.analysis.merge.window import GroupedEvents, WindowContext

NO_STEP = -1
LAUNCH_FLOWS_COVERED_CATEGORY = "ac2g"
_HOST_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
ENCLOSING_SEARCH_LIMIT = 256
_COLLECTIVE_FLOW_BIT = 1 << 63

CollectiveKey = tuple[int, str, int]
"""(step or NO_STEP, collective name, ordinal of that name within the step): as in the report."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveHit:
    """One collective instance on this rank."""

    ident: int
    start_ns: int


@dataclass(frozen=True, kw_only=True)
class LaunchFlows:
    """Launch flows as columns (column_flows.py): flow `ids[i]` runs from the slice of event `sources[i]` to
    that of `targets[i]`; they come before a slice's flows in `FlowPlan.outgoing` / `terminating`."""

    sources: np.ndarray
    targets: np.ndarray
    ids: np.ndarray
    """uint64."""
    left_out: int = 0
    """GPU slices whose begin is written before their launch's: no flow (FlowPlan.launch_flows_left_out)."""


@dataclass(kw_only=True)
class FlowPlan:
    outgoing: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    """ident -> flow ids that start at (or pass through) the event's slice."""
    terminating: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    """ident -> flow ids that end at the event's slice."""
    launch: LaunchFlows | None = None
    """The launch flows when planned on columns (then not in `outgoing` / `terminating`)."""
    collectives: dict[CollectiveKey, CollectiveHit] = field(default_factory=dict)
    collective_source: str | None = None
    launch_flow_count: int = 0
    trace_flow_count: int = 0
    collective_flow_count: int = 0
    p2p_flow_count: int = 0
    """Sends and receives bound to a point-to-point flow (a transfer has two)."""
    trace_flow_steps_left_out: int = 0
    """Ends of the trace's own flows left out by in_begin_order."""
    launch_flows_left_out: int = 0
    """GPU slices whose begin is written before their launch's (in_begin_order's rule): no launch flow
    (column_flows.launch_flows)."""

    @property
    def launches_matched(self) -> bool:
        """Whether launch flows were planned (drawn or left out): the trace's `ac2g` flows repeat them."""
        return bool(self.launch_flow_count or self.launch_flows_left_out)

    def left_out(self) -> dict[str, int]:
        """Reason -> count of the arrows this plan leaves out (for WindowPlan.skipped)."""
        counts = {TRACE_FLOW_STEPS_LEFT_OUT: self.trace_flow_steps_left_out,
                  LAUNCH_FLOWS_LEFT_OUT: self.launch_flows_left_out}
        return {reason: count for reason, count in counts.items() if count}


TRACE_FLOW_STEPS_LEFT_OUT = ("flow ends not drawn: each bound to a slice that begins before the slice of the flow's "
                             "previous end, or with it on a track written first (Perfetto joins a flow's slices in "
                             "the order their begins are written)")
LAUNCH_FLOWS_LEFT_OUT = ("launch arrows not drawn: the GPU work begins before the call that launched it (the trace's "
                         "host and device clocks disagree), or with it on a track written first (Perfetto joins a "
                         "flow's slices in the order their begins are written)")


def plan_collective_flows(located: dict[int, "Located"], grouped: "GroupedEvents", context: "WindowContext",
                          plan: FlowPlan) -> None:
    """The collective instances and point-to-point transfers bound to slices of `located`, with their flows."""
    _bind_collectives(located, grouped, context, plan)
    if context.options.collective_flows:
        for key, hit in plan.collectives.items():
            plan.outgoing[hit.ident].append(collective_flow_id(key, context.window_key))
        plan.collective_flow_count = len(plan.collectives)
        _plan_p2p_flows(located, context, plan)


_P2P_FLOW_BIT = 1 << 62


def p2p_flow_id(key: tuple, window_key: int) -> int:
    """The same on the sending and the receiving rank for one transfer (sources.transfer_key)."""
    digest = hashlib.blake2b(f"p2p|window {window_key}|{key}".encode(), digest_size=8).digest()
    return _COLLECTIVE_FLOW_BIT | _P2P_FLOW_BIT | (int.from_bytes(digest, "big") >> 2)


def _plan_p2p_flows(located: dict[int, Located], context: "WindowContext", plan: FlowPlan) -> None:
    """One flow id on a transfer's send slice and its receive slice, joined in time order as collective flows
    are: a receive is often posted before its send starts, and a flow that ended before it began would be
    dropped by the trace processor."""
    by_start: dict[int, list[int]] = defaultdict(list)
    for ident, where in located.items():
        if may_be_collective(where.name):
            by_start[where.start_ns].append(ident)
    for start_ns, key, kind in context.p2p:
        ident = next((i for i in by_start.get(start_ns, ()) if point_to_point_kind(located[i].name)), None)
        if ident is None:
            continue
        plan.outgoing[ident].append(p2p_flow_id(key, context.window_key))
        plan.p2p_flow_count += 1


def collective_flow_id(key: CollectiveKey, window_key: int) -> int:
    """The same on every rank for the same instance. Within a step the step number identifies the
    instance; outside steps only the window does."""
    step, name, ordinal = key
    scope = f"step {step}" if step != NO_STEP else f"window {window_key}"
    digest = hashlib.blake2b(f"{scope}|{name}|{ordinal}".encode(), digest_size=8).digest()
    return _COLLECTIVE_FLOW_BIT | (int.from_bytes(digest, "big") >> 1)


class Located(NamedTuple):
    start_ns: int
    end_ns: int
    name: str
    category: str
    on_gpu: bool


COLLECTIVE_NAME_STARTS = ("nccl", "gloo", "c10d", "_c10d")
"""A cheap first test (every name the rules below accept starts so) before the rules themselves."""


def may_be_collective(name: str) -> bool:
    return is_comm_kernel(name) or is_gloo_span(name) or name.startswith(_HOST_COLLECTIVE_PREFIXES)


Begin = tuple[int, int]
"""When a slice's begin is written: (timestamp ns, tracks.emission_ranks of its thread). Perfetto joins a
flow's slices in the order their begins are written: by time, then, at one instant, in file order."""


def in_begin_order(idents: list[int], begin_of: Callable[[int], Begin], plan: FlowPlan) -> list[int]:
    """A chain's slices (in the order of its flow events) that Perfetto can join: each one's begin written
    after the one kept before it (Begin). Flow ids ride on a slice's begin, so an end bound to a slice
    written earlier (an `f` with `bp: e` whose enclosing host call began before the GPU work it waited for,
    as in HTA's critical-path overlays, or at the same instant on a track written first) would end a flow
    not yet started: it is left out, and counted."""
    kept: list[int] = []
    latest = None
    for ident in idents:
        begin = begin_of(ident)
        if latest is not None and begin <= latest:
            continue
        kept.append(ident)
        latest = begin
    plan.trace_flow_steps_left_out += len(idents) - len(kept)
    return kept


def _bind_collectives(located: dict[int, Located], grouped: "GroupedEvents", context: "WindowContext",
                      plan: FlowPlan) -> None:
    """Attach each collective instance the per-rank parse found (start, key) to the slice it was parsed
    from: the slice of a collective event that starts at that instant (the same `ts`, so the same ns)."""
    by_start: dict[int, list[int]] = defaultdict(list)
    for ident, where in located.items():
        if may_be_collective(where.name):
            by_start[where.start_ns].append(ident)
    for start_ns, key in context.collectives:
        candidates = by_start.get(start_ns, ())
        ident = next((i for i in candidates
                      if collective_name(located[i].name, grouped.group_of.get(i)) == key[1]), None)
        if ident is not None:
            plan.collectives[key] = CollectiveHit(ident=ident, start_ns=start_ns)
    plan.collective_source = context.collective_source
