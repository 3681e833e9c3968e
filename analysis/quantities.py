"""The one definition of each quantity fleetscope prints: the report, advise, both compare forms, history,
the gate and the merged trace's counters all take their numbers from these functions, and print the basis
string next to them ("trace, profiled steps 2-3, 6-7, slowest rank per step").

step time, trace         per profiled step (a `ProfilerStep#N` or `train_step` range), the slowest rank's step
                         time: a synchronous job's step ends when its last rank's does. A rank's step time is
                         its host range, or the GPU's span where the GPU bounds the step (the host ran ahead of
                         the queue: per_rank/steps.py StepTiming). The run's figure is the StepStats of those
                         per-step times (median first). `trace_step_times`.
step time, step metrics  per steady step, the slowest rank's `step_time_ms`; the run's figure is the median over
                         steady steps. Steady steps: every step of a rank's metrics except its first (start-up,
                         compilation) and those recorded inside a profiler window (`profiled`: the profiler's own
                         cost); traces/formats.py `is_steady`, the one rule. `metrics_step_times`.
waiting                  of a rank in a step: the time inside at least one of its waits at the step's
                         collectives (a wait: from its arrival to the last rank's), so collectives in flight
                         together (DDP's gradient buckets) count once: the union, never the sum. `union_us`,
                         `union_by_step_us`; stragglers.py `waiting_by_step` applies it to the arrivals.
waiting caused           by a late rank at a collective: the stretch before its arrival by which it was later
                         than the others (their median arrival), less what it inherited from an earlier
                         collective it was also last at (causes.py); per step the union of those stretches,
                         clamped to [0, step time - the step's compute floor]. `clamp_caused_wait_ms`.
compute floor            of a step, for a late rank: the larger of what its other ranks computed between the
                         step's collectives (the median over them per collective, summed; causes.py) and each
                         other rank's step time less its waiting in the step (its own work, which stays were
                         the late rank on time); with step metrics, also the steady step less its exposed
                         gradient communication (`metrics_floor_ms`). No what-if goes below it.
own work                 of a rank in a step, step metrics: its step time less its exposed gradient communication
                         (where it waits for a later rank); `status` names the rank with the most as the one the
                         others wait for. traces/formats.py `own_work_ms`, there because launcher/ (the live
                         status) may not import analysis/; `metrics_floor_ms` applies it to the job's medians.
stands out               a rank's lateness, when its mean signed lateness vs peers per profiled step reaches the
                         one-sided Student t quantile at 5% / ranks against the larger of its own step-to-step
                         spread and (3+ ranks) the other ranks'; only then is it named a straggler, with a
                         confidence bounded by its steps and ranks (low below 4 steps, high from 8 steps of 3+
                         ranks). stragglers.py `significance`, `straggler_confidence`.
what-if                  of a late rank in a step: the step's time less what replaying it through its dependency
                         model (analysis/whatif: each rank's compute between the step's collectives, each
                         collective's transfer from its last arrival) saves with that rank's compute at its peers'
                         lower median, everything else as recorded (WHAT_IF_REPLAYED). The saving, not the
                         replayed time itself: what the model does not hold (a collective that ends past its
                         step's range, launch gaps) stays as measured. Where the model cannot hold the step (ranks
                         issued different collectives, pipeline sends/receives), the step's time less the waiting
                         the rank caused in it (WHAT_IF_ARITHMETIC), said so with the reason. Either kept within
                         [compute floor, step]. `replayed_what_if_ms`, `bounded_what_if_ms`, `what_if_text`.
gain                     ms per step a change could save, never more than the step it is taken from less that
                         step's floor; its percentage is of a denominator printed beside it (`Gain`).
gain, whole run          of a rank the whole run finds slow (cross_rank/whole_run.py), ms per step: its excess
                         over its peers' median in the signal that names it (input wait, arrival at the first
                         collective, step time), median over the episode's steady steps (what the others wait for
                         it each step), of the episode's steady step time (slowest rank per step, median), bounded
                         as every gain. `whole_run_gain`.
profiled window          named everywhere by `window_name` ("window 0 (profiled steps 1-4)"): the steps its trace
                         recorded, the warm-up left out; windows that touch stay apart (`profiled_steps_text`).
percentage metrics       (`*_pct`): compared in percentage points, never as a relative change (`is_share`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from fleetscope.traces.formats import STEP_SOURCE_CAPTURE, StepRecord, own_work_ms
from fleetscope.traces.validate import finite

BASIS_TRACE = "trace"
BASIS_STEP_METRICS = "step metrics"
SLOWEST_RANK = "slowest rank per step"


def step_ranges(steps: Iterable[int]) -> str:
    """2, 3, 4, 7, 9, 10 -> "2-4, 7, 9-10" (steps sorted, duplicates once)."""
    runs: list[tuple[int, int]] = []
    for step in sorted(set(int(s) for s in steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return ranges_text(runs)


def ranges_text(runs: list[tuple[int, int]]) -> str:
    """Sorted, disjoint runs (first, last) -> "2-4, 7, 9-10": each run in full however long; more than 8 runs
    read as the first 4, "...", the last 3 (the bound is on the runs printed, not on the numbers they hold)."""
    if not runs:
        return "none"
    parts = [str(first) if first == last else f"{first}-{last}" for first, last in runs]
    if len(parts) > 8:
        parts = parts[:4] + ["..."] + parts[-3:]
    return ", ".join(parts)


def absent_runs(size: int, present: Iterable[int]) -> list[tuple[int, int]]:
    """The runs of 0..size-1 not in `present`: at most one more than the present numbers, whatever `size` a
    file declares, so a declared world of a million ranks costs no more than the traces found."""
    runs, start = [], 0
    for number in sorted({int(p) for p in present if 0 <= int(p) < size}):
        if number > start:
            runs.append((start, number - 1))
        start = number + 1
    if start < size:
        runs.append((start, size - 1))
    return runs


def window_name(window: int | None, steps: Iterable[int]) -> str:
    """A profiled window as every section names it (module docstring)."""
    return f"{'window' if window is None else f'window {window}'} (profiled steps {step_ranges(steps)})"


def profiled_steps_text(steps_by_window: Iterable[Iterable[int]]) -> str:
    """"1-4, 6-9": each window's steps as step_ranges gives them, in step order; two windows that touch stay two
    ranges ("1-4, 5-8"), as the windows are named."""
    windows = sorted((sorted(set(int(s) for s in steps)) for steps in steps_by_window), key=lambda s: s[:1])
    parts = [part for steps in windows if steps for part in step_ranges(steps).split(", ")]
    if not parts:
        return "none"
    return ", ".join(parts if len(parts) <= 8 else parts[:4] + ["..."] + parts[-3:])


def is_share(metric_name: str) -> bool:
    """A percentage metric (`*_pct`): its change is told in points, not as a relative change."""
    return metric_name.endswith("_pct")


def pct_of(part: float | None, whole: float | None) -> float | None:
    """100 x part / whole; None when either is unknown or whole is not positive."""
    if part is None or whole is None or not whole > 0:
        return None
    return 100.0 * part / whole


# -- step time, trace --------------------------------------------------------------------------------


def trace_step_times(windows) -> dict[tuple[int | None, int], float]:
    """(window, step) -> the slowest rank's wall time of that profiled step, ms (module docstring)."""
    times: dict[tuple[int | None, int], float] = {}
    for window in windows:
        for rank in window.ranks:
            for step in rank.steps:
                key = (window.window, step.step)
                times[key] = max(times.get(key, 0.0), float(step.step_time_ms))
    return times


