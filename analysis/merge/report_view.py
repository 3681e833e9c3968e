"""The analysis report, as the merge reads it for its overlays.

The merge takes from it the straggler marks, the critical path (critical_path_overlays.py), the per-step
evidence (evidence_overlays.py) and, when the caller gives no offsets, the clock offsets
the analysis used, so the merged timeline and the report agree on who arrived when. It reads the typed
`Report` (report/model.py): one given is used as it is; a JSON dict or a `report.json` file is read with
`Report.from_json_lenient`, so a report of another version, or one partly wrong, gives what parses and a
note per field that did not. A run directory's `report/report.json` is used when no report is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from fleetscope.analysis.merge.critical_path_overlays import rank_path
from fleetscope.analysis.merge.evidence_overlays import rank_evidence
from fleetscope.analysis.merge.sources import MergeProblem
from fleetscope.traces.safe_read import read_metadata
from fleetscope.analysis.merge.window import ReportView
from fleetscope.traces.layout import RunLayout
from fleetscope.traces.validate import finite_number

if TYPE_CHECKING:
    from fleetscope.analysis.cross_rank.stragglers import CollectiveInstance
    from fleetscope.analysis.report.model import RankReport, Report, WindowReport

ReportSource = Any
"""A `Report`, its JSON dict, a path to report.json, or None."""
MAX_PARSE_NOTES = 10
"""Notes listed per report read leniently (a hand-written report may miss dozens of fields); the rest counted."""


def load_report(source: ReportSource, layout: RunLayout | None, problems: list[MergeProblem],
                notes: list[MergeProblem]) -> "Report | None":
    """The report; None when there is none. A file that cannot be read, or that is no report at all, is a
    problem; each field a readable one did not parse is a note naming the file (never an error)."""
    # imported here: a merge without a report (and its worker processes) never loads the report's model
    from fleetscope.analysis.report.model import Report

    within = None
    if source is None:
        if layout is None or not layout.report_json.is_file():
            return None
        source, within = layout.report_json, layout.root   # the run's own report: it must stay inside the run
    if isinstance(source, Report):
        return source
    if hasattr(source, "to_json"):
        return _parsed(source.to_json(), "analysis report", problems, notes)
    if isinstance(source, Mapping):
        return _parsed(dict(source), "analysis report", problems, notes)
    try:
        loaded = json.loads(read_metadata(Path(source), within=within))
    except (OSError, ValueError, RecursionError) as error:
        problems.append(MergeProblem(path=str(source), reason=f"analysis report not used: {error}"))
        return None
    return _parsed(loaded, str(source), problems, notes)


def _parsed(data: Any, path: str, problems: list[MergeProblem], notes: list[MergeProblem]) -> "Report | None":
    from fleetscope.analysis.report.model import Report

    if not isinstance(data, dict):
        problems.append(MergeProblem(path=path, reason="analysis report not used: not a JSON object"))
        return None
    try:
        report, parse_notes = Report.from_json_lenient(data)
    except (ValueError, RecursionError) as error:
        problems.append(MergeProblem(path=path, reason=f"analysis report not used: {error}"))
        return None
    notes += [MergeProblem(path=path, reason=f"analysis report: {note}") for note in parse_notes[:MAX_PARSE_NOTES]]
    if len(parse_notes) > MAX_PARSE_NOTES:
        notes.append(MergeProblem(path=path, reason=f"analysis report: {len(parse_notes) - MAX_PARSE_NOTES} more "
                                                    f"fields not read as written"))
    return report


def report_mismatch(report: "Report | None", event_counts: Mapping[tuple[int | None, int], int]) -> str | None:
    """Why `report` is not a report of the traces whose per-rank parse counted `event_counts` ((window, rank)
    -> events), or None. Only what the report states is compared (windows[].ranks[] with their event_count):
    a report that states nothing of its ranks is taken as it is."""
    stated = {(w.window, r.rank): r.event_count for w in (report.windows if report is not None else [])
              for r in w.ranks}
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


def report_view(report: "Report | None", *, rank: int, window_key: int, first_window: bool) -> ReportView | None:
    """What the report says about `rank` in the window numbered `window_key`."""
    if report is None:
        return None
    window = _window_entry(report.windows, window_key)
    offset_ns = report_clock_offsets_ns(report, window_key).get(rank, 0)
    trainer_rank = _rank_entry(report.trainer.ranks, rank) if report.trainer is not None else None
    if window is None:
        return ReportView(evidence=rank_evidence(None, None, trainer_rank),
                          rank_summary=_rank_entry(report.ranks, rank) if first_window else None,
                          report_verdict=report.verdict)
    stragglers = window.stragglers
    return ReportView(
        critical_path=rank_path(window.critical_path, rank=rank, window_key=window_key, report_offset_ns=offset_ns),
        evidence=rank_evidence(window, _rank_entry(window.ranks, rank), trainer_rank),
        rank_summary=_rank_entry(report.ranks, rank) if first_window else None,
        report_verdict=report.verdict,
        window_verdict=stragglers.verdict,
        waited_for=stragglers.waited_for_rank == rank,
        slowest=stragglers.slowest_rank == rank and len(window.ranks) > 1,
        wait=_rank_entry(stragglers.by_wait, rank),
        late_instances=[i for i in stragglers.worst_instances
                        if i.last_rank == rank and _kept_others_waiting(i, stragglers.min_lateness_us)],
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFigures:
    """The report's step times and idle by cause of one rank in one window (what the merge's analysis
    track must show: expectations.py)."""

    step_times_ms: dict[int, float]
    """step -> windows[].ranks[].steps[].step_time_ms."""
    idle_by_cause_us: dict[str, float] | None
    """host_stalls.idle_by_cause_us (summed over the window's steps); None: no host_stalls."""


def report_step_figures(report: "Report | None", *, rank: int, window_key: int) -> StepFigures | None:
    """The report's StepFigures of `rank` in the window numbered `window_key`; None without a report."""
    if report is None:
        return None
    window = _window_entry(report.windows, window_key)
    entry = _rank_entry(window.ranks, rank) if window is not None else None
    return StepFigures(step_times_ms=_step_times_ms(entry), idle_by_cause_us=_idle_by_cause_us(entry))


def _step_times_ms(rank_entry: "RankReport | None") -> dict[int, float]:
    """step -> step_time_ms of a windows[].ranks[] entry (the span the merge draws each step with)."""
    if rank_entry is None:
        return {}
    return {s.step: float(s.step_time_ms) for s in rank_entry.steps if _number(s.step_time_ms)}


def _idle_by_cause_us(rank_entry: "RankReport | None") -> dict[str, float] | None:
    """host_stalls.idle_by_cause_us of a windows[].ranks[] entry; None without host_stalls, or with one that
    measured no span (a report that states no idle figures: its idle by cause is empty, not zero)."""
    if rank_entry is None or rank_entry.host_stalls is None or not rank_entry.host_stalls.steps_span_us > 0:
        return None
    return {str(cause): float(us) for cause, us in rank_entry.host_stalls.idle_by_cause_us.items() if _number(us)}


def _number(value: Any) -> bool:
    return finite_number(value) is not None


def _kept_others_waiting(instance: "CollectiveInstance", min_lateness_us: float) -> bool:
    """The instance's last rank was late enough to count as such in the report (ranks arriving together
    have a "last" one too, by ordering noise, and are not marked)."""
    return instance.lateness_us >= min_lateness_us and instance.lateness_us > 0


def _window_entry(windows: "list[WindowReport]", window_key: int) -> "WindowReport | None":
    for window in windows:
        if window.window == window_key:
            return window
    unnumbered = [w for w in windows if w.window is None]
    return unnumbered[0] if len(unnumbered) == 1 else None


def _rank_entry(entries: list, rank: int) -> Any:
    """The first of `entries` (dataclasses with a `rank`) about `rank`; None without one."""
    return next((e for e in entries if e.rank == rank), None)


def report_clock_offsets_ns(report: "Report | None", window_key: int) -> dict[int, int]:
    """rank -> the clock offset (ns) the analysis used for this window (`windows[].clock.hosts[]`:
    measured at startup, or refined from collectives). Empty when the report has none."""
    window = _window_entry(report.windows, window_key) if report is not None else None
    offsets = {}
    for host in window.clock.hosts if window is not None else []:
        if _number(host.offset_us):
            offsets.update({rank: round(host.offset_us * 1000) for rank in host.ranks})
    return offsets


MAX_NAMED_PER_KIND = 8
"""Ranks one kind of finding may name for the focus set (a hot expert of a wide job has many holders)."""
MAX_CRITICAL_PATH_RANKS = 4


def report_named_ranks(report: "Report | None") -> list[tuple[int, str]]:
    """(rank, reason) of every rank the report points at, most telling first: hang late ranks, the
    rank others wait for, the slowest rank, straggler causes, critical-path ranks, hot-expert holders
    (the merge's focus set, focus.py)."""
    if report is None:
        return []
    hang = report.capture.hang if report.capture is not None else None
    named = _capped([(r, "hang: never entered the collective the others wait in")
                     for r in (hang.late_ranks if hang is not None else [])])
    windows = [w for w in report.windows if len(w.ranks) > 1]
    named += [(w.stragglers.waited_for_rank, "straggler: the rank the others wait for") for w in windows
              if w.stragglers.waited_for_rank is not None]
    named += [(w.stragglers.slowest_rank, "straggler: slowest step time") for w in windows
              if w.stragglers.slowest_rank is not None]
    named += _capped([(f.rank, f"straggler cause: {f.cause or 'unexplained'}") for w in report.windows
                      for f in w.causes.findings])
    named += [(rank, "critical path") for rank in _critical_path_ranks(report.windows)]
    named += _capped([(rank, f"hot expert {f.expert} of layer {f.layer}")
                      for f in (report.moe.findings if report.moe is not None else []) for rank in f.ranks])
    return named


def report_groups(report: "Report | None") -> dict[str, list[int]]:
    """Process group label -> member ranks the report knows (the hang view's groups)."""
    hang = report.capture.hang if report is not None and report.capture is not None else None
    return {g.group: list(g.ranks) for g in (hang.groups if hang is not None else []) if g.ranks}


def _critical_path_ranks(windows: "list[WindowReport]") -> list[int]:
    """Ranks with the largest summed share of the critical path, over the windows."""
    shares: dict[int, float] = {}
    for window in windows:
        for entry in window.critical_path.by_rank:
            if entry.share > 0:
                shares[entry.rank] = shares.get(entry.rank, 0.0) + float(entry.share)
    return sorted(shares, key=lambda r: (-shares[r], r))[:MAX_CRITICAL_PATH_RANKS]


def _capped(named: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return named[:MAX_NAMED_PER_KIND]
