"""Checking and querying a merged trace with Perfetto's own trace processor (`trace_processor_shell`).

The trace processor is the engine behind ui.perfetto.dev, so what it makes of a file is what the UI
shows. `find_trace_processor` is the one place that decides which binary to use: the one named by
the caller (`--trace-processor PATH`), else `$FLEETSCOPE_TRACE_PROCESSOR`, else
`<repo>/../shared/tools/trace_processor_shell`, else `trace_processor_shell` on PATH.

`check_with_trace_processor` loads a trace once and compares the engine's tables with what the file
should hold (`EngineExpectations`):
  * its import statistics with severity `error` or `data_loss` (e.g. `misplaced_end_event`);
  * slices per process (`rank R (host)`), through process tracks and thread tracks;
  * thread tracks per process (the engine's `thread` table);
  * cross-rank flows per collective instance (flow ids with the top bit set);
  * counter samples;
  * the summary track of each rank (`rank R: steps`, merge/summary.py) and its slices;
  * every slice and counter inside the merge's first and last timestamps.
An unmatched slice end leaves no row in `stats`, which is why the counts are compared too.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

BINARY_NAME = "trace_processor_shell"
ENV_VAR = "FLEETSCOPE_TRACE_PROCESSOR"
REPO_ROOT = Path(__file__).resolve().parents[3]
SHARED_BINARY = REPO_ROOT.parent / "shared" / "tools" / BINARY_NAME
QUERY_TIMEOUT_S = 600


class TraceProcessorError(RuntimeError):
    """The trace processor could not load the trace or run the query."""


def find_trace_processor(explicit: str | Path | None = None) -> Path | None:
    """The trace processor binary to use, or None when there is none (see the module docstring)."""
    if explicit:
        if not _executable(explicit):
            raise FileNotFoundError(f"trace processor {explicit} is not an executable file")
        return Path(os.path.abspath(explicit))  # exactly the file checked: a bare name is not looked up on PATH
    for candidate in (os.environ.get(ENV_VAR), SHARED_BINARY, shutil.which(BINARY_NAME)):
        if candidate and _executable(candidate):
            return Path(os.path.abspath(candidate))
    return None


def _executable(path: str | Path) -> bool:
    return Path(path).is_file() and os.access(path, os.X_OK)


def _not_a_regular_file(path: Path) -> str | None:
    """Why the engine must not open `path` (this layer imports nothing of the project: traces/safe_read.py
    makes the same check for the rest), or None."""
    try:
        info = os.stat(path)
    except OSError as error:
        return f"cannot stat: {error.strerror or error}"
    return None if stat.S_ISREG(info.st_mode) else "not a regular file (a FIFO, a device, a directory): not read"


def run_query(trace: str | Path, sql: str, bin_path: str | Path) -> list[dict[str, str]]:
    """Rows (column -> text, '' for NULL) of the last statement of `sql` run on `trace`."""
    return run_query_table(trace, sql, bin_path)[1]


def run_query_table(trace: str | Path, sql: str, bin_path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """The columns and rows of the last statement of `sql` run on `trace` (the columns even without rows)."""
    problem = _not_a_regular_file(Path(trace))
    if problem:  # a FIFO would block the engine's open forever
        raise TraceProcessorError(f"{trace}: {problem}")
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as query:
        query.write(sql)
        query.flush()
        try:
            completed = subprocess.run([os.path.abspath(bin_path), "-q", query.name, str(trace)],
                                       capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TraceProcessorError(f"{bin_path} did not finish on {trace} within {QUERY_TIMEOUT_S} s") from None
    if completed.returncode != 0:
        tail = "\n".join(completed.stderr.strip().splitlines()[-5:])
        raise TraceProcessorError(f"{bin_path} failed on {trace} (exit {completed.returncode}): {tail}")
    return parse_csv_table(completed.stdout)


def parse_csv_rows(text: str) -> list[dict[str, str]]:
    """The shell's output: a header line then rows, CSV; only the last result is kept (pure)."""
    return parse_csv_table(text)[1]


def parse_csv_table(text: str) -> tuple[list[str], list[dict[str, str]]]:
    """The last result's columns (its header line, printed even for no rows) and rows (pure)."""
    blocks = [block for block in text.strip().split("\n\n") if block.strip()]
    if not blocks:
        return [], []
    reader = csv.DictReader(io.StringIO(blocks[-1]))
    rows = [{key: ("" if value == "[NULL]" else value) for key, value in row.items()} for row in reader]
    return list(reader.fieldnames or []), rows


