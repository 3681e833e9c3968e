"""N-rank trace sets made from one real rank trace: for benchmarks and ground-truth tests.

Every rank gets the source trace's events, with its own `distributedInfo`, host name and base time.
Known effects can be injected:
  - a clock offset per host (ranks r // ranks_per_host share a host): added to `baseTimeNanoseconds`,
    exactly what a host whose wall clock runs ahead produces;
  - one late rank, for a known reason (`late_cause`); its communication kernels start later and end at the
    same instant as before (it arrives late; the others wait for it):
      LATE_HOST: they start `late_us` later, nothing else changes (the GPU idles before the collective:
        what a host that launches late produces);
      LATE_EXTRA_WORK: a compute kernel of `late_us` (EXTRA_WORK_KERNEL, a name no other rank runs) runs
        just before each of them, which starts that much later (more work before the collective);
      LATE_SLOW_KERNELS: every compute kernel, memcpy and memset of a step lasts `slow_factor` times as long
        and starts proportionally later from the step's first GPU activity (the same work on a slower
        GPU); the step's collective starts by as much as its GPU work got longer. Sources with their own
        communication kernels are refused (their compute and collectives interleave).
A source without communication kernels (a single-GPU recording) gets one all-reduce kernel per step after
the step's last GPU activity, with its host launch (`cudaLaunchKernel`, linked by correlation id) at the end
of that step (never after the kernel starts), so collectives exist to match and belong to their step.

Each file is one gzip member, as real writers make them: a small per-rank header deflated on its own, then
the events' deflate blocks, compressed once and shared (_DeflatedBody); N ranks cost little more than one.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fleetscope.analysis.per_rank.names import is_comm_kernel, profiler_step_number
from fleetscope.traces.kineto_schema import GPU_ACTIVITY_CATEGORIES, MISSING_DURATION_US
from fleetscope.traces.kineto import read_trace

INSERTED_ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
INSERTED_STREAM = 99
EXTRA_WORK_KERNEL = "fleetscope_synthetic_extra_work_kernel"
EXTRA_WORK_STREAM = 98
LATE_HOST = "host"
LATE_EXTRA_WORK = "extra work"
LATE_SLOW_KERNELS = "slow kernels"
LATE_CAUSES = (LATE_HOST, LATE_EXTRA_WORK, LATE_SLOW_KERNELS)


@dataclass(frozen=True, kw_only=True)
class TraceSetSpec:
    ranks: int
    ranks_per_host: int = 8
    host_offsets_us: dict[int, float] = field(default_factory=dict)
    """Host index -> how far its clock runs ahead of host 0's."""
    late_rank: int | None = None
    late_us: float = 0.0
    late_cause: str = LATE_HOST
    """How the late rank comes to be late (module docstring)."""
    slow_factor: float = 1.0
    """LATE_SLOW_KERNELS: how many times as long the late rank's GPU activity lasts."""
    inserted_allreduce_us: float = 1000.0
    """Duration of the all-reduce added per step to a source without communication kernels."""
    compress_level: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {self.ranks_per_host}")
        if self.late_rank is not None and not 0 <= self.late_rank < self.ranks:
            raise ValueError(f"late_rank {self.late_rank} is not a rank of {self.ranks}")
        if self.late_us < 0:
            raise ValueError(f"late_us must be >= 0, got {self.late_us}")
        if self.late_cause not in LATE_CAUSES:
            raise ValueError(f"late_cause must be one of {', '.join(LATE_CAUSES)}, got {self.late_cause!r}")
        if self.slow_factor < 1:
            raise ValueError(f"slow_factor must be >= 1, got {self.slow_factor}")

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host


def make_trace_set(source: Path, out_dir: Path, spec: TraceSetSpec) -> list[Path]:
    """Write `spec.ranks` traces `rank<R>.json.gz` into `out_dir`; returns their paths."""
    document = read_trace(source)
    events = _with_collectives(document["traceEvents"], spec.inserted_allreduce_us)
    header_fields = {k: v for k, v in document.items() if k != "traceEvents"}
    body = _DeflatedBody.of(events, spec.compress_level)
    late_body = body
    if spec.late_rank is not None:
        late_body = _DeflatedBody.of(_late_events(document["traceEvents"], events, spec), spec.compress_level)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(spec.ranks):
        path = out_dir / f"rank{rank}.json.gz"
        header = _header_text(header_fields, rank, spec)
        path.write_bytes((late_body if rank == spec.late_rank else body).gzip_after(header, spec.compress_level))
        paths.append(path)
    return paths


