"""GPU time by phase, user range and kernel category against the synthetic trace's known amounts."""

from __future__ import annotations

import pytest
from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.per_rank.gpu_time import PHASE_OTHER, PHASE_OUTSIDE
from fleetscope.analysis.per_rank.names import kernel_category
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal

from helpers.kineto import KinetoBuilder

AUTOGRAD_TID = 4500


def phased_rank() -> KinetoBuilder:
    """One step of 1000 us. Launches (host time) and GPU durations:
    forward 20-320: gemm 300 us launched at 30, flash attention 100 us at 60 (inside user range
    `attention` 50-100); backward 330-830: elementwise 250 us launched at 400 from the autograd thread
    (the gemm and the elementwise kernel come from aten::mm and aten::add_: External ids 1001 and 1003,
    the builder's first and third kernels);
    optimizer_step 840-900: multi_tensor_apply 40 us at 850; train_step 10-990 outside its phases: memcpy
    30 us at 910; in the step after train_step: a reduction 10 us at 995; outside steps: a reduction
    20 us launched at 1100."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    builder.annotation("train_step", 10, 980.0)
    builder.annotation("forward", 20, 300.0)
    builder.annotation("attention", 50, 50.0)
    builder.annotation("backward", 330, 500.0)
    builder.annotation("optimizer_step", 840, 60.0)
    builder.complete("aten::mm", "cpu_op", 25, 10.0, args={"External id": 1001})   # the gemm's launcher
    builder.complete("aten::add_", "cpu_op", 395, 10.0, args={"External id": 1003})
    builder.kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 100, 300.0, launch_ts=30)
    builder.kernel("flash_fwd_kernel", 420, 100.0, launch_ts=60)
    builder.kernel("vectorized_elementwise_kernel", 530, 250.0, launch_ts=400)
    builder.events[-2]["tid"] = AUTOGRAD_TID              # the launch (cudaLaunchKernel) of the backward kernel
    builder.kernel("multi_tensor_apply_kernel", 860, 40.0, launch_ts=850)
    builder.kernel("Memcpy DtoH (Device -> Pinned)", 950, 30.0, launch_ts=910, cat="gpu_memcpy")
    builder.kernel("reduce_kernel", 1000, 10.0, launch_ts=995)
    builder.kernel("reduce_kernel", 1200, 20.0, launch_ts=1100)
    return builder


def test_gpu_time_goes_to_the_phase_and_range_that_launched_it(tmp_path):
    phased_rank().write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False)
    gpu = report.windows[0].ranks[0].gpu_time
    assert gpu.total_us == pytest.approx(750.0)
    assert gpu.by_phase_us == pytest.approx({"forward": 400.0, "backward": 250.0, "optimizer_step": 40.0,
                                             "train_step": 30.0, PHASE_OTHER: 10.0,
                                             PHASE_OUTSIDE: 20.0})
    assert gpu.by_range_us == pytest.approx({"attention": 100.0})
    assert gpu.by_op_us == pytest.approx({"aten::mm": 300.0, "aten::add_": 250.0})   # linked by External id
    assert gpu.by_category_us == pytest.approx({"gemm": 300.0, "attention": 100.0, "elementwise": 250.0,
                                                "optimizer": 40.0, "memcpy/memset": 30.0, "reduction": 30.0})
    assert report.windows[0].gpu_time.by_phase_us == gpu.by_phase_us


def test_phases_and_gpu_time_are_rendered(tmp_path):
    phased_rank().write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False)
    text, html = render_terminal(report), render_html(report)
    assert "forward 0.30 ms" in text and "backward 0.50 ms" in text     # host phase wall times
    assert "GPU time by phase" in html and "by kernel category" in html


@pytest.mark.parametrize("name, category", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm>", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("void flash::flash_bwd_dq_dk_dv_loop_kernel", "attention"),
    ("void at::native::(anonymous)::cunn_SoftMaxForward", "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor>", "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_poi_fused_add_mul_0", "elementwise"),
    ("void at::native::radixSortKVInPlace", "other"),
])
def test_kernel_categories_by_name(name, category):
    assert kernel_category(name) == category


def test_a_lambda_in_a_kernel_name_is_no_optimizer():
    name = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}"
    assert kernel_category(name) == "elementwise"


def test_nested_user_ranges_give_the_innermost_and_other_threads_none(tmp_path):
    builder = KinetoBuilder(rank=0, world_size=1).step(1, 0, 1000.0)
    builder.annotation("outer", 10, 500.0).annotation("inner", 100, 100.0)
    builder.annotation("other thread", 0, 1000.0, tid=AUTOGRAD_TID)
    for launch, duration in ((50, 10.0), (150, 20.0), (300, 40.0), (700, 80.0)):
        builder.kernel("gemm", 800 + launch / 10, duration, launch_ts=launch)
    builder.write(tmp_path / "rank0.json.gz")
    gpu = analyze(tmp_path, use_hta=False, use_cache=False).windows[0].ranks[0].gpu_time
    assert gpu.by_range_us == pytest.approx({"outer": 50.0, "inner": 20.0})    # the launch at 700: no range
