"""Exact numbers on hand-built traces: steps, busy/idle/comm/overlap, collectives, stragglers."""

import pytest

from fleetscope.analysis.per_rank.collectives import SOURCE_GLOO, SOURCE_NCCL, find_collectives
from fleetscope.analysis.per_rank.events import extract_events
from fleetscope.analysis.per_rank.names import collective_name, is_comm_kernel
from fleetscope.analysis.per_rank.parse import analyze_trace
from fleetscope.analysis.inputs.sources import TraceSource
from fleetscope.analysis.per_rank.rank import RANK_FROM_TRACE
from fleetscope.analysis.per_rank.steps import find_steps
from fleetscope.analysis.cross_rank.arrivals import arrival_matrix
from fleetscope.analysis.cross_rank.stragglers import find_stragglers
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, CAUSE_SLOW_DEVICE, CAUSE_WORK, find_causes
from fleetscope.analysis.cross_rank.clock_align import ClockAlignment
from fleetscope.analysis.per_rank.utilization import measure_utilization
from helpers.kineto import RUNLOOP_TID, KinetoBuilder, gpu_rank


def _utilization(builder: KinetoBuilder):
    events = extract_events(builder.document())
    steps, _ = find_steps(events)
    return measure_utilization(events, steps)


def test_gpu_utilization_exact():
    u = _utilization(gpu_rank(0, nccl_start=600))
    assert u.basis == "gpu"
    assert u.span_us == 2000
    assert u.compute_us == 1100      # (300 + 250) per step
    assert u.comm_us == 600          # 600-900 per step
    assert u.memory_us == 60
    assert u.busy_us == 1560         # 100-400, 450-900, 950-980 per step
    assert u.idle_us == 440
    assert u.overlap_us == 200       # 600-700 per step
    assert u.exposed_comm_us == 400
    assert u.overlap_pct == pytest.approx(100 / 3)
    assert u.busy_pct == pytest.approx(78.0)


def test_gpu_span_extends_to_work_the_last_step_queued():
    builder = gpu_rank(0)
    builder.kernel("late_gemm", 1990.0, 110.0, launch_ts=1980.0)   # runs past the last step's end
    u = _utilization(builder)
    assert u.span_us == 2100
    assert u.compute_us == 1100 + 110


def test_cpu_utilization_exact():
    builder = KinetoBuilder(backend="gloo").step(1, 0, 1000)
    builder.op("aten::mm", 100, 300)
    builder.op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 450, 250)
    builder.op("c10d::allreduce_", 500, 20)            # issued from inside the autograd op
    builder.gloo(520, 280)                               # in flight on the runloop thread
    u = _utilization(builder)
    assert u.basis == "cpu"
    assert u.span_us == 1000
    assert u.compute_us == 300 + 230                     # the c10d op is cut out of the autograd op
    assert u.comm_us == 300                              # 500-800
    assert u.overlap_us == 180                           # 520-700
    assert u.overlap_pct == pytest.approx(60.0)
    assert u.busy_us == 650
    assert u.idle_us == 350
    assert u.memory_us == 0


def test_no_ops_means_no_utilization():
    assert _utilization(KinetoBuilder()) is None


def test_steps_and_phases_from_profiler_steps():
    events = extract_events(gpu_rank(0).document())
    steps, source = find_steps(events)
    assert source == "ProfilerStep"
    assert [s.step for s in steps] == [1, 2]
    assert [s.step_time_ms for s in steps] == [1.0, 1.0]
    assert steps[0].phases_ms == {"train_step": 0.98, "forward": 0.3, "backward": 0.5}


def test_steps_fall_back_to_train_step_ranges():
    builder = KinetoBuilder().annotation("train_step", 0, 2000).annotation("train_step", 2500, 3000)
    steps, source = find_steps(extract_events(builder.document()))
    assert source == "train_step"
    assert [(s.step, s.step_time_ms) for s in steps] == [(0, 2.0), (1, 3.0)]


def test_negative_durations_and_bad_times_are_dropped_and_counted():
    builder = KinetoBuilder().step(1, 0, 100).op("aten::mm", 10, -5).op("aten::add", 10, 5)
    builder.events.append({"ph": "X", "cat": "cpu_op", "name": "x", "pid": 1, "tid": 1, "ts": "soon", "dur": 1})
    events = extract_events(builder.document())
    assert events.dropped == {"negative duration": 1, "missing or non-numeric ts/dur": 1}
    assert len(events) == 2


