"""Unplanned profiling windows of a running job: on request (`fleetscope profile`) and on anomalies.

Every rank must open such a window at the same global step, so the start is agreed collectively, at no
extra cost: the per-step stop-flag all-reduce (preemption.py) carries a few more numbers, max-reduced:

    [stop level, request number, trigger vote, step time of rank 0, ..., of rank W-1]

  - request number: rank 0 looks for request files at step boundaries (a directory stat every
    `profiler.request_poll_steps` steps or `request_poll_seconds`), and votes the oldest new one;
  - trigger vote: 1 + the rank whose step_time / data_time trigger fired (0: none);
  - step times: only every `profiler.trigger_every` steps and only with a rank_step_time trigger; each rank
    fills its own slot, so the max-reduce is an all-gather.
The agreed values of step p are read with step p's metrics, once step p+1 is launched; every rank then
computes the same window from them (first free step >= p+2, after planned and earlier windows).
Rank 0 writes the request's status and the capture record; a triggered window's record is written by the
rank that fired it (its reason is local), or by rank 0 for rank_step_time.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..traces.capture import (
    CaptureRecord,
    CaptureRequest,
    RequestError,
    RequestStatus,
    now_iso_ms,
    read_request,
    read_status,
    request_numbers,
    write_capture_record,
    write_status,
)
from ..traces.layout import WINDOW_RE, RunLayout, parse_trace_file_name
from .config import TrainConfig
from .metrics import StepMetrics
from .profiling import Window
from .triggers import LocalTriggers, parse_triggers, rank_outliers

log = logging.getLogger("fleetscope.trainer")

REQUEST_SLOT, TRIGGER_SLOT = 0, 1
FIXED_SLOTS = 2
FIRST_START_AFTER = 2
"""A window agreed with step p's metrics starts at p + 2 at the earliest: step p + 1 is already running."""
WINDOW_GAP_STEPS = 1
"""Unprofiled steps between an on-demand or triggered window and any other: a profiler never starts right after
one stopped (kineto PR #1554: a race with CUPTI teardown, traces/cupti.py)."""


def _windows_on_disk(layout: RunLayout) -> list[int]:
    """Window indices an earlier attempt of the run already used (read before any rank can add one: the
    first agreement needs every rank): a resumed job numbers its unplanned windows after them."""
    names = [p.name for p in layout.traces_dir.glob("window*")] + [p.stem for p in layout.captures_dir.glob("window*.json")]
    return [int(m["index"]) for m in map(WINDOW_RE.match, names) if m]


class RequestPoller:
    """Rank 0's cheap look for new request files: a stat of requests/ when due, a listing when it changed."""

    def __init__(self, layout: RunLayout, every_steps: int, every_s: float):
        self._layout, self._every_steps, self._every_s = layout, every_steps, every_s
        self._last_poll = float("-inf")
        self._last_mtime: int | None = None
        self._seen = 0

    def poll(self, step: int, *, force: bool = False) -> list[int]:
        """Numbers of requests not seen before and without a status file (in order)."""
        now = time.monotonic()
        if not force and step % self._every_steps and now - self._last_poll < self._every_s:
            return []
        self._last_poll = now
        try:
            mtime = os.stat(self._layout.requests_dir).st_mtime_ns
        except OSError:
            return []
        if mtime == self._last_mtime and not force:
            return []
        self._last_mtime = mtime
        new = [n for n in request_numbers(self._layout) if n > self._seen]
        self._seen = max(new, default=self._seen)
        return [n for n in new if not self._layout.request_status_file(n).exists()]


@dataclass
class Unplanned:
    window: Window
    kind: str
    request: int | None
    """The request number (None: triggered)."""
    ranks: list[int] | None
    published: bool = False