def _header_text(fields: dict[str, Any], rank: int, spec: TraceSetSpec) -> bytes:
    host = spec.host_of(rank)
    info = dict(fields.get("distributedInfo") or {})
    info.update(rank=rank, world_size=spec.ranks)
    base_ns = int(fields.get("baseTimeNanoseconds") or 0) + round(spec.host_offsets_us.get(host, 0.0) * 1000)
    header = {**fields, "distributedInfo": info, "host_name": f"node{host}", "baseTimeNanoseconds": base_ns}
    # stdlib spacing ("rank": 3) on purpose: HTA finds a trace's rank with the regex `"rank":\s+(\d+)`
    return json.dumps(header).encode()[:-1] + b', "traceEvents": '


@dataclass(frozen=True)
class _DeflatedBody:
    """The events shared by every rank's file, compressed once. Each file is ONE gzip member, as every
    writer makes them (torch's, gzip's, fleetscope's): the rank's header deflated and sync-flushed (byte
    aligned, not final), then these deflate blocks, then the CRC-32 of the whole text, combined from the two
    parts' CRCs without reading the body again. (Two gzip members, as before, made every reader join a copy
    of the whole text.)"""

    deflated: bytes
    crc: int
    size: int

    @classmethod
    def of(cls, events: list[Any], level: int) -> _DeflatedBody:
        text = orjson.dumps(events) + b"}"
        compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        return cls(compressor.compress(text) + compressor.flush(zlib.Z_FINISH), zlib.crc32(text), len(text))

    def gzip_after(self, header: bytes, level: int) -> bytes:
        compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        head = compressor.compress(header) + compressor.flush(zlib.Z_SYNC_FLUSH)
        crc = crc32_combine(zlib.crc32(header), self.crc, self.size)
        trailer = struct.pack("<II", crc, (len(header) + self.size) & 0xFFFFFFFF)
        return _GZIP_HEADER + head + self.deflated + trailer


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
"""A gzip member's header: deflate, no flags, mtime 0, no extra flags, OS unknown."""


def crc32_combine(first: int, second: int, second_size: int) -> int:
    """zlib's crc32_combine: the CRC-32 of A + B from crc32(A), crc32(B) and len(B)."""
    return _gf2_times(_zeros_operator(second_size), first) ^ second


@functools.lru_cache(maxsize=8)
def _zeros_operator(size: int) -> tuple[int, ...]:
    """The GF(2) matrix (32 columns) that runs a CRC-32 register over `size` zero bytes (zlib's crc32.c)."""
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    result = [1 << n for n in range(32)]  # identity
    remaining = size
    while remaining:
        even = _gf2_square(odd)  # the first square gives one zero byte
        if remaining & 1:
            result = [_gf2_times(even, column) for column in result]
        remaining >>= 1
        if not remaining:
            break
        odd = _gf2_square(even)
        if remaining & 1:
            result = [_gf2_times(odd, column) for column in result]
        remaining >>= 1
    return tuple(result)


def _gf2_times(matrix, vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix) -> list[int]:
    return [_gf2_times(matrix, column) for column in matrix]


def _late_events(source: list[Any], events: list[Any], spec: TraceSetSpec) -> list[Any]:
    """The late rank's events: `events` (the source with its collectives) changed by `spec.late_cause`."""
    if spec.late_cause == LATE_EXTRA_WORK:
        return _with_extra_work(events, spec.late_us)
    if spec.late_cause == LATE_SLOW_KERNELS:
        if any(_is_comm_kernel_event(e) for e in source):
            raise ValueError("slow kernels: only for sources without communication kernels")
        return _slowed(source, spec.slow_factor, spec.inserted_allreduce_us)
    return _delayed(events, spec.late_us)


def _with_extra_work(events: list[Any], late_us: float) -> list[Any]:
    """A kernel of late_us right where each communication kernel started; the collective starts after it."""
    changed = []
    for event in events:
        if _is_comm_kernel_event(event) and event.get("dur", MISSING_DURATION_US) > late_us:
            device = (event.get("args") or {}).get("device", event.get("pid"))
            changed.append({"ph": "X", "cat": "kernel", "name": EXTRA_WORK_KERNEL, "pid": event.get("pid"),
                            "tid": EXTRA_WORK_STREAM, "ts": event["ts"], "dur": late_us,
                            "args": {"device": device, "stream": EXTRA_WORK_STREAM}})
            event = {**event, "ts": event["ts"] + late_us, "dur": event["dur"] - late_us}
        changed.append(event)
    return changed


