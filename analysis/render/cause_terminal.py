"""Terminal lines for why stragglers are late (cross_rank/causes.py) and each step's critical path."""

from __future__ import annotations

from fleetscope.analysis.report.model import Report


def cause_lines(report: Report) -> str:
    """The "Causes" section: one line per straggler finding, then its per-step what-if."""
    lines = []
    for window in report.windows:
        label = "-" if window.window is None else str(window.window)
        for finding in window.causes.findings:
            lines.append(f"window {label}: {finding.cause}: {finding.explanation}")
            lines += [f"  step {w.step}: {w.step_time_ms:.2f} ms, {w.caused_wait_ms:.2f} ms of it waiting for "
                      f"rank {finding.rank} -> {w.projected_step_ms:.2f} ms were it on time" for w in finding.what_if]
    return "Causes\n" + "\n".join(f"  {line}" for line in lines) if lines else ""
