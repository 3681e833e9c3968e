"""One rank's Kineto trace as a columnar event table (numpy arrays plus a string table).

Only complete events (`"ph": "X"`) are kept; they are what every analysis here uses. Names are
interned into `names` and referenced by `name_id`, so classifying events is done once per distinct
name, not once per event. Timestamps stay in the trace's own clock (microseconds relative to
`base_time_ns`), which keeps float64 precision at the sub-microsecond level.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

import msgspec
import numpy as np
from fleetscope.traces.validate import MAX_NAME_CHARS, bounded_name
from fleetscope.traces.kineto_schema import (
    ABSENT,
    COMPLETE,
    CPU_OP_CATEGORY,
    GPU_ACTIVITY_CATEGORIES,
    GPU_ACTIVITY_KINDS,
    GPU_TRACK_CATEGORIES,
    GPU_TRACK_KIND_CODES,
    HOST_CATEGORIES_BY_KIND,
    INT64_MAX,
    KIND_CODE_OF_CATEGORY,
    METADATA,
    MISSING_DURATION_US,
    PARSE_COMPLETE_TYPES,
    PARSE_OTHER_PHASES,
    TIME_LIMIT_US,
    Kind,
    ParseArgs,
    ParseComplete,
    ParseDocument,
    ParseDocumentWithShapes,
    ParseMetadata,
    UnknownPhaseEvent,
    metadata_value,
    time_problem,
)
from fleetscope.analysis.per_rank.names import (
    ALL_TO_ALL_BASE_OP,
    CONCRETE_INPUTS_ARG,
    GEMM_OP_OPERANDS,
    is_kept_host_op,
    process_group_label,
)

__all__ = ["ABSENT", "GPU_ACTIVITY_KINDS", "GPU_TRACK_CATEGORIES", "HOST_CATEGORIES_BY_KIND", "Kind"]
"""Defined by the schema (traces/kineto_schema.py, as are the phases and event Structs); the analysis reads
them from here, with the table."""
_KIND_CODE, _GPU_TRACK_CODES, _GPU_CATEGORY_NAMES = KIND_CODE_OF_CATEGORY, GPU_TRACK_KIND_CODES, GPU_ACTIVITY_CATEGORIES
NO_ID = -1


LONG_HOST_OP_US = 1000.0
"""A host op's call at least this long is kept (TraceEvents.long_host_ops) where a GPU trace's table leaves the op
out: a millisecond inside one call is the host held by that op (a plan built, an autotune, a setup for a new
shape), and there are few such calls."""


@dataclass(frozen=True, kw_only=True)
class HostOpCalls:
    """Calls of host ops: each one's name, span and thread (the table's thread key)."""

    names: list[str]
    start_us: np.ndarray
    end_us: np.ndarray
    thread: np.ndarray


@dataclass(frozen=True, kw_only=True)
class TraceEvents:
    """Complete events of one trace, one row per event, sorted by start time."""

    names: list[str]
    """String table: `names[name_id[i]]` is the name of event i."""
    thread_names: dict[int, str]
    """Thread key -> thread name from the trace's metadata (may be empty)."""
    name_id: np.ndarray
    kind: np.ndarray
    """`Kind` codes (int8)."""
    start_us: np.ndarray
    dur_us: np.ndarray
    thread: np.ndarray
    """CPU thread key (the trace's tid) or, for GPU activity, the stream."""
    device: np.ndarray
    """GPU device index for GPU activity, -1 for host events."""
    correlation: np.ndarray
    """CUDA correlation id linking a launch to its GPU activity, -1 when absent."""
    groups: list[str] = field(default_factory=list)
    """String table of process groups (`names.process_group_label`)."""
    group_id: np.ndarray | None = None
    """Index into `groups` of each event's process group, -1 when the event names none; None when no
    event does (traces without the args: gloo, older PyTorch)."""
    messages: list[tuple] = field(default_factory=list)
    """Table of distinct collective message descriptions (`comm_bytes.MESSAGE_FIELDS` order: collective
    name, in/out element counts, dtype, group size) read from the args NCCL kernels and
    `record_param_comms` carry."""
    message_id: np.ndarray | None = None
    """Index into `messages` of each event's message, -1 where the event has none; None when no event
    has one (gloo traces, older PyTorch)."""
    op_of_external: dict[int, str] = field(default_factory=dict)
    """GPU traces: `External id` -> name of the host op (`cpu_op`) carrying it, for every host op, also the
    ones left out of the table: a kernel's `External id` names the innermost op that launched it."""
    external_id: np.ndarray | None = None
    """GPU traces: each event's `External id` (GPU activity only), -1 where none; None on CPU traces."""
    launch_shapes: list[str] = field(default_factory=list)
    """String table of kernel launch shapes ("grid [x, y, z] block [x, y, z]", from the kernel's args)."""
    launch_shape_id: np.ndarray | None = None
    """Index into `launch_shapes` of each kernel's launch shape, -1 where none; None when no kernel has one
    (CPU traces, traces without the args). Same name and shape is the same work (cross_rank/causes.py)."""
    copy_bytes: np.ndarray | None = None
    """Bytes each GPU copy (`gpu_memcpy`) moved, from its `bytes` arg, -1 where none; None when no copy has one."""
    sequence: np.ndarray | None = None
    """Each event's process-group sequence number (names.SEQUENCE_ARG, on NCCL kernels and
    `record_param_comms` of newer PyTorch), -1 where none; None when no event has one."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Events left out, by reason (negative duration, non-numeric time)."""
    host_pid: int | None = None
    """The process id of the trace's first host event (its `pid`): windows of one process share it."""
    omitted_host_ops: int = 0
    """`cpu_op` events not kept because the trace holds GPU activity: GPU-basis metrics never read host
    ops other than collectives and tensor reads (names.is_kept_host_op, which are kept), and they are most
    of a GPU trace's events."""
    gemm_input_types: dict[int, str] = field(default_factory=dict)
    """GPU traces with record_shapes: External id -> the numeric type of a GEMM op's inputs (`Input type`, the
    first two tensors' when they agree: "c10::BFloat16", "float", ...), what its kernels compute where their
    names do not say (step_work._op_precision)."""
    omitted_host_op_start_us: np.ndarray | None = None
    """The start of each of those ops (sorted; those with a numeric time): the profiler recorded them, each at a
    cost of its own (steps.py StepTiming.host_events counts them). None where none was left out."""
    long_host_ops: HostOpCalls | None = None
    """Of those ops, the calls that lasted at least LONG_HOST_OP_US: what the host was inside while the GPU waited
    (host_stalls.py op_held_idle_us). None where none was left out."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """What the analyses ask of the table again and again (end_us, of_kind, names_matching, the launch calls'
    order), computed once a table."""

    def __len__(self) -> int:
        return int(self.start_us.size)

    @property
    def end_us(self) -> np.ndarray:
        """Read-only: computed once a table (the analyses read it ~80 times a rank)."""
        end = self._memo.get("end_us")
        if end is None:
            end = self._memo["end_us"] = self.start_us + self.dur_us
            end.flags.writeable = False
        return end

    def names_matching(self, predicate) -> np.ndarray:
        """Boolean mask over events whose name satisfies `predicate(name)`. The mask of a module-level function
        (a name rule of names.py: a pure function of the name) is kept for the table's other readers."""
        rule = isinstance(predicate, FunctionType) and "<" not in predicate.__qualname__
        key = ("names", predicate) if rule else None
        mask = self._memo.get(key) if key is not None else None
        if mask is None:
            by_id = np.fromiter(map(bool, map(predicate, self.names)), dtype=bool, count=len(self.names))
            ids_key = ("name ids", by_id.tobytes())  # rules that pick the same names pick the same events
            mask = self._memo.get(ids_key)
            if mask is None:
                # most rules match no name of a trace: then no pass over the events
                mask = by_id[self.name_id] if by_id.any() else np.zeros(len(self), dtype=bool)
                self._memo[ids_key] = mask
            if key is not None:
                self._memo[key] = mask
        return mask.copy()

    def of_kind(self, *kinds: Kind) -> np.ndarray:
        # a lookup table over the int8 codes: several times faster than np.isin; called ~120 times a rank with
        # a dozen distinct sets, so each set's mask is kept (a copy is returned: callers may change theirs)
        key = ("kind", kinds)
        mask = self._memo.get(key)
        if mask is None:
            wanted = np.zeros(256, dtype=bool)
            wanted[np.asarray(kinds, dtype=np.int8).view(np.uint8)] = True
            mask = self._memo[key] = wanted[np.asarray(self.kind, dtype=np.int8).view(np.uint8)]
        return mask.copy()

    def launch_start_us(self, selected: np.ndarray) -> np.ndarray:
        """For the selected GPU events, when the host launched them (the `cuda_runtime` event with the
        same correlation id); their own start where no launch is recorded."""
        return self._of_launch(selected, self.start_us, self.start_us[selected])

    def launch_end_us(self, selected: np.ndarray) -> np.ndarray:
        """For the selected GPU events, when their launch call returned; their own start where no launch
        is recorded."""
        return self._of_launch(selected, self.end_us, self.start_us[selected])

    def launch_thread(self, selected: np.ndarray) -> np.ndarray:
        """For the selected GPU events, the host thread of their launch call; NO_ID where none is recorded."""
        return self._of_launch(selected, self.thread, np.full(int(np.count_nonzero(selected)), NO_ID, dtype=np.int64))

    def _of_launch(self, selected: np.ndarray, column: np.ndarray, default: np.ndarray) -> np.ndarray:
        """`column` of each selected GPU event's launch call (matched by correlation id), else `default`."""
        launches, launch_ids = self._launches_by_correlation()
        if not launch_ids.size:
            return default
        values = column[launches]
        wanted = self.correlation[selected]
        slot = np.clip(np.searchsorted(launch_ids, wanted), 0, launch_ids.size - 1)
        found = (launch_ids[slot] == wanted) & (wanted != NO_ID)
        return np.where(found, values[slot], default)

    def _launches_by_correlation(self) -> tuple[np.ndarray, np.ndarray]:
        """(the rows of launch calls with a correlation id, ordered by it (stable), their ids in that order)."""
        found = self._memo.get("launches")
        if found is None:
            launches = np.flatnonzero(self.of_kind(Kind.CUDA_RUNTIME) & (self.correlation != NO_ID))
            launches = launches[np.argsort(self.correlation[launches], kind="stable")]
            found = self._memo["launches"] = (launches, self.correlation[launches])
        return found

    def message_of(self, index: int) -> tuple | None:
        """The message description of event `index` (see `messages`), when the trace records one."""
        if self.message_id is None or self.message_id[index] == NO_ID:
            return None
        return self.messages[self.message_id[index]]

    def sequence_of(self, indices: np.ndarray) -> np.ndarray:
        """The sequence numbers of the events at `indices` (-1 where the trace records none)."""
        if self.sequence is None:
            return np.full(indices.size, NO_ID, dtype=np.int64)
        return self.sequence[indices]

    def group_of(self, index: int) -> str | None:
        """The process group event `index` ran on, when the trace says."""
        if self.group_id is None or self.group_id[index] == NO_ID:
            return None
        return self.groups[self.group_id[index]]

    @property
    def has_gpu_activity(self) -> bool:
        return bool(self.of_kind(*GPU_ACTIVITY_KINDS).any())


