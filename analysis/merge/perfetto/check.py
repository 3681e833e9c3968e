"""Reading a written Perfetto trace back and checking what the merge promises.

Works without `trace_processor_shell`: packets are parsed one at a time with the protobuf classes
of the perfetto package, and slices are rebuilt the way the trace processor builds them (per track,
events sorted by timestamp, file order kept between equal timestamps; an end closes the innermost
open slice).

Checked: every track event names a described track; every interned id (names, categories,
annotation names) resolves on its sequence; per track, begins and ends balance and no end comes
before its begin; every flow arrow joins two slices, and a rank's own flows are complete; every counter
value is finite (the engine drops or mis-scales the others).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from google.protobuf.message import DecodeError
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

_TRACE_PACKET_FIELD_TAG = (1 << 3) | 2
_STATE_CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
_READ_CHUNK_BYTES = 1 << 20


WHOLE_FILE_PARSE_BYTES = 64 << 20
"""Traces up to this size are parsed in one protobuf call (fast); larger ones packet by packet."""


def iter_packets(path: str | Path) -> Iterator[pb.TracePacket]:
    """The packets of a Perfetto trace file; a large file is read one packet at a time."""
    if Path(path).stat().st_size <= WHOLE_FILE_PARSE_BYTES:
        trace = pb.Trace()
        try:
            trace.ParseFromString(Path(path).read_bytes())
        except DecodeError as error:
            raise ValueError(f"{path}: truncated or not a Perfetto trace ({error})") from error
        yield from trace.packet
        return
    with open(path, "rb") as handle:
        buffer = b""
        position = 0
        while True:
            packet_bytes, position, buffer = _next_packet_bytes(handle, buffer, position)
            if packet_bytes is None:
                return
            packet = pb.TracePacket()
            try:
                packet.ParseFromString(packet_bytes)
            except DecodeError as error:
                raise ValueError(f"{path}: damaged packet before byte {position} ({error})") from error
            yield packet


def _next_packet_bytes(handle, buffer: bytes, position: int) -> tuple[bytes | None, int, bytes]:
    while True:
        parsed = _try_parse_packet(buffer, position)
        if parsed is not None:
            return parsed[0], parsed[1], buffer
        more = handle.read(_READ_CHUNK_BYTES)
        if not more:
            if position < len(buffer):
                raise ValueError(f"truncated trace: {len(buffer) - position} trailing bytes")
            return None, position, buffer
        buffer = buffer[position:] + more
        position = 0


def _try_parse_packet(buffer: bytes, position: int) -> tuple[bytes, int] | None:
    if position >= len(buffer):
        return None
    tag, at = _read_varint(buffer, position)
    if tag is None:
        return None
    if tag != _TRACE_PACKET_FIELD_TAG:
        raise ValueError(f"unexpected field tag {tag} at byte {position}: not a Perfetto trace")
    length, at = _read_varint(buffer, at)
    if length is None or at + length > len(buffer):
        return None
    return buffer[at:at + length], at + length


def _read_varint(buffer: bytes, position: int) -> tuple[int | None, int]:
    value, shift = 0, 0
    while position < len(buffer):
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    return None, position


@dataclass(frozen=True, kw_only=True, slots=True)
class RebuiltSlice:
    track_uuid: int
    name: str
    category: str
    start_ns: int
    end_ns: int
    depth: int
    annotations: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RebuiltInstant:
    track_uuid: int
    name: str
    ts_ns: int
    annotations: dict[str, Any] | None = None


@dataclass(kw_only=True, slots=True)
class TrackInfo:
    uuid: int
    name: str
    parent_uuid: int | None
    pid: int | None
    order: int | None
    is_counter: bool
    tid: int | None = None
    """Set for thread tracks (with `thread_pid`, the pid its descriptor names)."""
    thread_pid: int | None = None


@dataclass(kw_only=True)
class TraceCheck:
    """What a trace holds and what is wrong with it (`problems` empty when it is sound)."""

    tracks: dict[int, TrackInfo] = field(default_factory=dict)
    slices: list[RebuiltSlice] = field(default_factory=list)
    instants: list[RebuiltInstant] = field(default_factory=list)
    counter_values: dict[int, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    flow_ends: dict[int, list[tuple]] = field(default_factory=lambda: defaultdict(list))
    """flow id -> (ts_ns, packet index, terminates, slice key) of every slice it is attached to;
    a slice key is (track uuid, start ns, name)."""
    arrows: list[tuple[int, tuple, tuple]] = field(default_factory=list)
    """(flow id, from slice key, to slice key), as the trace processor joins flows."""
    unpaired_flow_ids: set[int] = field(default_factory=set)
    """Cross-rank flow ids found on one slice only (a rank without that collective instance)."""
    packet_count: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def processes(self) -> list[TrackInfo]:
        """Process tracks in the order the UI lists them (explicit order, then pid)."""
        found = [t for t in self.tracks.values() if t.pid is not None]
        return sorted(found, key=lambda t: (t.order if t.order is not None else 1 << 31, t.pid))

    def process_of(self, track_uuid: int) -> TrackInfo | None:
        track = self.tracks.get(track_uuid)
        while track is not None and track.pid is None:
            track = self.tracks.get(track.parent_uuid) if track.parent_uuid is not None else None
        return track

    def threads(self) -> list[TrackInfo]:
        return [t for t in self.tracks.values() if t.tid is not None]

    def thread_count_by_process(self) -> Counter:
        return Counter(self.process_of(t.uuid).name for t in self.threads())

    def instant_count_by_process(self) -> Counter:
        return Counter(self.process_of(i.track_uuid).name for i in self.instants)

    def slice_count_by_process(self) -> Counter:
        counts: Counter = Counter()
        for item in self.slices:
            process = self.process_of(item.track_uuid)
            counts[process.name if process else None] += 1
        return counts


@dataclass(kw_only=True)
class _Interning:
    names: dict[int, str] = field(default_factory=dict)
    categories: dict[int, str] = field(default_factory=dict)
    annotation_names: dict[int, str] = field(default_factory=dict)

    def clear(self) -> None:
        self.names.clear()
        self.categories.clear()
        self.annotation_names.clear()

    def add(self, interned: pb.InternedData) -> None:
        self.names.update((e.iid, e.name) for e in interned.event_names)
        self.categories.update((e.iid, e.name) for e in interned.event_categories)
        self.annotation_names.update((e.iid, e.name) for e in interned.debug_annotation_names)


def check_trace(path: str | Path) -> TraceCheck:
    """Read a Perfetto trace written by the merge and check its invariants."""
    check = TraceCheck()
    interning: dict[int, _Interning] = defaultdict(_Interning)
    events_by_track: dict[int, list[tuple]] = defaultdict(list)
    for index, packet in enumerate(iter_packets(path)):
        check.packet_count += 1
        if packet.HasField("track_descriptor"):
            _add_track(packet.track_descriptor, check)
        sequence = interning[packet.trusted_packet_sequence_id]
        if packet.sequence_flags & _STATE_CLEARED:
            sequence.clear()
        if packet.HasField("interned_data"):
            sequence.add(packet.interned_data)
        if packet.HasField("track_event"):
            _add_event(packet, index, sequence, check, events_by_track)
    for uuid, events in events_by_track.items():
        _rebuild_track(uuid, events, check)
    _check_flows(check)
    _check_threads(check)
    _check_counters(check)
    return check


def _check_counters(check: TraceCheck) -> None:
    for uuid, samples in check.counter_values.items():
        bad = [ts for ts, value in samples if not math.isfinite(value)]
        if bad:
            check.problems.append(f"counter track {uuid}: {len(bad)} values not finite (first at {bad[0]})")


def _add_track(descriptor: pb.TrackDescriptor, check: TraceCheck) -> None:
    if descriptor.uuid == 0:
        return
    if descriptor.uuid in check.tracks:
        check.problems.append(f"track {descriptor.uuid} described twice")
    check.tracks[descriptor.uuid] = TrackInfo(
        uuid=descriptor.uuid,
        name=descriptor.name,
        parent_uuid=descriptor.parent_uuid if descriptor.HasField("parent_uuid") else None,
        pid=descriptor.process.pid if descriptor.HasField("process") else None,
        order=descriptor.sibling_order_rank if descriptor.HasField("sibling_order_rank") else None,
        is_counter=descriptor.HasField("counter"),
        tid=descriptor.thread.tid if descriptor.HasField("thread") else None,
        thread_pid=descriptor.thread.pid if descriptor.HasField("thread") else None,
    )


def _add_event(packet: pb.TracePacket, index: int, sequence: _Interning, check: TraceCheck,
               events_by_track: dict[int, list[tuple]]) -> None:
    event = packet.track_event
    if event.track_uuid not in check.tracks:
        check.problems.append(f"packet {index}: track {event.track_uuid} used before it is described")
    name = _resolve(event.name_iid, sequence.names, "name", index, check) if event.name_iid else event.name
    categories = [_resolve(iid, sequence.categories, "category", index, check) for iid in event.category_iids]
    annotations = {}
    for annotation in event.debug_annotations:
        key = (_resolve(annotation.name_iid, sequence.annotation_names, "annotation name", index, check)
               if annotation.name_iid else annotation.name)
        annotations[key] = annotation_value(annotation)
    if event.type == pb.TrackEvent.TYPE_COUNTER:
        value = event.double_counter_value if event.HasField("double_counter_value") else event.counter_value
        check.counter_values[event.track_uuid].append((packet.timestamp, value))
        return
    flows = tuple(event.flow_ids) + tuple(event.flow_ids_old)
    terminating = tuple(event.terminating_flow_ids) + tuple(event.terminating_flow_ids_old)
    if (flows or terminating) and event.type not in (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_INSTANT):
        check.problems.append(f"packet {index}: flow ids on an event that is not a slice")
    events_by_track[event.track_uuid].append(
        (packet.timestamp, index, event.type, name, ",".join(categories), flows, terminating, annotations or None)
    )


def annotation_value(annotation: pb.DebugAnnotation) -> Any:
    """A debug annotation as a plain value (dicts and lists for nested ones)."""
    if annotation.dict_entries:
        return {entry.name: annotation_value(entry) for entry in annotation.dict_entries}
    if annotation.array_values:
        return [annotation_value(item) for item in annotation.array_values]
    which = annotation.WhichOneof("value")
    return getattr(annotation, which) if which else None


def _resolve(iid: int, table: dict[int, str], what: str, index: int, check: TraceCheck) -> str:
    text = table.get(iid)
    if text is None:
        check.problems.append(f"packet {index}: interned {what} id {iid} does not resolve")
        return f"<unresolved {iid}>"
    return text


def _rebuild_track(uuid: int, events: list[tuple], check: TraceCheck) -> None:
    events.sort(key=lambda e: e[0])
    open_slices: list[tuple] = []
    for timestamp, index, kind, name, category, flow_ids, terminating, annotations in events:
        slice_key = (uuid, timestamp, name)
        for flow_id in flow_ids:
            check.flow_ends[flow_id].append((timestamp, index, False, slice_key))
        for flow_id in terminating:
            check.flow_ends[flow_id].append((timestamp, index, True, slice_key))
        if kind == pb.TrackEvent.TYPE_SLICE_BEGIN:
            open_slices.append((timestamp, name, category, annotations))
        elif kind == pb.TrackEvent.TYPE_SLICE_END:
            if not open_slices:
                check.problems.append(f"packet {index}: slice end on track {uuid} with no open slice")
                continue
            start, begun_name, begun_category, begun_annotations = open_slices.pop()
            check.slices.append(RebuiltSlice(track_uuid=uuid, name=begun_name, category=begun_category,
                                             start_ns=start, end_ns=timestamp, depth=len(open_slices),
                                             annotations=begun_annotations))
        elif kind == pb.TrackEvent.TYPE_INSTANT:
            check.instants.append(RebuiltInstant(track_uuid=uuid, name=name, ts_ns=timestamp,
                                                 annotations=annotations))
    for start, name, _, _ in open_slices:
        check.problems.append(f"track {uuid}: slice {name!r} begun at {start} never ends")


def _check_flows(check: TraceCheck) -> None:
    """Join flow ends in time order the way the trace processor does (file order between equal
    timestamps: an end written before the flow's start at the same instant ends nothing); every arrow must
    have a slice at both ends. A rank's own flows (launch -> kernel, the trace's flows) must be complete; a
    cross-rank id (top bit set) seen once only means the other ranks lack that instance."""
    for flow_id, ends in check.flow_ends.items():
        ends.sort(key=lambda end: (end[0], end[1]))
        previous = None
        for _, _, terminates, slice_key in ends:
            if previous is not None:
                check.arrows.append((flow_id, previous, slice_key))
            elif terminates:
                check.problems.append(f"flow {flow_id} ends at {slice_key} but never started")
            previous = None if terminates else slice_key
        if len(ends) < 2:
            if flow_id & CROSS_RANK_FLOW_BIT:
                check.unpaired_flow_ids.add(flow_id)
            else:
                check.problems.append(f"flow {flow_id} is attached to one slice only")


CROSS_RANK_FLOW_BIT = 1 << 63


def _check_threads(check: TraceCheck) -> None:
    """A thread track names its process's pid (the process it sits under), and no thread id is used by
    two thread tracks or by a process."""
    pids = {t.pid for t in check.tracks.values() if t.pid is not None}
    seen: dict[int, int] = {}
    for thread in check.threads():
        process = check.process_of(thread.uuid)
        if thread.thread_pid not in pids:
            check.problems.append(f"thread track {thread.uuid} names pid {thread.thread_pid}, which has no process")
        elif process is not None and process.pid != thread.thread_pid:
            check.problems.append(f"thread track {thread.uuid} names pid {thread.thread_pid} "
                                  f"but sits under process {process.pid}")
        if thread.tid in seen or thread.tid in pids:
            check.problems.append(f"thread id {thread.tid} of track {thread.uuid} is not unique")
        seen[thread.tid] = thread.uuid