def trace_basis(windows) -> str:
    """"trace, profiled steps 2-3, 6-7, slowest rank per step" (windows named when there are several)."""
    times = trace_step_times(windows)
    steps = sorted({step for (_, step) in times})
    if not steps:
        return f"{BASIS_TRACE}: no profiled steps"
    sources = {rank.step_source for window in windows for rank in window.ranks if rank.steps}
    if sources == {STEP_SOURCE_CAPTURE}:
        return f"{BASIS_TRACE}, the whole capture as one step (no step markers), {SLOWEST_RANK}"
    by_window: dict = defaultdict(list)
    for window, step in times:
        by_window[window].append(step)
    return f"{BASIS_TRACE}, profiled steps {profiled_steps_text(by_window.values())}, {SLOWEST_RANK}"


# -- step time, step metrics -------------------------------------------------------------------------


def metrics_step_times(steady: Mapping[int, list[StepRecord]], key: str = "step_time_ms") -> dict[int, float]:
    """step -> the slowest rank's value of the StepRecord field `key` in that steady step (ms)."""
    by_step: dict[int, float] = {}
    for records in steady.values():
        for record in records:
            value = getattr(record, key)
            if value is not None:
                by_step[record.step] = max(by_step.get(record.step, value), value)
    return by_step


def metrics_step_time_ms(steady: Mapping[int, list[StepRecord]], key: str = "step_time_ms") -> float | None:
    """The run's step time from step metrics: the median over steady steps of the slowest rank's value."""
    values = list(metrics_step_times(steady, key).values())
    return float(np.median(values)) if values else None


