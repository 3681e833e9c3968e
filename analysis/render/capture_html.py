"""HTML of the report's `capture` section: unplanned windows (why each was taken) and the hang report."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.render.capture_text import flight_recorder_title, render_hang
from fleetscope.analysis.render.html_table import table
from fleetscope.analysis.report.model import Report


def capture_html(report: Report) -> str:
    """Empty when the report has no capture section."""
    section = report.capture
    if section is None:
        return ""
    parts = []
    if section.windows:
        rows = [[str(w.window), w.kind, w.steps, "all" if w.ranks is None else ", ".join(map(str, w.ranks)), w.why]
                for w in section.windows]
        parts.append("<h2>Unplanned windows</h2>" + table(["window", "kind", "steps", "ranks", "why"], rows, left=(4,)))
    if section.problems:
        parts.append("<ul>" + "".join(f"<li>{escape(p)}</li>" for p in section.problems) + "</ul>")
    if section.hang is not None:
        title = flight_recorder_title(report)
        parts.append(f"<h2>{escape(title)}</h2><p>{escape(section.hang.verdict)}</p>"
                     f"<pre>{escape(render_hang(section.hang, title=title))}</pre>")
    return "".join(parts)
