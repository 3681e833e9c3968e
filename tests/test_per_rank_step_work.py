"""Step work figures read from a trace's mechanisms, on synthetic traces with known amounts: the forward work a
backward pass runs again (activation checkpointing), garbage collections, the GPU idle inside allocator calls."""

from __future__ import annotations

import pytest
from fleetscope.analysis.analyze import analyze

from helpers.kineto import MAIN_TID, KinetoBuilder

BACKWARD_TID = 9


class Launcher:
    """Kernels launched by named host ops on a given thread, each op's External id carried to its kernel."""

    def __init__(self, builder: KinetoBuilder) -> None:
        self.builder, self.next_id = builder, 100

    def run(self, op: str, kernel: str, launch_ts: float, start: float, dur: float, tid: int,
            dims: list | None = None) -> None:
        self.next_id += 1
        ids = {"correlation": self.next_id, "External id": self.next_id}
        op_args = {"External id": self.next_id, **({"Input Dims": dims} if dims is not None else {})}
        self.builder.complete(op, "cpu_op", launch_ts - 1, 6.0, tid=tid, args=op_args)
        self.builder.complete("cudaLaunchKernel", "cuda_runtime", launch_ts, 4.0, tid=tid, args=ids)
        self.builder.complete(kernel, "kernel", start, dur, pid=0, tid=7,
                              args={"device": 0, "stream": 7, **ids, "grid": [1, 1, 1], "block": [128, 1, 1]})


