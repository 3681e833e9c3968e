"""Profiling windows for your own training loop, launched by `fleetscope launch -- python train.py ...`.

    from fleetscope.trainer import user_profiling as fs

    for step in fs.windows().steps(range(steps)):   # the one-line form, or:

    windows = fs.windows()                 # after init_process_group, on every rank
    for step in range(steps):
        with windows.step(step):           # or call windows.step_done(step) at the end of each step
            with windows.phase("forward"):
                loss = model(batch).sum()
            ...
    windows.close()                        # optional: at exit a window cut short is dropped anyway

The plan comes from the environment the launcher sets (traces/launch_env.py): the run directory and the
profiler schedule (`--profile skip_first=..,wait=..,warmup=..,active=..,repeat=..`), the same on every rank.
The schedule is planned into windows by fleetscope's own planner (trainer/profiling.py) and a
torch.profiler exists only inside them; steps are marked `ProfilerStep#<step>`; each finished window is
published into `<run>/traces/window<NNN>/rank<R>.<host>.pt.trace.json.gz` atomically; the clock offset to
rank 0 is measured once (collectively) when the process group exists. Not launched by fleetscope, all of
this is a no-op after a one-line notice on stderr.

Every step of the loop, profiled or not, also appends one record to `<run>/metrics/rank<R>.timeline`
(traces/timeline.py): its start on this rank's wall clock at the previous step's end (the first step: its
own start), its time from there to its end (so consecutive records tile the loop, the time between steps
included), `data_ms` from `windows.phase("data")` when the loop times its input with it (NaN otherwise),
and whether it ran inside a window. No device sync; records are buffered and written at exit even without
`close()`.

Users who drive torch.profiler themselves pass `on_trace_ready=fs.trace_handler()`: each trace the profiler
hands it is filed into the run directory as the next window of this rank.

Imports: torch, fleetscope.traces, and the torch-free trainer modules of the window planner; nothing else
(no transformers), so a training script can afford it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..traces.clock import record_clock_offset
from ..traces.launch_env import LaunchedBy, launcher_rank, read_launch_environment, restart_attempt
from ..traces.layout import RunLayout
from ..traces.timeline import MAX_TIMELINE_STEP, TimelineWriter
from ..traces.writer import publish_trace
from .config import ProfilerSchedule
from .profiling import Window, WindowedProfiler, plan_windows

NOT_LAUNCHED_NOTICE = "fleetscope: not launched by `fleetscope launch`: profiling windows are off"
_OPEN_ENDED_HORIZON_CYCLES = 64
"""repeat=0 (until training ends): windows are planned this many cycles ahead, then again."""


def schedule_of(launched: LaunchedBy) -> ProfilerSchedule:
    """The ProfilerSchedule the launcher passed (its checks name a bad field)."""
    known = {field.name for field in dataclasses.fields(ProfilerSchedule)}
    unknown = sorted(set(launched.schedule) - known)
    if unknown:
        raise ValueError(f"profiler schedule from the launcher has unknown fields {unknown}")
    return ProfilerSchedule(**launched.schedule)


def current_rank() -> int:
    """The process group's rank when it exists, else the launcher's (RANK, SLURM_PROCID), else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = launcher_rank()
    return 0 if rank is None else rank


