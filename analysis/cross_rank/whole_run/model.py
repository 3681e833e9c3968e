"""The whole-run section's types and the constants that tune the scan and the findings (the package's
docstring defines the quantities)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


from fleetscope.analysis.cross_rank.stragglers import Significance
from fleetscope.analysis.quantities import window_name
from fleetscope.traces.change_points import MIN_SEGMENT_STEPS



STEP_BLOCK = 2048
"""Steps read at once across all ranks."""
CHUNK_VALUES = 1 << 18
"""Values of one field across ranks and steps figured at once: a chunk's arrays (1-2 MiB) stay in a core's
cache from one operation to the next; a whole block's (8-16 MiB at 1,024 ranks) go to memory and back."""
WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Threads of the pass and of the change-point searches. numpy lets go of the interpreter in its loops, so a
block's parts (ranks to read, steps to figure) run side by side; a step's figures depend on that step's
records alone and a rank's search on its own series, so the results do not depend on the count."""
MAX_RANK_BINS = 256
MAX_STEP_BINS = 200
SLOW_EXCESS = 0.05
"""A rank this far above its peers (5% of the step time) is slow."""
NOISE_FLOOR = 0.005
"""A signal's noise is taken as at least this share of the median step time (0.5%): a signal that never moves
(an input wait of 0 at every step) weighs much, not infinitely."""
MIN_NOISE_VALUES = 8
"""Fewer known excesses of a signal on a rank than this in the first block: its noise is the ranks' median."""
MIN_SLOW_STEPS = 10
SHORT_SLOW_STEPS = MIN_SEGMENT_STEPS
"""A shorter slow stretch (down to the shortest segment the search makes) counts when it stands SHORT_SIGMAS
of the rank's step-to-step noise above its peers: a straggle of 8 steps is found, and a chance split near
the run's edge, a few noise scales high, is not (1 of tests/test_cross_rank_whole_run.py's 50 stationary runs had one)."""
SHORT_SIGMAS = 5.0
MAX_CHANGES_SHOWN = 200
PROFILE_STEPS = 3
"""Steps the suggested `fleetscope profile` command records."""
SOURCE_TIMELINE = "timeline"
EVIDENCE_SOURCE = "whole run (timeline)"
"""What a finding resting on this section names as its source (advise's straggler rule; invariants.py)."""
SOURCE_JSONL = "step metrics (jsonl)"
STATUS_OK = "ok"
STATUS_NOT_RECORDED = "not recorded"


@dataclass(frozen=True, kw_only=True)
class Heatmap:
    """Rank bins x step bins of a mean value (None: no value in the cell)."""

    quantity: str
    unit: str
    binning: str
    rank_bins: list[list[int]]
    """[first rank, last rank] of each row."""
    step_bins: list[list[int]]
    """[first step, last step] of each column."""
    values: list[list[float | None]]


@dataclass(frozen=True, kw_only=True)
class SlowRank:
    rank: int
    from_step: int
    to_step: int
    to_the_end: bool
    signal: str
    """What it did that its peers did not (one of SIGNALS): of the signals, the one with the largest excess."""
    excess_ms: float
    """Median over the segment's steady steps of its excess over its peers' median in `signal`, ms."""
    baseline_ms: float
    """The median rank's steady step time before the change (see _baseline_ms)."""
    excess_pct: float
    """excess_ms in percent of baseline_ms: a size, not a share (it may exceed 100)."""
    job_step_change_ms: float | None
    """The median rank's step time over the segment less baseline_ms: near excess_ms when every rank waits
    for this one (synchronous data parallelism), near 0 when only this rank's steps are longer."""
    steps: int
    last_pct: float | None
    """Of those steps with known lateness, how often its step ended last."""
    first_collective_last_pct: float | None
    """Of those steps with known arrival at the first collective, how often it arrived last."""
    median_lateness_ms: float | None
    windows: list[str]
    """Profiled windows whose steps it covers."""
    sentence: str
    step_ms: float | None = None
    """The episode's steady step time: median over its steady steps of the slowest rank's step_ms."""
    significance: Significance | None = None
    """Whether its per-step excess in `signal` stands out from its own step-to-step spread (stragglers.py
    series_significance: the rule that names a straggler in the profiled steps, on the episode's steady steps)."""
    to_record: str = ""
    """How to record a window over its first steps (RecordSuggestion.to_record)."""

    @property
    def time_lost_ms(self) -> float:
        """What it cost the run: its excess per step times its steady steps (the measure of `largest_episode`)."""
        return self.excess_ms * self.steps


