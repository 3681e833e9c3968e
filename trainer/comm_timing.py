"""Cheap, every-step estimates of communication time, outside profiler windows.

Two sources, both read one step late (with the step's other metrics) so that nothing here syncs the
host with the device in the training loop:

* DDP's gradient all-reduces, through a comm hook that wraps the default all-reduce hook and notes
  when each bucket became ready (the hook is called) and when its all-reduce completed (the
  future's callback). On CPU these are wall-clock times (the callback runs on the backend's thread
  once the work is done; it needs the GIL, so it can land a little late). On CUDA they are CUDA
  events: one recorded on the current stream when the bucket is ready, one recorded in the callback,
  which torch runs on a stream that waits for the all-reduce to finish.
* The collectives the trainer itself issues between steps (the stop-flag agreement), timed as a span.

* FSDP2's gradient reduce-scatters, through a subclass of its default reduce-scatter (ReduceScatterTimer):
  ready and done points around each one, the same shape and estimate as DDP's buckets.

FSDP2's all-gathers and tensor-parallel collectives are not timed here (they run inside the modules' own code,
with no cheap hook at their completion); for them the step fields stay null.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

MIB = 1024 * 1024
"""DDP's bucket_cap_mb counts MiB."""


class Clock:
    """A point in time: perf_counter on CPU, a timing CUDA event on the current stream on CUDA."""

    def __init__(self, use_cuda: bool):
        self.use_cuda = use_cuda

    def now(self) -> object:
        if not self.use_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms_between(self, start: object, end: object) -> float:
        """Milliseconds from `start` to `end` (on CUDA waits for `end`: call only one step later)."""
        if not self.use_cuda:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


@dataclass(frozen=True, slots=True)
class CommEstimate:
    comm_ms: float
    """First bucket ready -> last bucket's all-reduce done."""
    comm_exposed_ms: float
    """Last bucket ready -> last bucket's all-reduce done."""
    buckets: int
    total_mb: float | None = None
    """MiB of gradients all-reduced (every bucket's flat buffer); None when sizes were not noted."""
    last_bucket_mb: float | None = None
    """MiB of the bucket that became ready last (the all-reduce the step waits for)."""


class StepBuckets:
    """The (ready, done) points of one step's gradient buckets, and each bucket's size in bytes."""

    def __init__(self, clock: Clock, points: list[list[object]], sizes: list[int] | None = None):
        self._clock = clock
        self._points = points
        self._sizes = sizes if sizes is not None and len(sizes) == len(points) else None

    def first_ready(self) -> object | None:
        """When the step's first bucket was ready and its all-reduce issued (a Clock point; None: no bucket)."""
        return self._points[0][0] if self._points else None

    def estimate(self) -> CommEstimate | None:
        """None when the step all-reduced nothing (or a bucket never completed)."""
        if not self._points or any(done is None for _, done in self._points):
            return None
        first_ready = self._points[0][0]
        ready_ms = [self._clock.ms_between(first_ready, ready) if i else 0.0
                    for i, (ready, _) in enumerate(self._points)]
        done_ms = [self._clock.ms_between(first_ready, done) for _, done in self._points]
        last_done = max(done_ms)
        sizes_mb = [size / MIB for size in self._sizes] if self._sizes else None
        return CommEstimate(comm_ms=last_done, comm_exposed_ms=max(0.0, last_done - max(ready_ms)),
                            buckets=len(self._points), total_mb=sum(sizes_mb) if sizes_mb else None,
                            last_bucket_mb=sizes_mb[ready_ms.index(max(ready_ms))] if sizes_mb else None)


class DdpCommTimer:
    """A DDP comm hook: the default all-reduce, plus when each bucket was ready and when it was done."""

    def __init__(self, use_cuda: bool):
        self._clock = Clock(use_cuda)
        self._points: list[list[object]] = []
        self._sizes: list[int] = []

    def install(self, ddp_model: torch.nn.Module, process_group) -> None:
        ddp_model.register_comm_hook(state=process_group, hook=self._hook)

    # No return annotation: DDP checks it against Future[Tensor], and postponed annotations are strings.
    def _hook(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        point = [self._clock.now(), None]
        self._points.append(point)
        buffer = bucket.buffer()
        self._sizes.append(buffer.numel() * buffer.element_size())

        def done(future: torch.futures.Future) -> torch.Tensor:
            point[1] = self._clock.now()
            return future.value()

        return allreduce_hook(process_group, bucket).then(done)

    def finish_step(self) -> StepBuckets:
        """This step's buckets (call after the step is launched); the next step starts empty."""
        buckets = StepBuckets(self._clock, self._points, self._sizes)
        self._points, self._sizes = [], []
        return buckets


@dataclass(frozen=True, slots=True)
class TimedSpan:
    """The start and end points of something the trainer issued, read later."""

    clock: Clock
    start: object
    end: object

    def ms(self) -> float:
        return self.clock.ms_between(self.start, self.end)


class ReduceScatterTimer:
    """FSDP2's gradient reduce-scatters of each step: when each was issued (its input ready on the reduce-scatter
    stream) and when it completed, as Clock points, with the bytes reduced: the same (ready, done) shape as DDP's
    buckets, so the same estimate (comm_ms, comm_exposed_ms) and the same first point (first_collective_ms).
    On CUDA both points are events on the reduce-scatter stream (FSDP2 issues the collective with that stream
    current), recorded before and after the collective is enqueued: the second completes when it does. HSDP's
    all-reduce across replicas, which follows on another stream, is not included."""

    def __init__(self, use_cuda: bool):
        self._clock = Clock(use_cuda)
        self._points: list[list[object]] = []
        self._sizes: list[int] = []

    def issued(self, input_tensor: torch.Tensor) -> list[object]:
        point = [self._clock.now(), None]
        self._points.append(point)
        self._sizes.append(input_tensor.numel() * input_tensor.element_size())
        return point

    def completed(self, point: list[object]) -> None:
        point[1] = self._clock.now()

    def finish_step(self) -> StepBuckets | None:
        """This step's reduce-scatters (None: none issued, e.g. an accumulation micro-step); the next step starts
        empty."""
        if not self._points:
            return None
        buckets = StepBuckets(self._clock, self._points, self._sizes)
        self._points, self._sizes = [], []
        return buckets


def install_reduce_scatter_stamps(model: torch.nn.Module, timer: ReduceScatterTimer) -> int:
    """FSDP2's reduce-scatters of every fully_shard-ed module of `model` are timed by `timer`; the number of
    modules stamped (0: no FSDP2 module, or a torch without the default reduce-scatter to extend)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:
        return 0

    class StampedReduceScatter(DefaultReduceScatter):
        """FSDP2's default reduce-scatter, timed (a subclass: FSDP2's own type checks still pass)."""

        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            point = timer.issued(input_tensor)
            work = super().__call__(output_tensor, input_tensor, *args, **kwargs)
            timer.completed(point)
            return work

    stamped = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            try:
                module.set_custom_reduce_scatter(StampedReduceScatter())
            except ValueError:  # several parameter groups: FSDP2 takes no custom comm there
                continue
            stamped += 1
    return stamped