_ARG_KEYS = dict(zip(ParseArgs.__struct_fields__, ParseArgs.__struct_encode_fields__))
"""Attribute name -> the key it is read from in a trace's `args`."""
_OTHER_PHASE_CLASS = {cls.ph: cls for cls in PARSE_OTHER_PHASES}
COMPLETE_EVENT_TYPES = PARSE_COMPLETE_TYPES

_DECODER = msgspec.json.Decoder(ParseDocument)
_DECODER_WITH_SHAPES = msgspec.json.Decoder(ParseDocumentWithShapes)
_SHAPE_MARKERS = (ALL_TO_ALL_BASE_OP.encode(), CONCRETE_INPUTS_ARG.encode())
TRACE_METADATA_KEYS = ("distributedInfo", "baseTimeNanoseconds", "host_name", "deviceProperties")


def decode_selectively(data: bytes) -> tuple[dict[str, Any], list[Any]] | None:
    """(metadata, events) of a trace's JSON bytes, decoding only the fields the analysis reads.

    None when this fast decoder cannot take the file (other shapes, integers beyond 64 bits, invalid
    UTF-8, invalid JSON, deep nesting): the generic parser then decides, and explains what is wrong."""
    decoder = _DECODER_WITH_SHAPES if all(marker in data for marker in _SHAPE_MARKERS) else _DECODER
    try:
        document = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return {key: metadata_value(document, key) for key in TRACE_METADATA_KEYS}, document.traceEvents


