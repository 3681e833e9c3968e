"""The Kineto (torch.profiler) trace format as fleetscope decodes it: the one definition of an event's fields,
the document's metadata, the phase letters, the duration rule and the categories.

Every decoder of a trace decodes with a Struct declared here: gather's identity (traces/kineto.py), the per-rank
parse (analysis/per_rank/events.py), HTA's frames (hta_native.py, hta_frame.py) and the merge
(merge/window_decode.py). They select different fields on purpose (msgspec builds only the fields a Struct
names, so each reader pays only for what it reads): each selection is a named variant below, not a definition
of its own. tests/test_traces_one_decoder_schema.py keeps it that way.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Union

import msgspec

# --- arg keys (`args`) the analysis reads ----------------------------------------------------------

PROCESS_GROUP_NAME_ARG = "Process Group Name"
PROCESS_GROUP_DESCRIPTION_ARG = "Process Group Description"
"""Kineto args naming the process group of a collective (on NCCL kernels and `record_param_comms`)."""
EXTERNAL_ID_ARG = "External id"
"""Kineto's link from GPU activity (and its launch) to the host op that launched it."""
COLLECTIVE_NAME_ARG = "Collective name"
IN_NELEMS_ARG = "In msg nelems"
OUT_NELEMS_ARG = "Out msg nelems"
DTYPE_ARG = "dtype"
GROUP_SIZE_ARG = "Group size"
IN_SPLIT_ARG = "In split size"
OUT_SPLIT_ARG = "Out split size"
CONCRETE_INPUTS_ARG, INPUT_DIMS_ARG, INPUT_TYPE_ARG = "Concrete Inputs", "Input Dims", "Input type"
"""Host op args of traces with record_shapes: c10d::alltoall_base_ lists its split sizes there (gloo and
every backend), as `c10d::alltoall_base_(output, input, group, output_split_sizes, input_split_sizes, ...)`."""
SEQUENCE_ARG = "Seq"
"""The process group's own sequence number of a collective (kSeqNum in PyTorch's profiler utils and Kineto's
collective args; written by newer PyTorch on `record_param_comms` and copied onto its NCCL kernel, together
with `Comms Id`, a hash of the group name, this number and the group's topology). Every member of the group
numbers the same collective alike, so (group, sequence number) names an instance exactly
(cross_rank/matching.py); gloo records neither."""

# --- phases (`ph`) ---------------------------------------------------------------------------------------

COMPLETE = "X"
"""A complete event: a slice with a start (`ts`) and a duration (`dur`); what every analysis reads."""
METADATA = "M"
"""Process and thread names and sort indices."""
COUNTER = "C"
INSTANT_PHASES = ("i", "I")
FLOW_PHASES = ("s", "t", "f")
"""Flow arrows (start, step, finish): a quarter of a GPU trace's events."""
CHROME_PHASES = ("B", "E", "i", "I", "C", "b", "n", "e", "s", "t", "f", "P", "N", "O", "D", "V", "v", "R", "c",
                 "(", ")")
"""Every phase of the Chrome trace event format besides X and M."""
PLANNED_PHASES = (*INSTANT_PHASES, COUNTER, METADATA)
"""The phases the merge draws besides complete events and flows."""
UNDRAWN_PHASES = tuple(phase for phase in CHROME_PHASES if phase not in PLANNED_PHASES + FLOW_PHASES)
"""Phases of the Chrome format the merge does not draw: counted, never built."""

# --- categories (`cat`) ----------------------------------------------------------------------------------


class Kind(enum.IntEnum):
    """What an event is, from its Kineto category."""

    OTHER = 0
    CPU_OP = 1
    USER_ANNOTATION = 2
    GPU_USER_ANNOTATION = 3
    KERNEL = 4
    GPU_MEMCPY = 5
    GPU_MEMSET = 6
    CUDA_RUNTIME = 7
    PYTHON_FUNCTION = 8


