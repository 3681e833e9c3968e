"""Ground truth from programs nobody here wrote: bench/planted/programs.py's small PyTorch programs, one
planted problem each, profiled on one H200 (bench/device/planted_programs.sh; traces and the planted size,
timed inside each program, in tests/fixtures/gpu/planted/NAME/). advise gets only the folder of traces."""

import json
import shutil
from pathlib import Path

import pytest

from fleetscope.analysis.advise import advise

PLANTED = Path(__file__).parent / "fixtures" / "gpu" / "planted"


def _advice(name: str):
    planted = json.loads((PLANTED / name / "planted.json").read_text())
    return advise(PLANTED / name / "traces"), planted


@pytest.mark.parametrize("name, rule, tolerance", [
    ("cpu_batch", "host_work", 0.10),             # the batch built by torch.randn on the host: 83.5 ms a step
    ("slow_dataloader", "data_workers", 0.10),    # 32 samples of 0.5 ms, fetched in the training process
    # synchronize, then 5 ms of host work nothing overlaps; the GPU then idles too while the host launches again
    # until its queue is rebuilt (charged to the sync up to the lead it took), longer under the profiler: 5.9 ms
    ("sync_per_step", "host_syncs", 0.20),
])
def test_the_top_finding_is_the_planted_problem_with_its_size(name, rule, tolerance):
    advice, planted = _advice(name)
    top = advice.findings[0]
    assert top.rule == rule
    assert top.expected_gain_ms == pytest.approx(planted["planted_ms_per_step"], rel=tolerance)
    assert top.apply is None and "--set" not in top.change           # a user program: the code change


def test_item_per_layer_is_the_syncs_not_cuda_graphs():
    advice, _ = _advice("item_per_layer")
    top = advice.findings[0]
    assert top.rule == "host_syncs" and top.evidence["tensor_reads_per_step"] == 8.0    # one per layer
    assert "cuda_graphs" not in {f.rule for f in advice.findings}    # no graph captures a step that syncs


def test_the_syncs_advice_names_the_frame_that_holds_them():
    # item_per_layer_frames: the 8 .item() per step sit in the program's log_statistic (with_stack trace)
    advice, _ = _advice("item_per_layer_frames")
    top = advice.findings[0]
    assert top.rule == "host_syncs" and "programs.py(122): log_statistic" in top.change
    assert top.evidence["frames"].startswith("programs.py(122): log_statistic")


def test_a_pageable_copy_is_advised_pinned_memory_naming_its_frame():
    # pageable_copy: a 128 MiB host-to-device copy from pageable memory every step, 18.6 ms timed in the program;
    # the trace shows the host inside that copy call (profiled, so a little longer). Tolerance 20%.
    advice, planted = _advice("pageable_copy")
    top = advice.findings[0]
    assert top.rule == "pinned_copies" and "non_blocking=True" in top.change and "programs.py(149): step" in top.change
    assert top.evidence["pageable_copy_ms_per_step"] == pytest.approx(planted["planted_ms_per_step"], rel=0.20)
    # the gain: the host's copy time less its wait for work queued before the copy, less the same bytes at the
    # pinned rate (the H200's PCIe Gen5 link, 50 GB/s), plus the GPU's idle while the host refills its queue
    left_ms = top.evidence["pageable_copy_mb_per_step"] / top.evidence["pinned_copy_gbps"]
    assert top.evidence["pageable_copy_mb_per_step"] == pytest.approx(134.2, rel=0.01)
    copying_ms = top.evidence["pageable_copy_ms_per_step"] - top.evidence["pageable_copy_queued_ms_per_step"]
    assert top.expected_gain_ms == pytest.approx(copying_ms - left_ms + top.evidence["pageable_copy_refill_ms_per_step"],
                                                 rel=0.01)
    assert top.expected_gain_ms == pytest.approx(planted["planted_ms_per_step"], rel=0.25)
    assert top.evidence["pageable_copy_gpu_ms_per_step"] <= top.evidence["pageable_copy_ms_per_step"]
    assert top.apply is None and "--set" not in top.change


def test_many_tiny_kernels_are_launch_bound():
    advice, _ = _advice("tiny_kernels")
    top = advice.findings[0]
    assert top.rule == "cuda_graphs" and top.evidence["launches_per_step"] >= 1000
    assert top.change.startswith("torch.compile(model, mode='reduce-overhead')")


def test_a_healthy_gemm_bound_program_gets_nothing_large():
    advice, planted = _advice("healthy_gemm")
    assert all((f.expected_gain_pct or 0.0) < 5.0 for f in advice.findings), advice.findings