PROFILED_UNREPRESENTATIVE_PCT = 20.0
"""Profiled steps this much slower than the run's steady steps are not representative of the run: the verdict
says so first (the profiler's own cost, or windows that caught unusual steps)."""


def profiled_excess_pct(profiled_ms: float | None, run_ms: float | None) -> float | None:
    """How much slower the profiled steps are than the run's steady ones, in percent (None: either unknown)."""
    if profiled_ms is None or run_ms is None or not run_ms > 0 or finite(profiled_ms) is None:
        return None
    return 100.0 * (profiled_ms / run_ms - 1.0)


def metrics_basis(steady: Mapping[int, list[StepRecord]]) -> str:
    steps = metrics_step_times(steady)
    if not steps:
        return f"{BASIS_STEP_METRICS}: no steady steps"
    return f"{BASIS_STEP_METRICS}, steady steps {step_ranges(steps)} ({len(steps)}), {SLOWEST_RANK}"


# -- waiting, what-if, gain --------------------------------------------------------------------------


def union_us(starts_us, ends_us) -> float:
    """Time inside at least one of the intervals [start, end), us; non-finite or empty ones add nothing."""
    starts, ends = np.asarray(starts_us, dtype=np.float64), np.asarray(ends_us, dtype=np.float64)
    keep = np.isfinite(starts) & np.isfinite(ends) & (ends > starts)
    if not keep.any():
        return 0.0
    order = np.argsort(starts[keep], kind="stable")
    starts, ends = starts[keep][order], ends[keep][order]
    # in start order, each interval adds only what reaches past every earlier end
    reach = np.concatenate(([-np.inf], np.maximum.accumulate(ends)[:-1]))
    return float(np.sum(np.maximum(ends - np.maximum(starts, reach), 0.0)))


def union_by_step_us(steps, starts_us, ends_us) -> dict[int, float]:
    """step -> `union_us` of the intervals of that step (the waiting of one rank per step, module docstring)."""
    steps, starts, ends = np.asarray(steps), np.asarray(starts_us, dtype=np.float64), np.asarray(ends_us, dtype=np.float64)
    return {int(step): union_us(starts[steps == step], ends[steps == step]) for step in np.unique(steps)}


def metrics_floor_ms(step_ms: float | None, comm_exposed_ms: float | None) -> float | None:
    """The compute floor step metrics give: the steady step less its exposed gradient communication (which holds
    any waiting for a late rank), each the slowest rank's per step, median; None when either is unknown."""
    return own_work_ms(step_ms, comm_exposed_ms)


def clamp_caused_wait_ms(caused_ms: float, step_ms: float, floor_ms: float | None) -> float:
    """The waiting a rank caused in a step, clamped to [0, step - floor] (module docstring)."""
    floor = min(max(floor_ms or 0.0, 0.0), step_ms)
    return float(min(max(caused_ms, 0.0), max(step_ms - floor, 0.0)))


WHAT_IF_REPLAYED = "replayed"
WHAT_IF_ARITHMETIC = "arithmetic"
"""The basis of a what-if (module docstring): the replayed step, or the step less the waiting caused."""


def replayed_what_if_ms(step_ms: float, saving_ms: float) -> float:
    """The step less the replay's saving (module docstring)."""
    return step_ms - saving_ms