CPU_OP_CATEGORY = "cpu_op"
TRACE_SPAN_CATEGORY = "Trace"
"""The category of Kineto's one span over the whole trace (HTA leaves it out of its frame)."""
KIND_OF_CATEGORY = {
    CPU_OP_CATEGORY: Kind.CPU_OP,
    "operator": Kind.CPU_OP,
    "user_annotation": Kind.USER_ANNOTATION,
    "gpu_user_annotation": Kind.GPU_USER_ANNOTATION,
    "kernel": Kind.KERNEL,
    "gpu_memcpy": Kind.GPU_MEMCPY,
    "gpu_memset": Kind.GPU_MEMSET,
    "cuda_runtime": Kind.CUDA_RUNTIME,
    "cuda_driver": Kind.CUDA_RUNTIME,
    "python_function": Kind.PYTHON_FUNCTION,
    # the category names of 2021-era Kineto traces (HTA still reads them)
    "Operator": Kind.CPU_OP,
    "Kernel": Kind.KERNEL,
    "Memcpy": Kind.GPU_MEMCPY,
    "Memset": Kind.GPU_MEMSET,
    "Runtime": Kind.CUDA_RUNTIME,
}
KIND_CODE_OF_CATEGORY = {category: int(kind) for category, kind in KIND_OF_CATEGORY.items()}
"""KIND_OF_CATEGORY as plain ints: what the parse's hot loop looks up."""
GPU_ACTIVITY_KINDS = (Kind.KERNEL, Kind.GPU_MEMCPY, Kind.GPU_MEMSET)
GPU_TRACK_KIND_CODES = frozenset(int(k) for k in (*GPU_ACTIVITY_KINDS, Kind.GPU_USER_ANNOTATION))
GPU_ACTIVITY_CATEGORIES = frozenset(category for category, kind in KIND_OF_CATEGORY.items()
                                    if kind in GPU_ACTIVITY_KINDS)
GPU_TRACK_CATEGORIES = GPU_ACTIVITY_CATEGORIES | {category for category, kind in KIND_OF_CATEGORY.items()
                                                  if kind == Kind.GPU_USER_ANNOTATION}
"""Categories of events that run on a GPU stream, in every Kineto generation (2021's `Kernel`, `Memcpy`, ...):
the one table the parse and the merge read (the merge drew a 2021 trace's kernels as a host thread)."""
HOST_CATEGORIES_BY_KIND = {kind: frozenset(c for c, k in KIND_OF_CATEGORY.items() if k == kind)
                           for kind in (Kind.CPU_OP, Kind.CUDA_RUNTIME)}
"""The category names of host ops and runtime calls in every Kineto generation."""

# --- the duration rule (`dur` of a complete event) -------------------------------------------------------

MISSING_DURATION_US = 0
"""A complete event without `dur` lasted no time: what the parse's table and the merge take. (HTA leaves such an
event out of its frame; hta_native.py and hta_frame.py reproduce HTA, so they drop it.)"""
NON_NUMERIC_TIME = "missing or non-numeric ts/dur"
NEGATIVE_DURATION = "negative duration"
TIME_BEYOND_INT64 = "time beyond int64 nanoseconds"
INT64_MAX = 2**63 - 1
TIME_LIMIT_US = INT64_MAX / 1000.0
"""Times beyond this many microseconds cannot be nanoseconds of any real clock."""


def time_problem(start: Any, dur: Any) -> str | None:
    """Why a complete event's `ts` and `dur` cannot be used, or None when they can (ints are fine): a time
    that is not a finite number, a negative duration, a time beyond int64 nanoseconds. The table drops such an
    event; the merge keeps a negative one as 0 long (it draws what the trace holds)."""
    if not (_is_number(start) and _is_number(dur)):
        return NON_NUMERIC_TIME
    if dur < 0:
        return NEGATIVE_DURATION
    if not -TIME_LIMIT_US < start < TIME_LIMIT_US or dur > TIME_LIMIT_US:
        return TIME_BEYOND_INT64
    return None


def _is_number(value: Any) -> bool:
    """A finite int or float (not bool); `v - v == 0` is false for NaN and infinities."""
    kind = type(value)
    return (kind is float or kind is int) and value - value == 0


