"""The analysis report, as the merge reads it for its overlays.

The merge takes from it the straggler marks, the critical path (critical_path_overlays.py), the per-step
evidence (evidence_overlays.py) and, when the caller gives no offsets, the clock offsets
the analysis used, so the merged timeline and the report agree on who arrived when. Only the report's
JSON form is read (the schema documented in report.py), so a `Report` object, its
`to_json()` dict and a `report.json` file all work, and the merge does not depend on how the analysis
computes anything. A run directory's `report/report.json` is used when no report is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from fleetscope.analysis.merge.critical_path_overlays import rank_path
from fleetscope.analysis.merge.evidence_overlays import rank_evidence
from fleetscope.analysis.merge.sources import MergeProblem
from fleetscope.traces.safe_read import read_metadata
from fleetscope.analysis.merge.window import ReportView
from fleetscope.traces.layout import RunLayout

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
        loaded = json.loads(read_metadata(Path(source)))
    except (OSError, ValueError, RecursionError) as error:
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
    window = _dict(_window_entry(report.get("windows"), window_key))
    stragglers = _dict(window.get("stragglers"))
    trainer = _dict(report.get("trainer"))
    return ReportView(
        critical_path=rank_path(window.get("critical_path"), rank=rank, window_key=window_key,
                                report_offset_ns=report_clock_offsets_ns(report, window_key).get(rank, 0)),
        evidence=rank_evidence(window, _rank_entry(window.get("ranks"), rank), _rank_entry(trainer.get("ranks"), rank)),
        rank_summary=_rank_entry(report.get("ranks"), rank) if first_window else None,
        report_verdict=str(report.get("verdict") or ""),
        window_verdict=str(stragglers.get("verdict") or ""),
        waited_for=stragglers.get("waited_for_rank") == rank,
        slowest=stragglers.get("slowest_rank") == rank and len(_dicts(window.get("ranks"))) > 1,
        wait=_rank_entry(stragglers.get("by_wait"), rank),
        late_instances=[i for i in _dicts(stragglers.get("worst_instances"))
                        if i.get("last_rank") == rank and _kept_others_waiting(i, stragglers.get("min_lateness_us"))],
    )


def _kept_others_waiting(instance: dict, min_lateness_us: Any) -> bool:
    """The instance's last rank was late enough to count as such in the report (ranks arriving together
    have a "last" one too, by ordering noise, and are not marked)."""
    lateness = instance.get("lateness_us")
    if not isinstance(lateness, (int, float)):
        return False
    threshold = min_lateness_us if isinstance(min_lateness_us, (int, float)) else 0.0
    return lateness >= threshold and lateness > 0


def _window_entry(windows: Any, window_key: int) -> dict | None:
    windows = _dicts(windows)
    for window in windows:
        if window.get("window") == window_key:
            return window
    unnumbered = [w for w in windows if w.get("window") is None]
    return unnumbered[0] if len(unnumbered) == 1 else None


def _dicts(value: Any) -> list[dict]:
    """The dict items of a JSON list (a report written by another version may hold anything)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _rank_entry(entries: Any, rank: int) -> dict | None:
    return next((dict(e) for e in _dicts(entries) if e.get("rank") == rank), None)


def report_clock_offsets_ns(report: dict | None, window_key: int) -> dict[int, int]:
    """rank -> the clock offset (ns) the analysis used for this window (`windows[].clock.hosts[]`:
    measured at startup, or refined from collectives). Empty when the report has none."""
    if report is None:
        return {}
    clock = _dict(_dict(_window_entry(report.get("windows"), window_key)).get("clock"))
    offsets = {}
    for host in _dicts(clock.get("hosts")):
        offset_us, ranks = host.get("offset_us"), host.get("ranks")
        if isinstance(offset_us, (int, float)) and not isinstance(offset_us, bool) and isinstance(ranks, list):
            offsets.update({rank: round(offset_us * 1000) for rank in ranks if isinstance(rank, int)})
    return offsets
