"""`fleetscope diff` as text (analysis/diff.py computes it)."""

from __future__ import annotations


NAME_CHARS = 90
HOST_CALLS_SHOWN = 5


def render_diff(result) -> str:
    """`result`: analysis/diff.py's TraceDiff (renderers import no analysis module)."""
    a, b = result.a, result.b
    lines = ["diff A -> B", f"  A: {a.label} ({a.ranks} rank(s), {a.steps} profiled step(s) in all)",
             f"  B: {b.label} ({b.ranks} rank(s), {b.steps} profiled step(s) in all)"]
    if a.report_step_ms is not None and b.report_step_ms is not None:
        lines.append(f"  step time (the report's: slowest rank per profiled step, median): {a.report_step_ms:.2f} -> "
                     f"{b.report_step_ms:.2f} ms ({result.report_change_ms:+.2f} ms)")
    lines.append(f"  mean step span (every rank's profiled steps), which the items below add up to: {a.span_ms:.2f} -> "
                 f"{b.span_ms:.2f} ms ({result.span_change_ms:+.2f} ms)")
    lines.append("")
    lines.append(f"  {'change ms':>9}  {'A ms':>8}  {'B ms':>8}  {'calls A -> B':>14}  item (per step)")
    for item in result.items:
        calls = f"{item.a_count:.0f} -> {item.b_count:.0f}" if item.kind == "GPU activity" else ""
        label = item.name if len(item.name) <= NAME_CHARS else item.name[:NAME_CHARS - 3] + "..."
        shape = f" {item.shape}" if item.shape else ""
        status = f" [{item.status}]" if item.status else ""
        sign = " (counts against the step)" if item.kind == "overlap" else ""
        lines.append(f"  {item.change_ms:+9.3f}  {item.a_ms:8.3f}  {item.b_ms:8.3f}  {calls:>14}  {label}{shape}{status}{sign}")
    moved = [item for item in result.host_calls if abs(item.change_ms) >= 0.001][:HOST_CALLS_SHOWN]
    if moved:
        lines.append("  host calls inside the steps (beside the partition: they overlap the GPU's work):")
        for item in moved:
            lines.append(f"  {item.change_ms:+9.3f}  {item.a_ms:8.3f}  {item.b_ms:8.3f}  "
                         f"{f'{item.a_count:.0f} -> {item.b_count:.0f}':>14}  {item.name}"
                         + (f" [{item.status}]" if item.status else ""))
    if result.unexplained_ms is not None:
        lines.append(f"  {result.unexplained_ms:+9.3f}  unexplained: the report's step time is the slowest rank's, the "
                     "items the mean rank's")
    for side, name in ((a, "A"), (b, "B")):
        lines += [f"  problem ({name}): {problem}" for problem in side.problems]
    return "\n".join(lines) + "\n"