class _Absent:
    """The value of a key the parse's decoder did not find (told apart from an explicit JSON null: HTA's frame,
    built from the same decode, takes a missing `stream` as -1 and an explicit null as not an integer)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
"""A missing `dur` of a complete event, `stream` or `correlation` of its args (the parse's decoder only)."""

# --- the document's metadata ---------------------------------------------------------------------------------


class TraceMetadata(msgspec.Struct, gc=False):
    """The known top-level keys of a Kineto document besides `traceEvents` (UNSET: the trace has no such key);
    every document below holds them."""

    schemaVersion: Any = msgspec.UNSET
    distributedInfo: Any = msgspec.UNSET
    deviceProperties: Any = msgspec.UNSET
    baseTimeNanoseconds: Any = msgspec.UNSET
    host_name: Any = msgspec.UNSET
    displayTimeUnit: Any = msgspec.UNSET
    traceName: Any = msgspec.UNSET
    trace_id: Any = msgspec.UNSET


def metadata_value(document: TraceMetadata, key: str) -> Any:
    """A metadata key's value, None where the trace has none (the generic reader's `document.get(key)`)."""
    value = getattr(document, key)
    return None if value is msgspec.UNSET else value


# --- gather's identity (traces/kineto.py): event names only ---------------------------------------------------


class NamedEvent(msgspec.Struct, gc=False):
    name: Any = None


class IdentityDocument(TraceMetadata, kw_only=True):
    traceEvents: list[NamedEvent]


# --- the per-rank parse (analysis/per_rank/events.py) ---------------------------------------------------------


class ParseArgs(msgspec.Struct, gc=False):
    """The few `args` fields the analysis reads; msgspec skips every other key without building it."""

    correlation: Any = ABSENT
    stream: Any = ABSENT
    device: Any = None
    name: Any = None
    group_name: Any = msgspec.field(default=None, name=PROCESS_GROUP_NAME_ARG)
    group_description: Any = msgspec.field(default=None, name=PROCESS_GROUP_DESCRIPTION_ARG)
    collective: Any = msgspec.field(default=None, name=COLLECTIVE_NAME_ARG)
    in_nelems: Any = msgspec.field(default=None, name=IN_NELEMS_ARG)
    out_nelems: Any = msgspec.field(default=None, name=OUT_NELEMS_ARG)
    dtype: Any = msgspec.field(default=None, name=DTYPE_ARG)
    group_size: Any = msgspec.field(default=None, name=GROUP_SIZE_ARG)
    in_split: Any = msgspec.field(default=None, name=IN_SPLIT_ARG)
    out_split: Any = msgspec.field(default=None, name=OUT_SPLIT_ARG)
    external_id: Any = msgspec.field(default=None, name=EXTERNAL_ID_ARG)
    grid: Any = None
    block: Any = None
    sequence: Any = msgspec.field(default=None, name=SEQUENCE_ARG)
    copy_bytes: Any = msgspec.field(default=None, name="bytes")
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name=INPUT_DIMS_ARG)
    """Kept undecoded by the fast decoder: a kernel's launching op's input shapes are part of the kernel's
    identity (events._note_launch_shape); the generic path gives the parsed value."""
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name=INPUT_TYPE_ARG)
    """Kept undecoded: a GEMM op's input types tell its numeric type where its kernels' names do not
    (events.TraceEvents.gemm_input_types); decoded for those ops only."""


class ParseArgsWithShapes(ParseArgs):
    """ParseArgs plus the record_shapes args, kept undecoded (every op has them) and decoded for
    c10d::alltoall_base_ only: used for traces that hold such an op with those args (events.decode_selectively)."""

    concrete_inputs: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name=CONCRETE_INPUTS_ARG)


class PhasedEvent(msgspec.Struct, gc=False, tag_field="ph"):
    """The parse's events, one class per phase (`ph` is the tag): a complete event decodes every field the
    table reads, thread metadata what thread names need, every other phase only its name, category and times
    (what HTA's frame reads of every event: hta_native.py), so their other values are never built."""


