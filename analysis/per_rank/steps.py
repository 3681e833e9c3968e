"""Training steps of one rank: where each step lies in the trace and how long its phases took."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.events import Kind, TraceEvents
from fleetscope.analysis.per_rank.names import PHASES, TRAIN_STEP, profiler_step_number

STEP_SOURCE_PROFILER = "ProfilerStep"
STEP_SOURCE_TRAIN_STEP = "train_step"
DATA_LOADER_PREFIX = "enumerate(DataLoader)#"
"""torch.utils.data names the range of each batch fetch `enumerate(DataLoader)#<iterator>.__next__`."""


@dataclass(frozen=True, kw_only=True)
class StepTiming:
    """One training step on one rank."""

    step: int
    """The step number (N of `ProfilerStep#N`; with only `train_step` ranges, their order in the trace)."""
    start_us: float
    """Start in the trace's own clock (microseconds after the trace's base time)."""
    step_time_ms: float
    """Wall time of the step annotation on the host."""
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Summed wall time of each `train_step`/`forward`/`backward`/`optimizer_step` range in this step."""
    data_loader_ms: float | None = None
    """Summed wall time of the DataLoader's `enumerate(DataLoader)#...__next__` ranges that start in this
    step (fetching its batch on the host); None when the trace records none."""

    @property
    def end_us(self) -> float:
        return self.start_us + self.step_time_ms * 1000.0


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """Statistics of step_time_ms over the steps of one rank (or of all ranks)."""

    count: int
    mean_ms: float
    median_ms: float
    min_ms: float
    max_ms: float
    std_ms: float
    """Population standard deviation (0 for a single step)."""

    @classmethod
    def of(cls, times_ms: list[float]) -> "StepStats | None":
        if not times_ms:
            return None
        values = np.asarray(times_ms, dtype=np.float64)
        return cls(
            count=int(values.size),
            mean_ms=float(values.mean()),
            median_ms=float(np.median(values)),
            min_ms=float(values.min()),
            max_ms=float(values.max()),
            std_ms=float(values.std()),
        )


def find_steps(events: TraceEvents) -> tuple[list[StepTiming], str | None]:
    """The steps of a trace and where they came from (`ProfilerStep`, `train_step`, or None)."""
    host_ranges = events.of_kind(Kind.USER_ANNOTATION, Kind.CPU_OP)
    windows = _profiler_step_windows(events, host_ranges)
    source = STEP_SOURCE_PROFILER
    if not windows:
        windows = _train_step_windows(events, host_ranges)
        source = STEP_SOURCE_TRAIN_STEP
    if not windows:
        return [], None
    phase_masks = {phase: host_ranges & events.names_matching(lambda n, p=phase: n == p) for phase in PHASES}
    loader = host_ranges & events.names_matching(lambda n: n.startswith(DATA_LOADER_PREFIX))
    steps = [
        StepTiming(step=step, start_us=start, step_time_ms=dur / 1000.0,
                   phases_ms=_phase_times_ms(events, phase_masks, start, start + dur),
                   data_loader_ms=_phase_times_ms(events, {"data": loader}, start, start + dur).get("data")
                   if loader.any() else None)
        for step, start, dur in windows
    ]
    return steps, source


def _profiler_step_windows(events: TraceEvents, host_ranges: np.ndarray) -> list[tuple[int, float, float]]:
    """(step, start, duration) of each ProfilerStep range. The duration is the event's own: an end minus a
    start loses the nanoseconds of epoch timestamps (~1.7e15 us keep 0.25 us in a float64), the
    duration keeps them (ns-resolution traces write both with 3 decimals)."""
    numbers = [profiler_step_number(n) for n in events.names]
    is_step = events.names_matching(lambda n: profiler_step_number(n) is not None) & host_ranges
    seen: dict[int, tuple[int, float, float]] = {}
    for index in np.flatnonzero(is_step):
        step = numbers[events.name_id[index]]
        if step not in seen:  # a step annotated twice (e.g. a nested profiler) counts once
            seen[step] = (step, float(events.start_us[index]), float(events.dur_us[index]))
    return sorted(seen.values(), key=lambda w: w[1])


def _train_step_windows(events: TraceEvents, host_ranges: np.ndarray) -> list[tuple[int, float, float]]:
    is_step = events.names_matching(lambda n: n == TRAIN_STEP) & host_ranges
    starts, durs = events.start_us[is_step], events.dur_us[is_step]
    return [(index, float(s), float(d)) for index, (s, d) in enumerate(zip(starts, durs))]


def _phase_times_ms(events: TraceEvents, phase_masks: dict[str, np.ndarray],
                    start_us: float, end_us: float) -> dict[str, float]:
    inside = (events.start_us >= start_us) & (events.start_us < end_us)
    times = {}
    for phase, mask in phase_masks.items():
        selected = mask & inside
        if selected.any():
            times[phase] = float(events.dur_us[selected].sum()) / 1000.0
    return times
