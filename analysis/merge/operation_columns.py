"""A window's plan as the columns the Perfetto encoder takes (perfetto/columnar.py).

The slices' begins and ends come as indexes into the slice table (column_plan.py); the few other operations
(instants, counters, overlays) as tuples (tracks.py: OP_BEGIN, OP_END, OP_INSTANT, OP_COUNTER). Only the rows
that carry flows or debug annotations are looked at one by one. RowSources keeps what the Chrome JSON and the
events' args need of each row (run.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np
from fleetscope.analysis.merge.flows import FlowPlan
from fleetscope.analysis.merge.perfetto.columnar import FlowColumns, TrackEventColumns
from fleetscope.analysis.merge.perfetto.writer import (
    COUNTER,
    INSTANT,
    SLICE_BEGIN,
    SLICE_END,
)
from fleetscope.analysis.merge.tracks import (
    NO_EVENT,
    OP_BEGIN,
    OP_COUNTER,
    OP_END,
    OP_INSTANT,
)

if TYPE_CHECKING:
    from fleetscope.analysis.merge.slice_table import SliceOps, SliceTable

_TYPE_OF_OPERATION = np.zeros(max(OP_END, OP_BEGIN, OP_INSTANT, OP_COUNTER) + 1, dtype=np.uint8)
_TYPE_OF_OPERATION[[OP_END, OP_BEGIN, OP_INSTANT, OP_COUNTER]] = [SLICE_END, SLICE_BEGIN, INSTANT, COUNTER]
_BEGIN_END, _BEGIN_IDENT, _BEGIN_ANNOTATIONS = 5, 6, 7
_INSTANT_IDENT, _INSTANT_ANNOTATIONS = 5, 6


@dataclass(frozen=True, slots=True)
class _Rows:
    """The operations of one kind: their rows, the tuples and their idents."""

    rows: np.ndarray
    operations: list[tuple]
    idents: np.ndarray

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


def event_args_of(events: list[Any], ident: int) -> dict | None:
    """A Kineto event's args as debug annotations (None when it has none)."""
    args = events[ident].get("args")
    return args if isinstance(args, dict) and args else None


# --- a window planned on columns (column_plan.py) ---------------------------------------------------

@dataclass(frozen=True, slots=True)
class RowSources:
    """What each row of a columnar plan's columns came from, for the Chrome JSON and the events' args."""

    idents: np.ndarray
    """int64 per row: the Kineto event's index in the trace (NO_EVENT or below: a made-up slice or mark)."""
    ends_ns: np.ndarray
    """int64 per row: a SLICE_BEGIN's end (0 elsewhere)."""


def planned_columns(slice_ops: "SliceOps", rare_ops: list[tuple], table: "SliceTable",
                    flows: FlowPlan) -> tuple[TrackEventColumns, RowSources]:
    """The encoder's columns of a columnar plan: the slices' begins and ends (`slice_ops`, in emission
    order), then the rare operations (instants, counters, overlays: plan.py's tuples), sorted by time
    stably over that order; and each row's sources."""
    rows, begins = slice_ops.rows, slice_ops.begins
    rare = _RareOps.of(rare_ops)
    timestamps = np.concatenate([np.where(begins, table.starts[rows], table.ends[rows]), rare.timestamps])
    order = np.argsort(timestamps, kind="stable")
    kinds = np.concatenate([np.where(begins, OP_BEGIN, OP_END).astype(np.int8), rare.kinds])[order]
    names = np.concatenate([_texts(table.names, table.name_ids[rows], begins), rare.names])[order]
    categories = np.concatenate([_texts(table.categories, table.category_ids[rows], begins), rare.categories])[order]
    idents = np.concatenate([table.idents[rows], rare.idents])[order]
    named = (kinds == OP_BEGIN) | (kinds == OP_INSTANT)
    begin_rows = np.flatnonzero(kinds == OP_BEGIN)
    slice_count = len(rows)
    ends = np.concatenate([np.where(begins, table.ends[rows], 0), rare.ends_ns])[order]
    return TrackEventColumns(
        types=_TYPE_OF_OPERATION[kinds], timestamps_ns=timestamps[order],
        track_uuids=np.concatenate([slice_ops.uuids, rare.uuids])[order],
        names=names[named].tolist(), categories=categories[named].tolist(),
        counter_values=rare.values[order[kinds == OP_COUNTER] - slice_count],
        flows=_planned_flows(begin_rows, idents[begin_rows], flows),
        annotations=_rare_annotations(rare, order, slice_count),
    ), RowSources(idents=idents, ends_ns=ends)


