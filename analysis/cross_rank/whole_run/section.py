"""The section: the scan's figures made into the report's WholeRun (windows, heatmaps, slow ranks, change
points, notes)."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fleetscope.analysis.quantities import BASIS_STEP_METRICS, SLOWEST_RANK, step_ranges
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.analysis.cross_rank.whole_run.model import (ChangePoint, Heatmap, MAX_CHANGES_SHOWN, SOURCE_JSONL,
    SOURCE_TIMELINE, STATUS_NOT_RECORDED, STATUS_OK, WORKERS, WholeRun, WindowCheck, _Window, sized_changes)
from fleetscope.analysis.cross_rank.whole_run.scan import _Accumulated, _Damaged, _Source, _pass, _sources
from fleetscope.analysis.cross_rank.whole_run.statistics import _median
from fleetscope.analysis.cross_rank.whole_run.episodes import _segments, _slow_ranks
from fleetscope.analysis.cross_rank.whole_run.sentences import (RecordSuggestion, _is_user_program, _job_ended,
    _with_sentences)


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
