"""`fleetscope diff` on pairs whose change is known (bench/planted/pairs.py, recorded on an H200: the same model on
two ranks, rank 1 with twice the rows, or confined to a third of the GPU's SMs), and on a trace against itself."""

import json
from pathlib import Path

import pytest

from fleetscope.analysis.diff import KIND_ACTIVITY, diff
from fleetscope.analysis.per_rank.names import kernel_category
from fleetscope.cli.main import main

PAIRS = Path(__file__).parent / "fixtures" / "gpu" / "planted_pairs"


def _pair(case: str):
    traces = PAIRS / case / "traces"
    planted = json.loads((PAIRS / case / "planted.json").read_text())
    return diff(traces / "rank0.pt.trace.json.gz", traces / "rank1.pt.trace.json.gz"), planted


@pytest.mark.parametrize("case", ["more_tokens", "slow_device"])
def test_the_items_add_up_to_the_step_and_the_work_to_the_planted_change(case):
    result, planted = _pair(case)
    # the partition: activities - overlap + idle is the step span, exactly, on both sides and in the change
    assert sum(item.change_ms for item in result.items) == pytest.approx(result.span_change_ms, abs=1e-9)
    # rank 1's extra compute (timed in the program, profiler off) is what the GPU activities changed by (10%)
    extra = planted["ranks"]["1"]["compute_ms"] - planted["ranks"]["0"]["compute_ms"]
    work = sum(item.change_ms for item in result.items if item.kind == KIND_ACTIVITY)
    assert work == pytest.approx(extra, rel=0.10)
    # a synchronous pair: the faster rank waits, so its idle falls by about as much and the step barely moves
    idle = next(item for item in result.items if item.kind == "GPU idle")
    assert idle.change_ms < -0.8 * extra and abs(result.report_change_ms) < 0.2 * extra


def test_a_slow_device_is_the_same_kernels_taking_longer_more_work_is_other_grids():
    # the same kernels (names, grids, counts) on the slow device, its GEMMs the largest changes; twice the rows
    # bring kernels on grids rank 0 never ran
    slow, _ = _pair("slow_device")
    top = [item for item in slow.items if item.kind == KIND_ACTIVITY][:5]
    assert all(not item.status and item.a_count == item.b_count for item in top)
    assert top[0].change_ms > 0 and top[1].change_ms > 0 and kernel_category(top[0].name) == "gemm"
    more, _ = _pair("more_tokens")
    assert any(item.status == "new" for item in more.items[:5])


def test_a_trace_against_itself_changes_nothing():
    trace = PAIRS / "more_tokens" / "traces" / "rank0.pt.trace.json.gz"
    result = diff(trace, trace)
    assert all(item.change_ms == 0 for item in result.items)
    assert result.report_change_ms == 0 and result.unexplained_ms == 0


def test_the_command_prints_and_writes_json(tmp_path, capsys):
    traces = PAIRS / "more_tokens" / "traces"
    assert main(["diff", str(traces / "rank0.pt.trace.json.gz"), str(traces / "rank1.pt.trace.json.gz"),
                 "--json", str(tmp_path / "diff.json")]) == 0
    out = capsys.readouterr().out
    assert "GPU idle inside the steps" in out and "unexplained" in out
    written = json.loads((tmp_path / "diff.json").read_text())
    assert written["items"][0]["change_ms"] == pytest.approx(written["items"][0]["b_ms"] - written["items"][0]["a_ms"])


