"""A Chrome trace of another tool (viztracer's X events of cat "fee" / "python", no torch.profiler event):
`merge` draws its events, names the file as analyze does, calls it no rank, and exits 3 (partial)."""

from __future__ import annotations

import json
from pathlib import Path

from fleetscope.analysis.merge.perfetto.sql import run_query
from fleetscope.cli.main import main
from helpers import requires_trace_processor, trace_processor

CALLS = 50


def write_viztracer_like(path: Path) -> Path:
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 1, "args": {"name": "python"}}]
    for call in range(CALLS):
        start = call * 20
        events.append({"ph": "X", "name": f"step{call % 5} (/train.py:{call})", "cat": "fee", "pid": 1, "tid": 1,
                       "ts": start, "dur": 10})
        events.append({"ph": "X", "name": "builtins.len", "cat": "python", "pid": 1, "tid": 1, "ts": start + 1,
                       "dur": 2})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "viztracer_metadata": {"version": "0.16.3"}}))
    return path


@requires_trace_processor
def test_another_tool_s_trace_is_drawn_named_and_partial(tmp_path, capsys):
    trace = write_viztracer_like(tmp_path / "traces" / "result.json")
    out = tmp_path / "merged.perfetto-trace"
    assert main(["merge", str(trace.parent), "-o", str(out), "--verify"]) == 3
    printed = capsys.readouterr()
    problem = f"{trace}: no torch.profiler events"
    assert problem in printed.out + printed.err and "a Chrome trace of another tool" in printed.out + printed.err
    assert "rank 0:" not in printed.out + printed.err
    assert "merged 1 trace(s) of another tool" in printed.out and "rank(s) in full" not in printed.out.splitlines()[0]
    rows = run_query(out, "SELECT p.name AS process, COUNT(s.id) AS slices FROM slice s "
                          "JOIN thread_track tt ON s.track_id = tt.id JOIN thread USING (utid) "
                          "JOIN process p USING (upid) GROUP BY p.name", trace_processor())
    assert rows == [{"process": "trace result.json (not a torch.profiler trace)", "slices": str(2 * CALLS)}]
    names = run_query(out, "SELECT DISTINCT s.name FROM slice s JOIN thread_track tt ON s.track_id = tt.id",
                      trace_processor())
    assert {row["name"] for row in names} == {"builtins.len"} | {f"step{i} (/train.py:{c})"
                                                                 for c in range(CALLS) for i in [c % 5]}


def test_the_merge_names_another_tool_s_trace_as_analyze_does(tmp_path):
    from fleetscope.analysis.analyze import analyze
    from fleetscope.analysis.merge.run import merge

    trace = write_viztracer_like(tmp_path / "traces" / "result.json")
    analyzed = analyze(trace.parent, use_hta=False, use_cache=False)
    merged = merge(trace.parent, tmp_path / "merged.perfetto-trace", use_cache=False)
    assert [p.reason for p in analyzed.problems] == [p.reason for p in merged.problems]
    assert [p.path for p in merged.problems] == [str(trace)] and merged.problems[0].rank is None
