"""Which lane each slice of a track takes, and the order of its begins and ends: the lane rule's one owner.

Slices come sorted by (start, -end). The nesting loop (`nest_codes`: the rule, which tracks.nest_into_lanes
emits for the few made-up slices, and the reference the arrays are held to) puts slice i on the
lowest lane whose innermost open slice contains it; on lane L the open slices at i's start are those of L
that end after it (each lane's stack nests, so popping the ended ones from the top pops all of them), and
the innermost is the latest begun. Most tracks nest on one lane (`_one_lane_codes`: one sort, checked).
For the others, lane 0 is found on arrays (`slice_lanes`: the latest slice before each one that reaches
its start, by a table of maxima), the few slices above it take their lanes in a short loop, and the order
of begins and ends follows from the lanes (`codes_of_lanes`)."""

from __future__ import annotations

import numpy as np


def nest_codes(starts: list[int], ends: list[int]) -> tuple[list[int], list[int], int]:
    """The lanes of slices sorted by (start, -end): the emission order as codes (i: slice i begins, ~i: it
    ends), each slice's lane, and the lane count. Each slice goes on the lowest lane whose innermost open slice
    contains it (or that has none open). The reference `lane_codes` is held to."""
    stacks: list[list[int]] = []
    codes: list[int] = []
    lanes = [0] * len(starts)
    emit = codes.append
    for index, start in enumerate(starts):
        end = ends[index]
        lane = 0
        for stack in stacks:
            while stack and ends[stack[-1]] <= start:
                emit(~stack.pop())
            if not stack or ends[stack[-1]] >= end:
                break
            lane += 1
        if lane == len(stacks):
            stacks.append([])
        stacks[lane].append(index)
        lanes[index] = lane
        emit(index)
    for stack in stacks:
        while stack:
            emit(~stack.pop())
    return codes, lanes, len(stacks)


