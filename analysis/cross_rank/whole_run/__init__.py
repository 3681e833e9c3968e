"""The report's `whole_run` section: every step of every rank from the whole-run timelines, no traces.

Sources, per rank: `metrics/rank<R>.timeline` (traces/timeline.py), else its step metrics
`metrics/rank<R>.jsonl` (older runs: no start times, so no lateness for that rank). A file that cannot be
used is named in `notes` and the other ranks are analyzed.

Definitions (steady steps and the slowest rank per step as analysis/quantities.py defines step time):
  steady step          traces/formats.py is_steady: not the rank's first (FLAG_FIRST, or its lowest step), not profiled
  median step time     per step, the median over ranks of their steady step_ms
  peers' median        per step, the median of a value over the other ranks that know it (leaving the rank
                       out: of two ranks, the median of both would halve a straggler's excess)
  excess               a rank's value less its peers' median that step, ms, in three signals: step time
                       (step_ms), input wait (data_ms), late at the first collective (its aligned arrival at
                       the first collective); under synchronous data parallelism the peers wait for a
                       straggler inside their own steps, so every rank's step time rises together and only
                       the input wait or the arrival shows who they wait for
  signal noise         per rank and signal, the robust step-to-step spread of its excess (MAD of successive
                       differences: a level shift moves one of them) over the run's first STEP_BLOCK steps,
                       at least NOISE_FLOOR of the median step time
  excess level         1 + the noise-weighted mean of a rank's known excesses that step (each signal weighted by
                       1 / its noise on that rank) over the median step time: the series whose change points
                       (traces/change_points.py) delimit the segments. A mean, not the largest: the largest of
                       a step time level with the peers' and an arrival spread around it is half-rectified
                       noise, which the search's robust noise scale underrates. Weighted: with equal weights a
                       signal that is noise on this host (arrivals spread by +-40 ms on a loaded machine)
                       drowns a clean one (a late input of 40 ms), and 1 / noise makes the mean's shift, in its
                       own noise, that of the signal that moved. A segment is looked at when its level is
                       SLOW_EXCESS x the smallest weight share up (what one signal SLOW_EXCESS up makes of the
                       mean), then sized per signal
  slow rank            a segment at least SLOW_EXCESS above its peers for at least MIN_SLOW_STEPS steady steps
                       (SHORT_SLOW_STEPS when it stands SHORT_SIGMAS noise scales high),
                       named by the signal with the largest median excess over it and sized as that excess
                       in percent of the median rank's steady step time before the change
  profiled window      a run of consecutive steps that some rank recorded with FLAG_PROFILED

Scale: records are read in blocks of STEP_BLOCK steps across all ranks (a few hundred MB at most at 1,024
ranks); what stays for the whole run is one float16 log excess level per rank and step, per-step figures
(with each signal's order statistics, for the peers' median), and the binned heatmaps. A block's ranks are
read, and its steps figured in chunks of CHUNK_VALUES, on WORKERS threads. A timeline's records are checked
as the pass reads them (read_timeline checks every record as it opens the file, which cost a fifth of the
analysis): one with a record that cannot be true has the whole run read again the checked way, so that the
record is named and left out exactly as before. The change-point search runs once per rank, on the excess
level, not once per signal: at 1,024 ranks x 100,000 steps each search costs ~5 ms, so per signal it would
cost ~10 s more (bench/whole_run_scale.py).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from fleetscope.analysis.cross_rank.stragglers import Significance, series_significance
from fleetscope.analysis.quantities import BASIS_STEP_METRICS, SLOWEST_RANK, step_ranges, window_name
from fleetscope.traces.change_points import MIN_SEGMENT_STEPS, Segment, segment_levels
from fleetscope.traces.formats import is_steady
from fleetscope.analysis.inputs.records import RunRecords, StepMetricsFile
from fleetscope.analysis.inputs.timelines import TimelineSource, records_into, runs_of
from fleetscope.traces.jobfile import FINAL_STATUSES
from fleetscope.traces.timeline import (
    FLAG_FIRST,
    FLAG_PROFILED,
    MAX_START_US,
    MAX_STEP_MS,
    MAX_TIMELINE_STEP,
    TIMELINE_DTYPE,
    valid_records,
)

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
the run's edge, a few noise scales high, is not (1 of tests/test_whole_run.py's 50 stationary runs had one)."""
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


# -- reading ---------------------------------------------------------------------------------------------


_Source = TimelineSource
"""One rank's records (inputs/timelines.py): a timeline's, or its step metrics' held in memory."""


def _jsonl_source(records: RunRecords, metrics_file: StepMetricsFile, notes: list[str]) -> _Source | None:
    layout, path, rank, metrics = records.layout, metrics_file.path, metrics_file.rank, metrics_file.read
    if metrics is None:
        notes.append(f"{layout.relative(path)}: not used ({metrics_file.error[:200]})")
        return None
    if metrics.bad_line_count:
        notes.append(f"{layout.relative(path)}: {metrics.bad_line_count} line(s) left out")
    usable = [r for r in metrics.records if r.step_time_ms is not None and r.step_time_ms > 0]
    beyond = sum(r.step > MAX_TIMELINE_STEP for r in usable)
    if beyond:
        notes.append(f"{layout.relative(path)}: {beyond} record(s) with a step beyond {MAX_TIMELINE_STEP:,} left out")
        usable = [r for r in usable if r.step <= MAX_TIMELINE_STEP]
    if not usable:
        return None
    records = np.zeros(len(usable), dtype=TIMELINE_DTYPE)
    records["step"] = [r.step for r in usable]
    records["flags"] = [FLAG_PROFILED if r.profiled else 0 for r in usable]
    records["start_us"] = math.nan
    records["step_ms"] = [r.step_time_ms for r in usable]
    records["data_ms"] = [math.nan if r.data_ms is None else r.data_ms for r in usable]
    records["first_collective_ms"] = records["exposed_comm_ms"] = math.nan
    steps = records["step"].astype(np.int64)
    return _Source(rank=rank, runs=runs_of(steps, np.arange(steps.size)), records=records,
                   lowest_step=int(steps.min()))


def _sources(run: RunRecords, notes: list[str], check_records: bool) -> dict[int, _Source]:
    sources = run.timelines.sources(notes, check_records=check_records) if run.timelines is not None else {}
    for metrics_file in run.step_metrics:
        if metrics_file.rank not in sources:
            source = _jsonl_source(run, metrics_file, notes)
            if source is not None:
                sources[metrics_file.rank] = source
    notes += run.clock_problems
    return {rank: _with_offset(source, run.clock) for rank, source in sorted(sources.items())}


