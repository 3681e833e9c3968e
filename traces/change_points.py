"""Change points in a step-time series: where a rank became slower or faster, and by how much.

The one owner of change detection, pure numpy (no torch), for the whole-run analysis and the trainer alike.
Stable API (everything else here is private):

    segment_levels(values, steps=None, *, false_alarm_rate=FALSE_ALARM_RATE, min_steps=MIN_SEGMENT_STEPS)
        -> list[Segment]
        Offline: the segments of one series of positive values (e.g. a rank's step_ms over the cross-rank
        median of each step), each Segment(start_step, end_step, level, steps). NaN / non-positive values
        are skipped. `level` is the segment's median value (1.2 = 20% above the median rank).
    ChangeDetector(min_change=0.2, ...).observe(value) -> str | None
        Online: one value per step; returns the reason once a sustained change of at least `min_change`
        (relative) has lasted `consecutive` steps (2 by default: it fires on the second step of the change),
        else None. After firing it adopts the new level as its baseline.

How (offline): binary segmentation of log(value) under a mean-shift model. The noise scale is estimated
robustly (the median absolute difference of neighbours, so level shifts do not inflate it), values are
clipped at +/- CLIP_SIGMAS scales for the search (one-step spikes make no segments; levels use the unclipped
values). A split is kept when its standardized gain exceeds the threshold of the maximally selected
likelihood ratio for a false-alarm probability of `false_alarm_rate` per test (Csorgo & Horvath's
asymptotic law). Long series are searched on bins of at most MAX_SEARCH_POINTS points (bin means weighted
by their counts, the noise scale estimated on the bins too, so correlated noise raises it), then each change
is refined at step resolution within two bins on either side.

How (online): a one-sided CUSUM each way on z = (log value - baseline) / scale, with the baseline the median
of a running window and the scale its robust spread (never below MIN_SCALE), reference k = half the change
in scale units; one value's contribution is capped, so a lone spike never fires; it fires when the sum
passes the threshold after `consecutive` steps beyond k in one direction.

Measured (tests/test_cross_rank_whole_run.py, seeded lognormal noise of 5% a step): offline, a +20% level for steps
300-599 of 1,000 is located within 2 steps at 98% of change points (never more than 3 off), its size within
2 points; stationary series of 1,000 or 100,000 steps got no split in 200 and 50 seeds. Online (defaults),
a change of +30% or -25% fires on its first or second step in 200 of 200 seeds; +20% (4 noise scales) fires
within 2 steps in 88% (two values cannot tell 4 scales from noise more often at this quietness); stationary
noise fired 3 times in 400,000 steps. The faster it must fire, the larger the change must be next to the
noise: about 6 noise scales for two steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

FALSE_ALARM_RATE = 0.01
"""Probability that a stationary series gets a spurious split, per test (one test per series without change)."""
MIN_SEGMENT_STEPS = 5
"""No segment is shorter: a change lasting fewer steps is a spike, not a level."""
MAX_SEARCH_POINTS = 2048
"""A longer series is searched on bins, then refined at step resolution."""
MAX_CHANGES = 64
"""Searching stops after this many change points (bounds the time on hostile series)."""
CLIP_SIGMAS = 6.0
MIN_SCALE = 0.005
"""Relative noise below this (0.5%) is taken as this: a perfectly even series is not infinitely sensitive."""
BASELINE_REFRESH = 16
"""The online detector's baseline is recomputed every this many steps (see ChangeDetector._baseline)."""
_MAD_TO_SIGMA = 1.4826
_VALUE_RANGE = (1e-6, 1e6)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Steps start_step..end_step (inclusive) at one level."""

    start_step: int
    end_step: int
    level: float
    """The median value over the segment's steps."""
    steps: int
    """How many values the segment holds (steps with no value inside it are not counted)."""


def segment_levels(values, steps=None, *, false_alarm_rate: float = FALSE_ALARM_RATE,
                   min_steps: int = MIN_SEGMENT_STEPS) -> list[Segment]:
    """The segments of a series (module docstring). `steps`: each value's step number (default 0, 1, ...)."""
    if not 0 < false_alarm_rate < 1:
        raise ValueError(f"false_alarm_rate must be in (0, 1), got {false_alarm_rate}")
    if min_steps < 1:
        raise ValueError(f"min_steps must be >= 1, got {min_steps}")
    x, step_numbers = _log_series(values, steps)
    if x.size == 0:
        return []
    bounds = _change_bounds(x, false_alarm_rate, min_steps)
    return [Segment(start_step=int(step_numbers[a]), end_step=int(step_numbers[b - 1]),
                    level=float(np.exp(np.median(x[a:b]))), steps=int(b - a))
            for a, b in zip(bounds[:-1], bounds[1:])]


