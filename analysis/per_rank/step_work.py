"""What one rank's profiled steps spent their time on, beyond idle and busy: the numeric type of its matrix
products, how its optimizer runs, and how often it calls the CUDA allocator. Each figure is the mean per
profiled step; each is what a rule of the advisor needs to tell one cause of a slow step from another.

GEMM precision, from the kernel's name (the library writes the types into it): fp32 on the SIMT cores
(`sgemm`, `simt`, `f32f32_f32f32`), TF32 on the tensor cores (`tf32`, CUTLASS's `s1688`/`s16816` tensor-op
kernels), bf16/fp16 and fp8; a GEMM whose name says none of these is "unknown". Only work launched inside
a step counts (by its launch call; work without one by its own start). Convolutions, by the op that launched
them (`aten::cudnn_convolution`, `aten::convolution_backward`, ...): with TF32 off and no autocast cuDNN runs them
in fp32 with algorithms whose kernels are no GEMM by name (FFT transforms and their complex products, Winograd,
direct `dgrad_engine<float, ...>`); every kernel of a convolution op whose name says fp32 or that names no
tensor-core type is fp32 convolution work (conv_fp32_us), what TF32 or bf16 would move to the tensor cores.

The optimizer: the ranges torch.optim opens around each step (`Optimizer.step#AdamW.step`), their host wall
time, the launch calls the host made inside them and the GPU time of what they launched. Its implementation
from the kernels: fused (`fused_adam...`, `FusedAdam...`), foreach (`multi_tensor_apply_kernel`) or, with
neither, one set of kernels per parameter tensor.

The allocator: `cudaMalloc` / `cudaFree` (and HIP's) calls in the step and the host time inside them. The
caching allocator calls them only when its pool cannot serve a request (after `torch.cuda.empty_cache()`,
under fragmentation, or as memory grows); `cudaFree` also waits for the whole device.

Compilation: the host time inside torch.compile's ranges (names.is_compile_region) in the step, and the
compile ids (`compile_id=F/N` in its annotations) seen there: a program that recompiles every step shows
new ids in every step.

Copies to the host: device-to-host copies launched by copy ops (`aten::copy_`, `aten::_to_copy`: `.cpu()`,
`.to("cpu")`, a `state_dict` saved), not by value reads (`.item()`), their count and GPU time per step.

Recomputation (activation checkpointing): on a thread that runs the backward pass (it launches backward ops,
names.is_backward_op) other than the one that launched the step's forward, kernels of forward-only ops
(names.FORWARD_ONLY_OPS) between two backward ops are a forward run again, and it runs the forward's kernels
in the forward's order: the run counted is what matches the forward's kernel sequence around such a kernel
(the matrix products between them too: a bias-free linear's `aten::mm` is no forward-only op by itself). A backward on the forward's own thread (CPU autograd) cannot be told from the
next micro-batch's forward: nothing is counted there.

GEMM rates (traces with record_shapes): each GEMM op's FLOPs from its input shapes (`aten::mm` [M,K]x[K,N]:
2MNK; `aten::addmm`, `aten::bmm`, `aten::baddbmm` and `aten::_scaled_mm` alike), counted once per op, over the
time of the GEMM kernels it launched; against the device's dense peak for the kernels' type where
traces/device_peaks.py lists the GPU.

Garbage collection (with_stack traces): the host time inside torch.profiler's `Python GC` events and
`gc.collect()` frames (names.is_gc_frame) in the step, their union, and how many collections ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import re

from fleetscope.analysis.per_rank.events import GPU_ACTIVITY_KINDS, NO_ID, Kind, TraceEvents
from fleetscope.analysis.per_rank.intervals import Intervals, clip, covered_between, union
from fleetscope.analysis.per_rank.names import (CATEGORY_GEMM, FORWARD_ONLY_OPS, GEMM_OP_OPERANDS, is_backward_op,
                                                is_compile_region,
                                                is_device_to_host_copy, is_gc_frame, is_launch_call, is_pinned_host_copy,
                                                kernel_category)
from fleetscope.analysis.per_rank.steps import StepTiming, in_host_ranges
from fleetscope.traces.device_peaks import device_name, peak_tflops, pinned_copy_gbps

PRECISION_FP32, PRECISION_TF32, PRECISION_HALF, PRECISION_FP8 = "fp32", "tf32", "bf16/fp16", "fp8"
PRECISION_UNKNOWN = "unknown"
_PRECISION_NEEDLES = (
    # first match wins, on the lower-cased kernel name; the input type before the instruction shape: `s1688`
    # names fp32 accumulation, TF32 only where no half type is named (`cutlass_75_tensorop_bf16_s1688gemm_bf16`,
    # cuBLAS's `ampere_bf16_s16816gemm_bf16` multiply bf16)
    (PRECISION_FP8, ("e4m3", "e5m2", "fp8", "f8f8")),
    (PRECISION_TF32, ("tf32",)),
    (PRECISION_HALF, ("bf16", "bfloat16", "f16", "fp16", "half", "hgemm", "h1688", "h16816", "h884", "bgemm")),
    (PRECISION_TF32, ("s1688", "s16816", "s884", "tensorop_s")),
    (PRECISION_FP32, ("sgemm", "simt", "f32f32_f32f32", "gemm_f32", "fp32", "cf32")),
)
_FP32_CONV_NEEDLES = ("float", "f32", "fft", "winograd", "implicit_convolve_sgemm")
"""Kernel names of fp32 convolution algorithms (cuDNN's templates name `float`; FFT and Winograd run only in fp32
here): with the op launching them a convolution and no half or TF32 marker in the name. A name without a type
says nothing: cuDNN's depthwise kernels (`dgrad2d_c1_k1_nhwc_specialized`, `wgrad2d_c1_k1_nhwc`) run the same
for bf16 inputs under autocast and use no tensor cores either way."""
OPTIMIZER_RANGE_PREFIX = "Optimizer.step#"
IMPL_FUSED, IMPL_FOREACH, IMPL_PER_PARAMETER = "fused", "foreach", "per-parameter"
ALLOCATOR_CALLS = frozenset({"cudaMalloc", "cudaFree", "cudaMallocHost", "cudaFreeHost", "cudaHostAlloc",
                             "cuMemAlloc", "cuMemAlloc_v2", "cuMemFree", "cuMemFree_v2",
                             "hipMalloc", "hipFree", "hipHostMalloc", "hipHostFree"})


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """One rank's profiled steps, per step (mean over them)."""

    steps: int
    gemm_us_by_precision: dict[str, float] = field(default_factory=dict)
    """GPU time of GEMM kernels per step by numeric type (module docstring)."""
    conv_fp32_us: float = 0.0
    """GPU time per step of fp32 convolution kernels that are no GEMM by name (FFT, Winograd, direct engines;
    module docstring): fp32 work beside the fp32 GEMMs."""
    optimizer: str = ""
    """The optimizer's class from its range (`AdamW`); "" without one."""
    optimizer_impl: str = ""
    """IMPL_FUSED, IMPL_FOREACH or IMPL_PER_PARAMETER ("" without an optimizer range)."""
    optimizer_host_us: float = 0.0
    """Host wall time of the optimizer's ranges per step."""
    optimizer_launches: float = 0.0
    """Launch calls the host made inside them per step."""
    optimizer_gpu_us: float = 0.0
    """GPU time of the work launched inside them per step."""
    optimizer_foreach_calls: float = 0.0
    """Calls per step of the foreach op called most inside them (`aten::_foreach_mul_`): torch.optim calls each
    once per parameter group (and per device and dtype), so many calls are many groups."""
    allocator_calls: float = 0.0
    """cudaMalloc / cudaFree calls per step."""
    allocator_us: float = 0.0
    """Host time inside them per step."""
    allocator_idle_us: float = 0.0
    """GPU idle while the host was inside them per step: a cudaFree waits for the device, and only the part of
    the wait the GPU spends idle is lost."""
    compile_us: float = 0.0
    """Host time inside torch.compile's ranges per step (their union)."""
    compile_ids: int = 0
    """Distinct compile ids in the steps' compile annotations."""
    host_copies: float = 0.0
    """Device-to-host copies launched by copy ops per step."""
    host_copy_us: float = 0.0
    """Their GPU time per step."""
    graph_launches: float = 0.0
    """CUDA (or HIP) graph replays launched per step: the step already replays captured work."""
    softmax_us: float = 0.0
    """GPU time of softmax kernels (forward and backward) per step."""
    fused_attention_us: float = 0.0
    """GPU time of fused attention kernels (flash, memory-efficient, cuDNN SDPA, FMHA) per step."""
    score_pass_us: float = 0.0
    """GPU time per step of the non-GEMM passes over a score matrix (score_pass_rows; record_shapes traces)."""
    score_shapes: list[str] = field(default_factory=list)
    """The score matrices' shapes ("[4,16,2048,2048]"), most softmax time first."""
    score_gemm_us: float = 0.0
    """GPU time per step of the GEMMs over a score matrix (QK^T, PV and their backward's: score_gemm_excess)."""
    score_gemm_excess_us: float = 0.0
    """Of that, the time beyond their math at a fused kernel's rate (score_gemm_excess): the scores written and
    read by products too small in their head dimension to be bound by their math."""
    score_saving_us: float | None = None
    """How much shorter the step would be without those passes and that excess, as far as it reaches the step's
    end (saving_reach.py); None where the idle gaps cannot tell or there are none."""
    value_use_saving_us: float | None = None
    """How much shorter the step would be without the host's use of the values its syncs read (a `.tolist()`
    looped over in Python), as far as it reaches the step's end (saving_reach.value_use_saving_us); None where the
    idle gaps cannot tell or nothing syncs."""
    gemm_tflops_by_precision: dict[str, float] = field(default_factory=dict)
    """Achieved TFLOP/s of the GEMMs whose shapes the trace records (record_shapes), by numeric type: their
    2*M*N*K (times the batch) over their kernels' time (module docstring)."""
    gemm_shaped_share: float = 0.0
    """Share of the GEMM time those GEMMs hold (0 without record_shapes)."""
    device: str = ""
    """The GPU as the peak table lists it (traces/device_peaks.py); "" for one it does not."""
    gemm_peak_pct_by_precision: dict[str, float] = field(default_factory=dict)
    """Achieved over the device's dense peak for that type, in percent (listed devices only)."""
    recompute_us: float = 0.0
    """GPU time of forward work the backward pass ran again per step (module docstring)."""
    recompute_idle_us: float = 0.0
    """GPU idle per step from the end of the work before each recomputed run to the run's end: the host
    setting the recomputation up and launching it again."""
    gc_us: float = 0.0
    """Host time inside garbage collections per step (with_stack traces; 0 where the trace cannot show them)."""
    gc_count: float = 0.0
    """Collections per step."""
    fp32_saving_us: float | None = None
    """How much shorter the step would be per step with that fp32 math TENSOR_CORE_SPEEDUP times faster, as far
    as it reaches the step's end (saving_reach.py); None where the idle gaps cannot tell."""
    pinned_copy_gbps: float = 0.0
    """The rate the trace's own large copies between pinned host memory and the device reached (bytes over their
    GPU time, copies of PINNED_RATE_MIN_BYTES or more anywhere in the trace); 0 without such copies."""
    host_link: str = ""
    """The GPU's host link as traces/device_peaks.py lists it; "" for a GPU it does not."""
    host_link_gbps: float = 0.0
    """What a pinned copy over that link reaches (the table's figure)."""
    python_frames: bool = False
    """The trace holds Python frames (with_stack): work outside any op can be named, and collections seen."""
    routed_gemm_weights: list[str] = field(default_factory=list)
    """The weights ("[512, 1024]") that GEMMs in the steps multiplied by ROUTED_ROW_COUNTS or more different
    numbers of rows (routed_gemms; record_shapes traces), most launches first, each with its count of row
    counts ("[512, 1024] (49 row counts)")."""
    routed_gemm_launches: float = 0.0
    """GEMM launches over those weights per step."""
    routed_loop_saving_us: float | None = None
    """How much shorter the step would be with the loop over those groups gone (one grouped launch per GEMM,
    nothing read to count the groups), beyond the idle its reads leave, as far as it reaches the step's end
    (saving_reach.routed_loop_saving_us); None where the idle gaps cannot tell or there is no such loop."""


