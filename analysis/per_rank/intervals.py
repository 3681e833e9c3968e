"""Interval arithmetic on columnar numpy arrays (microseconds).

An interval set is a pair of float64 arrays `(starts_us, ends_us)`. Functions named `union*` return a
*normalized* set: sorted, non-overlapping, no empty intervals. Everything here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Intervals:
    """A set of half-open time intervals [start, end) in microseconds."""

    starts_us: np.ndarray
    ends_us: np.ndarray

    @classmethod
    def empty(cls) -> "Intervals":
        return cls(np.empty(0, dtype=np.float64), np.empty(0, dtype=np.float64))

    @classmethod
    def of(cls, starts_us, ends_us) -> "Intervals":
        starts = np.asarray(starts_us, dtype=np.float64)
        ends = np.asarray(ends_us, dtype=np.float64)
        if starts.shape != ends.shape:
            raise ValueError(f"starts ({starts.shape}) and ends ({ends.shape}) differ in shape")
        return cls(starts, ends)

    def __len__(self) -> int:
        return int(self.starts_us.size)

    @property
    def total_us(self) -> float:
        """Sum of lengths; equals covered time only for a normalized set."""
        return float(np.sum(self.ends_us - self.starts_us)) if len(self) else 0.0


def union(intervals: Intervals) -> Intervals:
    """Merge overlapping or touching intervals; drops empty ones."""
    keep = intervals.ends_us > intervals.starts_us
    starts, ends = intervals.starts_us[keep], intervals.ends_us[keep]
    if starts.size == 0:
        return Intervals.empty()
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    running_end = np.maximum.accumulate(ends)
    # A new merged interval begins where the start lies beyond every earlier end.
    begins = np.empty(starts.size, dtype=bool)
    begins[0] = True
    begins[1:] = starts[1:] > running_end[:-1]
    group = np.cumsum(begins) - 1
    merged_starts = starts[begins]
    merged_ends = np.zeros(merged_starts.size, dtype=np.float64)
    np.maximum.at(merged_ends, group, ends)
    return Intervals(merged_starts, merged_ends)


def union_of(*sets: Intervals) -> Intervals:
    return union(Intervals(
        np.concatenate([s.starts_us for s in sets]) if sets else np.empty(0),
        np.concatenate([s.ends_us for s in sets]) if sets else np.empty(0),
    ))


def covered_us(intervals: Intervals) -> float:
    """Time covered by at least one interval."""
    return union(intervals).total_us


def clip(intervals: Intervals, start_us: float, end_us: float) -> Intervals:
    """The parts of the intervals that lie inside [start_us, end_us)."""
    starts = np.maximum(intervals.starts_us, start_us)
    ends = np.minimum(intervals.ends_us, end_us)
    keep = ends > starts
    return Intervals(starts[keep], ends[keep])


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two interval sets (both are normalized first)."""
    a, b = union(a), union(b)
    if not len(a) or not len(b):
        return Intervals.empty()
    # For each interval of `a`, the intervals of `b` that can overlap it form a contiguous run.
    first = np.searchsorted(b.ends_us, a.starts_us, side="right")
    last = np.searchsorted(b.starts_us, a.ends_us, side="left")
    counts = np.maximum(last - first, 0)
    a_index = np.repeat(np.arange(len(a)), counts)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    b_index = np.repeat(first, counts) + offsets
    starts = np.maximum(a.starts_us[a_index], b.starts_us[b_index])
    ends = np.minimum(a.ends_us[a_index], b.ends_us[b_index])
    keep = ends > starts
    return Intervals(starts[keep], ends[keep])


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The parts of `a` not covered by `b` (normalized)."""
    a = union(a)
    if not len(a):
        return a
    inside = intersect(a, b)
    if not len(inside):
        return a
    # a minus (a ∩ b): walk the boundaries of both as +1/-1 events.
    points = np.concatenate([a.starts_us, a.ends_us, inside.starts_us, inside.ends_us])
    deltas = np.concatenate([
        np.ones(len(a)), -np.ones(len(a)), -np.ones(len(inside)), np.ones(len(inside)),
    ])
    order = np.lexsort((deltas, points))
    points, level = points[order], np.cumsum(deltas[order])
    lengths = np.diff(points)
    active = level[:-1] > 0
    return union(Intervals(points[:-1][active & (lengths > 0)], points[1:][active & (lengths > 0)]))


def overlap_us(a: Intervals, b: Intervals) -> float:
    """Time covered by both sets."""
    return intersect(a, b).total_us


def covered_between(intervals: Intervals, starts_us: np.ndarray, ends_us: np.ndarray) -> np.ndarray:
    """For each query [start, end), the time covered by `intervals` inside it (0 for empty queries)."""
    normalized = union(intervals)
    starts_us = np.asarray(starts_us, dtype=np.float64)
    ends_us = np.maximum(np.asarray(ends_us, dtype=np.float64), starts_us)
    if not len(normalized):
        return np.zeros(starts_us.shape)
    return _covered_before(normalized, ends_us) - _covered_before(normalized, starts_us)


def _covered_before(normalized: Intervals, times_us: np.ndarray) -> np.ndarray:
    """Time covered by a normalized set before each time."""
    lengths = normalized.ends_us - normalized.starts_us
    before = np.concatenate([[0.0], np.cumsum(lengths)])
    slot = np.searchsorted(normalized.starts_us, times_us, side="right") - 1
    inside = np.clip(times_us - normalized.starts_us[np.clip(slot, 0, None)], 0, lengths[np.clip(slot, 0, None)])
    return np.where(slot >= 0, before[np.clip(slot, 0, None)] + inside, 0.0)


def inside_any(starts_us, ends_us, times_us) -> np.ndarray:
    """Which times fall inside one of the ranges [start, end) (they may overlap). A time is in some range
    starting at or before it iff the latest end among those ranges is after it: one search over the sorted
    starts, linear in the times whatever the number of ranges."""
    times_us = np.asarray(times_us, dtype=np.float64)
    starts, ends = np.asarray(starts_us, dtype=np.float64), np.asarray(ends_us, dtype=np.float64)
    if not starts.size:
        return np.zeros(times_us.shape, dtype=bool)
    order = np.argsort(starts, kind="stable")
    starts, latest_end = starts[order], np.maximum.accumulate(ends[order])
    slot = np.searchsorted(starts, times_us, side="right") - 1
    return (slot >= 0) & (times_us < latest_end[np.clip(slot, 0, None)])
