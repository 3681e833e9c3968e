"""Hand-built Kineto traces for the analysis tests (tests/test_traces_kineto_builder.py checks that the builder makes valid traces)."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


PID = 4242
MAIN_TID = 4242
RUNLOOP_TID = 4300
BASE_TIME_NS = 1_790_000_000_000_000_000
T0_US = 1_000_000.0


@dataclass
class KinetoBuilder:
    """Builds one rank's trace; times are microseconds after T0_US."""

    rank: int | None = 0
    world_size: int = 2
    host: str = "node0"
    backend: str = "nccl"
    base_time_ns: int = BASE_TIME_NS
    events: list[dict[str, Any]] = field(default_factory=list)
    _correlation: int = 1000

    def complete(self, name: str, cat: str, ts: float, dur: float, *, pid: Any = PID, tid: Any = MAIN_TID,
                 args: dict | None = None) -> "KinetoBuilder":
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                            "ts": T0_US + ts, "dur": dur, "args": args or {}})
        return self

    def op(self, name: str, ts: float, dur: float, *, tid: int = MAIN_TID) -> "KinetoBuilder":
        return self.complete(name, "cpu_op", ts, dur, tid=tid)

    def annotation(self, name: str, ts: float, dur: float, *, tid: int = MAIN_TID) -> "KinetoBuilder":
        return self.complete(name, "user_annotation", ts, dur, tid=tid)

    def step(self, number: int, ts: float, dur: float) -> "KinetoBuilder":
        return self.annotation(f"ProfilerStep#{number}", ts, dur)

    def gloo(self, ts: float, dur: float, *, name: str = "gloo:all_reduce", tid: int = RUNLOOP_TID) -> "KinetoBuilder":
        return self.complete(name, "user_annotation", ts, dur, tid=tid)

    def kernel(self, name: str, ts: float, dur: float, *, launch_ts: float | None = None, stream: int = 7,
               device: int = 0, cat: str = "kernel", args: dict | None = None) -> "KinetoBuilder":
        """A GPU activity; with launch_ts, also its cudaLaunchKernel on the main thread; `args` adds to
        the kernel's own (e.g. the process group of a collective)."""
        self._correlation += 1
        correlation = self._correlation
        if launch_ts is not None:
            self.complete("cudaLaunchKernel", "cuda_runtime", launch_ts, 4.0,
                          args={"correlation": correlation, "External id": correlation})
        return self.complete(name, cat, ts, dur, pid=device, tid=stream, args={
            "device": device, "stream": stream, "correlation": correlation, "External id": correlation,
            "grid": [1, 1, 1], "block": [128, 1, 1], **(args or {}),
        })

    def document(self) -> dict[str, Any]:
        metadata = [
            {"ph": "M", "name": "thread_name", "pid": PID, "tid": MAIN_TID, "args": {"name": "thread 1 (python3)"}},
            {"ph": "M", "name": "thread_name", "pid": PID, "tid": RUNLOOP_TID,
             "args": {"name": "thread 2 (pt_gloo_runloop)"}},
        ]
        document: dict[str, Any] = {"schemaVersion": 1, "host_name": self.host, "baseTimeNanoseconds": self.base_time_ns,
                                    "traceEvents": metadata + self.events}
        if self.rank is not None:
            document["distributedInfo"] = {"backend": self.backend, "rank": self.rank, "world_size": self.world_size}
        if any(e["cat"] == "kernel" for e in self.events):
            document["deviceProperties"] = [{"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150_000_000_000}]
        return document

    def write(self, path: Path) -> Path:
        data = json.dumps(self.document()).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
        return path


def gpu_rank(rank: int, *, nccl_start: float = 600.0, kernel_name: str = "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
             world_size: int = 2) -> KinetoBuilder:
    """A rank with two steps of 1000 us: compute kernels, one all-reduce per step, one memcpy.

    Per step (offsets from the step start): compute 100-400 and 450-700 (stream 7), the all-reduce
    `nccl_start`-900 (stream 20), a memcpy 950-980. The all-reduce ends at 900 on every rank.
    """
    builder = KinetoBuilder(rank=rank, world_size=world_size)
    for index, step_start in enumerate((0.0, 1000.0)):
        s = step_start
        builder.step(index + 1, s, 1000.0)
        builder.annotation("train_step", s + 10, 980.0)
        builder.annotation("forward", s + 20, 300.0)
        builder.annotation("backward", s + 330, 500.0)
        builder.kernel("sm90_xmma_gemm_bf16", s + 100, 300.0, launch_ts=s + 30)
        builder.kernel("elementwise_kernel", s + 450, 250.0, launch_ts=s + 40)
        builder.kernel(f"{kernel_name}(ncclDevKernelArgsStorage<4096ul>)", s + nccl_start, 900.0 - nccl_start,
                       launch_ts=s + 50, stream=20)
        builder.kernel("Memcpy DtoH (Device -> Pinned)", s + 950, 30.0, launch_ts=s + 60, cat="gpu_memcpy")
    return builder
