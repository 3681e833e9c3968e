"""HTML sections for why stragglers are late (cross_rank/causes.py) and each step's critical path."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.cross_rank.critical_path import SEGMENT_KINDS_TEXT, CriticalPaths, PathSegment, StepPath
from fleetscope.analysis.quantities import what_if_text
from fleetscope.analysis.render.html_table import table as _table
from fleetscope.analysis.report.model import Report

TOP_SEGMENTS = 3
"""Segments shown per step (the longest); the whole chain is one click away, in a <details>."""
TOP_SHARES = 8
"""(rank, kind) rows of the time-on-path table shown before the rest."""


def _what_if_steps(finding) -> str:
    """Each step's what-if, grouped under its basis (quantities.what_if_text)."""
    groups: dict[str, list[str]] = {}
    for w in finding.what_if:
        label = what_if_text(finding.rank, w.basis, w.not_replayed)
        groups.setdefault(label, []).append(f"step {w.step}: {w.step_time_ms:.2f} -> {w.projected_step_ms:.2f} ms")
    return "; ".join(f"{label}: {', '.join(steps)}" for label, steps in groups.items())


def _ms(value_us: float | None) -> str:
    return "-" if value_us is None else f"{value_us / 1000:.2f}"


def cause_section(report: Report) -> str:
    """"Causes of waiting": one row per straggler finding, its explanation, and its per-step what-if."""
    rows, notes = [], []
    for window in report.windows:
        label = "-" if window.window is None else str(window.window)
        for f in window.causes.findings:
            ratio = "-" if f.op_duration_ratio is None else f"{f.op_duration_ratio:.3f}"
            rows.append([label, str(f.rank), f.cause, f"{100 * f.wait_share:.0f}", str(f.late_instances),
                         _ms(f.mean_lateness_us), _ms(f.mean_extra_compute_us), _ms(f.mean_extra_idle_us),
                         _ms(f.mean_carried_us), ratio, f.phase or "-"])
            what_if = _what_if_steps(f)
            notes.append(f"window {label}, rank {f.rank}: {f.explanation}" + (f" ({what_if})" if what_if else ""))
    if not rows:
        return ""
    header = ["window", "rank", "cause", "waiting %", "late at", "lateness ms", "extra compute ms",
              "extra idle ms", "carried ms", "kernel time ratio", "phase"]
    return ("<h2>Causes of waiting</h2>" + _table(header, rows, left=(0, 2, 10), labels=2)
            + "<ul>" + "".join(f'<li class="note">{escape(n)}</li>' for n in notes) + "</ul>")


def critical_path_section(report: Report) -> str:
    """"Critical path": time on the path by rank and kind, then each step's longest segments; every kept step's
    whole chain of segments is folded under them."""
    html = ""
    for window in report.windows:
        paths = window.critical_path
        if paths.steps:
            label = "-" if window.window is None else str(window.window)
            html += (f"<h3>window {escape(label)}</h3>" + _path_shares(paths) + _top_segments(paths)
                     + _every_segment(paths))
    if not html:
        return ""
    return ("<h2>Critical path</h2><p class=\"note\">Per step, the chain across ranks that set the step's end: at "
            "each collective the rank that arrived last, its compute and host gap before it, the data movement "
            f"after it. Segment kinds: {escape(SEGMENT_KINDS_TEXT)}. The path lies within the step across ranks "
            "(the earliest rank's start to the latest end).</p>" + html)


def _path_shares(paths: CriticalPaths) -> str:
    rows = [[str(s.rank), s.kind, _ms(s.duration_us), f"{100 * s.share:.1f}"] for s in paths.by_rank]
    header = ["rank", "kind", "ms", "share %"]
    shown = _table(header, rows[:TOP_SHARES], left=(1,))
    if len(rows) <= TOP_SHARES:
        return shown
    return shown + _folded(f"the other {len(rows) - TOP_SHARES} (rank, kind) rows",
                           _table(header, rows[TOP_SHARES:], left=(1,)))


def _top_segments(paths: CriticalPaths) -> str:
    rows = [[str(p.step), _ms(p.length_us), *_segment_cells(s)] for p in paths.steps for s in _longest(p)]
    return (f'<p class="note">The {TOP_SEGMENTS} longest segments of each step:</p>'
            + _table(["step", "path ms", "rank", "kind", "collective", "from ms", "ms", "share %"], rows,
                     left=(3, 4), labels=2))


def _every_segment(paths: CriticalPaths) -> str:
    rows = [[str(p.step), *_segment_cells(s)] for p in paths.steps for s in p.segments]
    if all(len(p.segments) <= TOP_SEGMENTS for p in paths.steps):
        return ""
    return _folded(f"every segment of each step, in time order ({len(rows)} rows)",
                   _table(["step", "rank", "kind", "collective", "from ms", "ms", "share %"], rows, left=(2, 3)))


def _longest(path: StepPath) -> list[PathSegment]:
    return sorted(path.segments, key=lambda s: -s.duration_us)[:TOP_SEGMENTS]


def _segment_cells(s: PathSegment) -> list[str]:
    return [str(s.rank), s.kind, s.collective or "-", _ms(s.start_us), _ms(s.duration_us), f"{100 * s.share:.1f}"]


def _folded(summary: str, html: str) -> str:
    return f"<details><summary>{escape(summary)}</summary>{html}</details>"
