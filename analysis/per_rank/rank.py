"""Everything computed from one rank's trace file, in one call that a worker process can run.

The event table stays inside the worker; only the compact result (steps, utilization, collective times)
travels back, which keeps the parent's memory flat in the number of ranks.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleetscope.traces.device_peaks import device_name
from fleetscope.traces.validate import world_size_problem

from fleetscope.analysis.inputs.resolve import rank_from_name
from fleetscope.analysis.inputs.sources import TraceSource
from fleetscope.analysis.per_rank.collectives import CollectiveCalls, find_collectives
from fleetscope.analysis.per_rank.events import (
    GPU_ACTIVITY_KINDS,
    NO_ID,
    Kind,
    TraceEvents,
    build_table,
    decode_selectively,
    extract_events,
)
from fleetscope.analysis.per_rank.gpu_time import GpuTime, measure_gpu_time
from fleetscope.analysis.per_rank.hta_native import NotComputable, UnfilteredFrame, parsed_columns, unfiltered_frame
from fleetscope.analysis.per_rank.host_stalls import HostStalls, IdleGaps, find_host_stalls, find_idle_gaps
from fleetscope.analysis.per_rank.saving_reach import with_savings
from fleetscope.analysis.per_rank.step_work import StepWork, measure_step_work
from fleetscope.analysis.per_rank.kernels import KernelTotal, OpDuration, op_durations, top_kernels
from fleetscope.analysis.per_rank.p2p import PointToPoint, find_point_to_point
from fleetscope.analysis.per_rank.moe import MoeRankTimes, measure_moe
from fleetscope.analysis.per_rank.names import (comm_kernel_rule, custom_comm_kernel, is_launch_call,
                                                looks_like_comm_kernel)
from fleetscope.analysis.per_rank.steps import StepTiming, find_steps
from fleetscope.analysis.per_rank.utilization import (
    Utilization,
    build_timeline,
    measure_utilization,
)
from fleetscope.analysis.quantities import step_ranges
from fleetscope.traces.fused import fused_ranks, may_be_fused
from fleetscope.traces.kineto import (
    TraceIdentity,
    TraceReadError,
    decode_trace,
    decompress,
    distributed_rank,
    identity_of_fields,
)

RANK_FROM_MANIFEST = "manifest"
RANK_FROM_TRACE = "distributedInfo"
RANK_FROM_FILE_NAME = "file name"
RANK_FROM_ORDER = "file order"

@dataclass(frozen=True, kw_only=True)
class RankResult:
    """The analysis of one rank's trace in one window."""

    label: str
    path: str
    window: int | None
    rank: int | None
    """None until resolved: no manifest, no distributedInfo and no rank in the file name."""
    rank_source: str
    host: str
    world_size: int | None
    backend: str | None
    base_time_ns: int
    """The trace's `baseTimeNanoseconds`: event times are microseconds after it."""
    event_count: int
    dropped_events: dict[str, int]
    first_start_us: float | None
    """Earliest event start (trace clock); None for a trace without complete events."""
    last_end_us: float | None
    has_gpu: bool
    steps: list[StepTiming]
    step_source: str | None
    utilization: Utilization | None
    collectives: CollectiveCalls
    top_kernels: list[KernelTotal] = dataclasses.field(default_factory=list)
    """This rank's kernels with the most GPU time (kernels.py)."""
    gpu_time: GpuTime | None = None
    """GPU time by phase, user range and kernel category (gpu_time.py); None without GPU activity."""
    host_stalls: HostStalls | None = None
    """Syncs, tensor reads, copies to the host, input waits per step; GPU idle gaps by cause."""
    step_work: StepWork | None = None
    """GEMM precision, the optimizer's implementation, allocator calls per step (step_work.py)."""
    idle_gaps: IdleGaps | None = None
    """Every idle gap inside the steps with its cause (host_stalls.find_idle_gaps): what the merge draws."""
    op_durations: list[OpDuration] = dataclasses.field(default_factory=list)
    """Median duration of each compute kernel (host op on CPU) name (kernels.py)."""
    p2p: PointToPoint = dataclasses.field(default_factory=PointToPoint.none)
    """Point-to-point sends / receives and pipeline-stage compute (p2p.py); no collectives."""
    moe: MoeRankTimes | None = None
    """MoE range times and all-to-all calls by layer (moe.py); None without MoE ranges."""
    remarks: list[str] = dataclasses.field(default_factory=list)
    launch_audit: LaunchAudit | None = None
    """Launch calls and how many have no GPU activity recorded (None: results cached before it was kept)."""
    profiler_events: bool = True
    """The trace holds torch.profiler's events (a known Kineto category): False for a Chrome trace of another
    tool, which the merge draws and the analysis names as no profiler trace (analyze.py)."""
    device_name: str = ""
    """The GPU's name in the trace's `deviceProperties` (the device most of its GPU work ran on); "" where the
    trace names none."""
    process_id: int | None = None
    """The traced process's id (events.TraceEvents.host_pid): traces of one process on one host are windows of
    one rank (cross_rank/placement.py)."""
    """Things about the file a reader should know (e.g. invalid UTF-8 that was replaced)."""
    from_cache: bool = False
    """Read from the parsed-trace cache (result_cache.py) instead of parsed."""
    parsed_while_gathering: bool = False
    """The cache entry was written by gather's pass over the same files (postprocess: one read of each file),
    not by an earlier analysis."""

    def absolute_us(self, trace_us: float) -> float:
        """A trace time as microseconds since the epoch on this rank's own clock."""
        return self.base_time_ns / 1000.0 + trace_us

    def with_placement(self, *, rank: int, rank_source: str, window: int | None) -> "RankResult":
        return dataclasses.replace(self, rank=rank, rank_source=rank_source, window=window)