def gemm_precision(name: str) -> str:
    folded = name.lower()
    for precision, needles in _PRECISION_NEEDLES:
        if any(needle in folded for needle in needles):
            return precision
    return PRECISION_UNKNOWN


def measure_step_work(events: TraceEvents, steps: list[StepTiming], device_properties: Any = None) -> StepWork | None:
    """None without steps or without GPU activity (the figures are about GPU work); `device_properties`: the
    trace's `deviceProperties` (the GPU's name: its peaks)."""
    if not steps or not events.has_gpu_activity:
        return None
    count = len(steps)
    in_steps = in_host_ranges(events.start_us, steps)
    return StepWork(steps=count, gemm_us_by_precision=_gemm_by_precision(events, steps, count),
                    conv_fp32_us=_conv_fp32_us(events, steps) / count,
                    **_gemm_rates(events, steps, device_properties),
                    **_optimizer(events, steps, in_steps, count), **_allocator(events, in_steps, count),
                    **_compilation(events, steps, in_steps, count), **_host_copies(events, steps, count),
                    **_attention(events, steps, count), **_recompute(events, steps, count),
                    **routed_gemms(events, steps, count),
                    **_garbage_collection(events, in_steps, count), **_host_link(events, device_properties),
                    python_frames=bool(events.of_kind(Kind.PYTHON_FUNCTION).any()),
                    graph_launches=int(np.count_nonzero(events.of_kind(Kind.CUDA_RUNTIME) & in_steps
                                                        & events.names_matching(lambda n: n in GRAPH_LAUNCHES))) / count)


