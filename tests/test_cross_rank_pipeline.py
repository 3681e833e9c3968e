"""Point-to-point in the analysis: sends and receives are no collectives; a pipeline job's report names its
slowest stage and the bubble per stage, and its merged trace draws send -> receive arrows.

Unit tests on hand-written traces; one real 2-stage gloo job per schedule with a deliberately slow stage.
"""

from __future__ import annotations

import gzip
import json

import pytest
from helpers import REPO, torchrun

from fleetscope.analysis.cross_rank.pipeline import analyze_pipeline, theoretical_bubble
from fleetscope.analysis.inputs.sources import TraceSource
from fleetscope.analysis.per_rank.names import P2P_RECV, P2P_SEND, P2P_UNKNOWN, point_to_point_kind
from fleetscope.analysis.per_rank.rank import analyze_bytes
from fleetscope.traces.formats import p2p_marker, schedule_marker


@pytest.mark.parametrize("name, arg, op, kind", [
    ("gloo:send", None, None, P2P_SEND), ("gloo:recv", None, None, P2P_RECV),
    ("c10d::send", None, None, P2P_SEND), ("c10d::recv_", None, None, P2P_RECV),
    ("gloo:all_reduce", None, None, None), ("c10d::broadcast_", None, None, None),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send", None, P2P_SEND),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", None, "c10d::recv_", P2P_RECV),
    # NCCL runs uneven all-to-alls as SendRecv kernels: the arg or the launching op tells them apart.
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all_to_allv", None, None),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", None, "c10d::alltoall_base_", None),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", None, None, P2P_UNKNOWN),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", None, None, None),
])
def test_point_to_point_is_told_from_collectives(name, arg, op, kind):
    assert point_to_point_kind(name, arg, op) == kind


def test_theoretical_bubble_of_the_schedules():
    assert theoretical_bubble("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved_1f1b", 4, 4) == pytest.approx(1 / 9)  # 2 ranks x 2 stages


def _span(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": float(ts), "dur": float(dur)}


def _stage_trace(rank: int, *, compute_us: float, recv_us: float, markers: bool = True) -> dict:
    """One step of a 2-stage GPipe pipeline with 2 micro-batches, as gloo records it on CPU."""
    peer = 1 - rank
    events = [_span("ProfilerStep#3", 0, 1000, cat="user_annotation"),
              _span(schedule_marker("gpipe", 2, 2, [rank]), 1, 0, cat="user_annotation")]
    t = 10.0
    for direction in ("forward", "backward"):
        for mb in range(2):
            receives = (direction == "forward") == (rank == 1)
            kind = "recv" if receives else "send"
            if receives:
                events += [_span(p2p_marker(kind, direction, mb, peer), t, 0, cat="user_annotation"),
                           _span("c10d::recv_", t + 1, 1), _span("gloo:recv", t + 1, recv_us)]
                t += recv_us + 2
            events.append(_span("pp_forward" if direction == "forward" else "pp_backward", t, compute_us,
                                cat="user_annotation"))
            t += compute_us + 1
            if not receives:
                events += [_span(p2p_marker(kind, direction, mb, peer), t, 0, cat="user_annotation"),
                           _span("c10d::send", t + 1, 1), _span("gloo:send", t + 1, 5)]
                t += 7
    events.append(_span("gloo:all_reduce", 900, 20, tid=2))
    if not markers:
        events = [e for e in events if not e["name"].startswith(("pp_p2p[", "pp_schedule["))]
    return {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}, "baseTimeNanoseconds": 0,
            "traceEvents": events}


def _result(tmp_path, rank: int, **shape):
    path = tmp_path / f"rank{rank}.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_stage_trace(rank, **shape)).encode()))
    return analyze_bytes(TraceSource(path=path, label=path.name, window=0, rank=rank), path.read_bytes())


def test_sends_and_receives_leave_collectives_and_pair_up(tmp_path):
    results = [_result(tmp_path, 0, compute_us=20, recv_us=200), _result(tmp_path, 1, compute_us=150, recv_us=30)]
    for result in results:
        assert [key[1] for key in result.collectives.keys] == ["gloo:all_reduce"]
        assert len(result.p2p.calls) == 4 and all(c.peer == 1 - result.rank for c in result.p2p.calls)
    pipeline = analyze_pipeline(results)
    assert (pipeline.transfers, pipeline.unpaired) == (4, 0)
    assert (pipeline.schedule, pipeline.stages, pipeline.microbatches) == ("gpipe", 2, 2)
    assert pipeline.theoretical_bubble_pct == pytest.approx(100 / 3)
    stage0, stage1 = pipeline.ranks
    assert stage0.bubble_ms == pytest.approx(0.4) and stage0.backward_wait_ms == pytest.approx(0.4)
    assert stage1.forward_wait_ms == pytest.approx(0.06) and stage0.forward_wait_ms == 0
    assert stage1.compute_per_microbatch_ms == pytest.approx(0.3) and stage0.compute_per_microbatch_ms == pytest.approx(0.04)
    assert pipeline.slowest_rank == 1 and pipeline.slowest_stages == [1]
    assert pipeline.verdict.startswith("stage 1 (rank 1) is the slowest pipeline stage")


