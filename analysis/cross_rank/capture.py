"""The report's `capture` section: why each unplanned window was recorded, and the hang report.

Reads the manifest's `captures` (traces/capture.py records, copied by gather); a run directory that was
never gathered falls back to the records themselves. The hang part comes from cross_rank/hang.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetscope.analysis.cross_rank.hang import HangReport, analyze_hang
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.traces.capture import CaptureRecord


@dataclass(frozen=True, kw_only=True)
class CaptureWindow:
    window: int
    kind: str
    """requested | triggered."""
    steps: str
    """Recorded (active) steps, e.g. `12-13`."""
    ranks: list[int] | None
    """Ranks that recorded (None: all)."""
    why: str
    """One sentence: who asked and when, or which trigger fired on what value."""


@dataclass(kw_only=True)
class CaptureSection:
    windows: list[CaptureWindow] = field(default_factory=list)
    hang: HangReport | None = None
    problems: list[str] = field(default_factory=list)


def capture_section(run: RunRecords | None, world_size: int | None = None) -> CaptureSection | None:
    """None when the run has neither unplanned windows nor Flight Recorder dumps (or `run` is None: no run
    directory)."""
    if run is None:
        return None
    records, problems = _records(run)
    hang = analyze_hang(run, world_size)
    if not records and hang is None and not problems:
        return None
    return CaptureSection(windows=[_window(r) for r in records], hang=hang, problems=problems)


def _records(run: RunRecords) -> tuple[list[CaptureRecord], list[str]]:
    """The manifest's records of unplanned windows (validated by its one reader), else the run's own
    captures/ files (before gather, or when the manifest cannot be used: the inputs stage names it)."""
    captured = run.manifest.captures if run.manifest is not None else []
    if captured:
        return captured, []
    return list(run.captures), list(run.capture_problems)


def _window(record: CaptureRecord) -> CaptureWindow:
    if record.kind == "requested":
        why = (f"requested by {record.requested_by or 'unknown'} at {record.requested_at or '?'} "
               f"(request {record.request}); started after step {record.agreed_at_step}")
    else:
        why = f"triggered by {record.trigger or '?'}: {record.reason or 'no reason recorded'}"
    return CaptureWindow(window=record.window, kind=record.kind, steps=f"{record.active_start}-{record.end - 1}",
                         ranks=record.ranks, why=why)
