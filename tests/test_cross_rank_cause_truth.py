"""Ground truth for straggler causes: sets with one rank late for a known reason must be classified as such,
with the amounts injected (tolerances stated per assertion)."""

from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.cross_rank.arrivals import arrival_matrix
from fleetscope.analysis.cross_rank.causes import (
    CAUSE_CLOCK,
    CAUSE_HOST,
    CAUSE_NETWORK,
    CAUSE_SLOW_DEVICE,
    CAUSE_WORK,
    find_causes,
)
from fleetscope.analysis.cross_rank.clock_align import SOURCE_MEASURED, ClockAlignment, HostClock
from fleetscope.analysis.cross_rank.stragglers import find_stragglers
from fleetscope.analysis.inputs.sources import TraceSource
from fleetscope.analysis.per_rank.parse import analyze_trace
from fleetscope.analysis.synthetic import (
    EXTRA_WORK_KERNEL,
    LATE_EXTRA_WORK,
    LATE_HOST,
    LATE_SLOW_KERNELS,
    TraceSetSpec,
    make_trace_set,
)
from helpers.kineto import KinetoBuilder

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-fleetscope-fast-2steps.json.gz"
LATE_RANK = 2
LATE_US = 2000.0
SLOW_FACTOR = 1.05
EXPECTED = {LATE_HOST: CAUSE_HOST, LATE_EXTRA_WORK: CAUSE_WORK, LATE_SLOW_KERNELS: CAUSE_SLOW_DEVICE}
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"


def _single_gpu_source(directory: Path) -> Path:
    builder = KinetoBuilder(rank=0, world_size=1)
    for step, s in enumerate((0.0, 10_000.0, 20_000.0)):
        builder.step(step, s, 10_000).kernel("gemm", s + 100, 3000, launch_ts=s + 20)
        builder.kernel("norm", s + 3100, 1000, launch_ts=s + 30)
    return builder.write(directory / "source_single.json.gz")


SOURCES = {"fixture fleetscope-fast": lambda directory: FIXTURE, "hand-built single gpu": _single_gpu_source}


@pytest.fixture(params=sorted(SOURCES))
def source(request, tmp_path) -> Path:
    return SOURCES[request.param](tmp_path)


@pytest.mark.parametrize("late_cause", sorted(EXPECTED))
def test_each_injected_cause_is_named_with_its_amount(source, tmp_path, late_cause):
    late_us = LATE_US if late_cause != LATE_SLOW_KERNELS else 0.0
    make_trace_set(source, tmp_path / "set", TraceSetSpec(
        ranks=4, ranks_per_host=4, late_rank=LATE_RANK, late_us=late_us, late_cause=late_cause,
        slow_factor=SLOW_FACTOR, inserted_allreduce_us=5000.0))
    report = analyze(tmp_path / "set", use_hta=False)
    window = report.windows[0]
    assert window.stragglers.waited_for_rank == LATE_RANK and window.stragglers.consistent
    (finding,) = window.causes.findings
    assert (finding.rank, finding.cause) == (LATE_RANK, EXPECTED[late_cause])
    assert finding.wait_share == 1.0 and finding.explained_share >= 0.85
    if late_cause == LATE_SLOW_KERNELS:
        assert finding.op_duration_ratio == pytest.approx(SLOW_FACTOR, rel=0.005)
        # the slowdown the kernel ratio predicts is what the rank was late by, within 15%: the peers' compute
        # is counted from the previous collective's end, and a step's first kernels may run before it
        assert finding.expected_slowdown_us == pytest.approx(finding.mean_lateness_us, rel=0.15)
    else:
        assert finding.median_lateness_us == pytest.approx(late_us, abs=1.0)
        assert finding.op_duration_ratio == pytest.approx(1.0, abs=1e-9)      # same kernels, same speed
    for what_if in finding.what_if:                                             # one collective per step
        assert what_if.caused_wait_ms == pytest.approx(finding.median_lateness_us / 1000, rel=0.01)
        assert what_if.projected_step_ms == pytest.approx(what_if.step_time_ms - what_if.caused_wait_ms, abs=1e-9)
    assert f"rank {LATE_RANK} is the straggler" in report.verdict and f"cause: {EXPECTED[late_cause]}" in report.verdict


def _results(tmp_path: Path, builders: list[KinetoBuilder]):
    paths = [b.write(tmp_path / f"rank{b.rank}.json") for b in builders]
    return [analyze_trace(TraceSource(path=p, label=p.name, window=None)) for p in paths]


