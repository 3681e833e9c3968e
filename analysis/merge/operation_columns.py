"""A window's planned operations as the columns the Perfetto encoder takes (perfetto/columnar.py).

The operations are the planner's tuples (tracks.py: OP_BEGIN, OP_END, OP_INSTANT, OP_COUNTER); each
column is pulled out in one pass, and only the few rows that carry flows or debug annotations are
looked at one by one. What a row carries is what the per-event emitter gives it (run.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress
from operator import itemgetter
from typing import Any

import numpy as np

from fleetscope.analysis.merge.flows import FlowPlan
from fleetscope.analysis.merge.perfetto.columnar import FlowColumns, TrackEventColumns
from fleetscope.analysis.merge.perfetto.writer import COUNTER, INSTANT, SLICE_BEGIN, SLICE_END
from fleetscope.analysis.merge.tracks import NO_EVENT, OP_BEGIN, OP_COUNTER, OP_END, OP_INSTANT

_TYPE_OF_OPERATION = np.zeros(max(OP_END, OP_BEGIN, OP_INSTANT, OP_COUNTER) + 1, dtype=np.uint8)
_TYPE_OF_OPERATION[[OP_END, OP_BEGIN, OP_INSTANT, OP_COUNTER]] = [SLICE_END, SLICE_BEGIN, INSTANT, COUNTER]
_BEGIN_IDENT, _BEGIN_ANNOTATIONS = 6, 7
_INSTANT_IDENT, _INSTANT_ANNOTATIONS = 5, 6


def operation_columns(operations: list[tuple], flows: FlowPlan, events: list[Any], *,
                      event_args: bool) -> TrackEventColumns | None:
    """The operations as columns; None when a timestamp or uuid does not fit int64 / uint64 (the
    per-event writer then says what is wrong)."""
    count = len(operations)
    kinds = np.fromiter(map(itemgetter(1), operations), dtype=np.int8, count=count)
    try:
        timestamps = np.fromiter(map(itemgetter(0), operations), dtype=np.int64, count=count)
        uuids = np.fromiter(map(itemgetter(2), operations), dtype=np.uint64, count=count)
    except (OverflowError, TypeError):
        return None
    named_ops = list(compress(operations, ((kinds == OP_BEGIN) | (kinds == OP_INSTANT)).tolist()))
    counter_ops = compress(operations, (kinds == OP_COUNTER).tolist())
    begins = _Rows.of(operations, kinds, OP_BEGIN, _BEGIN_IDENT)
    instants = _Rows.of(operations, kinds, OP_INSTANT, _INSTANT_IDENT)
    annotations = _annotations(begins, _BEGIN_ANNOTATIONS, begins.idents <= NO_EVENT, events, event_args)
    annotations.update(_annotations(instants, _INSTANT_ANNOTATIONS, instants.idents == NO_EVENT, events, event_args))
    return TrackEventColumns(
        types=_TYPE_OF_OPERATION[kinds], timestamps_ns=timestamps, track_uuids=uuids,
        names=list(map(itemgetter(3), named_ops)), categories=list(map(itemgetter(4), named_ops)),
        counter_values=np.fromiter(map(itemgetter(3), counter_ops), dtype=np.float64),
        flows=_flows(begins, flows), annotations=annotations,
    )


@dataclass(frozen=True, slots=True)
class _Rows:
    """The operations of one kind: their rows, the tuples and their idents."""

    rows: np.ndarray
    operations: list[tuple]
    idents: np.ndarray

    @classmethod
    def of(cls, operations: list[tuple], kinds: np.ndarray, kind: int, ident_index: int) -> "_Rows":
        selected = kinds == kind
        chosen = list(compress(operations, selected.tolist()))
        idents = np.fromiter(map(itemgetter(ident_index), chosen), dtype=np.int64, count=len(chosen))
        return cls(rows=np.flatnonzero(selected), operations=chosen, idents=idents)


def _flows(begins: _Rows, flows: FlowPlan) -> FlowColumns:
    """The flow ids of the slice begins (a slice's are the FlowPlan's under its ident), looked up per
    ident, not per row; idents that key flows and are not unique among the begins are looked up per row."""
    if not flows.outgoing and not flows.terminating:
        return FlowColumns.none()
    keyed = np.isin(begins.idents, np.fromiter({*flows.outgoing, *flows.terminating}, dtype=np.int64))
    if len(np.unique(begins.idents[keyed])) != int(keyed.sum()):
        return FlowColumns.of_rows({row: (flows.outgoing.get(ident, ()), flows.terminating.get(ident, ()))
                                    for row, ident in zip(begins.rows[keyed].tolist(), begins.idents[keyed].tolist())})
    order = np.argsort(begins.idents[keyed])
    idents, rows = begins.idents[keyed][order], begins.rows[keyed][order]
    parts = [_entries(table, idents, rows, terminating) for terminating, table in
             ((False, flows.outgoing), (True, flows.terminating))]
    return FlowColumns.of_entries(*(np.concatenate(column) for column in zip(*parts)))


def _entries(table: dict[int, list[int]], idents: np.ndarray, rows: np.ndarray,
             terminating: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, flow id, terminating) of each flow id in `table` whose ident is a slice begin (`idents`, sorted)."""
    keys = np.fromiter(table, dtype=np.int64, count=len(table))
    counts = np.fromiter(map(len, table.values()), dtype=np.int64, count=len(table))
    ids = np.fromiter(chain.from_iterable(table.values()), dtype=np.uint64, count=int(counts.sum()))
    at = np.minimum(np.searchsorted(idents, keys), max(len(idents) - 1, 0))
    found = idents[at] == keys if len(idents) else np.zeros(len(keys), dtype=bool)
    kept = np.repeat(found, counts)
    entry_rows = np.repeat(rows[at] if len(idents) else keys, counts)[kept]
    return entry_rows, ids[kept], np.full(len(entry_rows), terminating)


def _annotations(chosen: _Rows, annotations_index: int, made_up: np.ndarray, events: list[Any],
                 event_args: bool) -> dict[int, dict]:
    """row -> debug annotations, as the per-event emitter gives them: a made-up row's own, and with
    `event_args` each event's Kineto args."""
    annotations = {}
    for position in np.flatnonzero(made_up).tolist():
        annotations[int(chosen.rows[position])] = chosen.operations[position][annotations_index]
    if event_args:
        for position in np.flatnonzero(~made_up).tolist():
            annotations[int(chosen.rows[position])] = event_args_of(events, int(chosen.idents[position]))
    return {row: value for row, value in annotations.items() if value}


def event_args_of(events: list[Any], ident: int) -> dict | None:
    """A Kineto event's args as debug annotations (None when it has none)."""
    args = events[ident].get("args")
    return args if isinstance(args, dict) and args else None