def events_from_document(document: dict[str, Any]) -> tuple[list[Any], int]:
    """Generic path: the events of an already parsed document as the fast decoder's classes, and how many
    were not JSON objects."""
    events, skipped = [], 0
    for raw in document["traceEvents"]:
        if not isinstance(raw, dict):
            skipped += 1
            continue
        events.append(_event_of(raw))
    return events, skipped


def _event_of(raw: dict[str, Any]) -> Any:
    phase, name, cat = raw.get("ph"), raw.get("name"), raw.get("cat")
    if phase == COMPLETE or phase == METADATA:
        args = raw.get("args")
        args = ParseArgs(**{field: args.get(key) for field, key in _ARG_KEYS.items()}) if isinstance(args, dict) else None
        if phase == METADATA:
            return ParseMetadata(name=name, cat=cat, tid=raw.get("tid"), args=args)
        return ParseComplete(name=name, cat=cat, ts=raw.get("ts"), dur=raw.get("dur", MISSING_DURATION_US),
                             pid=raw.get("pid"), tid=raw.get("tid"), args=args)
    other = _OTHER_PHASE_CLASS.get(phase, UnknownPhaseEvent) if type(phase) is str else UnknownPhaseEvent
    return other(name=name, cat=cat)


def extract_events(document: dict[str, Any]) -> TraceEvents:
    """Build the event table of a parsed Kineto trace document."""
    events, skipped = events_from_document(document)
    table = build_table(events)
    if skipped:
        table.dropped["not a JSON object"] = skipped
    return table


