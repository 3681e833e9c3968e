"""What the section says: a slow rank's sentence (with the command that records it), the drift of the
steady step time across windows, whether the profiled windows represent the run."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

import numpy as np

from fleetscope.analysis.quantities import BASIS_STEP_METRICS, SLOWEST_RANK
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.traces.jobfile import FINAL_STATUSES
from fleetscope.analysis.cross_rank.whole_run.model import (MIN_SLOW_STEPS, PROFILE_STEPS, SLOW_EXCESS, SlowRank,
    WholeRun, WindowCheck, largest_episode)
from fleetscope.analysis.cross_rank.whole_run.scan import _Accumulated


def _with_slow_sentence(finding: SlowRank, run_dir: RecordSuggestion) -> SlowRank:
    until = "to the end" if finding.to_the_end else f"to step {finding.to_step:,}"
    parts = [f"rank {finding.rank} slow from step {finding.from_step:,} ({until}): {finding.signal} "
             f"{finding.excess_ms:+.1f} ms over its peers' median, {finding.excess_pct:+.0f}% of the median rank's "
             f"step time before the change ({finding.baseline_ms:.1f} ms; {finding.steps:,} steady steps)"]
    if finding.significance is not None:
        parts.append(("stands out" if finding.significance.stands_out else "does not stand out")
                     + f" from its step-to-step spread ({finding.significance.evidence()})")
    if _everyone_waits(finding):
        parts.append(f"every rank's step time rose by ~{finding.job_step_change_ms:.0f} ms from step "
                     f"{finding.from_step:,}: they wait for rank {finding.rank}")
    if finding.last_pct is not None:
        parts.append(f"last to end its step at {finding.last_pct:.0f}% of steps since")
    if finding.first_collective_last_pct is not None:
        parts.append(f"last at the first collective at {finding.first_collective_last_pct:.0f}%")
    if finding.windows:
        parts.append("covered by a window (" + ", ".join(finding.windows) + ")")
    else:
        parts.append(f"no profiled window covers it: {run_dir.to_record(finding.from_step)}")
    return dataclasses.replace(finding, sentence="; ".join(parts))


@dataclass(frozen=True, kw_only=True)
class RecordSuggestion:
    """How a user records a window of this run: `fleetscope profile` while the job runs; once it has ended, a
    relaunch whose schedule covers the steps in question (`profile` can no longer reach it)."""

    run_dir: str
    ended: bool
    user_program: bool = False
    """The run is a user's program, whose ranks read no on-demand request: only a relaunch records a window."""

    def to_record(self, step: int) -> str:
        if not self.ended and not self.user_program:
            return f"fleetscope profile {shlex.quote(self.run_dir)} --steps {PROFILE_STEPS} records a window"
        skip = max(step - 1, 0)
        why = "the job has ended" if self.ended else "your program reads no on-demand request"
        return (f"{why}: relaunch it with --profile skip_first={skip},wait=0,warmup=1,"
                f"active={PROFILE_STEPS},repeat=1 to record steps {skip + 1}-{skip + PROFILE_STEPS}")


def _is_user_program(records: RunRecords) -> bool:
    """job.json records a user's program (its `program`), not fleetscope's trainer."""
    return isinstance(records.job.get("program"), dict)


def _job_ended(records: RunRecords) -> bool:
    """job.json records a final status (or the record cannot be read: no running job to reach either)."""
    return bool(records.job_problem) or records.job.get("status") in FINAL_STATUSES


def _everyone_waits(finding: SlowRank) -> bool:
    """The median rank's step rose by most of this rank's excess (and by SLOW_EXCESS of the step or more)."""
    change = finding.job_step_change_ms
    return change is not None and change >= max(0.5 * finding.excess_ms, SLOW_EXCESS * finding.baseline_ms)


def _with_sentences(section: WholeRun, acc: _Accumulated, steady: np.ndarray, run_dir: RecordSuggestion) -> WholeRun:
    drift = _drift_sentence(section.windows)
    representative = _representative_sentence(section.windows, run_dir, acc.first_step + acc.steps // 2)
    worst = largest_episode(section.slow_ranks)
    if worst is not None:
        ranks = len({s.rank for s in section.slow_ranks})
        which = ("the one that cost the most time (its excess per step x its steady steps): "
                 if len(section.slow_ranks) > 1 else "")
        verdict = (f"{len(section.slow_ranks)} slow-rank episode(s) on {ranks} rank(s); {which}rank {worst.rank} "
                   f"{worst.signal} {worst.excess_ms:+.1f} ms ({worst.excess_pct:+.0f}% of the step) x {worst.steps:,} steps = "
                   f"{worst.time_lost_ms / 1000:.2f} s lost, from step {worst.from_step:,}")
    elif section.ranks == 1:
        # slow ranks are found against their peers: one rank has none
        verdict = (f"one rank: no peers to compare it with ({section.steady_steps:,} steady steps); its steps over the "
                   "run are in the step-time series and the windows' checks")
    else:
        verdict = (f"no rank above its peers by {100 * SLOW_EXCESS:.0f}% of the step time or more (in step time, "
                   f"input wait or arrival at the first collective) for {MIN_SLOW_STEPS}+ steady steps in "
                   f"{section.steady_steps:,} steady steps of {section.ranks} ranks")
    return dataclasses.replace(section, drift=drift, representative=representative, verdict=verdict)


def _drift_sentence(windows: list[WindowCheck]) -> str:
    gaps = [w.between_median_ms for w in windows if w.between_median_ms is not None]
    if len(gaps) < 2:
        return "fewer than two stretches between profiled windows: no drift measured"
    change = 100.0 * (gaps[-1] / gaps[0] - 1.0)
    return (f"steady step time before the first window {gaps[0]:.2f} ms, before the last {gaps[-1]:.2f} ms "
            f"({change:+.1f}%; {BASIS_STEP_METRICS} (timeline), {SLOWEST_RANK})")


def _representative_sentence(windows: list[WindowCheck], run_dir: RecordSuggestion, middle_step: int) -> str:
    placed = [w for w in windows if w.percentile_pct is not None]
    if not placed:
        return f"no profiled step in the timelines: no window to compare; {run_dir.to_record(middle_step)}"
    parts = [f"{w.label}: {w.median_ms:.2f} ms, percentile "
             f"{w.percentile_pct:.0f} of the run's steady steps" for w in placed]
    typical = all(10.0 <= w.percentile_pct <= 90.0 for w in placed)
    return ("; ".join(parts) + (" (representative: within percentiles 10-90" if typical else
                                " (not all representative: outside percentiles 10-90")
            + "; profiled steps include the profiler's cost)")
