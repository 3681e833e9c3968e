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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from fleetscope.analysis.per_rank.events import NO_ID, TraceEvents
from fleetscope.analysis.per_rank.names import collective_type

MESSAGE_FIELDS = ("collective", "in_nelems", "out_nelems", "dtype", "group_size")
"""Order of the fields of `TraceEvents.messages` entries."""

DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
    "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
    "ComplexFloat": 8, "ComplexDouble": 16, "UInt16": 2, "UInt32": 4, "UInt64": 8,
}
"""Element size in bytes of each dtype name as Kineto writes it (c10 ScalarType names)."""


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

    @property
    def recorded(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.bytes)))


def message_sizes(events: TraceEvents, indices: np.ndarray) -> MessageSizes:
    """Sizes of the collective events at `indices` (in that order)."""
    sizes = np.full(indices.size, np.nan)
    group_size = np.full(indices.size, NO_ID, dtype=np.int32)
    types, groups = [], []
    for slot, index in enumerate(indices):
        message = events.message_of(int(index))
        name = events.names[events.name_id[index]]
        collective_arg = message[0] if message else None
        types.append(collective_type(collective_arg, name))
        groups.append(events.group_of(int(index)))
        if message is not None:
            sizes[slot] = message_bytes(*message[1:4])
            group_size[slot] = message[4]
    return MessageSizes(bytes=sizes, group_size=group_size, collective=types, group=groups)


def message_bytes(in_nelems: int, out_nelems: int, dtype: str | None) -> float:
    """max(in, out) elements x the element size; NaN for an unknown dtype or no counts."""
    element = DTYPE_BYTES.get(dtype) if dtype else None
    elements = max(in_nelems, out_nelems)
    if element is None or elements < 0:
        return float("nan")
    return float(elements * element)
