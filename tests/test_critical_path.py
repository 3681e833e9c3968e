"""The cross-rank critical path on sets with a known path: the late rank's compute before each collective it
holds up is on it, the segments tile each step, a rank that is never last is never on it."""

from pathlib import Path

import pytest

from fleetscope.analysis import analyze, render_terminal
from fleetscope.analysis.cross_rank.critical_path import (
    SEGMENT_COMPUTE,
    SEGMENT_IDLE,
    SEGMENT_TRANSFER,
)
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.synthetic import LATE_EXTRA_WORK, TraceSetSpec, make_trace_set
from helpers.kineto import KinetoBuilder

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-fleetscope-fast-2steps.json.gz"
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"


def test_the_late_ranks_compute_is_on_the_path(tmp_path):
    make_trace_set(FIXTURE, tmp_path / "set", TraceSetSpec(ranks=4, late_rank=2, late_us=2000.0,
                                                           late_cause=LATE_EXTRA_WORK, inserted_allreduce_us=5000.0))
    window = analyze(tmp_path / "set", use_hta=False).windows[0]
    paths = window.critical_path
    assert [p.step for p in paths.steps] == [0, 1]
    for path in paths.steps:
        assert sum(s.duration_us for s in path.segments) == pytest.approx(path.length_us, abs=1e-6)
        assert sum(s.share for s in path.segments) == pytest.approx(1.0, abs=1e-9)
        compute = [s for s in path.segments if s.kind == SEGMENT_COMPUTE]
        assert [s.rank for s in compute] == [2]
        assert compute[0].duration_us > 2000.0                 # its extra kernel is part of it
        assert {s.rank for s in path.segments} == {2}          # the others only wait for it
    assert paths.by_rank[0].rank == 2 and paths.by_rank[0].kind == SEGMENT_COMPUTE


def jumping_path_set(directory: Path) -> Path:
    """Three ranks, two all-reduces per step: rank 1 is 200 us late at the first, rank 2 300 us late at
    the second, so each step's path runs rank 1 -> rank 2 -> rank 0."""
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        for step, s in enumerate((0.0, 2000.0)):
            builder.step(step, s, 2000)
            first = 300.0 + (200.0 if rank == 1 else 0.0)
            builder.kernel("gemm", s + 100, first - 100, launch_ts=s + 10)
            builder.kernel(NCCL, s + first, 700 - first, launch_ts=s + 20, stream=20)
            second = 1000.0 + (300.0 if rank == 2 else 0.0)
            builder.kernel("gemm", s + 700, second - 700, launch_ts=s + 30)
            builder.kernel(NCCL, s + second, 1500 - second, launch_ts=s + 40, stream=20)
            builder.kernel("optimizer", s + 1500, 400, launch_ts=s + 50)
        builder.write(directory / f"rank{rank}.json")
    return directory


def test_the_path_jumps_to_whichever_rank_arrives_last(tmp_path):
    report = analyze(jumping_path_set(tmp_path / "set"), use_hta=False)
    for path in report.windows[0].critical_path.steps:
        chain = [(s.kind, s.rank, s.collective, s.duration_us) for s in path.segments]
        assert chain == [
            (SEGMENT_COMPUTE, 1, "nccl:AllReduce #0", 400.0),
            (SEGMENT_IDLE, 1, "nccl:AllReduce #0", 100.0),
            (SEGMENT_TRANSFER, 1, "nccl:AllReduce #0", 200.0),
            (SEGMENT_COMPUTE, 2, "nccl:AllReduce #1", 600.0),
            (SEGMENT_TRANSFER, 2, "nccl:AllReduce #1", 200.0),
            ("work", 0, "nccl:AllReduce #1", 500.0),
        ]
        assert path.length_us == 2000.0
    assert "Critical path" in render_terminal(report)
    assert "<h2>Critical path</h2>" in render_html(report)


def test_the_path_lies_within_its_step_across_ranks_and_is_printed_against_it(tmp_path):
    # rank 1 starts each step 300 us after rank 0 and ends it with the all-reduce rank 0 waits in: the path runs
    # from rank 0's start to the latest end, 300 us longer than rank 1's own step, never longer than the span
    for rank in range(2):
        builder = KinetoBuilder(rank=rank, world_size=2)
        for step, s in enumerate((0.0, 3000.0)):
            start = s + (300.0 if rank == 1 else 0.0)
            builder.step(step, start, 2000.0 - (300.0 if rank == 1 else 0.0) + 300.0 * rank)
            builder.kernel("gemm", start + 10, 1000.0, launch_ts=start + 5)
            builder.kernel(NCCL, start + 1010 if rank else s + 1310, 500.0 if rank else 200.0,
                           launch_ts=start + 8, stream=20)
        builder.write(tmp_path / f"rank{rank}.json")
    report = analyze(tmp_path, use_hta=False)
    for path in report.windows[0].critical_path.steps:
        assert 0 < path.length_us <= path.span_us
    text = render_terminal(report)
    first = report.windows[0].critical_path.steps[0]
    assert f"of the step's {first.span_us / 1000:.2f} ms across ranks" in text
    assert "work: a rank's time after a collective" in text and "work: a rank" in render_html(report)