def _kernel_us_by_name(events: TraceEvents, steps: list[StepTiming]) -> dict[str, float]:
    """Kernel name -> GPU time of the kernels launched inside the steps (by their launch call)."""
    kernels = events.of_kind(Kind.KERNEL)
    if not kernels.any():
        return {}
    launched = in_host_ranges(events.launch_start_us(kernels), steps)
    ids, durations = events.name_id[kernels][launched], events.dur_us[kernels][launched]
    per_name = np.bincount(ids, weights=durations, minlength=len(events.names))
    return {events.names[i]: float(per_name[i]) for i in np.flatnonzero(per_name).tolist()}


def _conv_fp32_us(events: TraceEvents, steps: list[StepTiming]) -> float:
    """GPU time of fp32 convolution kernels launched inside the steps that are no GEMM by name (module
    docstring); 0 without External ids (no op to tell a convolution by)."""
    return float(events.dur_us[_fp32_conv_rows(events, steps)].sum())


def _fp32_conv_rows(events: TraceEvents, steps: list[StepTiming]) -> np.ndarray:
    kernels = events.of_kind(Kind.KERNEL)
    if events.external_id is None or not kernels.any():
        return np.zeros(0, dtype=np.int64)
    rows = np.flatnonzero(kernels)[in_host_ranges(events.launch_start_us(kernels), steps)]
    # judged once per distinct External id and kernel name (a conv net launches ~30k kernels of ~100 names)
    externals, of_external = np.unique(events.external_id[rows], return_inverse=True)
    convolution = np.fromiter(("convolution" in events.op_of_external.get(external, "") for external in externals.tolist()),
                              dtype=bool, count=externals.size)
    name_ids, of_name = np.unique(events.name_id[rows], return_inverse=True)
    fp32 = np.fromiter((_fp32_conv_kernel(events.names[name_id]) for name_id in name_ids.tolist()), dtype=bool,
                       count=name_ids.size)
    return rows[convolution[of_external] & fp32[of_name]].astype(np.int64)


def fp32_math_rows(events: TraceEvents, steps: list[StepTiming]) -> np.ndarray:
    """The kernels launched inside the steps that do fp32 math off the tensor cores: fp32 GEMMs by name and fp32
    convolutions (the two figures the precision rule reads)."""
    kernels = events.of_kind(Kind.KERNEL)
    gemm = kernels & events.names_matching(lambda n: kernel_category(n) == CATEGORY_GEMM and gemm_precision(n) == "fp32")
    rows = np.flatnonzero(gemm)
    rows = rows[in_host_ranges(events.launch_start_us(gemm), steps)] if rows.size else rows
    return np.union1d(rows, _fp32_conv_rows(events, steps)).astype(np.int64)


def _fp32_conv_kernel(name: str) -> bool:
    """A convolution's kernel doing fp32 math off the GEMM kernels' count: no tensor-core type in its name, and
    an fp32 convolution algorithm's (_FP32_CONV_NEEDLES)."""
    if kernel_category(name) == CATEGORY_GEMM or gemm_precision(name) != PRECISION_UNKNOWN:
        return False
    folded = name.lower()
    return any(needle in folded for needle in _FP32_CONV_NEEDLES)


def _gemm_by_precision(events: TraceEvents, steps: list[StepTiming], count: int) -> dict[str, float]:
    """GPU time of the GEMM kernels launched in the steps, per step, by the numeric type of the op that launched
    them (_op_precision: its kernels' names, else its inputs' type), by the kernel's name where no op is known."""
    gemm = events.of_kind(Kind.KERNEL) & events.names_matching(lambda n: kernel_category(n) == CATEGORY_GEMM)
    rows = np.flatnonzero(gemm)
    rows = rows[in_host_ranges(events.launch_start_us(gemm), steps)] if rows.size else rows
    by_op: dict[int, list[int]] = {}
    totals: dict[str, float] = {}
    for row in rows.tolist():
        external = int(events.external_id[row]) if events.external_id is not None else NO_ID
        if external != NO_ID:
            by_op.setdefault(external, []).append(row)
        else:
            precision = gemm_precision(events.names[events.name_id[row]])
            totals[precision] = totals.get(precision, 0.0) + float(events.dur_us[row]) / count
    for kernels in by_op.values():
        precision = _op_precision(events, kernels)
        totals[precision] = totals.get(precision, 0.0) + float(events.dur_us[kernels].sum()) / count
    return totals


def _optimizer(events: TraceEvents, steps: list[StepTiming], in_steps: np.ndarray, count: int) -> dict:
    ranges = np.flatnonzero(events.of_kind(Kind.USER_ANNOTATION) & in_steps & events.names_matching(
        lambda n: n.startswith(OPTIMIZER_RANGE_PREFIX)))
    if not ranges.size:
        return _update_loop(events, steps, count)
    starts, ends, threads = events.start_us[ranges], events.end_us[ranges], events.thread[ranges]
    launches = np.flatnonzero(events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_launch_call))
    launch_count = sum(int(np.count_nonzero((events.start_us[launches] >= s) & (events.start_us[launches] < e)
                                            & (events.thread[launches] == t)))
                       for s, e, t in zip(starts.tolist(), ends.tolist(), threads.tolist()))
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    launched_at = events.launch_start_us(gpu)
    inside = np.zeros(launched_at.size, dtype=bool)
    for s, e in zip(starts.tolist(), ends.tolist()):
        inside |= (launched_at >= s) & (launched_at < e)
    kernel_names = {events.names[i] for i in np.unique(events.name_id[gpu][inside]).tolist()}
    name = events.names[events.name_id[ranges[0]]][len(OPTIMIZER_RANGE_PREFIX):]
    return {"optimizer": name.split(".")[0], "optimizer_impl": _implementation(kernel_names),
            "optimizer_host_us": float((ends - starts).sum()) / count, "optimizer_launches": launch_count / count,
            "optimizer_gpu_us": float(events.dur_us[gpu][inside].sum()) / count,
            "optimizer_foreach_calls": _foreach_calls(events, events.external_id[gpu][inside]) / count
            if events.external_id is not None else 0.0}