CONSISTENT_STEPS_SHARE = 0.5
"""An episode covering at least this share of the run's steady steps shows its rank consistently late
(`run_straggler`); a shorter one is a stretch of the run (on a loaded host, 14 such on 2 ranks of 2,500 steps),
and a t inside a stretch the search picked for being high proves nothing about the run."""


def run_straggler(section: WholeRun | None) -> SlowRank | None:
    """The rank the whole run shows consistently late: of the episodes that stand out from their own spread and
    cover CONSISTENT_STEPS_SHARE of the run's steady steps, the one that cost the most time (None: none)."""
    if section is None or not section.steady_steps:
        return None
    return largest_episode([s for s in section.slow_ranks if s.significance is not None and s.significance.stands_out
                            and s.steps >= CONSISTENT_STEPS_SHARE * section.steady_steps])


def largest_episode(episodes: list[SlowRank]) -> SlowRank | None:
    """The episode that cost the run the most time (time_lost_ms); a short large one and a long small one are
    compared by what each cost, not by its size alone."""
    return max(episodes, key=lambda e: (e.time_lost_ms, -e.rank, -e.from_step), default=None)


MIN_CHANGE_LEVEL = 0.01
"""A change point whose excess level moves by less than this (1% of the median step time) is no finding: on a
long, quiet run the search resolves shifts far below what a user would act on ("1.00 -> 1.00")."""


@dataclass(frozen=True, kw_only=True)
class ChangePoint:
    """A change in a rank's excess level: 1 + its noise-weighted mean excess over its peers / the median step
    time."""

    rank: int
    step: int
    level_before: float
    level_after: float


def sized_changes(changes: list[ChangePoint]) -> list[ChangePoint]:
    """The change points whose level moved by at least MIN_CHANGE_LEVEL."""
    return [c for c in changes if abs(c.level_after - c.level_before) >= MIN_CHANGE_LEVEL]


@dataclass(frozen=True, kw_only=True)
class WindowCheck:
    """One profiled window against the run."""

    first_step: int
    last_step: int
    median_ms: float | None
    """Median over its steps of the slowest rank's step_ms (profiler overhead included)."""
    between_median_ms: float | None
    """Median of the steady steps from the previous window (or the start) to this one, same basis."""
    percentile_pct: float | None
    """Where median_ms falls among the run's steady step times."""
    window: int | None = None
    """The window's number in the run's manifest (None: the manifest does not list it)."""
    profiled_steps: list[int] = field(default_factory=list)
    """The steps its traces recorded, the warm-up left out (the manifest's; empty: not listed)."""

    @property
    def label(self) -> str:
        return _window_text(self.first_step, self.last_step, self.window, self.profiled_steps)


@dataclass(frozen=True, kw_only=True)
class WholeRun:
    status: str
    reason: str = ""
    sources: dict[str, list[int]] = field(default_factory=dict)
    """source -> ranks read from it."""
    ranks: int = 0
    first_step: int | None = None
    last_step: int | None = None
    steady_steps: int = 0
    step_time_ms: float | None = None
    """Median over steady steps of the slowest rank's step_ms."""
    median_rank_step_ms: float | None = None
    """Median over steady steps of the median rank's step_ms."""
    basis: str = ""
    lateness_basis: str = ""
    slow_ranks: list[SlowRank] = field(default_factory=list)
    changes: list[ChangePoint] = field(default_factory=list)
    changes_total: int = 0
    changes_below_size: int = 0
    """Change points found whose level moved by less than MIN_CHANGE_LEVEL (left out of changes and the total)."""
    windows: list[WindowCheck] = field(default_factory=list)
    drift: str = ""
    representative: str = ""
    step_time_map: Heatmap | None = None
    lateness_map: Heatmap | None = None
    verdict: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Window:
    first: int
    last: int
    window: int | None = None
    steps: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return _window_text(self.first, self.last, self.window, self.steps)


def _window_text(first: int, last: int, window: int | None, steps) -> str:
    """The window's name as every section gives it (quantities.py window_name), then the steps the profiler was
    on; only the latter where the manifest does not list the window."""
    on = window_label(first, last)
    return f"{window_name(window, steps)}; {on}" if steps else on


def window_label(first: int, last: int) -> str:
    """A window as the timelines see it: the steps the profiler was on, its warm-up included (the report's
    header names the steps the trace recorded, "profiled steps 2-3" of a window on in steps 1-3)."""
    return f"profiler on in steps {first}-{last}" if last > first else f"profiler on in step {first}"