@pytest.mark.parametrize("name, expected", [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl:AllReduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "nccl:AllReduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl:AllGather"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "nccl:SendRecv"),
    ("gloo:all_reduce", "gloo:all_reduce"),
])
def test_collective_names_match_old_and_new_nccl(name, expected):
    assert collective_name(name) == expected


def test_comm_kernels_old_and_new_names():
    assert is_comm_kernel("ncclKernel_AllReduce_RING_LL_Sum_float")
    assert is_comm_kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL")
    assert not is_comm_kernel("sm90_xmma_gemm_bf16")


def test_gpu_collectives_are_keyed_by_launching_step():
    builder = gpu_rank(0)
    # launched at the end of step 2 but running after it: still step 2's collective
    builder.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2050, 100, launch_ts=1990, stream=20)
    events = extract_events(builder.document())
    steps, _ = find_steps(events)
    calls = find_collectives(events, steps)
    assert calls.source == SOURCE_NCCL
    assert calls.keys == [(1, "nccl:AllReduce", 0), (2, "nccl:AllReduce", 0), (2, "nccl:AllReduce", 1)]


def test_gloo_collectives_come_from_runloop_spans():
    builder = KinetoBuilder(backend="gloo").step(1, 0, 1000).op("c10d::allreduce_", 100, 10)
    builder.gloo(110, 200).gloo(400, 100, tid=RUNLOOP_TID + 1)
    events = extract_events(builder.document())
    calls = find_collectives(events, find_steps(events)[0])
    assert calls.source == SOURCE_GLOO
    assert calls.keys == [(1, "gloo:all_reduce", 0), (1, "gloo:all_reduce", 1)]
    assert calls.start_us.tolist() == [1_000_110.0, 1_000_400.0]


def _results(tmp_path, builders):
    results = []
    for builder in builders:
        path = builder.write(tmp_path / f"r{builder.rank}.json")
        results.append(analyze_trace(TraceSource(path=path, label=path.name, window=None)))
    return results