def test_a_rank_causing_all_waiting_at_few_collectives_is_named(tmp_path):
    # 4 all-reduces per step; rank 2 is 400 us late at the first only, the others arrive together.
    builders = []
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        for step, s in enumerate((0.0, 4000.0)):
            builder.step(step, s, 4000)
            for k in range(4):
                start = s + 1000 * k
                arrival = start + (700 if rank == 2 and k == 0 else 300)
                builder.kernel("gemm", start + 100, 200, launch_ts=start + 10)
                builder.kernel(NCCL, arrival, start + 900 - arrival, launch_ts=start + 20, stream=20)
        builders.append(builder)
    report = analyze(_write_all(tmp_path, builders), use_hta=False)
    stragglers = report.windows[0].stragglers
    top = stragglers.by_wait[0]
    assert (top.rank, top.times_last, top.collectives, top.score) == (2, 2, 8, 1.0)
    assert stragglers.consistent and "spread" not in stragglers.verdict
    assert "rank 2 at collectives: it causes 100% of all waiting" in stragglers.verdict
    assert "last at 2 of 8 (25%)" in stragglers.verdict
    assert "rank 2 is the straggler" in report.verdict and "no single straggler" not in report.verdict


def _write_all(directory: Path, builders: list[KinetoBuilder]) -> Path:
    for builder in builders:
        builder.write(directory / "set" / f"rank{builder.rank}.json")
    return directory / "set"


def test_a_backward_straggler_is_found_from_bucket_arrivals(tmp_path):
    # DDP-like: three gradient buckets reduced inside backward; rank 1 computes 300 us more before the
    # first bucket. The host's backward range ends when the last bucket is done, on every rank alike.
    builders = []
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        for step, s in enumerate((0.0, 5000.0)):
            builder.step(step, s, 5000).annotation("forward", s + 10, 990).annotation("backward", s + 1000, 3500)
            builder.kernel("fwd_gemm", s + 100, 800, launch_ts=s + 20)
            extra = 300.0 if rank == 1 else 0.0
            builder.kernel("bwd_gemm", s + 1000, 500, launch_ts=s + 1005)
            if extra:
                builder.kernel("bwd_expert_gemm", s + 1500, extra, launch_ts=s + 1010)
            for bucket in range(3):
                begin = s + 1500 + 1000 * bucket
                arrival = begin + (extra if bucket == 0 else 0.0)
                builder.kernel(NCCL, arrival, begin + 800 - arrival, launch_ts=s + 1020 + bucket, stream=20)
                if bucket < 2:
                    builder.kernel("bwd_gemm", begin + 800, 200, launch_ts=s + 1030 + bucket)
        builders.append(builder)
    report = analyze(_write_all(tmp_path, builders), use_hta=False)
    window = report.windows[0]
    phases = {r.rank: [s.phases_ms["backward"] for s in r.steps] for r in window.ranks}
    assert phases[0] == phases[1] == phases[2]           # the phase times cannot tell
    (finding,) = window.causes.findings
    assert (finding.rank, finding.phase, finding.cause) == (1, "backward", CAUSE_WORK)
    assert finding.phase_vs_peers_pct == pytest.approx(0.0, abs=1e-9)
    assert finding.median_lateness_us == pytest.approx(300.0, abs=1.0)
    assert "gradient buckets" in finding.explanation


def test_a_rank_leaving_the_previous_collective_late_is_a_network_straggler(tmp_path):
    # Rank 1's first all-reduce takes 200 us longer (its link is slow); it then reaches the second 200 us late.
    builders = []
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        slow = 200.0 if rank == 1 else 0.0
        for step, s in enumerate((0.0, 1000.0)):
            builder.step(step, s, 1000).kernel("gemm", s + 100, 200, launch_ts=s + 10)
            builder.kernel(NCCL, s + 300, 200 + slow, launch_ts=s + 20, stream=20)
            builder.kernel("gemm2", s + 500 + slow, 200, launch_ts=s + 30)
            builder.kernel(NCCL, s + 700 + slow, 250 - slow, launch_ts=s + 40, stream=20)
        builders.append(builder)
    results = _results(tmp_path, builders)
    matrix = arrival_matrix(results)
    (finding,) = find_causes(results, matrix, find_stragglers(results, matrix), ClockAlignment()).findings
    assert (finding.rank, finding.cause) == (1, CAUSE_NETWORK)
    assert finding.mean_carried_us == pytest.approx(200.0, abs=1e-6)


