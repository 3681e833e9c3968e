"""Anomaly triggers (`profiler.trigger`), parsed and evaluated without torch.

Grammar: comma-separated `metric>threshold`:
  step_time>2x        this rank's step time over 2x the median of its last `profiler.trigger_history` steps,
                      or a sustained slowdown of about that size found by the online change detector
                      (traces/change_points.py ChangeDetector, min_change 2 - 1: the whole-run analysis's
                      definition of a change; it fires on the second step of the change), when those two
                      steps average at least 1.6x (SUSTAINED_SHARE of the size: a smaller persistent
                      slowdown does not fire)
  step_time>500ms     ... over an absolute 500 ms
  data_time>3x, data_time>50ms   the same for the step's data-loading time
Absolute thresholds (`ms`) compare each step alone, nothing else.
  rank_step_time>1.5x some rank's step time over 1.5x the median of all ranks' (compared every
                      `profiler.trigger_every` steps, from values carried by the per-step agreement)
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass

from ..traces.change_points import ChangeDetector

METRICS = ("step_time", "data_time", "rank_step_time")
_TRIGGER_RE = re.compile(r"^(?P<metric>[a-z_]+)\s*>\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>x|ms)$")
SUSTAINED_SHARE = 0.6
"""Of a relative trigger's size, what a sustained change must reach to fire it (_near_threshold)."""
SUSTAINED_STEPS = 2
"""Steps whose mean that is (the detector fires on the second step of a change)."""
MIN_HISTORY = 5
"""A rolling median (and the change detector's first baseline) needs this many steps before a relative
trigger can fire."""
MAX_MIN_CHANGE = 9.99
"""The change detector takes a relative change below 10 (11x); larger thresholds ask it for this."""


@dataclass(frozen=True, slots=True)
class Trigger:
    metric: str
    threshold: float
    relative: bool
    """True: `threshold` times a median; False: milliseconds."""

    @property
    def text(self) -> str:
        return f"{self.metric}>{self.threshold:g}{'x' if self.relative else 'ms'}"


def parse_triggers(text: str) -> list[Trigger]:
    """`step_time>2x,data_time>50ms` -> triggers; raises ValueError saying which part is wrong."""
    triggers = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = _TRIGGER_RE.match(part)
        if match is None or match["metric"] not in METRICS:
            raise ValueError(f"cannot parse {part!r}: expected METRIC>Nx or METRIC>Nms, METRIC one of {METRICS}")
        relative = match["unit"] == "x"
        threshold = float(match["value"])
        if match["metric"] == "rank_step_time" and not relative:
            raise ValueError(f"{part!r}: rank_step_time compares ranks, so its threshold is Nx")
        if relative and threshold <= 1.0:
            raise ValueError(f"{part!r}: a relative threshold must be > 1x")
        triggers.append(Trigger(match["metric"], threshold, relative))
    return triggers


class LocalTriggers:
    """This rank's step_time / data_time triggers over a rolling history of unprofiled steps."""

    def __init__(self, triggers: list[Trigger], history: int):
        self._triggers = [t for t in triggers if t.metric != "rank_step_time"]
        self._history = {m: deque(maxlen=history) for m in ("step_time", "data_time")}
        self._recent = {m: deque(maxlen=SUSTAINED_STEPS - 1) for m in ("step_time", "data_time")}
        self._detectors = {t: ChangeDetector(min_change=min(t.threshold - 1.0, MAX_MIN_CHANGE), warmup=MIN_HISTORY,
                                             window=max(history, MIN_HISTORY))
                           for t in self._triggers if t.relative}

    def observe(self, step_time_ms: float, data_ms: float) -> str | None:
        """Add one step; the reason when a trigger fires on it (the step is then kept out of the history)."""
        values = {"step_time": step_time_ms, "data_time": data_ms}
        reason = None
        for trigger in self._triggers:
            value = values[trigger.metric]
            fired = _fires(trigger, value, self._history[trigger.metric])
            detector = self._detectors.get(trigger)
            change = detector.observe(value) if detector is not None else None  # every step: it keeps its level
            recent = self._recent[trigger.metric]
            if fired is None and change is not None and change.startswith("slower") \
                    and _near_threshold(trigger, [*recent, value], self._history[trigger.metric]):
                fired = f"{trigger.metric} {value:.1f} ms, a sustained change ({trigger.text}): {change}"
            reason = reason or fired
        for metric, value in values.items():
            self._recent[metric].append(value)
        if reason is None:
            for metric, value in values.items():
                self._history[metric].append(value)
        return reason


def _near_threshold(trigger: Trigger, values: list[float], history: deque) -> bool:
    """A sustained change fires a relative trigger only when its last SUSTAINED_STEPS steps average at least
    SUSTAINED_SHARE of the trigger's size above the rolling median ((1 + 0.6 (N - 1))x: 1.6x for 2x). A CUSUM
    also fires some steps into a smaller persistent slowdown (1.45x under 2x at 1% noise), which is not what
    `2x` asks for; the mean of two steps keeps one noisy step of a real 1.8x change from hiding it."""
    if len(history) < MIN_HISTORY or len(values) < SUSTAINED_STEPS:
        return False
    median = statistics.median(history)
    return median > 0 and statistics.fmean(values) >= (1.0 + SUSTAINED_SHARE * (trigger.threshold - 1.0)) * median


def _fires(trigger: Trigger, value: float, history: deque) -> str | None:
    if not trigger.relative:
        return f"{trigger.metric} {value:.1f} ms > {trigger.threshold:g} ms" if value > trigger.threshold else None
    if len(history) < MIN_HISTORY:
        return None
    median = statistics.median(history)
    if median > 0 and value > trigger.threshold * median:
        return (f"{trigger.metric} {value:.1f} ms = {value / median:.2f}x the median {median:.1f} ms "
                f"of the last {len(history)} steps (threshold {trigger.threshold:g}x)")
    return None


def rank_outliers(trigger: Trigger, step_times_ms: list[float]) -> str | None:
    """The reason when some rank's step time is over `threshold` x the median of all ranks'."""
    valid = [t for t in step_times_ms if t > 0]
    if len(valid) < 2:
        return None
    median = statistics.median(valid)
    slow = [(rank, t) for rank, t in enumerate(step_times_ms) if median > 0 and t > trigger.threshold * median]
    if not slow:
        return None
    worst_rank, worst = max(slow, key=lambda item: item[1])
    return (f"rank {worst_rank} step {worst:.1f} ms = {worst / median:.2f}x the median {median:.1f} ms of "
            f"{len(valid)} ranks (threshold {trigger.threshold:g}x); slow ranks: {[r for r, _ in slow]}")
