"""How many bytes each collective call moved, from the message args the trace records.

NCCL kernels (and `record_param_comms`) of recent PyTorch carry `In msg nelems`, `Out msg nelems`,
`dtype` and `Group size` (names.py). A collective's size is counted the way nccl-tests counts it, so the
bus-bandwidth formulas (cross_rank/bandwidth.py) apply unchanged:
  - all-reduce, broadcast, reduce: the buffer (in = out elements);
  - all-gather: the gathered output (out elements, group size x the input);
  - reduce-scatter: the full input (in elements, group size x the output);
  - all-to-all: everything a rank sends (in elements).
That is max(in, out) elements x the dtype's size in every case. gloo traces and host ops record no
message args: their sizes are "not recorded" (NaN).

All-to-all split sizes (`In split size` / `Out split size`, "[r0, r1, ...]": dim-0 rows sent to / received
from each group member, in group rank order; "[]" for an even split) give the bytes per peer: rows x the
row's elements (in msg nelems / the rows sent; out msg nelems / the rows received) x the element size. The
profiler writes at most 30 entries and then "..." (kTruncatLength): such a list says SPLIT_TRUNCATED and no
per-peer bytes are guessed (the totals still come from the nelems). gloo spans carry no message args;
with record_shapes, the c10d::alltoall_base_ op that issued one lists the tensors' dims and type and both
split lists (events.py reads them as a message): the k-th such op and the k-th gloo all-to-all span, in
start order, are paired when their counts agree and every op starts before its span. The trainer's own records
(metrics/rank<R>.moe.jsonl) keep them whole; cross_rank/bandwidth.py prefers them where they apply.

A trace is untrusted: a `Group size` beyond traces/validate.MAX_WORLD_SIZE is not recorded (an even split
of 10^9 peers would be 10^9 entries), a split list longer than that is not read, and one rank's calls keep
at most MAX_PEER_ENTRIES per-peer entries in all (identical messages share theirs); past that, a call's
bytes per peer are SPLIT_NOT_RECORDED (its total still counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.events import NO_ID, TraceEvents
from fleetscope.analysis.per_rank.names import ALL_TO_ALL, ALL_TO_ALL_BASE_OP, collective_type, is_gloo_span
from fleetscope.traces.validate import MAX_WORLD_SIZE, checked_world_size

SPLIT_TRACE, SPLIT_EVEN, SPLIT_TRUNCATED = "trace", "even", "split sizes truncated"
SPLIT_RECORDS, SPLIT_NOT_RECORDED = "trainer records", "not recorded"
"""Where an all-to-all's bytes per peer come from: the trace's split sizes, an even split ("[]"), none
(the profiler cut the list at 30 entries), the trainer's records, or nothing recorded."""

MAX_PEER_ENTRIES = 1 << 22
"""Per-peer byte entries one rank's all-to-all calls keep in all (module docstring): a real trace needs far
fewer (a thousand calls of a 256-member group is a quarter million)."""

MESSAGE_FIELDS = ("collective", "in_nelems", "out_nelems", "dtype", "group_size", "in_split", "out_split")
"""Order of the fields of `TraceEvents.messages` entries."""

DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
    "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
    "ComplexFloat": 8, "ComplexDouble": 16, "UInt16": 2, "UInt32": 4, "UInt64": 8,
}
"""Element size in bytes of each dtype name as Kineto writes it (c10 ScalarType names)."""


@dataclass(frozen=True, kw_only=True)
class SplitBytes:
    """One all-to-all call's bytes per peer of one rank (group rank order)."""

    status: str
    """SPLIT_TRACE, SPLIT_EVEN, SPLIT_RECORDS (send/recv known); SPLIT_TRUNCATED, SPLIT_NOT_RECORDED (empty)."""
    send_bytes: tuple[float, ...] = ()
    recv_bytes: tuple[float, ...] = ()

    @property
    def known(self) -> bool:
        return bool(self.send_bytes)


@dataclass(frozen=True, kw_only=True)
class MessageSizes:
    """Per collective call of one rank (same order as `CollectiveCalls.keys`)."""

    bytes: np.ndarray
    """Bytes the call moved (module docstring), NaN where the trace does not record its message."""
    group_size: np.ndarray
    """Members of its process group from the `Group size` arg, -1 where not recorded."""
    collective: list[str | None]
    """names.collective_type of each call (ALL_REDUCE, ...), None when unknown."""
    group: list[str | None]
    """Process group label of each call (names.process_group_label), None when the trace names none."""
    splits: list[SplitBytes | None] = field(default_factory=list)
    """Bytes per peer of each all-to-all call (module docstring); None for other calls and calls without
    message args. Empty list: no call has any."""

    @property
    def recorded(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.bytes)))


def message_sizes(events: TraceEvents, indices: np.ndarray) -> MessageSizes:
    """Sizes of the collective events at `indices` (in that order)."""
    sizes = np.full(indices.size, np.nan)
    group_size = np.full(indices.size, NO_ID, dtype=np.int32)
    types, groups, splits = [], [], []
    issued_by = _issuing_host_ops(events, indices)
    split_of = _SplitMemo()
    for slot, index in enumerate(indices):
        message = events.message_of(int(index))
        message = message if message is not None else issued_by.get(int(index))
        name = events.names[events.name_id[index]]
        collective_arg = message[0] if message else None
        types.append(collective_type(collective_arg, name))
        groups.append(events.group_of(int(index)))
        if message is not None:
            sizes[slot] = message_bytes(*message[1:4])
            group_size[slot] = checked_world_size(message[4]) or NO_ID
        splits.append(split_of(message[1:]) if message is not None and types[-1] == ALL_TO_ALL else None)
    return MessageSizes(bytes=sizes, group_size=group_size, collective=types, group=groups,
                        splits=splits if any(s is not None for s in splits) else [])


