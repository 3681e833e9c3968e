import numpy as np
import pytest

from fleetscope.analysis.per_rank.intervals import (
    Intervals, clip, covered_between, covered_us, intersect, overlap_us, subtract, union,
)


def _pairs(intervals: Intervals) -> list[tuple[float, float]]:
    return list(zip(intervals.starts_us.tolist(), intervals.ends_us.tolist()))


def test_union_merges_overlapping_and_touching_and_drops_empty():
    merged = union(Intervals.of([5, 0, 2, 10, 20], [8, 3, 5, 12, 20]))
    assert _pairs(merged) == [(0, 8), (10, 12)]
    assert merged.total_us == 10


def test_union_keeps_a_long_interval_that_contains_later_ones():
    merged = union(Intervals.of([0, 1, 2, 50], [100, 3, 4, 60]))
    assert _pairs(merged) == [(0, 100)]


def test_intersect_of_two_sets():
    a = Intervals.of([0, 10], [5, 20])
    b = Intervals.of([3, 12, 18], [11, 14, 30])
    assert _pairs(intersect(a, b)) == [(3, 5), (10, 11), (12, 14), (18, 20)]
    assert overlap_us(a, b) == 7


def test_subtract_removes_covered_parts_only():
    a = Intervals.of([0, 50], [40, 60])
    b = Intervals.of([10, 35, 55], [20, 45, 70])
    assert _pairs(subtract(a, b)) == [(0, 10), (20, 35), (50, 55)]


def test_subtract_nothing_and_everything():
    a = Intervals.of([0], [10])
    assert _pairs(subtract(a, Intervals.empty())) == [(0, 10)]
    assert _pairs(subtract(a, Intervals.of([-5], [15]))) == []


def test_clip_and_covered():
    clipped = clip(Intervals.of([0, 8, 30], [10, 20, 40]), 5, 35)
    assert _pairs(clipped) == [(5, 10), (8, 20), (30, 35)]
    assert covered_us(clipped) == 20


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        Intervals.of([0, 1], [2])


def test_random_sets_agree_with_a_dense_grid():
    rng = np.random.default_rng(7)
    starts_a = rng.integers(0, 1000, 60)
    a = Intervals.of(starts_a, starts_a + rng.integers(0, 80, 60))
    starts_b = rng.integers(0, 1000, 40)
    b = Intervals.of(starts_b, starts_b + rng.integers(0, 80, 40))
    grid_a, grid_b = np.zeros(1100, bool), np.zeros(1100, bool)
    for s, e in _pairs(a):
        grid_a[int(s):int(e)] = True
    for s, e in _pairs(b):
        grid_b[int(s):int(e)] = True
    assert covered_us(a) == grid_a.sum()
    assert overlap_us(a, b) == (grid_a & grid_b).sum()
    assert subtract(a, b).total_us == (grid_a & ~grid_b).sum()


def test_covered_between_queries():
    intervals = Intervals.of([0, 20, 50], [10, 30, 60])
    starts = np.array([-5, 5, 10, 25, 0, 70, 40])
    ends = np.array([5, 25, 20, 55, 100, 80, 30])   # the last query is empty (end < start)
    assert covered_between(intervals, starts, ends).tolist() == [5, 10, 0, 10, 30, 0, 0]
    assert covered_between(Intervals.empty(), starts, ends).tolist() == [0] * 7
