"""Small hand-made SVG charts (no JavaScript, no external files) for the HTML report.

Every function takes plain data and returns an `<svg>` element as a string; every mark carries a
`<title>` so hovering shows the exact value.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from fleetscope.traces.validate import finite

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f")
_FONT = 'font-family="system-ui, sans-serif" font-size="11"'


@dataclass(frozen=True)
class Segment:
    name: str
    value: float


def stacked_bars(rows: list[tuple[str, list[Segment]]], *, unit: str, colors: dict[str, str],
                 width: int = 720) -> str:
    """Horizontal stacked bars, one row per label; segments in the order given."""
    if not rows:
        return ""
    label_w, bar_h, gap = 80, _row_height(len(rows)), 2
    total = max((sum(s.value for s in segs) for _, segs in rows), default=0.0) or 1.0
    scale = (width - label_w - 10) / total
    height = len(rows) * (bar_h + gap) + 44
    parts = [_open(width, height)]
    for index, (label, segments) in enumerate(rows):
        y = index * (bar_h + gap)
        if bar_h >= 9:
            parts.append(_text(label_w - 6, y + bar_h - 2, label, anchor="end"))
        x = float(label_w)
        for segment in segments:
            w = segment.value * scale
            tip = f"{label}: {segment.name} {segment.value:.2f} {unit}"
            parts.append(_rect(x, y, w, bar_h, colors.get(segment.name, "#999"), tip))
            x += w
    parts.append(_legend(list(colors.items()), 10, height - 12))
    parts.append(_text(width - 6, len(rows) * (bar_h + gap) + 12, f"longest bar {total:.2f} {unit}", anchor="end"))
    parts.append("</svg>")
    return "".join(parts)


def bars(labels: list[str], values: list[float], *, unit: str, width: int = 720,
         highlight: str | None = None, label_width: int = 80, full_scale: float | None = None) -> str:
    """Horizontal bars, one per label. `full_scale`: the value that fills the track (100 for percentages,
    so 40% reads as 40% of the track); without it the largest value does."""
    if not labels:
        return ""
    label_w, bar_h, gap = label_width, _row_height(len(labels)), 2
    top = max([*values, full_scale or 0.0]) or 1.0
    width = max(width, label_w + 200)
    scale = (width - label_w - 80) / top
    height = len(labels) * (bar_h + gap)
    parts = [_open(width, height)]
    for index, (label, value) in enumerate(zip(labels, values)):
        y = index * (bar_h + gap)
        color = PALETTE[2] if label == highlight else PALETTE[0]
        parts.append(_rect(label_w, y, value * scale, bar_h, color, f"{label}: {value:.2f} {unit}"))
        if bar_h >= 9:
            parts.append(_text(label_w - 6, y + bar_h - 2, label, anchor="end"))
            parts.append(_text(label_w + value * scale + 4, y + bar_h - 2, f"{value:.2f} {unit}"))
    parts.append("</svg>")
    return "".join(parts)


def heatmap(row_labels: list[str], column_labels: list[str], values: list[list[float | None]], *,
            unit: str, width: int = 720) -> str:
    """A grid colored from light (low) to dark (high); None cells are left grey."""
    if not row_labels or not column_labels:
        return ""
    label_w, cell_h = 80, _row_height(len(row_labels))
    cell_w = max(2.0, (width - label_w - 10) / len(column_labels))
    known = [v for row in values for v in row if finite(v) is not None]
    low, high = (min(known), max(known)) if known else (0.0, 1.0)
    height = len(row_labels) * cell_h + 40
    parts = [_open(width, height)]
    for r, (label, row) in enumerate(zip(row_labels, values)):
        y = r * cell_h
        if cell_h >= 9:
            parts.append(_text(label_w - 6, y + cell_h - 2, label, anchor="end"))
        for c, value in enumerate(row):
            tip = f"{label}, {column_labels[c]}: " + ("no data" if value is None else f"{value:.2f} {unit}")
            parts.append(_rect(label_w + c * cell_w, y, cell_w, cell_h, _shade(value, low, high), tip))
    base = len(row_labels) * cell_h + 14
    step = max(1, len(column_labels) // 12)
    for c in range(0, len(column_labels), step):
        parts.append(_text(label_w + c * cell_w + cell_w / 2, base, column_labels[c], anchor="middle"))
    parts.append(_text(label_w, base + 16, f"light {low:.2f} {unit} .. dark {high:.2f} {unit}"))
    parts.append("</svg>")
    return "".join(parts)


def _row_height(rows: int) -> int:
    return 14 if rows <= 40 else max(1, 560 // rows)


def _shade(value: float | None, low: float, high: float) -> str:
    if finite(value) is None:
        return "#dddddd"
    t = 0.0 if high <= low else (value - low) / (high - low)
    light, dark = (222, 235, 247), (8, 48, 107)
    r, g, b = (round(a + (d - a) * t) for a, d in zip(light, dark))
    return f"#{r:02x}{g:02x}{b:02x}"


def _open(width: int, height: int) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" {_FONT}>')


def _rect(x: float, y: float, w: float, h: float, color: str, tip: str) -> str:
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h}" fill="{color}">'
            f"<title>{escape(tip)}</title></rect>")


def _text(x: float, y: float, text: str, *, anchor: str = "start") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{escape(text)}</text>'


def _legend(items: list[tuple[str, str]], x: float, y: float) -> str:
    parts = []
    for name, color in items:
        parts.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" fill="{color}"/>')
        parts.append(_text(x + 14, y, name))
        x += 24 + 7 * len(name)
    return "".join(parts)