class StepTimeline:
    """One timeline record per step of a user's loop (the writer opens at the first record, closes at exit)."""

    def __init__(self, layout: RunLayout) -> None:
        self._layout = layout
        self._writer: TimelineWriter | None = None
        self._boundary_ns: int | None = None
        """perf_counter_ns of the previous step's end (or of the first seen step's start); None: none yet."""
        self._boundary_us = math.nan
        """The same moment on this rank's wall clock (`time.time_ns() / 1000`)."""
        self._data_ns: int | None = None
        self._first = True
        self._warned = False

    def begin(self) -> None:
        """A step begins; its record starts here unless a previous step's end already set the start."""
        if self._boundary_ns is None:
            self._set_boundary()

    def end(self, step: int, *, profiled: bool) -> None:
        """Step `step` ends: its record, from the boundary to now (none when its start was not seen, nor for a
        step number a record cannot hold: the loop's own numbering never raises in here)."""
        now_ns = time.perf_counter_ns()
        if self._boundary_ns is not None and not self._recordable(step):
            self._boundary_ns = None
        if self._boundary_ns is not None:
            step_ms = max(now_ns - self._boundary_ns, 1) / 1e6
            data_ms = min(self._data_ns / 1e6, step_ms) if self._data_ns is not None else math.nan
            self._open().append(step=step, start_us=self._boundary_us, step_ms=step_ms, data_ms=data_ms,
                                profiled=profiled, first=self._first)
            self._first = False
        self._set_boundary()

    def _recordable(self, step: object) -> bool:
        """An integer step a timeline record holds (0 to MAX_TIMELINE_STEP); said once when the loop's is not."""
        if type(step) is int and 0 <= step <= MAX_TIMELINE_STEP:
            return True
        if not self._warned:
            self._warned = True
            print(f"fleetscope: step {step!r} cannot be kept in the step timeline (an integer from 0 to "
                  f"{MAX_TIMELINE_STEP} is needed); such steps are left out of it", file=sys.stderr, flush=True)
        return False

    def add_data_ns(self, elapsed_ns: int) -> None:
        """Time the loop spent on its input (`windows.phase("data")`), counted in the step that ends next."""
        self._data_ns = (self._data_ns or 0) + elapsed_ns

    def close(self) -> None:
        """Write the buffered records (a later step opens the file again and appends)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            atexit.unregister(writer.close)
            writer.close()

    def _set_boundary(self) -> None:
        self._boundary_ns, self._boundary_us, self._data_ns = time.perf_counter_ns(), time.time_ns() / 1e3, None

    def _open(self) -> TimelineWriter:
        if self._writer is None:
            rank = current_rank()
            self._writer = TimelineWriter(self._layout.timeline_file(rank), rank)
            atexit.register(self._writer.close)  # a program that never calls close() keeps its records
        return self._writer


class _DataPhase:
    """`windows.phase("data")`: its time goes to the step's data_ms; inside windows also a named range."""

    def __init__(self, timeline: StepTimeline, inner: contextlib.AbstractContextManager) -> None:
        self._timeline, self._inner, self._start_ns = timeline, inner, 0

    def __enter__(self) -> None:
        self._inner.__enter__()
        self._start_ns = time.perf_counter_ns()

    def __exit__(self, *exc_info) -> None:
        self._timeline.add_data_ns(time.perf_counter_ns() - self._start_ns)
        self._inner.__exit__(*exc_info)


