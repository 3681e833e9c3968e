"""Flows, overlays, options and the Chrome JSON of the merged trace, on hand-made Kineto traces."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from fleetscope.traces.clock import ClockOffset, write_clock_offset

from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.inputs.resolve import resolve_input
from fleetscope.analysis.per_rank.parse import parse_traces
from fleetscope.analysis.merge.run import PROCESS_PID_BASE, merge
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.check import CROSS_RANK_FLOW_BIT, check_trace
from test_merge import (
    BASE_NS, complete, expected_slices, gpu_rank_events, kernel, kineto_document, rebuilt_slices,
    write_trace,
)


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    """Rank 1 reaches the step and its collective 7.5 us after rank 0 (2 us of base time, 5.5 us of ts)."""
    directory = tmp_path / "traces"
    write_trace(directory / "rank0.json", kineto_document(0, gpu_rank_events(), host="node0"))
    write_trace(directory / "rank1.json", kineto_document(1, gpu_rank_events(shift_us=5.5), host="node1",
                                                          base_ns=BASE_NS + 2_000))
    return directory


def slice_named(check, process: str, name: str):
    found = [s for s in check.slices if s.name == name and check.process_of(s.track_uuid).name == process]
    assert len(found) == 1, (name, found)
    return found[0]


def key(check, process: str, name: str) -> tuple:
    item = slice_named(check, process, name)
    return (item.track_uuid, item.start_ns, item.name)


def test_cpu_launch_flows_to_its_kernel_and_trace_flows_are_kept(traces, tmp_path):
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace").output)
    assert check.ok, check.problems
    local = {(a, b) for flow_id, a, b in check.arrows if not flow_id & CROSS_RANK_FLOW_BIT}
    rank0 = "rank 0 (node0)"
    assert (key(check, rank0, "cudaLaunchKernel"), key(check, rank0, "sm90_gemm")) in local
    assert (key(check, rank0, "aten::mm"), key(check, rank0, "backward")) in local
    # two ranks x (one launch flow + one fwdbwd flow); Kineto's ac2g pair repeats the launch flow
    assert len(local) == 4


def test_the_same_collective_on_both_ranks_is_joined_in_arrival_order(traces, tmp_path):
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace").output)
    cross = [(a, b) for flow_id, a, b in check.arrows if flow_id & CROSS_RANK_FLOW_BIT]
    nccl = "ncclDevKernel_AllReduce"
    assert cross == [(key(check, "rank 0 (node0)", nccl), key(check, "rank 1 (node1)", nccl))]


def test_collective_flows_can_be_turned_off(traces, tmp_path):
    options = MergeOptions(collective_flows=False, flows=False)
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace", options=options).output)
    assert check.arrows == [] and check.ok


def test_analysis_track_has_steps_idle_gaps_and_counters(traces, tmp_path):
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace").output)
    rank0 = check.processes()[0]
    analysis = [s for s in check.slices if check.tracks[s.track_uuid].name == "fleetscope analysis"
                and check.process_of(s.track_uuid).uuid == rank0.uuid]
    step = next(s for s in analysis if s.name == "step 3")
    assert (step.start_ns, step.end_ns) == (BASE_NS, BASE_NS + 1_000_000)
    # GPU busy: [30, 90] and [95, 395] us; every gap is drawn by default (the report's idle by cause)
    assert [(s.name, s.start_ns - BASE_NS, s.end_ns - BASE_NS) for s in analysis if s.name.startswith("idle")] == [
        ("idle: host busy elsewhere", 0, 30_000), ("idle: short gaps", 90_000, 95_000),
        ("idle: host busy elsewhere", 395_000, 1_000_000)]
    # with min_idle_gap_us 50 the 30 us and 5 us gaps are counted (idle %) but not drawn
    short = check_trace(merge(traces, tmp_path / "short.perfetto-trace", options=MergeOptions(min_idle_gap_us=50)).output)
    assert [(s.name, s.start_ns - BASE_NS) for s in short.slices if s.name.startswith("idle")
            and short.process_of(s.track_uuid).uuid == short.processes()[0].uuid] == [
        ("idle: host busy elsewhere", 395_000)]
    assert step.annotations["idle_pct"] == pytest.approx(64.0)
    assert step.annotations["idle_basis"] == "gpu"
    counters = {t.name: check.counter_values[t.uuid] for t in check.tracks.values()
                if t.is_counter and t.parent_uuid == rank0.uuid}
    assert counters["step time (ms)"] == [(BASE_NS, 1.0)]
    assert counters["idle (%)"] == [(BASE_NS, pytest.approx(64.0))]


def test_idle_gaps_carry_the_analysis_causes(tmp_path):
    """The merge draws the per-rank analysis's gaps and causes (host_stalls.find_idle_gaps), no rule of its own."""
    events = [
        complete("ProfilerStep#0", 0, 200, cat="user_annotation"),
        complete("cudaLaunchKernel", 0, 1, cat="cuda_runtime", args={"correlation": 1}),  # not after its kernel
        complete("cudaLaunchKernel", 2, 1, cat="cuda_runtime", args={"correlation": 3}),
        complete("cudaLaunchKernel", 50, 5, cat="cuda_runtime", args={"correlation": 2}),
        kernel("a", 0, 10, correlation=1),
        kernel("b", 60, 10, correlation=2),    # launched at 50..55, after the GPU went idle at 10
        kernel("c", 130, 10, correlation=3),   # launched long before: waited on something else
    ]
    write_trace(tmp_path / "t" / "rank0.json", kineto_document(0, events))
    check = check_trace(merge(tmp_path / "t", tmp_path / "out.perfetto-trace").output)
    gaps = [(s.name, (s.start_ns - BASE_NS) // 1000) for s in check.slices if s.name.startswith("idle")]
    assert gaps == [("idle: host busy elsewhere", 10), ("idle: device dependency", 70),
                    ("idle: host busy elsewhere", 140)]
    stalls = analyze(tmp_path / "t", use_hta=False, use_cache=False).windows[0].ranks[0].host_stalls
    assert stalls.idle_gaps_by_cause == {"host busy elsewhere": 2, "device dependency": 1}


def test_report_marks_the_straggler_at_its_collective(traces, tmp_path):
    report = {
        "verdict": "the others wait for rank 1 at collectives.",
        "ranks": [{"rank": 1, "host": "node1", "windows": 1, "span_us": 100.0, "busy_pct": 40.0, "idle_pct": 60.0,
                   "step_time": {"mean_ms": 1.0}}],
        "windows": [{"window": 0, "ranks": [{}, {}], "stragglers": {
            "verdict": "rank 1 is last at 1 of 1 collectives", "waited_for_rank": 1, "slowest_rank": 1,
            "min_lateness_us": 5.0, "by_wait": [{"rank": 1, "collectives": 1, "times_last": 1, "last_pct": 100.0, "caused_wait_us": 7.5,
                         "waited_us": 0.0, "score": 1.0}],
            "worst_instances": [{"step": 3, "name": "nccl:AllReduce", "ordinal": 0, "last_rank": 1,
                                 "lateness_us": 7.5, "participants": 2, "extra_compute_us": 0.0,
                                 "arrival_spread_us": 7.5, "end_spread_us": 0.0}]}}],
    }
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace", report=report).output)
    marks = {(check.process_of(i.track_uuid).name, i.name): i for i in check.instants
             if check.tracks[i.track_uuid].name == "fleetscope analysis"}
    late = marks[("rank 1 (node1)", "arrived last: nccl:AllReduce (step 3 #0)")]
    assert late.ts_ns == slice_named(check, "rank 1 (node1)", "ncclDevKernel_AllReduce").start_ns
    assert late.annotations["lateness_us"] == 7.5
    waited = marks[("rank 1 (node1)", "straggler: the others wait for this rank")]
    assert waited.annotations["verdict"] == "rank 1 is last at 1 of 1 collectives"
    summary = marks[("rank 1 (node1)", "rank summary")]
    assert summary.annotations["verdict"] == report["verdict"] and summary.annotations["idle_pct"] == 60.0
    assert not any(process == "rank 0 (node0)" and name != "rank summary" for process, name in marks)


def test_python_functions_can_be_dropped(traces, tmp_path):
    result = merge(traces, tmp_path / "out.perfetto-trace", options=MergeOptions(drop_python_functions=True))
    names = {s.name for s in check_trace(result.output).slices}
    assert "python_a" not in names and "aten::mm" in names
    assert [s.filtered_count for s in result.per_rank] == [2, 2]
    assert result.slices_per_rank[0] == sum(expected_slices(kineto_document(0, gpu_rank_events())).values()) - 2


def two_step_events() -> list[dict]:
    return [
        complete("ProfilerStep#7", 0, 100, cat="user_annotation"),
        complete("aten::a", 10, 20),
        complete("ProfilerStep#8", 100, 100, cat="user_annotation"),
        complete("aten::b", 110, 20),
        complete("aten::c", 95, 10),  # crosses the boundary: overlaps both steps
    ]


def test_steps_option_keeps_only_events_of_those_steps(tmp_path):
    write_trace(tmp_path / "t" / "rank0.json", kineto_document(0, two_step_events()))
    result = merge(tmp_path / "t", tmp_path / "out.perfetto-trace", options=MergeOptions(steps=frozenset({8})))
    check = check_trace(result.output)
    assert sorted(rebuilt_slices(check, "rank 0 (node0)")) == sorted([
        ("ProfilerStep#8", BASE_NS + 100_000, BASE_NS + 200_000), ("aten::b", BASE_NS + 110_000, BASE_NS + 130_000),
        ("aten::c", BASE_NS + 95_000, BASE_NS + 105_000)])
    assert [s.name for s in check.slices if s.name.startswith("step ")] == ["step 8"]
    assert result.per_rank[0].filtered_count == 2


def test_time_window_counts_from_the_first_event(tmp_path):
    write_trace(tmp_path / "t" / "rank0.json", kineto_document(0, two_step_events()))
    options = MergeOptions(time_window_s=(105e-6, 125e-6), overlays=False)
    check = check_trace(merge(tmp_path / "t", tmp_path / "out.perfetto-trace", options=options).output)
    assert sorted(s.name for s in check.slices) == ["ProfilerStep#8", "aten::b"]


def test_event_args_become_debug_annotations_when_asked(traces, tmp_path):
    plain = check_trace(merge(traces, tmp_path / "a.perfetto-trace").output)
    with_args = check_trace(merge(traces, tmp_path / "b.perfetto-trace", options=MergeOptions(event_args=True)).output)
    assert slice_named(plain, "rank 0 (node0)", "sm90_gemm").annotations is None
    assert slice_named(with_args, "rank 0 (node0)", "sm90_gemm").annotations == {
        "device": 0, "stream": 7, "correlation": 11}


def load_json(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.name.endswith(".gz") else data)


def test_chrome_json_has_the_same_events_on_the_same_clock(traces, tmp_path):
    json_path = tmp_path / "merged.trace.json.gz"
    result = merge(traces, tmp_path / "out.perfetto-trace", options=MergeOptions(chrome_json=json_path))
    assert result.chrome_json == json_path
    document = load_json(json_path)
    base = document["baseTimeNanoseconds"]
    events = document["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert processes == {PROCESS_PID_BASE: "rank 0 (node0)", PROCESS_PID_BASE + 1: "rank 1 (node1)"}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    for rank, pid in ((0, PROCESS_PID_BASE), (1, PROCESS_PID_BASE + 1)):
        source = kineto_document(rank, gpu_rank_events(shift_us=5.5 * rank), base_ns=BASE_NS + 2_000 * rank)
        found = Counter((e["name"], base + round(e["ts"] * 1000), base + round((e["ts"] + e["dur"]) * 1000))
                        for e in events if e.get("ph") == "X" and e["pid"] == pid
                        and thread_names[(pid, e["tid"])] != "fleetscope analysis")
        assert found == expected_slices(source)
    flows = Counter(e["ph"] for e in events if e.get("ph") in ("s", "f"))
    assert flows == {"s": 4, "f": 4}
    assert result.chrome_json_uncompressed_bytes > result.output_bytes


def test_run_directory_report_json_is_used_by_default(tmp_path):
    from fleetscope.traces.layout import RunLayout

    layout = RunLayout.at(tmp_path / "run")
    for rank in (0, 1):
        write_trace(layout.trace_file(0, rank, "h"), kineto_document(rank, gpu_rank_events(), host="h"))
    layout.report_dir.mkdir(parents=True)
    layout.report_json.write_text(json.dumps({"verdict": "all fine", "ranks": [{"rank": 0, "windows": 1, "span_us": 1.0}],
                                              "windows": []}))
    check = check_trace(merge(layout.root).output)
    summaries = [i for i in check.instants if i.name == "rank summary"]
    assert [i.annotations["verdict"] for i in summaries] == ["all fine"]


def test_clock_offsets_the_report_used_win_over_clock_files_but_not_over_given_ones(tmp_path):
    from fleetscope.traces.layout import RunLayout

    layout = RunLayout.at(tmp_path / "run")
    for rank in (0, 1):
        write_trace(layout.trace_file(0, rank, "h"), kineto_document(rank, gpu_rank_events(), host="h"))
    layout.clock_dir.mkdir(parents=True)
    write_clock_offset(ClockOffset(rank=1, offset_us=3.0, uncertainty_us=1.0, best_round_trip_us=2.0, round_trips=16,
                                   host="node1", measured_at_ns=0), layout.clock_file(1))
    report = {"windows": [{"window": 0, "clock": {"hosts": [{"host": "h", "ranks": [1], "offset_us": 2.5}]}}]}

    def clock_of_rank1(**kwargs) -> tuple[int, str, int]:
        result = merge(layout.root, tmp_path / "out.perfetto-trace", **kwargs)
        summary = result.per_rank[1]
        return summary.clock_offset_ns, summary.clock_source, summary.first_timestamp_ns

    assert clock_of_rank1()[:2] == (3_000, "clock file")
    assert clock_of_rank1(report=report)[:2] == (2_500, "analysis report")
    assert clock_of_rank1(report=report, offsets_ns={1: 100})[:2] == (100, "given")
    assert clock_of_rank1(report=report)[2] == BASE_NS - 2_500


def test_worker_processes_write_the_same_trace_and_json(tmp_path):
    directory = tmp_path / "four"
    for rank in range(4):
        write_trace(directory / f"rank{rank}.json",
                    kineto_document(rank, gpu_rank_events(shift_us=1.5 * rank), host=f"n{rank}", world_size=4))
    outputs = {}
    for workers in (1, 3):
        result = merge(directory, tmp_path / f"w{workers}.perfetto-trace",
                       options=MergeOptions(workers=workers, chrome_json=tmp_path / f"w{workers}.trace.json.gz",
                                            time_window_s=(0, 1)))
        outputs[workers] = (result.output.read_bytes(), load_json(result.chrome_json), result.slices_per_rank)
    assert outputs[1] == outputs[3] and len(outputs[3][2]) == 4
    assert check_trace(tmp_path / "w3.perfetto-trace").ok
    assert not list(tmp_path.glob(".*part"))


def _kill_a_worker_once_started(workers: int, killed: list[int]) -> threading.Thread:
    """A thread that SIGKILLs one of this process's pool workers (as the out-of-memory killer would) once
    `workers` of them run: a kill while the pool is still spawning one races CPython's own start-up handshake,
    which is not what a worker killed at work looks like."""
    def kill():
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            try:
                children = [c for c in multiprocessing.active_children() if c.pid]
            except RuntimeError:  # the pool changed its children while they were listed
                continue
            if len(children) >= workers:
                os.kill(children[0].pid, signal.SIGKILL)
                killed.append(children[0].pid)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def _four_ranks(directory: Path) -> Path:
    for rank in range(4):
        write_trace(directory / f"rank{rank}.json",
                    kineto_document(rank, gpu_rank_events(shift_us=1.5 * rank), host=f"n{rank}", world_size=4))
    return directory


def test_a_killed_merge_worker_costs_a_second_pool_not_the_merged_trace(tmp_path):
    """The ranks a killed merge worker had not delivered are merged again: the trace is the one an undisturbed
    merge writes, and a note says so."""
    directory = _four_ranks(tmp_path / "four")
    options = dict(workers=2, time_window_s=(0, 1))
    # the first merge also fills the parsed-trace cache: the second starts no parse workers, only merge ones
    undisturbed = merge(directory, tmp_path / "calm.perfetto-trace", options=MergeOptions(**options))
    killed: list[int] = []
    killer = _kill_a_worker_once_started(options["workers"], killed)
    result = merge(directory, tmp_path / "killed.perfetto-trace", options=MergeOptions(**options))
    killer.join()
    assert killed, "no worker process was seen"
    assert result.output.read_bytes() == undisturbed.output.read_bytes()
    assert any("merge worker process ended unexpectedly" in note.reason for note in result.notes)
    assert not list(tmp_path.glob(".*part"))


def test_a_killed_parse_worker_costs_a_second_pool_not_the_ranks(tmp_path):
    """A parse worker killed mid-analysis: every trace is still parsed, to the same results."""
    directory = _four_ranks(tmp_path / "four")
    calm = parse_traces(resolve_input(directory).sources, cache=None, workers=2, fresh_workers=True)
    killed: list[int] = []
    killer = _kill_a_worker_once_started(2, killed)
    disturbed = parse_traces(resolve_input(directory).sources, cache=None, workers=2, fresh_workers=True)
    killer.join()
    assert killed, "no worker process was seen"
    assert [r.rank for r in disturbed] == [0, 1, 2, 3]
    assert [(r.steps, r.event_count) for r in disturbed] == [(r.steps, r.event_count) for r in calm]


def test_a_malformed_report_is_ignored_not_fatal(traces, tmp_path):
    report = {"verdict": 3, "ranks": "x", "windows": [None, {"window": 0, "stragglers": [], "clock": {"hosts": [7]}}]}
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace", report=report).output)
    assert check.ok and not [i for i in check.instants if i.name.startswith(("straggler", "arrived"))]
    bad_file = tmp_path / "report.json"
    bad_file.write_text("{not json")
    result = merge(traces, tmp_path / "out.perfetto-trace", report=bad_file)
    assert any("analysis report not used" in p.reason for p in result.problems)


def test_old_and_new_nccl_kernel_names_are_the_same_collective(tmp_path):
    names = {0: "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", 1: "ncclDevKernel_AllReduce_Sum_f32_RING_LL"}
    for rank, name in names.items():
        events = [complete("ProfilerStep#1", 0, 500, cat="user_annotation"), kernel(name, 10 + rank, 100, stream=20)]
        write_trace(tmp_path / "t" / f"rank{rank}.json", kineto_document(rank, events))
    check = check_trace(merge(tmp_path / "t", tmp_path / "out.perfetto-trace").output)
    cross = [(a[2], b[2]) for flow_id, a, b in check.arrows if flow_id & CROSS_RANK_FLOW_BIT]
    assert cross == [(names[0], names[1])]
