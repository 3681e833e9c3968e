"""What an event name means: communication or computation, steps and training phases.

Every rule that decides from a name lives here, so the analyses agree with each other.
"""

from __future__ import annotations

import functools
import re

# The trainer's step markers and phase names are a record format: traces/formats.py owns them.
from fleetscope.traces.formats import PHASES, TRAIN_STEP  # noqa: F401
from fleetscope.traces.formats import STEP_MARKER_PREFIX as PROFILER_STEP_PREFIX  # noqa: F401
from fleetscope.traces.formats import parse_step_marker as profiler_step_number  # noqa: F401
from fleetscope.traces.kineto_schema import (  # noqa: F401  (the trace's arg keys: traces/ owns the format)
    COLLECTIVE_NAME_ARG,
    CONCRETE_INPUTS_ARG,
    DTYPE_ARG,
    EXTERNAL_ID_ARG,
    GROUP_SIZE_ARG,
    IN_NELEMS_ARG,
    IN_SPLIT_ARG,
    INPUT_DIMS_ARG,
    INPUT_TYPE_ARG,
    OUT_NELEMS_ARG,
    OUT_SPLIT_ARG,
    PROCESS_GROUP_DESCRIPTION_ARG,
    PROCESS_GROUP_NAME_ARG,
    SEQUENCE_ARG,
)

# Old NCCL builds name kernels ncclKernel_<Op>_..., current ones ncclDevKernel_<Op>_...;
# RCCL keeps the NCCL names.
_NCCL_KERNEL_RE = re.compile(r"^nccl(?:Dev)?Kernel_?(?P<op>[A-Za-z]+)?")
_CPU_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "nccl:", "gloo:")
_CPU_COMM_NAMES = frozenset({"record_param_comms"})
GLOO_SPAN_PREFIX = "gloo:"


def is_comm_kernel(name: str) -> bool:
    """A GPU kernel that communicates (NCCL/RCCL, old and new kernel names)."""
    return name.startswith("nccl")


def is_comm_cpu_op(name: str) -> bool:
    """A host-side collective: c10d ops, functional collectives, NCCL/gloo annotations."""
    return name.startswith(_CPU_COMM_PREFIXES) or name in _CPU_COMM_NAMES


def is_gloo_span(name: str) -> bool:
    """The span gloo records on its `pt_gloo_runloop` thread while a collective runs."""
    return name.startswith(GLOO_SPAN_PREFIX)


P2P_SEND, P2P_RECV, P2P_UNKNOWN = "send", "recv", "send/recv"
_P2P_HOST_OPS = {"c10d::send": P2P_SEND, "c10d::recv_": P2P_RECV, "c10d::recv_any_source_": P2P_RECV}
_P2P_GLOO_SPANS = {"gloo:send": P2P_SEND, "gloo:recv": P2P_RECV}


def point_to_point_kind(name: str, collective_arg: str | None = None, launching_op: str | None = None) -> str | None:
    """P2P_SEND / P2P_RECV for a point-to-point event (P2P_UNKNOWN: one whose direction the trace does not say),
    None for a collective or anything else.

    Point-to-point is not a collective: only two ranks take part, so it has no "last rank to arrive".
    gloo: `gloo:send` / `gloo:recv` spans and the `c10d::send` / `c10d::recv_` host ops. NCCL runs sends
    and receives as `SendRecv` kernels, but also uneven all-to-alls: a SendRecv kernel counts as
    point-to-point unless its `Collective name` arg or the host op that launched it says otherwise
    ("all_to_allv" ... stay collectives); with neither recorded, it is taken for point-to-point."""
    kind = _P2P_HOST_OPS.get(name) or _P2P_GLOO_SPANS.get(name)
    if kind is not None:
        return kind
    if _kernel_op(name) != "SendRecv":
        return None
    for text in (collective_arg, launching_op):
        if text:
            folded = text.lower().replace("_", "")
            if "recv" in folded and "send" not in folded:
                return P2P_RECV
            if "send" in folded and "recv" not in folded:
                return P2P_SEND
            return P2P_UNKNOWN if folded.endswith(("sendrecv", "batchisendirecv", "coalesced")) else None
    return P2P_UNKNOWN


_UNDESCRIBED_GROUPS = ("", "undefined")
ALL_TO_ALL_BASE_OP = "c10d::alltoall_base_"
"""Kineto args describing a collective's message (on NCCL kernels and `record_param_comms`, PyTorch >= 2.3;
gloo traces have none)."""


