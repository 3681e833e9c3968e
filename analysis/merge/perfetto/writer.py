"""Writing a native Perfetto trace packet by packet, with interned names.

`PacketStream` is `perfetto.trace_builder.proto_builder.StreamingTraceProtoBuilder` with one change:
it serializes packets in small batches instead of one `Trace` message per packet. The bytes on disk
are the same kind of stream (concatenated `Trace` messages, each holding packets), memory stays
bounded by one batch, and writing is about 1.7x faster because protobuf's per-message overhead is
paid once per batch.

`SequenceWriter` owns one trusted packet sequence: its interning tables (event names, categories,
debug annotation names) and the packet flags Perfetto needs to resolve interned ids. One rank of a
merged trace is one sequence, so a rank's interning table lives only while that rank is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Callable, Sequence

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

SLICE_BEGIN = pb.TrackEvent.TYPE_SLICE_BEGIN
SLICE_END = pb.TrackEvent.TYPE_SLICE_END
INSTANT = pb.TrackEvent.TYPE_INSTANT
COUNTER = pb.TrackEvent.TYPE_COUNTER

_STATE_CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
_NEEDS_STATE = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
_BATCH_PACKETS = 2048


class PacketStream(StreamingTraceProtoBuilder):
    """A streaming trace builder that writes its packets in batches of `batch_packets`."""

    def __init__(self, file: IO[bytes], *, batch_packets: int = _BATCH_PACKETS):
        super().__init__(file)
        self._batch = pb.Trace()
        self._add = self._batch.packet.add
        self._batch_packets = batch_packets
        self._pending = 0
        self.packets_written = 0

    def add_packet(self) -> pb.TracePacket:
        """A new packet, already part of the stream; fill it in before the next call."""
        if self._pending >= self._batch_packets:
            self.flush()
        self._pending += 1
        self.packets_written += 1
        return self._add()

    def write_packet(self, packet: pb.TracePacket) -> None:
        self.add_packet().CopyFrom(packet)

    def write_encoded(self, data: bytes | memoryview, packet_count: int) -> None:
        """Append packets already encoded as a `Trace` message (columnar.py), after the pending batch."""
        self.flush()
        self._file.write(data)
        self.packets_written += packet_count

    def flush(self) -> None:
        if self._pending:
            self._file.write(self._batch.SerializeToString())
            self._batch = pb.Trace()
            self._add = self._batch.packet.add
            self._pending = 0


class PacketCapture:
    """Stands in for a PacketStream so that a SequenceWriter's packets come back as bytes instead of
    going to the file: the columnar encoder lets the writer make its rare packets (new interned names,
    debug annotations) and splices them in between its own."""

    def __init__(self) -> None:
        self._packets: list[pb.TracePacket] = []

    def add_packet(self) -> pb.TracePacket:
        packet = pb.TracePacket()
        self._packets.append(packet)
        return packet

    def take(self) -> bytes:
        """The packets made since the last call, framed as fields of a `Trace` message."""
        trace = pb.Trace()
        trace.packet.extend(self._packets)
        self._packets.clear()
        return trace.SerializeToString()


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackSpec:
    """One track descriptor: a rank's process, a thread/stream/overlay track, or a counter."""

    uuid: int
    name: str
    parent_uuid: int | None = None
    pid: int | None = None
    """Set for process tracks only."""
    order: int | None = None
    """Position among the parent's children (or among processes)."""
    counter_unit: str | None = None
    """Set for counter tracks; the unit shown next to values (e.g. "ms", "%", "bytes")."""
    is_counter: bool = False
    description: str | None = None
    tid: int | None = None
    """Set for thread tracks only, with `pid` left None: the thread's id in the merged trace."""
    thread_pid: int | None = None
    """The pid of a thread track's process."""
    thread_name: str | None = None