PAIRS = Path(__file__).parent / "fixtures" / "gpu" / "planted_pairs"


def _straggler_cause(case: str):
    from fleetscope.analysis.analyze import analyze

    planted = json.loads((PAIRS / case / "planted.json").read_text())
    report = analyze(PAIRS / case / "traces", use_hta=False)
    (finding,) = report.windows[0].causes.findings
    return finding, planted


def test_the_same_kernels_longer_are_a_slow_device_with_their_ratio():
    # bench/planted/pairs.py slow_device: rank 1's kernels confined to 44 of the H200's 132 SMs (a green
    # context); same names, grids, shapes and counts as rank 0's. Planted: 5.80 ms more compute a step.
    from fleetscope.analysis.cross_rank.causes import CAUSE_SLOW_DEVICE

    finding, planted = _straggler_cause("slow_device")
    assert (finding.rank, finding.cause) == (planted["late_rank"], CAUSE_SLOW_DEVICE)
    assert finding.extra_kernels == [] and finding.extra_kernel_us == 0.0 and finding.ops_compared >= 10
    assert finding.op_duration_ratio > 1.5
    assert finding.mean_extra_compute_us / 1000 == pytest.approx(planted["late_ms_per_step"], rel=0.15)


def test_more_tokens_on_the_same_kernel_names_are_more_work():
    # pairs.py more_tokens: rank 1's batch has twice the rows; cuBLAS's persistent GEMMs keep their grid, so
    # only the launching op's input shapes tell the bigger GEMMs apart. Planted: 4.11 ms more compute a step.
    from fleetscope.analysis.cross_rank.causes import CAUSE_WORK

    finding, planted = _straggler_cause("more_tokens")
    assert (finding.rank, finding.cause) == (planted["late_rank"], CAUSE_WORK)
    assert finding.op_duration_ratio == pytest.approx(1.0, abs=0.1)
    assert any("[[8192,4096]" in kernel for kernel in finding.extra_kernels), finding.extra_kernels
    assert finding.mean_extra_compute_us / 1000 == pytest.approx(planted["late_ms_per_step"], rel=0.15)


def _host_stalls(name: str):
    from fleetscope.analysis.analyze import analyze

    planted = json.loads((PLANTED / name / "planted.json").read_text())
    (rank,) = analyze(PLANTED / name / "traces", use_hta=False).windows[0].ranks
    return rank.host_stalls, planted


def test_a_pageable_copy_is_host_time_in_the_copy_call_with_its_frame():
    # pageable_copy: 128 MiB .cuda() from pageable memory each step; planted 18.6 ms (timed outside the window)
    stalls, planted = _host_stalls("pageable_copy")
    per_step = [s.pageable_copy_us / 1000 for s in stalls.steps]
    assert [s.pageable_copy_count for s in stalls.steps] == [1, 1, 1]
    assert sorted(per_step)[1] == pytest.approx(planted["planted_ms_per_step"], rel=0.20)
    (copy,) = [f for f in stalls.frames if f.what == "pageable copy"]
    assert copy.frame.startswith("programs.py(") and copy.frame.endswith(": step") and copy.count == 3


def test_with_stack_names_the_frame_that_holds_each_item():
    # item_per_layer_frames: the .item() sits in log_statistic, 8 a step, 3 profiled steps
    stalls, _ = _host_stalls("item_per_layer_frames")
    (sync,) = [f for f in stalls.frames if f.what == "sync"]
    assert sync.frame.endswith(": log_statistic") and sync.count == 24
    assert _host_stalls("item_per_layer")[0].frames == []          # no with_stack, no frames


def test_copies_to_host_that_the_host_reads_are_syncs_not_pinned_copies(tmp_path):
    """The stock transformers eager MoE step (tests/fixtures/gpu/h200-small-hf-eager-2steps.json.gz): its experts
    loop copies which experts got tokens to the host, 2 KB at a time, and launches each expert's work from what
    it read. The host waits in those copies for the GPU's queued work, and the GPU idles after each while the host
    launches again: a read's cost, which pinned memory would only move to the values' first use."""
    trace = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-hf-eager-2steps.json.gz"
    shutil.copyfile(trace, tmp_path / "rank0.pt.trace.json.gz")
    advice = advise(tmp_path)
    syncs, copies = advice.findings[0], {f.rule: f for f in advice.findings}.get("pinned_copies")
    assert syncs.rule == "host_syncs" and syncs.evidence["sync_idle_ms_per_step"] > 1.0
    assert copies is None or (copies.evidence["pageable_copy_refill_ms_per_step"] == 0.0
                              and copies.expected_gain_ms < syncs.expected_gain_ms)
