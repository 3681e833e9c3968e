"""The report's evidence and critical path drawn in the merged trace, checked in Perfetto's own engine on
sets with a known answer: the critical-path slices per rank equal the report's segments, flows cross ranks
where the path does, evidence counters carry the report's values, idle-cause slices the report's causes."""

from __future__ import annotations

import json
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.cross_rank.critical_path import CriticalPaths
from fleetscope.analysis.report.model import lenient_build
from fleetscope.analysis.merge.critical_path_overlays import PATH_TRACK_NAME, rank_path
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.perfetto.sql import run_query
from fleetscope.analysis.merge.run import PROCESS_PID_BASE, merge
from fleetscope.analysis.merge.verify import verify_merge
from fleetscope.analysis.synthetic import LATE_EXTRA_WORK, TraceSetSpec, make_trace_set
from helpers import requires_trace_processor, trace_processor
from test_critical_path import jumping_path_set

GPU = Path(__file__).parent / "fixtures" / "gpu"
EVIDENCE = GPU / "h200-small-evidence"
FIXTURE = GPU / "h200-small-fleetscope-fast-2steps.json.gz"
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
RANK_OF_SLICE = f"""
WITH rank_track AS (
  SELECT pt.id AS track_id, p.pid - {PROCESS_PID_BASE} AS rank, pt.name AS track
  FROM process_track pt JOIN process p USING (upid) WHERE p.name LIKE 'rank %'
)"""


def path_of(section: dict) -> CriticalPaths:
    """The typed critical path the merge reads of a hand-written section (what parses of it)."""
    return lenient_build(CriticalPaths, section, [])


def expected_path_slices(report) -> list[tuple[int, int, str, int, int, int]]:
    """(step, rank, kind, start ns, duration ns, position) of every segment: the path tiles its step from start_ns."""
    expected = []
    for path in report.windows[0].critical_path.steps:
        cursor = path.start_ns
        for position, segment in enumerate(path.segments):
            expected.append((path.step, segment.rank, segment.kind, cursor, round(segment.duration_us * 1000), position))
            cursor += round(segment.duration_us * 1000)
    return expected


def path_rows(trace: Path) -> list[dict[str, str]]:
    return run_query(trace, RANK_OF_SLICE + f"""
SELECT r.rank, s.name AS kind, s.ts, s.dur, EXTRACT_ARG(s.arg_set_id, 'debug.step') AS step,
       EXTRACT_ARG(s.arg_set_id, 'debug.share_pct') AS share_pct,
       EXTRACT_ARG(s.arg_set_id, 'debug.collective') AS collective,
       EXTRACT_ARG(s.arg_set_id, 'debug.waited_for_rank') AS waited_for
FROM slice s JOIN rank_track r USING (track_id) WHERE r.track LIKE '{PATH_TRACK_NAME}%' ORDER BY CAST(step AS INT), s.ts, r.rank""",
                     trace_processor())


def path_flows(trace: Path) -> list[tuple[int, str, int, str]]:
    rows = run_query(trace, RANK_OF_SLICE + f"""
SELECT ro.rank AS from_rank, so.name AS from_kind, ri.rank AS to_rank, si.name AS to_kind
FROM flow f JOIN slice so ON so.id = f.slice_out JOIN slice si ON si.id = f.slice_in
JOIN rank_track ro ON ro.track_id = so.track_id JOIN rank_track ri ON ri.track_id = si.track_id
WHERE ro.track LIKE '{PATH_TRACK_NAME}%' AND ri.track LIKE '{PATH_TRACK_NAME}%' ORDER BY si.ts""", trace_processor())
    return [(int(r["from_rank"]), r["from_kind"], int(r["to_rank"]), r["to_kind"]) for r in rows]


