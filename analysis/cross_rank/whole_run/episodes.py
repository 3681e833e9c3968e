"""Slow-rank episodes: the change points of each rank's excess level, the segments that stand above its
peers long or clearly enough, and their size per signal."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fleetscope.analysis.cross_rank.stragglers import series_significance
from fleetscope.traces.change_points import Segment, segment_levels
from fleetscope.traces.timeline import TIMELINE_DTYPE
from fleetscope.analysis.cross_rank.whole_run.model import (MIN_SLOW_STEPS, SHORT_SIGMAS, SHORT_SLOW_STEPS,
    SLOW_EXCESS, SlowRank, _Window)
from fleetscope.analysis.cross_rank.whole_run.scan import (CAUSE_SLACK, SIGNALS, SIGNALS_BY_CAUSE, SIGNAL_ARRIVAL,
    SIGNAL_DATA, SIGNAL_STEP, _Accumulated, _Source, _aligned, _aligned_start, _read_block)
from fleetscope.analysis.cross_rank.whole_run.statistics import _excess_ms, _median
from fleetscope.analysis.cross_rank.whole_run.sentences import RecordSuggestion, _with_slow_sentence


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
