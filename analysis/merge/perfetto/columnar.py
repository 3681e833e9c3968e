"""Encoding track events from columns: the bytes `SequenceWriter` would write, without a Python object
per event.

A rank drawn in full is mostly slice begins and ends that differ only in timestamp, track, name and
category. Here each field of a whole column is encoded at once with numpy (varints, fixed64 values,
constant keys), every packet's bytes are laid out by offsets computed from the field lengths, and a
chunk of packets goes to the file in one write. Fields are written in field-number order, as the
protobuf runtime writes them, so the output is byte for byte what the per-event writer gives.

Rare packets stay with `SequenceWriter` (through a `PacketCapture`) and are spliced in at their place:
the first use of an event name or category in the sequence (its packet carries the interned string),
events with debug annotations, the sequence's first packet (it clears incremental state), and anything
outside the fast path's value ranges. Interning happens in row order either way, so the interned ids
are the same.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from itertools import repeat
from typing import Sequence

import numpy as np

from fleetscope.analysis.merge.perfetto.writer import (
    COUNTER,
    INSTANT,
    SLICE_BEGIN,
    SLICE_END,
    PacketCapture,
    SequenceWriter,
    pb,
)

CHUNK_ROWS = 1 << 14
"""Packets encoded and written at once: bounds the encoder's arrays to a few MB."""

# Field keys, (field number << 3) | wire type, from the descriptors of the perfetto package's protos.
_VARINT, _FIXED64, _LENGTH_DELIMITED = 0, 1, 2


def _key(message: type, field_name: str, wire_type: int) -> bytes:
    number = message.DESCRIPTOR.fields_by_name[field_name].number
    return _varint_bytes((number << 3) | wire_type)


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_TRACE_PACKET = _key(pb.Trace, "packet", _LENGTH_DELIMITED)
_TIMESTAMP = _key(pb.TracePacket, "timestamp", _VARINT)
_SEQUENCE_ID = _key(pb.TracePacket, "trusted_packet_sequence_id", _VARINT)
_TRACK_EVENT = _key(pb.TracePacket, "track_event", _LENGTH_DELIMITED)
_SEQUENCE_FLAGS = _key(pb.TracePacket, "sequence_flags", _VARINT)
_CATEGORY_IID = _key(pb.TrackEvent, "category_iids", _VARINT)
_TYPE = _key(pb.TrackEvent, "type", _VARINT)
_NAME_IID = _key(pb.TrackEvent, "name_iid", _VARINT)
_TRACK_UUID = _key(pb.TrackEvent, "track_uuid", _VARINT)
_COUNTER_VALUE = _key(pb.TrackEvent, "double_counter_value", _FIXED64)
_FLOW_ID = _key(pb.TrackEvent, "flow_ids", _FIXED64)
_TERMINATING_FLOW_ID = _key(pb.TrackEvent, "terminating_flow_ids", _FIXED64)
_DEBUG_ANNOTATION = _key(pb.TrackEvent, "debug_annotations", _LENGTH_DELIMITED)
_ANNOTATION_NAME_IID = _key(pb.DebugAnnotation, "name_iid", _VARINT)
_ANNOTATION_VALUE_KEYS = {
    bool: _key(pb.DebugAnnotation, "bool_value", _VARINT),
    int: _key(pb.DebugAnnotation, "int_value", _VARINT),
    float: _key(pb.DebugAnnotation, "double_value", _FIXED64),
    str: _key(pb.DebugAnnotation, "string_value", _LENGTH_DELIMITED),
}
_NEEDS_STATE = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
_MAX_COMMON_FLOWS = 1
"""Slices with more flow ids are rare rows: the encoder's flow matrix is as wide as its widest row."""