def _foreach_calls(events: TraceEvents, externals: np.ndarray) -> int:
    """Calls of the foreach op called most among the ops that launched `externals` (each call counted once,
    whatever its kernels)."""
    calls: dict[str, int] = {}
    for external in np.unique(externals[externals != NO_ID]).tolist():
        op = events.op_of_external.get(int(external), "")
        if op.startswith("aten::_foreach_"):
            calls[op] = calls.get(op, 0) + 1
    return max(calls.values(), default=0)


UPDATE_OPS = frozenset({"aten::mul_", "aten::add_", "aten::sub_", "aten::div_", "aten::addcmul_", "aten::addcdiv_",
                        "aten::sqrt_", "aten::lerp_", "aten::mul", "aten::add", "aten::sub", "aten::div",
                        "aten::sqrt", "aten::addcmul", "aten::addcdiv", "aten::sign_", "aten::clamp_",
                        "aten::maximum", "aten::copy_"})
"""Elementwise arithmetic an optimizer written by hand (or an EMA of the weights) runs per parameter tensor."""
UPDATE_LOOP_MIN_LAUNCHES = 64
"""Update launches after the backward, per step, from which they are a loop over parameter tensors (a model's
final loss arithmetic launches a handful)."""
UPDATE_LOOP_LABEL = "update loop after the backward"


def _update_loop(events: TraceEvents, steps: list[StepTiming], count: int) -> dict:
    """An optimizer without torch.optim's range: after the step's last backward launch, at least
    UPDATE_LOOP_MIN_LAUNCHES kernels of elementwise update ops (UPDATE_OPS, by the op that launched them) make up
    most of what the host launches, and none is a foreach or fused kernel: a loop over parameter tensors (a
    hand-written optimizer, an EMA). Its host time runs from its first launch to its last launch's return."""
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    if events.external_id is None or not gpu.any():
        return {}
    rows = np.flatnonzero(gpu)
    ops = [events.op_of_external.get(int(e), "") for e in events.external_id[rows].tolist()]
    launch_start, launch_end = events.launch_start_us(gpu), events.launch_end_us(gpu)
    backward = np.fromiter((is_backward_op(op) for op in ops), dtype=bool, count=rows.size)
    update = np.fromiter((op in UPDATE_OPS for op in ops), dtype=bool, count=rows.size)
    host_us = launches = gpu_us = 0.0
    names: set[str] = set()
    for step in steps:
        inside = (launch_start >= step.start_us) & (launch_start < step.end_us)
        if not (inside & backward).any():
            continue
        after = inside & (launch_start > launch_start[inside & backward].max())
        loop = after & update
        if np.count_nonzero(loop) < UPDATE_LOOP_MIN_LAUNCHES or np.count_nonzero(loop) < 0.5 * np.count_nonzero(after):
            continue
        host_us += float(launch_end[loop].max() - launch_start[loop].min())
        launches += int(np.count_nonzero(loop))
        gpu_us += float(events.dur_us[rows[loop]].sum())
        names |= {events.names[i] for i in np.unique(events.name_id[rows[after]]).tolist()}
    if not launches or _implementation(names) != IMPL_PER_PARAMETER:
        return {}
    return {"optimizer": UPDATE_LOOP_LABEL, "optimizer_impl": IMPL_PER_PARAMETER, "optimizer_host_us": host_us / count,
            "optimizer_launches": launches / count, "optimizer_gpu_us": gpu_us / count}


def _implementation(kernel_names: set[str]) -> str:
    folded = [name.lower() for name in kernel_names]
    if any("fused" in name and ("adam" in name or "sgd" in name or "optim" in name) for name in folded):
        return IMPL_FUSED
    if any("multi_tensor_apply" in name for name in folded):
        return IMPL_FOREACH
    return IMPL_PER_PARAMETER if folded else ""


def _allocator(events: TraceEvents, in_steps: np.ndarray, count: int) -> dict:
    calls = events.of_kind(Kind.CUDA_RUNTIME) & in_steps & events.names_matching(lambda n: n in ALLOCATOR_CALLS)
    if not calls.any():
        return {}
    spans = union(Intervals(events.start_us[calls], events.end_us[calls]))
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    busy = float(covered_between(Intervals(events.start_us[gpu], events.end_us[gpu]), spans.starts_us,
                                 spans.ends_us).sum())
    return {"allocator_calls": int(np.count_nonzero(calls)) / count,
            "allocator_us": float(events.dur_us[calls].sum()) / count,
            "allocator_idle_us": max(spans.total_us - busy, 0.0) / count}


GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch", "hipGraphLaunch"})
COMPILE_ID = re.compile(r"compile_id=(\d+/\d+)")
HOST_COPY_OPS = frozenset({"aten::copy_", "aten::_to_copy", "aten::to"})


def compile_intervals(events: TraceEvents) -> Intervals:
    """The union of torch.compile's ranges (names.is_compile_region) on the host."""
    regions = events.of_kind(Kind.CPU_OP, Kind.USER_ANNOTATION) & events.names_matching(is_compile_region)
    return union(Intervals(events.start_us[regions], events.end_us[regions]))


def _compilation(events: TraceEvents, steps: list[StepTiming], in_steps: np.ndarray, count: int) -> dict:
    regions = compile_intervals(events)
    if not len(regions):
        return {}
    inside = sum(clip(regions, s.start_us, s.end_us).total_us for s in steps)
    annotated = events.of_kind(Kind.USER_ANNOTATION, Kind.CPU_OP) & in_steps & events.names_matching(
        lambda n: "compile_id=" in n)
    ids = {match.group(1) for i in np.unique(events.name_id[annotated]).tolist()
           if (match := COMPILE_ID.search(events.names[i]))}
    return {"compile_us": inside / count, "compile_ids": len(ids)}


def _host_copies(events: TraceEvents, steps: list[StepTiming], count: int) -> dict:
    copies = events.of_kind(Kind.GPU_MEMCPY) & events.names_matching(is_device_to_host_copy)
    if not copies.any() or events.external_id is None:
        return {}
    by_copy_op = np.fromiter((events.op_of_external.get(int(x)) in HOST_COPY_OPS if x != NO_ID else False
                              for x in events.external_id[copies].tolist()), dtype=bool, count=int(copies.sum()))
    launched = in_host_ranges(events.launch_start_us(copies), steps) & by_copy_op
    return {"host_copies": int(launched.sum()) / count,
            "host_copy_us": float(events.dur_us[copies][launched].sum()) / count}


