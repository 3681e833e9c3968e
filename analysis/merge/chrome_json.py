"""The merged trace as Chrome JSON, for tools that only read JSON (written beside the Perfetto trace).

Same processes, tracks, slices, instants and counters as the Perfetto trace, streamed event by event
(gzip when the file name ends in `.gz`). Each rank is a process (`pid` = the Perfetto trace's pid),
each track a thread (`tid` = its index in the rank) named by `thread_name` metadata, so overlapping
events keep the overlap lanes that make them nest. Timestamps are microseconds after
`baseTimeNanoseconds` (a whole second shortly before the first event), which keeps nanoseconds exact
in a double. Launch and trace flows are written as `s`/`f` pairs; the cross-rank collective flows
exist only in the Perfetto trace (JSON flows cannot chain an unknown number of ranks).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import IO, Any

import orjson
from fleetscope.traces.atomic import staging_path

_NS_PER_S = 1_000_000_000
_BASE_MARGIN_NS = 3600 * _NS_PER_S
"""The base sits an hour before the first event written, so ranks that start earlier stay >= 0."""
_TRACK_INDEX_MASK = 0xFFFFFFFF


class ChromeJsonWriter:
    """Streams `{"traceEvents": [...]}`; `close()` finishes the file and moves it into place.

    A fragment writer (`ChromeJsonWriter.fragment`) writes only `,`-led events, for a worker process
    whose part the main writer appends with `append_fragment`.
    """

    def __init__(self, path: Path, *, fragment: bool = False, base_ns: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fragment = fragment
        self._staging = self.path if fragment else staging_path(self.path)
        raw = open(self._staging, "wb")
        compressed = self.path.name.endswith(".gz") and not fragment
        self._file: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) if compressed else raw
        self._raw = raw
        self._base_ns = base_ns
        self._wrote_event = fragment
        self._counter_names: dict[int, str] = {}
        self.uncompressed_bytes = 0

    @classmethod
    def fragment(cls, path: Path, *, base_ns: int | None) -> "ChromeJsonWriter":
        return cls(path, fragment=True, base_ns=base_ns)

    @property
    def base_ns(self) -> int | None:
        return self._base_ns

    def append_fragment(self, path: Path) -> None:
        """Copy a fragment writer's events into this file (after at least one event of its own)."""
        with open(path, "rb") as part:
            while chunk := part.read(1 << 20):
                self._write(chunk)

    def process(self, pid: int, name: str, order: int) -> None:
        self._event({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        self._event({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": order}})

    def track(self, pid: int, uuid: int, name: str, order: int | None, is_counter: bool) -> None:
        if is_counter:
            self._counter_names[uuid] = name
            return
        tid = uuid & _TRACK_INDEX_MASK
        self._event({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        if order is not None:
            self._event({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                         "args": {"sort_index": order}})

    def complete(self, pid: int, uuid: int, name: str, category: str, start_ns: int, end_ns: int,
                 args: Any) -> None:
        event = {"ph": "X", "name": name, "cat": category, "pid": pid, "tid": uuid & _TRACK_INDEX_MASK,
                 "ts": self._us(start_ns), "dur": (end_ns - start_ns) / 1000}
        if args:
            event["args"] = args
        self._event(event)

    def instant(self, pid: int, uuid: int, name: str, category: str, ts_ns: int, args: Any) -> None:
        event = {"ph": "i", "s": "t", "name": name, "cat": category, "pid": pid,
                 "tid": uuid & _TRACK_INDEX_MASK, "ts": self._us(ts_ns)}
        if args:
            event["args"] = args
        self._event(event)

    def counter(self, pid: int, uuid: int, ts_ns: int, value: float) -> None:
        name = self._counter_names.get(uuid, "counter")
        self._event({"ph": "C", "name": name, "pid": pid, "ts": self._us(ts_ns), "args": {"value": value}})

    def flow(self, *, ends: bool, flow_id: int, pid: int, uuid: int, ts_ns: int) -> None:
        event = {"ph": "f" if ends else "s", "id": flow_id, "cat": "flow", "name": "flow", "pid": pid,
                 "tid": uuid & _TRACK_INDEX_MASK, "ts": self._us(ts_ns)}
        if ends:
            event["bp"] = "e"
        self._event(event)

    def start_clock(self, first_ts_ns: int) -> None:
        """Fix the base time; call before the first timed event."""
        if self._base_ns is None:
            self._base_ns = max(0, (first_ts_ns - _BASE_MARGIN_NS) // _NS_PER_S * _NS_PER_S)

    def close(self) -> None:
        if self._fragment:
            self._file.close()
            return
        if not self._wrote_event:
            self._write(self._header())
        self._write(b"]}\n")
        self._file.close()
        if self._file is not self._raw:
            self._raw.close()
        os.replace(self._staging, self.path)

    def abandon(self) -> None:
        self._file.close()
        if self._file is not self._raw:
            self._raw.close()
        self._staging.unlink(missing_ok=True)

    def _us(self, ts_ns: int) -> float:
        if self._base_ns is None:
            self.start_clock(ts_ns)
        return (ts_ns - self._base_ns) / 1000

    def _header(self) -> bytes:
        header = {"schemaVersion": 1, "displayTimeUnit": "ms", "baseTimeNanoseconds": self._base_ns or 0}
        return orjson.dumps(header)[:-1] + b',"traceEvents":['

    def _event(self, event: dict) -> None:
        try:
            data = orjson.dumps(event, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # integers beyond 64 bits in args, which stdlib json writes as they are
            data = json.dumps(event, default=str, separators=(",", ":")).encode()
        if not self._wrote_event:
            self._write(self._header())
            self._wrote_event = True
        else:
            data = b"," + data
        self._write(data)

    def _write(self, data: bytes) -> None:
        self.uncompressed_bytes += len(data)
        self._file.write(data)