def build_table(events: list[Any], *, names_seen: set[str] | None = None) -> TraceEvents:
    """The columnar table of decoded events, built in one pass that judges every value.

    This loop is the hot path of the whole analysis (every event of every rank), hence plain int codes,
    inlined type checks and local names. (Measured: one list comprehension per column, checked with
    numpy, was slower, as it walks every event once per column.) `names_seen`, when given, receives the
    name of every event that has a string name, of any phase, kept or not (what gather's identity reads),
    at the price of the lookups the loop makes anyway.
    """
    collect = names_seen is not None
    seen = names_seen.add if collect else None
    dropped_names: list[str] = []
    name_index: dict[str, int] = {}
    name_ids, kinds, starts, durs, threads, devices, correlations = [], [], [], [], [], [], []
    thread_names: dict[int, str] = {}
    dropped: dict[str, int] = {}
    code_of, gpu_codes, other, limit, int_limit = _KIND_CODE.get, _GPU_TRACK_CODES, int(Kind.OTHER), TIME_LIMIT_US, INT64_MAX
    # Kineto writes device activity after host events: looking from the end finds it at once
    skip_host_ops = any(type(event.cat) is str and event.cat in _GPU_CATEGORY_NAMES for event in reversed(events))
    host_op_kept: dict[str, bool] = {}
    omitted = 0
    omitted_starts: list[float] = []
    long_calls: list[tuple[str, float, float, Any]] = []
    group_index: dict[tuple, int] = {}
    grouped_rows: list[tuple[int, int]] = []
    message_index: dict[tuple, int] = {}
    message_rows: list[tuple[int, int]] = []
    op_of_external: dict[int, str] = {}
    external_rows: list[tuple[int, int]] = []
    dims_of_external: dict[int, Any] = {}
    types_of_external: dict[int, Any] = {}
    shape_index: dict[str, int] = {}
    shape_slots: dict[tuple, int | None] = {}
    shape_rows: list[tuple[int, int]] = []
    sequence_rows: list[tuple[int, int]] = []
    copy_rows: list[tuple[int, int]] = []
    kernel_code, copy_code = int(Kind.KERNEL), int(Kind.GPU_MEMCPY)
    complete, cpu_op = COMPLETE, CPU_OP_CATEGORY
    host_pid = None
    for event in events:
        if event.ph != complete:
            if collect and type(event.name) is str:
                seen(event.name)
            if event.ph == METADATA and event.name == "thread_name":
                _add_thread_name(thread_names, event)
            continue
        if skip_host_ops and event.cat == cpu_op:
            name = event.name
            external = event.args.external_id if event.args is not None else None
            if type(external) is int and type(name) is str:
                op_of_external[external] = name if len(name) <= MAX_NAME_CHARS and name.isascii() else bounded_name(name)
                if event.args.input_dims:
                    dims_of_external[external] = event.args.input_dims
                if name in GEMM_OP_OPERANDS and event.args.input_type:
                    types_of_external[external] = event.args.input_type
            kept = host_op_kept.get(name) if type(name) is str else False
            if kept is None:
                kept = host_op_kept[name] = is_kept_host_op(name)
            if not kept:
                omitted += 1
                start = event.ts
                if type(start) is float and -limit < start < limit:
                    omitted_starts.append(start)
                    if type(event.dur) is float and LONG_HOST_OP_US <= event.dur < limit and type(name) is str:
                        long_calls.append((name, start, event.dur, event.tid))
                continue
        start, dur = event.ts, event.dur
        if not (type(start) is float and type(dur) is float and 0.0 <= dur < limit and -limit < start < limit):
            if dur is ABSENT:
                dur = MISSING_DURATION_US
            problem = time_problem(start, dur)
            if problem:
                dropped[problem] = dropped.get(problem, 0) + 1
                if collect and type(event.name) is str:
                    dropped_names.append(event.name)
                continue
        name = event.name
        name_id = name_index.get(name) if type(name) is str else None
        if name_id is None:
            name = name if type(name) is str else str(name)
            name_id = name_index.setdefault(name, len(name_index))
        cat = event.cat
        kind = code_of(cat, other) if type(cat) is str else other
        args = event.args
        name_ids.append(name_id)
        kinds.append(kind)
        starts.append(start)
        durs.append(dur)
        if kind in gpu_codes:
            if args is not None and type(args.external_id) is int and -int_limit <= args.external_id <= int_limit:
                external_rows.append((len(name_ids) - 1, args.external_id))
            if kind == kernel_code and args is not None and args.grid is not None:
                dims = dims_of_external.get(args.external_id) if type(args.external_id) is int else None
                _note_launch_shape(args, dims, len(name_ids) - 1, shape_index, shape_rows, shape_slots)
            elif kind == copy_code and args is not None and type(args.copy_bytes) is int \
                    and 0 <= args.copy_bytes <= int_limit:
                copy_rows.append((len(name_ids) - 1, args.copy_bytes))
            # the stream and device from args where they are ints, else the tid and pid (_int_or, _device_or)
            stream, device = (args.stream, args.device) if args is not None else (None, None)
            threads.append(stream if type(stream) is int and -int_limit <= stream <= int_limit
                           else _int_or(event.tid, NO_ID))
            devices.append(device if type(device) is int and -_INT32_MAX <= device <= _INT32_MAX
                           else _device_or(event.pid, 0))
        else:
            tid = event.tid
            threads.append(tid if type(tid) is int and -int_limit <= tid <= int_limit else _thread_key(tid))
            devices.append(NO_ID)
            if host_pid is None and type(event.pid) is int and 0 <= event.pid <= int_limit:
                host_pid = event.pid
        correlation = args.correlation if args is not None else None
        correlations.append(correlation if type(correlation) is int and -int_limit <= correlation <= int_limit
                            else NO_ID)
        if args is not None and args.group_name is not None:
            _note_group(args, len(name_ids) - 1, group_index, grouped_rows)
            sequence = args.sequence
            if type(sequence) is int and 0 <= sequence <= int_limit:
                sequence_rows.append((len(name_ids) - 1, sequence))
        if args is not None and args.in_nelems is not None:
            _note_message(args, len(name_ids) - 1, message_index, message_rows)
        elif name == ALL_TO_ALL_BASE_OP and args is not None and getattr(args, "concrete_inputs", None):
            _note_host_all_to_all(args, len(name_ids) - 1, message_index, message_rows)
    if collect:
        # every other string name is a key of these (a non-string name interned as its str() is never a step
        # marker, all gather looks for)
        names_seen.update(name_index, host_op_kept, dropped_names)
    groups = _group_column(group_index, grouped_rows, len(name_ids)) if grouped_rows else None
    messages = _message_column(message_index, message_rows, len(name_ids)) if message_rows else None
    table = _to_table(name_index, name_ids, kinds, starts, durs, threads, devices, correlations,
                      thread_names, dropped, groups, messages)
    if skip_host_ops:
        table = _with_externals(table, starts, op_of_external, external_rows, len(name_ids))
        if types_of_external:
            table = dataclasses.replace(table, gemm_input_types=_gemm_input_types(types_of_external))
    if shape_rows:
        table = _with_launch_shapes(table, starts, shape_index, shape_rows, len(name_ids))
    if sequence_rows:
        table = _with_sequence(table, starts, sequence_rows, len(name_ids))
    if copy_rows:
        table = dataclasses.replace(table, copy_bytes=_sorted_column(starts, copy_rows, len(name_ids)))
    if host_pid is not None:
        table = dataclasses.replace(table, host_pid=host_pid)
    if not omitted:
        return table
    return dataclasses.replace(table, omitted_host_ops=omitted,
                               omitted_host_op_start_us=np.sort(np.asarray(omitted_starts, dtype=np.float64)),
                               long_host_ops=_host_op_calls(long_calls))