def test_clock_uncertainty_larger_than_the_lateness_tells_nothing(tmp_path):
    builders = []
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3, host="node1" if rank == 2 else "node0")
        for step, s in enumerate((0.0, 1000.0)):
            builder.step(step, s, 1000).kernel("gemm", s + 100, 200, launch_ts=s + 10)
            arrival = 550.0 if rank == 2 else 300.0
            builder.kernel(NCCL, s + arrival, 900 - arrival, launch_ts=s + 20, stream=20)
        builders.append(builder)
    results = _results(tmp_path, builders)
    matrix = arrival_matrix(results)
    stragglers = find_stragglers(results, matrix)

    def clock(uncertainty_us: float) -> ClockAlignment:
        return ClockAlignment(reference_rank=0, reference_host="node0", hosts=[
            HostClock(host="node0", ranks=[0, 1], offset_us=0.0, source="reference host"),
            HostClock(host="node1", ranks=[2], offset_us=0.0, source=SOURCE_MEASURED,
                      measured_offset_us=0.0, measured_uncertainty_us=uncertainty_us)])

    (unsure,) = find_causes(results, matrix, stragglers, clock(1000.0)).findings
    assert (unsure.rank, unsure.cause, unsure.clock_uncertainty_us) == (2, CAUSE_CLOCK, 1000.0)
    (sure,) = find_causes(results, matrix, stragglers, clock(10.0)).findings
    assert sure.cause == CAUSE_HOST


def test_causes_reach_the_json_the_terminal_and_the_html(tmp_path):
    from fleetscope.analysis import render_terminal
    from fleetscope.analysis.render.html import render_html
    from fleetscope.analysis.report.model import Report

    make_trace_set(_single_gpu_source(tmp_path), tmp_path / "set", TraceSetSpec(
        ranks=3, late_rank=1, late_us=LATE_US, late_cause=LATE_EXTRA_WORK, inserted_allreduce_us=5000.0))
    report = analyze(tmp_path / "set", use_hta=False)
    again = Report.from_json(report.to_json())
    assert again.windows[0].causes == report.windows[0].causes
    text = render_terminal(report)
    assert "Causes\n  window -: work imbalance: rank 1" in text
    assert "2.00 ms of it waiting for rank 1" in text
    html = render_html(report)
    assert "<h2>Causes of waiting</h2>" in html and "<td class=\"l\">work imbalance</td>" in html


@pytest.mark.parametrize("late_cause", [LATE_EXTRA_WORK, LATE_SLOW_KERNELS])
def test_kernels_matched_by_identity_tell_more_work_from_a_slow_device(tmp_path, late_cause):
    # real H200 kernels: the same kernels longer is a slow device with its ratio; an extra kernel is more work, named
    make_trace_set(FIXTURE, tmp_path / "set", TraceSetSpec(
        ranks=4, ranks_per_host=4, late_rank=LATE_RANK, late_us=LATE_US if late_cause == LATE_EXTRA_WORK else 0.0,
        late_cause=late_cause, slow_factor=1.3, inserted_allreduce_us=20000.0))
    (finding,) = analyze(tmp_path / "set", use_hta=False).windows[0].causes.findings
    assert finding.rank == LATE_RANK and finding.ops_compared > 10
    if late_cause == LATE_SLOW_KERNELS:
        assert finding.cause == CAUSE_SLOW_DEVICE and finding.op_duration_ratio == pytest.approx(1.3, rel=0.005)
        assert finding.extra_kernels == [] and finding.extra_kernel_us == 0.0
        assert "1.30x as long" in finding.explanation and "same launch counts" in finding.explanation
    else:
        assert finding.cause == CAUSE_WORK and finding.op_duration_ratio == pytest.approx(1.0, abs=1e-9)
        (extra,) = finding.extra_kernels
        assert extra.startswith(f"{EXTRA_WORK_KERNEL} (+") and finding.extra_kernel_us > 0
        assert EXTRA_WORK_KERNEL in finding.explanation


def _partly_slow_ranks(gemm_factor: float, extra_gemms: int = 0, bigger_grid: bool = False) -> list[KinetoBuilder]:
    # per step one GEMM and four elementwise kernels, then an all-reduce; rank 1's GEMMs take gemm_factor as
    # long (a power-capped device slows the math, not the memory-bound kernels), or it runs extra GEMMs
    builders = []
    for rank in range(4):
        builder = KinetoBuilder(rank=rank, world_size=4)
        for step, s in enumerate((0.0, 10_000.0, 20_000.0)):
            builder.step(step, s, 10_000)
            t = s + 100
            gemms = 1 + (extra_gemms if rank == 1 else 0)
            for g in range(gemms):
                dur = 2000.0 * (gemm_factor if rank == 1 else 1.0)
                grid = [264, 2, 1] if bigger_grid and rank == 1 else [132, 1, 1]
                builder.kernel("sm90_xmma_gemm_bf16", t, dur, launch_ts=s + 10 + g, args={"grid": grid})
                t += dur
            for k, name in enumerate(("add_kernel", "mul_kernel", "relu_kernel", "copy_kernel")):
                builder.kernel(name, t, 100, launch_ts=s + 20 + k)
                t += 100
            builder.kernel(NCCL, t, s + 8000 - t, launch_ts=s + 30, stream=20)
        builders.append(builder)
    return builders


