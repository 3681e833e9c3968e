"""`fleetscope diff --html`: the diff as one self-contained page (analysis/diff.py computes it)."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.render import html_table
from fleetscope.analysis.render.html_table import table

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}th{background:#f4f4f4}
td.l,th.l{text-align:left}td.l{max-width:640px;overflow-wrap:anywhere}.note{color:#555;font-size:12px}
"""
_HEADER = ["change ms", "noise ms", "A ms", "B ms", "calls A", "calls B", "item (per step)", "status"]


def render_diff_html(result) -> str:
    """`result`: analysis/diff.py's TraceDiff (renderers import no analysis module)."""
    a, b = result.a, result.b
    title = f"fleetscope diff: {a.label} -> {b.label}"
    parts = [f"<h1>{escape(title)}</h1>", _summary(result), "<h2>Where the step's time moved</h2>",
             '<p class="note">The items add up to the mean step span\'s change: each kernel, copy and fill by name '
             "and launch shape, the GPU idle inside the steps, and the overlap of activities (it counts against the "
             "step).</p>", _items_table(result.items, counted=True)]
    for heading, items, counted in (
            ("Host calls inside the steps", result.host_calls, True),
            ("GPU time by phase", result.phases, False),
            ("GPU time by host op", result.ops, False),
            ("Collectives by op, group and size", result.collectives, True)):
        if items:
            parts += [f"<h2>{escape(heading)}</h2>", '<p class="note">Beside the partition: not part of its sum.</p>',
                      _items_table(items, counted)]
    problems = [f"{name}: {problem}" for side, name in ((a, "A"), (b, "B")) for problem in side.problems]
    if problems:
        parts += ["<h2>Problems</h2><ul>", *(f"<li>{escape(p)}</li>" for p in problems), "</ul>"]
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{_CSS}{html_table.CSS}</style></head><body>{''.join(parts)}</body></html>\n")


def _summary(result) -> str:
    a, b = result.a, result.b
    rows = [[f"A: {a.label}", str(a.ranks), str(a.steps), f"{a.span_ms:.2f}", _ms(a.report_step_ms)],
            [f"B: {b.label}", str(b.ranks), str(b.steps), f"{b.span_ms:.2f}", _ms(b.report_step_ms)],
            ["change", "", "", f"{result.span_change_ms:+.2f} ± {result.span_noise_ms:.2f}",
             _ms(result.report_change_ms, signed=True)]]
    note = ""
    if result.unexplained_ms is not None:
        note = (f'<p class="note">Unexplained {result.unexplained_ms:+.3f} ms: the report\'s step time is the slowest '
                "rank's (per profiled step, median), the items the mean rank's.</p>")
    return table(["side", "ranks", "profiled steps", "mean step span ms", "report step time ms"], rows,
                 left=(0,), labels=1) + note


def _items_table(items, counted: bool) -> str:
    rows = [[f"{item.change_ms:+.3f}", f"{item.noise_ms:.3f}" if item.noise_ms > 0 else "-", f"{item.a_ms:.3f}",
             f"{item.b_ms:.3f}", f"{item.a_count:.0f}" if counted else "-", f"{item.b_count:.0f}" if counted else "-",
             item.name + (f" {item.shape}" if item.shape else ""), item.status or "-"]
            for item in items]
    return table(_HEADER, rows, left=(6, 7), labels=0)


def _ms(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"