def process_group_label(group_name: object, description: object) -> str | None:
    """How a collective's process group is named in keys and reports ("mesh_tp pg 3", "pg 3"); None when
    the trace does not say. The name identifies the group (every member sees the same name); the
    description (DeviceMesh sets `mesh_<dim>`) says what it is for."""
    if type(group_name) not in (str, int) or group_name == "":
        return None
    if isinstance(description, str) and description not in _UNDESCRIBED_GROUPS:
        return f"{description} pg {group_name}"
    return f"pg {group_name}"


def collective_name(name: str, group: str | None = None) -> str:
    """The name that identifies a collective across ranks.

    NCCL kernel names carry the algorithm, protocol and template arguments, which need not be the same on
    every rank; the operation (`AllReduce`, `AllGather`, ...) is. Host-side names are already uniform.
    With the process group known (`process_group_label`), it is part of the name, so collectives of
    different groups (tensor- and data-parallel ones in a 2-D run) are never taken for one another.
    """
    match = _NCCL_KERNEL_RE.match(name)
    base = name if match is None else f"nccl:{match['op'] or 'Kernel'}"
    return base if group is None else f"{base} [{group}]"


ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
ALL_TO_ALL, BROADCAST, REDUCE, SEND_RECV = "all_to_all", "broadcast", "reduce", "send_recv"
_COLLECTIVE_TYPES = (
    # (what a `Collective name` arg or NCCL kernel op contains, lower case without "_", the type)
    ("reducescatter", REDUCE_SCATTER), ("allreduce", ALL_REDUCE), ("allgather", ALL_GATHER),
    ("alltoall", ALL_TO_ALL), ("broadcast", BROADCAST), ("reduce", REDUCE), ("sendrecv", SEND_RECV),
    ("send", SEND_RECV), ("recv", SEND_RECV),
)


def collective_type(collective_arg: str | None, kernel_name: str) -> str | None:
    """The collective's type (ALL_REDUCE, ...), from the `Collective name` arg ("allreduce",
    "_allgather_base", "reduce_scatter_tensor_coalesced", "all_to_all", ...) or else the NCCL kernel's op
    (`ncclDevKernel_AllGather_...`); None when neither says. The arg comes first: NCCL runs an all-to-all
    as SendRecv kernels."""
    for text in (collective_arg, _kernel_op(kernel_name)):
        if not text:
            continue
        folded = text.lower().replace("_", "")
        for needle, kind in _COLLECTIVE_TYPES:
            if needle in folded:
                return kind
    return None


def _kernel_op(name: str) -> str | None:
    match = _NCCL_KERNEL_RE.match(name)
    return match["op"] if match else None


CATEGORY_GEMM, CATEGORY_ATTENTION, CATEGORY_ELEMENTWISE = "gemm", "attention", "elementwise"
CATEGORY_REDUCTION, CATEGORY_MEMORY, CATEGORY_COMM = "reduction", "memcpy/memset", "communication"
CATEGORY_OPTIMIZER, CATEGORY_OTHER = "optimizer", "other"
KERNEL_CATEGORIES = (CATEGORY_GEMM, CATEGORY_ATTENTION, CATEGORY_ELEMENTWISE, CATEGORY_REDUCTION,
                     CATEGORY_MEMORY, CATEGORY_COMM, CATEGORY_OPTIMIZER, CATEGORY_OTHER)
_CATEGORY_RULES = (
    # first match wins, on the lower-cased kernel name
    (CATEGORY_COMM, ("nccl",)),
    (CATEGORY_MEMORY, ("memcpy", "memset")),
    (CATEGORY_ATTENTION, ("flash", "fmha", "attention", "attn", "sdpa", "softmax_warp")),
    (CATEGORY_GEMM, ("gemm", "cutlass", "cublas", "xmma", "wgmma", "nvjet", "matmul", "gemv", "_mma",
                     "cijk_")),  # ROCm's Tensile/hipBLASLt GEMMs: Cijk_Alik_Bljk_..._MT64x16x32_...
    (CATEGORY_OPTIMIZER, ("multi_tensor_apply", "adam", "optimizer")),  # not "lamb": C++ "lambda"
    (CATEGORY_REDUCTION, ("reduce", "reduction", "softmax", "norm", "argmax", "argmin", "cumsum", "scan",
                          "triton_red_", "triton_per_")),
    (CATEGORY_ELEMENTWISE, ("elementwise", "vectorized", "unrolled", "pointwise", "triton_poi", "index",
                            "copy", "fill", "cat_", "gather", "scatter")),
)
"""Kernel categories by name. Communication: NCCL kernels; memcpy/memset: copies and fills (also by
event kind); attention: FlashAttention/FMHA/SDPA kernels; GEMM: cuBLAS/CUTLASS/nvjet matrix products and
ROCm's Tensile/hipBLASLt ones (`Cijk_...`); optimizer: fused/foreach optimizer kernels (multi_tensor_apply,
Adam); reduction: reductions, softmax, norms, scans (incl. Inductor's `triton_red` / persistent `triton_per`);
elementwise: elementwise/vectorized/pointwise (incl. Triton `triton_poi`), indexing, copies and fills; other:
everything else (sorting, top-k, Triton kernels without a hint, ...)."""