def test_only_the_gemms_slower_is_still_a_slow_device(tmp_path):
    # the median over kernel names is 1.0 (four of five names unchanged): matched by identity, the same
    # kernels take 1.33x as long
    results = _results(tmp_path, _partly_slow_ranks(1.5))
    matrix = arrival_matrix(results)
    (finding,) = find_causes(results, matrix, find_stragglers(results, matrix), ClockAlignment()).findings
    assert (finding.rank, finding.cause, finding.ops_compared) == (1, CAUSE_SLOW_DEVICE, 5)
    assert finding.op_duration_ratio == pytest.approx(3400 / 2400)
    assert finding.same_kernel_excess_us == pytest.approx(3 * 1000.0) and finding.extra_kernels == []


def test_the_same_gemm_on_a_bigger_grid_is_more_work_not_a_slow_device(tmp_path):
    # more tokens: the same kernel name, launched with four times the blocks and lasting 1.5x; matched by
    # name alone it read as a slow device (1.33x the same kernels)
    results = _results(tmp_path, _partly_slow_ranks(1.5, bigger_grid=True))
    matrix = arrival_matrix(results)
    (finding,) = find_causes(results, matrix, find_stragglers(results, matrix), ClockAlignment()).findings
    assert (finding.rank, finding.cause) == (1, CAUSE_WORK)
    assert finding.op_duration_ratio == pytest.approx(1.0) and finding.ops_compared == 4
    assert finding.extra_kernels == ["sm90_xmma_gemm_bf16 (grid [264, 2, 1] block [128, 1, 1]) (+3 launches, 9.00 ms)"]


def test_the_same_gemm_run_more_often_is_more_work(tmp_path):
    results = _results(tmp_path, _partly_slow_ranks(1.0, extra_gemms=1))
    matrix = arrival_matrix(results)
    (finding,) = find_causes(results, matrix, find_stragglers(results, matrix), ClockAlignment()).findings
    assert (finding.rank, finding.cause) == (1, CAUSE_WORK)
    assert finding.op_duration_ratio == pytest.approx(1.0)
    assert finding.extra_kernels == ["sm90_xmma_gemm_bf16 (+3 launches, 6.00 ms)"]
    assert "sm90_xmma_gemm_bf16 (+3 launches" in finding.explanation


def _one_kernel_longer_ranks(extra_us: float) -> list[KinetoBuilder]:
    # per step one GEMM and four elementwise kernels, then an all-reduce; on rank 1 the LAST kernel before the
    # all-reduce runs extra_us longer (the same names, the same counts, every other kernel unchanged)
    builders = []
    for rank in range(4):
        builder = KinetoBuilder(rank=rank, world_size=4)
        for step, s in enumerate((0.0, 10_000.0, 20_000.0)):
            builder.step(step, s, 10_000)
            builder.kernel("sm90_xmma_gemm_bf16", s + 100, 2000.0, launch_ts=s + 10)
            t = s + 2100
            for k, name in enumerate(("add_kernel", "mul_kernel", "relu_kernel", "copy_kernel")):
                dur = 100.0 + (extra_us if rank == 1 and name == "copy_kernel" else 0.0)
                builder.kernel(name, t, dur, launch_ts=s + 20 + k)
                t += dur
            builder.kernel(NCCL, t, s + 9000 - t, launch_ts=s + 30, stream=20)
        builders.append(builder)
    return builders


def test_one_kernel_much_longer_is_more_work_in_it_not_a_slow_device(tmp_path):
    # a slow or throttled GPU stretches most of its work; here one kernel of 4% of the peers' time runs 31x as
    # long: more work in that kernel (data-dependent), named with its ratio
    results = _results(tmp_path, _one_kernel_longer_ranks(3000.0))
    matrix = arrival_matrix(results)
    (finding,) = find_causes(results, matrix, find_stragglers(results, matrix), ClockAlignment()).findings
    assert (finding.rank, finding.cause, finding.ops_compared) == (1, CAUSE_WORK, 5)
    assert finding.op_duration_ratio == pytest.approx(5400 / 2400)
    (kernel,) = finding.concentrated_kernels
    assert kernel.startswith("copy_kernel (31.00x, +9.00 ms)")
    assert "the slow-down is in a few kernels" in finding.explanation and "copy_kernel" in finding.explanation