_FUSED_ATTENTION = ("flash", "fmha", "sdpa", "efficient_attention", "attention_kernel", "attn_fwd", "attn_bwd")


def _attention(events: TraceEvents, steps: list[StepTiming], count: int) -> dict:
    """Softmax kernels vs fused attention kernels launched in the steps: attention computed from materialized
    scores runs softmax over them (and scales and masks them in passes of their own); a fused kernel never
    writes them. Only softmax that can be attention's counts (_is_attention_softmax): where the trace records the
    softmax ops' shapes, the softmax over a score matrix alone."""
    per_name = _kernel_us_by_name(events, steps)
    if not per_name:
        return {}
    softmax = fused = 0.0
    for name, us in per_name.items():
        folded = name.lower()
        if any(needle in folded for needle in _FUSED_ATTENTION):
            fused += us
        elif _is_attention_softmax(folded):
            softmax += us
    rows = score_pass_rows(events, steps)
    if _softmax_shapes_recorded(events, steps):
        # the trace shows what each softmax ran over: the one over a score matrix is attention's, the rest
        # (a router's over its experts, a pooling's, a Gumbel-softmax's over codes) no fused kernel replaces
        softmax = sum(float(events.dur_us[row]) for row in rows.tolist()
                      if _is_attention_softmax(events.names[events.name_id[row]].lower()))
    gemms, excess = score_gemm_excess(events, steps)
    return {"softmax_us": softmax / count, "fused_attention_us": fused / count,
            "score_pass_us": float(events.dur_us[rows].sum()) / count if rows.size else 0.0,
            "score_gemm_us": float(events.dur_us[gemms].sum()) / count if gemms.size else 0.0,
            "score_gemm_excess_us": float(excess.sum()) / count,
            "score_shapes": _score_shapes(events, steps)[:3]}


def _is_attention_softmax(folded_name: str) -> bool:
    """Whether a kernel (lower-cased name) can be attention's softmax: a softmax that is no log-softmax. A
    log-softmax makes log-probabilities (cross-entropy over a vocabulary or classes, a KL term), never attention's
    weights; a compiled kernel's name lists the ops it fused (triton_..._log_softmax_...)."""
    return "softmax" in folded_name and "log_softmax" not in folded_name and "logsoftmax" not in folded_name


def _softmax_shapes_recorded(events: TraceEvents, steps: list[StepTiming]) -> bool:
    """Whether the trace records the input shapes of a softmax op (SOFTMAX_OPS) launched in the steps."""
    return any(events.op_of_external.get(int(events.external_id[row]), "") in SOFTMAX_OPS and dims
               for row, dims in _launch_inputs(events, steps))


SOFTMAX_OPS = frozenset(("aten::_softmax", "aten::softmax", "aten::_safe_softmax", "aten::_softmax_backward_data"))
"""Ops whose first input, in attention written by hand, is the score matrix (batch, heads, queries, keys)."""


def _score_shapes(events: TraceEvents, steps: list[StepTiming]) -> list[str]:
    """The shapes softmax ran over in the steps (record_shapes traces), as compact text ("[4,16,2048,2048]"):
    a score matrix has at least 3 dimensions, and its last two (queries x keys) are a GEMM's product (QK^T)
    where the trace records the GEMMs' shapes. A softmax over weights no GEMM made (attention pooling's over a
    conv's output, a router's over its logits' experts) is no attention a fused kernel replaces."""
    inputs = _launch_inputs(events, steps)
    products = _gemm_products(events, inputs)
    shapes: dict[str, float] = {}
    for row, dims in inputs:
        if events.op_of_external.get(int(events.external_id[row]), "") in SOFTMAX_OPS and dims \
                and isinstance(dims[0], list) and len(dims[0]) >= 3 \
                and (not products or tuple(dims[0][-2:]) in products):
            text = json.dumps(dims[0], separators=(",", ":"))
            shapes[text] = shapes.get(text, 0.0) + float(events.dur_us[row])
    return sorted(shapes, key=lambda shape: -shapes[shape])


def _gemm_products(events: TraceEvents, inputs: list[tuple[int, list]]) -> set[tuple]:
    """(rows, columns) of the products of the GEMM kernels among `inputs` (their ops' two matrices,
    GEMM_OP_OPERANDS: [.., m, k] x [.., k, n] makes m x n)."""
    products: set[tuple] = set()
    for row, dims in inputs:
        operands = GEMM_OP_OPERANDS.get(events.op_of_external.get(int(events.external_id[row]), ""))
        if operands is None or len(dims) <= max(operands):
            continue
        a, b = dims[operands[0]], dims[operands[1]]
        if isinstance(a, list) and isinstance(b, list) and len(a) >= 2 and len(b) >= 2:
            products.add((a[-2], b[-1]))
    return products


def score_pass_rows(events: TraceEvents, steps: list[StepTiming]) -> np.ndarray:
    """The kernels launched in the steps that are passes over a score matrix, not GEMMs: launched by an op with an
    input of a shape softmax ran over (the softmax itself, scaling, masking, dropout, their backward). A fused
    attention kernel makes none of them; empty without record_shapes (no shapes to tell them by)."""
    shapes = set(_score_shapes(events, steps))
    if not shapes:
        return np.zeros(0, dtype=np.int64)
    chosen = [row for row, dims in _launch_inputs(events, steps)
              if kernel_category(events.names[events.name_id[row]]) != CATEGORY_GEMM
              and any(isinstance(d, list) and json.dumps(d, separators=(",", ":")) in shapes for d in dims)]
    return np.asarray(chosen, dtype=np.int64)


FUSED_ATTENTION_GEMM_SHARE = 0.5
"""The share of the program's own GEMM rate (its other GEMMs', same numeric type) a fused attention kernel
reaches on the score GEMMs' math: it also runs the softmax between its two products and recomputes the scores
in its backward (FlashAttention-2 reports 50-73% of an A100's peak forward, less backward). An assumption."""


