"""Named SQL queries over a merged trace, for `fleetscope query --named NAME` (Perfetto's SQL).

Each is one statement over the trace processor's tables. Ranks are the processes named `rank R (host)`
(listed by pid, which is 1000000 + R); a slice belongs to a rank through its process track or its
thread track (`RANK_OF_TRACK`). Durations are in milliseconds (`_ms` columns), and so are times: `_ms`
columns that are points in time count from the trace's start (`trace_bounds.start_ts`), not raw timestamps.
"""

from __future__ import annotations

RANK_OF_TRACK = """
rank_of_track AS (
  SELECT pt.id AS track_id, p.pid AS pid, p.name AS rank FROM process_track pt JOIN process p USING (upid)
    WHERE p.name LIKE 'rank %'
  UNION ALL
  SELECT tt.id, p.pid, p.name FROM thread_track tt JOIN thread t USING (utid) JOIN process p USING (upid)
    WHERE p.name LIKE 'rank %'
)"""

TOP_KERNELS = f"""
WITH {RANK_OF_TRACK},
kernels AS (
  SELECT r.pid, r.rank, s.name AS kernel, COUNT(*) AS calls, SUM(s.dur) AS total_ns
  FROM slice s JOIN rank_of_track r ON s.track_id = r.track_id
  WHERE s.category = 'kernel' GROUP BY r.pid, s.name
),
ranked AS (
  SELECT *, ROW_NUMBER() OVER (PARTITION BY pid ORDER BY total_ns DESC, kernel) AS position FROM kernels
)
SELECT rank, position, kernel, calls, ROUND(total_ns / 1e6, 3) AS total_ms
FROM ranked WHERE position <= 10 ORDER BY pid, position
"""
"""The ten GPU kernels with the most total time on each rank."""

COLLECTIVE_WAITS = f"""
WITH {RANK_OF_TRACK},
ends AS (
  SELECT trace_id, slice_out AS slice_id FROM flow WHERE trace_id < 0
  UNION SELECT trace_id, slice_in FROM flow WHERE trace_id < 0
),
arrivals AS (
  SELECT e.trace_id, s.name, s.ts, s.dur, r.rank,
         ROW_NUMBER() OVER (PARTITION BY e.trace_id ORDER BY s.ts DESC) AS from_last
  FROM ends e JOIN slice s ON s.id = e.slice_id JOIN rank_of_track r ON s.track_id = r.track_id
  JOIN track t ON t.id = s.track_id
  WHERE t.name IS NULL OR t.name NOT LIKE 'critical path%'
)
SELECT MIN(name) AS collective, COUNT(*) AS ranks,
       ROUND((MIN(ts) - (SELECT start_ts FROM trace_bounds)) / 1e6, 3) AS first_arrival_ms,
       ROUND((MAX(ts) - MIN(ts)) / 1e6, 3) AS longest_wait_ms,
       MAX(CASE WHEN from_last = 1 THEN rank END) AS last_to_arrive
FROM arrivals GROUP BY trace_id ORDER BY longest_wait_ms DESC, first_arrival_ms LIMIT 100
"""
"""Per collective instance (the slices joined by one cross-rank flow id): how long the first rank to
arrive waited for the last one, and which rank that was; the 100 longest waits. The critical path's arrows
between ranks are cross-rank flows too: they join `critical path` slices, which are left out."""

IDLE_GAPS = f"""
WITH {RANK_OF_TRACK}
SELECT r.rank, s.name AS cause, COUNT(*) AS gaps, ROUND(SUM(s.dur) / 1e6, 3) AS total_ms,
       ROUND(MAX(s.dur) / 1e6, 3) AS longest_ms
FROM slice s JOIN rank_of_track r ON s.track_id = r.track_id JOIN track t ON t.id = s.track_id
WHERE t.name LIKE 'fleetscope analysis%' AND s.name LIKE 'idle%'
GROUP BY r.pid, s.name ORDER BY r.pid, total_ms DESC
"""
"""Idle gaps per rank by cause, from the `fleetscope analysis` track's `idle: <cause>` slices (the per-rank
analysis's gaps and causes, host_stalls.py)."""

CRITICAL_PATH = f"""
WITH {RANK_OF_TRACK}
SELECT EXTRACT_ARG(s.arg_set_id, 'debug.step') AS step, r.rank, s.name AS segment,
       ROUND((s.ts - (SELECT start_ts FROM trace_bounds)) / 1e6, 3) AS start_ms,
       ROUND(s.dur / 1e6, 3) AS dur_ms, EXTRACT_ARG(s.arg_set_id, 'debug.share_pct') AS share_pct,
       EXTRACT_ARG(s.arg_set_id, 'debug.collective') AS collective,
       EXTRACT_ARG(s.arg_set_id, 'debug.waited_for_rank') AS waited_for_rank
FROM slice s JOIN rank_of_track r ON s.track_id = r.track_id JOIN track t ON t.id = s.track_id
WHERE t.name LIKE 'critical path%'
ORDER BY CAST(EXTRACT_ARG(s.arg_set_id, 'debug.step') AS INT), s.ts, r.pid
"""
"""Each step's cross-rank critical path, segment by segment, from the `critical path` tracks."""

NO_ROWS = {
    "top-kernels": "the trace holds no GPU kernels (a CPU run, or a merge of CPU traces)",
    "collective-waits": "no collective joins ranks by a cross-rank arrow (one rank, a merge with --no-flows, "
                        "or collectives the merge could not match)",
    "idle-gaps": "no `fleetscope analysis` track with idle gaps (a merge with --no-overlays, or no gap found)",
    "critical-path": "no `critical path` track (a merge with --no-overlays, or a report without a critical path)",
}
"""Why a named query can find nothing, for `fleetscope query`'s "no rows: <why>"."""

NAMED_QUERIES = {
    "top-kernels": TOP_KERNELS,
    "collective-waits": COLLECTIVE_WAITS,
    "idle-gaps": IDLE_GAPS,
    "critical-path": CRITICAL_PATH,
}
