"""HTML sections for why stragglers are late (cross_rank/causes.py) and each step's critical path."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.report.model import Report


def _table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    def cell(tag: str, index: int, value: str) -> str:
        align = ' class="l"' if index in left else ""
        return f"<{tag}{align}>{escape(value)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f'<div class="scroll"><table><tr>{head}</tr>{body}</table></div>'


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
            what_if = "; ".join(f"step {w.step}: {w.step_time_ms:.2f} -> {w.projected_step_ms:.2f} ms"
                                for w in f.what_if)
            notes.append(f"window {label}, rank {f.rank}: {f.explanation}" + (f" ({what_if})" if what_if else ""))
    if not rows:
        return ""
    header = ["window", "rank", "cause", "waiting %", "late at", "lateness ms", "extra compute ms",
              "extra idle ms", "carried ms", "kernel time ratio", "phase"]
    return ("<h2>Causes of waiting</h2>" + _table(header, rows, left=(0, 2, 10))
            + "<ul>" + "".join(f'<li class="note">{escape(n)}</li>' for n in notes) + "</ul>")


def critical_path_section(report: Report) -> str:
    """"Critical path": time on the path by rank and kind, then every kept step's chain of segments."""
    html = ""
    for window in report.windows:
        paths = window.critical_path
        if not paths.steps:
            continue
        label = "-" if window.window is None else str(window.window)
        html += f"<h3>window {escape(label)}</h3>" + _table(
            ["rank", "kind", "ms", "share %"],
            [[str(s.rank), s.kind, _ms(s.duration_us), f"{100 * s.share:.1f}"] for s in paths.by_rank], left=(1,))
        rows = [[str(p.step), str(s.rank), s.kind, s.collective or "-", _ms(s.start_us), _ms(s.duration_us),
                 f"{100 * s.share:.1f}"] for p in paths.steps for s in p.segments]
        html += _table(["step", "rank", "kind", "collective", "from ms", "ms", "share %"], rows, left=(2, 3))
    if not html:
        return ""
    return ("<h2>Critical path</h2><p class=\"note\">Per step, the chain across ranks that set the step's end: at "
            "each collective the rank that arrived last, its compute and host gap before it, the data movement "
            "after it.</p>" + html)