def track_codes(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """nest_codes on int64 arrays: (codes, lanes, lane count), codes and lanes as int64 arrays. A track
    whose slices all nest on one lane (most) is ordered by one sort and checked; others by lane_codes."""
    codes = _one_lane_codes(starts, ends)
    if codes is not None:
        return codes, np.zeros(len(starts), dtype=np.int64), 1
    return lane_codes(starts, ends)


def lane_codes(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """nest_codes on int64 arrays: (codes, lanes, lane count), codes and lanes as int64 arrays."""
    lanes = slice_lanes(starts, ends)
    if lanes is None:
        codes, lane_list, lane_count = nest_codes(starts.tolist(), ends.tolist())
        return np.asarray(codes, dtype=np.int64), np.asarray(lane_list, dtype=np.int64), lane_count
    lane_count = int(lanes.max()) + 1 if len(lanes) else 0
    return codes_of_lanes(starts, ends, lanes, lane_count), lanes, lane_count


GUESS_ROUNDS = 6
"""How many times slice_lanes corrects its guess of lane 0 before it leaves the track to the loop."""


def slice_lanes(starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """Each slice's lane under the nesting loop, or None where the loop must find them.

    The loop decides whether a slice goes on lane 0 from lane 0's slices before it only: it does if it
    ends no later than the latest lane-0 slice before it that reaches its start (or there is none). So a
    guess of lane 0 that gives itself back under that rule is the loop's lane 0. The first guess takes the
    latest reaching slice of any lane; each next one looks further back where that slice was guessed above
    lane 0. The slices above lane 0 then take lanes as the loop gives them (their stacks hold only them)."""
    positions = np.arange(len(starts))
    reaching = _MaxTable(ends).reaching_before(positions, starts)
    above = ~_fits(reaching, ends)
    for _ in range(GUESS_ROUNDS):
        if not above.any():
            return np.zeros(len(starts), dtype=np.int64)
        stale = np.flatnonzero(reaching >= 0)
        stale = stale[above[reaching[stale]]]
        lane_zero = reaching.copy()
        lane_zero[stale] = _MaxTable(np.where(above, np.iinfo(np.int64).min, ends)).reaching_before(
            stale, starts[stale])
        guess = ~_fits(lane_zero, ends)
        if (guess == above).all():
            return _with_upper_lanes(above, starts, ends)
        above = guess
    return None


def _fits(reaching: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Whether each slice ends no later than the slice `reaching` names (True where it names none, -1)."""
    has = reaching >= 0
    fits = np.ones(len(ends), dtype=bool)
    fits[has] = ends[reaching[has]] >= ends[has]
    return fits


def _with_upper_lanes(above: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    lanes = np.zeros(len(starts), dtype=np.int64)
    rows = np.flatnonzero(above)
    stacks: list[list[int]] = []
    lanes[rows] = [_upper_lane(stacks, start, end) for start, end in zip(starts[rows].tolist(), ends[rows].tolist())]
    return lanes


def _upper_lane(stacks: list[list[int]], start: int, end: int) -> int:
    """The lane above 0 the loop gives a slice that does not nest on lane 0 (stacks of the ends open on
    lanes 1, 2, ...)."""
    for offset, stack in enumerate(stacks):
        while stack and stack[-1] <= start:
            stack.pop()
        if not stack or stack[-1] >= end:
            stack.append(end)
            return offset + 1
    stacks.append([end])
    return len(stacks)


class _MaxTable:
    """Maxima of `ends` over power-of-two runs, to find the latest slice before a position that ends after a time."""

    def __init__(self, ends: np.ndarray):
        self.levels = [ends]
        width = 1
        while 2 * width <= len(ends):
            previous = self.levels[-1]
            self.levels.append(np.maximum(previous[:-width], previous[width:]))
            width *= 2

    def reaching_before(self, positions: np.ndarray, times: np.ndarray) -> np.ndarray:
        """For each position p and time t: the largest j < p with ends[j] > t, or -1."""
        bound = positions.copy()
        for level in range(len(self.levels) - 1, -1, -1):
            width = 1 << level
            candidate = bound - width
            ok = candidate >= 0
            values = self.levels[level][np.where(ok, candidate, 0)]
            step = ok & (values <= times)
            bound[step] = candidate[step]
        return bound - 1


def codes_of_lanes(starts: np.ndarray, ends: np.ndarray, lanes: np.ndarray, lane_count: int) -> np.ndarray:
    """The nesting loop's emission order, given each slice's lane. Slice i's begin comes after the ends the
    loop pops when it places i: on each lane it visits (0 up to i's lane), lowest lane first, the slices of
    that lane ended by i's start, latest begun first. So slice j (lane L) ends at the first later slice that
    starts at or after j's end and visits L (its lane is L or higher), or in the final flush (lane by lane)."""
    count = len(starts)
    index = np.arange(count)
    reached = np.maximum(index + 1, np.searchsorted(starts, ends, side="left"))
    popped_at = reached.copy()
    for lane in range(1, lane_count):
        on_lane = np.flatnonzero(lanes == lane)
        visits = np.flatnonzero(lanes >= lane)
        at = np.searchsorted(visits, reached[on_lane])
        popped_at[on_lane] = np.append(visits, count)[at]
    popped_at = np.minimum(popped_at, count)
    return _sorted_codes(index, popped_at, lanes, lane_count)


def _sorted_codes(index: np.ndarray, popped_at: np.ndarray, lanes: np.ndarray, lane_count: int) -> np.ndarray:
    """Begins (i) and ends (~j) sorted by (slice placed, ends before the begin, lane, latest begun first),
    by one int64 key where it fits."""
    count = len(index)
    if (count + 1) * 2 * max(lane_count, 1) * (count + 1) >= 2**62:
        order = np.lexsort((np.concatenate([np.zeros(count, dtype=np.int64), -index]),
                            np.concatenate([np.zeros(count, dtype=np.int64), lanes]),
                            np.concatenate([np.ones(count, dtype=np.int8), np.zeros(count, dtype=np.int8)]),
                            np.concatenate([index, popped_at])))
    else:
        lanes_of = max(lane_count, 1)
        begins = ((index * 2 + 1) * lanes_of) * count
        ends = ((popped_at * 2) * lanes_of + lanes) * count + (count - 1 - index)
        order = np.argsort(np.concatenate([begins, ends]))
    return np.where(order < count, order, ~(order - count))


def _one_lane_codes(starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """nest_codes of slices sorted by (start, -end) that all nest on one lane (no slice starts inside another
    and ends after it: a CPU thread's calls, a GPU stream's kernels); None when they do not.

    On one lane, slice j's end is emitted just before the begin of the first later slice that starts at or
    after it (the stack pops every slice that ended by then, the latest begun first), or at the end. That
    order is built by a sort, then checked: it must pair every begin with its own end at the same depth,
    and each slice must end no later than the slice it opened inside (else nest_codes puts it on a new lane)."""
    count = len(starts)
    index = np.arange(count)
    emitted_before = np.maximum(index + 1, np.searchsorted(starts, ends, side="left"))
    order = np.lexsort((np.concatenate([np.zeros(count, dtype=np.int64), -index]),
                        np.concatenate([np.ones(count, dtype=np.int8), np.zeros(count, dtype=np.int8)]),
                        np.concatenate([index, emitted_before])))
    is_begin = order < count
    slice_of = np.where(is_begin, order, order - count)
    depth_after = np.cumsum(np.where(is_begin, 1, -1))
    if len(depth_after) and depth_after.min() < 0:
        return None
    level = np.where(is_begin, depth_after - 1, depth_after)
    if not _pairs_at_each_depth(is_begin, slice_of, level):
        return None
    if not _ends_inside_parents(is_begin, slice_of, level, ends):
        return None
    return np.where(is_begin, order, ~slice_of)


def _pairs_at_each_depth(is_begin: np.ndarray, slice_of: np.ndarray, level: np.ndarray) -> bool:
    """Whether, depth by depth in emission order, the events run begin, its own end, begin, its own end, ..."""
    by_level = np.lexsort((np.arange(len(level)), level))
    begins, slices, levels = is_begin[by_level], slice_of[by_level], level[by_level]
    return bool(begins[0::2].all() and not begins[1::2].any() and (slices[0::2] == slices[1::2]).all()
                and (levels[0::2] == levels[1::2]).all())


def _ends_inside_parents(is_begin: np.ndarray, slice_of: np.ndarray, level: np.ndarray, ends: np.ndarray) -> bool:
    """Whether each slice ends no later than its parent: the last slice begun one level up before it."""
    positions = np.flatnonzero(is_begin)
    levels, slices = level[positions], slice_of[positions]
    stride = 2 * len(level) + 1
    keys = levels * stride + positions
    by_key = np.argsort(keys, kind="stable")
    child = levels > 0
    at = np.searchsorted(keys[by_key], (levels[child] - 1) * stride + positions[child]) - 1
    if len(at) and (at.min() < 0 or (levels[by_key[at]] != levels[child] - 1).any()):
        return False
    return bool((ends[slices[by_key[at]]] >= ends[slices[child]]).all())
