"""A run's progress from its own step records (metrics/rank<R>.jsonl, written by every rank as it finishes each
step): what `fleetscope status` shows of a job while it runs, on any scheduler.

  step          the last step every rank finished (the slowest rank's), and the most any rank finished;
  step time     per rank, its last step's time; the slowest rank named (the one furthest behind, then the one
                whose last step took longest);
  pace          the median of the last RECENT_STEPS steps of the job (per step the slowest rank's time, steps
                the profiler ran in left out), as steps per second, and the time left at that pace to the
                run's last step (job.json's train.steps);
  profiled      the steps the profiler ran in so far (their records say so), as ranges.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..traces.formats import read_metric_records, steady_step_records
from ..traces.layout import STEP_METRICS_RE, RunLayout
from ..traces.validate import finite_number

RECENT_STEPS = 20
"""Steps the pace is the median of."""


@dataclass(frozen=True, kw_only=True)
class RankProgress:
    rank: int
    step: int
    """The last step it finished."""
    step_time_ms: float | None


@dataclass(frozen=True, kw_only=True)
class RunProgress:
    ranks: list[RankProgress]
    total_steps: int | None
    """Steps the run was launched for (train.steps); None where job.json does not say."""
    pace_ms: float | None
    """Median step time of the job's recent unprofiled steps (module docstring)."""
    profiled_steps: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def done_step(self) -> int:
        """The last step every rank finished."""
        return min(r.step for r in self.ranks)

    @property
    def front_step(self) -> int:
        return max(r.step for r in self.ranks)

    @property
    def slowest(self) -> RankProgress:
        return min(self.ranks, key=lambda r: (r.step, -(r.step_time_ms or 0.0), r.rank))

    @property
    def eta_s(self) -> float | None:
        if self.total_steps is None or self.pace_ms is None:
            return None
        return max(self.total_steps - 1 - self.done_step, 0) * self.pace_ms / 1000.0


def run_progress(layout: RunLayout, total_steps: int | None) -> RunProgress | None:
    """The run's progress (module docstring); None before any rank finished a step."""
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
    if not latest:
        return None
    return RunProgress(ranks=[latest[r] for r in sorted(latest)], total_steps=total_steps,
                       pace_ms=_pace_ms(per_step, profiled), profiled_steps=sorted(profiled), notes=notes)


def _latest(rank: int, records: list[dict]) -> RankProgress:
    last = max(records, key=lambda r: r["step"])
    time = last.get("step_time_ms")
    return RankProgress(rank=rank, step=last["step"], step_time_ms=finite_number(time))


def _note_steps(records: list[dict], per_step: dict[int, float], profiled: set[int]) -> None:
    """Per steady step (traces/formats.py steady_step_records) the slowest rank's time (what the job waits
    for), and the steps the profiler ran in."""
    profiled.update(record["step"] for record in records if record.get("profiled") is True)
    for record in steady_step_records(records):
        time = finite_number(record.get("step_time_ms"))
        if time is not None and time >= 0:
            per_step[record["step"]] = max(per_step.get(record["step"], 0.0), time)


def _pace_ms(per_step: dict[int, float], profiled: set[int]) -> float | None:
    """The median of the last RECENT_STEPS steady steps' times."""
    recent = [per_step[s] for s in sorted(per_step) if s not in profiled][-RECENT_STEPS:]
    return statistics.median(recent) if recent else None