def other_tool_trace_reason(result: RankResult) -> str | None:
    """Why a parsed file is no torch.profiler trace (a Chrome trace of another tool), as analyze and the merge
    name it; None for a profiler trace."""
    if result.profiler_events:
        return None
    return (f"no torch.profiler events (no cpu_op, user_annotation, cuda_runtime or kernel category among its "
            f"{result.event_count} events): a Chrome trace of another tool")


@dataclass(frozen=True)
class DecodedTrace:
    """A trace's metadata (`distributedInfo`, `baseTimeNanoseconds`, `host_name`), event table and remarks."""

    metadata: dict
    events: TraceEvents
    remarks: list[str]
    hta_frame: UnfilteredFrame | None = None
    """HTA's frame from the same decode, when asked for and the trace has GPU activity the native frame
    reproduces (hta_native.parsed_columns): its views then need no decode of their own."""


def analyze_bytes(source: TraceSource, raw: bytes, comm_kernel_pattern: str | None = None) -> RankResult:
    """The RankResult of one trace file's stored bytes (raises TraceReadError for a file that is no trace);
    kernels matching `comm_kernel_pattern` count as communication too (names.comm_kernel_rule)."""
    return analyze_decoded(source, read_decoded(source.path, raw), comm_kernel_pattern)


def decode_identified(path: Path, raw: bytes) -> tuple[TraceIdentity, DecodedTrace] | None:
    """One decode of a trace's bytes giving both what gather records of it (the identity identify_trace
    gives, from the same fields) and what analyze_decoded needs; None for anything the fast decoder does
    not take (the generic readers then decide, and explain)."""
    decoded = decode_selectively(decompress(raw, path))
    if decoded is None:
        return None
    metadata, events = decoded
    names: set[str] = set()
    table = build_table(events, names_seen=names)
    identity = identity_of_fields(distributed_info=metadata["distributedInfo"], host_name=metadata["host_name"],
                                  event_names=names, event_count=len(events))
    return identity, DecodedTrace(metadata, table, [])