def checkpointed_block(recompute: bool) -> KinetoBuilder:
    """One step, 0-1000 us. Forward on the main thread: layer norm 10-20, addmm 30-80, gelu 90-100. Backward on
    the autograd thread: gelu_backward 200-210; with `recompute`, the block's forward again (layer norm 300-310,
    addmm 320-370, gelu 380-390: 70 us of work, the GPU idle 210-300, 310-320, 370-380: 110 us); then the
    matrix products' mm 400-440 and layer_norm_backward 450-460."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    launch = Launcher(builder)
    launch.run("aten::native_layer_norm", "vectorized_layer_norm_kernel", 5, 10, 10, MAIN_TID)
    launch.run("aten::addmm", "nvjet_gemm_bias_TNT", 25, 30, 50, MAIN_TID)
    launch.run("aten::gelu", "vectorized_elementwise_kernel<gelu>", 85, 90, 10, MAIN_TID)
    launch.run("aten::gelu_backward", "vectorized_elementwise_kernel<gelu_backward>", 195, 200, 10, BACKWARD_TID)
    if recompute:
        launch.run("aten::native_layer_norm", "vectorized_layer_norm_kernel", 295, 300, 10, BACKWARD_TID)
        launch.run("aten::addmm", "nvjet_gemm_bias_TNT", 315, 320, 50, BACKWARD_TID)
        launch.run("aten::gelu", "vectorized_elementwise_kernel<gelu>", 375, 380, 10, BACKWARD_TID)
    launch.run("aten::mm", "nvjet_gemm_NNT", 395, 400, 40, BACKWARD_TID)
    launch.run("aten::native_layer_norm_backward", "layer_norm_grad_input_kernel", 445, 450, 10, BACKWARD_TID)
    return builder


def _work(tmp_path, builder: KinetoBuilder):
    builder.write(tmp_path / "rank0.json.gz")
    return analyze(tmp_path, use_hta=False, use_cache=False, write_default_outputs=False).windows[0].ranks[0].step_work


def test_the_forward_run_again_inside_the_backward_is_recomputation(tmp_path):
    work = _work(tmp_path, checkpointed_block(recompute=True))
    assert work.recompute_us == 70.0        # the three forward kernels, not the backward's mm after them
    assert work.recompute_idle_us == 110.0  # from the gelu_backward's end to the recomputed gelu's


def test_a_backward_without_forward_ops_recomputes_nothing(tmp_path):
    work = _work(tmp_path, checkpointed_block(recompute=False))
    assert (work.recompute_us, work.recompute_idle_us) == (0.0, 0.0)


def test_forward_ops_on_the_forwards_own_thread_are_never_recomputation(tmp_path):
    # the next micro-batch's forward between two backward ops on one thread (CPU autograd) cannot be told apart
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    launch = Launcher(builder)
    launch.run("aten::addmm", "gemm_fwd", 5, 10, 50, MAIN_TID)
    launch.run("aten::gelu_backward", "gelu_bwd", 95, 100, 10, MAIN_TID)
    launch.run("aten::addmm", "gemm_fwd", 195, 200, 50, MAIN_TID)
    launch.run("aten::gelu_backward", "gelu_bwd", 295, 300, 10, MAIN_TID)
    assert _work(tmp_path, builder).recompute_us == 0.0


def test_garbage_collections_are_the_union_of_gc_events_and_collect_frames(tmp_path):
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    Launcher(builder).run("aten::addmm", "gemm", 5, 10, 50, MAIN_TID)
    builder.complete("<built-in function collect>", "python_function", 100, 300.0)
    builder.complete("Python GC", "python_function", 110, 280.0)      # the same collection, inside the call
    builder.complete("Python GC", "python_function", 600, 50.0)       # an automatic one
    builder.complete("Python GC", "python_function", 1500, 50.0)      # after the step: not the step's
    work = _work(tmp_path, builder)
    assert (work.gc_us, work.gc_count, work.python_frames) == (350.0, 2.0, True)


def test_only_the_gpu_idle_inside_allocator_calls_is_lost(tmp_path):
    # a cudaFree 100-400 us waits for the kernel running until 300: 100 us of it the GPU idles
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    Launcher(builder).run("aten::addmm", "gemm", 5, 10, 290, MAIN_TID)
    builder.complete("cudaFree", "cuda_runtime", 100, 300.0)
    work = _work(tmp_path, builder)
    assert (work.allocator_calls, work.allocator_us, work.allocator_idle_us) == (1.0, 300.0, 100.0)


def test_gemm_rates_come_from_the_ops_shapes_against_the_devices_peak(tmp_path):
    # an fp32 [4096 x 4096] x [4096 x 4096] mm in 2.5 ms: 2 * 4096^3 = 137.4 GFLOP -> 54.98 TFLOP/s, 82% of an
    # H200's 67 fp32 TFLOP/s; a GEMM without shapes is left out of the rate and of the shaped share
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 10_000.0)
    launch = Launcher(builder)
    launch.run("aten::mm", "ampere_sgemm_128x64_nn", 5, 10, 2500.0, MAIN_TID, dims=[[4096, 4096], [4096, 4096]])
    launch.run("aten::mm", "ampere_sgemm_128x64_nn", 2600, 2600, 500.0, MAIN_TID)
    work = _work(tmp_path, builder)
    assert work.device == "H200"
    assert work.gemm_tflops_by_precision["fp32"] == pytest.approx(2 * 4096 ** 3 / 2500e-6 / 1e12)
    assert work.gemm_peak_pct_by_precision["fp32"] == pytest.approx(100 * 54.975581 / 67.0, rel=1e-5)
    assert work.gemm_shaped_share == pytest.approx(2500 / 3000)


def test_only_gemm_shapes_give_flops():
    from fleetscope.analysis.per_rank.step_work import gemm_flops
    assert gemm_flops("aten::addmm", [[64], [8, 32], [32, 64], [], []]) == 2 * 8 * 32 * 64
    assert gemm_flops("aten::bmm", [[4, 8, 32], [4, 32, 16]]) == 2 * 4 * 8 * 32 * 16
    assert gemm_flops("aten::mm", [[8, 32], [31, 64]]) is None          # inner dimensions differ
    assert gemm_flops("aten::add", [[8, 32], [8, 32]]) is None
    assert gemm_flops("aten::mm", "garbage") is None


def test_gpu_idle_during_a_collection_is_its_own_cause(tmp_path):
    # the GPU idles 100-900 us; a collection covers 150-850 of it: the gap is "garbage collection", not host work
    # (the step's first 10 us, before its first kernel, are the host's)
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    launch = Launcher(builder)
    launch.run("aten::addmm", "gemm", 5, 10, 90, MAIN_TID)
    builder.complete("Python GC", "python_function", 150, 700.0)
    launch.run("aten::addmm", "gemm", 880, 900, 100, MAIN_TID)
    builder.write(tmp_path / "rank0.json.gz")
    stalls = analyze(tmp_path, use_hta=False, use_cache=False, write_default_outputs=False).windows[0].ranks[0].host_stalls
    assert stalls.idle_by_cause_us == {"garbage collection": 800.0, "host busy elsewhere": 10.0}
    assert stalls.steps_busy_us + sum(stalls.idle_by_cause_us.values()) == stalls.steps_span_us


def update_loop(kernel: str, launches: int, op: str = "aten::mul_") -> KinetoBuilder:
    """One step, 0-20000 us: a backward kernel launched at 95, then `launches` kernels of `op` launched every
    20 us from 200 on the main thread, each 2 us of GPU work."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 20000.0)
    launch = Launcher(builder)
    launch.run("aten::convolution_backward", "wgrad_kernel", 95, 100, 50, BACKWARD_TID)
    for index in range(launches):
        at = 200.0 + 20.0 * index
        launch.run(op, kernel, at, at + 5, 2.0, MAIN_TID)
    return builder


