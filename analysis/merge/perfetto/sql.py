"""Optional checks of a merged trace by Perfetto's own trace processor (`--trace-processor PATH`).

The perfetto package drives a `trace_processor_shell` binary; it cannot download one here, so these
checks run only when the caller names a binary. They ask the trace processor what it made of the
file, which is what the Perfetto UI will show:
  * the processes named `rank R (host)`, and the slices under each (its tracks and their children);
  * its import statistics with severity `error` or `data_loss` (e.g. `misplaced_end_event`, which is
    what slices that do not nest would cause);
  * how many flows (arrows) it built.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

SLICES_PER_TRACK_SQL = "SELECT track_id, COUNT(*) AS slices FROM slice GROUP BY track_id"
TRACKS_SQL = "SELECT id, parent_id FROM track"
PROCESS_TRACKS_SQL = "SELECT id, upid FROM process_track"
PROCESSES_SQL = "SELECT upid, name FROM process WHERE name LIKE 'rank %'"
ERROR_STATS_SQL = ("SELECT name, idx, severity, value FROM stats "
                   "WHERE value > 0 AND severity IN ('error', 'data_loss')")
FLOWS_SQL = "SELECT COUNT(*) AS flows FROM flow"


@dataclass(kw_only=True)
class SqlCheck:
    slices_by_process: dict[str, int] = field(default_factory=dict)
    flow_count: int = 0
    error_stats: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_with_trace_processor(trace: str | Path, bin_path: str | Path, *,
                               expected_slices: Mapping[str, int] | None = None) -> SqlCheck:
    """Load `trace` in the trace processor at `bin_path` and check it; `expected_slices` maps a
    process name (`rank 0 (host)`) to the number of slices it should hold."""
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    check = SqlCheck()
    with TraceProcessor(trace=str(trace), config=TraceProcessorConfig(bin_path=str(bin_path))) as processor:
        rows = {sql: [row.__dict__ for row in processor.query(sql)] for sql in (
            SLICES_PER_TRACK_SQL, TRACKS_SQL, PROCESS_TRACKS_SQL, PROCESSES_SQL, ERROR_STATS_SQL, FLOWS_SQL)}
    check.slices_by_process = slices_by_process(rows[SLICES_PER_TRACK_SQL], rows[TRACKS_SQL],
                                                rows[PROCESS_TRACKS_SQL], rows[PROCESSES_SQL])
    check.flow_count = int(rows[FLOWS_SQL][0]["flows"]) if rows[FLOWS_SQL] else 0
    check.error_stats = {f"{r['name']}[{r['idx']}]" if r.get("idx") is not None else r["name"]: int(r["value"])
                         for r in rows[ERROR_STATS_SQL]}
    check.problems += [f"trace processor stat {name} = {value}" for name, value in check.error_stats.items()]
    for process, expected in (expected_slices or {}).items():
        found = check.slices_by_process.get(process, 0)
        if found != expected:
            check.problems.append(f"{process}: the trace processor sees {found} slices, expected {expected}")
    return check


def slices_by_process(slice_rows: list[dict], track_rows: list[dict], process_track_rows: list[dict],
                      process_rows: list[dict]) -> dict[str, int]:
    """Slices per process name, following each track up its parents to a process track (pure)."""
    parent = {row["id"]: row.get("parent_id") for row in track_rows}
    upid_of_track = {row["id"]: row["upid"] for row in process_track_rows}
    name_of_upid = {row["upid"]: row["name"] for row in process_rows}
    counts: Counter = Counter()
    for row in slice_rows:
        track, seen = row["track_id"], set()
        while track is not None and track not in upid_of_track and track not in seen:
            seen.add(track)
            track = parent.get(track)
        name = name_of_upid.get(upid_of_track.get(track))
        if name is not None:
            counts[name] += int(row["slices"])
    return dict(counts)