def score_gemm_excess(events: TraceEvents, steps: list[StepTiming]) -> tuple[np.ndarray, np.ndarray]:
    """(rows, excess us) of the GEMM kernels over a score matrix launched in the steps: batched products whose
    product or first operand is a score matrix (batch = its leading dims, queries x keys either way round):
    QK^T and PV forward, dP, dV, dQ and dK backward. Each one's excess is its time beyond its math at
    FUSED_ATTENTION_GEMM_SHARE of the rate the program's other GEMMs of its numeric type reach: with a small
    head dimension these products write and read the scores, bound by memory, where a fused kernel does the
    same math without them. Empty without record_shapes, a score matrix or other GEMMs to take the rate from."""
    none = (np.zeros(0, dtype=np.int64), np.zeros(0))
    scores = [json.loads(shape) for shape in _score_shapes(events, steps)]
    keys = {(int(np.prod(s[:-2])), s[-2], s[-1]) for s in scores} | {(int(np.prod(s[:-2])), s[-1], s[-2])
                                                                       for s in scores}
    if not keys:
        return none
    kernels_of: dict[int, list[int]] = {}
    flops_of: dict[int, float] = {}
    over_scores: set[int] = set()
    for row, dims in _launch_inputs(events, steps):
        op, external = events.op_of_external.get(int(events.external_id[row]), ""), int(events.external_id[row])
        work = gemm_flops(op, dims) if kernel_category(events.names[events.name_id[row]]) == CATEGORY_GEMM else None
        if work is None:
            continue
        kernels_of.setdefault(external, []).append(row)
        flops_of[external] = work
        if _over_scores(dims[GEMM_OP_OPERANDS[op][0]], dims[GEMM_OP_OPERANDS[op][1]], keys):
            over_scores.add(external)
    precision_of = {external: _op_precision(events, rows) for external, rows in kernels_of.items()}
    other_flops: dict[str, float] = {}
    other_us: dict[str, float] = {}
    for external, kernels in kernels_of.items():
        if external not in over_scores:
            precision = precision_of[external]
            other_us[precision] = other_us.get(precision, 0.0) + float(events.dur_us[kernels].sum())
            other_flops[precision] = other_flops.get(precision, 0.0) + flops_of[external]
    rows, excess = [], []
    for external in over_scores:
        kernels, precision = kernels_of[external], precision_of[external]
        if not other_us.get(precision):
            continue
        rate = FUSED_ATTENTION_GEMM_SHARE * other_flops[precision] / other_us[precision]   # flop per us
        spent = events.dur_us[kernels]
        beyond = max(float(spent.sum()) - flops_of[external] / rate, 0.0)
        rows.extend(kernels)
        excess.extend((beyond * spent / max(float(spent.sum()), 1e-9)).tolist())
    return np.asarray(rows, dtype=np.int64), np.asarray(excess, dtype=float)


def _op_precision(events: TraceEvents, kernels: list[int]) -> str:
    """The numeric type of an op's GEMM, from the first of its kernels whose name gives one: a split-K GEMM
    launches its product (cuBLASLt's `nvjet_..._splitK` names no type) and a reduction that names its output's
    (`splitKreduce_kernel<..., __nv_bfloat16, ...>`); the op's FLOPs and both kernels' time are one GEMM's.
    Where no kernel names one, the op's half or fp8 inputs (record_shapes: INPUT_TYPE_PRECISION) do."""
    for row in kernels:
        precision = gemm_precision(events.names[events.name_id[row]])
        if precision != PRECISION_UNKNOWN:
            return precision
    return INPUT_TYPE_PRECISION.get(events.gemm_input_types.get(int(events.external_id[kernels[0]]), ""),
                                    PRECISION_UNKNOWN)


INPUT_TYPE_PRECISION = {"c10::BFloat16": PRECISION_HALF, "c10::Half": PRECISION_HALF,
                        "c10::Float8_e4m3fn": PRECISION_FP8, "c10::Float8_e5m2": PRECISION_FP8,
                        "c10::Float8_e4m3fnuz": PRECISION_FP8, "c10::Float8_e5m2fnuz": PRECISION_FP8}
"""A GEMM op's input type -> the math its kernels do. Not fp32 inputs: cuBLAS runs them as TF32 or fp32 by the
program's settings, which the op does not record (the kernel's name must tell)."""


def _over_scores(a: Any, b: Any, keys: set[tuple]) -> bool:
    """Whether a batched product [n, m, k] x [n, k, p] makes a score matrix (n, m, p) or reads one (n, m, k)."""
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == 3 and len(b) == 3):
        return False
    return (a[0], a[1], b[2]) in keys or (a[0], a[1], a[2]) in keys


def _launch_inputs(events: TraceEvents, steps: list[StepTiming]) -> list[tuple[int, list]]:
    """(kernel row, its launching op's input shapes) of the kernels launched in the steps whose launch label has
    them (record_shapes)."""
    kernels = events.of_kind(Kind.KERNEL)
    if events.launch_shape_id is None or events.external_id is None or not kernels.any():
        return []
    rows = np.flatnonzero(kernels & (events.launch_shape_id >= 0))
    rows = rows[in_host_ranges(events.launch_start_us(kernels & (events.launch_shape_id >= 0)), steps)]
    parsed: dict[int, list | None] = {}
    found = []
    for row, shape in zip(rows.tolist(), events.launch_shape_id[rows].tolist()):
        if shape not in parsed:
            parsed[shape] = _label_inputs(events.launch_shapes[shape])
        if parsed[shape]:
            found.append((row, parsed[shape]))
    return found


def _label_inputs(label: str) -> list | None:
    at = label.find(_INPUTS_MARK)
    if at < 0:
        return None
    try:
        dims = json.loads(label[at + len(_INPUTS_MARK):])
    except ValueError:
        return None   # a label cut at its length limit
    return dims if isinstance(dims, list) else None


_FORWARD, _BACKWARD, _NEUTRAL = 1, 2, 0


