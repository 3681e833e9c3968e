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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fleetscope.analysis.merge.critical_path_overlays import rank_path
from fleetscope.analysis.merge.evidence_overlays import rank_evidence
from fleetscope.analysis.merge.sources import MergeProblem
from fleetscope.traces.safe_read import read_metadata
from fleetscope.analysis.merge.window import ReportView
from fleetscope.traces.layout import RunLayout
from fleetscope.traces.validate import finite_number

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


def report_mismatch(report: dict | None, event_counts: Mapping[tuple[int | None, int], int]) -> str | None:
    """Why `report` is not a report of the traces whose per-rank parse counted `event_counts` ((window, rank)
    -> events), or None. Only what the report states is compared (windows[].ranks[] with an event_count):
    a report that states nothing of its ranks is taken as it is."""
    stated = {(w.get("window"), r["rank"]): r["event_count"] for w in _dicts(_dict(report).get("windows"))
              for r in _dicts(w.get("ranks")) if _ints([r.get("rank")]) and _ints([r.get("event_count")])}
    if not stated:
        return None
    for (window, rank), count in sorted(stated.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        found = event_counts.get((window, rank))
        if found is None:
            return f"it analyzed rank {rank} in window {_window_text(window)}, which these traces do not hold"
        if found != count:
            return (f"rank {rank} in window {_window_text(window)}: {count:,} events in the report, "
                    f"{found:,} in the trace")
    windows = {window for window, _ in stated}
    extra = sorted((rank, window) for window, rank in event_counts if window in windows and (window, rank) not in stated)
    if extra:
        rank, window = extra[0]
        return f"rank {rank} in window {_window_text(window)} is not in the report ({len(extra)} rank trace(s) in all)"
    return None


def _window_text(window: Any) -> str:
    return "-" if window is None else str(window)


def report_view(report: dict | None, *, rank: int, window_key: int, first_window: bool) -> ReportView | None:
    """What the report says about `rank` in the window numbered `window_key`."""
    if report is None:
        return None
    window = _dict(_window_entry(report.get("windows"), window_key))
    stragglers = _dict(window.get("stragglers"))
    trainer = _dict(report.get("trainer"))
    offset_ns = report_clock_offsets_ns(report, window_key).get(rank, 0)
    return ReportView(
        critical_path=rank_path(window.get("critical_path"), rank=rank, window_key=window_key,
                                report_offset_ns=offset_ns),
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


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFigures:
    """The report's step times and idle by cause of one rank in one window (what the merge's analysis
    track must show: expectations.py)."""

    step_times_ms: dict[int, float]
    """step -> windows[].ranks[].steps[].step_time_ms."""
    idle_by_cause_us: dict[str, float] | None
    """host_stalls.idle_by_cause_us (summed over the window's steps); None: no host_stalls."""


def report_step_figures(report: dict | None, *, rank: int, window_key: int) -> StepFigures | None:
    """The report's StepFigures of `rank` in the window numbered `window_key`; None without a report."""
    if report is None:
        return None
    entry = _dict(_rank_entry(_dict(_window_entry(report.get("windows"), window_key)).get("ranks"), rank))
    return StepFigures(step_times_ms=_step_times_ms(entry), idle_by_cause_us=_idle_by_cause_us(entry))


def _step_times_ms(rank_entry: dict) -> dict[int, float]:
    """step -> step_time_ms of a windows[].ranks[] entry (the span the merge draws each step with)."""
    return {s["step"]: float(s["step_time_ms"]) for s in _dicts(rank_entry.get("steps"))
            if _ints([s.get("step")]) and _number(s.get("step_time_ms"))}


def _idle_by_cause_us(rank_entry: dict) -> dict[str, float] | None:
    """host_stalls.idle_by_cause_us of a windows[].ranks[] entry; None without host_stalls."""
    stalls = rank_entry.get("host_stalls")
    if not isinstance(stalls, dict) or not isinstance(stalls.get("idle_by_cause_us"), dict):
        return None
    return {str(cause): float(us) for cause, us in stalls["idle_by_cause_us"].items() if _number(us)}


def _number(value: Any) -> bool:
    return finite_number(value) is not None


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


MAX_NAMED_PER_KIND = 8
"""Ranks one kind of finding may name for the focus set (a hot expert of a wide job has many holders)."""
MAX_CRITICAL_PATH_RANKS = 4


def report_named_ranks(report: dict | None) -> list[tuple[int, str]]:
    """(rank, reason) of every rank the report points at, most telling first: hang late ranks, the
    rank others wait for, the slowest rank, straggler causes, critical-path ranks, hot-expert holders
    (the merge's focus set, focus.py)."""
    if report is None:
        return []
    hang = _dict(_dict(report.get("capture")).get("hang"))
    named = _capped([(r, "hang: never entered the collective the others wait in")
                     for r in _ints(hang.get("late_ranks"))])
    windows = _dicts(report.get("windows"))
    for key, reason in (("waited_for_rank", "straggler: the rank the others wait for"),
                        ("slowest_rank", "straggler: slowest step time")):
        named += [(rank, reason) for w in windows if len(_dicts(w.get("ranks"))) > 1
                  for rank in _ints([_dict(w.get("stragglers")).get(key)])]
    named += _capped([(rank, f"straggler cause: {f.get('cause') or 'unexplained'}") for w in windows
                      for f in _dicts(_dict(w.get("causes")).get("findings")) for rank in _ints([f.get("rank")])])
    named += [(rank, "critical path") for rank in _critical_path_ranks(windows)]
    named += _capped([(rank, f"hot expert {f.get('expert')} of layer {f.get('layer')}")
                      for f in _dicts(_dict(report.get("moe")).get("findings")) for rank in _ints(f.get("ranks"))])
    return named


def report_groups(report: dict | None) -> dict[str, list[int]]:
    """Process group label -> member ranks the report knows (the hang view's groups)."""
    hang = _dict(_dict(_dict(report or {}).get("capture")).get("hang"))
    return {str(g.get("group")): _ints(g.get("ranks")) for g in _dicts(hang.get("groups")) if _ints(g.get("ranks"))}


def _critical_path_ranks(windows: list[dict]) -> list[int]:
    """Ranks with the largest summed share of the critical path, over the windows."""
    shares: dict[int, float] = {}
    for window in windows:
        for entry in _dicts(_dict(window.get("critical_path")).get("by_rank")):
            share = entry.get("share")
            if _ints([entry.get("rank")]) and isinstance(share, (int, float)) and share > 0:
                shares[entry["rank"]] = shares.get(entry["rank"], 0.0) + float(share)
    return sorted(shares, key=lambda r: (-shares[r], r))[:MAX_CRITICAL_PATH_RANKS]


def _ints(value: Any) -> list[int]:
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)] if isinstance(value, list) else []


def _capped(named: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return named[:MAX_NAMED_PER_KIND]