def test_a_loop_over_parameters_after_the_backward_is_a_per_parameter_optimizer(tmp_path):
    work = _work(tmp_path, update_loop("vectorized_elementwise_kernel<MulFunctor>", 100))
    assert (work.optimizer, work.optimizer_impl, work.optimizer_launches) == \
        ("update loop after the backward", "per-parameter", 100)
    assert work.optimizer_host_us == pytest.approx(20.0 * 99 + 4.0)   # first launch to the last one's return
    assert work.optimizer_gpu_us == pytest.approx(200.0)


@pytest.mark.parametrize("kernel, launches, op", [
    ("multi_tensor_apply_kernel<MulFunctor>", 100, "aten::_foreach_mul_"),   # foreach: one kernel for many tensors
    ("vectorized_elementwise_kernel<MulFunctor>", 10, "aten::mul_"),         # a loss's few ops after the backward
    ("vectorized_elementwise_kernel<ReluFunctor>", 100, "aten::relu"),       # work that is no update arithmetic
])
def test_no_update_loop_without_many_per_tensor_updates(tmp_path, kernel, launches, op):
    assert _work(tmp_path, update_loop(kernel, launches, op)).optimizer_impl == ""


def test_fp32_convolution_work_is_read_from_the_ops_that_launched_it(tmp_path):
    """Kernels of convolution ops in fp32 algorithms (FFT, a direct dgrad engine) count; a convolution's
    bf16 kernel, a fp32 GEMM already counted by name, a non-convolution op's float kernel and a depthwise
    kernel whose name carries no type (the same under bf16 autocast) do not."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 2000.0)
    launch = Launcher(builder)
    launch.run("aten::cudnn_convolution", "void fft2d_r2c_32x32<float, false, 0u, false>", 5, 10, 100, MAIN_TID)
    launch.run("aten::cudnn_convolution", "void pointwise_mult_and_sum_complex<float2, 8, 4>", 15, 110, 200, MAIN_TID)
    launch.run("aten::convolution_backward", "void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>",
               400, 410, 300, BACKWARD_TID)
    launch.run("aten::convolution_backward", "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc",
               720, 730, 50, BACKWARD_TID)
    launch.run("aten::cudnn_convolution", "sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs", 800, 810, 40,
               MAIN_TID)
    launch.run("aten::native_batch_norm", "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512>", 900, 910,
               80, MAIN_TID)
    launch.run("aten::convolution_backward", "dgrad2d_c1_k1_nhwc_specialized", 1000, 1010, 70, BACKWARD_TID)
    work = _work(tmp_path, builder)
    assert work.conv_fp32_us == pytest.approx(600.0)
    assert work.gemm_us_by_precision == pytest.approx({"fp32": 40.0, "bf16/fp16": 50.0})


def _gemms(builder: KinetoBuilder, shapes: list[tuple[int, list]]) -> None:
    """`shapes`: (rows, weight) of 2-D aten::mm GEMMs launched 10 us apart from 10 us."""
    launch = Launcher(builder)
    for i, (rows, weight) in enumerate(shapes):
        launch.run("aten::mm", "nvjet_gemm_NNT", 10 + 10 * i, 12 + 10 * i, 5, MAIN_TID,
                   dims=[[rows, weight[0]], weight])


def test_one_weight_over_many_row_counts_is_a_loop_over_routed_groups(tmp_path):
    """An expert loop: each of 8 experts' two GEMMs ([512, 1024] and [1024, 512]) over the tokens routed to it, a
    different count each; beside them a dense layer's GEMM over the batch's 2048 tokens and its backward's, 2 row
    counts of one weight, which is no routing."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    tokens = [500, 524, 494, 498, 540, 495, 512, 533]
    _gemms(builder, [(n, w) for n in tokens for w in ([512, 1024], [1024, 512])]
           + [(2048, [512, 512]), (512, [512, 512])])
    work = _work(tmp_path, builder)
    assert work.routed_gemm_weights == ["[512, 1024] (8 row counts)", "[1024, 512] (8 row counts)"]
    assert work.routed_gemm_launches == 16.0


