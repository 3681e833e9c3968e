"""The HTML report's tables: columns that hold no value on this run are left out (named under the table),
a table left with nothing but its label columns is not shown, and long or wide tables scroll in a box of their own.

A CPU run has no GPU numbers: without this its memory, MoE and clock tables would be rows of dashes.
"""

from __future__ import annotations

from html import escape

NO_VALUE = "-"
"""How the report's cells write a value it does not have."""
SCROLL_ROWS = 16
"""Tables with more rows scroll inside a box (CSS class `tall`), so 64 ranks don't make the page 64 rows taller."""
TOOLTIP_CHARS = 80

CSS = """
.scroll{overflow-x:auto}.tall{max-height:420px;overflow-y:auto;border-bottom:2px solid #ccc}
.tall th{position:sticky;top:0}
summary{cursor:pointer;font-size:13px}
"""


def table(header: list[str], rows: list[list[str]], *, left: tuple[int, ...] = (), labels: int = 1,
          raw_last: list[str] | None = None) -> str:
    """`labels`: how many leading columns name the row (rank, layer, ...): kept always, and a table with no
    other column left is dropped ('' returned). `raw_last`: one HTML cell per row appended unescaped (markup
    the report made), which counts as a value."""
    columns = len(header) - (raw_last is not None)
    kept = [i for i in range(columns) if i < labels or not rows or _has_value(rows, i)]
    if rows and len(kept) <= labels and raw_last is None:
        return ""
    head = _cells("th", header, kept, left) + (f"<th>{escape(header[-1])}</th>" if raw_last is not None else "")
    extra = raw_last if raw_last is not None else [None] * len(rows)
    body = "".join("<tr>" + _cells("td", row, kept, left) + (f"<td>{cell}</td>" if cell is not None else "")
                   + "</tr>" for row, cell in zip(rows, extra))
    boxed = "scroll tall" if len(rows) > SCROLL_ROWS else "scroll"
    return f'<div class="{boxed}"><table><tr>{head}</tr>{body}</table></div>' + _dropped_note(header, kept, columns)


def _has_value(rows: list[list[str]], column: int) -> bool:
    return any(row[column] != NO_VALUE for row in rows)


def _cells(tag: str, values: list[str], kept: list[int], left: tuple[int, ...]) -> str:
    # long left-aligned texts (mangled kernel names) show one line; the whole text on hover / as a tooltip
    parts = []
    for i in kept:
        value = values[i]
        aligned = ' class="l"' if i in left else ""
        long_text = i in left and tag == "td" and len(value) > TOOLTIP_CHARS
        tooltip = f' title="{escape(value, quote=True)}"' if long_text else ""
        parts.append(f"<{tag}{aligned}{tooltip}>{escape(value)}</{tag}>")
    return "".join(parts)


def _dropped_note(header: list[str], kept: list[int], columns: int) -> str:
    dropped = [header[i] for i in range(columns) if i not in kept]
    if not dropped:
        return ""
    return f'<p class="note">No values on this run, not shown: {escape(", ".join(dropped))}.</p>'
