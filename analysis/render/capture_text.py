"""Terminal text of the report's `capture` section: unplanned windows and the hang report."""

from __future__ import annotations

from fleetscope.analysis.cross_rank.capture import CaptureSection
from fleetscope.analysis.cross_rank.hang import HangReport
from fleetscope.analysis.cross_rank.outcome import STATE_FAILED
from fleetscope.analysis.report.model import Report

HANG_TITLE = "Hang (Flight Recorder)"
FAILURE_TITLE = "Collectives when the job failed (Flight Recorder)"
"""A crashed job also leaves dumps (its peers were waiting when it died): they are no hang, and not titled one."""


def flight_recorder_title(report: Report) -> str:
    failed = report.outcome is not None and report.outcome.state == STATE_FAILED
    return FAILURE_TITLE if failed else HANG_TITLE


def capture_sections(report: Report) -> list[str]:
    """The capture sections of a report (none when it has no capture section)."""
    section = report.capture
    if section is None:
        return []
    hang = render_hang(section.hang, title=flight_recorder_title(report)) if section.hang else ""
    return [text for text in (_windows(section), hang) if text]


def _windows(section: CaptureSection) -> str:
    if not section.windows and not section.problems:
        return ""
    lines = ["Unplanned windows"]
    for window in section.windows:
        ranks = "all ranks" if window.ranks is None else f"ranks {window.ranks}"
        lines.append(f"  window {window.window} ({window.kind}, steps {window.steps}, {ranks}): {window.why}")
    lines += [f"  problem: {p}" for p in section.problems]
    return "\n".join(lines)


def render_hang(hang: HangReport, title: str = HANG_TITLE) -> str:
    """The hang report as plain text (what `fleetscope hang` prints)."""
    lines = [title, f"  {hang.verdict}"]
    lines += [_stalled(marker) for marker in hang.detected_by]
    lines.append(f"  dumps: ranks {hang.dumped_ranks}" + (f"; MISSING ranks {hang.missing_dumps}" if hang.missing_dumps
                                                          else ""))
    if hang.groups:
        lines.append(f"  {COLLECTIVE_NUMBERS}")
    for group in hang.groups:
        lines.append(f"  process group {group.group} ({group.desc or '-'}, ranks {group.ranks}):")
        for member in group.members:
            call = member.last_entered
            entered = f"#{call.seq} {call.name} {call.input_sizes} {call.input_dtypes}" if call else "nothing"
            done = "-" if member.last_completed_seq is None else f"#{member.last_completed_seq}"
            if _ended_without_peers(group, member):
                done += (" (ended without the ranks that never entered it: it failed; the recorder counts that as "
                         "completed)")
            lines.append(f"    rank {member.rank}: last entered {entered}; last completed {done}")
        if group.waiting_in is not None:
            lines.append(f"    waiting in #{group.waiting_in.seq} {group.waiting_in.name}, recorded at:")
            lines += [f"      {frame}" for frame in group.waiting_in.frames]
        lines += [f"    MISMATCH {m}" for m in group.mismatches]
    for rank, frames in hang.late_rank_stacks.items():
        lines.append(f"  rank {rank} was here instead (main thread, innermost first):")
        lines += [f"    {frame}" for frame in frames]
    if hang.last_steps:
        lines.append("  last step with metrics: " + ", ".join(f"rank {r}: {s}" for r, s in hang.last_steps.items())
                     + _metrics_lag(hang))
    if hang.last_window:
        lines.append(f"  last profiled window: {hang.last_window}")
    for rank, tail in hang.log_tails.items():
        if tail:
            lines.append(f"  rank {rank} log:")
            lines += [f"    {line}" for line in tail]
    lines += [f"  {line}" for line in hang.pytorch_analysis]
    lines += [f"  problem: {p}" for p in hang.problems]
    return "\n".join(lines)


COLLECTIVE_NUMBERS = ("#N: a collective's number in its process group, counted alike on every rank by the Flight "
                      "Recorder; a step issues several collectives, so #N is no step number")


def _ended_without_peers(group, member) -> bool:
    """A waiting rank whose recorder marks the collective it waits in completed: its peers never entered, so it
    ended in an error (a crashed peer's closed connection)."""
    waiting = group.waiting_in
    return (waiting is not None and member.rank in group.waiting_ranks and member.last_completed_seq is not None
            and member.last_completed_seq >= waiting.seq)


def _stalled(marker: dict) -> str:
    """A hang watchdog's marker in steps: its `step` counts the steps the rank had finished (the next one's index)."""
    done = marker["step"]
    after = f"after step {done - 1}" if done > 0 else "before its first step finished"
    return (f"  rank {marker['rank']}: no step finished for {marker['seconds']:.0f} s {after}, so it stopped in step "
            f"{done} (its hang watchdog, {marker['at']})")


def _metrics_lag(hang: HangReport) -> str:
    """Why the step metrics end before the steps the watchdogs counted, where they do (one record, written late)."""
    finished = {m["rank"]: m["step"] - 1 for m in hang.detected_by}
    lags = {finished[r] - s for r, s in hang.last_steps.items() if r in finished}
    if not lags or lags == {0}:
        return ""
    if lags == {1}:
        last = {finished[r] for r in hang.last_steps if r in finished}
        which = f"step {last.pop()}, finished before the hang," if len(last) == 1 else "the last step each finished"
        return f" (metrics/rank<R>.jsonl: a step's line is written once the next step has run, so {which} has none)"
    return (" (metrics/rank<R>.jsonl: a step's line is written once the next step has run; these end earlier than "
            "the steps the watchdogs counted as finished)")
