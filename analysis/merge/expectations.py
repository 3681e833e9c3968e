"""What a rank's `fleetscope analysis` track must show, by the report, and the check that it does.

The merge notes, per rank drawn in full (RankMergeSummary), the report's step time of each step of the
windows it merged (`windows[].ranks[].steps[].step_time_ms`) and the rank's idle time by cause summed over
those windows (`host_stalls.idle_by_cause_us`); merged without a report, the same values from the per-rank
parse the report is made of (StepTiming spans, host_stalls.find_idle_gaps). verify.py reads the trace back
and compares: every drawn `step N` slice lasts the report's step time, every step of a merge that keeps all
events is drawn, and a rank's `idle: <cause>` slices sum to the report's idle by cause (only when every
gap is drawn: `min_idle_gap_us` 0 and no step or time filter).
"""

from __future__ import annotations

import math

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetscope.analysis.merge.overlays import ANALYSIS_TRACK_NAME, IDLE_CATEGORY, STEP_CATEGORY
from fleetscope.analysis.merge.report_view import StepFigures
from fleetscope.analysis.merge.sources import WindowModel, idle_gap_rows

if TYPE_CHECKING:
    from fleetscope.analysis.merge.options import MergeOptions
    from fleetscope.analysis.merge.perfetto.check import TraceCheck

STEP_TOLERANCE_MS = 0.001
"""A drawn step may differ from the report's time by this much (ns rounding of its two ends, JSON floats)."""
IDLE_TOLERANCE_US_PER_GAP = 0.512
"""Each idle slice's two ends are rounded on their own: a trace's epoch timestamps in microseconds (~1.7e15) are
held by float64 to 0.25 us (a ns-resolution trace loses its last digits there), so each end is up to that far
from the report's float, independently: the sum over n gaps is allowed this x sqrt(n) (about 5 standard
deviations of the rounding's sum; measured on HTA's ns-resolution trace: 3.3 us over 5,045 gaps)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankExpectations:
    """What the report says one rank's analysis track holds."""

    steps: tuple[tuple[int, int, float], ...] = ()
    """(window, step, step_time_ms) of every step of the windows merged."""
    idle_us: tuple[tuple[str, float], ...] | None = None
    """(cause, us) summed over the windows merged; None: not compared (some gaps are not drawn, or a
    window has no idle figures in the report)."""
    filtered: bool = False
    """The merge kept only some steps or a time range: only the drawn steps are compared."""


def window_expectations(figures: StepFigures | None, model: WindowModel, window_key: int
                        ) -> tuple[list[tuple[int, int, float]], dict[str, float] | None]:
    """One window's (window, step, step_time_ms) and idle us by cause: the report's (report_view.
    report_step_figures), else the parse's."""
    if figures is not None and figures.step_times_ms:
        steps = [(window_key, step, ms) for step, ms in figures.step_times_ms.items()]
    else:
        steps = [(window_key, step, (end - start) / 1000.0) for step, start, end in model.step_spans]
    if figures is not None:
        idle = dict(figures.idle_by_cause_us) if figures.idle_by_cause_us is not None else (None if steps else {})
    else:
        idle = defaultdict(float)
        for start, end, cause in idle_gap_rows(model.idle_gaps):
            idle[cause] += end - start
        idle = dict(idle)
    return steps, idle


def rank_expectations(windows: list[tuple[list[tuple[int, int, float]], dict[str, float] | None]],
                      options: "MergeOptions") -> RankExpectations:
    """The windows' expectations of one rank, with what the options leave comparable."""
    steps = tuple(step for found, _ in windows for step in found)
    every_gap = options.min_idle_gap_us == 0 and not options.filters_events and options.overlays
    idle: dict[str, float] | None = defaultdict(float) if every_gap else None
    for _, by_cause in windows:
        if idle is None or by_cause is None:
            idle = None
            continue
        for cause, us in by_cause.items():
            idle[cause] += us
    return RankExpectations(steps=steps, filtered=options.filters_events,
                            idle_us=tuple(sorted(idle.items())) if idle is not None else None)


def analysis_track_problems(check: "TraceCheck", expected: dict[str, RankExpectations]) -> list[str]:
    """Where the read-back's step and idle slices of each process in `expected` (process name ->
    RankExpectations) disagree with the report."""
    drawn_steps: dict[str, dict[tuple, float]] = defaultdict(dict)
    drawn_idle: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for piece in check.slices:
        track = check.tracks.get(piece.track_uuid)
        process = check.process_of(piece.track_uuid)
        if track is None or process is None or not track.name.startswith(ANALYSIS_TRACK_NAME):
            continue
        notes = piece.annotations or {}
        if piece.category == STEP_CATEGORY:
            drawn_steps[process.name][(notes.get("window"), notes.get("step"))] = (piece.end_ns - piece.start_ns) / 1e6
        elif piece.category == IDLE_CATEGORY:
            drawn_idle[process.name][piece.name.removeprefix("idle: ")].append(piece.end_ns - piece.start_ns)
    problems = []
    for process, wanted in expected.items():
        problems += _step_problems(process, wanted, drawn_steps.get(process, {}))
        if wanted.idle_us is not None:
            problems += _idle_problems(process, dict(wanted.idle_us), drawn_idle.get(process, {}))
    return problems


def _step_problems(process: str, wanted: RankExpectations, drawn: dict[tuple, float]) -> list[str]:
    report = {(window, step): ms for window, step, ms in wanted.steps}
    problems = []
    for (window, step), ms in sorted(drawn.items(), key=str):
        if (window, step) not in report:
            problems.append(f"{process}: step {step} of window {window} is drawn, the report has no such step")
        elif abs(ms - report[(window, step)]) > STEP_TOLERANCE_MS:
            problems.append(f"{process}: step {step} of window {window} is drawn {ms:.3f} ms long, the report's "
                            f"step time is {report[(window, step)]:.3f} ms")
    if not wanted.filtered:
        missing = sorted(key for key in report if key not in drawn)
        problems += [f"{process}: step {step} of window {window} is in the report, not drawn"
                     for window, step in missing]
    return problems


def _idle_problems(process: str, report_us: dict[str, float], drawn: dict[str, list[int]]) -> list[str]:
    problems = []
    for cause in sorted(set(report_us) | set(drawn)):
        lengths = drawn.get(cause, [])
        found_us, wanted_us = sum(lengths) / 1000, report_us.get(cause, 0.0)
        if abs(found_us - wanted_us) > IDLE_TOLERANCE_US_PER_GAP * math.sqrt(max(len(lengths), 1)) + 1e-3:
            problems.append(f"{process}: idle slices '{cause}' sum to {found_us / 1000:.3f} ms over {len(lengths)} "
                            f"gaps, the report's idle by cause is {wanted_us / 1000:.3f} ms")
    return problems
