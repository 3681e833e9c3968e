"""The one pass over every step of every rank: each rank's records (a timeline, else its step metrics),
read block by block on WORKERS threads, checked, and accumulated into per-step figures, excess levels and
heatmap cells."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from fleetscope.traces.formats import is_steady
from fleetscope.analysis.inputs.records import RunRecords, StepMetricsFile
from fleetscope.analysis.inputs.timelines import TimelineSource, records_into, runs_of
from fleetscope.traces.timeline import (
    FLAG_FIRST,
    FLAG_PROFILED,
    MAX_START_US,
    MAX_STEP_MS,
    MAX_TIMELINE_STEP,
    TIMELINE_DTYPE,
    valid_records,
)
from fleetscope.analysis.cross_rank.whole_run.model import (CHUNK_VALUES, MAX_RANK_BINS, MAX_STEP_BINS,
    MIN_NOISE_VALUES, NOISE_FLOOR, STEP_BLOCK, WORKERS)
from fleetscope.analysis.cross_rank.whole_run.statistics import _excess_ms, _median, _median_of, _order_statistics


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
