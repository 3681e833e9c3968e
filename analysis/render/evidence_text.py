"""Terminal sections of the evidence: collective bandwidth (and the sections after it in the report)."""

from __future__ import annotations

from fleetscope.analysis.report.model import Report

BANDWIDTH_ROWS_SHOWN = 5


def evidence_sections(report: Report) -> list[str]:
    """The evidence sections of the terminal summary, each a titled block (empty ones left out)."""
    return [s for s in (_bandwidth(report),) if s]


def _titled(title: str, lines: list[str]) -> str:
    return f"{title}\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def _bandwidth(report: Report) -> str:
    lines = []
    for window in report.windows:
        bandwidth = window.bandwidth
        if bandwidth is None:
            continue
        prefix = f"window {'-' if window.window is None else window.window}: "
        if bandwidth.status != "ok":
            lines.append(f"{prefix}bandwidth {bandwidth.status}: {bandwidth.reason}")
            continue
        lines += [prefix + row.verdict for row in bandwidth.rows[:BANDWIDTH_ROWS_SHOWN]]
        if len(bandwidth.rows) > BANDWIDTH_ROWS_SHOWN:
            lines.append(f"{prefix}... {len(bandwidth.rows) - BANDWIDTH_ROWS_SHOWN} more rows in the JSON/HTML report")
    return _titled("Collective bandwidth (bus bandwidth vs link peak, nccl-tests formulas)", lines)