@dataclass(frozen=True, kw_only=True)
class FlowColumns:
    """The flow ids of slice begins, one entry each, by row: a row's outgoing ids, then the ids it
    terminates, each in its given order."""

    rows: np.ndarray
    """int64, sorted."""
    ids: np.ndarray
    """uint64."""
    terminating: np.ndarray
    """bool: the entry is a terminating_flow_id."""

    @classmethod
    def none(cls) -> "FlowColumns":
        return cls(rows=np.zeros(0, dtype=np.int64), ids=np.zeros(0, dtype=np.uint64),
                   terminating=np.zeros(0, dtype=bool))

    @classmethod
    def of_rows(cls, flow_ids: dict[int, tuple[Sequence[int], Sequence[int]]]) -> "FlowColumns":
        """From row -> (outgoing ids, terminating ids)."""
        entries = [(row, flow_id, False) for row, (outgoing, _) in flow_ids.items() for flow_id in outgoing]
        entries += [(row, flow_id, True) for row, (_, terminating) in flow_ids.items() for flow_id in terminating]
        return cls.of_entries(np.array([e[0] for e in entries], dtype=np.int64),
                              np.array([e[1] for e in entries], dtype=np.uint64),
                              np.array([e[2] for e in entries], dtype=bool))

    @classmethod
    def of_entries(cls, rows: np.ndarray, ids: np.ndarray, terminating: np.ndarray) -> "FlowColumns":
        """From entries given outgoing before terminating and in order within each: sorted by row, stably."""
        order = np.argsort(rows, kind="stable")
        return cls(rows=rows[order], ids=ids[order], terminating=terminating[order])

    def of_row(self, row: int) -> tuple[list[int], list[int]]:
        """(outgoing ids, terminating ids) of one row."""
        first, last = np.searchsorted(self.rows, [row, row + 1])
        ids, terminating = self.ids[first:last].tolist(), self.terminating[first:last].tolist()
        return ([i for i, ends in zip(ids, terminating) if not ends], [i for i, ends in zip(ids, terminating) if ends])


@dataclass(frozen=True, kw_only=True)
class TrackEventColumns:
    """Track events of one sequence in write order, a row each."""

    types: np.ndarray
    """TrackEvent type per row: SLICE_BEGIN, SLICE_END, INSTANT or COUNTER."""
    timestamps_ns: np.ndarray
    """int64, per row."""
    track_uuids: np.ndarray
    """uint64, per row."""
    names: list[str]
    """One per SLICE_BEGIN and INSTANT row, in row order."""
    categories: list[str]
    """Likewise; "" for none."""
    counter_values: np.ndarray
    """float64, one per COUNTER row, in row order."""
    flows: FlowColumns = field(default_factory=FlowColumns.none)
    """The flow ids of the SLICE_BEGIN rows."""
    annotations: dict[int, dict[str, object]] = field(default_factory=dict)
    """row of a SLICE_BEGIN or INSTANT -> its debug annotations."""

    @property
    def row_count(self) -> int:
        return len(self.types)


def write_track_events(writer: SequenceWriter, columns: TrackEventColumns, *, chunk_rows: int = CHUNK_ROWS) -> None:
    """Write every row of `columns` to `writer`'s stream as `writer`'s own methods would, chunk by chunk."""
    named = (columns.types == SLICE_BEGIN) | (columns.types == INSTANT)
    name_before = np.concatenate(([0], np.cumsum(named)))
    counter_before = np.concatenate(([0], np.cumsum(columns.types == COUNTER)))
    flows = _Flows.of(columns.flows)
    annotated = np.array(sorted(columns.annotations), dtype=np.int64)
    for start in range(0, columns.row_count, chunk_rows):
        stop = min(start + chunk_rows, columns.row_count)
        chunk = _Chunk(columns=columns, start=start, stop=stop, named=named[start:stop],
                       names=columns.names[name_before[start]:name_before[stop]],
                       categories=columns.categories[name_before[start]:name_before[stop]],
                       counter_values=columns.counter_values[counter_before[start]:counter_before[stop]],
                       flows=flows, annotated=annotated[np.searchsorted(annotated, start):
                                                        np.searchsorted(annotated, stop)].tolist())
        writer.stream.write_encoded(_encode_chunk(writer, chunk), stop - start)


