"""A run's progress from its own step records (metrics/rank<R>.jsonl, written by every rank as it finishes each
step): what `fleetscope status` shows of a job while it runs, on any scheduler.

  step          the last step every rank finished (the slowest rank's), and the most any rank finished;
  step time     per rank, its last step's time;
  slowest rank  the one the others wait for, by the first measure the records allow (its name is printed with it):
                  behind     a rank BEHIND_STEPS or more steps behind the furthest (ranks of a synchronous job finish
                             each step together, their records at most a step apart): stalled, or not in step;
                  own work   the most own work a step (traces/formats.py own_work_ms: step time less the gradient
                             communication it waited for), median of each rank's last RECENT_STEPS steady steps. In
                             a synchronous data-parallel job every rank's step time is about equal, because the
                             others wait for the straggler inside their steps (in their gradient collectives): the
                             longest step time names a rank that waits about as often as the straggler.
                             It is consistently the one waited for when its own work exceeds the other ranks'
                             median in CONSISTENT_SHARE of the steps compared; otherwise none is said to be;
                  step time  where no rank recorded its gradient communication (no DDP or FSDP2: one replica, TP,
                             pipeline stages), the longest median step time, said to be a step time (the
                             same count of steps over the others);
  pace          the median of the last RECENT_STEPS steps of the job (per step the slowest rank's time, steps
                the profiler ran in left out), as steps per second, and the time left at that pace to the
                run's last step (job.json's train.steps);
  profiled      the steps the profiler ran in so far (their records say so), as ranges;
  stalled       no step record for STALLED_PACES steps at the pace (at least MIN_STALLED_S): a rank may hang.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from ..traces.formats import StepRecord, own_work_ms, read_metric_records, steady
from ..traces.layout import STEP_METRICS_RE, RunLayout

RECENT_STEPS = 20
"""Steps the pace, and each rank's own work and step time, are the median of."""
BEHIND_STEPS = 2
"""A rank this many steps behind the furthest is named behind (module docstring)."""

CONSISTENT_SHARE = 0.8
"""A rank is consistently the one waited for when its value exceeds the other ranks' median in this share of the
steps compared: a rank the others wait for does so in nearly every step, one of equal ranks in about half."""
MIN_COMPARED_STEPS = 10
"""Fewer steady steps compared name no rank as consistently waited for (of 2 equal ranks, one is over the other in
8 of 10 steps about once in 20 reads)."""
STALLED_PACES = 20
"""No step record for this many steps at the recent pace (and MIN_STALLED_S) reads as stalled."""
MIN_STALLED_S = 30.0

MEASURE_BEHIND = "behind"
MEASURE_OWN_WORK = "own work"
MEASURE_STEP_TIME = "step time"


@dataclass(frozen=True, kw_only=True)
class RankProgress:
    rank: int
    step: int
    """The last step it finished."""
    step_time_ms: float | None
    """Its last step's time."""
    recent_step_ms: dict[int, float] = field(default_factory=dict)
    """step -> step time of its last RECENT_STEPS steady steps (all its steps while none is steady)."""
    own_work_ms: dict[int, float] | None = None
    """step -> own work over the same steps (None: its gradient communication is not recorded in all of them)."""
    steady: bool = True
    """Those steps are steady ones (False: the rank has none yet, and they are all its steps)."""

    def series(self, measure: str) -> dict[int, float]:
        """step -> its value of `measure` (MEASURE_OWN_WORK or MEASURE_STEP_TIME) over its recent steps."""
        return (self.own_work_ms if measure == MEASURE_OWN_WORK else self.recent_step_ms) or {}

    def median(self, measure: str) -> float | None:
        values = self.series(measure)
        return statistics.median(values.values()) if values else None


@dataclass(frozen=True, kw_only=True)
class SlowestRank:
    """The rank the others wait for, and the measure that names it (module docstring)."""

    rank: int
    measure: str
    """MEASURE_BEHIND, MEASURE_OWN_WORK or MEASURE_STEP_TIME."""
    ms: float | None = None
    """Its median of the measure; None when behind."""
    others_ms: float | None = None
    """The median over the other ranks of their medians of the same measure."""
    steps_over: int = 0
    """Of its recent steps that the other ranks also recorded, those in which its value exceeds their median."""
    steps_compared: int = 0
    steady: bool = True
    """Every rank's steps compared are steady ones (not the first, not profiled)."""
    steps_behind: int = 0

    @property
    def consistent(self) -> bool:
        """Behind, or over the others in at least CONSISTENT_SHARE of at least MIN_COMPARED_STEPS steady steps."""
        if self.measure == MEASURE_BEHIND:
            return True
        return (self.steady and self.steps_compared >= MIN_COMPARED_STEPS
                and self.steps_over >= CONSISTENT_SHARE * self.steps_compared)