class _SplitMemo:
    """split_bytes of each distinct message once, within the MAX_PEER_ENTRIES budget of one rank."""

    def __init__(self) -> None:
        self.known: dict[tuple, SplitBytes] = {}
        self.entries = 0

    def __call__(self, message: tuple) -> SplitBytes:
        found = self.known.get(message)
        if found is None:
            # past the budget nothing more is computed: a split costs time as well as memory
            found = split_bytes(*message) if self.entries < MAX_PEER_ENTRIES else SplitBytes(status=SPLIT_NOT_RECORDED)
            self.entries += len(found.send_bytes) + len(found.recv_bytes)
            if self.entries > MAX_PEER_ENTRIES:
                found = SplitBytes(status=SPLIT_NOT_RECORDED)
            self.known[message] = found
        return found


def message_bytes(in_nelems: int, out_nelems: int, dtype: str | None) -> float:
    """max(in, out) elements x the element size; NaN for an unknown dtype or no counts."""
    element = DTYPE_BYTES.get(dtype) if dtype else None
    elements = max(in_nelems, out_nelems)
    if element is None or elements < 0:
        return float("nan")
    return float(elements * element)


def _issuing_host_ops(events: TraceEvents, indices: np.ndarray) -> dict[int, tuple]:
    """gloo all-to-all span index -> the message of the c10d::alltoall_base_ op that issued it (module
    docstring); empty unless every such span pairs with one op."""
    if events.message_id is None or ALL_TO_ALL_BASE_OP not in events.names:
        return {}
    op_name = events.names.index(ALL_TO_ALL_BASE_OP)
    ops = np.flatnonzero((events.name_id == op_name) & (events.message_id != NO_ID))
    span_names = {i for i, name in enumerate(events.names) if is_gloo_span(name) and "all_to_all" in name}
    spans = np.asarray([i for i in indices.tolist() if int(events.name_id[i]) in span_names], dtype=np.int64)
    if not ops.size or ops.size != spans.size:
        return {}
    ops = ops[np.argsort(events.start_us[ops], kind="stable")]
    spans = spans[np.argsort(events.start_us[spans], kind="stable")]
    if np.any(events.start_us[ops] > events.start_us[spans]):
        return {}
    return {int(span): events.message_of(int(op)) for span, op in zip(spans, ops)}


def parse_split(text: str | None) -> tuple[list[int] | None, bool]:
    """(sizes, truncated) of a split-size arg: "[3, 4]" -> ([3, 4], False); "[]" -> ([], False); a list
    ending in "..." -> (None, True); anything unreadable or negative -> (None, False)."""
    if not isinstance(text, str):
        return None, False
    body = text.strip().strip('"').strip()
    if not (body.startswith("[") and body.endswith("]")) or body.count(",") >= MAX_WORLD_SIZE:
        return None, False
    items = [item.strip() for item in body[1:-1].split(",") if item.strip()]
    if items and items[-1] == "...":
        return None, True
    try:
        sizes = [int(item) for item in items]
    except ValueError:
        return None, False
    return (sizes, False) if all(v >= 0 for v in sizes) else (None, False)


def split_bytes(in_nelems: int, out_nelems: int, dtype: str | None, group_size: int,
                in_split: str | None, out_split: str | None) -> SplitBytes:
    """Bytes per peer of one all-to-all from its message args (module docstring)."""
    element = DTYPE_BYTES.get(dtype) if dtype else None
    send, send_cut = parse_split(in_split)
    recv, recv_cut = parse_split(out_split)
    if send_cut or recv_cut:
        return SplitBytes(status=SPLIT_TRUNCATED)
    if element is None or send is None or recv is None or in_nelems < 0 or out_nelems < 0:
        return SplitBytes(status=SPLIT_NOT_RECORDED)
    if not send and not recv:
        if checked_world_size(group_size) is None or in_nelems % group_size or out_nelems % group_size:
            return SplitBytes(status=SPLIT_NOT_RECORDED)
        return SplitBytes(status=SPLIT_EVEN, send_bytes=(in_nelems / group_size * element,) * group_size,
                          recv_bytes=(out_nelems / group_size * element,) * group_size)
    send_row, recv_row = _row_elements(in_nelems, send), _row_elements(out_nelems, recv)
    if send_row is None or recv_row is None:
        return SplitBytes(status=SPLIT_NOT_RECORDED)
    return SplitBytes(status=SPLIT_TRACE, send_bytes=tuple(float(n * send_row * element) for n in send),
                      recv_bytes=tuple(float(n * recv_row * element) for n in recv))


def _row_elements(nelems: int, rows: list[int]) -> int | None:
    """Elements per dim-0 row: nelems / the rows; None when they do not divide (the args disagree)."""
    total = sum(rows)
    if total == 0:
        return 0 if nelems == 0 else None
    return nelems // total if nelems % total == 0 else None