@dataclass(frozen=True, kw_only=True)
class _Chunk:
    columns: TrackEventColumns
    start: int
    stop: int
    named: np.ndarray
    names: list[str]
    categories: list[str]
    counter_values: np.ndarray
    flows: "_Flows"
    annotated: list[int]
    """The rows (of the whole columns, sorted) that have debug annotations."""

    @property
    def types(self) -> np.ndarray:
        return self.columns.types[self.start:self.stop]

    @property
    def timestamps_ns(self) -> np.ndarray:
        return self.columns.timestamps_ns[self.start:self.stop]

    @property
    def track_uuids(self) -> np.ndarray:
        return self.columns.track_uuids[self.start:self.stop]


def _encode_chunk(writer: SequenceWriter, chunk: _Chunk) -> bytes:
    names = _Interned.look_up(chunk.names, writer.name_iids)
    categories = _Interned.look_up(chunk.categories, writer.category_iids)
    rare = _rare_rows(writer, chunk, names, categories)
    rare_bytes = _write_rare_rows(writer, chunk, rare)
    names.complete(writer.name_iids)
    categories.complete(writer.category_iids)
    common = np.ones(chunk.stop - chunk.start, dtype=bool)
    common[rare] = False
    annotations = _annotation_field(writer, chunk, common)
    return _assemble(writer, chunk, common, rare, rare_bytes, names.iids, categories.iids, annotations)


@dataclass(frozen=True, slots=True)
class _Interned:
    """The interned id of each of a chunk's names (or categories); 0 for one not interned yet."""

    texts: list[str]
    iids: np.ndarray
    missing: np.ndarray
    """Positions whose text was not interned when looked up."""

    @classmethod
    def look_up(cls, texts: list[str], interned: dict[str, int]) -> "_Interned":
        iids = np.fromiter(map(interned.get, texts, repeat(0)), dtype=np.uint64, count=len(texts))
        return cls(texts=texts, iids=iids, missing=np.flatnonzero(iids == 0))

    def first_uses(self, *, skip: str | None = None) -> np.ndarray:
        """Positions of the first use of each text not interned (but `skip`, which never is)."""
        first: dict[str, int] = {}
        for position in self.missing.tolist():
            first.setdefault(self.texts[position], position)
        first.pop(skip, None)
        return np.array(sorted(first.values()), dtype=np.int64)

    def complete(self, interned: dict[str, int]) -> None:
        """Fill in the ids interned since the look-up (by the rare rows' packets)."""
        self.iids[self.missing] = [interned.get(self.texts[position], 0) for position in self.missing.tolist()]


# --- the rare rows, written by SequenceWriter -----------------------------------------------------

def _rare_rows(writer: SequenceWriter, chunk: _Chunk, names: _Interned, categories: _Interned) -> np.ndarray:
    """Chunk rows (sorted) that SequenceWriter writes: first uses of a name or category, annotated rows,
    the sequence's first packet, negative timestamps (the writer refuses them) and slices with many flows."""
    named_rows = np.flatnonzero(chunk.named)
    rows = [named_rows[names.first_uses()], named_rows[categories.first_uses(skip="")]]
    rows.append(_rare_annotated_rows(writer, chunk))
    rows.append(np.flatnonzero(chunk.timestamps_ns < 0))
    rows.append(np.flatnonzero(chunk.flows.per_row_counts(chunk.start, chunk.stop) > _MAX_COMMON_FLOWS))
    if not writer.started:
        rows.append(np.flatnonzero(chunk.types != SLICE_END)[:1])
    return np.unique(np.concatenate(rows).astype(np.int64))


def _rare_annotated_rows(writer: SequenceWriter, chunk: _Chunk) -> np.ndarray:
    """Annotated rows SequenceWriter writes: the first use of an annotation name not interned yet (its packet
    interns it), and rows with a value other than text, a bool, a float or an int64 (lists, dicts, others)."""
    interned, first_seen, rows = writer.annotation_name_iids, set(), []
    for row in chunk.annotated:
        annotations = chunk.columns.annotations[row]
        new_names = [key for key in annotations if key not in interned and key not in first_seen]
        if new_names or not all(map(_is_plain_value, annotations.values())):
            rows.append(row - chunk.start)
            first_seen.update(new_names)
    return np.array(rows, dtype=np.int64)