def test_the_api_tour_in_the_docs_runs():
    import subprocess
    import sys

    traces = PAIRS / "more_tokens" / "traces"
    example = Path(__file__).resolve().parents[1] / "docs" / "examples" / "api_tour.py"
    done = subprocess.run([sys.executable, str(example), str(traces / "rank0.pt.trace.json.gz"),
                           str(traces / "rank1.pt.trace.json.gz")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step time: 12.76 ms (trace, profiled steps 3-5" in done.stdout and "GPU idle inside the steps" in done.stdout


def test_import_fleetscope_gives_the_api_and_loads_nothing_heavy():
    """`import fleetscope` is the API's front door; its names load their modules only when used."""
    import subprocess
    import sys

    code = ("import sys, fleetscope; heavy = [m for m in ('numpy', 'pandas', 'torch') if m in sys.modules]; "
            "assert not heavy, heavy; from fleetscope.analysis import diff, open_run; "
            "assert fleetscope.open_run is open_run and fleetscope.diff is diff; print(fleetscope.__all__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "open_run" in done.stdout


def test_the_api_gives_the_reports_numbers_and_the_event_table():
    from fleetscope.analysis import open_run

    run = open_run(PAIRS / "slow_device" / "traces")
    assert run.ranks == [0, 1] and run.report.step_time.median_ms == pytest.approx(
        sorted(run.step_times().values())[len(run.step_times()) // 2])
    events = run.events(rank=1)
    assert list(events.columns) == ["name", "kind", "start_us", "dur_us", "thread", "device", "correlation"]
    assert (events["kind"] == "kernel").any() and events["start_us"].is_monotonic_increasing
    with pytest.raises(LookupError, match="ranks: \\[0, 1\\]"):
        run.events(rank=7)


def test_a_regression_found_by_compare_names_where_the_time_moved(capsys):
    # a bf16 MLP against an fp32 one (recorded on an H200): the fp32 GEMMs are new, the bf16 ones vanished
    corpus = Path(__file__).parent / "fixtures" / "gpu" / "corpus"
    assert main(["compare", str(corpus / "healthy_bf16_mlp"), str(corpus / "precision_fp32_mlp"),
                 "--allow-different-jobs"]) == 1
    out = capsys.readouterr().out
    moved = out.split("where the step's time moved")[1].splitlines()[1:6]
    assert "f32f32" in moved[0] and moved[0].strip().startswith("+") and "[new]" in moved[0]
    assert any("[vanished]" in line for line in moved)


DIFF_PAIRS = Path(__file__).parent / "fixtures" / "gpu" / "diff_pairs"


def _fp32_gemm(name: str) -> bool:
    from fleetscope.analysis.per_rank.step_work import gemm_precision

    return kernel_category(name) == "gemm" and gemm_precision(name) == "fp32"


@pytest.mark.parametrize("program, planted_item, kind, tolerance", [
    # fp32 GEMMs with TF32 off, fixed by bf16: the fp32 GEMM kernels vanish, their time the planted cost (10%)
    ("precision_fp32_mlp", _fp32_gemm, "GPU activity", 0.10),
    # a 256 MB batch copied from pageable memory, fixed by pinning: the pageable copy vanishes
    ("pageable_copy_batch", lambda name: "Pageable" in name, "GPU activity", 0.10),
    # empty_cache() every step: the GPU's idle while the host allocates falls; cudaMalloc / cudaFree vanish
    ("allocator_churn_mlp", lambda name: "idle" in name, "GPU idle", 0.30),
])
def test_diff_names_the_planted_change_first_with_its_size(program, planted_item, kind, tolerance):
    pair = DIFF_PAIRS / program
    planted = json.loads((pair / "planted.json").read_text())["planted_ms_per_step"]
    result = diff(pair / "as_written", pair / "fixed")
    top = result.items[0]
    assert top.kind == kind and planted_item(top.name) and top.change_ms < 0
    same = sum(i.change_ms for i in result.items if i.kind == kind and planted_item(i.name))
    assert -same == pytest.approx(planted, rel=tolerance)
    if program == "allocator_churn_mlp":
        assert {i.name: i.status for i in result.host_calls[:2]} == {"cudaMalloc": "vanished", "cudaFree": "vanished"}


def test_the_views_beside_the_partition_name_the_ops_and_the_collectives(tmp_path):
    """fp32 -> bf16: the host ops whose GPU time fell are the matmuls; each view is sorted by its change; a
    change's noise is never negative and is 0 for a trace against itself."""
    pair = DIFF_PAIRS / "precision_fp32_mlp"
    result = diff(pair / "as_written", pair / "fixed")
    assert result.ops[0].name in ("aten::mm", "aten::addmm") and result.ops[0].change_ms < 0
    assert all(abs(x.change_ms) >= abs(y.change_ms) for x, y in zip(result.ops, result.ops[1:]))
    assert result.phases and all(item.noise_ms >= 0 for item in result.items)
    assert result.span_change_ms == pytest.approx(sum(item.change_ms for item in result.items), abs=1e-6)
    assert 0 < result.span_noise_ms < abs(result.span_change_ms)
    same = diff(pair / "fixed", pair / "fixed")
    assert all(item.change_ms == 0 for item in same.ops + same.phases + same.collectives)


def test_collectives_are_keyed_by_op_and_counted_per_step():
    ranks = Path(__file__).parent / "fixtures" / "public" / "hta" / "two_of_128_ranks"
    result = diff(ranks / "sampled_rank-0.json.gz", ranks / "sampled_rank-1.json.gz")
    assert result.collectives, "the sampled ranks' NCCL kernels are collectives"
    top = result.collectives[0]
    assert top.a_count > 0 and top.b_count > 0 and top.a_ms > 0


def test_the_command_writes_an_html_page(tmp_path, capsys):
    pair = DIFF_PAIRS / "pageable_copy_batch"
    page = tmp_path / "diff.html"
    assert main(["diff", str(pair / "as_written"), str(pair / "fixed"), "--html", str(page),
                 "--json", str(tmp_path / "diff.json")]) == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "Where the step's time moved" in text and "Pageable" in text
    assert "GPU time by host op" in text
    written = json.loads((tmp_path / "diff.json").read_text())
    assert {"ops", "phases", "collectives", "span_noise_ms"} <= set(written)


def test_cpu_traces_are_refused_before_any_table(tmp_path, capsys):
    """Two CPU runs have no GPU time to partition: the refusal comes alone, not after a table of zeros."""
    from helpers.kineto import KinetoBuilder

    for side in ("a", "b"):
        KinetoBuilder(rank=0, world_size=1).step(1, 0.0, 1000.0).op("aten::mm", 10, 500).write(
            tmp_path / side / "rank0.json")
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "no GPU trace with profiled steps to partition" in captured.err