def expert_loop(kernel_us: float) -> KinetoBuilder:
    """One step, 0-800 us on the host: a dense GEMM over 2048 tokens (launched at 5), then 8 experts 60 us apart
    from 100, each a GEMM over its tokens ([n, 512] x [512, 1024], launched at t) and a SiLU over [n, 1024] (at
    t + 30), each kernel running `kernel_us` from 5 us after its launch or when the GPU is done with the work
    before it; then a dense elementwise over [2048, 512] at 700. Each of the loop's 16 launches is 30 us of host time after the one before it (the first:
    95 us after the dense GEMM's)."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 800.0)
    launch = Launcher(builder)
    launch.run("aten::mm", "nvjet_gemm_NNT", 5, 10, 50, MAIN_TID, dims=[[2048, 512], [512, 512]])
    free = 60.0   # when the GPU is done with the work queued so far: each kernel starts then or 5 us after its launch

    def run(op: str, kernel: str, at: float, dims: list, dur: float) -> None:
        nonlocal free
        start = max(at + 5, free)
        launch.run(op, kernel, at, start, dur, MAIN_TID, dims=dims)
        free = start + dur

    for i, n in enumerate([500, 524, 494, 498, 540, 495, 513, 533]):
        t = 100 + 60 * i
        run("aten::mm", "nvjet_gemm_NNT", t, [[n, 512], [512, 1024]], kernel_us)
        run("aten::silu", "vectorized_elementwise_kernel<silu>", t + 30, [[n, 1024]], kernel_us)
    run("aten::add", "vectorized_elementwise_kernel<add>", 700, [[2048, 512], [2048, 512]], 20)
    return builder


def test_a_host_paced_loop_over_routed_groups_costs_its_dispatch(tmp_path):
    """The GPU waits for each of the loop's launches (5 us kernels, 25 us gaps): one grouped launch gives the
    step back the loop's host time up to the GPU's idle in it, the 145 us wait for the dense op after it
    included: 495 us of dispatch, each gap's wait at most its length."""
    work = _work(tmp_path, expert_loop(kernel_us=5.0))
    assert work.routed_gemm_weights == ["[512, 1024] (8 row counts)"]
    assert 400.0 <= work.routed_loop_saving_us <= 545.0


def test_a_gpu_bound_loop_over_routed_groups_costs_no_dispatch(tmp_path):
    """The same loop with 100 us kernels: the host launches each long before the GPU reaches it, so its
    dispatch is hidden and only the grouped GEMM's own speed could change the step."""
    work = _work(tmp_path, expert_loop(kernel_us=100.0))
    assert work.routed_gemm_weights == ["[512, 1024] (8 row counts)"]
    assert work.routed_loop_saving_us == pytest.approx(0.0, abs=1.0)


def test_a_dense_models_few_row_counts_are_no_routing(tmp_path):
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    _gemms(builder, [(n, [768, 768]) for n in (8192, 1600, 100, 8192, 768, 1600, 2048)])   # 5 row counts
    work = _work(tmp_path, builder)
    assert (work.routed_gemm_weights, work.routed_gemm_launches) == ([], 0.0)