def _host_op_calls(calls: list[tuple[str, float, float, Any]]) -> HostOpCalls | None:
    """The calls as columns (names bounded as the table's are), threads keyed as the table keys them."""
    if not calls:
        return None
    limit = INT64_MAX
    return HostOpCalls(
        names=[name if len(name) <= MAX_NAME_CHARS and name.isascii() else bounded_name(name) for name, *_ in calls],
        start_us=np.array([start for _, start, _, _ in calls], dtype=np.float64),
        end_us=np.array([start + dur for _, start, dur, _ in calls], dtype=np.float64),
        thread=np.array([tid if type(tid) is int and -limit <= tid <= limit else _thread_key(tid)
                         for *_, tid in calls], dtype=np.int64))


def _note_group(args: ParseArgs, row: int, group_index: dict[tuple, int], grouped_rows: list[tuple[int, int]]) -> None:
    """Record event `row`'s process group (few events carry one: communication kernels and ops)."""
    if type(args.group_name) not in (str, int):
        return
    description = args.group_description if type(args.group_description) is str else None
    identity = (args.group_name, description)
    index = group_index.get(identity)
    if index is None:
        if process_group_label(*identity) is None:
            return
        index = group_index.setdefault(identity, len(group_index))
    grouped_rows.append((row, index))