def bounded_what_if_ms(what_if_ms: float, step_ms: float, floor_ms: float | None) -> float:
    """A what-if within [compute floor, step] (module docstring): no change makes a step longer than it was, and
    the others' own work stays."""
    floor = min(max(floor_ms or 0.0, 0.0), step_ms)
    return float(min(max(what_if_ms, floor), step_ms))


def what_if_text(rank: int, basis: str, note: str = "") -> str:
    """What a what-if is, printed beside its figure."""
    if basis == WHAT_IF_REPLAYED:
        return f"replayed without rank {rank}'s extra compute (its compute at its peers' lower median)"
    reason = f"; not replayed: {note}" if note else ""
    return f"were rank {rank} on time (the step less the waiting it caused{reason})"


@dataclass(frozen=True, kw_only=True)
class Gain:
    """A saving per step and what its percentage is of."""

    ms: float
    of_ms: float
    basis: str
    """Where the denominator comes from ("step metrics, steady steps 4-9 (6), slowest rank per step")."""

    @property
    def pct(self) -> float:
        return 100.0 * self.ms / self.of_ms

    def text(self) -> str:
        return f"{self.ms:.2f} ms/step ({self.pct:.0f}% of {self.of_ms:.2f} ms, {self.basis})"


def bounded_gain(gain_ms: float | None, of_ms: float | None, basis: str, floor_ms: float = 0.0) -> Gain | None:
    """A gain no larger than its step less the step's floor, nor below 0; None when either is unknown."""
    if gain_ms is None or of_ms is None or not of_ms > 0 or finite(gain_ms) is None:
        return None
    ceiling = max(of_ms - max(floor_ms, 0.0), 0.0)
    return Gain(ms=float(min(max(gain_ms, 0.0), ceiling)), of_ms=float(of_ms), basis=basis)


def whole_run_gain(excess_ms: float | None, step_ms: float | None, basis: str, floor_ms: float = 0.0) -> Gain | None:
    """The gain of a slow rank the whole run finds (module docstring "gain, whole run")."""
    return bounded_gain(excess_ms, step_ms, basis, floor_ms)


# -- who the others wait for -------------------------------------------------------------------------

CONSISTENT_WINDOW_SHARE = 0.5
"""The job's straggler is the same rank as each window's consistent straggler in at least this share of windows."""


@dataclass(frozen=True, kw_only=True)
class JobStraggler:
    """The rank that causes the most waiting over all windows (stragglers.py's caused_wait_us summed)."""

    rank: int
    caused_us: float
    share: float
    """Of all waiting caused, all windows."""
    times_last: int
    collectives: int
    consistent: bool
    """Every window with a consistent straggler names this rank, and at least half the windows have one:
    the verdict calls it "the straggler"; otherwise "causes the most waiting"."""
    windows: tuple[int | None, ...]
    """Windows where it causes the most waiting."""


def job_straggler(windows) -> JobStraggler | None:
    """The verdict's rank (module docstring of this class); None when no rank was ever last."""
    caused: dict[int, float] = defaultdict(float)
    last: dict[int, int] = defaultdict(int)
    taken: dict[int, int] = defaultdict(int)
    top_in: dict[int, list] = defaultdict(list)
    for window in windows:
        waits = window.stragglers.by_wait
        for wait in waits:
            caused[wait.rank] += wait.caused_wait_us
            last[wait.rank] += wait.times_last
            taken[wait.rank] += wait.collectives
        if waits:
            leader = max(waits, key=lambda w: (w.caused_wait_us, -w.rank))
            if leader.caused_wait_us > 0:
                top_in[leader.rank].append(window.window)
    total = sum(caused.values())
    if not caused or total <= 0:
        return None
    top = max(caused, key=lambda r: (caused[r], -r))
    if last[top] == 0:
        return None
    named = [w.stragglers.waited_for_rank for w in windows if w.stragglers.consistent]
    consistent = bool(named) and all(r == top for r in named) and len(named) >= CONSISTENT_WINDOW_SHARE * len(windows)
    return JobStraggler(rank=top, caused_us=caused[top], share=caused[top] / total, times_last=last[top],
                        collectives=taken[top], consistent=consistent, windows=tuple(top_in.get(top, ())))
