"""`fleetscope query`: SQL and the named queries over a merged trace, in the trace processor."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

import fleetscope.analysis.merge.perfetto.sql as perfetto_sql
from fleetscope.analysis.merge.perfetto.queries import NAMED_QUERIES
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.run import merge
from fleetscope.cli.main import main
from helpers import requires_trace_processor
from test_merge import gpu_rank_events, kineto_document, write_trace


@pytest.fixture
def merged_trace(tmp_path: Path) -> Path:
    for rank in (0, 1):
        write_trace(tmp_path / "t" / f"rank{rank}.json",
                    kineto_document(rank, gpu_rank_events(shift_us=3.0 * rank), host=f"n{rank}"))
    return merge(tmp_path / "t", tmp_path / "out.perfetto-trace").output


def query(capsys, *argv: str) -> tuple[int, list[dict]]:
    code = main(["query", *argv])
    return code, list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


@requires_trace_processor
def test_top_kernels_lists_each_ranks_kernels_by_total_time(merged_trace, capsys):
    code, rows = query(capsys, str(merged_trace), "--named", "top-kernels")
    assert code == 0
    assert [(r["rank"], r["position"], r["kernel"]) for r in rows] == [
        ("rank 0 (n0)", "1", "ncclDevKernel_AllReduce"), ("rank 0 (n0)", "2", "sm90_gemm"),
        ("rank 1 (n1)", "1", "ncclDevKernel_AllReduce"), ("rank 1 (n1)", "2", "sm90_gemm")]


@requires_trace_processor
def test_collective_waits_name_the_last_rank_to_arrive(merged_trace, capsys):
    code, rows = query(capsys, str(merged_trace), "--named", "collective-waits")
    assert code == 0 and len(rows) == 1
    assert rows[0]["ranks"] == "2" and rows[0]["last_to_arrive"] == "rank 1 (n1)"
    assert float(rows[0]["longest_wait_ms"]) == pytest.approx(0.003)   # rank 1 runs 3 us later


@requires_trace_processor
def test_idle_gaps_come_from_the_analysis_track(merged_trace, capsys):
    code, rows = query(capsys, str(merged_trace), "--named", "idle-gaps")
    assert code == 0
    assert {r["rank"] for r in rows} == {"rank 0 (n0)", "rank 1 (n1)"}
    assert all(r["cause"].startswith("idle") and float(r["total_ms"]) > 0 for r in rows)


@requires_trace_processor
def test_every_named_query_runs_and_plain_sql_too(merged_trace, capsys):
    for name in NAMED_QUERIES:
        assert query(capsys, str(merged_trace), "--named", name)[0] == 0
    code, rows = query(capsys, str(merged_trace), "SELECT COUNT(*) AS threads FROM thread WHERE tid >= 10000000")
    assert code == 0 and rows == [{"threads": "4"}]
    assert main(["query", str(merged_trace), "SELECT * FROM no_such_table"]) == 1


def test_without_a_trace_processor_query_says_so_and_exits_2(merged_trace, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETSCOPE_TRACE_PROCESSOR", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(perfetto_sql, "SHARED_BINARY", tmp_path / "none")
    assert main(["query", str(merged_trace), "--named", "idle-gaps"]) == 2
    assert "no trace_processor_shell found" in capsys.readouterr().err
    assert main(["query", str(merged_trace), "SELECT 1", "--trace-processor", str(tmp_path / "none")]) == 2


@requires_trace_processor
def test_named_queries_on_a_real_two_rank_gpu_run(tmp_path, capsys):
    from test_merge_gpu import DDP_GLOO

    trace = merge(DDP_GLOO, tmp_path / "merged.perfetto-trace", options=MergeOptions()).output
    code, kernels = query(capsys, str(trace), "--named", "top-kernels")
    assert code == 0 and {r["rank"] for r in kernels} == {"rank 0 (vm)", "rank 1 (vm)"}
    assert all(int(r["position"]) <= 10 and float(r["total_ms"]) > 0 for r in kernels)
    code, waits = query(capsys, str(trace), "--named", "collective-waits")
    assert code == 0 and waits and all(r["ranks"] == "2" and r["collective"].startswith("gloo:") for r in waits)
    assert [float(r["longest_wait_ms"]) for r in waits] == sorted((float(r["longest_wait_ms"]) for r in waits),
                                                                  reverse=True)
    code, gaps = query(capsys, str(trace), "--named", "idle-gaps")
    assert code == 0 and gaps and all(r["cause"].startswith("idle") for r in gaps)


@requires_trace_processor
def test_a_run_directory_is_queried_through_its_merged_trace(merged_trace, capsys, tmp_path):
    from fleetscope.traces.layout import RunLayout
    run = RunLayout.at(tmp_path / "run")
    run.merged_trace.parent.mkdir(parents=True)
    run.merged_trace.write_bytes(merged_trace.read_bytes())
    code, rows = query(capsys, str(run.root), "--named", "top-kernels")
    assert code == 0 and rows
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["query", str(empty), "--named", "top-kernels"]) == 2
    assert "no merged trace there" in capsys.readouterr().err