class CaptureController:
    """One rank's part in on-demand and triggered windows; the loop calls votes / observe / agreed / close."""

    def __init__(self, *, config: TrainConfig, layout: RunLayout, rank: int, world_size: int,
                 planned: list[Window], open_window: Callable[[Window], None]):
        self._profiler, self._total = config.profiler, config.steps
        self._layout, self._rank, self._world = layout, rank, world_size
        self._known = list(planned)
        self._next_index = max([w.index for w in planned] + _windows_on_disk(layout), default=-1) + 1
        self._open_window = open_window
        triggers = parse_triggers(self._profiler.trigger)
        self._local = LocalTriggers(triggers, self._profiler.trigger_history)
        self._rank_trigger = next((t for t in triggers if t.metric == "rank_step_time"), None)
        self._has_local = any(t.metric != "rank_step_time" for t in triggers)
        on_demand = self._profiler.on_demand and rank == 0
        self._poller = RequestPoller(layout, self._profiler.request_poll_steps,
                                     self._profiler.request_poll_seconds) if on_demand else None
        self._waiting: list[CaptureRequest] = []
        self._served: set[int] = set()
        self._unplanned: list[Unplanned] = []
        self._trigger_reason: str | None = None
        self._last_step_ms = 0.0
        self._triggered = 0
        self._quiet_until = -1
        """No trigger fires before this step (cooldown; a window's own steps and the one after it)."""
        self._status_refused = False
        """A request status could not be written (requests/ is not the run's own folder): said once."""

    @property
    def active(self) -> bool:
        """Whether anything here needs the per-step agreement (a single rank skips it otherwise)."""
        return self._profiler.on_demand or bool(self._profiler.trigger)

    def votes(self, step: int) -> list[float]:
        """This rank's extra values for the agreement issued after `step`."""
        if self._poller is not None:
            self._take_requests(self._poller.poll(step), step)
        values = [float(self._waiting[0].number) if self._waiting else 0.0,
                  float(self._rank + 1) if self._trigger_reason else 0.0]
        if self._rank_slots(step):
            slots = [0.0] * self._world
            slots[self._rank] = self._last_step_ms
            values += slots
        return values

    def _rank_slots(self, step: int) -> bool:
        return self._rank_trigger is not None and step % self._profiler.trigger_every == 0

    def observe(self, metrics: StepMetrics) -> None:
        """A finished step's metrics (profiled steps are kept out of the triggers' history)."""
        self._last_step_ms = metrics.step_time_ms
        if not self._has_local or metrics.profiled or metrics.step < self._quiet_until:
            return
        reason = self._local.observe(metrics.step_time_ms, metrics.data_ms)
        if reason and self._trigger_reason is None and self._may_trigger(metrics.step):
            self._trigger_reason = f"step {metrics.step} on rank {self._rank}: {reason}"

    def agreed(self, step: int, values: list[float]) -> None:
        """The max-reduced votes of the agreement issued after `step` (same on every rank)."""
        self._mark_published(step)
        if not values:
            return
        request = int(values[REQUEST_SLOT])
        if request and request not in self._served:
            self._serve_request(request, step)
        winner = int(values[TRIGGER_SLOT]) - 1
        if winner >= 0:
            self._fire("triggered", step, writer=winner, reason=self._trigger_reason if winner == self._rank else "")
        if self._rank_slots(step) and len(values) >= FIXED_SLOTS + self._world:
            reason = rank_outliers(self._rank_trigger, values[FIXED_SLOTS:FIXED_SLOTS + self._world])
            if reason and step >= self._quiet_until and self._may_trigger(step):
                self._fire("triggered", step, writer=0, reason=f"after step {step}: {reason}",
                           trigger=self._rank_trigger.text)
        if winner >= 0 and (winner == self._rank or not self._may_trigger(step)):
            self._trigger_reason = None  # taken, or capped / cooling down: a new anomaly must fire anew

    def _may_trigger(self, step: int) -> bool:
        return self._triggered < self._profiler.max_triggered_windows and step >= self._quiet_until

    def _take_requests(self, numbers: list[int], step: int) -> None:
        for number in numbers:
            try:
                self._waiting.append(read_request(self._layout, number, world_size=self._world))
            except RequestError as error:
                log.warning("profiling request %d refused: %s", number, error)
                self._status(number, "not_served", reason=f"invalid request: {error}")

    def _serve_request(self, number: int, step: int) -> None:
        self._served.add(number)
        request = self._request(number)
        if request is None:  # unreadable on this rank: every rank must still agree, so record on all
            log.warning("profiling request %d unreadable on rank %d; recording on every rank", number, self._rank)
        warmup = request.warmup if request else self._profiler.trigger_warmup
        active = request.steps if request else self._profiler.trigger_active
        window = self._place(step, warmup, active)
        self._waiting = [r for r in self._waiting if r.number != number]
        if window is None:
            self._status(number, "not_served", reason=f"the job ends at step {self._total} before a window of "
                                                       f"{warmup + active} steps starting after step {step} completes")
            return
        ranks = request.ranks if request else None
        self._open(Unplanned(window, "requested", number, ranks))
        self._status(number, "accepted", window=window, ranks=ranks)
        if self._rank == 0:
            write_capture_record(self._layout, CaptureRecord(
                window=window.index, kind="requested", agreed_at_step=step, warmup_start=window.warmup_start,
                active_start=window.active_start, end=window.end, ranks=ranks, at=now_iso_ms(), request=number,
                requested_by=request.requested_by if request else "", requested_at=request.requested_at if request else ""))

    def _request(self, number: int) -> CaptureRequest | None:
        for request in self._waiting:
            if request.number == number:
                return request
        try:
            return read_request(self._layout, number, world_size=self._world)
        except RequestError:
            return None

    def _fire(self, kind: str, step: int, *, writer: int, reason: str, trigger: str | None = None) -> None:
        if not self._may_trigger(step):
            return
        window = self._place(step, self._profiler.trigger_warmup, self._profiler.trigger_active)
        if window is None:
            return
        self._triggered += 1
        self._quiet_until = window.end + 1 + self._profiler.trigger_cooldown
        self._open(Unplanned(window, kind, None, None))
        if self._rank == writer:
            write_capture_record(self._layout, CaptureRecord(
                window=window.index, kind=kind, agreed_at_step=step, warmup_start=window.warmup_start,
                active_start=window.active_start, end=window.end, ranks=None, at=now_iso_ms(),
                trigger=trigger or self._profiler.trigger, reason=reason))
            log.warning("profiling window %d (steps %d-%d) triggered: %s", window.index, window.active_start,
                        window.end - 1, reason)

    def _place(self, step: int, warmup: int, active: int) -> Window | None:
        """The first window of warmup + active steps from step + 2 that keeps WINDOW_GAP_STEPS from every known
        window (None: none fits)."""
        start = step + FIRST_START_AFTER
        moved = True
        while moved:
            moved = False
            for known in self._known:
                if start < known.end + WINDOW_GAP_STEPS and start + warmup + active + WINDOW_GAP_STEPS > known.warmup_start:
                    start, moved = known.end + WINDOW_GAP_STEPS, True
        if start + warmup + active > self._total:
            return None
        window = Window(self._next_index, start, start + warmup, start + warmup + active)
        self._next_index += 1
        self._known.append(window)
        return window

    def _open(self, unplanned: Unplanned) -> None:
        self._unplanned.append(unplanned)
        if unplanned.ranks is None or self._rank in unplanned.ranks:
            self._open_window(unplanned.window)

    def _mark_published(self, step: int) -> None:
        """Every rank has finished `step` once its agreement is read: windows ended by then are published."""
        for item in self._unplanned:
            if not item.published and item.window.end - 1 <= step:
                item.published = True
                if item.request is not None:
                    self._status(item.request, "published", window=item.window, ranks=item.ranks,
                                 traces=self._traces(item.window.index))

    def _traces(self, window: int) -> list[str]:
        directory = self._layout.window_dir(window)
        return sorted(self._layout.relative(p) for p in directory.glob("rank*") if parse_trace_file_name(p.name))

    def _status(self, number: int, state: str, *, window: Window | None = None, ranks: list[int] | None = None,
                traces: list[str] | None = None, reason: str = "") -> None:
        if self._rank != 0:
            return
        fields = dict(window=window.index, warmup_start=window.warmup_start, active_start=window.active_start,
                      end=window.end) if window else {}
        try:
            write_status(self._layout, number, RequestStatus(
                state=state, at=now_iso_ms(), ranks=ranks if ranks is not None else list(range(self._world)),
                traces=traces or [], reason=reason, **fields))
        except (RequestError, OSError) as error:
            # the window is still captured; only its status cannot be told (training goes on)
            if not self._status_refused:
                log.warning("request %d: status not written: %s", number, error)
            self._status_refused = True

    def close(self, steps_done: int, error: BaseException | None) -> None:
        """The job is ending (error: why, None: training finished): say so in every open request's status."""
        if self._rank != 0:
            return
        how = f"failed ({type(error).__name__})" if error is not None else "ended"
        for item in self._unplanned:
            if not item.published and item.request is not None:
                self._status(item.request, "aborted", window=item.window, ranks=item.ranks,
                             traces=self._traces(item.window.index),
                             reason=f"the job {how} after {steps_done} steps, inside the window "
                                    f"(steps {item.window.warmup_start}-{item.window.end - 1})")
        if self._poller is not None:
            self._take_requests(self._poller.poll(steps_done, force=True), steps_done)
        for request in self._waiting:
            if request.number not in self._served and read_status(self._layout, request.number) is None:
                self._status(request.number, "not_served",
                             reason=f"the job {how} after {steps_done} steps, before the window could start")
