"""The GPU-work family: what the step's own work costs beyond what it must, from what ran (per_rank/step_work.py):
matrix products in fp32 on the SIMT cores, an optimizer that runs one set of kernels per parameter tensor, a
step that calls the CUDA allocator, and a backward that recomputes the forward."""

from __future__ import annotations

from fleetscope.analysis.per_rank.host_stalls import IDLE_ALLOCATOR
from fleetscope.analysis.per_rank.step_work import TENSOR_CORE_SPEEDUP, UPDATE_LOOP_LABEL

from .model import Evidence, Finding, Rule, profiled_scale, settings_change, step_gain, trace_gain, trainer_change

FP32_GEMM_SHARE = 0.10
"""fp32 (SIMT) GEMM time above this share of the step: the matrix products could use the tensor cores."""
OPTIMIZER_SHARE = 0.10
"""A per-parameter optimizer whose ranges take at least this share of the step: fuse it."""
FOREACH_GROUP_CALLS = 8
"""Calls of one foreach op per step from which a foreach optimizer's parameter groups are many: torch.optim
calls each once per group (and device and dtype); the recorded programs' foreach optimizers call each once or
twice (1-2 groups), one with a group per parameter 241 times."""
SOFTMAX_SHARE = 0.05
"""Softmax kernels (or all the passes over the scores, where the trace records shapes) above this share of the
step, with no fused attention kernel: attention on materialized scores worth fusing."""
SCORE_PASSES = 2.0
"""The softmax's time is multiplied by this for the gain: an attention written by hand also scales and masks
the score matrix in passes of their own (forward and backward), each about as long as the softmax (one read and
one write of the scores); a fused kernel never writes the scores at all."""
ALLOCATOR_SHARE = 0.05
"""Host time inside cudaMalloc / cudaFree above this share of the step: the caching allocator misses."""
RECOMPUTE_SHARE = 0.05
"""Forward work recomputed in the backward above this share of the step: checkpointing costs that much."""


def precision(e: Evidence) -> Finding | None:
    """GEMMs in fp32 on the SIMT cores (their kernel names say so) and fp32 convolutions (FFT, Winograd and
    direct algorithms cuDNN picks with TF32 off: step_work.py conv_fp32_us) over FP32_GEMM_SHARE of the step.
    Gain: that work TENSOR_CORE_SPEEDUP times faster, as far as the saving reaches the step's end
    (per_rank/saving_reach.py: the GPU waiting for the host absorbs it); where the trace cannot tell, the saving
    times the share of the step the GPU is busy, said so."""
    gemm_ms = e.gemm_ms_by_precision.get("fp32", 0.0)
    fp32_ms = gemm_ms + e.conv_fp32_ms
    if e.basis != "gpu" or not e.step_ms or fp32_ms < FP32_GEMM_SHARE * e.step_ms:
        return None
    faster_ms = fp32_ms * (1.0 - 1.0 / TENSOR_CORE_SPEEDUP)
    if e.fp32_saving_ms is not None:
        saved_ms = e.fp32_saving_ms
        reach = (f"{saved_ms:.2f} of the {faster_ms:.2f} ms the kernels would save reach the step's end; the rest "
                 "is absorbed where the GPU then waits for the host")
    else:
        busy_share = 1.0 - (e.idle_pct or 0.0) / 100.0
        saved_ms = faster_ms * busy_share
        reach = f"counted over the {busy_share:.0%} of the step the GPU is busy"
    gain, pct = trace_gain(e, saved_ms)
    others = {kind: round(ms, 3) for kind, ms in e.gemm_ms_by_precision.items() if kind != "fp32"}
    return Finding(
        rule="precision", title="the matrix products run in fp32, off the tensor cores",
        evidence={"fp32_gemm_ms_per_step": round(gemm_ms, 3), "fp32_conv_ms_per_step": round(e.conv_fp32_ms, 3),
                  "gpu_idle_pct": round(e.idle_pct or 0.0, 1),
                  **({"saving_reaching_step_end_ms": round(e.fp32_saving_ms, 3)} if e.fp32_saving_ms is not None else {}),
                  **{f"{kind}_gemm_ms_per_step": ms for kind, ms in others.items()}},
        expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
        change="run the forward and backward under torch.autocast('cuda', dtype=torch.bfloat16), or at least "
               "allow TF32: torch.set_float32_matmul_precision('high') (torch.backends.cuda.matmul.allow_tf32 = "
               "True; torch.backends.cudnn.allow_tf32 = True for convolutions)",
        why=f"{gemm_ms:.2f} ms per step of GEMM kernels whose names say fp32 on the SIMT cores (sgemm / simt / "
            f"f32f32)" + (f" and {e.conv_fp32_ms:.2f} ms of fp32 convolution kernels (FFT, Winograd or direct "
                          "algorithms, by the convolution ops that launched them)" if e.conv_fp32_ms else "")
            + "; the tensor cores run the same products several times faster (gain assumed: "
            f"{TENSOR_CORE_SPEEDUP:.0f}x; {reach})")