@requires_trace_processor
def test_critical_path_slices_and_flows_follow_the_report_across_ranks(tmp_path):
    traces = jumping_path_set(tmp_path / "set")
    report = analyze(traces, use_hta=False, use_cache=False)
    result = merge(traces, tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    assert verify_merge(result, engine=True) == []
    rows = path_rows(result.output)
    expected = expected_path_slices(report)
    assert len(rows) == len(expected) == 12                                 # 6 segments per step, 2 steps
    for row, (step, rank, kind, start, duration, _) in zip(rows, expected):
        assert (int(row["step"]), int(row["rank"]), row["kind"]) == (step, rank, kind)
        assert abs(int(row["ts"]) - start) <= 1000 and abs(int(row["dur"]) - duration) <= 1000   # within 1 us
    assert Counter(int(r["rank"]) for r in rows) == {1: 6, 2: 4, 0: 2}
    # the path crosses at each step's two all-reduces: from the rank waited for to the one that waited
    assert path_flows(result.output) == [(1, "data movement", 2, "compute"), (2, "data movement", 0, "work")] * 2
    waited = [(int(r["rank"]), r["waited_for"]) for r in rows if r["waited_for"]]
    assert waited == [(2, "1"), (0, "2")] * 2
    shares = defaultdict(float)
    for row in rows:
        shares[row["step"]] += float(row["share_pct"])
    assert all(total == pytest.approx(100.0, abs=0.01) for total in shares.values())


@requires_trace_processor
def test_a_late_rank_holds_the_whole_path_after_clock_alignment(tmp_path):
    """A real H200 step replicated on 4 ranks over 2 hosts whose clocks differ by 700 us; rank 2 runs 2 ms
    of extra work before each all-reduce: the path is all on rank 2, no flow crosses ranks."""
    spec = TraceSetSpec(ranks=4, ranks_per_host=2, host_offsets_us={1: 700.0}, late_rank=2, late_us=2000.0,
                        late_cause=LATE_EXTRA_WORK, inserted_allreduce_us=5000.0)
    make_trace_set(FIXTURE, tmp_path / "set", spec)
    report = analyze(tmp_path / "set", use_hta=False, use_cache=False)
    result = merge(tmp_path / "set", tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    rows = path_rows(result.output)
    expected = expected_path_slices(report)
    assert {int(r["rank"]) for r in rows} == {2} and len(rows) == len(expected) > 0
    for row, (_, _, kind, start, duration, _) in zip(rows, expected):
        assert row["kind"] == kind and abs(int(row["ts"]) - start) <= 1000 and abs(int(row["dur"]) - duration) <= 1000
    assert path_flows(result.output) == []
    # on the merged clock (rank 2's host 700 us ahead, removed) its data movement is its own all-reduce kernel
    kernels = run_query(result.output, RANK_OF_SLICE + f"""
SELECT s.ts, s.dur FROM slice s JOIN rank_track r USING (track_id) WHERE r.rank = 2 AND s.name LIKE '{NCCL}%'
ORDER BY s.ts""", trace_processor())
    movement = [(r["ts"], r["dur"]) for r in rows if r["kind"] == "data movement"]
    assert movement == [(k["ts"], k["dur"]) for k in kernels] and len(movement) == 2


@requires_trace_processor
def test_evidence_counters_and_idle_causes_carry_the_reports_values(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(EVIDENCE, run)
    report = analyze(run, use_hta=False, use_cache=False)
    options = MergeOptions(min_idle_gap_us=0.0)                # every gap drawn, so counts compare exactly
    result = merge(run, tmp_path / "merged.perfetto-trace", report=report, options=options, use_cache=False)
    assert verify_merge(result, engine=True) == []
    rank = report.windows[0].ranks[0]
    counters = run_query(result.output, """
SELECT t.name, c.value FROM counter c JOIN process_counter_track t ON t.id = c.track_id ORDER BY t.name, c.ts""",
                         trace_processor())
    values = defaultdict(list)
    for row in counters:
        values[row["name"]].append(float(row["value"]))
    memory = report.trainer.ranks[0].memory
    drawn = [s.step for s in rank.steps]
    assert values["peak allocated (MiB)"] == pytest.approx([memory.allocated_mb[memory.steps.index(s)] for s in drawn])
    assert values["peak reserved (MiB)"] == pytest.approx([memory.reserved_mb[memory.steps.index(s)] for s in drawn])
    assert values["data loader (ms)"] == pytest.approx([s.data_loader_ms for s in rank.steps])
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics" / "rank0.jsonl").read_text().splitlines())}
    assert values["trainer data (ms)"] == pytest.approx([metrics[s]["data_ms"] for s in drawn])
    assert values["phase forward (ms)"] == pytest.approx([s.phases_ms["forward"] for s in rank.steps])
    assert values["host sync (ms)"] == pytest.approx([s.sync_us / 1000 for s in rank.host_stalls.steps])
    assert values["tensor reads"] == [s.tensor_reads for s in rank.host_stalls.steps]
    idle = run_query(result.output, """
SELECT SUBSTR(s.name, 7) AS cause, COUNT(*) AS gaps, SUM(s.dur) AS ns FROM slice s JOIN track t ON t.id = s.track_id
WHERE t.name = 'fleetscope analysis' AND s.name LIKE 'idle: %' GROUP BY s.name""", trace_processor())
    by_cause = {r["cause"]: (int(r["gaps"]), int(r["ns"])) for r in idle}
    assert {c: n for c, (n, _) in by_cause.items()} == rank.host_stalls.idle_gaps_by_cause
    for cause, (gaps, ns) in by_cause.items():
        assert ns / 1000 == pytest.approx(rank.host_stalls.idle_by_cause_us[cause], abs=gaps * 0.001 + 1e-6)
    marks = run_query(result.output, """
SELECT COUNT(*) AS n FROM slice s JOIN track t ON t.id = s.track_id
WHERE t.name = 'fleetscope analysis' AND s.name LIKE 'host sync: %' AND s.dur = 0""", trace_processor())
    assert int(marks[0]["n"]) == sum(s.sync_count + s.tensor_reads for s in rank.host_stalls.steps) > 0


def test_a_report_without_the_data_draws_nothing_and_does_not_fail(tmp_path):
    traces = jumping_path_set(tmp_path / "set")
    report = analyze(traces, use_hta=False, use_cache=False).to_json()
    for window in report["windows"]:
        window["critical_path"] = {"steps": [
            {"step": 0, "segments": [{"rank": "x"}]}, "junk", {"step": True},
            {"step": 1, "start_ns": 2**70, "segments": [{"rank": 0, "kind": "work", "duration_us": 1.0}]},
            {"step": 2, "start_ns": 5, "segments": [{"rank": 0, "kind": "work", "duration_us": 1e300}]}]}
        for rank in window["ranks"]:
            rank["steps"] = [{"step": 0, "data_loader_ms": "slow", "phases_ms": [1]}, 7]
            rank["host_stalls"] = {"steps": "none"}
    report["trainer"] = {"ranks": [{"rank": 0, "memory": {"steps": [0], "allocated_mb": [1.0, 2.0]}}]}
    result = merge(traces, tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    assert verify_merge(result) == [] and not result.problems
    check = check_trace(result.output)
    names = {t.name for t in check.tracks.values()}
    assert PATH_TRACK_NAME not in names and "data loader (ms)" not in names and "peak allocated (MiB)" not in names
    assert "fleetscope analysis" in names
    shares = rank_path(path_of({"steps": [{"step": 3, "length_us": 2.0, "start_ns": 10, "segments": [
        {"rank": 0, "kind": "work", "collective": "", "start_us": 0.0, "duration_us": 2.0, "share": float("nan")}]}]}),
        rank=0, window_key=0, report_offset_ns=0)
    assert [(s.start_ns, s.end_ns, s.annotations["share_pct"]) for s in shares.slices] == [(10, 2010, 0.0)]


def test_the_path_moves_with_the_clock_offset_the_merge_removes():
    """Segments are on the report's clock; a merge that removes another offset from a rank moves them with
    that rank's events."""
    section = {"steps": [{"step": 4, "start_ns": 10_000, "length_us": 3.0, "segments": [
        {"kind": "compute", "rank": 1, "collective": "c #0", "start_us": 0.0, "duration_us": 1.0, "share": 1 / 3},
        {"kind": "data movement", "rank": 1, "collective": "c #0", "start_us": 1.0, "duration_us": 1.0, "share": 1 / 3},
        {"kind": "work", "rank": 0, "collective": "c #0", "start_us": 2.0, "duration_us": 1.0, "share": 1 / 3}]}]}
    rank1 = rank_path(path_of(section), rank=1, window_key=0, report_offset_ns=500)
    rank0 = rank_path(path_of(section), rank=0, window_key=0, report_offset_ns=0)
    assert [(s.start_ns, s.end_ns, s.kind) for s in rank1.slices] == [(10_000, 11_000, "compute"),
                                                                      (11_000, 12_000, "data movement")]
    assert rank1.slices[1].flows_out == rank0.slices[0].flows_in and len(rank0.slices[0].flows_in) == 1
    assert rank0.slices[0].annotations["waited_for_rank"] == 1 and rank1.report_offset_ns == 500
    assert rank_path(path_of({"steps": [{"step": 4, "length_us": 0.0, "segments": []}]}), rank=0, window_key=0,
                     report_offset_ns=0) is None
    assert json.dumps(rank0.slices[0].annotations)


@requires_trace_processor
def test_each_collective_carries_its_bandwidth_and_a_slow_one_is_marked(tmp_path):
    """Two ranks, a 96 MiB all-reduce per step moving 400 us after the last arrival (test_analysis_bandwidth):
    every rank marks both instances with the report's figures; on a 1000 GB/s link they are slow."""
    from test_analysis_bandwidth import NELEMS, nccl_rank
    for rank in (0, 1):
        nccl_rank(rank).write(tmp_path / "set" / f"rank{rank}.json.gz")
    for peak, slow in ((None, False), (1000.0, True)):
        report = analyze(tmp_path / "set", use_hta=False, use_cache=False, link_peak_gbps=peak)
        out = tmp_path / f"merged-{peak}.perfetto-trace"
        merge(tmp_path / "set", out, report=report, use_cache=False)
        rows = run_query(out, RANK_OF_SLICE + """
SELECT r.rank, s.name, s.ts, EXTRACT_ARG(s.arg_set_id, 'debug.busbw_gbps') AS busbw,
       EXTRACT_ARG(s.arg_set_id, 'debug.peak_pct') AS peak_pct, EXTRACT_ARG(s.arg_set_id, 'debug.bytes') AS bytes,
       EXTRACT_ARG(s.arg_set_id, 'debug.verdict') AS verdict
FROM slice s JOIN rank_track r USING (track_id)
WHERE s.name LIKE 'bandwidth: %' OR s.name LIKE 'slow collective: %' ORDER BY r.rank, s.ts, s.name""",
                         trace_processor())
        instances = report.windows[0].bandwidth.instances
        marks = [r for r in rows if r["name"].startswith("bandwidth: ")]
        assert [r["rank"] for r in marks] == ["0", "0", "1", "1"]
        for row, instance in zip(marks, instances * 2):
            assert row["name"] == "bandwidth: all_reduce 64 MiB-256 MiB"
            assert float(row["busbw"]) == pytest.approx(instance.busbw_gbps, rel=1e-6)
            assert float(row["peak_pct"]) == pytest.approx(instance.peak_pct, rel=1e-6)
            assert float(row["bytes"]) == NELEMS * 2
        slow_marks = [r for r in rows if r["name"].startswith("slow collective: ")]
        assert len(slow_marks) == (4 if slow else 0)
        assert all("25% of bus peak" in r["verdict"] for r in slow_marks)


@requires_trace_processor
def test_the_shipped_query_lists_the_path_and_verify_catches_a_broken_one(tmp_path, capsys):
    from fleetscope.analysis.merge.verify import critical_path_problems
    from fleetscope.cli.main import main
    traces = jumping_path_set(tmp_path / "set")
    report = analyze(traces, use_hta=False, use_cache=False)
    result = merge(traces, tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    capsys.readouterr()
    assert main(["query", str(result.output), "--named", "critical-path"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("data movement") == 4 and printed.count("compute") == 4
    assert critical_path_problems(check_trace(result.output)) == []


@pytest.mark.damaged_trace
def test_verify_says_when_given_clock_offsets_move_a_rank_off_the_path(tmp_path):
    """Offsets other than the report's move rank 2's segments (with its events) off the chain: verify says
    so (the engine check of this test's traces is skipped: that trace fails it on purpose)."""
    from fleetscope.analysis.merge.verify import critical_path_problems
    traces = jumping_path_set(tmp_path / "set")
    report = analyze(traces, use_hta=False, use_cache=False)
    moved = merge(traces, tmp_path / "moved.perfetto-trace", report=report, use_cache=False,
                  offsets_ns={0: 0, 1: 0, 2: 300_000})
    problems = critical_path_problems(check_trace(moved.output))
    assert {p.split(":")[0] for p in problems} == {"critical path of step 0", "critical path of step 1"}
    assert all("rank 2 (" in p and "clock offsets other than the report's" in p for p in problems)
    assert check_trace(moved.output).problems == []          # the file itself is sound
    assert verify_merge(moved) == []                          # given offsets: the chain is not expected


@pytest.mark.damaged_trace
def test_the_read_back_refuses_a_counter_value_that_is_not_finite(tmp_path):
    from fleetscope.analysis.merge.perfetto.writer import PacketStream, SequenceWriter, TrackSpec, write_preamble
    path = tmp_path / "nan.perfetto-trace"
    with open(path, "wb") as handle:
        stream = PacketStream(handle)
        write_preamble(stream, sequence_id=1, first_timestamp_ns=1000)
        writer = SequenceWriter(stream=stream, sequence_id=2)
        writer.track(TrackSpec(uuid=1 << 32, name="rank 0 (n0)", pid=PROCESS_PID_BASE))
        writer.track(TrackSpec(uuid=(1 << 32) | 1, name="host sync (ms)", parent_uuid=1 << 32, is_counter=True,
                               counter_unit="ms"))
        for ts, value in ((1000, 1.0), (2000, float("nan")), (3000, float("inf"))):
            writer.counter(ts, (1 << 32) | 1, value)
        stream.flush()
    assert check_trace(path).problems == [f"counter track {(1 << 32) | 1}: 2 values not finite (first at 2000)"]


def expected_crossings(report) -> list[tuple[int, str, int, str]]:
    """(rank waited for, its segment, waiting rank, its segment) wherever consecutive segments change rank."""
    crossings = []
    for path in report.windows[0].critical_path.steps:
        for before, after in zip(path.segments, path.segments[1:]):
            if before.rank != after.rank:
                crossings.append((before.rank, before.kind, after.rank, after.kind))
    return crossings


@requires_trace_processor
def test_the_path_of_a_real_two_rank_ddp_run_is_drawn_as_the_report_has_it(tmp_path):
    """A real DDP run on the H200 host (2 ranks, gloo): the path crosses ranks at gloo collectives."""
    run = tmp_path / "run"
    shutil.copytree(GPU / "h200-ddp-gloo-2rank", run)
    report = analyze(run, use_hta=False, use_cache=False)
    result = merge(run, tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    assert verify_merge(result, engine=True) == []
    rows, expected = path_rows(result.output), expected_path_slices(report)
    assert len(rows) == len(expected) > 0
    for row, (step, rank, kind, start, duration, _) in zip(rows, expected):
        assert (int(row["step"]), int(row["rank"]), row["kind"]) == (step, rank, kind)
        assert abs(int(row["ts"]) - start) <= 1000 and abs(int(row["dur"]) - duration) <= 1000
    crossings = expected_crossings(report)
    assert crossings and sorted(path_flows(result.output)) == sorted(crossings)
    # every rank has its own evidence counters, with its own report values
    counters = run_query(result.output, f"""
SELECT p.pid - {PROCESS_PID_BASE} AS rank, t.name, c.value FROM counter c
JOIN process_counter_track t ON t.id = c.track_id JOIN process p USING (upid) ORDER BY rank, t.name, c.ts""",
                         trace_processor())
    values = defaultdict(list)
    for row in counters:
        values[(int(row["rank"]), row["name"])].append(float(row["value"]))
    for records in report.trainer.ranks:
        rank_report = next(r for r in report.windows[0].ranks if r.rank == records.rank)
        drawn = [s.step for s in rank_report.steps]
        memory = records.memory
        assert values[(records.rank, "peak allocated (MiB)")] == pytest.approx(
            [memory.allocated_mb[memory.steps.index(s)] for s in drawn])
        assert values[(records.rank, "host sync (ms)")] == pytest.approx(
            [s.sync_us / 1000 for s in rank_report.host_stalls.steps])
    assert {r.rank for r in report.trainer.ranks} == {0, 1}