def analyze_decoded(source: TraceSource, decoded: DecodedTrace, comm_kernel_pattern: str | None = None) -> RankResult:
    """analyze_bytes after the decode."""
    document, events, remarks = decoded.metadata, decoded.events, decoded.remarks
    trace_rank, world_size = distributed_rank(document)
    rank, rank_source = _resolve_rank(source, trace_rank)
    steps, step_source = find_steps(events)
    is_comm = comm_kernel_rule(comm_kernel_pattern)
    timeline = build_timeline(events, is_comm)
    info = document.get("distributedInfo")
    collectives = find_collectives(events, steps, timeline.compute, is_comm)
    idle_gaps = find_idle_gaps(events, steps, timeline)
    audit = launch_audit(events)
    return RankResult(
        label=source.label,
        path=str(source.path),
        window=source.window,
        rank=rank,
        rank_source=rank_source,
        host=str(document.get("host_name") or source.host or "unknown-host"),
        world_size=world_size,
        backend=info.get("backend") if isinstance(info, dict) else None,
        base_time_ns=base_time_ns_of(document),
        event_count=len(events) + events.omitted_host_ops,
        dropped_events=dict(events.dropped),
        first_start_us=float(events.start_us.min()) if len(events) else None,
        last_end_us=float(events.end_us.max()) if len(events) else None,
        has_gpu=events.has_gpu_activity,
        steps=steps,
        step_source=step_source,
        utilization=measure_utilization(events, steps, timeline),
        collectives=collectives,
        top_kernels=top_kernels(events),
        gpu_time=measure_gpu_time(events, steps),
        host_stalls=find_host_stalls(events, steps, idle_gaps),
        step_work=with_savings(measure_step_work(events, steps, document.get("deviceProperties")), events, steps,
                                   idle_gaps),
        idle_gaps=idle_gaps,
        op_durations=op_durations(events),
        p2p=find_point_to_point(events, steps),
        moe=measure_moe(events, steps, collectives, is_comm, custom_comm_kernel(comm_kernel_pattern)),
        remarks=remarks + _world_size_remarks(info) + audit.remarks() + comm_kernel_hints(events, is_comm),
        launch_audit=audit,
        process_id=events.host_pid,
        device_name=_main_device_name(events, document.get("deviceProperties")),
        profiler_events=events.omitted_host_ops > 0 or bool(np.any(events.kind != int(Kind.OTHER))),
    )


def _main_device_name(events: TraceEvents, device_properties: Any) -> str:
    devices = events.device[events.of_kind(*GPU_ACTIVITY_KINDS)]
    devices = devices[devices >= 0]
    return device_name(device_properties, int(np.bincount(devices).argmax()) if len(devices) else None)


LOST_LAUNCHES_SHARE = 0.01
LOST_LAUNCHES_MIN = 10
"""Launch calls without recorded GPU work above this share (and count) are records lost, not the window's last
kernels still running when the profiler stopped."""


@dataclass(frozen=True, kw_only=True)
class LaunchAudit:
    """Whether the GPU side of a trace is whole: launch calls (names.HOST_LAUNCH_CALLS, with a correlation id)
    and how many of them no recorded kernel, copy or fill carries."""

    launches: int
    unrecorded: int

    @property
    def nothing_recorded(self) -> bool:
        """CUDA work was launched and none of it recorded (CUPTI off or failed): not a CPU job."""
        return self.launches > 0 and self.unrecorded == self.launches

    @property
    def records_lost(self) -> bool:
        """Some of it unrecorded, beyond noise (CUPTI's buffers capped)."""
        return not self.nothing_recorded and self.unrecorded >= LOST_LAUNCHES_MIN \
            and self.unrecorded >= LOST_LAUNCHES_SHARE * self.launches

    def remarks(self) -> list[str]:
        if self.nothing_recorded:
            return [f"{self.launches} CUDA launch calls but no GPU activity recorded: CUDA work ran and its kernels "
                    "were not recorded (CUPTI off, failed or out of buffers); the figures are the host's side only, "
                    "not a CPU job's"]
        if self.records_lost:
            return [f"{self.unrecorded} of {self.launches} launch calls have no GPU activity recorded (kernel records "
                    "lost, e.g. CUPTI's buffers capped): GPU busy time is undercounted and its idle overcounted"]
        return []


def launch_audit(events: TraceEvents) -> LaunchAudit:
    """The trace's LaunchAudit: launch calls whose correlation id no recorded GPU activity carries."""
    launches = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_launch_call) & (events.correlation != NO_ID)
    count = int(np.count_nonzero(launches))
    if not count:
        return LaunchAudit(launches=0, unrecorded=0)
    gpu = events.of_kind(*GPU_ACTIVITY_KINDS)
    lost = count if not gpu.any() else int(np.count_nonzero(~np.isin(events.correlation[launches],
                                                                          events.correlation[gpu])))
    return LaunchAudit(launches=count, unrecorded=lost)


COMM_HINT_SHARE = 0.01
"""Kernels that look like communication get a hint when they hold at least this share of the GPU time."""
COMM_HINTS_NAMED = 3