def _note_message(args: ParseArgs, row: int, index: dict[tuple, int], rows: list[tuple[int, int]]) -> None:
    """Record event `row`'s collective message (in/out element counts, dtype, group size, split sizes)."""
    identity = (_str_or_none(args.collective), _int_or(args.in_nelems, NO_ID), _int_or(args.out_nelems, NO_ID),
                _str_or_none(args.dtype), _int_or(args.group_size, NO_ID), _split_text(args.in_split),
                _split_text(args.out_split))
    if identity[1] == NO_ID and identity[2] == NO_ID:
        return
    rows.append((row, index.setdefault(identity, len(index))))


HOST_TYPE_NAMES = {"float": "Float", "double": "Double", "c10::Half": "Half", "c10::BFloat16": "BFloat16",
                   "long int": "Long", "int": "Int", "short int": "Short", "signed char": "Char",
                   "unsigned char": "Byte", "bool": "Bool"}
"""Host op `Input type` names (C++ type names) -> the dtype names of NCCL args (comm_bytes.DTYPE_BYTES)."""


def _note_host_all_to_all(args: ParseArgs, row: int, index: dict[tuple, int], rows: list[tuple[int, int]]) -> None:
    """Record a c10d::alltoall_base_ op's message from its record_shapes args: output and input tensors'
    dims and type, output and input split sizes (names.ALL_TO_ALL_BASE_OP); nothing where they do not parse."""
    try:
        concrete, dims, types = (msgspec.json.decode(raw) if isinstance(raw, msgspec.Raw) else raw
                                 for raw in (args.concrete_inputs, args.input_dims, args.input_type))
    except msgspec.DecodeError:
        return
    if not (isinstance(concrete, list) and isinstance(dims, list) and isinstance(types, list)
            and len(concrete) >= 5 and len(dims) >= 2 and len(types) >= 2):
        return
    sizes = [_elements(d) for d in dims[:2]]
    dtype = HOST_TYPE_NAMES.get(types[1]) if isinstance(types[1], str) else None
    out_split, in_split = _split_text(concrete[3]), _split_text(concrete[4])
    if None in sizes or dtype is None or in_split is None or out_split is None:
        return
    members = in_split.count(",") + 1 if in_split.strip("[] ") else NO_ID
    identity = ("all_to_all", sizes[1], sizes[0], dtype, members, in_split, out_split)
    rows.append((row, index.setdefault(identity, len(index))))


def _elements(dims: Any) -> int | None:
    if not isinstance(dims, list) or not all(type(d) is int and d >= 0 for d in dims):
        return None
    count = 1
    for d in dims:
        count *= d
    return count


def _split_text(value: Any) -> str | None:
    """A split-size arg as text: Kineto writes "[3, 4]" (a JSON string); a list is taken as written."""
    if type(value) is str:
        return value
    if type(value) is list:
        return "[" + ", ".join(str(v) for v in value) + "]"
    return None


def _message_column(index: dict[tuple, int], rows: list[tuple[int, int]], count: int) -> tuple[list[tuple], np.ndarray]:
    """(message table, message index per row in parse order, -1 where none)."""
    messages: list[tuple] = [()] * len(index)
    for identity, slot in index.items():
        messages[slot] = identity
    column = np.full(count, NO_ID, dtype=np.int32)
    parsed_rows, slots = zip(*rows)
    column[list(parsed_rows)] = slots
    return messages, column