def _with_offset(source: _Source, offsets: dict) -> _Source:
    if source.path is None:
        return source
    if source.rank in offsets:
        offset = offsets[source.rank].offset_us
    else:
        offset = 0.0 if source.rank == 0 else None  # rank 0 is the reference clock
    return dataclasses.replace(source, offset_us=offset)


def _read_block(source: _Source, first: int, out: np.ndarray) -> None:
    """The records of steps [first, first + len(out)) of one rank into `out`, step-indexed (missing: step -1)."""
    out["step"] = -1
    stop = first + out.size
    for run_step, run_record, count in source.runs:
        low, high = max(first, run_step), min(stop, run_step + count)
        if low < high:
            records_into(source, run_record + (low - run_step), out[low - first:high - first])




# -- one pass over the steps -----------------------------------------------------------------------------


SIGNAL_STEP = "step time"
SIGNAL_DATA = "input wait"
SIGNAL_ARRIVAL = "late at the first collective"
SIGNALS = (SIGNAL_STEP, SIGNAL_DATA, SIGNAL_ARRIVAL)
"""What a rank can do that its peers don't, each as its excess over the peers' median of the same step."""
SIGNALS_BY_CAUSE = (SIGNAL_DATA, SIGNAL_ARRIVAL, SIGNAL_STEP)
CAUSE_SLACK = 0.2
"""A signal earlier in SIGNALS_BY_CAUSE is named when its excess is within this share of the largest."""


@dataclass(kw_only=True)
class _Accumulated:
    """What the pass keeps: per step figures, per rank and step the log excess level (float16: 0.1% resolution
    near 1), and the heatmaps' sums."""

    ranks: list[int]
    first_step: int
    steps: int
    rank_bins: int
    step_bins: int
    log_level: np.ndarray = field(init=False)
    """log of 1 + (the noise-weighted mean of the rank's known excesses over its peers, ms) / the median step time
    of the step."""
    weights: np.ndarray = field(init=False)
    """Per rank and signal (SIGNALS order), 1 / the signal's noise on the rank, ms (float32); 0: never known."""
    median_ms: np.ndarray = field(init=False)
    order: dict[str, np.ndarray] = field(init=False)
    """Per signal, per step the order statistics _peer_median needs (4 rows; NaN: the signal unknown)."""
    slowest_ms: np.ndarray = field(init=False)
    """Steady steps: the slowest rank's step_ms (NaN: no steady record)."""
    profiled_slowest_ms: np.ndarray = field(init=False)
    """Profiled steps: the slowest rank's step_ms (NaN: not profiled)."""
    profiled: np.ndarray = field(init=False)
    earliest_end_us: np.ndarray = field(init=False)
    earliest_arrival_us: np.ndarray = field(init=False)
    """The earliest aligned moment any rank reached its first collective (NaN: unknown)."""
    last_rank: np.ndarray = field(init=False)
    """Index into `ranks` of the rank whose step ended last (-1: fewer than two ends known)."""
    first_collective_last: np.ndarray = field(init=False)
    """Index into `ranks` of the rank that reached its first collective last (-1: fewer than two known)."""
    cells: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        n, s = len(self.ranks), self.steps
        self.log_level = np.full((n, s), np.nan, dtype=np.float16)
        self.weights = np.ones((n, len(SIGNALS)), dtype=np.float32)
        self.median_ms, self.slowest_ms, self.profiled_slowest_ms, self.earliest_end_us, self.earliest_arrival_us = (
            np.full(s, np.nan) for _ in range(5))
        self.order = {signal: np.full((4, s), np.nan, dtype=np.float32) for signal in SIGNALS}
        self.profiled = np.zeros(s, dtype=bool)
        self.last_rank = np.full(s, -1, dtype=np.int32)
        self.first_collective_last = np.full(s, -1, dtype=np.int32)
        size = self.rank_bins * self.step_bins
        self.cells = {name: np.zeros(size) for name in ("step_sum", "step_count", "late_sum", "late_count")}


class _Damaged(Exception):
    """An unchecked timeline (_unchecked_source) holds a record that read_timeline would leave out, or changed
    since it was listed: the run is read again, every timeline checked as it is read."""


@dataclass(frozen=True, kw_only=True)
class _Fields:
    """A block's record fields as ranks x steps arrays, one per field: copied out of the records once, then
    read by every figure (a field of the records is strided: each read of it costs about twice as much)."""

    step: np.ndarray
    flags: np.ndarray
    start_us: np.ndarray
    step_ms: np.ndarray
    data_ms: np.ndarray
    first_collective_ms: np.ndarray
    exposed_comm_ms: np.ndarray

    @staticmethod
    def empty(ranks: int, steps: int) -> _Fields:
        return _Fields(**{name: np.empty((ranks, steps), dtype=TIMELINE_DTYPE[name]) for name in TIMELINE_DTYPE.names})

    def part(self, rows: slice = slice(None), columns: slice = slice(None)) -> _Fields:
        return _Fields(**{name: getattr(self, name)[rows, columns] for name in TIMELINE_DTYPE.names})

    def copy_from(self, records: np.ndarray) -> None:
        for name in TIMELINE_DTYPE.names:
            np.copyto(getattr(self, name), records[name])