def _slowed(source: list[Any], factor: float, allreduce_us: float) -> list[Any]:
    """Each step's GPU activity stretched by `factor` from the step's first GPU start; the inserted
    all-reduce (placed from the unstretched step, so it ends when the other ranks' does) starts as much
    later as the step's GPU work got longer."""
    stretched = {id(e): e for e in source}
    delays = []
    for step, gpu_end, _ in _step_gpu_ends(source):
        inside = [e for e in source if _is_gpu_event(e) and step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
        anchor = min(e["ts"] for e in inside)
        for e in inside:
            stretched[id(e)] = {**e, "ts": anchor + (e["ts"] - anchor) * factor, "dur": e["dur"] * factor}
        delays.append((gpu_end - anchor) * (factor - 1.0))
    if any(delay >= allreduce_us for delay in delays):
        raise ValueError(f"slow kernels: a step's GPU work grows by {max(delays):.0f} us, more than the "
                         f"inserted all-reduce ({allreduce_us:.0f} us): raise inserted_allreduce_us")
    events = [stretched[id(e)] for e in source]
    with_collectives = _with_collectives(source, allreduce_us)
    inserted = iter(delays)
    for event in with_collectives[len(source):]:
        if _is_comm_kernel_event(event):
            delay = next(inserted)
            event = {**event, "ts": event["ts"] + delay, "dur": event["dur"] - delay}
        events.append(event)
    return events


def _is_gpu_event(event: Any) -> bool:
    return isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") in GPU_ACTIVITY_CATEGORIES


def _delayed(events: list[Any], late_us: float) -> list[Any]:
    """The late rank: communication kernels start late_us later and end when they did."""
    delayed = []
    for event in events:
        if _is_comm_kernel_event(event) and event.get("dur", MISSING_DURATION_US) > late_us:
            event = {**event, "ts": event["ts"] + late_us, "dur": event["dur"] - late_us}
        delayed.append(event)
    return delayed


def _is_comm_kernel_event(event: Any) -> bool:
    return (isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") == "kernel"
            and isinstance(event.get("name"), str) and is_comm_kernel(event["name"]))


def _with_collectives(events: list[Any], duration_us: float) -> list[Any]:
    if any(_is_comm_kernel_event(e) for e in events):
        return events
    added = []
    for index, (step, gpu_end, device) in enumerate(_step_gpu_ends(events)):
        correlation = _INSERTED_CORRELATION_BASE + index
        added.append(_launch(step, correlation, gpu_end))
        added.append(_allreduce_after(gpu_end, device, duration_us, correlation))
    return events + added


_INSERTED_CORRELATION_BASE = 1_000_000_000


def _step_gpu_ends(events: list[Any]) -> list[tuple[dict[str, Any], float, int]]:
    """Per host step (ProfilerStep#N): the step, and the end (and device) of the last GPU activity that
    started inside it."""
    steps = [e for e in events
             if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and isinstance(e.get("name"), str) and profiler_step_number(e["name"]) is not None]
    gpu = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in GPU_ACTIVITY_CATEGORIES]
    ends = []
    for step in sorted(steps, key=lambda e: e["ts"]):
        inside = [e for e in gpu if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
        if inside:
            last = max(inside, key=lambda e: e["ts"] + e["dur"])
            ends.append((step, last["ts"] + last["dur"], int((last.get("args") or {}).get("device", 0))))
    return ends


def _launch(step: dict[str, Any], correlation: int, gpu_end: float) -> dict[str, Any]:
    """The host launch of an inserted all-reduce, at the end of its step (so it belongs to that step), and
    never after the kernel it launches starts (at gpu_end + 5 us)."""
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": step.get("pid"),
            "tid": step.get("tid"), "ts": min(step["ts"] + step["dur"] - 10.0, gpu_end), "dur": 5.0,
            "args": {"correlation": correlation, "External id": correlation}}


def _allreduce_after(start_us: float, device: int, duration_us: float, correlation: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": INSERTED_ALLREDUCE, "pid": device, "tid": INSERTED_STREAM,
            "ts": start_us + 5.0, "dur": duration_us,
            "args": {"device": device, "stream": INSERTED_STREAM, "correlation": correlation,
                     "External id": correlation}}