def optimizer_impl(e: Evidence) -> Finding | None:
    """The optimizer launches one set of kernels per parameter tensor (neither foreach nor fused kernels ran
    inside its ranges), or runs its foreach ops once per parameter group over many groups (FOREACH_GROUP_CALLS
    calls of one foreach op a step: a group per parameter, for layer-wise learning rates), and its ranges' host
    time beyond their kernels' takes OPTIMIZER_SHARE of the step. Gain: the ranges' host time less the GPU time
    of their kernels, which a fused optimizer still spends (the same bytes to move)."""
    host_ms = e.optimizer_host_ms or 0.0
    gpu_ms = e.optimizer_gpu_ms or 0.0
    grouped = e.optimizer_impl == "foreach" and (e.optimizer_foreach_calls or 0.0) >= FOREACH_GROUP_CALLS
    if (e.optimizer_impl != "per-parameter" and not grouped) or not e.step_ms \
            or host_ms - (gpu_ms if grouped else 0.0) < OPTIMIZER_SHARE * e.step_ms:
        return None
    gain, pct = trace_gain(e, max(host_ms - gpu_ms, 0.0))
    if e.optimizer == UPDATE_LOOP_LABEL:
        return _update_loop_finding(e, host_ms, gpu_ms, gain, pct)
    if grouped:
        return _many_groups_finding(e, host_ms, gpu_ms, gain, pct)
    name = e.optimizer or "the optimizer"
    return Finding(
        rule="optimizer_impl", title=f"{name} runs one set of kernels per parameter tensor",
        evidence={"optimizer": name, "optimizer_ms_per_step": round(host_ms, 3),
                  "optimizer_launches_per_step": round(e.optimizer_launches or 0.0, 1),
                  "optimizer_gpu_ms_per_step": round(gpu_ms, 3), "implementation": e.optimizer_impl},
        expected_gain_ms=gain, expected_gain_pct=pct, confidence="high",
        change=f"construct torch.optim.{name}(..., fused=True) (or foreach=True where fused is not offered); "
               "foreach=False forces the per-tensor loop",
        why=f"{name}.step takes {host_ms:.2f} ms per step on the host for {e.optimizer_launches or 0.0:.0f} "
            f"launches while its kernels run {gpu_ms:.2f} ms: no multi_tensor_apply or fused kernel ran, so each "
            "parameter tensor gets its own kernels and the GPU waits for their launches")