@pytest.mark.parametrize("kernel_name", ["ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                                         "ncclKernel_AllReduce_RING_LL_Sum_float"])
def test_the_late_rank_and_its_lateness_are_found(tmp_path, kernel_name):
    # Rank 2 reaches the all-reduce 250 us after the others; all finish together at 900.
    builders = [gpu_rank(r, nccl_start=600 if r == 2 else 350, kernel_name=kernel_name, world_size=4)
                for r in range(4)]
    results = _results(tmp_path, builders)
    assert all(r.rank_source == RANK_FROM_TRACE for r in results)
    stragglers = find_stragglers(results, arrival_matrix(results))
    assert stragglers.matched_collectives == 2
    assert stragglers.waited_for_rank == 2 and stragglers.consistent
    assert stragglers.waited_for_median_us == pytest.approx(250.0)
    top = stragglers.by_wait[0]
    assert (top.rank, top.times_last, top.last_pct, top.score) == (2, 2, 100.0, 1.0)
    assert top.caused_wait_us == pytest.approx(500.0)
    assert top.median_extra_compute_us == 0      # same compute on every rank: the delay is elsewhere
    finding = find_causes(results, arrival_matrix(results), stragglers, ClockAlignment()).findings[0]
    assert (finding.rank, finding.cause) == (2, CAUSE_HOST)
    assert finding.mean_extra_idle_us == pytest.approx(250.0)
    waited = {w.rank: w.waited_us for w in stragglers.by_wait}
    assert waited == {0: 500.0, 1: 500.0, 2: 0.0, 3: 500.0}
    assert all(i.end_spread_us == 0 for i in stragglers.worst_instances)


def test_ranks_arriving_together_blame_nobody(tmp_path):
    results = _results(tmp_path, [gpu_rank(r, nccl_start=600 + 10 * r) for r in range(2)])
    stragglers = find_stragglers(results, arrival_matrix(results), min_lateness_us=100.0)
    assert stragglers.matched_collectives == 2
    assert stragglers.waited_for_rank is None
    assert "no rank keeps the others waiting" in stragglers.verdict


def test_clock_shift_changes_who_is_late(tmp_path):
    results = _results(tmp_path, [gpu_rank(r, nccl_start=600 if r == 1 else 350) for r in range(2)])
    matrix = arrival_matrix(results)
    assert find_stragglers(results, matrix).waited_for_rank == 1
    # If rank 1's clock ran 500 us ahead, it really arrived first.
    assert find_stragglers(results, matrix.shifted({1: 500.0})).waited_for_rank == 0


def test_slowest_rank_by_step_time(tmp_path):
    slow = KinetoBuilder(rank=1).step(1, 0, 1500).step(2, 1500, 1500)
    fast = KinetoBuilder(rank=0).step(1, 0, 1000).step(2, 1000, 1000)
    results = _results(tmp_path, [fast, slow])
    stragglers = find_stragglers(results, arrival_matrix(results))
    assert stragglers.slowest_rank == 1
    assert [r.rank for r in stragglers.by_step_time] == [1, 0]
    assert stragglers.by_step_time[0].vs_median_pct == pytest.approx(20.0)
    assert stragglers.matched_collectives == 0


def test_late_rank_with_more_work_is_called_imbalanced(tmp_path):
    builders = []
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        for step, s in enumerate((0.0, 1000.0)):
            builder.step(step, s, 1000).kernel("gemm", s + 100, 300, launch_ts=s + 10)
            arrival = 400.0
            if rank == 1:                      # 250 us more expert work before every all-reduce
                builder.kernel("expert_gemm", s + 400, 250, launch_ts=s + 20)
                arrival = 650.0
            builder.kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", s + arrival, 900 - arrival,
                           launch_ts=s + 30, stream=20)
        builders.append(builder)
    results = _results(tmp_path, builders)
    stragglers = find_stragglers(results, arrival_matrix(results))
    top = stragglers.by_wait[0]
    assert (top.rank, top.times_last) == (1, 2)
    assert top.median_lateness_us == pytest.approx(250.0)
    assert top.median_extra_compute_us == pytest.approx(250.0)
    finding = find_causes(results, arrival_matrix(results), stragglers, ClockAlignment()).findings[0]
    assert (finding.rank, finding.cause) == (1, CAUSE_WORK)
    assert finding.op_duration_ratio == pytest.approx(1.0)        # gemm runs as fast as on the others
    assert "computes 0.25 ms more" in finding.explanation


def test_late_rank_with_slower_kernels_is_called_a_slow_device(tmp_path):
    builders = []
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        slow = 1.5 if rank == 1 else 1.0          # the same two kernels, 1.5x as long on rank 1
        for step, s in enumerate((0.0, 1000.0)):
            builder.step(step, s, 1000).kernel("gemm", s + 100, 200 * slow, launch_ts=s + 10)
            builder.kernel("norm", s + 100 + 200 * slow, 100 * slow, launch_ts=s + 12)
            arrival = 100 + 300 * slow
            builder.kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", s + arrival, 900 - arrival,
                           launch_ts=s + 30, stream=20)
        builders.append(builder)
    results = _results(tmp_path, builders)
    stragglers = find_stragglers(results, arrival_matrix(results))
    finding = find_causes(results, arrival_matrix(results), stragglers, ClockAlignment()).findings[0]
    assert (finding.rank, finding.cause) == (1, CAUSE_SLOW_DEVICE)
    assert finding.op_duration_ratio == pytest.approx(1.5) and finding.ops_compared == 2
    assert finding.median_lateness_us == pytest.approx(150.0)
    assert finding.expected_slowdown_us == pytest.approx(150.0)


def test_gpu_job_communicating_on_the_host_exact():
    builder = KinetoBuilder(backend="gloo").step(1, 0, 1000)
    builder.kernel("gemm", 100, 300, launch_ts=20).kernel("gemm", 600, 100, launch_ts=30)
    builder.op("c10d::allreduce_", 490, 10)
    builder.gloo(500, 300)
    u = _utilization(builder)
    assert u.basis == "gpu"
    assert u.busy_us == 400                 # GPU activity only
    assert u.idle_us == 600
    assert u.comm_us == 310                 # 490-800 on the host
    assert u.overlap_us == 100              # the 600-700 kernel
    assert u.idle_comm_us == 210            # GPU idle while the all-reduce is in flight
    assert u.exposed_comm_us == 210


@pytest.mark.parametrize("builder", [gpu_rank(0), gpu_rank(1, nccl_start=200)], ids=["gpu", "gpu-overlapped"])
def test_breakdown_segments_add_up_to_the_span(builder):
    from fleetscope.analysis.render.html import breakdown_segments

    u = _utilization(builder)
    segments = breakdown_segments(u)
    assert all(s.value >= 0 for s in segments)
    assert sum(s.value for s in segments) == pytest.approx(u.span_us / 1000)


def test_gpu_span_follows_work_launched_in_the_steps_however_late_it_runs():
    builder = gpu_rank(0)
    builder.kernel("queued_gemm", 2300.0, 100.0, launch_ts=1990.0)   # launched in step 2, runs 300 us after it
    builder.kernel("next_step_gemm", 2500.0, 50.0, launch_ts=2450.0)  # launched after the steps: not theirs
    u = _utilization(builder)
    assert u.span_us == 2400
    assert u.compute_us == 1100 + 100