class ParseComplete(PhasedEvent, tag=COMPLETE):
    ph: ClassVar[str] = COMPLETE
    name: Any = None
    cat: Any = None
    ts: Any = None
    dur: Any = ABSENT
    """ABSENT when the event has none: the table takes it as MISSING_DURATION_US, HTA's frame leaves it out."""
    pid: Any = None
    tid: Any = None
    args: Union[ParseArgs, None] = None


class ParseCompleteWithShapes(ParseComplete, tag=COMPLETE):
    args: Union[ParseArgsWithShapes, None] = None


class ParseMetadata(PhasedEvent, tag=METADATA):
    ph: ClassVar[str] = METADATA
    name: Any = None
    cat: Any = None
    ts: Any = None
    dur: Any = None
    tid: Any = None
    args: Union[ParseArgs, None] = None


PARSE_OTHER_PHASES = tuple(
    msgspec.defstruct(f"ParsePhase{index}", [("name", Any, None), ("cat", Any, None), ("ts", Any, None),
                                             ("dur", Any, None)],
                      bases=(PhasedEvent,), tag=phase, namespace={"ph": phase}, module=__name__)
    for index, phase in enumerate(CHROME_PHASES))
"""The parse's event of every phase but X and M; an event of a phase outside the format sends the file to the
generic decoder (which skips it, as the table does every phase but X and M)."""


class UnknownPhaseEvent(msgspec.Struct, gc=False):
    """The generic path's event of a phase outside the format (or none): skipped like every phase but X and M."""

    ph: ClassVar[str] = ""
    name: Any = None
    cat: Any = None


class ParseDocument(TraceMetadata, kw_only=True):
    traceEvents: list[Union[(ParseComplete, ParseMetadata, *PARSE_OTHER_PHASES)]]


class ParseDocumentWithShapes(TraceMetadata, kw_only=True):
    traceEvents: list[Union[(ParseCompleteWithShapes, ParseMetadata, *PARSE_OTHER_PHASES)]]


PARSE_COMPLETE_TYPES = frozenset((ParseComplete, ParseCompleteWithShapes))
"""The parse decoder's classes of a complete event."""

# --- HTA's rank frame for its views (analysis/per_rank/hta_native.py) -----------------------------------------


class HtaRankArgs(msgspec.Struct, gc=False):
    """HTA's defaults for the two args its views read."""

    stream: Any = -1
    correlation: Any = -1


class HtaRankEvent(msgspec.Struct, gc=False):
    """What HTA's views read of every event, of any phase."""

    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = None
    args: HtaRankArgs | None | msgspec.Raw = None


class HtaRankDocument(msgspec.Struct, gc=False):
    traceEvents: list[HtaRankEvent]


# --- HTA's per-rank DataFrame (analysis/per_rank/hta_frame.py) ------------------------------------------------

HTA_ARGS = (
    # (column, key in the event's args, default): HTA 0.5.0's default ParserConfig (ARGS_DEFAULT, v1.0.0)
    ("stream", "stream", -1),
    ("correlation", "correlation", -1),
    ("bytes", "bytes", -1),
    ("memory_bw_gbps", "memory bandwidth (GB/s)", 0.0),
    ("wait_on_stream", "wait_on_stream", -1),
    ("wait_on_cuda_event_record_corr_id", "wait_on_cuda_event_record_corr_id", -1),
    ("input_dims", INPUT_DIMS_ARG, "-1"),
    ("input_type", INPUT_TYPE_ARG, "-1"),
    ("input_strides", "Input Strides", "-1"),
    ("external_id", EXTERNAL_ID_ARG, -1),
)
HTA_RAW_ARGS = frozenset(("input_dims", "input_type", "input_strides"))
"""Nested values (shape lists): kept as raw JSON while decoding, decoded in one call per column."""