def comm_kernel_hints(events: TraceEvents, is_comm) -> list[str]:
    """Kernels whose names speak of communication (names.looks_like_comm_kernel) that no rule counts as such,
    holding COMM_HINT_SHARE of the GPU time: named, with the flag that would count them."""
    kernels = events.of_kind(Kind.KERNEL)
    total = float(events.dur_us[kernels].sum())
    if total <= 0:
        return []
    per_name = np.bincount(events.name_id[kernels], weights=events.dur_us[kernels], minlength=len(events.names))
    suspects = [(float(per_name[i]), events.names[i]) for i in np.flatnonzero(per_name >= COMM_HINT_SHARE * total)
                if looks_like_comm_kernel(events.names[i]) and not is_comm(events.names[i])]
    if not suspects:
        return []
    suspects.sort(reverse=True)
    # no figures in the text: the same kernels on every rank make one note for all of them (report/build.py)
    named = "; ".join(name[:80] for _, name in suspects[:COMM_HINTS_NAMED])
    pattern = "|".join(re.escape(_kernel_word(name)) for _, name in suspects[:COMM_HINTS_NAMED])
    return [f"kernels that look like communication, each {COMM_HINT_SHARE:.0%} or more of the GPU time, are "
            f"counted as compute: {named}; if they communicate, --comm-kernel-pattern '{pattern}' counts them as "
            "communication"]


def _kernel_word(name: str) -> str:
    """The distinctive part of a kernel's name: its function's name without template arguments or parameters."""
    base = name.split("<", 1)[0].split("(", 1)[0].strip()
    return base.rsplit(" ", 1)[-1] or name[:60]


def _world_size_remarks(info: object) -> list[str]:
    """Say so when the trace declares a world size that is not believed (validate.py)."""
    problem = world_size_problem(info.get("world_size")) if isinstance(info, dict) else None
    return [f"distributedInfo: {problem}"] if problem else []


def read_decoded(path: Path, raw: bytes, *, with_hta_frame: bool = False) -> DecodedTrace:
    """The file's stored bytes decoded once: the fast selective decoder, else the generic reader, which also
    explains files that cannot be used. `with_hta_frame`: also HTA's frame of a GPU trace from the same
    decoded events (fast decoder only; None where it cannot be built so, and HTA's stage decodes itself)."""
    data = decompress(raw, path)
    _refuse_fused(path, data)
    decoded = decode_selectively(data)
    if decoded is not None:
        metadata, events = decoded
        table = build_table(events)
        frame = _hta_frame(events) if with_hta_frame and table.has_gpu_activity else None
        return DecodedTrace(metadata, table, [], frame)
    document = decode_trace(raw, path)
    return DecodedTrace(document, extract_events(document), _generic_parse_remarks(data))


def _refuse_fused(path: Path, data: bytes) -> None:
    """A file that fused several ranks (traces/fused.py) is no rank's trace: read as one it would pool their
    steps, GPUs and collectives. Raises TraceReadError naming its ranks and the command that splits it."""
    if not may_be_fused(data):
        return
    try:
        ranks = fused_ranks(decode_trace(data, path))
    except TraceReadError:
        return  # the readers below say what is wrong with it
    if ranks:
        shown = sorted(set(r for r in ranks.values() if r is not None) or ranks)
        raise TraceReadError(path, f"holds {len(shown)} ranks fused into one file (ranks {step_ranges(shown)}), "
                                   "not one rank's trace: split it with `fleetscope split "
                                   f"{shlex.quote(str(path))} -o DIR` and analyze DIR")


def _hta_frame(events: list) -> UnfilteredFrame | None:
    try:
        return unfiltered_frame(parsed_columns(events))
    except (NotComputable, ValueError, TypeError, OverflowError, IndexError, KeyError):
        return None  # HTA's stage then decodes the file itself, and says what it cannot take


def _generic_parse_remarks(data: bytes) -> list[str]:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        return [f"invalid UTF-8 at byte {error.start}: replaced with U+FFFD in names"]
    return []


def _resolve_rank(source: TraceSource, trace_rank: int | None) -> tuple[int | None, str]:
    if source.rank is not None:
        return source.rank, RANK_FROM_MANIFEST
    if trace_rank is not None:
        return trace_rank, RANK_FROM_TRACE
    named = rank_from_name(source.path.name)
    if named is not None:
        return named, RANK_FROM_FILE_NAME
    return None, RANK_FROM_ORDER


def base_time_ns_of(document: dict) -> int:
    """The trace's `baseTimeNanoseconds`; 0 where it is absent or not a time in [0, 2^63) ns (the one rule: the
    analysis and the merge place events by it)."""
    base = document.get("baseTimeNanoseconds")
    return base if isinstance(base, int) and not isinstance(base, bool) and 0 <= base < 2**63 else 0