def short_kernel_name(name: str, limit: int = 80) -> str:
    """A kernel's name without its return type, template arguments and parameters: what a reader recognises
    ("at::native::vectorized_elementwise_kernel", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT")."""
    text = name[5:] if name.startswith("void ") else name
    cut = min((i for i in (text.find("<"), text.find("(")) if i > 0), default=len(text))
    text = text[:cut].strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


_NAME_MEMO = 1 << 16
"""Distinct names whose category is remembered: the per-rank passes ask for every kernel name many times, and
every rank of a job launches the same kernels."""


@functools.lru_cache(maxsize=_NAME_MEMO)
def kernel_category(name: str) -> str:
    """The category of a GPU kernel or memory operation (KERNEL_CATEGORIES), by its name."""
    if is_known_comm_kernel(name):
        return CATEGORY_COMM
    folded = name.lower()
    for category, needles in _CATEGORY_RULES:
        if any(needle in folded for needle in needles):
            return category
    return CATEGORY_OTHER


HOST_SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                             "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize",
                             "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize"})
"""CUDA/HIP runtime and CUDA driver calls that block the host until the GPU has finished work (ROCm traces
name the HIP calls in the same `cuda_runtime` category)."""
TENSOR_READ_OP = "aten::_local_scalar_dense"
"""A GPU tensor's value read on the host (`.item()`, `if tensor:`, `int(tensor)`): a copy plus a sync.
`aten::item` encloses it, so only this one is counted."""
_DEVICE_TO_HOST = "Memcpy DtoH"
DATALOADER_PREFIX = "enumerate(DataLoader)#"
"""The record_function PyTorch's DataLoader iterator opens around fetching each batch."""


HOST_LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync",
    "hipLaunchKernel", "hipExtLaunchKernel", "hipModuleLaunchKernel", "hipExtModuleLaunchKernel", "hipGraphLaunch",
    "hipMemcpyAsync", "hipMemsetAsync"})
"""Runtime/driver calls that hand the GPU work: the host time in them is what CUDA graphs would save."""


def is_launch_call(name: str) -> bool:
    return name in HOST_LAUNCH_CALLS


def is_host_sync_call(name: str) -> bool:
    return name in HOST_SYNC_CALLS


def is_tensor_read_op(name: str) -> bool:
    return name == TENSOR_READ_OP


def is_device_to_host_copy(name: str) -> bool:
    """A GPU copy to host memory (`Memcpy DtoH (Device -> Pinned)`, `... -> Pageable`)."""
    return name.startswith(_DEVICE_TO_HOST)


def is_pageable_copy(name: str) -> bool:
    """A GPU copy from or to pageable host memory (`Memcpy HtoD (Pageable -> Device)`): the host stays in the
    copy call until it is done, and nothing of it overlaps the GPU's work."""
    return name.startswith("Memcpy ") and "Pageable" in name


def is_pinned_host_copy(name: str) -> bool:
    """A GPU copy between pinned host memory and the device (`Memcpy HtoD (Pinned -> Device)`): it runs at the
    host link's full rate."""
    return name.startswith(("Memcpy HtoD", "Memcpy DtoH")) and "Pinned" in name


LIBRARY_FRAME_MARKERS = ("site-packages/", "dist-packages/", "/torch/", "torch/", "<built-in", "<frozen", "threading.py",
                         "contextlib.py", "runpy.py", "<string>")
"""Python frames (with_stack's `python_function` events) of libraries, not of the program: the frame that
holds a sync is the innermost one outside these."""


def is_program_frame(name: str) -> bool:
    """A with_stack frame (`file.py(LINE): function`) of the program itself, not of a library."""
    return not any(marker in name for marker in LIBRARY_FRAME_MARKERS) and "(" in name


