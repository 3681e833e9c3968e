"""A window the columnar decoder does not take, as the columns the merge's planner takes.

window_decode.decode_window refuses a file whose values are of another type than Kineto writes (a string
`ts`, a dict `pid`, an event that is not an object, ...); the generic reader (traces/kineto.py) reads it.
Its events are sorted here as decode_window sorts a decoded window's, so column_plan.py plans every file:
complete events with numeric times become SliceColumns, flow events their binding fields, every other
event goes to plan.add_other_event as it is. What a value of another type means is plan.py's rule:
a name or category that is not a string is drawn as its text, a pid or tid that is neither an int nor a
string as its text, a correlation id only when it is an int.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from msgspec import UNSET

from fleetscope.analysis.merge.plan import NOT_AN_OBJECT, hashable_id, text_of
from fleetscope.analysis.merge.window_decode import DecodedWindow, SliceColumns
from fleetscope.analysis.per_rank.names import PROCESS_GROUP_DESCRIPTION_ARG, PROCESS_GROUP_NAME_ARG
from fleetscope.traces.kineto_schema import FLOW_PHASES, MISSING_DURATION_US

_NUMBERS = (int, float)


@dataclass(frozen=True, slots=True)
class EventArgs:
    """The args a slice needs, as the columnar decoder's SliceArgs has them (UNSET: the key is absent)."""

    correlation: Any = None
    device: Any = UNSET
    stream: Any = UNSET
    group_name: Any = UNSET
    group_description: Any = None

    @classmethod
    def of(cls, args: Any) -> "EventArgs | None":
        if type(args) is not dict:
            return None
        return cls(correlation=args.get("correlation"), device=args.get("device", UNSET),
                   stream=args.get("stream", UNSET), group_name=args.get(PROCESS_GROUP_NAME_ARG, UNSET),
                   group_description=args.get(PROCESS_GROUP_DESCRIPTION_ARG))


class FlowFields(NamedTuple):
    """A flow event's binding fields, as column_plan reads a decoded one's."""

    ph: str
    ts: Any
    id: Any
    bp: Any
    cat: Any
    pid: Any
    tid: Any


def window_of_events(document: dict[str, Any]) -> tuple[DecodedWindow, Counter]:
    """The generic reader's `document` as a DecodedWindow, and the events it holds that are not objects
    (counted: the window has no field for them)."""
    events = document["traceEvents"]
    completes: list[tuple[int, dict]] = []
    window = DecodedWindow(base_time_ns=document.get("baseTimeNanoseconds"),
                           distributed_info=document.get("distributedInfo"), event_count=len(events),
                           slices=_slice_columns([]))
    skipped: Counter = Counter()
    for ident, event in enumerate(events):
        if not isinstance(event, dict):
            skipped[NOT_AN_OBJECT] += 1
            continue
        phase = event.get("ph")
        if phase == "X":
            if type(event.get("ts")) in _NUMBERS and type(event.get("dur", MISSING_DURATION_US)) in _NUMBERS:
                completes.append((ident, event))
            else:
                window.complete_without_time += 1
        elif phase in FLOW_PHASES:
            window.flow_events.append(_flow_fields(phase, event))
        else:
            window.others.append((ident, event))
    window.slices = _slice_columns(completes)
    return window, skipped


def _flow_fields(phase: str, event: dict) -> FlowFields:
    ts = event.get("ts")
    # a ts of another type reads as NaN: plan.add_flow_fields counts both as a flow event without a numeric ts
    return FlowFields(ph=phase, ts=ts if type(ts) in _NUMBERS else math.nan, id=event.get("id"), bp=event.get("bp"),
                      cat=event.get("cat"), pid=event.get("pid", ""), tid=event.get("tid", ""))


def _slice_columns(completes: list[tuple[int, dict]]) -> SliceColumns:
    events = [event for _, event in completes]
    return SliceColumns(
        idents=np.array([ident for ident, _ in completes], dtype=np.int64),
        ts_us=[event["ts"] for event in events], dur_us=[event.get("dur", MISSING_DURATION_US) for event in events],
        names=[text_of(event.get("name")) for event in events],
        categories=[text_of(event.get("cat", "")) for event in events],
        pids=[hashable_id(event.get("pid", "")) for event in events],
        tids=[hashable_id(event.get("tid", "")) for event in events],
        args=[EventArgs.of(event.get("args")) for event in events],
    )
