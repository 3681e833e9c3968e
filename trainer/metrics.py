"""Per-step metrics: phase timing (CUDA events on GPU), one JSON line per step per rank."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch

from ..traces.formats import metric_line


class StepTiming:
    """The phase boundaries of one step; reading them waits for that step's GPU work only."""

    def __init__(self, marks: list[tuple[str, object]], use_cuda: bool):
        self._marks = marks
        self._use_cuda = use_cuda

    def durations_ms(self) -> dict[str, float]:
        """`{phase: ms}` between consecutive marks (the last mark only ends the previous phase)."""
        if self._use_cuda:
            self._marks[-1][1].synchronize()
        return {
            name: start.elapsed_time(end) if self._use_cuda else (end - start) * 1e3
            for (name, start), (_, end) in zip(self._marks, self._marks[1:])
        }


class PhaseTimer:
    """Marks phase boundaries in one step.

    On CUDA the marks are events on the current stream, so the numbers are GPU time between the
    boundaries; they are read a step later (see the train loop) so that reading them never stalls
    the GPU. On CPU, wall time.
    """

    def __init__(self, use_cuda: bool):
        self._use_cuda = use_cuda
        self._marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self._use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def finish(self) -> StepTiming:
        timing = StepTiming(self._marks, self._use_cuda)
        self._marks = []
        return timing


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
    tflops: float | None = None
    """Model FLOPs of this rank's step over its time (trainer/flops.py states the formula)."""
    mfu_pct: float | None = None
    """tflops over the device's dense bf16 peak; None where the peak is unknown (CPU)."""
    profiled: bool = False
    """The step ran inside a profiler window (its time includes profiler overhead)."""


class MetricsWriter:
    """Appends one JSON line per step to metrics/rank<R>.jsonl (appending keeps resumed runs whole)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path, "a", buffering=1)

    def write(self, metrics: StepMetrics) -> None:
        self._file.write(metric_line(asdict(metrics)))

    def close(self) -> None:
        self._file.close()