def _note_launch_shape(args: ParseArgs, op_dims: Any, row: int, index: dict[str, int], rows: list[tuple[int, int]],
                       slots: dict[tuple, int | None]) -> None:
    """Record kernel `row`'s launch shape: its grid and block (three non-negative ints each) and, where the
    trace has record_shapes, its launching op's input shapes (a persistent GEMM keeps its grid whatever the
    sizes: the shapes tell a bigger GEMM apart). A trace launches a few hundred distinct shapes over tens of
    thousands of kernels: each distinct (grid, block, inputs) is labelled once, through `slots`."""
    key = _shape_key(args.grid, args.block, op_dims)
    try:
        slot = slots.get(key, _UNSEEN) if key is not None else _UNSEEN
    except TypeError:  # an unhashable value inside the grid or block (a hostile file): labelled without the memo
        key, slot = None, _UNSEEN
    if slot is _UNSEEN:
        slot = _shape_slot(args, op_dims, index)
        if key is not None:
            slots[key] = slot
    if slot is not None:
        rows.append((row, slot))


_UNSEEN = object()


def _shape_key(grid: Any, block: Any, op_dims: Any) -> tuple | None:
    """A hashable key of what a launch shape's label is made of (None: not hashable as decoded: no memo)."""
    if type(grid) is not list or (block is not None and type(block) is not list):
        return None
    if op_dims is None or isinstance(op_dims, msgspec.Raw):
        dims = bytes(op_dims) if op_dims is not None else None
    else:
        return None  # the generic decoder's nested lists: labelled each time (a rare path)
    return (tuple(grid), tuple(block) if block is not None else None, dims)


def _shape_slot(args: ParseArgs, op_dims: Any, index: dict[str, int]) -> int | None:
    grid, block = _dims_text(args.grid), _dims_text(args.block)
    if grid is None:
        return None
    label = f"grid {grid}" + (f" block {block}" if block is not None else "")
    inputs = _input_dims_text(op_dims)
    if inputs:
        label += f" inputs {inputs}"
    return index.setdefault(label, len(index))


_INPUT_DIMS_LIMIT = 512
"""Bytes of an op's Input Dims kept in a label: enough for any GEMM's shapes; a longer list is cut, as it only
needs to tell launches apart."""


def _input_dims_text(value: Any) -> str:
    """An op's `Input Dims` as compact text ("" when absent or not a list): Raw from the fast decoder, the
    parsed value from the generic one."""
    if isinstance(value, msgspec.Raw):
        text = bytes(value)
        if not text.startswith(b"["):
            return ""
        return text[:_INPUT_DIMS_LIMIT].decode("utf-8", "replace").replace(" ", "")
    if type(value) is list:
        try:
            return msgspec.json.encode(value)[:_INPUT_DIMS_LIMIT].decode("utf-8", "replace")
        except (TypeError, OverflowError):
            return ""
    return ""


def _dims_text(value: Any) -> str | None:
    if type(value) is not list or not 1 <= len(value) <= 3 or not all(type(v) is int and 0 <= v < 1 << 32 for v in value):
        return None
    return "[" + ", ".join(str(v) for v in value) + "]"


def _with_launch_shapes(table: TraceEvents, starts: list, index: dict[str, int], rows: list[tuple[int, int]],
                        count: int) -> TraceEvents:
    """The table with its launch shape column (kernels), sorted like the other columns."""
    labels = [""] * len(index)
    for label, slot in index.items():
        labels[slot] = label
    column = np.full(count, NO_ID, dtype=np.int32)
    parsed_rows, slots = zip(*rows)
    column[list(parsed_rows)] = slots
    order = np.argsort(np.asarray(starts, dtype=np.float64), kind="stable")
    return dataclasses.replace(table, launch_shapes=labels, launch_shape_id=column[order])


def _with_sequence(table: TraceEvents, starts: list, rows: list[tuple[int, int]], count: int) -> TraceEvents:
    """The table with its sequence number column (events naming a process group), sorted like the others."""
    return dataclasses.replace(table, sequence=_sorted_column(starts, rows, count))


def _sorted_column(starts: list, rows: list[tuple[int, int]], count: int) -> np.ndarray:
    """An int64 column of (parsed row, value) pairs, NO_ID elsewhere, in the table's (start time) order."""
    column = np.full(count, NO_ID, dtype=np.int64)
    parsed_rows, values = zip(*rows)
    column[list(parsed_rows)] = values
    order = np.argsort(np.asarray(starts, dtype=np.float64), kind="stable")
    return column[order]