def change_threshold(points: int, false_alarm_rate: float = FALSE_ALARM_RATE) -> float:
    """The standardized gain (chi-square, one degree of freedom) a split of `points` values must exceed:
    the (1 - false_alarm_rate) quantile of the maximum over split positions under no change
    (Csorgo & Horvath 1997, Theorem 1.3.1: a_n sqrt(G) - b_n tends to the double-exponential law)."""
    loglog = math.log(math.log(max(points, 16)))
    a_n = math.sqrt(2.0 * loglog)
    b_n = 2.0 * loglog + 0.5 * math.log(loglog) - 0.5 * math.log(math.pi)
    t = -math.log(-math.log1p(-false_alarm_rate) / 2.0)
    return ((t + b_n) / a_n) ** 2


def _log_series(values, steps) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(values, dtype=np.float64)
    numbers = np.arange(x.size) if steps is None else np.asarray(steps, dtype=np.int64)
    if numbers.shape != x.shape:
        raise ValueError(f"steps has shape {numbers.shape}, values {x.shape}")
    keep = np.isfinite(x) & (x > 0)
    return np.log(np.clip(x[keep], *_VALUE_RANGE)), numbers[keep]


def _change_bounds(x: np.ndarray, false_alarm_rate: float, min_steps: int) -> list[int]:
    """Segment boundaries as indices into x: [0, c1, ..., n]."""
    n = x.size
    if n < 2 * min_steps:
        return [0, n]
    scale = _noise_scale(x)
    center = float(np.median(x))
    clipped = np.clip(x, center - CLIP_SIGMAS * scale, center + CLIP_SIGMAS * scale)
    bin_size = max(1, math.ceil(n / MAX_SEARCH_POINTS))
    sums, counts = _bins(clipped, bin_size)
    if bin_size > 1:
        scale = max(scale, _noise_scale(sums / counts) * math.sqrt(bin_size))
    min_bins = max(1, math.ceil(min_steps / bin_size))
    cuts = _binary_segmentation(sums, counts, scale, false_alarm_rate, min_bins)
    cuts = [c * bin_size for c in cuts]
    if bin_size > 1:
        cuts = _refine(clipped, cuts, bin_size, min_steps)
    return [0, *cuts, n]


def _noise_scale(x: np.ndarray) -> float:
    """Robust standard deviation of one value: from neighbours' differences (a level shift moves one)."""
    if x.size < 3:
        return MIN_SCALE
    spread = _MAD_TO_SIGMA * float(np.median(np.abs(np.diff(x)))) / math.sqrt(2.0)
    return max(spread, MIN_SCALE)