def test_a_score_matrix_is_a_softmax_over_a_gemms_product(tmp_path):
    """Attention written out: a bmm of [32, 1024, 64] by [32, 64, 1024] makes 1024 x 1024 scores, softmax runs
    over [4, 8, 1024, 1024] and a scaling pass reads them. Beside it attention pooling's softmax over
    [4, 384, 4096, 2] (pairs of positions, weights from a convolution, which no GEMM made): no score matrix,
    and its pass is none of the fused kernel's."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 2000.0)
    launch = Launcher(builder)
    launch.run("aten::bmm", "nvjet_gemm_bf16_TNN", 5, 10, 50, MAIN_TID, dims=[[32, 1024, 64], [32, 64, 1024]])
    launch.run("aten::mul", "vectorized_elementwise_kernel<mul>", 70, 75, 30, MAIN_TID,
               dims=[[4, 8, 1024, 1024], []])
    launch.run("aten::_softmax", "cunn_SoftMaxForward", 110, 115, 40, MAIN_TID, dims=[[4, 8, 1024, 1024], [], []])
    launch.run("aten::_softmax", "cunn_SoftMaxForward", 160, 165, 20, MAIN_TID, dims=[[4, 384, 4096, 2], [], []])
    work = _work(tmp_path, builder)
    assert work.score_shapes == ["[4,8,1024,1024]"]
    assert work.score_pass_us == pytest.approx(70.0)
    assert work.softmax_us == pytest.approx(40.0)   # the pooling's softmax is no attention's


def test_a_log_softmax_is_no_attentions_softmax(tmp_path):
    """Without shapes, a step's softmax kernels are attention's unless they make log-probabilities: a
    cross-entropy's log-softmax over the vocabulary (cunn_SoftMaxForward with the LogSoftMax epilogue) and a
    compiled kernel that fused one (triton_..._log_softmax_...) are not counted; a plain softmax is."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 2000.0)
    launch = Launcher(builder)
    launch.run("aten::_softmax", "cunn_SoftMaxForward<4, float, float, float, SoftMaxForwardEpilogue>",
               5, 10, 40, MAIN_TID)
    launch.run("aten::_log_softmax", "cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>",
               60, 65, 300, MAIN_TID)
    launch.run("Torch-Compiled Region", "triton_red_fused__log_softmax__softmax_add_exp_0", 400, 405, 500, MAIN_TID)
    assert _work(tmp_path, builder).softmax_us == pytest.approx(40.0)


def host_paced_attention() -> KinetoBuilder:
    """One step, 0-400 us on the host: attention written out over [4, 8, 1024, 1024] scores, its ops 40 us of host
    work apart and their kernels 5-10 us long, so the GPU waits for each launch: the QK^T bmm (launched at 5),
    a scaling mul (45) and a softmax (85) over the scores, the PV bmm (125); then an add over the output (300)."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 400.0)
    launch = Launcher(builder)
    scores = [4, 8, 1024, 1024]
    launch.run("aten::bmm", "nvjet_gemm_bf16_TNN", 5, 10, 10, MAIN_TID, dims=[[32, 1024, 64], [32, 64, 1024]])
    launch.run("aten::mul", "vectorized_elementwise_kernel<mul>", 45, 50, 5, MAIN_TID, dims=[scores, []])
    launch.run("aten::_softmax", "cunn_SoftMaxForward", 85, 90, 5, MAIN_TID, dims=[scores, [], []])
    launch.run("aten::bmm", "nvjet_gemm_bf16_TNN", 125, 130, 10, MAIN_TID, dims=[[32, 1024, 1024], [32, 1024, 64]])
    launch.run("aten::add", "vectorized_elementwise_kernel<add>", 300, 305, 20, MAIN_TID,
               dims=[[4, 1024, 512], [4, 1024, 512]])
    return builder


def test_a_fused_attention_gives_a_host_paced_step_the_passes_dispatch(tmp_path):
    """The scaling and the softmax, gone into one fused kernel, take their host work with them (40 us each from
    the launch before, not only their 4 us launch calls): every launch after them is 80 us earlier, and the GPU,
    waiting for the host, with it; their 10 us of GPU time is lost in the gaps that wait for the host."""
    work = _work(tmp_path, host_paced_attention())
    assert work.score_shapes == ["[4,8,1024,1024]"] and work.score_pass_us == pytest.approx(10.0)
    assert work.score_saving_us == pytest.approx(80.0, abs=2.0)


@pytest.mark.parametrize("name,precision", [
    ("void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_nn_align1>", "bf16/fp16"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_nn", "bf16/fp16"),
    ("ampere_fp16_s16816gemm_fp16_256x128_ldg8_f2f_stages_32x3_nt", "bf16/fp16"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_nn_align4>", "tf32"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "tf32"),
    ("ampere_sgemm_128x64_nn", "fp32"),
])
def test_a_gemms_numeric_type_is_its_inputs_not_its_accumulator(name, precision):
    """`s1688` / `s16816` name an fp32 accumulator: the math is TF32 only where no half input type is named."""
    from fleetscope.analysis.per_rank.step_work import gemm_precision
    assert gemm_precision(name) == precision


def attention_with_gemms(head_dim: int, score_gemm_us: float) -> KinetoBuilder:
    """One GPU-bound step: a projection GEMM [8192, 1024] x [1024, 1024] in 100 us (17.2 GFLOP: 172 TFLOP/s), then
    attention over [4, 8, 1024, 1024] scores with `head_dim`: QK^T ([32, 1024, d] x [32, d, 1024]), a softmax
    over the scores, PV ([32, 1024, 1024] x [32, 1024, d]), each GEMM `score_gemm_us` long."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 2000.0)
    launch = Launcher(builder)
    scores = [4, 8, 1024, 1024]
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn"
    launch.run("aten::mm", gemm, 5, 10, 100, MAIN_TID, dims=[[8192, 1024], [1024, 1024]])
    launch.run("aten::bmm", gemm, 15, 110, score_gemm_us, MAIN_TID, dims=[[32, 1024, head_dim], [32, head_dim, 1024]])
    at = 110 + score_gemm_us
    launch.run("aten::_softmax", "cunn_SoftMaxForward", 20, at, 40, MAIN_TID, dims=[scores, [], []])
    launch.run("aten::bmm", gemm, 25, at + 40, score_gemm_us, MAIN_TID,
               dims=[[32, 1024, 1024], [32, 1024, head_dim]])
    return builder


