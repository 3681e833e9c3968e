"""One rank's MoE layers from its trace: the time of each `moe/<kind>[layer L]` range, the grouped GEMMs
inside `moe/experts`, and which all-to-all collective calls belong to which layer's dispatch or combine.

Range names are a record format (traces/formats.py `moe_range`, `parse_moe_range`): the trainer opens
`moe/router|dispatch|experts|combine[layer L]` around each phase of each MoE layer's forward (host
`user_annotation`; on CUDA also NVTX, seen as `gpu_user_annotation` on the GPU timeline), and
`moe/split_sizes_d2h[layer L]` inside dispatch around the one device-to-host copy of the split sizes.

Definitions (all sums over the trace, microseconds; per step = divided by `steps`):
  - host_us[kind]: wall time of the host ranges of that kind and layer;
  - gpu_us[kind]: time of the GPU ranges (kernel spans the profiler assigns to the range);
  - grouped_gemm_us: GPU time of GEMM kernels (names.kernel_category == gemm) that start inside a GPU
    `moe/experts[layer L]` range; expert_kernel_us: every kernel starting there;
  - a collective call belongs to layer L's dispatch (combine) when it is an all-to-all
    (names.is_all_to_all_call), or a kernel of the configured non-NCCL communication pattern
    (names.custom_comm_kernel, e.g. DeepEP-style dispatch kernels), and it was issued inside a host
    `moe/dispatch[layer L]` (`moe/combine`) range: for communication kernels their launch (the
    cuda_runtime call with their correlation id, as collectives.py orders them), for gloo spans and host
    ops their start. Backward all-to-alls run outside every MoE range and are not attributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.traces.formats import MOE_COMBINE, MOE_DISPATCH, MOE_EXPERTS, parse_moe_range

from fleetscope.analysis.per_rank.collectives import SOURCE_NCCL, CollectiveCalls, CollectiveKey
from fleetscope.analysis.per_rank.events import Kind, TraceEvents
from fleetscope.analysis.per_rank.names import CATEGORY_GEMM, is_all_to_all_call, is_comm_kernel, kernel_category
from fleetscope.analysis.per_rank.steps import StepTiming

ATTRIBUTED_KINDS = (MOE_DISPATCH, MOE_COMBINE)
"""The phases whose all-to-all calls are attributed to their layer."""


@dataclass(frozen=True, kw_only=True)
class MoeLayerTimes:
    """One MoE layer on one rank, summed over the trace (module docstring)."""

    layer: int
    calls: dict[str, int]
    """kind -> host ranges seen (forwards, recomputes included)."""
    host_us: dict[str, float]
    gpu_us: dict[str, float] = field(default_factory=dict)
    """Empty on CPU traces."""
    grouped_gemm_us: float | None = None
    """None without GPU ranges of `moe/experts`."""
    expert_kernel_us: float | None = None


@dataclass(frozen=True, kw_only=True)
class MoeAllToAll:
    """A collective call of this rank attributed to one MoE layer's dispatch or combine."""

    key: CollectiveKey
    kind: str
    """MOE_DISPATCH or MOE_COMBINE."""
    layer: int


@dataclass(frozen=True, kw_only=True)
class MoeRankTimes:
    steps: int
    """Profiled steps of the trace (>= 1: a trace without step markers counts as one)."""
    layers: list[MoeLayerTimes]
    all_to_alls: list[MoeAllToAll]


def measure_moe(events: TraceEvents, steps: list[StepTiming], collectives: CollectiveCalls,
                is_comm=is_comm_kernel, custom_comm=None) -> MoeRankTimes | None:
    """The MoE view of one rank's trace; None when it holds no MoE range. `is_comm(name)`: the
    communication kernels collectives.py found the calls from (names.comm_kernel_rule); `custom_comm(name)`:
    those that are not NCCL's (names.custom_comm_kernel), attributed like all-to-alls."""
    parsed = [parse_moe_range(name) for name in events.names]
    if not any(parsed):
        return None
    of_name = np.asarray([p is not None for p in parsed], dtype=bool)
    ranges = of_name[events.name_id] if len(events) else np.zeros(0, dtype=bool)
    host = np.flatnonzero(ranges & events.of_kind(Kind.USER_ANNOTATION))
    gpu = np.flatnonzero(ranges & events.of_kind(Kind.GPU_USER_ANNOTATION))
    layers = sorted({parsed[i][1] for i in events.name_id[host].tolist() + events.name_id[gpu].tolist()})
    kernels = _kernels_in_expert_ranges(events, gpu, parsed)
    times = [_layer_times(events, host, gpu, parsed, layer, kernels.get(layer)) for layer in layers]
    issued_us = _issue_times(events, collectives, is_comm)
    return MoeRankTimes(steps=max(len(steps), 1), layers=times,
                        all_to_alls=_attributed(events, host, parsed, collectives, issued_us, custom_comm))


