"""A Kineto window decoded for the merge: its complete events as columns, the rest as plain events.

msgspec decodes the trace into typed structs that hold only the fields the merge draws (complete events:
name, category, time, duration, pid, tid and four args; flow events: their binding fields); every other
key is skipped without being built. The complete events, most of a trace, then become numpy columns
(`SliceColumns`); the other phases (instants, counters, metadata: a handful) become the dicts whose rules
plan.py owns.

`decode_window` returns None where this decoder cannot take a file the way the generic reader does
(another shape, a value of another type, invalid UTF-8, nesting too deep): the merge then reads it as
`traces.kineto.read_trace` does and event_window.py turns its events into the same columns, for the one
planner (column_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
from fleetscope.traces.kineto_schema import (
    FLOW_PHASES,
    PLANNED_PHASES,
    WindowComplete,
    WindowDocument,
    metadata_value,
)
from fleetscope.traces.validate import MAX_TIME_US

EXACT_TIME_US = float(2**53) / 1000
"""Below this, a timestamp's nanoseconds are the same whether figured from an int or its float64; at or above it an
int timestamp is converted exactly (nanoseconds)."""
_UNSET = msgspec.UNSET
_DECODER = msgspec.json.Decoder(WindowDocument)


@dataclass(frozen=True, kw_only=True)
class SliceColumns:
    """The window's complete events with a numeric, in-range time, in trace order."""

    idents: np.ndarray
    """int64: each event's index in the trace's event list."""
    ts_us: list
    """The events' `ts` as decoded (int or float)."""
    dur_us: list
    names: list[str]
    categories: list[str]
    pids: list
    tids: list
    args: list
    """kineto_schema.SliceArgs or None per event."""


@dataclass(kw_only=True)
class DecodedWindow:
    """One trace file as the columnar planner takes it."""

    base_time_ns: Any
    distributed_info: Any
    event_count: int
    slices: SliceColumns
    others: list[tuple[int, dict]] = field(default_factory=list)
    """(ident, event) of the instants, counters and metadata, as the dicts plan.py reads."""
    flow_events: list[Any] = field(default_factory=list)
    """The flow events (`s`, `t`, `f`), with an int or float `ts` and an int or str `id`."""
    undrawn: dict[str, int] = field(default_factory=dict)
    """Events of a phase the merge does not draw, by phase."""
    complete_without_time: int = 0
    """Complete events whose `ts` or `dur` is missing (null)."""

    @property
    def document(self) -> dict[str, Any]:
        """The header fields the merge checks (rank, base time), as the generic reader's document has them."""
        return {"baseTimeNanoseconds": self.base_time_ns, "distributedInfo": self.distributed_info}


_FLOW_PHASES = frozenset(FLOW_PHASES)


def decode_window(data: bytes) -> DecodedWindow | None:
    """The window of inflated trace JSON `data`, or None where the generic reader must take it."""
    try:
        window = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    events = window.traceEvents
    is_complete = [type(event) is WindowComplete for event in events]
    completes = list(compress(events, is_complete))
    idents = np.flatnonzero(np.array(is_complete, dtype=bool))
    decoded = DecodedWindow(base_time_ns=metadata_value(window, "baseTimeNanoseconds"),
                            distributed_info=metadata_value(window, "distributedInfo"),
                            event_count=len(events), slices=_slice_columns(completes, idents))
    if len(completes) != len(events):
        _sort_others(events, is_complete, decoded)
    decoded.complete_without_time = len(completes) - len(decoded.slices.names)
    return decoded


def _slice_columns(completes: list[WindowComplete], idents: np.ndarray) -> SliceColumns:
    """Per-field lists of the complete events that have a time and a duration (not null)."""
    ts, dur = list(map(attrgetter("ts"), completes)), list(map(attrgetter("dur"), completes))
    timed = [t is not None and d is not None for t, d in zip(ts, dur)]
    if not all(timed):
        completes, idents = list(compress(completes, timed)), idents[np.array(timed, dtype=bool)]
        ts, dur = list(compress(ts, timed)), list(compress(dur, timed))
    return SliceColumns(
        idents=idents.astype(np.int64), ts_us=ts, dur_us=dur,
        names=list(map(attrgetter("name"), completes)), categories=list(map(attrgetter("cat"), completes)),
        pids=list(map(attrgetter("pid"), completes)), tids=list(map(attrgetter("tid"), completes)),
        args=list(map(attrgetter("args"), completes)),
    )


def _sort_others(events: list, is_complete: list[bool], decoded: DecodedWindow) -> None:
    others = np.flatnonzero(~np.array(is_complete, dtype=bool)).tolist()
    for ident in others:
        event = events[ident]
        phase = event.ph
        if phase in _FLOW_PHASES:
            decoded.flow_events.append(event)
        elif phase in PLANNED_PHASES:
            decoded.others.append((ident, as_event_dict(event)))
        else:
            decoded.undrawn[phase] = decoded.undrawn.get(phase, 0) + 1


def as_event_dict(event: Any) -> dict[str, Any]:
    """A planned struct as the generic reader's dict: its phase and the keys the trace has."""
    found = {"ph": event.ph}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if value is not _UNSET:
            found[name] = value
    return found


def nanoseconds(values_us: list, shift_ns: int) -> np.ndarray | None:
    """`shift_ns + round(value * 1000)` of each value as int64, exactly as plan.py figures it in Python (an int
    value times 1000 exactly; a float one as float64's product, rounded half to even); None when a value is not
    finite or the result does not fit int64 (the caller then leaves the window to plan.py)."""
    floats = np.fromiter(values_us, dtype=np.float64, count=len(values_us))
    if not len(floats):
        return np.zeros(0, dtype=np.int64)
    magnitude = np.abs(floats)
    if not magnitude.max() < MAX_TIME_US / 2 or not (-(2**61) < shift_ns < 2**61):
        return None  # NaN, infinities, or a sum that could pass int64
    scaled = np.rint(floats * 1000.0).astype(np.int64)
    large = np.flatnonzero(magnitude >= EXACT_TIME_US)
    if large.size:
        # epoch microseconds as JSON integers (2021-era traces, some exporters): their float64 has lost the
        # nanoseconds an int keeps; floats are exact as they are (Python multiplies the same float64)
        exact = [(index, value * 1000) for index in large.tolist() if type(value := values_us[index]) is int]
        if exact:
            positions, values = zip(*exact)
            scaled[list(positions)] = np.array(values, dtype=np.int64)
    return scaled + np.int64(shift_ns)


def in_range(values_us: list) -> np.ndarray:
    """Whether each value is within (-MAX_TIME_US, MAX_TIME_US) (NaN is not)."""
    floats = np.fromiter(values_us, dtype=np.float64, count=len(values_us))
    return (floats > -MAX_TIME_US) & (floats < MAX_TIME_US)