def _is_plain_value(value: object) -> bool:
    kind = type(value)
    return kind is str or kind is float or kind is bool or (kind is int and -(2**63) <= value < 2**63)


def _annotation_field(writer: SequenceWriter, chunk: _Chunk, common: np.ndarray) -> _Field:
    """TrackEvent's debug_annotations of the common annotated rows, as set_annotation_value writes them:
    per annotation its name's iid, then its value (an int as its 64-bit two's complement varint)."""
    rows = len(common)
    encoded = {row - chunk.start: b"".join(_annotation_bytes(writer.annotation_name_iids[key], value)
                                           for key, value in chunk.columns.annotations[row].items())
               for row in chunk.annotated if common[row - chunk.start]}
    width = max(map(len, encoded.values()), default=0)
    matrix = np.zeros((rows, width), dtype=np.uint8)
    lengths = np.zeros(rows, dtype=np.int64)
    for row, data in encoded.items():
        matrix[row, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        lengths[row] = len(data)
    return _Field(matrix, lengths)


def _annotation_bytes(name_iid: int, value: object) -> bytes:
    kind = type(value)
    if kind is str:
        text = value.encode("utf-8")
        encoded = _ANNOTATION_VALUE_KEYS[str] + _varint_bytes(len(text)) + text
    elif kind is float:
        encoded = _ANNOTATION_VALUE_KEYS[float] + struct.pack("<d", value)
    else:  # bool or int
        encoded = _ANNOTATION_VALUE_KEYS[kind] + _varint_bytes(int(value) & ((1 << 64) - 1))
    body = _ANNOTATION_NAME_IID + _varint_bytes(name_iid) + encoded
    return _DEBUG_ANNOTATION + _varint_bytes(len(body)) + body


def _write_rare_rows(writer: SequenceWriter, chunk: _Chunk, rare: np.ndarray) -> list[bytes]:
    """Each rare row's packet, framed, made by `writer` in row order (so it interns as the per-event path)."""
    if not len(rare):
        return []
    name_position = np.cumsum(chunk.named) - 1
    counter_position = np.cumsum(chunk.types == COUNTER) - 1
    stream, capture = writer.stream, PacketCapture()
    writer.stream = capture
    try:
        encoded = []
        for row in rare.tolist():
            _write_row(writer, chunk, row, int(name_position[row]), int(counter_position[row]))
            encoded.append(capture.take())
        return encoded
    finally:
        writer.stream = stream


def _write_row(writer: SequenceWriter, chunk: _Chunk, row: int, name_position: int, counter_position: int) -> None:
    kind, ts, uuid = int(chunk.types[row]), int(chunk.timestamps_ns[row]), int(chunk.track_uuids[row])
    annotations = chunk.columns.annotations.get(chunk.start + row)
    if kind == SLICE_BEGIN:
        outgoing, terminating = chunk.columns.flows.of_row(chunk.start + row)
        writer.slice_begin(ts, uuid, chunk.names[name_position], chunk.categories[name_position],
                           flow_ids=outgoing, terminating_flow_ids=terminating, annotations=annotations)
    elif kind == INSTANT:
        writer.instant(ts, uuid, chunk.names[name_position], chunk.categories[name_position], annotations=annotations)
    elif kind == COUNTER:
        writer.counter(ts, uuid, float(chunk.counter_values[counter_position]))
    else:
        writer.slice_end(ts, uuid)


# --- the common rows, encoded from columns --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Field:
    """One field of every row, left-aligned in a row of `matrix`: row i holds `matrix[i, :lengths[i]]`
    (length 0 where the row lacks the field)."""

    matrix: np.ndarray
    lengths: np.ndarray


def _assemble(writer: SequenceWriter, chunk: _Chunk, common: np.ndarray, rare: np.ndarray,
              rare_bytes: list[bytes], name_iids: np.ndarray, category_iids: np.ndarray,
              annotations: _Field) -> bytes:
    """Every row's framed packet, rows in order; rare rows take their bytes from `rare_bytes`."""
    types = chunk.types
    named = chunk.named & common
    counter = (types == COUNTER) & common
    event_fields = _track_event_fields(chunk, common, named, counter, name_iids, category_iids, annotations)
    event_length = sum(f.lengths for f in event_fields)
    packet_fields = [
        _varint_field(_TIMESTAMP, chunk.timestamps_ns, common),
        _constant_field(_SEQUENCE_ID + _varint_bytes(writer.sequence_id), common),
        _varint_field(_TRACK_EVENT, event_length, common),
        *event_fields,
        _constant_field(_SEQUENCE_FLAGS + _varint_bytes(_NEEDS_STATE), common & (types != SLICE_END)),
    ]
    packet_length = sum(f.lengths for f in packet_fields)
    fields = [_varint_field(_TRACE_PACKET, packet_length, common), *packet_fields]
    return _splice(_concatenate_rows(fields), sum(f.lengths for f in fields), rare, rare_bytes)


def _concatenate_rows(fields: list[_Field]) -> np.ndarray:
    """Row 0's fields in order, then row 1's, ...: the fields' matrices side by side, padding dropped
    (fields no row has, such as counter values in most chunks, take no columns)."""
    fields = [f for f in fields if f.lengths.any()]
    if not fields:
        return np.zeros(0, dtype=np.uint8)
    padded = np.concatenate([f.matrix for f in fields], axis=1)
    widths = [f.matrix.shape[1] for f in fields]
    lengths = np.stack([f.lengths for f in fields], axis=1).astype(np.int32)
    column_in_field = np.concatenate([np.arange(width, dtype=np.int32) for width in widths])
    keep = column_in_field < np.repeat(lengths, widths, axis=1)
    return padded.reshape(-1)[np.flatnonzero(keep.reshape(-1))]


def _splice(common_bytes: np.ndarray, row_lengths: np.ndarray, rare: np.ndarray, rare_bytes: list[bytes]) -> bytes:
    """The common rows' bytes with each rare row's bytes put in at its place."""
    if not len(rare):
        return common_bytes.tobytes()
    cuts = (np.cumsum(row_lengths) - row_lengths)[rare].tolist()
    pieces, previous = [], 0
    for cut, encoded in zip(cuts, rare_bytes):
        pieces += [common_bytes[previous:cut].tobytes(), encoded]
        previous = cut
    pieces.append(common_bytes[previous:].tobytes())
    return b"".join(pieces)


def _track_event_fields(chunk: _Chunk, common: np.ndarray, named: np.ndarray, counter: np.ndarray,
                        name_iids: np.ndarray, category_iids: np.ndarray, annotations: _Field) -> list[_Field]:
    """TrackEvent's fields in field-number order: category_iids, debug_annotations, type, name_iid,
    track_uuid, double_counter_value, flow_ids and terminating_flow_ids."""
    rows = len(common)
    names, categories = np.zeros(rows, dtype=np.uint64), np.zeros(rows, dtype=np.uint64)
    name_rows = np.flatnonzero(chunk.named)
    names[name_rows], categories[name_rows] = name_iids, category_iids
    counter_values = np.zeros(rows, dtype=np.float64)
    counter_values[chunk.types == COUNTER] = chunk.counter_values
    return [
        _varint_field(_CATEGORY_IID, categories, named & (categories > 0)),
        annotations,
        _varint_field(_TYPE, chunk.types, common),
        _varint_field(_NAME_IID, names, named),
        _varint_field(_TRACK_UUID, chunk.track_uuids, common),
        _fixed64_field(_COUNTER_VALUE, counter_values.view(np.uint64), counter),
        _flow_field(chunk, common & (chunk.types == SLICE_BEGIN)),
    ]


@dataclass(frozen=True, slots=True)
class _Flows:
    """Every flow id of the slice begins, one entry each: outgoing ones then terminating ones, by row."""

    rows: np.ndarray
    slots: np.ndarray
    """The entry's place among its row's flow ids."""
    keys: np.ndarray
    """(entries, key bytes): flow_ids' or terminating_flow_ids' field key."""
    values: np.ndarray

    @classmethod
    def of(cls, flows: FlowColumns) -> "_Flows":
        rows = flows.rows
        first_of_row = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1]))) if len(rows) else rows
        slots = np.arange(len(rows)) - np.repeat(first_of_row, np.diff(np.append(first_of_row, len(rows))))
        keys = np.where(flows.terminating[:, None], np.frombuffer(_TERMINATING_FLOW_ID, dtype=np.uint8),
                        np.frombuffer(_FLOW_ID, dtype=np.uint8)).astype(np.uint8)
        return cls(rows=rows, slots=slots, keys=keys.reshape(len(rows), len(_FLOW_ID)), values=flows.ids)

    def per_row_counts(self, start: int, stop: int) -> np.ndarray:
        inside = (self.rows >= start) & (self.rows < stop)
        return np.bincount(self.rows[inside] - start, minlength=stop - start)


