"""The analysis report, as the merge reads it for its overlays.

The merge takes from it the straggler marks and, when the caller gives no offsets, the clock offsets
the analysis used, so the merged timeline and the report agree on who arrived when. Only the report's
JSON form is read (the schema documented in report.py), so a `Report` object, its
`to_json()` dict and a `report.json` file all work, and the merge does not depend on how the analysis
computes anything. A run directory's `report/report.json` is used when no report is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from fleetscope.traces.layout import RunLayout

from .merge_sources import MergeProblem
from .perfetto_overlays import ReportView

ReportSource = Any
"""A `Report` (anything with `to_json()`), its JSON dict, a path to report.json, or None."""


def load_report(source: ReportSource, layout: RunLayout | None, problems: list[MergeProblem]) -> dict | None:
    """The report as a JSON dict; None when there is none (a bad file is a problem, not an error)."""
    if source is None:
        if layout is None or not layout.report_json.is_file():
            return None
        source = layout.report_json
    if hasattr(source, "to_json"):
        return source.to_json()
    if isinstance(source, Mapping):
        return dict(source)
    try:
        loaded = json.loads(Path(source).read_text())
    except (OSError, ValueError) as error:
        problems.append(MergeProblem(path=str(source), reason=f"analysis report not used: {error}"))
        return None
    if not isinstance(loaded, dict):
        problems.append(MergeProblem(path=str(source), reason="analysis report not used: not a JSON object"))
        return None
    return loaded


def report_view(report: dict | None, *, rank: int, window_key: int, first_window: bool) -> ReportView | None:
    """What the report says about `rank` in the window numbered `window_key`."""
    if report is None:
        return None
    window = _window_entry(report.get("windows") or [], window_key)
    stragglers = (window or {}).get("stragglers") or {}
    ranks_in_window = len((window or {}).get("ranks") or [])
    return ReportView(
        rank_summary=_rank_entry(report.get("ranks") or [], rank) if first_window else None,
        report_verdict=str(report.get("verdict") or ""),
        window_verdict=str(stragglers.get("verdict") or ""),
        waited_for=stragglers.get("waited_for_rank") == rank,
        slowest=stragglers.get("slowest_rank") == rank and ranks_in_window > 1,
        wait=_rank_entry(stragglers.get("by_wait") or [], rank),
        late_instances=[i for i in stragglers.get("worst_instances") or [] if i.get("last_rank") == rank],
    )


def _window_entry(windows: list[dict], window_key: int) -> dict | None:
    for window in windows:
        if window.get("window") == window_key:
            return window
    unnumbered = [w for w in windows if w.get("window") is None]
    return unnumbered[0] if len(unnumbered) == 1 else None


def _rank_entry(entries: list[dict], rank: int) -> dict | None:
    return next((dict(e) for e in entries if isinstance(e, dict) and e.get("rank") == rank), None)


def report_clock_offsets_ns(report: dict | None, window_key: int) -> dict[int, int]:
    """rank -> the clock offset (ns) the analysis used for this window (`windows[].clock.hosts[]`:
    measured at startup, or refined from collectives). Empty when the report has none."""
    if report is None:
        return {}
    window = _window_entry(report.get("windows") or [], window_key)
    clock = (window or {}).get("clock") or {}
    offsets = {}
    for host in clock.get("hosts") or []:
        offset_us = host.get("offset_us") if isinstance(host, dict) else None
        if isinstance(offset_us, (int, float)) and not isinstance(offset_us, bool):
            offsets.update({rank: round(offset_us * 1000) for rank in host.get("ranks") or [] if isinstance(rank, int)})
    return offsets