def _many_groups_finding(e: Evidence, host_ms: float, gpu_ms: float, gain: float | None,
                         pct: float | None) -> Finding:
    """optimizer_impl for a foreach optimizer over many parameter groups."""
    name = e.optimizer or "the optimizer"
    calls = e.optimizer_foreach_calls or 0.0
    return Finding(
        rule="optimizer_impl", title=f"{name} runs its foreach kernels once per parameter group, over many groups",
        evidence={"optimizer": name, "optimizer_ms_per_step": round(host_ms, 3),
                  "optimizer_launches_per_step": round(e.optimizer_launches or 0.0, 1),
                  "optimizer_gpu_ms_per_step": round(gpu_ms, 3), "implementation": e.optimizer_impl,
                  "foreach_calls_per_step": round(calls, 1)},
        expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
        change=f"build fewer parameter groups: one per distinct learning rate and weight decay (per layer or "
               f"per stage for layer-wise decay, not per parameter), and construct torch.optim.{name}(..., "
               "fused=True)",
        why=f"{name}.step takes {host_ms:.2f} ms per step on the host for {e.optimizer_launches or 0.0:.0f} "
            f"launches while its kernels run {gpu_ms:.2f} ms: its foreach ops are called {calls:.0f} times a step "
            "each, once per parameter group, so each group's handful of tensors gets its own launches and Python, "
            "and the GPU waits for them")


def _update_loop_finding(e: Evidence, host_ms: float, gpu_ms: float, gain: float | None,
                         pct: float | None) -> Finding:
    """optimizer_impl for a loop over parameter tensors written in the program (step_work.py _update_loop)."""
    return Finding(
        rule="optimizer_impl", title="the step updates its parameters one tensor at a time after the backward",
        evidence={"optimizer": UPDATE_LOOP_LABEL, "optimizer_ms_per_step": round(host_ms, 3),
                  "optimizer_launches_per_step": round(e.optimizer_launches or 0.0, 1),
                  "optimizer_gpu_ms_per_step": round(gpu_ms, 3), "implementation": e.optimizer_impl},
        expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
        change="replace the loop over parameters with torch.optim's own optimizer (torch.optim.AdamW(..., "
               "fused=True) for a hand-written AdamW), or its arithmetic with multi-tensor ops over all parameters "
               "at once (torch._foreach_mul_, torch._foreach_add_, torch._foreach_lerp_ for a weight EMA)",
        why=f"after the backward the host launches {e.optimizer_launches or 0.0:.0f} elementwise update kernels per "
            f"step (mul_, add_, addcdiv_, ... by the ops that launched them) over {host_ms:.2f} ms while they run "
            f"{gpu_ms:.2f} ms on the GPU, outside any torch.optim range and with no multi_tensor_apply or fused "
            "kernel: each parameter tensor gets its own kernels and the GPU waits for their launches")


