"""`fleetscope diff` as text (analysis/diff.py computes it)."""

from __future__ import annotations


NAME_CHARS = 90
BESIDE_SHOWN = 5
"""Rows shown of each view beside the partition (host calls, phases, host ops, collectives)."""


def _noise(value_ms: float) -> str:
    return f"±{value_ms:.3f}" if value_ms > 0 else "-"


def _label(item) -> str:
    label = item.name if len(item.name) <= NAME_CHARS else item.name[:NAME_CHARS - 3] + "..."
    shape = f" {item.shape}" if item.shape else ""
    return label + shape + (f" [{item.status}]" if item.status else "")


def _beside(title: str, items, counted: bool) -> list[str]:
    """A view beside the partition: its items that moved, largest change first."""
    moved = [item for item in items if abs(item.change_ms) >= 0.001][:BESIDE_SHOWN]
    if not moved:
        return []
    lines = [f"  {title}:"]
    for item in moved:
        calls = f"{item.a_count:.0f} -> {item.b_count:.0f}" if counted else ""
        lines.append(f"  {item.change_ms:+9.3f}  {'':>7}  {item.a_ms:8.3f}  {item.b_ms:8.3f}  {calls:>14}  {_label(item)}")
    return lines


def render_diff(result) -> str:
    """`result`: analysis/diff.py's TraceDiff (renderers import no analysis module)."""
    a, b = result.a, result.b
    lines = ["diff A -> B", f"  A: {a.label} ({a.ranks} rank(s), {a.steps} profiled step(s) in all)",
             f"  B: {b.label} ({b.ranks} rank(s), {b.steps} profiled step(s) in all)"]
    if a.report_step_ms is not None and b.report_step_ms is not None:
        lines.append(f"  step time (the report's: slowest rank per profiled step, median): {a.report_step_ms:.2f} -> "
                     f"{b.report_step_ms:.2f} ms ({result.report_change_ms:+.2f} ms)")
    lines.append(f"  mean step span (every rank's profiled steps), which the items below add up to: {a.span_ms:.2f} -> "
                 f"{b.span_ms:.2f} ms ({result.span_change_ms:+.2f} ms, noise {_noise(result.span_noise_ms)})")
    lines.append("")
    lines.append(f"  {'change ms':>9}  {'noise':>7}  {'A ms':>8}  {'B ms':>8}  {'calls A -> B':>14}  item (per step)")
    for item in result.items:
        calls = f"{item.a_count:.0f} -> {item.b_count:.0f}" if item.kind == "GPU activity" else ""
        sign = " (counts against the step)" if item.kind == "overlap" else ""
        lines.append(f"  {item.change_ms:+9.3f}  {_noise(item.noise_ms):>7}  {item.a_ms:8.3f}  {item.b_ms:8.3f}  "
                     f"{calls:>14}  {_label(item)}{sign}")
    for title, items, counted in (
            ("host calls inside the steps (beside the partition: they overlap the GPU's work)", result.host_calls, True),
            ("GPU time by the phase that launched it", result.phases, False),
            ("GPU time by the host op that launched it", result.ops, False),
            ("collectives by op, process group and message size (their own time)", result.collectives, True)):
        lines += _beside(title, items, counted)
    if result.unexplained_ms is not None:
        lines.append(f"  {result.unexplained_ms:+9.3f}  unexplained: the report's step time is the slowest rank's, the "
                     "items the mean rank's")
    for side, name in ((a, "A"), (b, "B")):
        lines += [f"  problem ({name}): {problem}" for problem in side.problems]
    return "\n".join(lines) + "\n"