def test_score_gemms_slower_than_their_math_give_their_excess_to_a_fused_kernel(tmp_path):
    """Each score GEMM does 2 x 32 x 1024 x 1024 x 64 = 4.3 GFLOP: at half the projection's 172 TFLOP/s that is
    50 us, so GEMMs of 80 us (bound by writing and reading the scores) have 30 us each beyond their math, and the
    GPU-bound step keeps all of it with the softmax's 40 us; GEMMs of 40 us have none."""
    work = _work(tmp_path, attention_with_gemms(head_dim=64, score_gemm_us=80.0))
    assert work.score_gemm_us == pytest.approx(160.0)
    assert work.score_gemm_excess_us == pytest.approx(60.0, rel=0.01)
    assert work.score_saving_us == pytest.approx(100.0, abs=1.0)
    work = _work(tmp_path, attention_with_gemms(head_dim=64, score_gemm_us=40.0))
    assert work.score_gemm_excess_us == pytest.approx(0.0) and work.score_saving_us == pytest.approx(40.0, abs=1.0)


def test_a_split_k_gemm_is_one_gemm_of_its_outputs_type(tmp_path):
    """cuBLASLt splits the projection's K: one aten::mm launches a product that names no type (90 us) and a
    reduction that names the output's bf16 (10 us). That is one GEMM of 17.2 GFLOP in 100 us, bf16: its FLOPs are
    counted once, over both kernels' time, so the rate the score GEMMs are judged against is 172 TFLOP/s as in
    the unsplit case (counted per kernel, the reduction alone made bf16's rate 1,720 TFLOP/s, and every score
    GEMM's whole time excess)."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 2000.0)
    ids = {"correlation": 50, "External id": 50}
    builder.complete("aten::mm", "cpu_op", 1, 6.0, args={"External id": 50, "Input Dims": [[8192, 1024], [1024, 1024]]})
    builder.complete("cudaLaunchKernel", "cuda_runtime", 2, 1.0, args=ids)
    builder.complete("cudaLaunchKernel", "cuda_runtime", 4, 1.0, args={"correlation": 51, "External id": 50})
    for name, start, dur, correlation in (("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN", 10, 90, 50),
                                          ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>",
                                           100, 10, 51)):
        builder.complete(name, "kernel", start, dur, pid=0, tid=7,
                         args={"device": 0, "stream": 7, "correlation": correlation, "External id": 50,
                               "grid": [1, 1, 1], "block": [128, 1, 1]})
    launch = Launcher(builder)
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn"
    launch.run("aten::bmm", gemm, 15, 110, 80.0, MAIN_TID, dims=[[32, 1024, 64], [32, 64, 1024]])
    launch.run("aten::_softmax", "cunn_SoftMaxForward", 20, 190, 40, MAIN_TID, dims=[[4, 8, 1024, 1024], [], []])
    launch.run("aten::bmm", gemm, 25, 230, 80.0, MAIN_TID, dims=[[32, 1024, 1024], [32, 1024, 64]])
    work = _work(tmp_path, builder)
    assert work.score_gemm_excess_us == pytest.approx(60.0, rel=0.01)


def test_a_gemm_kernel_that_names_no_type_takes_its_ops_input_type(tmp_path):
    """Hopper's cuBLASLt kernels (`nvjet_sm90_tst_...`) name no numeric type: with record_shapes, the op's inputs
    do (`Input type` c10::BFloat16), so the GEMM's time and rate are bf16's and its efficiency is read against
    bf16's peak. fp32 inputs say nothing (TF32 or not is the program's setting), nor do inputs that differ."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    for external, (types, start) in enumerate(((["c10::BFloat16", "c10::BFloat16"], 10),
                                               (["float", "float"], 200), (["c10::BFloat16", "float"], 400)), 60):
        ids = {"correlation": external, "External id": external}
        builder.complete("aten::mm", "cpu_op", start - 9, 8.0,
                         args={"External id": external, "Input Dims": [[8192, 1024], [1024, 1024]],
                               "Input type": types})
        builder.complete("cudaLaunchKernel", "cuda_runtime", start - 5, 1.0, args=ids)
        builder.complete("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_NNN", "kernel", start, 100.0, pid=0, tid=7,
                         args={"device": 0, "stream": 7, **ids, "grid": [1, 1, 1], "block": [128, 1, 1]})
    work = _work(tmp_path, builder)
    assert work.gemm_us_by_precision == pytest.approx({"bf16/fp16": 100.0, "unknown": 200.0})
    assert work.gemm_tflops_by_precision["bf16/fp16"] == pytest.approx(171.8, rel=0.01)   # 17.2 GFLOP in 100 us