def _with_externals(table: TraceEvents, starts: list, op_of_external: dict[int, str],
                    rows: list[tuple[int, int]], count: int) -> TraceEvents:
    """The table with its External id column (GPU events), sorted like the other columns."""
    column = np.full(count, NO_ID, dtype=np.int64)
    if rows:
        parsed_rows, ids = zip(*rows)
        column[list(parsed_rows)] = ids
    order = np.argsort(np.asarray(starts, dtype=np.float64), kind="stable")
    return dataclasses.replace(table, op_of_external=op_of_external, external_id=column[order])


def _gemm_input_types(types_of_external: dict[int, Any]) -> dict[int, str]:
    """External id -> the one type a GEMM op's first two tensor inputs share; ops whose types do not parse or
    differ are left out. One decode per distinct raw value (a model repeats a handful)."""
    decoded: dict[bytes, str | None] = {}
    found: dict[int, str] = {}
    for external, raw in types_of_external.items():
        key = bytes(raw) if isinstance(raw, msgspec.Raw) else None
        value = decoded.get(key) if key is not None and key in decoded else _shared_type(raw)
        if key is not None:
            decoded[key] = value
        if value is not None:
            found[external] = value
    return found


def _shared_type(raw: Any) -> str | None:
    try:
        types = msgspec.json.decode(raw) if isinstance(raw, msgspec.Raw) else raw
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(types, list):
        return None
    tensors = [t for t in types if isinstance(t, str) and t]
    if len(tensors) < 2 or len(set(tensors[:2])) != 1 or len(tensors[0]) > 64:
        return None
    return tensors[0]


def _str_or_none(value: Any) -> str | None:
    return value if type(value) is str else None


def _group_column(group_index: dict[tuple, int], grouped_rows: list[tuple[int, int]],
                  rows: int) -> tuple[list[str], np.ndarray]:
    """(labels, group index per row in parse order, -1 where none)."""
    labels = [""] * len(group_index)
    for identity, index in group_index.items():
        labels[index] = process_group_label(*identity)
    column = np.full(rows, NO_ID, dtype=np.int32)
    grouped, indices = zip(*grouped_rows)
    column[list(grouped)] = indices
    return labels, column


def _add_thread_name(thread_names: dict[int, str], event: Any) -> None:
    name = event.args.name if event.args else None
    if isinstance(name, str):
        key = _thread_key(event.tid)
        # Kineto may name a thread twice ("python3" and "pt_gloo_runloop"): keep the specific one.
        if key not in thread_names or thread_names[key].endswith(("(python3)", "(python)")):
            thread_names[key] = bounded_name(name)


def _to_table(name_index, name_ids, kinds, starts, durs, threads, devices, correlations,
              thread_names, dropped, groups: tuple[list[str], np.ndarray] | None = None,
              messages: tuple[list[tuple], np.ndarray] | None = None) -> TraceEvents:
    start = np.asarray(starts, dtype=np.float64)
    order = np.argsort(start, kind="stable")
    names = [""] * len(name_index)
    for name, index in name_index.items():
        names[index] = bounded_name(name)
    return TraceEvents(
        names=names,
        thread_names=thread_names,
        name_id=np.asarray(name_ids, dtype=np.int32)[order],
        kind=np.asarray(kinds, dtype=np.int8)[order],
        start_us=start[order],
        dur_us=np.asarray(durs, dtype=np.float64)[order],
        thread=np.asarray(threads, dtype=np.int64)[order],
        device=np.asarray(devices, dtype=np.int32)[order],
        correlation=np.asarray(correlations, dtype=np.int64)[order],
        groups=groups[0] if groups else [],
        group_id=groups[1][order] if groups else None,
        messages=messages[0] if messages else [],
        message_id=messages[1][order] if messages else None,
        dropped=dropped,
    )


def _int_or(value: Any, default: int) -> int:
    """`value` if it is an int that fits int64 (bools excluded), else `default`."""
    if type(value) is int and -INT64_MAX <= value <= INT64_MAX:
        return value
    return default


def _device_or(value: Any, default: int) -> int:
    """`value` if it is an int that fits the device column (int32; bools excluded), else `default`."""
    if type(value) is int and -_INT32_MAX <= value <= _INT32_MAX:
        return value
    return default


_INT32_MAX = 2**31 - 1


def _thread_key(tid: Any) -> int:
    """Kineto tids are ints, or strings for its own pseudo-threads; strings get a stable negative key."""
    if type(tid) is int and -INT64_MAX <= tid <= INT64_MAX:
        return tid
    return -zlib.crc32(str(tid).encode()) - 2
