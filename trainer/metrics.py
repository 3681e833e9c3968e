"""Per-step metrics: phase timing (CUDA events on GPU), one JSON line per step per rank."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch

from ..traces.formats import metric_line
from .comm_timing import Clock


class StepPhaseMarks:
    """The phase boundaries of one step; reading them waits for that step's GPU work only."""

    def __init__(self, marks: list[tuple[str, object]], use_cuda: bool, start_us: float = math.nan):
        self._marks = marks
        self._use_cuda = use_cuda
        self.start_us = start_us
        """This rank's wall clock (`time.time_ns() / 1000`) at the step's first mark (NaN: no mark)."""

    def ms_since_start(self, point: object) -> float:
        """ms from the step's first mark to `point`, a point of the same clock (comm_timing.Clock: a timing
        CUDA event on CUDA, waited for here, so call it a step later; perf_counter seconds on CPU)."""
        if not self._marks:
            return math.nan
        return Clock(self._use_cuda).ms_between(self._marks[0][1], point)

    def durations_ms(self) -> dict[str, float]:
        """`{phase: ms}` between consecutive marks, summed per phase name (the last mark only ends the previous
        phase)."""
        if self._use_cuda:
            self._marks[-1][1].synchronize()
        durations: dict[str, float] = {}
        for (name, start), (_, end) in zip(self._marks, self._marks[1:]):
            # A phase repeated in one step (a forward per accumulated micro-batch) adds up.
            durations[name] = durations.get(name, 0.0) + (start.elapsed_time(end) if self._use_cuda else (end - start) * 1e3)
        return durations


class PhaseTimer:
    """Marks phase boundaries in one step.

    On CUDA the marks are events on the current stream, so the numbers are GPU time between the
    boundaries; they are read a step later (see the train loop) so that reading them never stalls
    the GPU. On CPU, wall time.
    """

    def __init__(self, use_cuda: bool):
        self._use_cuda = use_cuda
        self._marks: list[tuple[str, object]] = []
        self._start_us = math.nan

    def mark(self, name: str) -> None:
        if not self._marks:  # the step's start on this rank's wall clock, for the timeline
            self._start_us = time.time_ns() / 1e3
        if self._use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def finish(self) -> StepPhaseMarks:
        timing = StepPhaseMarks(self._marks, self._use_cuda, self._start_us)
        self._marks, self._start_us = [], math.nan
        return timing


@dataclass(frozen=True, slots=True)
class MemorySample:
    """The CUDA allocator's statistics of one step (all None on CPU)."""

    peak_allocated_mb: float | None = None
    peak_reserved_mb: float | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


class StepMemory:
    """Per-step CUDA memory: the allocator's peaks are reset when a step starts and read when it has been
    launched. Allocation happens on the host at launch, so the statistics are final then: reading them
    needs no device sync. Retries and OOMs are cumulative counters, reported as per-step deltas."""

    def __init__(self, device: torch.device):
        self._device = device
        self._active = device.type == "cuda"
        self._retries, self._ooms = self._counts() if self._active else (0, 0)

    def _counts(self) -> tuple[int, int]:
        stats = torch.cuda.memory_stats(self._device)
        return stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)

    def start_step(self) -> None:
        if self._active:
            torch.cuda.reset_peak_memory_stats(self._device)

    def finish_step(self) -> MemorySample:
        if not self._active:
            return MemorySample()
        stats = torch.cuda.memory_stats(self._device)
        retries, ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
        sample = MemorySample(
            peak_allocated_mb=stats.get("allocated_bytes.all.peak", 0) / 2**20,
            peak_reserved_mb=stats.get("reserved_bytes.all.peak", 0) / 2**20,
            alloc_retries=retries - self._retries, ooms=ooms - self._ooms,
        )
        self._retries, self._ooms = retries, ooms
        return sample


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    step: int
    rank: int
    loss: float
    step_time_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    tokens_per_s: float
    """This rank's tokens over this step's time."""
    max_memory_allocated_mb: float | None = None
    """CUDA: peak memory allocated by tensors during THIS step, MiB (the peak is reset at each step's start;
    before per-step resets this was a running maximum). None on CPU (no allocator statistics)."""
    tflops: float | None = None
    """Model FLOPs of this rank's step over its time (trainer/flops.py states the formula)."""
    mfu_pct: float | None = None
    """tflops over the device's dense bf16 peak; None where the peak is unknown (CPU)."""
    profiled: bool = False
    """The step ran inside a profiler window (its time includes profiler overhead)."""
    max_memory_reserved_mb: float | None = None
    """CUDA: peak memory reserved by the caching allocator during this step, MiB. None on CPU."""
    alloc_retries: int | None = None
    """CUDA: allocations during this step that failed, freed cached blocks and retried (`num_alloc_retries`
    delta; each one costs a device sync and cache flush). None on CPU."""
    ooms: int | None = None
    """CUDA: out-of-memory errors the allocator raised during this step (`num_ooms` delta). None on CPU."""
    comm_ms: float | None = None
    """ms from the first gradient collective becoming ready (DDP: a bucket's all-reduce; FSDP2: a module's
    reduce-scatter) to the last one completing, this step (CPU: wall clock; CUDA: events, GPU time). Mostly
    overlapped with backward compute: not a cost by itself. None without DDP or FSDP2 (one replica, TP, PP:
    their collectives are not timed outside traces)."""
    comm_exposed_ms: float | None = None
    """ms from the last gradient collective becoming ready (backward compute done, up to DDP's or FSDP2's own
    bookkeeping) to the last one completing: gradient communication the step waits for, including waiting for
    slower ranks to reach it. Part of backward_ms. None without DDP or FSDP2."""
    comm_buckets: int | None = None
    """Gradient collectives this step: DDP's buckets, FSDP2's reduce-scatters. None without DDP or FSDP2."""
    comm_mb: float | None = None
    """MiB of gradients reduced this step (DDP: every bucket's flat buffer; FSDP2: every reduce-scatter's
    input): with comm_buckets, the mean bucket size the advisor reads for DDP (many tiny buckets pay a fixed cost
    per all-reduce). None without DDP or FSDP2."""
    comm_last_bucket_mb: float | None = None
    """MiB of the gradient collective that became ready last this step (the one the step waits for once
    backward is done). None without DDP or FSDP2."""
    stop_agreement_ms: float | None = None
    """ms of the stop-flag all-reduce every rank issues right after the step (outside step_time_ms); since
    it is blocking on gloo, it includes waiting for the slowest rank to finish its step. CUDA: event time.
    None when no agreement runs (one rank without a stop request)."""
    compiled_frames: int | None = None
    """Frames torch.compile compiled during this step (0 in steady state; >0: compile time is inside this
    step's time). None when performance.compile is none."""
    fault_leaked_mb: float | None = None
    """MiB kept alive so far by the faults.leak_mb_per_step fault (bookkeeping of what it holds, after this
    step). None when that fault is off."""


class MetricsWriter:
    """Appends one JSON line per step to metrics/rank<R>.jsonl (appending keeps resumed runs whole)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path, "a", buffering=1)

    def write(self, metrics: StepMetrics) -> None:
        self._file.write(metric_line(asdict(metrics)))

    def close(self) -> None:
        self._file.close()
