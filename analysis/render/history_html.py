"""The history page: one SVG trend per gated metric across runs, regressions marked (analysis/history.py)."""

from __future__ import annotations

from html import escape

# duck-typed: a render module does not import the top-level history.py (tests/test_docs_layering.py)

WIDTH, HEIGHT, MARGIN = 720, 180, 40
LINE_COLOR, REGRESSION_COLOR = "#4e79a7", "#e15759"


def trend_svg(values: list[float | None], labels: list[str], regressions: list[bool], *, unit: str) -> str:
    """A line over the runs (None: the run lacks the metric); a red dot marks a regressing run."""
    known = [v for v in values if v is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    span = (high - low) or abs(high) or 1.0
    step_x = (WIDTH - 2 * MARGIN) / max(len(values) - 1, 1)

    def xy(index: int, value: float) -> tuple[float, float]:
        return MARGIN + index * step_x, HEIGHT - MARGIN - (value - low) / span * (HEIGHT - 2 * MARGIN)

    points = [xy(i, v) for i, v in enumerate(values) if v is not None]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    marks = []
    for i, (value, label, bad) in enumerate(zip(values, labels, regressions)):
        if value is None:
            continue
        x, y = xy(i, value)
        color = REGRESSION_COLOR if bad else LINE_COLOR
        tip = f"{label}: {value:.2f} {unit}" + (" (regression)" if bad else "")
        marks.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{5 if bad else 3}" fill="{color}">'
                     f"<title>{escape(tip)}</title></circle>")
    axis = (f'<text x="4" y="{MARGIN - 8}" font-size="11">{high:.2f} {escape(unit)}</text>'
            f'<text x="4" y="{HEIGHT - 8}" font-size="11">{low:.2f} {escape(unit)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'font-family="system-ui, sans-serif">{axis}<polyline fill="none" stroke="{LINE_COLOR}" '
            f'stroke-width="1.5" points="{line}"/>{"".join(marks)}</svg>')


def render_history_html(result) -> str:
    labels = [f"{r.date} {r.path}" for r in result.runs]
    sections = []
    for name in result.metrics:
        values = [r.medians.get(name) for r in result.runs]
        chart = trend_svg(values, labels, [name in r.regressions for r in result.runs], unit=result.units[name])
        if chart:
            better = "higher" if result.higher_is_better[name] else "lower"
            sections.append(f"<h2>{escape(name)} ({better} is better)</h2>{chart}")
    rows = "".join(f"<tr><td>{escape(r.date)}</td><td>{escape(r.path)}</td><td>{escape(', '.join(r.regressions) or '-')}"
                   f"</td></tr>" for r in result.runs)
    title = escape(f"fleetscope history: {result.root}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{title}</title></head>"
            f"<body style=\"font-family:system-ui,sans-serif;margin:24px\"><h1>{title}</h1>"
            f"<p>{len(result.runs)} run(s), oldest first; a red dot: a regression against the runs before it "
            f"(threshold {result.threshold_pct:g}%).</p>{''.join(sections)}"
            f"<table border=\"1\" cellpadding=\"3\"><tr><th>date</th><th>run</th><th>regressions</th></tr>{rows}"
            f"</table></body></html>\n")