def _layer_times(events: TraceEvents, host: np.ndarray, gpu: np.ndarray, parsed: list, layer: int,
                 kernels: tuple[float, float] | None) -> MoeLayerTimes:
    calls, host_us, gpu_us = {}, {}, {}
    for indices, totals in ((host, host_us), (gpu, gpu_us)):
        for index in indices.tolist():
            kind, of_layer = parsed[events.name_id[index]]
            if of_layer != layer:
                continue
            totals[kind] = totals.get(kind, 0.0) + float(events.dur_us[index])
            if indices is host:
                calls[kind] = calls.get(kind, 0) + 1
    gemm_us, all_us = kernels if kernels is not None else (None, None)
    return MoeLayerTimes(layer=layer, calls=calls, host_us=host_us, gpu_us=gpu_us, grouped_gemm_us=gemm_us,
                         expert_kernel_us=all_us)


def _kernels_in_expert_ranges(events: TraceEvents, gpu: np.ndarray, parsed: list) -> dict[int, tuple[float, float]]:
    """layer -> (GEMM kernel us, all kernel us) of kernels starting inside that layer's GPU experts ranges."""
    expert_ranges = [i for i in gpu.tolist() if parsed[events.name_id[i]][0] == MOE_EXPERTS]
    kernels = np.flatnonzero(events.of_kind(Kind.KERNEL))
    if not expert_ranges or not kernels.size:
        return {}
    gemm_of_name = {}
    found: dict[int, list[float]] = {}
    for index in expert_ranges:
        layer = parsed[events.name_id[index]][1]
        start, end = events.start_us[index], events.end_us[index]
        inside = kernels[(events.start_us[kernels] >= start) & (events.start_us[kernels] < end)
                         & (events.device[kernels] == events.device[index])]
        totals = found.setdefault(layer, [0.0, 0.0])
        for kernel in inside.tolist():
            name_id = int(events.name_id[kernel])
            if name_id not in gemm_of_name:
                gemm_of_name[name_id] = kernel_category(events.names[name_id]) == CATEGORY_GEMM
            duration = float(events.dur_us[kernel])
            totals[1] += duration
            totals[0] += duration if gemm_of_name[name_id] else 0.0
    return {layer: (gemm, every) for layer, (gemm, every) in found.items()}


def _issue_times(events: TraceEvents, collectives: CollectiveCalls, is_comm) -> np.ndarray:
    """When the host issued each call, in `collectives` order: for kernels their launches, sorted (the
    order collectives.py keys them in), else the calls' own starts."""
    if collectives.source != SOURCE_NCCL:
        return collectives.start_us
    kernels = events.of_kind(Kind.KERNEL) & events.names_matching(is_comm)
    return np.sort(events.launch_start_us(kernels))


def _attributed(events: TraceEvents, timeline: np.ndarray, parsed: list, collectives: CollectiveCalls,
                issued_us: np.ndarray, custom_comm=None) -> list[MoeAllToAll]:
    if not len(collectives) or not timeline.size or issued_us.size != len(collectives):
        return []
    kinds = collectives.sizes.collective if collectives.sizes is not None else [None] * len(collectives)
    found = []
    for kind in ATTRIBUTED_KINDS:
        chosen = [i for i in timeline.tolist() if parsed[events.name_id[i]][0] == kind]
        if not chosen:
            continue
        starts, ends = events.start_us[chosen], events.end_us[chosen]
        layers = [parsed[events.name_id[i]][1] for i in chosen]
        slot = np.searchsorted(starts, issued_us, side="right") - 1
        for call, position in enumerate(slot.tolist()):
            key = collectives.keys[call]
            if position < 0 or issued_us[call] >= ends[position]:
                continue
            if is_all_to_all_call(key[1], kinds[call]) or (custom_comm is not None and custom_comm(key[1])):
                found.append(MoeAllToAll(key=key, kind=kind, layer=layers[position]))
    return sorted(found, key=lambda a: a.key)