def _recompute(events: TraceEvents, steps: list[StepTiming], count: int) -> dict:
    """Forward work the backward pass ran again, and the GPU idle while it was set up (module docstring)."""
    kernels = np.flatnonzero(events.of_kind(Kind.KERNEL))
    if not kernels.size or events.external_id is None:
        return {}
    mask = np.zeros(len(events), dtype=bool)
    mask[kernels] = True
    launched, threads = events.launch_start_us(mask), events.launch_thread(mask)
    inside = in_host_ranges(launched, steps) & (threads != NO_ID)
    order = np.argsort(launched[inside], kind="stable")
    kernels, launched, threads = kernels[inside][order], launched[inside][order], threads[inside][order]
    if not kernels.size:
        return {}
    ops = [events.op_of_external.get(int(x), "") for x in events.external_id[kernels].tolist()]
    labels = np.fromiter((_FORWARD if op in FORWARD_ONLY_OPS else _BACKWARD if is_backward_op(op) else _NEUTRAL
                          for op in ops), dtype=np.int8, count=len(ops))
    firsts = [np.flatnonzero(in_host_ranges(launched, [s]))[:1] for s in steps]
    forward_threads = {int(threads[first[0]]) for first in firsts if first.size}
    forward = np.isin(threads, list(forward_threads))
    names = events.name_id[kernels]
    positions = _positions(names[forward])
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    busy = union(Intervals(events.start_us[gpu], events.end_us[gpu]))
    work_us = idle_us = 0.0
    for thread in np.unique(threads[labels == _BACKWARD]).tolist():
        if thread in forward_threads:
            continue
        mine = np.flatnonzero(threads == thread)
        for first, last in _recomputed_runs(labels[mine], names[mine], names[forward], positions):
            run = kernels[mine[first:last + 1]]
            work_us += float(events.dur_us[run].sum())
            idle_us += _idle_before_and_in(busy, float(events.start_us[run].min()), float(events.end_us[run].max()))
    if not work_us:
        return {}
    return {"recompute_us": work_us / count, "recompute_idle_us": idle_us / count}


def _idle_before_and_in(busy: Intervals, start_us: float, end_us: float) -> float:
    """GPU idle from the end of the GPU work before `start_us` to `end_us`: the gap while the host set a
    recomputation up (checkpoint's hooks run the forward again on the host first) and the gaps inside it."""
    slot = int(np.searchsorted(busy.ends_us, start_us, side="right")) - 1
    since = float(busy.ends_us[slot]) if slot >= 0 else start_us
    return max(end_us - since - float(covered_between(busy, np.array([since]), np.array([end_us]))[0]), 0.0)


RECOMPUTE_MATCHES_TRIED = 64
"""Places in the forward a recomputed run is matched against (the same kernel recurs once per layer)."""


def _positions(names: np.ndarray) -> dict[int, list[int]]:
    positions: dict[int, list[int]] = {}
    for index, name in enumerate(names.tolist()):
        slots = positions.setdefault(name, [])
        if len(slots) < RECOMPUTE_MATCHES_TRIED:
            slots.append(index)
    return positions


def _recomputed_runs(labels: np.ndarray, names: np.ndarray, forward_names: np.ndarray,
                     positions: dict[int, list[int]]) -> list[tuple[int, int]]:
    """[first, last] of each recomputed run of a backward thread's kernels (in launch order): each run between
    two backward kernels that holds a forward-only kernel is a forward replayed, so its kernels are the forward's
    in the same order. The run is what matches the forward's own kernel sequence around its first forward-only
    kernel (the matrix products, masks and adds between them included; the backward's own kernels, which the
    forward never ran in that order, not)."""
    runs = []
    for segment in np.split(np.arange(labels.size), np.flatnonzero(labels == _BACKWARD)):
        forward = segment[labels[segment] == _FORWARD]
        while forward.size:
            first, last = _matched_run(int(forward[0]), int(segment[0]), int(segment[-1]), names, forward_names,
                                       positions)
            runs.append((first, last))
            forward = forward[forward > last]
    return runs


def _matched_run(anchor: int, low: int, high: int, names: np.ndarray, forward_names: np.ndarray,
                 positions: dict[int, list[int]]) -> tuple[int, int]:
    """[first, last] around `anchor` (within [low, high]) whose kernel names follow the forward's sequence
    at the place that matches longest; the anchor alone where the forward never ran its kernel."""
    best = (anchor, anchor)
    for at in positions.get(int(names[anchor]), []):
        after = 0
        while (anchor + after + 1 <= high and at + after + 1 < forward_names.size
               and names[anchor + after + 1] == forward_names[at + after + 1]):
            after += 1
        before = 0
        while anchor - before - 1 >= low and at - before - 1 >= 0 and names[anchor - before - 1] == forward_names[at - before - 1]:
            before += 1
        if after + before > best[1] - best[0]:
            best = (anchor - before, anchor + after)
    return best


def _garbage_collection(events: TraceEvents, in_steps: np.ndarray, count: int) -> dict:
    collections = events.of_kind(Kind.PYTHON_FUNCTION) & in_steps & events.names_matching(is_gc_frame)
    if not collections.any():
        return {}
    spans = union(Intervals(events.start_us[collections], events.end_us[collections]))
    # an explicit gc.collect() holds its own GC event: one collection, counted once
    return {"gc_us": spans.total_us / count, "gc_count": len(spans) / count}


INPUTS_MARK = " inputs "
_INPUTS_MARK = INPUTS_MARK


def gemm_flops(op: str, dims: Any) -> float | None:
    """2*M*N*K (times the batch) of a GEMM op from its input shapes; None where they are not a GEMM's."""
    operands = GEMM_OP_OPERANDS.get(op)
    if operands is None or not isinstance(dims, list) or len(dims) <= max(operands):
        return None
    a, b = dims[operands[0]], dims[operands[1]]
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and len(a) in (2, 3)
            and all(type(v) is int and v > 0 for v in a + b) and a[-1] == b[-2]):
        return None
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _gemm_rates(events: TraceEvents, steps: list[StepTiming], device_properties: Any) -> dict:
    kernels = events.of_kind(Kind.KERNEL)
    if not kernels.any() or events.external_id is None or events.launch_shape_id is None:
        return {}
    gemm = kernels & events.names_matching(lambda n: kernel_category(n) == CATEGORY_GEMM)
    rows = np.flatnonzero(gemm)
    rows = rows[in_host_ranges(events.launch_start_us(gemm), steps)]
    if not rows.size:
        return {}
    kernels_of: dict[int, list[int]] = {}
    work_of: dict[int, float] = {}
    for row in rows.tolist():
        external, shape = int(events.external_id[row]), int(events.launch_shape_id[row])
        work = _op_flops(events, external, shape) if external != NO_ID and shape >= 0 else None
        if work is None:
            continue
        kernels_of.setdefault(external, []).append(row)
        work_of[external] = work
    flops: dict[str, float] = {}
    shaped_us: dict[str, float] = {}
    for external, kernels in kernels_of.items():   # an op's FLOPs once, over all its kernels' time
        precision = _op_precision(events, kernels)
        shaped_us[precision] = shaped_us.get(precision, 0.0) + float(events.dur_us[kernels].sum())
        flops[precision] = flops.get(precision, 0.0) + work_of[external]
    rates = {kind: flops[kind] / shaped_us[kind] / 1e6 for kind in flops if shaped_us.get(kind)}
    if not rates:
        return {}
    devices = events.device[rows]
    device, peaks = peak_tflops(device_name(device_properties, int(np.bincount(devices[devices >= 0]).argmax())
                                            if (devices >= 0).any() else None))
    return {"gemm_tflops_by_precision": rates,
            "gemm_shaped_share": sum(shaped_us.values()) / float(events.dur_us[rows].sum()),
            "device": device,
            "gemm_peak_pct_by_precision": {kind: 100.0 * rate / peaks[kind] for kind, rate in rates.items()
                                           if kind in peaks}}