def _pass(sources: dict[int, _Source], first_step: int, last_step: int) -> _Accumulated:
    ranks = sorted(sources)
    steps = last_step - first_step + 1
    acc = _Accumulated(ranks=ranks, first_step=first_step, steps=steps,
                       rank_bins=min(MAX_RANK_BINS, len(ranks)), step_bins=min(MAX_STEP_BINS, steps))
    offsets = np.array([np.nan if sources[r].offset_us is None else sources[r].offset_us for r in ranks])
    lowest = np.array([sources[r].lowest_step for r in ranks])
    unchecked = _Unchecked.of([sources[r] for r in ranks])
    width = min(STEP_BLOCK, steps)
    buffer, fields = np.zeros((len(ranks), width), dtype=TIMELINE_DTYPE), _Fields.empty(len(ranks), width)
    step_ms, late_ms = np.empty((len(ranks), width), dtype=np.float32), np.empty((len(ranks), width))
    acc.weights = _noise_weights(sources, ranks, first_step, min(STEP_BLOCK, steps), offsets, lowest)
    with ThreadPoolExecutor(WORKERS) as pool:
        for block_first in range(first_step, last_step + 1, STEP_BLOCK):
            block = buffer[:, :min(STEP_BLOCK, last_step + 1 - block_first)]
            block_fields = fields.part(columns=slice(0, block.shape[1]))

            def read(rows: slice) -> None:
                for group in range(rows.start, rows.stop, _READ_GROUP):
                    group_rows = slice(group, min(group + _READ_GROUP, rows.stop))
                    for row in range(group_rows.start, group_rows.stop):
                        _read_block(sources[ranks[row]], block_first, block[row])
                    block_fields.part(rows=group_rows).copy_from(block[group_rows])  # while still in cache

            def figure(columns: slice) -> None:
                part = block_fields.part(columns=columns)
                _check_records(block[:, columns], part, block_first + columns.start, unchecked)
                step_ms[:, columns], late_ms[:, columns] = _account_block(acc, part, block_first + columns.start,
                                                                          offsets, lowest)

            _each(pool, read, _parts(len(ranks), WORKERS))
            _each(pool, figure, _parts(block.shape[1], max(WORKERS, len(ranks) * block.shape[1] // CHUNK_VALUES)))
            _bin(acc, step_ms[:, :block.shape[1]], late_ms[:, :block.shape[1]],
                 slice(block_first - first_step, block_first - first_step + block.shape[1]))
    return acc


_READ_GROUP = 16
"""Ranks read before their fields are copied out: 16 x STEP_BLOCK records are 1 MiB, still in the cache."""


def _parts(count: int, parts: int) -> list[slice]:
    """[0, count) in `parts` runs."""
    bounds = [count * part // parts for part in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _each(pool: ThreadPoolExecutor, work, parts: list[slice]) -> None:
    """work(part) for every part on the pool; returns when all are done, raising the first failure."""
    for future in [pool.submit(work, part) for part in parts]:
        future.result()


@dataclass(frozen=True, kw_only=True)
class _Unchecked:
    """The rows of unchecked timelines and the steps their one run covers (first, stop)."""

    rows: np.ndarray
    every_row: bool
    first: np.ndarray
    stop: np.ndarray

    @staticmethod
    def of(sources: list[_Source]) -> _Unchecked:
        rows = np.flatnonzero([not s.checked for s in sources])
        runs = [sources[row].runs[0] for row in rows]
        return _Unchecked(rows=rows, every_row=rows.size == len(sources),
                          first=np.array([run[0] for run in runs], dtype=np.int64).reshape(-1, 1),
                          stop=np.array([run[0] + run[2] for run in runs], dtype=np.int64).reshape(-1, 1))


_MS_BELOW_MAX = np.nextafter(np.float32(MAX_STEP_MS), np.float32(0))
"""A float32 step time at most this is within MAX_STEP_MS however MAX_STEP_MS rounds to float32."""


def _check_records(block: np.ndarray, fields: _Fields, block_first: int, unchecked: _Unchecked) -> None:
    """Raises _Damaged when a record of an unchecked timeline is not at the step it should hold or holds
    values valid_records refuses. Quicker, stricter tests first (parts at most the step time, float32): over
    the whole block, then record by record; only the records they doubt go to valid_records, the rule's owner."""
    if unchecked.rows.size == 0:
        return
    rows = slice(None) if unchecked.every_row else unchecked.rows
    steps = np.arange(block_first, block_first + block.shape[1], dtype=np.int32)  # as the records' steps
    everywhere = bool(np.all(unchecked.first <= steps[0]) and np.all(unchecked.stop > steps[-1]))
    inside = True if everywhere else (steps >= unchecked.first) & (steps < unchecked.stop)
    if not np.all(fields.step[rows] == (steps if everywhere else np.where(inside, steps, np.int32(-1)))):
        raise _Damaged()
    part = fields.part(rows=rows)
    if everywhere and _all_plausible(part):
        return
    doubtful = inside & ~_plausible(part)
    if doubtful.any() and not valid_records(block[rows][doubtful]).all():
        raise _Damaged()


_PARTS = ("data_ms", "first_collective_ms", "exposed_comm_ms")


def _all_plausible(fields: _Fields) -> bool:
    """_plausible everywhere, by extremes (a NaN start or step time fails: min and max carry it)."""
    if not (fields.start_us.min() >= 0 and fields.start_us.max() <= MAX_START_US
            and fields.step_ms.min() > 0 and fields.step_ms.max() <= _MS_BELOW_MAX):
        return False
    parts = (getattr(fields, name) for name in _PARTS)
    return not any(np.fmin.reduce(p, axis=None) < 0 or np.any(p > fields.step_ms) for p in parts)


def _plausible(fields: _Fields) -> np.ndarray:
    """Records valid_records keeps (stricter: a part at most the step time)."""
    start_us, step_ms = fields.start_us, fields.step_ms
    plausible = (start_us >= 0) & (start_us <= MAX_START_US) & (step_ms > 0) & (step_ms <= _MS_BELOW_MAX)
    for name in _PARTS:
        plausible &= ~((getattr(fields, name) < 0) | (getattr(fields, name) > step_ms))  # NaN (unknown) passes
    return plausible


def _account_block(acc: _Accumulated, fields: _Fields, block_first: int, offsets: np.ndarray,
                   lowest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The per-step figures of the block's steps into acc; returns the steady step times and end lateness
    (ms, ranks x steps) for the heatmaps."""
    columns = slice(block_first - acc.first_step, block_first - acc.first_step + fields.step.shape[1])
    steady, profiled, acc.profiled[columns] = _steadiness(fields, lowest)
    signals, late, arrival = _signal_values(fields, steady, offsets)
    step_ms = signals[SIGNAL_STEP]
    acc.slowest_ms[columns] = np.fmax.reduce(step_ms, axis=0)  # fmax: NaN (no record) only where all are
    acc.profiled_slowest_ms[columns] = np.fmax.reduce(np.where(profiled, fields.step_ms, np.float32(np.nan)), axis=0)
    late_ms, acc.earliest_end_us[columns], acc.last_rank[columns] = late
    _, acc.earliest_arrival_us[columns], acc.first_collective_last[columns] = arrival
    acc.log_level[:, columns] = _log_level(acc, signals, columns)
    return step_ms, late_ms


def _signal_values(fields: _Fields, steady: np.ndarray, offsets: np.ndarray) -> tuple[dict[str, np.ndarray], tuple, tuple]:
    """(each signal's values over the steady records (SIGNALS; NaN: unknown), the step ends' _lateness, the
    arrivals' _lateness)."""
    start_us = _aligned_start(fields.start_us, steady, offsets)
    late = _lateness(_aligned(start_us, fields.step_ms))
    arrival = _lateness(_aligned(start_us, fields.first_collective_ms))
    signals = {SIGNAL_STEP: np.where(steady, fields.step_ms, np.float32(np.nan)),
               SIGNAL_DATA: np.where(steady, fields.data_ms, np.float32(np.nan)),
               SIGNAL_ARRIVAL: arrival[0].astype(np.float32)}
    return signals, late, arrival


def _steadiness(fields: _Fields, lowest: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steady, profiled) masks of the block's records, and per step whether any rank profiled it. Steady is
    traces/formats.py is_steady on timeline flags; profiled: the records steady but for the profiler."""
    present = fields.step >= 0
    first = fields.flags & FLAG_FIRST != 0
    flagged = fields.flags & FLAG_PROFILED != 0
    past_warmup = is_steady(fields.step, lowest[:, None], False, first)
    return past_warmup & ~flagged, past_warmup & flagged, np.any(present & flagged, axis=0)


def _noise_weights(sources: dict[int, _Source], ranks: list[int], first_step: int, width: int,
                   offsets: np.ndarray, lowest: np.ndarray) -> np.ndarray:
    """Per rank and signal, 1 / the signal's noise on the rank (module docstring: signal noise), from the run's
    first `width` steps, read once more on their own (at 1,024 ranks a 2,048-step block is 64 MiB)."""
    block = np.zeros((len(ranks), width), dtype=TIMELINE_DTYPE)
    for row, rank in enumerate(ranks):
        _read_block(sources[rank], first_step, block[row])
    fields = _Fields.empty(len(ranks), width)
    fields.copy_from(block)
    steady, _, _ = _steadiness(fields, lowest)
    signals, _, _ = _signal_values(fields, steady, offsets)
    with np.errstate(invalid="ignore"):
        floor = NOISE_FLOOR * (_median(_median_of(_order_statistics(signals[SIGNAL_STEP]))) or 1.0)
    noise = np.stack([_successive_spread(_excess_ms(v, _order_statistics(v))) for v in signals.values()], axis=1)
    for column in range(noise.shape[1]):
        unknown = np.isnan(noise[:, column])
        if unknown.all():
            continue
        noise[unknown, column] = np.nanmedian(noise[:, column])
    weights = 1.0 / np.maximum(noise, floor)
    return np.where(np.isnan(weights), 0.0, weights).astype(np.float32)


def _successive_spread(excess: np.ndarray) -> np.ndarray:
    """Per row (rank), 1.4826 x the median absolute difference of successive known values / sqrt(2): the
    robust step-to-step noise of one value (NaN: fewer than MIN_NOISE_VALUES known)."""
    spread = np.full(excess.shape[0], np.nan)
    for row, values in enumerate(excess):
        known = values[~np.isnan(values)].astype(np.float64)
        if known.size >= MIN_NOISE_VALUES:
            spread[row] = 1.4826 * float(np.median(np.abs(np.diff(known)))) / math.sqrt(2.0)
    return spread


def _log_level(acc: _Accumulated, signals: dict[str, np.ndarray], columns: slice) -> np.ndarray:
    """Per rank and step, log(1 + the noise-weighted mean of its known excesses over its peers / the step's median
    step time); a signal no rank recorded in the block costs nothing. The series the change-point search reads."""
    step_ms = signals[SIGNAL_STEP]
    total, count = np.zeros_like(step_ms), np.zeros_like(step_ms)
    for column, (signal, values) in enumerate(signals.items()):
        if signal != SIGNAL_STEP and not np.isfinite(values).any():
            continue
        order = _order_statistics(values)
        acc.order[signal][:, columns] = order
        if signal == SIGNAL_STEP:
            median = acc.median_ms[columns] = _median_of(order)
        excess = _excess_ms(values, order)
        known = ~np.isnan(excess)
        np.copyto(excess, np.float32(0.0), where=~known)
        weight = acc.weights[:, column:column + 1]
        excess *= weight
        total += excess
        count += np.multiply(known, weight, dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.divide(total, count, out=total)
        np.copyto(mean, np.float32(np.nan), where=np.isnan(step_ms))
        level = mean / median
        return np.log1p(level, out=level)


def _aligned_start(start_us: np.ndarray, steady: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each steady record's start on the reference clock, us; NaN: unknown or not steady."""
    return np.where(steady, start_us - offsets[:, None], np.nan)


def _aligned(start_us: np.ndarray, until_ms: np.ndarray) -> np.ndarray:
    """The moment `until_ms` after each aligned start (step_ms: the step's end), us; NaN: unknown."""
    moment_us = until_ms.astype(np.float64)
    moment_us *= 1000.0
    moment_us += start_us
    return moment_us


def _lateness(moment_us: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lateness ms per rank and step, the earliest moment per step, index of the last rank per step (-1:
    fewer than two known)). Takes `moment_us` over for the lateness."""
    earliest = np.fmin.reduce(moment_us, axis=0)
    # the first rank at the latest moment: an argmax over a mask, ~5x faster than over the moments
    last = np.argmax(moment_us == np.fmax.reduce(moment_us, axis=0), axis=0).astype(np.int32)
    two_known = np.count_nonzero(~np.isnan(moment_us), axis=0) >= 2
    moment_us -= earliest
    moment_us /= 1000.0
    return moment_us, earliest, np.where(two_known, last, -1)


def _order_statistics(values: np.ndarray) -> np.ndarray:
    """Per step (column), over the ranks that know the value: the sorted values at (n-2)//2, (n-1)//2, n//2,
    (n+1)//2 (n: how many know it; NaN sorts last), as 4 rows; enough for the median of all and the median of
    the others seen from any rank (_peer_median); NaN where the position does not exist."""
    ordered = _transposed(values)
    ordered.sort(axis=1)  # along contiguous rows: about twice as fast
    count = values.shape[0] - np.count_nonzero(np.isnan(ordered), axis=1)
    rows = np.stack([(count - 2) // 2, (count - 1) // 2, count // 2, (count + 1) // 2])
    picked = np.take_along_axis(ordered, np.clip(rows, 0, max(values.shape[0] - 1, 0)).T, axis=1).T
    return np.where((rows >= 0) & (rows < count), picked, np.nan)


_TRANSPOSE_BAND = 64


def _transposed(values: np.ndarray) -> np.ndarray:
    """values.T, C-contiguous, copied in bands of ranks that stay in cache (a plain copy is ~10x slower)."""
    out = np.empty(values.shape[::-1], dtype=values.dtype)
    for first in range(0, values.shape[0], _TRANSPOSE_BAND):
        out[:, first:first + _TRANSPOSE_BAND] = values[first:first + _TRANSPOSE_BAND].T
    return out


def _median_of(order: np.ndarray) -> np.ndarray:
    """The median over all ranks of each step (float64)."""
    return (order[1].astype(np.float64) + order[2]) / 2.0


def _peer_median(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Per rank and step, the median of the other ranks' values (NaN: fewer than one other). Leaving the rank
    out matters at few ranks: of two, the median of both would halve a straggler's excess. Of the n - 1
    others' sorted values, positions (n-2)//2 and (n-1)//2 are the sorted values there when the rank sorts
    after them, else the next ones (equal values are interchangeable). Arithmetic on the two comparisons, not
    np.where: a where on a mask that is true for half the ranks costs ten times more; in place: each
    temporary of the block's size costs as much as the arithmetic."""
    below, middle, above, next_above = order
    at_or_above = values >= above
    lower = np.multiply(above - below, at_or_above)
    np.greater_equal(values, next_above, out=at_or_above)
    lower += np.multiply(next_above - middle, at_or_above)
    median = np.subtract(above + next_above, lower, out=lower)
    median /= np.float32(2.0)
    return median


def _excess_ms(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Each rank's value less its peers' median of the same step (NaN: unknown, or no peer knows it)."""
    peer = _peer_median(values, order)
    return np.subtract(values, peer, out=peer)


def _bin(acc: _Accumulated, step_ms: np.ndarray, late_ms: np.ndarray, columns: slice) -> None:
    """Sums and counts per heatmap cell. Bins are runs of consecutive ranks and steps: summed by reduceat."""
    n_ranks, width = step_ms.shape
    rank_starts = np.flatnonzero(np.diff(np.arange(n_ranks) * acc.rank_bins // n_ranks, prepend=-1))
    step_bin = np.arange(columns.start, columns.start + width) * acc.step_bins // acc.steps
    step_starts = np.flatnonzero(np.diff(step_bin, prepend=-1))
    bins = step_bin[step_starts]
    for values, total, count in ((step_ms, "step_sum", "step_count"), (late_ms, "late_sum", "late_count")):
        known = ~np.isnan(values)
        for name, cell_values in ((total, np.where(known, values, np.float32(0.0))), (count, known)):
            # steps first: a reduceat over many short runs of ranks on the whole block is slow
            by_step = np.add.reduceat(cell_values, step_starts, axis=1, dtype=np.float32)
            sums = np.add.reduceat(by_step, rank_starts, axis=0, dtype=np.float64)
            acc.cells[name].reshape(acc.rank_bins, acc.step_bins)[:, bins] += sums


# -- findings --------------------------------------------------------------------------------------------


def whole_run_section(records: RunRecords | None, run_command_dir: str | None = None) -> WholeRun | None:
    """None when `records` is None (no run directory) or the run has neither timelines nor step metrics."""
    if records is None:
        return None
    try:
        return _analyzed(records, run_command_dir, check_records=False)
    except _Damaged:
        # a record that cannot be true: every timeline read again, checked, so that it is named and left out
        return _analyzed(records, run_command_dir, check_records=True)


MAX_STEP_GAP = 100_000
"""Steps between two stretches of records beyond which they are not one run's: the per-step arrays span every step
from the first to the last, so one record claiming step 2^31 beside steps 0-99 would cost gigabytes. A resumed
or restarted run continues where it stopped; a gap of 100,000 steps with nothing recorded is not training."""


def _within_one_span(sources: dict[int, _Source], notes: list[str]) -> dict[int, _Source]:
    """The stretches of steps (every rank's runs of consecutive records) grouped where they lie within
    MAX_STEP_GAP of each other; the group with the most records is kept, the others named and left out."""
    runs = sorted((run[0], run[0] + run[2] - 1, run[2], rank) for rank, s in sources.items() for run in s.runs)
    groups: list[list[tuple]] = []
    for run in runs:
        if groups and run[0] - max(r[1] for r in groups[-1]) <= MAX_STEP_GAP:
            groups[-1].append(run)
        else:
            groups.append([run])
    if len(groups) == 1:
        return sources
    kept = max(groups, key=lambda group: sum(r[2] for r in group))
    for group in groups:
        if group is not kept:
            ranks = sorted({r[3] for r in group})
            notes.append(f"{sum(r[2] for r in group)} record(s) of rank(s) {step_ranges(ranks)} at steps "
                         f"{group[0][0]}-{max(r[1] for r in group)}, more than {MAX_STEP_GAP:,} steps from the run's "
                         f"other steps ({kept[0][0]}-{max(r[1] for r in kept)}): not a step of this run, left out")
    low, high = kept[0][0], max(r[1] for r in kept)
    within = {}
    for rank, source in sources.items():
        runs_kept = [run for run in source.runs if low <= run[0] and run[0] + run[2] - 1 <= high]
        if runs_kept:
            within[rank] = dataclasses.replace(source, runs=runs_kept,
                                               lowest_step=min(run[0] for run in runs_kept))
    return within


def _analyzed(records: RunRecords, run_command_dir: str | None, check_records: bool) -> WholeRun | None:
    notes: list[str] = []
    sources = _sources(records, notes, check_records)
    if not sources:
        if not notes:
            return None
        return WholeRun(status=STATUS_NOT_RECORDED, reason="no usable timeline or step metrics", notes=notes)
    sources = _within_world(sources, _world_size(records), notes)
    if not sources:
        return WholeRun(status=STATUS_NOT_RECORDED, reason="no usable timeline or step metrics", notes=notes)
    sources = _within_one_span(sources, notes)
    first = min(run[0] for s in sources.values() for run in s.runs)
    last = max(run[0] + run[2] - 1 for s in sources.values() for run in s.runs)
    acc = _pass(sources, first, last)
    return _section(acc, sources, notes, RecordSuggestion(run_dir=run_command_dir or str(records.root),
                                                          ended=_job_ended(records),
                                                          user_program=_is_user_program(records)),
                    _recorded_windows(records))


def _world_size(records: RunRecords) -> int | None:
    """The job's world size as job.json records it; None where it records none (a folder of records alone)."""
    world = records.job.get("world_size")
    return world if type(world) is int and world > 0 else None


def _within_world(sources: dict[int, _Source], world_size: int | None, notes: list[str]) -> dict[int, _Source]:
    """The ranks of the job: records of ranks at or beyond its world size (left from another job in the same
    folder, or forged) are named and left out, never counted as ranks of this one."""
    if world_size is None:
        return sources
    beyond = sorted(rank for rank in sources if rank >= world_size)
    if beyond:
        notes.append(f"records of {len(beyond)} rank(s) at or beyond the job's world size {world_size} left out "
                     f"(ranks {step_ranges(beyond)})")
    return {rank: source for rank, source in sources.items() if rank < world_size}


def _section(acc: _Accumulated, sources: dict[int, _Source], notes: list[str], run_dir: RecordSuggestion,
             recorded: list[tuple[int | None, list[int]]]) -> WholeRun:
    steady = np.flatnonzero(~np.isnan(acc.slowest_ms))
    step_numbers = acc.first_step + steady
    windows = _windows(acc, recorded)
    with ThreadPoolExecutor(WORKERS) as pool:
        segments = dict(zip(acc.ranks, pool.map(lambda index: _segments(acc, index), range(len(acc.ranks)))))
    slow = [finding for index, rank in enumerate(acc.ranks)
            for finding in _slow_ranks(acc, index, sources[rank], segments[rank], windows, run_dir)]
    found_changes = [ChangePoint(rank=rank, step=b.start_step, level_before=a.level, level_after=b.level)
                     for rank, found in segments.items() for a, b in zip(found[:-1], found[1:])]
    changes = sized_changes(found_changes)
    timed = [r for r, s in sources.items() if s.offset_us is not None]
    section = WholeRun(
        status=STATUS_OK,
        sources=_by_source(sources),
        ranks=len(acc.ranks),
        first_step=acc.first_step,
        last_step=acc.first_step + acc.steps - 1,
        steady_steps=int(steady.size),
        step_time_ms=_median(acc.slowest_ms[steady]),
        median_rank_step_ms=_median(acc.median_ms[steady]),
        basis=(f"{BASIS_STEP_METRICS} (timeline), steady steps {step_ranges(step_numbers)} ({steady.size}), "
               f"{SLOWEST_RANK}; a slow rank's size: its excess over its peers' median, in percent of the median "
               "rank's steady step time before the change"),
        lateness_basis=_lateness_basis(timed, acc.ranks),
        slow_ranks=slow,
        changes=sorted(changes, key=lambda c: -abs(math.log(c.level_after / c.level_before)))[:MAX_CHANGES_SHOWN],
        changes_total=len(changes),
        changes_below_size=len(found_changes) - len(changes),
        windows=_window_checks(acc, windows),
        step_time_map=_heatmap(acc, "step_sum", "step_count", "step time (steady steps, mean)"),
        lateness_map=_heatmap(acc, "late_sum", "late_count", "lateness (steady steps, mean)")
        if timed else None,
        notes=notes,
    )
    return _with_sentences(section, acc, steady, run_dir)


def _by_source(sources: dict[int, _Source]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for rank, source in sources.items():
        found.setdefault(SOURCE_TIMELINE if source.path is not None else SOURCE_JSONL, []).append(rank)
    return found


def _lateness_basis(timed: list[int], ranks: list[int]) -> str:
    if not timed:
        return "no aligned clock (no timeline start times with a clock offset): lateness unknown"
    missing = len(ranks) - len(timed)
    return ("aligned step end (start_us less the rank's measured clock offset, plus step_ms) minus the earliest "
            f"end that step, steady steps; {len(timed)} of {len(ranks)} ranks"
            + (f" ({missing} without a timeline or a clock offset: unknown)" if missing else ""))


def _median(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(np.median(values)) if values.size else None


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


def _windows(acc: _Accumulated, recorded: list[tuple[int | None, list[int]]]) -> list[_Window]:
    """Runs of consecutive profiled steps, split where the manifest lists several windows in one run (back-to-back
    windows: the second's warm-up follows the first's last step), each named by its recorded steps."""
    flagged = np.concatenate([[False], acc.profiled, [False]]).astype(np.int8)
    edges = np.diff(flagged)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
    found = []
    for first, last in ((acc.first_step + int(a), acc.first_step + int(b)) for a, b in zip(starts, ends)):
        inside = sorted((w for w in recorded if first <= w[1][0] <= last), key=lambda w: w[1][0])
        start = first
        for index, (number, steps) in enumerate(inside):
            end = last if index == len(inside) - 1 else min(steps[-1], last)
            if start <= end:
                found.append(_Window(start, end, number, tuple(steps)))
                start = end + 1
        if not inside:
            found.append(_Window(first, last))
    return found


def _recorded_windows(records: RunRecords) -> list[tuple[int | None, list[int]]]:
    """(window, its recorded steps, sorted) per window the manifest lists; none without a readable manifest (the
    report names an unreadable one; the windows are then the timelines' runs of profiled steps)."""
    manifest = records.manifest
    if manifest is None:
        return []
    steps: dict[int | None, set[int]] = {}
    for record in manifest.traces:
        steps.setdefault(record.window, set()).update(int(s) for s in record.steps)
    return [(window, sorted(found)) for window, found in steps.items() if found]


def window_label(first: int, last: int) -> str:
    """A window as the timelines see it: the steps the profiler was on, its warm-up included (the report's
    header names the steps the trace recorded, "profiled steps 2-3" of a window on in steps 1-3)."""
    return f"profiler on in steps {first}-{last}" if last > first else f"profiler on in step {first}"


def _segments(acc: _Accumulated, index: int) -> list[Segment]:
    values = np.exp(acc.log_level[index].astype(np.float64))
    return segment_levels(values, acc.first_step + np.arange(acc.steps))


def _columns(acc: _Accumulated, segment: Segment) -> slice:
    return slice(segment.start_step - acc.first_step, segment.end_step - acc.first_step + 1)


@dataclass(frozen=True, kw_only=True)
class _Size:
    signal: str
    excess_ms: float
    baseline_ms: float
    job_step_change_ms: float | None


def _slow_ranks(acc: _Accumulated, index: int, source: _Source, segments: list[Segment],
                windows: list[_Window], run_dir: RecordSuggestion) -> list[SlowRank]:
    found = []
    rank_last = segments[-1].end_step if segments else None
    raised = [s for s in segments if s.level >= 1.0 + SLOW_EXCESS * _smallest_share(acc.weights[index])
              and _long_or_clear(acc, index, s)]
    sized = [(s, _slow_size(acc, index, source, segments, s)[0]) for s in raised]
    for segment in _merged([(s, size.signal) for s, size in sized if size is not None], segments):
        size, late, by_step = _slow_size(acc, index, source, segments, segment)
        if size is None:
            continue
        columns = _columns(acc, segment)
        significance = series_significance(source.rank, by_step[size.signal].astype(np.float64) * 1000.0,
                                           len(acc.ranks))
        covered = [w.label for w in windows if w.first <= segment.end_step and w.last >= segment.start_step]
        finding = SlowRank(rank=source.rank, from_step=segment.start_step, to_step=segment.end_step,
                           to_the_end=segment.end_step == rank_last, signal=size.signal, excess_ms=size.excess_ms,
                           baseline_ms=size.baseline_ms, excess_pct=100.0 * size.excess_ms / size.baseline_ms,
                           job_step_change_ms=size.job_step_change_ms, steps=segment.steps,
                           last_pct=_share_last(acc.last_rank[columns], index),
                           first_collective_last_pct=_share_last(acc.first_collective_last[columns], index),
                           median_lateness_ms=_median(late), windows=covered, sentence="",
                           step_ms=_median(acc.slowest_ms[columns]), significance=significance,
                           to_record=run_dir.to_record(segment.start_step))
        found.append(_with_slow_sentence(finding, run_dir))
    return found


def _smallest_share(weights: np.ndarray) -> float:
    """The smallest weight share among the rank's known signals: how much of one signal's excess its weighted
    mean shows (1 / len(SIGNALS) for equal weights)."""
    known = weights[weights > 0]
    return float(known.min() / known.sum()) if known.size else 1.0 / len(SIGNALS)


def _slow_size(acc: _Accumulated, index: int, source: _Source, segments: list[Segment],
               segment: Segment) -> tuple[_Size | None, np.ndarray, dict[str, np.ndarray]]:
    """The segment's size when it is slow (None: not), the rank's end lateness over it and its excess per step
    in each known signal."""
    by_step, late = _rank_figures(acc, index, source, segment)
    medians = {signal: m for signal, values in by_step.items() if (m := _median(values)) is not None}
    size = _size(acc, medians, segments, segment)
    return (size if size is not None and size.excess_ms >= SLOW_EXCESS * size.baseline_ms else None), late, by_step


def _long_or_clear(acc: _Accumulated, index: int, segment: Segment) -> bool:
    """Long enough to count, or short and clear of the rank's noise."""
    if segment.steps >= MIN_SLOW_STEPS:
        return True
    if segment.steps < SHORT_SLOW_STEPS:
        return False
    return math.log(segment.level) >= SHORT_SIGMAS * _noise_scale(acc.log_level[index])


def _noise_scale(log_level: np.ndarray) -> float:
    """Robust step-to-step spread of one value of a rank's log excess level (its neighbours' differences:
    a level shift moves only one)."""
    known = log_level[~np.isnan(log_level)].astype(np.float64)
    if known.size < 3:
        return math.inf
    return 1.4826 * float(np.median(np.abs(np.diff(known)))) / math.sqrt(2.0)


def _size(acc: _Accumulated, excess: dict[str, float], segments: list[Segment], segment: Segment) -> _Size | None:
    """The signal with the largest excess, sized against the step time before the change; None: no signal
    known or no step time to size it by."""
    baseline = _baseline_ms(acc, segments, segment)
    if not excess or baseline is None or baseline <= 0:
        return None
    signal = _named_signal(excess)
    during = _median(acc.median_ms[_columns(acc, segment)])
    return _Size(signal=signal, excess_ms=excess[signal], baseline_ms=baseline,
                 job_step_change_ms=None if during is None else during - baseline)


def _named_signal(excess: dict[str, float]) -> str:
    """The signal with the largest excess; an input wait delays the arrival at the first collective (and a
    late arrival the step) by as much, so the earlier in SIGNALS_BY_CAUSE wins when it holds most of it."""
    largest = max(excess.values())
    return next(s for s in SIGNALS_BY_CAUSE if s in excess and excess[s] >= (1.0 - CAUSE_SLACK) * largest)


def _baseline_ms(acc: _Accumulated, segments: list[Segment], segment: Segment) -> float | None:
    """The median rank's steady step time before the change: over the rank's segment before it; after it when
    the segment starts the rank's run; the segment itself when it is the only one."""
    before = [s for s in segments if s.end_step < segment.start_step]
    after = [s for s in segments if s.start_step > segment.end_step]
    around = before[-1] if before else after[0] if after else segment
    return _median(acc.median_ms[_columns(acc, around)])


def _share_last(last: np.ndarray, index: int) -> float | None:
    known = last >= 0
    return 100.0 * float(np.mean(last[known] == index)) if known.any() else None


def _rank_figures(acc: _Accumulated, index: int, source: _Source,
                  segment: Segment) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Over the segment's steady steps: the rank's excess per step in each signal (NaN: unknown), and its
    lateness per step at the step end (its records read again: only raised segments' are)."""
    columns = _columns(acc, segment)
    block = np.zeros(segment.end_step + 1 - segment.start_step, dtype=TIMELINE_DTYPE)
    _read_block(source, segment.start_step, block)
    steady = ~np.isnan(acc.log_level[index, columns])
    offset = np.array([np.nan if source.offset_us is None else source.offset_us])
    start_us = _aligned_start(block["start_us"][None, :], steady[None, :], offset)[0]
    arrival_us = _aligned(start_us, block["first_collective_ms"])
    values = {SIGNAL_STEP: np.where(steady, block["step_ms"], np.nan),
              SIGNAL_DATA: np.where(steady, block["data_ms"], np.nan),
              SIGNAL_ARRIVAL: (arrival_us - acc.earliest_arrival_us[columns]) / 1000.0}
    excess = {signal: _excess_ms(v.astype(np.float32), acc.order[signal][:, columns]) for signal, v in values.items()}
    end_us = _aligned(start_us, block["step_ms"])
    return excess, (end_us - acc.earliest_end_us[columns]) / 1000.0


def _merged(slow: list[tuple[Segment, str]], segments: list[Segment]) -> list[Segment]:
    """Slow segments next to each other among all the rank's `segments`, slow in the same signal, as one (their
    level the steps-weighted one). Slow in another signal: another episode (a late input, then a late arrival
    for another reason, are two findings, each named by its own signal)."""
    merged: list[Segment] = []
    signals: list[str] = []
    for segment, signal in slow:
        if merged and signals[-1] == signal and _adjacent(merged[-1], segment, segments):
            before = merged.pop()
            signals.pop()
            steps = before.steps + segment.steps
            level = (before.level * before.steps + segment.level * segment.steps) / steps
            segment = Segment(start_step=before.start_step, end_step=segment.end_step, level=level, steps=steps)
        merged.append(segment)
        signals.append(signal)
    return merged


def _adjacent(before: Segment, after: Segment, segments: list[Segment]) -> bool:
    return not any(before.end_step < s.start_step < after.start_step for s in segments)


def _with_slow_sentence(finding: SlowRank, run_dir: RecordSuggestion) -> SlowRank:
    until = "to the end" if finding.to_the_end else f"to step {finding.to_step:,}"
    parts = [f"rank {finding.rank} slow from step {finding.from_step:,} ({until}): {finding.signal} "
             f"{finding.excess_ms:+.1f} ms over its peers' median, {finding.excess_pct:+.0f}% of the median rank's "
             f"step time before the change ({finding.baseline_ms:.1f} ms; {finding.steps:,} steady steps)"]
    if finding.significance is not None:
        parts.append(("stands out" if finding.significance.stands_out else "does not stand out")
                     + f" from its step-to-step spread ({finding.significance.evidence()})")
    if _everyone_waits(finding):
        parts.append(f"every rank's step time rose by ~{finding.job_step_change_ms:.0f} ms from step "
                     f"{finding.from_step:,}: they wait for rank {finding.rank}")
    if finding.last_pct is not None:
        parts.append(f"last to end its step at {finding.last_pct:.0f}% of steps since")
    if finding.first_collective_last_pct is not None:
        parts.append(f"last at the first collective at {finding.first_collective_last_pct:.0f}%")
    if finding.windows:
        parts.append("covered by a window (" + ", ".join(finding.windows) + ")")
    else:
        parts.append(f"no profiled window covers it: {run_dir.to_record(finding.from_step)}")
    return dataclasses.replace(finding, sentence="; ".join(parts))


@dataclass(frozen=True, kw_only=True)
class RecordSuggestion:
    """How a user records a window of this run: `fleetscope profile` while the job runs; once it has ended, a
    relaunch whose schedule covers the steps in question (`profile` can no longer reach it)."""

    run_dir: str
    ended: bool
    user_program: bool = False
    """The run is a user's program, whose ranks read no on-demand request: only a relaunch records a window."""

    def to_record(self, step: int) -> str:
        if not self.ended and not self.user_program:
            return f"fleetscope profile {shlex.quote(self.run_dir)} --steps {PROFILE_STEPS} records a window"
        skip = max(step - 1, 0)
        why = "the job has ended" if self.ended else "your program reads no on-demand request"
        return (f"{why}: relaunch it with --profile skip_first={skip},wait=0,warmup=1,"
                f"active={PROFILE_STEPS},repeat=1 to record steps {skip + 1}-{skip + PROFILE_STEPS}")


def _is_user_program(records: RunRecords) -> bool:
    """job.json records a user's program (its `program`), not fleetscope's trainer."""
    return isinstance(records.job.get("program"), dict)


def _job_ended(records: RunRecords) -> bool:
    """job.json records a final status (or the record cannot be read: no running job to reach either)."""
    return bool(records.job_problem) or records.job.get("status") in FINAL_STATUSES


def _everyone_waits(finding: SlowRank) -> bool:
    """The median rank's step rose by most of this rank's excess (and by SLOW_EXCESS of the step or more)."""
    change = finding.job_step_change_ms
    return change is not None and change >= max(0.5 * finding.excess_ms, SLOW_EXCESS * finding.baseline_ms)


def _window_checks(acc: _Accumulated, windows: list[_Window]) -> list[WindowCheck]:
    steady = acc.slowest_ms[~np.isnan(acc.slowest_ms)]
    ordered = np.sort(steady)
    checks, previous_end = [], acc.first_step - 1
    for first, last, number, steps in ((w.first, w.last, w.window, w.steps) for w in windows):
        window_ms = _median(acc.profiled_slowest_ms[first - acc.first_step:last - acc.first_step + 1])
        between = acc.slowest_ms[previous_end + 1 - acc.first_step:first - acc.first_step]
        percentile = (100.0 * np.searchsorted(ordered, window_ms) / ordered.size
                      if window_ms is not None and ordered.size else None)
        checks.append(WindowCheck(first_step=first, last_step=last, median_ms=window_ms,
                                  between_median_ms=_median(between), percentile_pct=percentile,
                                  window=number, profiled_steps=list(steps)))
        previous_end = last
    return checks


def _heatmap(acc: _Accumulated, total: str, count: str, quantity: str) -> Heatmap:
    counts = acc.cells[count].reshape(acc.rank_bins, acc.step_bins)
    means = acc.cells[total].reshape(acc.rank_bins, acc.step_bins) / np.maximum(counts, 1)
    values = [[float(v) if c > 0 else None for v, c in zip(row, crow)] for row, crow in zip(means, counts)]
    n = len(acc.ranks)
    rank_edges = [[acc.ranks[i] for i in np.flatnonzero(np.arange(n) * acc.rank_bins // n == b)[[0, -1]]]
                  for b in range(acc.rank_bins)]
    step_edges = [[acc.first_step + int(i) for i in np.flatnonzero(
        np.arange(acc.steps) * acc.step_bins // acc.steps == b)[[0, -1]]] for b in range(acc.step_bins)]
    binning = (f"{n} ranks in {acc.rank_bins} bins of {math.ceil(n / acc.rank_bins)}, {acc.steps} steps in "
               f"{acc.step_bins} bins of {math.ceil(acc.steps / acc.step_bins)}; mean per cell")
    return Heatmap(quantity=quantity, unit="ms", binning=binning, rank_bins=rank_edges, step_bins=step_edges,
                   values=values)


def _with_sentences(section: WholeRun, acc: _Accumulated, steady: np.ndarray, run_dir: RecordSuggestion) -> WholeRun:
    drift = _drift_sentence(section.windows)
    representative = _representative_sentence(section.windows, run_dir, acc.first_step + acc.steps // 2)
    worst = largest_episode(section.slow_ranks)
    if worst is not None:
        ranks = len({s.rank for s in section.slow_ranks})
        which = ("the one that cost the most time (its excess per step x its steady steps): "
                 if len(section.slow_ranks) > 1 else "")
        verdict = (f"{len(section.slow_ranks)} slow-rank episode(s) on {ranks} rank(s); {which}rank {worst.rank} "
                   f"{worst.signal} {worst.excess_ms:+.1f} ms ({worst.excess_pct:+.0f}% of the step) x {worst.steps:,} steps = "
                   f"{worst.time_lost_ms / 1000:.2f} s lost, from step {worst.from_step:,}")
    elif section.ranks == 1:
        # slow ranks are found against their peers: one rank has none
        verdict = (f"one rank: no peers to compare it with ({section.steady_steps:,} steady steps); its steps over the "
                   "run are in the step-time series and the windows' checks")
    else:
        verdict = (f"no rank above its peers by {100 * SLOW_EXCESS:.0f}% of the step time or more (in step time, "
                   f"input wait or arrival at the first collective) for {MIN_SLOW_STEPS}+ steady steps in "
                   f"{section.steady_steps:,} steady steps of {section.ranks} ranks")
    return dataclasses.replace(section, drift=drift, representative=representative, verdict=verdict)


def _drift_sentence(windows: list[WindowCheck]) -> str:
    gaps = [w.between_median_ms for w in windows if w.between_median_ms is not None]
    if len(gaps) < 2:
        return "fewer than two stretches between profiled windows: no drift measured"
    change = 100.0 * (gaps[-1] / gaps[0] - 1.0)
    return (f"steady step time before the first window {gaps[0]:.2f} ms, before the last {gaps[-1]:.2f} ms "
            f"({change:+.1f}%; {BASIS_STEP_METRICS} (timeline), {SLOWEST_RANK})")


def _representative_sentence(windows: list[WindowCheck], run_dir: RecordSuggestion, middle_step: int) -> str:
    placed = [w for w in windows if w.percentile_pct is not None]
    if not placed:
        return f"no profiled step in the timelines: no window to compare; {run_dir.to_record(middle_step)}"
    parts = [f"{w.label}: {w.median_ms:.2f} ms, percentile "
             f"{w.percentile_pct:.0f} of the run's steady steps" for w in placed]
    typical = all(10.0 <= w.percentile_pct <= 90.0 for w in placed)
    return ("; ".join(parts) + (" (representative: within percentiles 10-90" if typical else
                                " (not all representative: outside percentiles 10-90")
            + "; profiled steps include the profiler's cost)")
