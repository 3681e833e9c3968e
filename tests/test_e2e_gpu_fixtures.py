"""analyze() on real H200 traces (tests/fixtures/gpu, see its README), with HTA alongside."""

from pathlib import Path

import pytest

from fleetscope.analysis import analyze, render_html, render_terminal

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


@pytest.fixture(scope="module")
def gloo_on_gpu():
    return analyze(FIXTURES / "h200-ddp-gloo-2rank", write_default_outputs=False)


@pytest.fixture(scope="module")
def fsdp_one_rank():
    return analyze(FIXTURES / "h200-fsdp-1rank", write_default_outputs=False)


def test_gpu_ranks_communicating_over_gloo(gloo_on_gpu):
    report = gloo_on_gpu
    assert report.complete and report.source_kind == "run_dir"
    assert report.analyzed_ranks == [0, 1]
    for rank in report.windows[0].ranks:
        u = rank.utilization
        assert u.basis == "gpu" and rank.step_source == "ProfilerStep"
        assert u.compute_us > 0 and u.memory_us > 0
        assert u.comm_us > 0 and u.idle_comm_us > 0    # the GPU waits while gloo all-reduces
        assert u.busy_us + u.idle_us == pytest.approx(u.span_us)
        assert rank.collective_source == "gloo spans"
    stragglers = report.windows[0].stragglers
    assert stragglers.matched_collectives == stragglers.by_wait[0].collectives > 0
    assert stragglers.unmatched_collectives == 0


def test_hta_runs_beside_ours(gloo_on_gpu):
    hta = gloo_on_gpu.windows[0].hta
    assert {"temporal_breakdown", "idle_time_breakdown", "comm_comp_overlap", "kernel_breakdown",
            "cuda_launch_stats"} <= set(hta.tables), hta.errors
    assert "NCCL kernels" in hta.not_applicable["potential_stragglers"]
    ours = {r.rank: r.utilization.compute_us for r in gloo_on_gpu.windows[0].ranks}
    theirs = {row["rank"]: row["compute_time(us)"] for row in hta.tables["temporal_breakdown"]}
    assert sorted(theirs) == sorted(ours)
    for rank, compute_us in ours.items():
        # HTA 0.5.0 keeps whole microseconds: these kernels last ~1.5 us (0.6 us ones become 0), so its
        # compute time is about half the recorded one (2.4 ms here); on long kernels the two agree within
        # a few percent (3% on h200-small-hf-eager-2steps)
        assert 0.4 * compute_us <= theirs[rank] <= compute_us


def test_one_rank_fsdp(fsdp_one_rank):
    report = fsdp_one_rank
    assert report.complete and report.analyzed_ranks == [0]
    rank = report.windows[0].ranks[0]
    assert rank.utilization.basis == "gpu" and len(rank.steps) == 2
    assert "no collectives matched" in report.windows[0].stragglers.verdict
    hta = report.windows[0].hta
    assert "two ranks" in hta.not_applicable["potential_stragglers"]
    # whatever HTA 0.5.0 manages on it is kept; what it cannot do is named with its error
    for analysis in ("temporal_breakdown", "idle_time_breakdown", "comm_comp_overlap", "kernel_breakdown",
                     "cuda_launch_stats"):
        assert (analysis in hta.tables) != (analysis in hta.errors), analysis
    assert "kernel_breakdown" in hta.tables


def test_renderers_on_real_reports(gloo_on_gpu, fsdp_one_rank):
    for report in (gloo_on_gpu, fsdp_one_rank):
        text = render_terminal(report)
        assert "HTA" in text and "Per rank" in text
        html = render_html(report)
        assert html.count("<svg") >= 2
        assert "kernel_breakdown" in html