def is_input_wait(name: str) -> bool:
    """A DataLoader fetch (`enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__`, multi-process too)."""
    return name.startswith(DATALOADER_PREFIX)


FORWARD_ONLY_OPS = frozenset({
    "aten::addmm", "aten::linear", "aten::baddbmm", "aten::conv1d", "aten::conv2d",
    "aten::conv3d", "aten::convolution", "aten::_convolution", "aten::cudnn_convolution", "aten::native_layer_norm",
    "aten::layer_norm", "aten::native_group_norm", "aten::group_norm", "aten::native_batch_norm",
    "aten::cudnn_batch_norm", "aten::_native_batch_norm_legit", "aten::rms_norm", "aten::_fused_rms_norm",
    "aten::gelu", "aten::silu", "aten::relu", "aten::_softmax", "aten::softmax", "aten::embedding",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward", "aten::_efficient_attention_forward"})
"""Ops (as the op that launched a kernel names it) that only a forward pass runs: no backward formula calls
them (the backward of a linear calls `aten::mm`, of a GELU `aten::gelu_backward`; `aten::mm` and `aten::bmm`
run in both passes and are not here). Run by the autograd
engine's thread inside the backward pass they are a forward computed again: activation checkpointing's
recomputation."""


def is_backward_op(name: str) -> bool:
    """An op only a backward pass runs (`aten::gelu_backward`, `aten::convolution_backward`,
    `aten::_softmax_backward_data`, `aten::threshold_backward`)."""
    return name.startswith("aten::") and "_backward" in name


PYTHON_GC_EVENT = "Python GC"
"""The `python_function` event torch.profiler records for each garbage collection (`record_python_gc_info` of
its experimental config, which needs the Python tracer: `with_stack=True`)."""
GC_COLLECT_FRAMES = frozenset({"<built-in function collect>", "<built-in method collect of module object>"})
"""with_stack's frame of an explicit `gc.collect()` call (recorded even without the GC events)."""


def is_gc_frame(name: str) -> bool:
    """A collection on the host: torch.profiler's GC event or a `gc.collect()` frame."""
    return name == PYTHON_GC_EVENT or name in GC_COLLECT_FRAMES


COMPILE_TIMED_SUFFIX = " (dynamo_timed)"
COMPILE_REGIONS = frozenset({"inductor_compile", "entire_frame_compile", "entire_backward_compile",
                             "compile_fx_inner", "fx_codegen_and_compile", "_compile.compile_inner",
                             "OutputGraph.call_user_compiler", "backend_compile", "create_aot_dispatcher_function"})
"""The ranges torch.compile's phases open while they run (`dynamo_timed`: `compile_fx_inner (dynamo_timed)`,
`inductor_compile`, `entire_backward_compile`, ...): compilation, not the program's work. Inductor benchmarks
candidate kernels in them, with syncs of its own."""


def is_compile_region(name: str) -> bool:
    """A range torch.compile opens while it compiles (COMPILE_REGIONS, or any `... (dynamo_timed)`)."""
    return name in COMPILE_REGIONS or name.endswith(COMPILE_TIMED_SUFFIX)


COMPILED_GRAPH_CALL = "## Call CompiledFxGraph"
"""The range Inductor's generated code opens around each call of a compiled graph (torch/_inductor/output_code.py:
`## Call CompiledFxGraph <key> ##`): inside it the host runs the generated wrapper, Python that launches the
graph's kernels one after another, and nothing else of the program's."""


def is_compiled_graph_call(name: str) -> bool:
    return name.startswith(COMPILED_GRAPH_CALL)


def is_kept_host_op(name: str) -> bool:
    """`cpu_op` events kept on GPU traces (where others are left out): collectives, tensor reads and
    compilation ranges."""
    return is_comm_cpu_op(name) or is_tensor_read_op(name) or is_compile_region(name) or is_dynamic_shape_op(name)


DYNAMIC_SHAPE_OPS = frozenset(("aten::index", "aten::nonzero", "aten::masked_select", "aten::index_put_",
                               "aten::_index_put_impl_", "aten::unique", "aten::_unique2", "aten::unique_dim",
                               "aten::unique_consecutive", "aten::repeat_interleave"))
"""Ops whose output size depends on the data (boolean-mask indexing, masked_select, unique, repeat_interleave
by a tensor): they read a count from the GPU before they can size their output, and their backward
(DYNAMIC_SHAPE_BACKWARDS) does the same again."""
DYNAMIC_SHAPE_BACKWARDS = ("IndexBackward", "MaskedSelectBackward", "IndexPutBackward")


def is_dynamic_shape_op(name: str) -> bool:
    """An op of DYNAMIC_SHAPE_OPS, or autograd's evaluation of one's backward
    (`autograd::engine::evaluate_function: IndexBackward0`)."""
    return name in DYNAMIC_SHAPE_OPS or (name.startswith("autograd::engine::evaluate_function: ")
                                         and any(b in name for b in DYNAMIC_SHAPE_BACKWARDS))


# --- expert parallelism: all-to-all calls ----------------------------------------------------------

_ALL_TO_ALL_NEEDLES = ("alltoall", "alltoallv")
"""What the name of an all-to-all call contains, lower case without "_": `c10d::alltoall_base_`,
`gloo:all_to_all`, `_c10d_functional::all_to_all_single`, `all_to_allv`."""


def is_all_to_all_call(name: str, collective: str | None = None) -> bool:
    """An all-to-all collective call, by its type (`collective_type`, from the `Collective name` arg of
    NCCL kernels and `record_param_comms`: NCCL runs an uneven all-to-all as SendRecv kernels) or else its
    own name (host ops, gloo spans)."""
    if collective is not None:
        return collective == ALL_TO_ALL
    folded = name.lower().replace("_", "")
    return any(needle in folded for needle in _ALL_TO_ALL_NEEDLES)


# --- communication kernels that are not NCCL's ------------------------------------------------------


KNOWN_COMM_KERNEL_FAMILIES = (
    ("DeepEP", r"deep_ep::|\b(?:internode|intranode|internode_ll)::\w*(?:dispatch|combine|notify)"),
    ("NVSHMEM", r"nvshmem"),
    ("PyTorch symmetric memory", r"symmetric_memory::|\bmultimem_\w*(?:all_reduce|all_gather|reduce)"),
    ("MSCCL++", r"mscclpp"),
    ("Transformer Engine userbuffers", r"userbuffers"),
    ("custom all-reduce (vLLM, TensorRT-LLM)", r"cross_device_reduce|allreduce_fusion_kernel|customAllReduce"),
)
"""Communication kernels beyond NCCL/RCCL's, by family: (name, a regular expression searched in the kernel's
name). They count as communication by default (comm_kernel_rule); `--comm-kernel-pattern` adds more."""
_KNOWN_COMM = re.compile("|".join(f"(?:{pattern})" for _, pattern in KNOWN_COMM_KERNEL_FAMILIES))
_COMM_LOOKING = re.compile(r"all_?to_?all|all_?reduce|all_?gather|reduce_?scatter|dispatch|combine|\bsend|\brecv"
                           r"|broadcast|barrier", re.IGNORECASE)
"""Words of communication in a kernel name: a kernel that has them and is in no known family gets a hint."""


@functools.lru_cache(maxsize=_NAME_MEMO)
def is_known_comm_kernel(name: str) -> bool:
    """A communication kernel of a family in KNOWN_COMM_KERNEL_FAMILIES (not NCCL's)."""
    return _KNOWN_COMM.search(name) is not None


def looks_like_comm_kernel(name: str) -> bool:
    """A kernel whose name speaks of communication but that no rule counts as such (a hint, never a count)."""
    return _COMM_LOOKING.search(name) is not None and not is_comm_kernel(name) and not is_known_comm_kernel(name)


def custom_comm_kernel(pattern: str | None):
    """Communication kernels that are not NCCL's: the known families (KNOWN_COMM_KERNEL_FAMILIES) and those
    matching `pattern` (a regular expression searched in kernel names, e.g. `my_ep::.*dispatch`) when one is
    given. Raises ValueError naming the pattern when it is not a valid one."""
    if not pattern:
        return is_known_comm_kernel
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ValueError(f"comm_kernel_pattern {pattern!r}: {error}") from None
    return lambda name: is_known_comm_kernel(name) or compiled.search(name) is not None


def comm_kernel_rule(pattern: str | None):
    """What counts as a communication kernel: NCCL/RCCL kernels (is_comm_kernel), the known families of
    others, and those matching `pattern` when one is given (custom_comm_kernel)."""
    custom = custom_comm_kernel(pattern)
    return lambda name: is_comm_kernel(name) or custom(name)


GEMM_OP_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
                    "aten::_scaled_mm": (0, 1)}
"""Per GEMM op, which of its inputs are the two matrices multiplied."""