def _flow_field(chunk: _Chunk, begins: np.ndarray) -> _Field:
    flows = chunk.flows
    local = flows.rows - chunk.start
    inside = (local >= 0) & (local < len(begins))
    inside[inside] = begins[local[inside]]
    entry = np.concatenate([flows.keys[inside], flows.values[inside].astype("<u8").view(np.uint8).reshape(-1, 8)], axis=1)
    slots = flows.slots[inside]
    width = int(slots.max()) + 1 if len(slots) else 0
    matrix = np.zeros((len(begins), width, entry.shape[1]), dtype=np.uint8)
    matrix[local[inside], slots] = entry
    lengths = np.bincount(local[inside], minlength=len(begins)).astype(np.int64) * entry.shape[1]
    return _Field(matrix.reshape(len(begins), -1), lengths)


def _constant_field(encoded: bytes, present: np.ndarray) -> _Field:
    matrix = np.broadcast_to(np.frombuffer(encoded, dtype=np.uint8), (len(present), len(encoded)))
    return _Field(matrix, present.astype(np.int64) * len(encoded))


def _varint_field(key: bytes, values: np.ndarray, present: np.ndarray) -> _Field:
    """`key` and the varint of each present row's value (values >= 0)."""
    remaining = values.astype(np.uint64)
    widths, width = _varint_widths(remaining)
    matrix = np.empty((len(values), len(key) + width), dtype=np.uint8)
    matrix[:, :len(key)] = np.frombuffer(key, dtype=np.uint8)
    for group in range(width):
        matrix[:, len(key) + group] = remaining & np.uint64(0x7F)
        remaining = remaining >> np.uint64(7)
    if isinstance(widths, int):
        matrix[:, len(key):len(key) + width - 1] |= 0x80
        lengths = present * (width + len(key))
    else:
        matrix[:, len(key):][np.arange(width) < widths[:, None] - 1] |= 0x80
        lengths = np.where(present, widths + len(key), 0)
    return _Field(matrix, lengths.astype(np.int64))


def _varint_widths(values: np.ndarray) -> tuple[np.ndarray | int, int]:
    """Bytes of each value's varint (7 bits a byte; one int when every value takes the same), and the most.
    The width grows with the value, so only the thresholds between the smallest and the largest value's
    widths are compared."""
    if not len(values):
        return 1, 1
    narrowest, widest = _varint_width(int(values.min())), _varint_width(int(values.max()))
    if narrowest == widest:
        return widest, widest
    widths = np.full(len(values), narrowest, dtype=np.int64)
    for group in range(narrowest, widest):
        widths += values >= np.uint64(1 << (7 * group))
    return widths, widest


def _varint_width(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _fixed64_field(key: bytes, values: np.ndarray, present: np.ndarray) -> _Field:
    """`key` and 8 little-endian bytes of each present row's value."""
    little = values.astype("<u8").view(np.uint8).reshape(-1, 8)
    matrix = np.concatenate([np.broadcast_to(np.frombuffer(key, dtype=np.uint8), (len(values), len(key))), little], axis=1)
    return _Field(matrix, present.astype(np.int64) * (len(key) + 8))