@dataclass(kw_only=True, slots=True)
class SequenceWriter:
    """Packets of one trusted sequence, with interning of names, categories and annotation keys."""

    stream: PacketStream | PacketCapture
    sequence_id: int
    shown: Callable[[str], str] = str
    """How an interned string is written (the merge passes its one name bound: a 20 MB name stays a few KB)."""
    _names: dict[str, int] = field(default_factory=dict)
    _categories: dict[str, int] = field(default_factory=dict)
    _annotation_names: dict[str, int] = field(default_factory=dict)
    _started: bool = False

    @property
    def started(self) -> bool:
        """Whether the sequence's first packet (the one that clears incremental state) is written."""
        return self._started

    @property
    def name_iids(self) -> dict[str, int]:
        """Event name -> interned id so far (read only: interning happens in the packet that first uses it)."""
        return self._names

    @property
    def category_iids(self) -> dict[str, int]:
        """Category -> interned id so far (read only, as `name_iids`)."""
        return self._categories

    @property
    def annotation_name_iids(self) -> dict[str, int]:
        """Debug annotation name -> interned id so far (read only, as `name_iids`)."""
        return self._annotation_names

    def packet(self, timestamp_ns: int | None = None) -> pb.TracePacket:
        packet = self.stream.add_packet()
        packet.trusted_packet_sequence_id = self.sequence_id
        if timestamp_ns is not None:
            packet.timestamp = timestamp_ns
        if not self._started:
            packet.first_packet_on_sequence = True
            packet.sequence_flags = _STATE_CLEARED | _NEEDS_STATE
            self._started = True
        else:
            packet.sequence_flags = _NEEDS_STATE
        return packet

    def track(self, spec: TrackSpec) -> None:
        descriptor = self.packet().track_descriptor
        descriptor.uuid = spec.uuid
        descriptor.name = spec.name
        if spec.parent_uuid is not None:
            descriptor.parent_uuid = spec.parent_uuid
        if spec.pid is not None:
            descriptor.process.pid = spec.pid
            descriptor.process.process_name = spec.name
            descriptor.child_ordering = pb.TrackDescriptor.EXPLICIT
        if spec.tid is not None:
            descriptor.thread.pid = spec.thread_pid
            descriptor.thread.tid = spec.tid
            descriptor.thread.thread_name = spec.thread_name or spec.name
        if spec.order is not None:
            descriptor.sibling_order_rank = spec.order
        if spec.description:
            descriptor.description = spec.description
        if spec.is_counter:
            descriptor.counter.SetInParent()
            if spec.counter_unit:
                descriptor.counter.unit_name = spec.counter_unit

    def slice_begin(self, timestamp_ns: int, track_uuid: int, name: str, category: str,
                    *, flow_ids: Sequence[int] = (), terminating_flow_ids: Sequence[int] = (),
                    annotations: dict[str, object] | None = None) -> pb.TracePacket:
        packet = self.packet(timestamp_ns)
        event = packet.track_event
        event.type = SLICE_BEGIN
        event.track_uuid = track_uuid
        self._set_name(packet, name)
        if category:
            event.category_iids.append(self._intern(packet, self._categories, category))
        if flow_ids:
            event.flow_ids.extend(flow_ids)
        if terminating_flow_ids:
            event.terminating_flow_ids.extend(terminating_flow_ids)
        if annotations:
            self._annotate(packet, annotations)
        return packet

    def slice_end(self, timestamp_ns: int, track_uuid: int) -> None:
        """Ends use no interned data, so they skip the sequence flags (the most frequent packet; a
        sequence always starts with a descriptor or a begin, which carry the flags)."""
        packet = self.stream.add_packet()
        packet.trusted_packet_sequence_id = self.sequence_id
        packet.timestamp = timestamp_ns
        event = packet.track_event
        event.type = SLICE_END
        event.track_uuid = track_uuid

    def instant(self, timestamp_ns: int, track_uuid: int, name: str, category: str = "",
                *, annotations: dict[str, object] | None = None) -> None:
        packet = self.packet(timestamp_ns)
        packet.track_event.type = INSTANT
        packet.track_event.track_uuid = track_uuid
        self._set_name(packet, name)
        if category:
            packet.track_event.category_iids.append(self._intern(packet, self._categories, category))
        if annotations:
            self._annotate(packet, annotations)

    def counter(self, timestamp_ns: int, track_uuid: int, value: float) -> None:
        event = self.packet(timestamp_ns).track_event
        event.type = COUNTER
        event.track_uuid = track_uuid
        event.double_counter_value = value

    def _set_name(self, packet: pb.TracePacket, name: str) -> None:
        packet.track_event.name_iid = self._intern(packet, self._names, name)

    def _intern(self, packet: pb.TracePacket, table: dict[str, int], text: str) -> int:
        iid = table.get(text)
        if iid is None:
            iid = table[text] = len(table) + 1
            interned = packet.interned_data
            shown = self.shown(text)
            if table is self._names:
                interned.event_names.add(iid=iid, name=shown)
            elif table is self._categories:
                interned.event_categories.add(iid=iid, name=shown)
            else:
                interned.debug_annotation_names.add(iid=iid, name=shown)
        return iid

    def _annotate(self, packet: pb.TracePacket, annotations: dict[str, object]) -> None:
        for key, value in annotations.items():
            annotation = packet.track_event.debug_annotations.add()
            annotation.name_iid = self._intern(packet, self._annotation_names, key)
            set_annotation_value(annotation, value)


def set_annotation_value(annotation: pb.DebugAnnotation, value: object) -> None:
    """Store a JSON-like value (scalars, lists, dicts) in a debug annotation."""
    if isinstance(value, bool):
        annotation.bool_value = value
    elif isinstance(value, int) and -(2**63) <= value < 2**63:
        annotation.int_value = value
    elif isinstance(value, float):
        annotation.double_value = value
    elif isinstance(value, dict):
        for key, item in value.items():
            entry = annotation.dict_entries.add()
            entry.name = str(key)
            set_annotation_value(entry, item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            set_annotation_value(annotation.array_values.add(), item)
    else:
        annotation.string_value = str(value)


def write_preamble(stream: PacketStream, *, sequence_id: int, first_timestamp_ns: int) -> None:
    """Packets every merged trace starts with.

    A root track descriptor (uuid 0) with explicit process ordering, so the UI lists processes by
    their `sibling_order_rank` (the rank) rather than by its own heuristics; and a clock snapshot
    saying the trace clock equals wall-clock time, so the UI can show UTC timestamps.
    """
    root = stream.add_packet()
    root.trusted_packet_sequence_id = sequence_id
    root.track_descriptor.uuid = 0
    root.track_descriptor.process_ordering = pb.TrackDescriptor.PROCESS_ORDERING_EXPLICIT
    snapshot = stream.add_packet()
    snapshot.trusted_packet_sequence_id = sequence_id
    snapshot.timestamp = first_timestamp_ns
    for clock_id in (pb.BUILTIN_CLOCK_BOOTTIME, pb.BUILTIN_CLOCK_REALTIME):
        snapshot.clock_snapshot.clocks.add(clock_id=clock_id, timestamp=first_timestamp_ns)
    snapshot.clock_snapshot.primary_trace_clock = pb.BUILTIN_CLOCK_BOOTTIME