def eager_attention(e: Evidence) -> Finding | None:
    """Softmax kernels, or with record_shapes the passes over the score matrix and the score GEMMs' excess, over
    SOFTMAX_SHARE of the step and no fused attention kernel in it: attention computed from a materialized score
    matrix (softmax(QK^T / sqrt(d) + mask) V written out). Gain: the passes over the
    score matrix that are no GEMM (step_work.py score_pass_rows: the softmax, scaling, masking, dropout and their
    backward, told by the score matrix's shape among their inputs), which a fused kernel never makes, with the host
    work that dispatched them, and the GEMMs over the scores' time beyond their math at a fused kernel's rate
    (step_work.py score_gemm_excess: a small head dimension leaves them writing and reading the scores), as far as
    that time reaches the step's end (per_rank/saving_reach.py); their math stays (a fused kernel does it).
    Without record_shapes, an estimate stated in SCORE_PASSES: the softmax's time and as much again."""
    if e.basis != "gpu" or not e.step_ms or e.fused_attention_ms > 0 or not e.softmax_ms:
        return None
    # the softmax is one of the passes a fused kernel removes: where the trace shows them all, they are the cost
    if max(e.softmax_ms, e.score_pass_ms + e.score_gemm_excess_ms) < SOFTMAX_SHARE * e.step_ms:
        return None
    busy_share = 1.0 - (e.idle_pct or 0.0) / 100.0
    if e.score_pass_ms > 0:
        removed_ms = e.score_pass_ms + e.score_gemm_excess_ms
        saved_ms = e.score_saving_ms if e.score_saving_ms is not None else removed_ms * busy_share
        gemms = (f", and the GEMMs over it {e.score_gemm_ms:.2f} ms, {e.score_gemm_excess_ms:.2f} ms of it beyond "
                 "their math at half the program's GEMM rate (the scores written and read)"
                 if e.score_gemm_excess_ms >= 0.01 else "")
        basis = (f"the passes over the score matrix ({', '.join(e.score_shapes) or 'its shape'}) that are no GEMM "
                 f"take {e.score_pass_ms:.2f} ms per step{gemms}; {saved_ms:.2f} ms of that reaches the step's end")
    else:
        saved_ms = SCORE_PASSES * e.softmax_ms * busy_share
        basis = (f"gain assumed: {SCORE_PASSES:.0f}x the softmax's time, over the {busy_share:.0%} of the step the "
                 "GPU is busy; record_shapes=True lets the trace show every pass over the scores")
    gain, pct = trace_gain(e, saved_ms)
    return Finding(
        rule="eager_attention", title="attention runs on materialized scores (no fused attention kernel)",
        evidence={"softmax_ms_per_step": round(e.softmax_ms, 3), "fused_attention_ms_per_step": 0.0,
                  "score_pass_ms_per_step": round(e.score_pass_ms, 3),
                  "score_gemm_ms_per_step": round(e.score_gemm_ms, 3),
                  "score_gemm_excess_ms_per_step": round(e.score_gemm_excess_ms, 3),
                  **({"score_shapes": "; ".join(e.score_shapes)} if e.score_shapes else {})},
        expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
        change="compute attention with torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=..., "
               "is_causal=...) (flash / memory-efficient / cuDNN kernels) instead of softmax(q @ k.T) @ v",
        why=f"{e.softmax_ms:.2f} ms per step of softmax kernels and no flash, memory-efficient or cuDNN attention "
            "kernel: the score matrix is written, scaled, masked and read again in memory-bound passes that a "
            f"fused kernel never makes ({basis})")


def allocator_churn(e: Evidence) -> Finding | None:
    """cudaMalloc / cudaFree calls inside the profiled steps taking ALLOCATOR_SHARE of the step: the caching
    allocator gives memory back and asks for it again (torch.cuda.empty_cache() in the loop, or a pool that
    cannot serve the step's sizes). Gain: the GPU idle gaps the host spent mostly inside them (host_stalls.py
    IDLE_ALLOCATOR: with the allocator's own host work around the calls), or the GPU idle while the host was
    inside them where that is more (a cudaFree waits for the device: the part of that wait the GPU is still
    busy costs nothing), at least ALLOCATOR_SHARE. The GPU's idle inside the calls is the driver's (cudaFree
    waiting for the device, then the driver's own work), which the profiler does not lengthen: it is not scaled
    to the steady step, as host_syncs leaves its waits unscaled; the host work around the calls is."""
    calls_ms = e.allocator_ms or 0.0
    if e.basis != "gpu" or not e.step_ms or calls_ms < ALLOCATOR_SHARE * e.step_ms:
        return None
    lost_ms = max(e.allocator_idle_ms, e.idle_cause_ms.get(IDLE_ALLOCATOR, 0.0))
    if lost_ms < ALLOCATOR_SHARE * e.step_ms:
        return None
    inside_ms = min(e.allocator_idle_ms, lost_ms)
    gain, pct = step_gain(e, inside_ms + (lost_ms - inside_ms) * profiled_scale(e))
    return Finding(
        rule="allocator_churn", title="the step allocates device memory from the driver",
        evidence={"allocator_calls_per_step": round(e.allocator_calls or 0.0, 1),
                  "allocator_ms_per_step": round(calls_ms, 3), "allocator_idle_ms_per_step": round(lost_ms, 3)},
        expected_gain_ms=gain, expected_gain_pct=pct, confidence="high",
        change="remove torch.cuda.empty_cache() (and gc-driven frees) from the loop; where sizes vary step to "
               "step, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or pad to fixed sizes",
        why=f"{e.allocator_calls or 0.0:.0f} cudaMalloc/cudaFree calls per step take {calls_ms:.2f} ms on the host "
            f"and the GPU idles {lost_ms:.2f} ms of it (cudaFree waits for the device to finish, then the host "
            "frees and allocates while nothing runs): the caching allocator normally serves every step from its "
            "pool and calls neither")