def test_sends_without_stage_markers_are_still_no_collectives(tmp_path):
    results = [_result(tmp_path, r, compute_us=100, recv_us=50, markers=False) for r in (0, 1)]
    assert all([key[1] for key in r.collectives.keys] == ["gloo:all_reduce"] for r in results)
    pipeline = analyze_pipeline(results)
    assert pipeline.schedule is None and pipeline.transfers == 0 and pipeline.ranks[0].bubble_ms == pytest.approx(0.1)


def test_equal_stages_name_no_slow_stage(tmp_path):
    results = [_result(tmp_path, 0, compute_us=100, recv_us=50), _result(tmp_path, 1, compute_us=100, recv_us=50)]
    pipeline = analyze_pipeline(results)
    assert pipeline.slowest_rank is None and pipeline.verdict.startswith("no pipeline stage is much slower")


SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_cases.py")
SLOW_STAGE_MS = 40.0
"""Sleep per micro-batch forward of the slow stage: two stages sharing a loaded 2-core machine slow each other's
compute by several ms a micro-batch (with 15 ms, 12.2 ms was once seen, 14.2 ms at load 4); 40 ms leaves the
asserted half of it 20 ms clear of that. 5 steps x 4 micro-batches cost 0.8 s a case."""
PROFILED = f"parallel.pp=2,data.batch_size=8,profiler.enabled=true,faults.slow_stage_ms={SLOW_STAGE_MS:g}"
SLOW_CASES = {"slow_stage1_1f1b": f"{PROFILED},parallel.pp_schedule=1f1b,faults.slow_stage=1",
              "slow_stage0_gpipe": f"{PROFILED},parallel.pp_schedule=gpipe,faults.slow_stage=0"}


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("slow_stage")
    completed = torchrun(2, SCRIPT, "--out", str(out), "--families", "qwen3_moe",
                         *[f"--case={name}={overrides}" for name, overrides in SLOW_CASES.items()], timeout=900)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case, slow_rank", [("slow_stage1_1f1b", 1), ("slow_stage0_gpipe", 0)])
def test_report_names_the_slow_stage_and_the_bubble(slow_runs, tmp_path, case, slow_rank):
    from fleetscope.analysis.analyze import analyze

    report = analyze(slow_runs / case / "qwen3_moe", json_out=tmp_path / "report.json")
    (window,) = report.windows
    pipeline = window.pipeline
    # 2 active steps x 4 micro-batches x (activations + gradients)
    assert pipeline.slowest_rank == slow_rank and pipeline.transfers == 16
    assert pipeline.unpaired == 0 and pipeline.theoretical_bubble_pct == pytest.approx(20.0)
    slow, fast = pipeline.ranks[slow_rank], pipeline.ranks[1 - slow_rank]
    # SLOW_STAGE_MS injected per micro-batch forward: the slow stage computes more per micro-batch by about that,
    # and the other stage waits for it in receives about 4 x SLOW_STAGE_MS a step. Contention between the two
    # stages moves the difference by several ms, so what is asserted is what it cannot make: a difference of at
    # least half the injection, in the right direction, and the bubble's order.
    assert slow.compute_per_microbatch_ms - fast.compute_per_microbatch_ms > 0.5 * SLOW_STAGE_MS
    assert fast.bubble_ms > 0.5 * 4 * SLOW_STAGE_MS and fast.bubble_pct > slow.bubble_pct
    assert f"stage {slow_rank} (rank {slow_rank}) is the slowest pipeline stage" in report.verdict
    assert "is the straggler" not in report.verdict
    matched = [i.name for i in window.stragglers.worst_instances]
    assert matched and not any("send" in name or "recv" in name for name in matched)
    from fleetscope.analysis.analyze import load_report_json
    from fleetscope.analysis.render.terminal import render_terminal

    reloaded = load_report_json(tmp_path / "report.json")
    assert reloaded.windows[0].pipeline == pipeline
    assert f"stage {slow_rank} (rank {slow_rank}) is the slowest" in render_terminal(reloaded).split("Pipeline (")[1]


@pytest.mark.slow
def test_merged_trace_draws_send_to_receive_flows(slow_runs, tmp_path):
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2

    from fleetscope.analysis.merge.flows import p2p_flow_id
    from fleetscope.analysis.merge.run import merge

    merge(slow_runs / "slow_stage1_1f1b" / "qwen3_moe", out=tmp_path / "merged.perfetto-trace")
    trace = perfetto_trace_pb2.Trace()
    trace.ParseFromString((tmp_path / "merged.perfetto-trace").read_bytes())
    slices_of: dict[int, int] = {}
    for packet in trace.packet:
        if packet.HasField("track_event"):
            for flow in packet.track_event.flow_ids:
                slices_of[flow] = slices_of.get(flow, 0) + 1
    # Step 2, 1F1B: micro-batch 0's activations go from rank 0 to rank 1 and its gradients come back; each
    # transfer's id is on its send slice and its receive slice (joined in time order).
    for key in ((2, "forward", 0, 0, 1), (2, "backward", 0, 1, 0), (3, "forward", 3, 0, 1)):
        assert slices_of.get(p2p_flow_id(key, 0)) == 2, key