class Windows:
    """Profiling windows of one rank of a user's loop; make one with `windows()`."""

    def __init__(self, launched: LaunchedBy | None, *, use_cuda: bool | None = None,
                 measure_clock: bool = True) -> None:
        self._launched = launched
        self._profiler: WindowedProfiler | None = None
        self._planned_until = 0
        self._open_step: int | None = None
        self._renumbered = False
        self._clock_pending = measure_clock and launched is not None
        self._timeline: StepTimeline | None = None
        if launched is None:
            return
        import torch

        self._schedule = schedule_of(launched)
        self._layout = RunLayout.at(launched.run_dir)
        self._timeline = StepTimeline(self._layout)
        self._use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self._measure_clock_if_possible()

    @property
    def enabled(self) -> bool:
        """Launched by fleetscope with profiling on."""
        return self._launched is not None and self._schedule.enabled

    @property
    def published(self) -> list[Path]:
        """The traces this rank has published so far."""
        return [trace.path for trace in self._profiler.published] if self._profiler else []

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wraps global step `step` of the loop (steps need not start at 0: a resumed run goes on)."""
        self._begin(step)
        try:
            yield
        finally:
            self._end(step)

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """`for step in windows.steps(range(n)):` the loop's body is step `step` (the one-line form)."""
        for step in steps:
            with self.step(step):
                yield step

    def step_done(self, step: int) -> None:
        """Call at the end of step `step` instead of wrapping it: ends it and begins step + 1 (as
        torch.profiler's `prof.step()` does). The first step is recorded from `windows(start_step=...)` on;
        without it, the first step_done's step is not (its start was not seen). A loop that numbers its steps
        its own way (a counter from 0 again each epoch, a jump) is not stopped: the step in progress ends under
        the number it began with and the count goes on from there (one notice on stderr)."""
        if self._open_step is None:
            self._begin(step, seen=False)
        elif step != self._open_step:
            self._note_renumbered(step)
            step = self._open_step
        self._end(step)
        self._begin(step + 1)

    def _note_renumbered(self, step: int) -> None:
        if not self._renumbered:
            self._renumbered = True
            print(f"fleetscope: step_done({step}) while step {self._open_step} is in progress: the loop's own step "
                  f"numbers are not consecutive; fleetscope counts on from {self._open_step} (records, windows and "
                  "`fleetscope profile --steps` use that count)", file=sys.stderr, flush=True)

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A named range (forward, backward, optimizer_step, ...) in the current step; recorded in windows only.
        `phase("data")` (the loop's input) is also timed every step: the step's data_ms in the timeline."""
        inner = self._profiler.phase(name) if self._profiler is not None else contextlib.nullcontext()
        if name == "data" and self._timeline is not None:
            return _DataPhase(self._timeline, inner)
        return inner

    def close(self) -> None:
        """Stop a window cut short (nothing of it is published) and write the timeline's buffered records."""
        if self._profiler is not None:
            self._profiler.close()
        if self._timeline is not None:
            self._timeline.close()
        self._open_step = None

    def _begin(self, step: int, *, seen: bool = True) -> None:
        """Step `step` begins (`seen`: now; False: earlier, unseen, so it gets no timeline record)."""
        if self._timeline is None:
            return
        if seen:
            self._timeline.begin()
        self._open_step = step
        if not self.enabled:
            return
        self._measure_clock_if_possible()
        self._plan_through(step)
        self._profiler.begin_step(step)

    def _end(self, step: int) -> None:
        if self._open_step is None:
            return
        if step != self._open_step:
            raise ValueError(f"step {step} ended but step {self._open_step} is the one in progress")
        self._open_step = None
        self._timeline.end(step, profiled=self._profiler is not None and self._profiler.recording)
        if self._profiler is not None:
            self._profiler.end_step(step)

    def _plan_through(self, step: int) -> None:
        """Plan every window (repeat > 0), or the next cycles' windows once `step` passes the planned ones
        (repeat=0: until training ends). Cycle k's window ends by skip_first + (k + 1) * cycle_steps, so
        planning to such a horizon takes whole cycles and the next plan continues without a gap."""
        if self._profiler is not None and step < self._planned_until:
            return
        schedule = self._schedule
        if schedule.repeat:
            horizon, until = schedule.skip_first + schedule.repeat * schedule.cycle_steps, sys.maxsize
        else:
            cycles = max(step - schedule.skip_first, 0) // schedule.cycle_steps + _OPEN_ENDED_HORIZON_CYCLES
            horizon = until = schedule.skip_first + cycles * schedule.cycle_steps
        planned = [w for w in plan_windows(schedule, horizon) if w.warmup_start >= self._planned_until]
        published = self._profiler.published if self._profiler is not None else []
        self._profiler = self._new_profiler(planned)
        self._profiler.published.extend(published)
        self._planned_until = until

    def _new_profiler(self, windows: list[Window]) -> WindowedProfiler:
        return WindowedProfiler(windows=windows, config=self._schedule, layout=self._layout, rank=current_rank(),
                                attempt=restart_attempt(), use_cuda=self._use_cuda)

    def _measure_clock_if_possible(self) -> None:
        """Once the process group exists: every rank's offset to rank 0 (a collective: all ranks are here)."""
        if not self._clock_pending:
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._clock_pending = False
            measure_clock_offset_once(self._layout)


def windows(*, start_step: int | None = None, use_cuda: bool | None = None, measure_clock: bool = True) -> Windows:
    """This rank's profiling windows, planned from the launcher's environment (every rank calls it, after
    `init_process_group` if there is one: the clock measurement is a collective). `start_step`: step
    `start_step` begins now (for loops that call `step_done` only). Not launched by fleetscope: a no-op
    object, after a one-line notice."""
    launched = read_launch_environment()
    if launched is None:
        print(NOT_LAUNCHED_NOTICE, file=sys.stderr)
    made = Windows(launched, use_cuda=use_cuda, measure_clock=measure_clock)
    if start_step is not None:
        made._begin(start_step)
    return made


class TraceHandler:
    """`on_trace_ready` for torch.profiler: files each trace into the run directory as this rank's next window
    (`traces/window<NNN>/rank<R>.<host>.pt.trace.json.gz`, published atomically, never overwriting)."""

    def __init__(self, layout: RunLayout | None, *, first_window: int = 0) -> None:
        self._layout = layout
        self._next_window = first_window
        self._host = socket.gethostname()
        self.published: list[Path] = []

    def __call__(self, prof: Any) -> None:
        if self._layout is None:
            return
        with tempfile.TemporaryDirectory(prefix="fleetscope-trace-") as local_dir:
            local_file = Path(local_dir) / "trace.json"
            prof.export_chrome_trace(str(local_file))
            path = publish_trace(local_file, self._layout, window=self._next_window, rank=current_rank(),
                                 host=self._host, attempt=restart_attempt())
        self._next_window += 1
        self.published.append(path)


def trace_handler(*, run_dir: str | Path | None = None, measure_clock: bool = True) -> Callable[[Any], None]:
    """An `on_trace_ready` handler that publishes into the run directory (the launcher's, or `run_dir`).
    Made on every rank after `init_process_group`, it also measures the clock offset to rank 0 (a
    collective). Not launched by fleetscope and no `run_dir`: traces are dropped, after a one-line notice."""
    if run_dir is None:
        launched = read_launch_environment()
        run_dir = launched.run_dir if launched else None
    if run_dir is None:
        print("fleetscope: not launched by `fleetscope launch`: trace_handler() keeps no traces", file=sys.stderr)
        return TraceHandler(None)
    layout = RunLayout.at(run_dir)
    if measure_clock:
        measure_clock_offset_once(layout)
    return TraceHandler(layout)


def measure_clock_offset_once(layout: RunLayout) -> bool:
    """Every rank's clock offset to rank 0 into clock/rank<R>.json, when a process group of several ranks
    exists (a collective: every rank must call it at the same point). True if measured."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    record_clock_offset(layout)
    return True