def with_event_args(columns: TrackEventColumns, sources: RowSources, events: list[Any]) -> TrackEventColumns:
    """`columns` with each Kineto event's args as its slice's or instant's debug annotations (the made-up
    rows keep their own), as the per-event emitter gives them with event args."""
    named = (columns.types == SLICE_BEGIN) | (columns.types == INSTANT)
    annotations = dict(columns.annotations)
    for row in np.flatnonzero(named & (sources.idents >= 0)).tolist():
        args = event_args_of(events, int(sources.idents[row]))
        if args:
            annotations[row] = args
    return dataclasses.replace(columns, annotations=annotations)


def _texts(table: list[str], ids: np.ndarray, named: np.ndarray) -> np.ndarray:
    """The text of each named row (None elsewhere), as an object array."""
    texts = np.empty(len(ids), dtype=object)
    texts[named] = np.array(table, dtype=object)[ids[named]] if len(table) else []
    return texts


@dataclass(frozen=True, slots=True)
class _RareOps:
    """plan.py's operation tuples as columns."""

    operations: list[tuple]
    timestamps: np.ndarray
    kinds: np.ndarray
    uuids: np.ndarray
    names: np.ndarray
    categories: np.ndarray
    idents: np.ndarray
    values: np.ndarray
    """float64 counter value per row (0 where not a counter)."""
    ends_ns: np.ndarray
    """int64: a begin's end (0 where not a begin)."""

    @classmethod
    def of(cls, operations: list[tuple]) -> "_RareOps":
        count = len(operations)
        kinds = np.fromiter(map(itemgetter(1), operations), dtype=np.int8, count=count)
        try:
            timestamps = np.fromiter(map(itemgetter(0), operations), dtype=np.int64, count=count)
            uuids = np.fromiter(map(itemgetter(2), operations), dtype=np.uint64, count=count)
        except (OverflowError, TypeError) as error:
            raise ValueError(f"a planned timestamp or track uuid does not fit 64 bits: {error}") from error
        names, categories = np.empty(count, dtype=object), np.empty(count, dtype=object)
        idents, values = np.full(count, NO_EVENT, dtype=np.int64), np.zeros(count, dtype=np.float64)
        ends = np.zeros(count, dtype=np.int64)
        for row, operation in enumerate(operations):
            kind = operation[1]
            if kind == OP_BEGIN:
                names[row], categories[row], idents[row] = operation[3], operation[4], operation[_BEGIN_IDENT]
                ends[row] = operation[_BEGIN_END]
            elif kind == OP_INSTANT:
                names[row], categories[row], idents[row] = operation[3], operation[4], operation[_INSTANT_IDENT]
            elif kind == OP_COUNTER:
                values[row] = operation[3]
        return cls(operations=operations, timestamps=timestamps, kinds=kinds, uuids=uuids, names=names,
                   categories=categories, idents=idents, values=values, ends_ns=ends)

    def annotations_of(self, row: int) -> Any:
        """A made-up slice's or mark's own annotations (the Kineto events' are not drawn here: no event args)."""
        operation = self.operations[row]
        kind, ident = operation[1], self.idents[row]
        if kind == OP_BEGIN and ident <= NO_EVENT:
            return operation[_BEGIN_ANNOTATIONS]
        if kind == OP_INSTANT and ident == NO_EVENT:
            return operation[_INSTANT_ANNOTATIONS]
        return None


def _rare_annotations(rare: _RareOps, order: np.ndarray, slice_count: int) -> dict[int, dict]:
    annotations = {}
    for row in np.flatnonzero(order >= slice_count).tolist():
        value = rare.annotations_of(int(order[row]) - slice_count)
        if value:
            annotations[row] = value
    return annotations


def _planned_flows(begin_rows: np.ndarray, begin_idents: np.ndarray, flows: FlowPlan) -> FlowColumns:
    """The FlowPlan's flow ids by begin row: the launch flows (columns) before each slice's other flows."""
    if flows.launch is None or not len(flows.launch.ids):
        return _flows(_Rows(rows=begin_rows, operations=[], idents=begin_idents), flows)
    order = np.argsort(begin_idents, kind="stable")
    sorted_idents, sorted_rows = begin_idents[order], begin_rows[order]
    launch = flows.launch
    rows_of = lambda idents: sorted_rows[np.searchsorted(sorted_idents, idents)]  # every launch slice is drawn
    others = _flows(_Rows(rows=begin_rows, operations=[], idents=begin_idents), flows)
    parts = [(rows_of(launch.sources), launch.ids, np.zeros(len(launch.ids), dtype=bool)),
             (others.rows[~others.terminating], others.ids[~others.terminating], others.terminating[~others.terminating]),
             (rows_of(launch.targets), launch.ids, np.ones(len(launch.ids), dtype=bool)),
             (others.rows[others.terminating], others.ids[others.terminating], others.terminating[others.terminating])]
    return FlowColumns.of_entries(*(np.concatenate(column) for column in zip(*parts)))
