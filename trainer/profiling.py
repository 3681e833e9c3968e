"""Scheduled profiling that costs nothing outside its windows.

A `torch.profiler.profile` context, even in its WAIT phase, slows every step by several percent.
So the schedule (skip_first / wait / warmup / active / repeat) is planned here into explicit
windows, and a profiler exists only from a window's first warmup step to its last active step.
Each finished window is exported on the rank's local disk and published into the run directory.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from ..traces import cupti
from ..traces.formats import step_marker
from ..traces.layout import RunLayout
from ..traces.writer import publish_trace
from .config import ProfilerSchedule


@dataclass(frozen=True, slots=True)
class Window:
    """One profiling window, in global training steps (end is exclusive)."""

    index: int
    warmup_start: int
    active_start: int
    end: int

    @property
    def active_steps(self) -> range:
        return range(self.active_start, self.end)


def plan_windows(config: ProfilerSchedule, total_steps: int) -> list[Window]:
    """Every complete window that fits in `total_steps` steps (pure)."""
    if not config.enabled:
        return []
    windows = []
    cycle = 0
    while config.repeat == 0 or cycle < config.repeat:
        cycle_start = config.skip_first + cycle * config.cycle_steps
        warmup_start = cycle_start + config.wait
        end = warmup_start + config.warmup + config.active
        if end > total_steps:
            break
        windows.append(Window(cycle, warmup_start, warmup_start + config.warmup, end))
        cycle += 1
    return windows


@dataclass(frozen=True, slots=True)
class PublishedTrace:
    window: Window
    path: Path
    export_seconds: float


class WindowedProfiler:
    """Enters torch.profiler only around planned windows; call `step_context(step)` every step."""

    def __init__(self, *, windows: list[Window], config: ProfilerSchedule, layout: RunLayout, rank: int,
                 attempt: int, use_cuda: bool, on_published: Callable[[PublishedTrace], None] | None = None):
        self._windows = {w.warmup_start: w for w in windows}
        self._config = config
        self._layout = layout
        self._rank = rank
        self._attempt = attempt
        self._host = socket.gethostname()
        self._activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
        self._on_published = on_published
        self._profiler: profile | None = None
        self._window: Window | None = None
        self._marker: record_function | None = None
        self.published: list[PublishedTrace] = []

    @contextlib.contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        """Wraps one training step: opens/closes windows, marks recorded steps `ProfilerStep#<step>`."""
        self.begin_step(step)
        try:
            yield
        finally:
            self._end_marker()
        self._advance(step)

    def begin_step(self, step: int) -> None:
        """The start of step `step`: opens its window if one starts here, marks the step inside windows."""
        self._maybe_start(step)
        if self._profiler is not None:
            self._marker = record_function(step_marker(step))
            self._marker.__enter__()

    def end_step(self, step: int) -> None:
        """The end of step `step` (after `begin_step(step)`): closes the window that ends with it."""
        self._end_marker()
        self._advance(step)

    @property
    def recording(self) -> bool:
        """Inside a window (a profiler exists)."""
        return self._profiler is not None

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A named range inside the current step, recorded only inside windows."""
        return record_function(name) if self._profiler is not None else contextlib.nullcontext()

    def _end_marker(self) -> None:
        if self._marker is not None:
            marker, self._marker = self._marker, None
            marker.__exit__(None, None, None)
    def add_window(self, window: Window) -> None:
        """Record one more window (an on-demand or triggered one); it must start after the current step."""
        self._windows[window.warmup_start] = window

    def close(self) -> None:
        """Stop a window cut short (training ended or failed inside it); nothing is exported."""
        self._end_marker()
        if self._profiler is not None:
            self._profiler.on_trace_ready = None
            self._profiler.stop()
            self._profiler = None

    def _maybe_start(self, step: int) -> None:
        window = self._windows.get(step)
        if window is None or self._profiler is not None:
            return
        cupti.guard_rank_environment(torch.version.cuda)  # before the profiler starts: kineto reads it then
        self._window = window
        self._profiler = profile(
            activities=self._activities,
            schedule=schedule(wait=0, warmup=window.active_start - window.warmup_start,
                              active=window.end - window.active_start, repeat=1),
            on_trace_ready=self._export,
            record_shapes=self._config.record_shapes,
            with_stack=self._config.with_stack,
            profile_memory=self._config.profile_memory,
            **_gc_events(self._config.with_stack),
        )
        # Steps are marked with global step numbers by step_context, not the profiler's own count.
        self._profiler.record_steps = False
        self._profiler.start()

    def _advance(self, step: int) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        if step == self._window.end - 1:
            self._profiler.stop()
            self._profiler = None

    def _export(self, prof: profile) -> None:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="fleetscope-trace-") as local_dir:
            local_file = Path(local_dir) / "trace.json"
            prof.export_chrome_trace(str(local_file))
            path = publish_trace(local_file, self._layout, window=self._window.index, rank=self._rank,
                                 host=self._host, attempt=self._attempt)
        published = PublishedTrace(self._window, path, time.perf_counter() - started)
        self.published.append(published)
        if self._on_published:
            self._on_published(published)


def _gc_events(with_stack: bool) -> dict:
    """With Python stacks, the garbage collections too (`Python GC` events: the advisor's gc_pauses rule reads
    them); torch records them only with its Python tracer, and older torch has no such option."""
    if not with_stack:
        return {}
    try:
        return {"experimental_config": torch.profiler._ExperimentalConfig(record_python_gc_info=True)}
    except (TypeError, AttributeError):
        return {}