DRAWN_PROCESS_PREFIXES = ("rank ", "trace ")
"""The processes of the files drawn in full: a rank's (`rank R (host)`), and a Chrome trace of another tool's
(`trace NAME (not a torch.profiler trace)`, merge/sources.py)."""

CHECK_SQL = """
WITH owner AS (
  SELECT id AS track_id, upid FROM process_track
  UNION ALL
  SELECT tt.id, t.upid FROM thread_track tt JOIN thread t USING (utid)
)
SELECT 'process' AS kind, CAST(upid AS TEXT) AS a, name AS b, '' AS c FROM process WHERE name LIKE 'rank %' OR name LIKE 'trace %'
UNION ALL
SELECT 'slices', CAST(o.upid AS TEXT), CAST(COUNT(*) AS TEXT), '' FROM slice s JOIN owner o ON s.track_id = o.track_id
  GROUP BY o.upid
UNION ALL
SELECT 'orphan_slices', '', CAST(COUNT(*) AS TEXT), '' FROM slice s LEFT JOIN owner o ON s.track_id = o.track_id
  WHERE o.upid IS NULL
UNION ALL
SELECT 'threads', CAST(t.upid AS TEXT), CAST(COUNT(DISTINCT t.utid) AS TEXT), ''
  FROM thread_track tt JOIN thread t USING (utid) GROUP BY t.upid
UNION ALL
SELECT 'stat', name || CASE WHEN idx IS NULL THEN '' ELSE '[' || idx || ']' END, CAST(value AS TEXT), severity
  FROM stats WHERE value > 0 AND severity IN ('error', 'data_loss')
UNION ALL
SELECT 'cross_flow', CAST(f.trace_id AS TEXT), CAST(COUNT(*) AS TEXT), ''
  FROM flow f JOIN slice so ON f.slice_out = so.id JOIN slice si ON f.slice_in = si.id
  JOIN owner oo ON so.track_id = oo.track_id JOIN owner oi ON si.track_id = oi.track_id
  WHERE oo.upid != oi.upid GROUP BY f.trace_id
UNION ALL
SELECT 'flows', '', CAST(COUNT(*) AS TEXT), '' FROM flow
UNION ALL
SELECT 'counters', '', CAST(COUNT(*) AS TEXT), '' FROM counter
UNION ALL
SELECT 'summary_track', name, CAST((SELECT COUNT(*) FROM slice s WHERE s.track_id = t.id) AS TEXT), ''
  FROM track t WHERE name GLOB 'rank *: steps'
UNION ALL
SELECT 'slice_bounds', CAST(MIN(ts) AS TEXT), CAST(MAX(ts + dur) AS TEXT), '' FROM slice
UNION ALL
SELECT 'counter_bounds', CAST(MIN(ts) AS TEXT), CAST(MAX(ts) AS TEXT), '' FROM counter
"""


@dataclass(frozen=True, kw_only=True)
class EngineExpectations:
    """What a merged trace should hold, by process name (`rank 0 (host)`)."""

    slices_by_process: Mapping[str, int]
    threads_by_process: Mapping[str, int] | None = None
    cross_rank_flows: Mapping[int, int] | None = None
    """Collective flow id (as written, top bit set) -> arrows between two different ranks."""
    counter_samples: int | None = None
    time_bounds_ns: tuple[int, int] | None = None
    """Every slice and counter lies within [first, last] of the merged clock."""
    summary_slices: Mapping[int, int] | None = None
    """rank -> slices on its summary track `rank R: steps` (merge/summary.py); every other rank has none."""
    arrows: int | None = None
    """Every arrow the file joins (the read-back's, perfetto/check.py): the engine must join each, within a
    rank or across ranks, as none of them leaves a stat when it does not."""


@dataclass(kw_only=True)
class SqlCheck:
    slices_by_process: dict[str, int] = field(default_factory=dict)
    threads_by_process: dict[str, int] = field(default_factory=dict)
    cross_rank_flows: dict[int, int] = field(default_factory=dict)
    flows: int = 0
    """Rows of the engine's `flow` table."""
    counter_samples: int = 0
    summary_slices: dict[int, int] = field(default_factory=dict)
    slice_bounds_ns: tuple[int, int] | None = None
    counter_bounds_ns: tuple[int, int] | None = None
    error_stats: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def flow_count(self) -> int:
        return sum(self.cross_rank_flows.values())

    @property
    def ok(self) -> bool:
        return not self.problems