@dataclass(frozen=True, kw_only=True)
class RunProgress:
    ranks: list[RankProgress]
    total_steps: int | None
    """Steps the run was launched for (train.steps); None where job.json does not say."""
    pace_ms: float | None
    """Median step time of the job's recent unprofiled steps (module docstring)."""
    profiled_steps: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    last_record_age_s: float | None = None
    """Seconds since the newest step record was written (its file's modification time)."""

    @property
    def recent_step_ms(self) -> float:
        """The pace, or before any step is steady the longest of the ranks' recent median step times."""
        return self.pace_ms or max((r.median(MEASURE_STEP_TIME) or 0.0 for r in self.ranks), default=0.0)

    @property
    def stalled(self) -> bool:
        """No step record for STALLED_PACES steps at `recent_step_ms`, and at least MIN_STALLED_S."""
        if self.last_record_age_s is None:
            return False
        return self.last_record_age_s >= max(MIN_STALLED_S, STALLED_PACES * self.recent_step_ms / 1000.0)

    @property
    def done_step(self) -> int:
        """The last step every rank finished."""
        return min(r.step for r in self.ranks)

    @property
    def front_step(self) -> int:
        return max(r.step for r in self.ranks)

    @property
    def slowest(self) -> SlowestRank | None:
        """The rank the others wait for (module docstring); None with one rank."""
        if len(self.ranks) < 2:
            return None
        behind = [r for r in self.ranks if self.front_step - r.step >= BEHIND_STEPS]
        if behind:
            rank = min(behind, key=lambda r: (r.step, r.rank))
            return SlowestRank(rank=rank.rank, measure=MEASURE_BEHIND, steps_behind=self.front_step - rank.step)
        if all(r.own_work_ms for r in self.ranks):
            return _most(self.ranks, MEASURE_OWN_WORK)
        if all(r.recent_step_ms for r in self.ranks):
            return _most(self.ranks, MEASURE_STEP_TIME)
        return None

    @property
    def eta_s(self) -> float | None:
        if self.total_steps is None or self.pace_ms is None:
            return None
        return max(self.total_steps - 1 - self.done_step, 0) * self.pace_ms / 1000.0


def _most(ranks: list[RankProgress], measure: str) -> SlowestRank:
    """The rank with the largest median of `measure`, and in how many of its steps it exceeds the others."""
    top = max(ranks, key=lambda r: (r.median(measure), -r.rank))
    others = [r for r in ranks if r is not top]
    series = [r.series(measure) for r in others]
    over = compared = 0
    for step, value in top.series(measure).items():
        peers = [s[step] for s in series if step in s]
        if peers:
            compared += 1
            over += value > statistics.median(peers)
    return SlowestRank(rank=top.rank, measure=measure, ms=top.median(measure),
                       others_ms=statistics.median(r.median(measure) for r in others),
                       steps_over=over, steps_compared=compared, steady=all(r.steady for r in ranks))


def run_progress(layout: RunLayout, total_steps: int | None, *, now: float | None = None) -> RunProgress | None:
    """The run's progress (module docstring); None before any rank finished a step. `now`: the time the records'
    age is taken at (default: the clock's)."""
    newest = None
    latest: dict[int, RankProgress] = {}
    per_step: dict[int, float] = {}
    profiled: set[int] = set()
    notes = []
    for path in layout.step_metrics_files():
        rank = int(STEP_METRICS_RE.match(path.name).group("rank"))
        try:
            records = read_metric_records(path, within=layout.root).records
        except ValueError as error:   # the safe reader's refusal: named, the other ranks still shown
            notes.append(f"{layout.relative(path)}: not read: {getattr(error, 'reason', error)}")
            continue
        if records:
            latest[rank] = _latest(rank, records)
            _note_steps(records, per_step, profiled)
            newest = max(newest or 0.0, _modified(path))
    if not latest:
        return None
    age = max((time.time() if now is None else now) - newest, 0.0) if newest else None
    return RunProgress(ranks=[latest[r] for r in sorted(latest)], total_steps=total_steps,
                       pace_ms=_pace_ms(per_step, profiled), profiled_steps=sorted(profiled), notes=notes,
                       last_record_age_s=age)


def _modified(path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:   # removed since it was read: its age is not known
        return 0.0


def _latest(rank: int, records: list[StepRecord]) -> RankProgress:
    last = max(records, key=lambda r: r.step)
    steady_records = steady(records)
    recent = sorted(steady_records or records, key=lambda r: r.step)[-RECENT_STEPS:]
    times = {r.step: t for r in recent if (t := _nonnegative(r.step_time_ms)) is not None}
    work = {r.step: own_work_ms(_nonnegative(r.step_time_ms), r.comm_exposed_ms) for r in recent}
    known = {step: w for step, w in work.items() if w is not None}
    return RankProgress(rank=rank, step=last.step, step_time_ms=last.step_time_ms,
                        recent_step_ms=times, own_work_ms=known if known and len(known) == len(work) else None,
                        steady=bool(steady_records))


def _nonnegative(number: float | None) -> float | None:
    return number if number is not None and number >= 0 else None


def _note_steps(records: list[StepRecord], per_step: dict[int, float], profiled: set[int]) -> None:
    """Per steady step (traces/formats.py is_steady) the slowest rank's time (what the job waits for), and the
    steps the profiler ran in."""
    profiled.update(record.step for record in records if record.profiled)
    for record in steady(records):
        time = _nonnegative(record.step_time_ms)
        if time is not None:
            per_step[record.step] = max(per_step.get(record.step, 0.0), time)


def _pace_ms(per_step: dict[int, float], profiled: set[int]) -> float | None:
    """The median of the last RECENT_STEPS steady steps' times."""
    recent = [per_step[s] for s in sorted(per_step) if s not in profiled][-RECENT_STEPS:]
    return statistics.median(recent) if recent else None