TENSOR_CORE_SPEEDUP = 4.0
"""How much faster the tensor cores run fp32 math as bf16 or TF32: an assumption, conservative against the
datasheets' 7-15x (peaks of fp32 vs TF32/bf16 dense) as real GEMMs reach less of the tensor cores' peak."""
PINNED_RATE_MIN_BYTES = 1 << 20
"""Smaller copies are dominated by their fixed cost and say little about the link's rate."""


def _host_link(events: TraceEvents, device_properties: Any) -> dict:
    """What a pinned copy between host and device moves per second on this GPU: measured on the trace's own
    large pinned copies where it has them, and the link table's figure (traces/device_peaks.py)."""
    copies = events.of_kind(Kind.GPU_MEMCPY)
    if not copies.any():
        return {}
    devices = events.device[copies]
    link, rate = pinned_copy_gbps(device_name(device_properties, int(np.bincount(devices[devices >= 0]).argmax())
                                              if (devices >= 0).any() else None))
    found: dict = {"host_link": link, "host_link_gbps": rate}
    if events.copy_bytes is None:
        return found
    pinned = copies & events.names_matching(is_pinned_host_copy) & (events.copy_bytes >= PINNED_RATE_MIN_BYTES)
    seconds = float(events.dur_us[pinned].sum()) / 1e6
    if seconds > 0:
        found["pinned_copy_gbps"] = float(events.copy_bytes[pinned].sum()) / seconds / 1e9
    return found


ROUTED_ROW_COUNTS = 8
"""Distinct row counts of the GEMMs over one weight in the steps from which its rows are routed: a dense model
multiplies a weight by a handful of row counts (the batch's tokens, a decoder's queries, the weight gradient's
transposed product: at most 4 on the 64 recorded programs), a loop over experts by one per expert, layer and
step (49 in the held-out Mixtral-style program), a loop over samples of different lengths by one per sample."""


def routed_gemms(events: TraceEvents, steps: list[StepTiming], count: int) -> dict:
    """StepWork.routed_gemm_weights and routed_gemm_launches: the GEMMs whose weight the steps multiply by
    ROUTED_ROW_COUNTS or more numbers of rows. Each group of rows (an expert's tokens) was counted, then its
    GEMMs launched on their own: a grouped GEMM over offsets kept on the device runs them in one launch.
    Empty without record_shapes (no shapes to tell them by)."""
    rows_by_weight, launches = _rows_by_weight(events, steps)
    routed = sorted((w for w, seen in rows_by_weight.items() if len(seen) >= ROUTED_ROW_COUNTS),
                    key=lambda w: -launches[w])
    if not routed:
        return {}
    return {"routed_gemm_weights": [f"[{w[0]}, {w[1]}] ({len(rows_by_weight[w])} row counts)" for w in routed[:3]],
            "routed_gemm_launches": sum(launches[w] for w in routed) / count}


def _rows_by_weight(events: TraceEvents, steps: list[StepTiming]) -> tuple[dict[tuple, set[int]], dict[tuple, int]]:
    """Per GEMM weight of the steps, the numbers of rows it was multiplied by and its launches (_gemm_rows)."""
    rows_by_weight: dict[tuple, set[int]] = {}
    launches: dict[tuple, int] = {}
    for weight, rows in _gemm_rows(events, steps):
        rows_by_weight.setdefault(weight, set()).add(rows)
        launches[weight] = launches.get(weight, 0) + 1
    return rows_by_weight, launches


def routed_loop_rows(events: TraceEvents, steps: list[StepTiming]) -> np.ndarray:
    """The kernels of a loop over routed groups (routed_gemms), forward and backward: those whose launching op
    has an input with one of the groups' row counts among its sizes (the group's GEMMs, its gather, activation,
    scatter and casts, their gradients). A row count that is also a size of the dense GEMMs (a weight's, a
    batch's) says nothing and is not one of them. Empty without routed GEMMs."""
    rows_by_weight, _ = _rows_by_weight(events, steps)
    routed = {w for w, seen in rows_by_weight.items() if len(seen) >= ROUTED_ROW_COUNTS}
    counts = set().union(*(rows_by_weight[w] for w in routed)) if routed else set()
    groups = set(counts)
    for weight, seen in rows_by_weight.items():
        if weight in routed:
            counts -= set(weight)
        else:
            counts -= seen
            # a weight gradient's product ([k, rows] x [rows, n]) has a group's rows as its second matrix's
            if not set(weight) & groups:
                counts -= set(weight)
    if not counts:
        return np.zeros(0, dtype=np.int64)
    return np.asarray([row for row, dims in _launch_inputs(events, steps) if _sizes(dims) & counts], dtype=np.int64)


def _sizes(dims: Any) -> set[int]:
    """Every size in a launch label's input shapes, nested lists (a tensor list's shapes) included."""
    found: set[int] = set()
    pending = [dims]
    while pending:
        value = pending.pop()
        if type(value) is int:
            found.add(value)
        elif isinstance(value, list):
            pending.extend(value)
    return found


def _gemm_rows(events: TraceEvents, steps: list[StepTiming]) -> list[tuple[tuple, int]]:
    """(weight shape, rows) of the 2-D GEMM kernels launched in the steps whose launching op's shapes the trace
    records: its two matrices (GEMM_OP_OPERANDS) rows x k and k x n, the second the weight."""
    found = []
    for row, dims in _launch_inputs(events, steps):
        operands = GEMM_OP_OPERANDS.get(events.op_of_external.get(int(events.external_id[row]), ""))
        if (operands is None or len(dims) <= max(operands)
                or kernel_category(events.names[events.name_id[row]]) != CATEGORY_GEMM):
            continue
        a, b = dims[operands[0]], dims[operands[1]]
        if (isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2
                and all(type(v) is int and v > 0 for v in a + b)):
            found.append(((b[0], b[1]), a[0]))
    return found


def _op_flops(events: TraceEvents, external: int, shape: int) -> float | None:
    dims = _label_inputs(events.launch_shapes[shape])
    return gemm_flops(events.op_of_external.get(external, ""), dims) if dims is not None else None
