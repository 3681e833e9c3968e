"""What profiling cost one rank, from its step metrics (metrics/rank<R>.jsonl, trainer/metrics.py):
step times of the steady steps before the first profiled step, inside the windows (the steps marked
`profiled`: warmup + active) and after the last window, each compared with the steps before, as the
difference of medians (percent) with a bootstrap interval.

Steady steps leave out the first WARMUP_STEPS steps (compilation, CUDA graph recording, the allocator's
first growth). The steps between two windows are in neither "before" nor "after". A run whose steps after
its last window are more than SLOWER_WARN_PCT slower than before it (interval above zero) most likely kept
CUPTI subscribed after profiling (TEARDOWN_CUPTI not 1: traces/cupti.py); the warning says so
(analysis/cross_rank/records.py).

`median_difference` is also the benchmark's statistic (bench/profiler_overhead.py): it takes groups of
step times (one per run) and resamples runs, then steps within each run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from fleetscope.traces.formats import StepRecord, is_steady

WARMUP_STEPS = 3
"""Steps 0..2 are never steady (compilation, CUDA graph recording and warm-up): a comparison of medians to the
percent needs more warm-up left out than the one step traces/formats.py is_steady leaves out by default."""
SLOWER_WARN_PCT = 3.0
"""Steps after the last window this much slower than before the first (interval above 0) are called out."""
RESAMPLES = 1000
CONFIDENCE = 0.95
MAX_BOOTSTRAP_STEPS = 5000
"""Steps of one run a bootstrap resamples at most: a longer run is thinned to this many by an even stride (the
interval of a median over thousands of steps is already narrow; resampling a million steps 1,000 times would take
minutes)."""
MIN_STEPS = 3
"""Fewer steps than this in a phase: no comparison for it."""


@dataclass(frozen=True, kw_only=True)
class Difference:
    """Median of one set of step times against a reference, percent: 100 * (median / reference median - 1)."""

    median_pct: float
    low_pct: float
    high_pct: float
    """The bootstrap interval (CONFIDENCE) of median_pct."""


@dataclass(frozen=True, kw_only=True)
class Phase:
    steps: list[int]
    median_ms: float | None
    """Median step_time_ms over `steps` (None: no step)."""


@dataclass(frozen=True, kw_only=True)
class ProfilingCost:
    first_profiled_step: int
    last_profiled_step: int
    before: Phase
    """Steady unprofiled steps before the first window (from step WARMUP_STEPS)."""
    inside: Phase
    """Profiled steps (the windows' warmup and active steps)."""
    after: Phase
    """Unprofiled steps after the last window."""
    after_vs_before: Difference | None
    inside_vs_before: Difference | None
    excluded: str = f"steps 0-{WARMUP_STEPS - 1} (compilation, warm-up) and steps between windows"


def median_difference(groups: Sequence[Sequence[float]], reference: Sequence[Sequence[float]], *,
                      resamples: int = RESAMPLES, seed: int = 0) -> Difference | None:
    """Difference of the pooled medians of `groups` and `reference` (lists of step times, one per run), with a
    percentile bootstrap interval that resamples runs, then steps within each run. None if either side is empty."""
    groups = [np.asarray(g, dtype=np.float64) for g in groups if len(g)]
    reference = [np.asarray(g, dtype=np.float64) for g in reference if len(g)]
    if not groups or not reference:
        return None
    rng = np.random.default_rng(seed)
    sampled = (_bootstrap_medians([_thinned(g) for g in groups], resamples, rng)
               / _bootstrap_medians([_thinned(g) for g in reference], resamples, rng))
    low, high = np.quantile(100.0 * (sampled - 1.0), [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    point = float(np.median(np.concatenate(groups)) / np.median(np.concatenate(reference)))
    return Difference(median_pct=round(100.0 * (point - 1.0), 3), low_pct=round(float(low), 3),
                      high_pct=round(float(high), 3))


def _thinned(values: np.ndarray) -> np.ndarray:
    """At most MAX_BOOTSTRAP_STEPS of a run's step times, every k-th (the point estimate keeps all of them)."""
    stride = -(-values.size // MAX_BOOTSTRAP_STEPS)
    return values[::stride] if stride > 1 else values


def _bootstrap_medians(groups: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    if len(groups) == 1:  # one run (a report's rank): resample its steps, all at once
        values = groups[0]
        return np.median(rng.choice(values, size=(resamples, len(values))), axis=1)
    medians = np.empty(resamples)
    for index in range(resamples):
        chosen = rng.integers(0, len(groups), size=len(groups))
        medians[index] = np.median(np.concatenate([rng.choice(groups[g], size=len(groups[g])) for g in chosen]))
    return medians


def profiling_cost(records: Sequence[StepRecord]) -> ProfilingCost | None:
    """One rank's before / inside / after comparison; None when no step was profiled or times are missing."""
    timed = sorted((r.step, r.step_time_ms, r.profiled) for r in records if r.step_time_ms is not None)
    profiled = [step for step, _, was_profiled in timed if was_profiled]
    if not profiled:
        return None
    first, last = profiled[0], profiled[-1]
    # past warm-up: the steady steps and the profiled ones that would be steady were they not profiled
    past_warmup = is_steady([s for s, _, _ in timed], 0, False, warmup_steps=WARMUP_STEPS).tolist()
    steady = [point for point, kept in zip(timed, past_warmup) if kept]
    before = _phase([(s, ms) for s, ms, p in steady if s < first and not p])
    inside = _phase([(s, ms) for s, ms, p in steady if p])
    after = _phase([(s, ms) for s, ms, p in steady if s > last and not p])
    return ProfilingCost(first_profiled_step=first, last_profiled_step=last, before=before, inside=inside,
                         after=after, after_vs_before=_compare(after, before, steady),
                         inside_vs_before=_compare(inside, before, steady))


def _phase(points: list[tuple[int, float]]) -> Phase:
    return Phase(steps=[s for s, _ in points],
                 median_ms=round(float(np.median([ms for _, ms in points])), 4) if points else None)


def _compare(phase: Phase, before: Phase, steady: list[tuple[int, float, bool]]) -> Difference | None:
    if len(phase.steps) < MIN_STEPS or len(before.steps) < MIN_STEPS:
        return None
    times = {s: ms for s, ms, _ in steady}
    return median_difference([[times[s] for s in phase.steps]], [[times[s] for s in before.steps]])


def slower_after(cost: ProfilingCost | None) -> bool:
    """Steps after the last window more than SLOWER_WARN_PCT slower than before the first, beyond noise."""
    difference = cost.after_vs_before if cost is not None else None
    return difference is not None and difference.median_pct > SLOWER_WARN_PCT and difference.low_pct > 0