def check_with_trace_processor(trace: str | Path, bin_path: str | Path, *,
                               expected: EngineExpectations | None = None) -> SqlCheck:
    """Load `trace` in the trace processor at `bin_path` and compare its tables with `expected`."""
    check = read_check_rows(run_query(trace, CHECK_SQL, bin_path))
    if expected is not None:
        check.problems += compare(check, expected)
    return check


def read_check_rows(rows: list[dict[str, str]]) -> SqlCheck:
    """The rows of CHECK_SQL as a SqlCheck, problems from the stats only (pure)."""
    check = SqlCheck()
    names = {row["a"]: row["b"] for row in rows if row["kind"] == "process"}
    for row in rows:
        kind, a, b = row["kind"], row["a"], row["b"]
        if kind == "slices" and a in names:
            check.slices_by_process[names[a]] = int(b)
        elif kind == "orphan_slices" and int(b):
            check.problems.append(f"{b} slices on tracks of no process")
        elif kind == "threads" and a in names:
            check.threads_by_process[names[a]] = int(b)
        elif kind == "stat":
            check.error_stats[a] = int(b)
        elif kind == "cross_flow":
            check.cross_rank_flows[int(a) % (1 << 64)] = int(b)
        elif kind == "flows":
            check.flows = int(b)
        elif kind == "counters":
            check.counter_samples = int(b)
        elif kind == "summary_track" and a.split(":")[0][len("rank "):].isdigit():
            check.summary_slices[int(a.split(":")[0][len("rank "):])] = int(b)
        elif kind in ("slice_bounds", "counter_bounds") and a:
            bounds = (int(a), int(b))
            if kind == "slice_bounds":
                check.slice_bounds_ns = bounds
            else:
                check.counter_bounds_ns = bounds
    check.problems += [f"trace processor stat {name} = {value}" for name, value in check.error_stats.items()]
    return check


def compare(check: SqlCheck, expected: EngineExpectations) -> list[str]:
    """Where the engine's view differs from `expected` (pure)."""
    problems = _compare_counts("slices", check.slices_by_process, expected.slices_by_process)
    if expected.threads_by_process is not None:
        problems += _compare_counts("threads", check.threads_by_process, expected.threads_by_process)
    if expected.cross_rank_flows is not None:
        missing = {i: n for i, n in expected.cross_rank_flows.items() if check.cross_rank_flows.get(i, 0) != n}
        extra = set(check.cross_rank_flows) - set(expected.cross_rank_flows)
        if missing or extra:
            problems.append(f"cross-rank flows: {len(missing)} collective instances with other arrow counts "
                            f"than written, {len(extra)} not written (engine sees {len(check.cross_rank_flows)}, "
                            f"expected {len(expected.cross_rank_flows)})")
    if expected.arrows is not None and check.flows != expected.arrows:
        problems.append(f"the trace processor joins {check.flows} arrows, the file holds {expected.arrows}: "
                        f"{abs(check.flows - expected.arrows)} {'lost' if check.flows < expected.arrows else 'extra'}")
    if expected.counter_samples is not None and check.counter_samples != expected.counter_samples:
        problems.append(f"the trace processor sees {check.counter_samples} counter samples, "
                        f"expected {expected.counter_samples}")
    if expected.summary_slices is not None and check.summary_slices != dict(expected.summary_slices):
        differ = sorted(set(check.summary_slices.items()) ^ set(expected.summary_slices.items()))
        problems.append(f"summary tracks: the trace processor sees {len(check.summary_slices)} ranks' summaries, "
                        f"expected {len(expected.summary_slices)} (first differences, rank and slices: {differ[:5]})")
    if expected.time_bounds_ns is not None:
        first, last = expected.time_bounds_ns
        for what, bounds in (("slices", check.slice_bounds_ns), ("counters", check.counter_bounds_ns)):
            if bounds is not None and (bounds[0] < first or bounds[1] > last):
                problems.append(f"{what} span [{bounds[0]}, {bounds[1]}] ns, outside the merge's [{first}, {last}]")
    return problems


def _compare_counts(what: str, found: Mapping[str, int], expected: Mapping[str, int]) -> list[str]:
    problems = [f"{process}: the trace processor sees {found.get(process, 0)} {what}, expected {count}"
                for process, count in expected.items() if found.get(process, 0) != count]
    problems += [f"{process}: the trace processor sees {count} {what} in a process not expected"
                 for process, count in found.items() if process not in expected and count]
    return problems