def _hta_args_struct() -> type:
    """The Struct of HTA_ARGS: an absent key reads as HTA's default, an explicit null as None; the HTA_RAW_ARGS
    stay raw JSON (UNSET where absent)."""
    fields = []
    for column, key, default in HTA_ARGS:
        if column in HTA_RAW_ARGS:
            raw_or_absent = Union[msgspec.Raw, msgspec.UnsetType]
            fields.append((column, raw_or_absent, msgspec.field(default=msgspec.UNSET, name=key)))
        else:
            fields.append((column, Any, msgspec.field(default=default, name=key)))
    return msgspec.defstruct("HtaArgs", fields, gc=False, module=__name__)


HtaArgs = _hta_args_struct()


class HtaEvent(msgspec.Struct, gc=False):
    cat: Any = None
    name: Any = None
    pid: Any = None
    tid: Any = None
    ts: Any = None
    dur: Any = None
    args: Union[HtaArgs, None, msgspec.Raw] = None


class HtaDocument(TraceMetadata, kw_only=True):
    traceEvents: list[HtaEvent]


# --- the merge's window (analysis/merge/window_decode.py) -----------------------------------------------------


class SliceArgs(msgspec.Struct, gc=False):
    """The args a complete event's slice needs: the CUDA correlation, the device and stream of GPU work,
    and the process group of a collective."""

    correlation: Any = None
    device: Any = msgspec.UNSET
    stream: Any = msgspec.UNSET
    group_name: Any = msgspec.field(default=msgspec.UNSET, name=PROCESS_GROUP_NAME_ARG)
    group_description: Any = msgspec.field(default=None, name=PROCESS_GROUP_DESCRIPTION_ARG)


class WindowEvent(msgspec.Struct, gc=False, tag_field="ph"):
    ph: ClassVar[str] = ""


class WindowComplete(WindowEvent, tag=COMPLETE):
    """Typed: a value of another type sends the file to the merge's generic reader."""

    ph: ClassVar[str] = COMPLETE
    ts: int | float | None = None
    dur: int | float | None = MISSING_DURATION_US
    name: str = ""
    cat: str = ""
    pid: int | str = ""
    tid: int | str = ""
    args: SliceArgs | None = None


_PLANNED_FIELDS = (("name", Any, msgspec.UNSET), ("cat", Any, msgspec.UNSET), ("ts", Any, msgspec.UNSET),
                   ("pid", Any, msgspec.UNSET), ("tid", Any, msgspec.UNSET), ("id", Any, msgspec.UNSET),
                   ("bp", Any, msgspec.UNSET), ("args", Any, msgspec.UNSET))
"""Every field the merge's per-event planner reads of a phase other than X (UNSET: the key is absent)."""
WINDOW_PLANNED = tuple(msgspec.defstruct(f"WindowPlanned{index}", _PLANNED_FIELDS, bases=(WindowEvent,), tag=phase,
                                         namespace={"ph": phase}, module=__name__)
                       for index, phase in enumerate(PLANNED_PHASES))
_FLOW_FIELDS = (("ts", Union[int, float]), ("id", Union[int, str]), ("bp", Any, msgspec.UNSET),
                ("cat", Any, msgspec.UNSET), ("pid", Any, msgspec.UNSET), ("tid", Any, msgspec.UNSET))
"""A flow event's time and id are required (every Kineto flow event has them; a trace without goes to the
generic reader), so a decoded one is valid where its time is in range."""
WINDOW_FLOWS = tuple(msgspec.defstruct(f"WindowFlow{index}", _FLOW_FIELDS, bases=(WindowEvent,), tag=phase,
                                       namespace={"ph": phase}, module=__name__)
                     for index, phase in enumerate(FLOW_PHASES))
WINDOW_UNDRAWN = tuple(msgspec.defstruct(f"WindowUndrawn{index}", [], bases=(WindowEvent,), tag=phase,
                                         namespace={"ph": phase}, module=__name__)
                       for index, phase in enumerate(UNDRAWN_PHASES))


class WindowDocument(TraceMetadata, kw_only=True):
    traceEvents: list[Union[(WindowComplete, *WINDOW_PLANNED, *WINDOW_FLOWS, *WINDOW_UNDRAWN)]]
