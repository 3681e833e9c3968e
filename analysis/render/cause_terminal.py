"""Terminal lines for why stragglers are late (cross_rank/causes.py) and each step's critical path."""

from __future__ import annotations

from fleetscope.analysis.cross_rank.critical_path import SEGMENT_KINDS_TEXT
from fleetscope.analysis.quantities import what_if_text
from fleetscope.analysis.report.model import Report


def cause_lines(report: Report) -> str:
    """The "Causes" section: one line per straggler finding, then its per-step what-if."""
    lines = []
    for window in report.windows:
        label = "-" if window.window is None else str(window.window)
        for finding in window.causes.findings:
            lines.append(f"window {label}: {finding.cause}: {finding.explanation}")
            lines += [f"  step {w.step}: {w.step_time_ms:.2f} ms, {w.caused_wait_ms:.2f} ms of it waiting for "
                      f"rank {finding.rank} -> {w.projected_step_ms:.2f} ms "
                      f"{what_if_text(finding.rank, w.basis, w.not_replayed)}" for w in finding.what_if]
    return "Causes\n" + "\n".join(f"  {line}" for line in lines) if lines else ""

PATH_STEPS_SHOWN = 4
PATH_SEGMENTS_SHOWN = 4
"""A step's longest segments named on its terminal line (in path order); the others are counted (the JSON,
the HTML report and the merged trace's `critical path` tracks hold every segment)."""


def critical_path_lines(report: Report) -> str:
    """The "Critical path" section: where the path's time went by rank, then the longest segments of a few steps."""
    lines = []
    for window in report.windows:
        paths = window.critical_path
        if not paths.steps:
            continue
        label = "-" if window.window is None else str(window.window)
        top = ", ".join(f"rank {s.rank} {s.kind} {100 * s.share:.0f}%" for s in paths.by_rank[:4])
        lines.append(f"window {label}: {top}")
        for path in paths.steps[:PATH_STEPS_SHOWN]:
            of_step = (f" of the step's {path.span_us / 1000:.2f} ms across ranks" if path.span_us else "")
            lines.append(f"  step {path.step} (path {path.length_us / 1000:.2f} ms{of_step}, "
                         f"{_count(len(path.segments), 'segment')}): {step_segments(path.segments)}")
    return ("Critical path (segments that set each step's end; the longest per step, in path order; "
            f"{SEGMENT_KINDS_TEXT}; the step across ranks: the earliest rank's start to the latest end)\n"
            + "\n".join(f"  {l}" for l in lines) if lines else "")


def step_segments(segments) -> str:
    """The PATH_SEGMENTS_SHOWN longest segments in path order, then how many others and their time."""
    longest = sorted(range(len(segments)), key=lambda i: -segments[i].duration_us)[:PATH_SEGMENTS_SHOWN]
    shown = "; ".join(_segment(segments[i]) for i in sorted(longest))
    rest = [s for i, s in enumerate(segments) if i not in longest]
    if not rest:
        return shown
    return f"{shown}; {_count(len(rest), 'more segment')}, {sum(s.duration_us for s in rest) / 1000:.2f} ms in all"


def _segment(segment) -> str:
    on = f" ({segment.collective})" if segment.collective else ""
    return f"r{segment.rank} {segment.kind}{on} {segment.duration_us / 1000:.2f} ms"


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