def activation_checkpointing(e: Evidence) -> Finding | None:
    """The backward pass runs forward work again (step_work.py: forward-only kernels on the backward thread, in
    the forward's order) for RECOMPUTE_SHARE of the step: activation checkpointing trades that compute for
    memory. Not where the run ran out of memory or retried allocations (the memory is needed). Gain: the
    recomputed GPU time and the GPU idle while the host set each recomputation up and launched it again
    (checkpoint's hooks, the forward's dispatch a second time); the price is the activations' memory. Only that
    host-paced idle is scaled to the steady step: the profiler lengthens the host's dispatch, not the recomputed
    kernels."""
    lost_ms = recompute_cost_ms(e)
    if e.basis != "gpu" or not e.step_ms or lost_ms < RECOMPUTE_SHARE * e.step_ms or e.ooms or e.alloc_retries:
        return None
    gain, pct = step_gain(e, e.recompute_ms + e.recompute_idle_ms * profiled_scale(e))
    mode = e.setting("performance", "activation_checkpointing", "none")
    lighter = "selective" if mode == "full" else "none"
    evidence = {"recompute_ms_per_step": round(e.recompute_ms, 3),
                "recompute_idle_ms_per_step": round(e.recompute_idle_ms, 3), "gpu_idle_pct": round(e.idle_pct or 0.0, 1)}
    if e.peak_reserved_mb:
        evidence["peak_reserved_mb"] = round(e.peak_reserved_mb, 1)
    return Finding(
        rule="activation_checkpointing", title="the backward pass recomputes the forward (activation checkpointing)",
        evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
        **trainer_change(settings_change(f"performance.activation_checkpointing={lighter}"),
                         note="where the activations fit in memory"),
        why=f"{e.recompute_ms:.2f} ms per step of forward kernels run again inside the backward, in the forward's "
            f"own order, and the GPU idle {e.recompute_idle_ms:.2f} ms while the host set those recomputations up: "
            "checkpointed blocks keep no activations and compute them twice; where memory allows, keeping them "
            "saves that time for the activations' memory")


def recompute_cost_ms(e: Evidence) -> float:
    """What the recomputation costs per profiled step: its GPU work and the GPU idle it left."""
    return e.recompute_ms + e.recompute_idle_ms


RULES = (
    Rule(find=activation_checkpointing, recovers="GPU recompute time",
         in_user_code="checkpoint fewer blocks (torch.utils.checkpoint only on the blocks whose activations do not "
                      "fit; or selective checkpointing that saves the matrix products' outputs: "
                      "torch.utils.checkpoint.create_selective_checkpoint_contexts), where the activations fit"),
    Rule(find=precision, recovers="GPU GEMM time",
         change_is_code="autocast and the TF32 switches are set in the program's own code"),
    Rule(find=optimizer_impl, recovers="optimizer host time",
         change_is_code="the optimizer is constructed in the program's own code"),
    Rule(find=eager_attention, recovers="GPU attention time",
         change_is_code="the attention is the model's own code"),
    Rule(find=allocator_churn, recovers="allocator calls",
         change_is_code="the frees and empty_cache() calls are the program's own"),
)