def _bins(x: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    starts = np.arange(0, x.size, size)
    sums = np.add.reduceat(x, starts)
    counts = np.diff(np.append(starts, x.size)).astype(np.float64)
    return sums, counts


def _binary_segmentation(sums: np.ndarray, counts: np.ndarray, scale: float, false_alarm_rate: float,
                         min_points: int) -> list[int]:
    """Change positions (bin indices), sorted; splits tested widest-gain first until none passes."""
    cum_s = np.concatenate([[0.0], np.cumsum(sums)])
    cum_n = np.concatenate([[0.0], np.cumsum(counts)])
    pending, cuts = [(0, sums.size)], []
    while pending and len(cuts) < MAX_CHANGES:
        start, end = pending.pop()
        split = _best_split(cum_s, cum_n, start, end, scale, false_alarm_rate, min_points)
        if split is None:
            continue
        cuts.append(split)
        pending += [(start, split), (split, end)]
    return sorted(cuts)


def _best_split(cum_s: np.ndarray, cum_n: np.ndarray, start: int, end: int, scale: float,
                false_alarm_rate: float, min_points: int) -> int | None:
    if end - start < 2 * min_points:
        return None
    k = np.arange(start + min_points, end - min_points + 1)
    gain = _split_gain(cum_s, cum_n, start, end, k) / scale ** 2
    best = int(np.argmax(gain))
    if gain[best] <= change_threshold(end - start, false_alarm_rate):
        return None
    return int(k[best])


def _split_gain(cum_s: np.ndarray, cum_n: np.ndarray, start: int, end: int, k: np.ndarray) -> np.ndarray:
    """Reduction of the squared error by splitting [start, end) at each k (unscaled)."""
    left_s, left_n = cum_s[k] - cum_s[start], cum_n[k] - cum_n[start]
    right_s, right_n = cum_s[end] - cum_s[k], cum_n[end] - cum_n[k]
    total_s, total_n = cum_s[end] - cum_s[start], cum_n[end] - cum_n[start]
    return left_s ** 2 / left_n + right_s ** 2 / right_n - total_s ** 2 / total_n


def _refine(x: np.ndarray, cuts: list[int], bin_size: int, min_steps: int) -> list[int]:
    """Each change found on bins moved to its best step within two bins either side, its neighbours fixed."""
    refined = list(cuts)
    cum = np.concatenate([[0.0], np.cumsum(x)])
    cum_n = np.arange(x.size + 1, dtype=np.float64)
    for index, cut in enumerate(cuts):
        start = refined[index - 1] if index else 0
        end = cuts[index + 1] if index + 1 < len(cuts) else x.size
        low = max(start + min_steps, cut - 2 * bin_size)
        high = min(end - min_steps, cut + 2 * bin_size)
        if low > high:
            continue
        k = np.arange(low, high + 1)
        refined[index] = int(k[int(np.argmax(_split_gain(cum, cum_n, start, end, k)))])
    return refined


def _sorted_median(ordered: list[float]) -> float:
    """numpy's median of an ascending list (the mean of the two middle values of an even count)."""
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2.0


class ChangeDetector:
    """Online detection of a sustained change in one series (module docstring).

    `min_change`: the relative change to detect within `consecutive` steps (0.2: 20% slower or faster);
    `warmup`: values seen before it may fire (the first baseline); `window`: values the baseline is the median
    of; `threshold`: the CUSUM level, in noise scales, that fires."""

    def __init__(self, *, min_change: float = 0.2, warmup: int = 16, window: int = 128, threshold: float = 3.0,
                 consecutive: int = 2) -> None:
        if not 0 < min_change < 10:
            raise ValueError(f"min_change must be in (0, 10), got {min_change}")
        if warmup < 3 or window < warmup:
            raise ValueError(f"need 3 <= warmup <= window, got warmup {warmup}, window {window}")
        if threshold <= 0 or consecutive < 1:
            raise ValueError(f"threshold must be > 0 and consecutive >= 1, got {threshold}, {consecutive}")
        self.min_change, self.warmup, self.threshold, self.consecutive = min_change, warmup, threshold, consecutive
        self._recent: deque[float] = deque(maxlen=window)
        self._up = self._down = 0.0
        self._run_up = self._run_down = 0
        self._seen = 0
        self._cached: tuple[float, float, float] | None = None
        self._since_refresh = 0

    def observe(self, value: float) -> str | None:
        """One step's value; the reason when a change is detected at this step, else None. Non-finite or
        non-positive values are ignored. Runs every step of every rank with a relative trigger: kept to a few
        plain float operations (no allocation) between baseline refreshes."""
        if type(value) is not float:
            if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
                return None
            value = float(value)
        if not (0.0 < value < math.inf):  # NaN fails too
            return None
        x = math.log(_VALUE_RANGE[0] if value < _VALUE_RANGE[0] else _VALUE_RANGE[1] if value > _VALUE_RANGE[1]
                     else value)
        self._seen += 1
        if len(self._recent) < self.warmup:
            self._recent.append(x)
            return None
        base, scale, k = self._baseline()
        reason = self._update(x, base, scale, k)
        self._recent.append(x)
        if reason is not None:
            self._adopt_new_level()
        return reason

    def _baseline(self) -> tuple[float, float, float]:
        """(median, robust scale, CUSUM allowance) of the recent values, recomputed every BASELINE_REFRESH
        steps: a median of 128 values moves little in a few steps, and a change resets it (_adopt_new_level).
        Medians by sorted() (~25 us for both on 128 values; numpy's ~90 us, its per-call overhead dominating at
        this size): on the H200's host the detectors were most of what the whole run adds to a 15 ms step."""
        # a young window (a few dozen values) is refreshed more often: its median still moves
        if self._cached is None or self._since_refresh >= min(BASELINE_REFRESH, len(self._recent) // 4):
            recent = sorted(self._recent)
            base = _sorted_median(recent)
            scale = max(_MAD_TO_SIGMA * _sorted_median(sorted([abs(x - base) for x in recent])), MIN_SCALE)
            self._cached = (base, scale, math.log1p(self.min_change) / scale / 2.0)
            self._since_refresh = 0
        self._since_refresh += 1
        return self._cached

    def _update(self, x: float, base: float, scale: float, k: float) -> str | None:
        z = (x - base) / scale
        threshold = self.threshold
        # One value adds at most the threshold: a lone spike cannot fire, two steps of the change can.
        up = self._up + (z - k if z - k < threshold else threshold)
        down = self._down + (-z - k if -z - k < threshold else threshold)
        self._up = up if up > 0.0 else 0.0
        self._down = down if down > 0.0 else 0.0
        self._run_up = self._run_up + 1 if z > k else 0
        self._run_down = self._run_down + 1 if -z > k else 0
        if self._up > threshold and self._run_up >= self.consecutive:
            return self._reason("slower", self._up, self._run_up, x, base, scale)
        if self._down > threshold and self._run_down >= self.consecutive:
            return self._reason("faster", self._down, self._run_down, x, base, scale)
        return None

    def _reason(self, word: str, total: float, run: int, x: float, base: float, scale: float) -> str:
        ratio = math.exp(x - base)
        return (f"{word}: {ratio:.2f}x the baseline of the last {len(self._recent)} steps for {run} step(s) "
                f"(CUSUM {total:.1f} > {self.threshold:.1f} noise scales of {100 * scale:.1f}%)")

    def _adopt_new_level(self) -> None:
        """After a change the recent values become the baseline (else it would fire at every step)."""
        run = max(self._run_up, self._run_down)
        changed = list(self._recent)[-run:]
        self._recent.clear()
        self._recent.extend(changed)
        self._cached = None
        self._up = self._down = 0.0
        self._run_up = self._run_down = 0