def test_a_linear_layer_as_wide_as_the_sequence_is_no_score_gemm(tmp_path):
    """A projection of [4, 1024, 1024] activations by a [1024, 1024] weight has a score-like product, but its
    weight has no batch: only products batched on both sides (bmm) are attention's."""
    builder = attention_with_gemms(head_dim=64, score_gemm_us=80.0)
    Launcher(builder).run("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn", 400, 500, 300, MAIN_TID,
                          dims=[[4096, 1024], [1024, 1024]])
    work = _work(tmp_path, builder)
    assert work.score_gemm_us == pytest.approx(160.0)


def test_a_steps_host_events_count_the_ops_a_gpu_traces_table_leaves_out():
    """A GPU trace's table keeps few host ops (events.py: most are never read), but the profiler recorded each,
    at a cost of its own: StepTiming.host_events, which apportions that cost (advise/model.py
    unprofiled_range_ms), counts them, and data_loader_events those inside the loader's ranges."""
    from fleetscope.analysis.per_rank.events import extract_events
    from fleetscope.analysis.per_rank.steps import find_steps
    trace = KinetoBuilder().step(1, 0.0, 1000.0)
    trace.annotation("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 10.0, 100.0)
    for i in range(3):                                  # inside the loader's range
        trace.op("aten::stack", 20.0 + 10 * i, 5.0)
    for i in range(5):                                  # the model's ops, each launching a kernel
        trace.op("aten::mm", 200.0 + 100 * i, 20.0)
        trace.kernel("ampere_sgemm_128x64_nn", 210.0 + 100 * i, 50.0, launch_ts=205.0 + 100 * i)
    trace.op("aten::mm", 1500.0, 20.0)                  # after the step: not its own
    events = extract_events(trace.document())
    assert events.omitted_host_ops == 9
    (step,), _ = find_steps(events)
    # 8 ops left out of the table, 5 launch calls, the loader's range and the step's own annotation
    assert step.host_events == 8 + 5 + 1 + 1
    assert step.data_loader_events == 3
