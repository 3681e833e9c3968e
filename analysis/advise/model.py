"""What every rule family shares: the evidence a rule reads, the change it proposes, the finding it returns,
the rule's registry entry, and the gain and threshold helpers more than one family uses."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from fleetscope.analysis.quantities import JobStraggler, bounded_gain
from fleetscope.analysis.cross_rank.moe import MoeReport
from fleetscope.traces.validate import finite

STRAGGLER_SHARE = 0.5
"""A rank causing at least this share of the waiting is the straggler (parallelism); the bucket rules stay
silent then (communication): the exposed time is waiting for it."""


TRACE_DATA_SOURCE = "trace DataLoader ranges"
"""Evidence.data_source where data_ms is the trace's DataLoader fetch time (else the step metrics' data_ms)."""


@dataclass(frozen=True, kw_only=True)
class Evidence:
    step_ms: float | None = None
    """The run's step time from step metrics (analysis/quantities.py metrics_step_time_ms)."""
    step_basis: str = ""
    """Where step_ms comes from (analysis/quantities.py metrics_basis)."""
    profiled_step_ms: float | None = None
    """The profiled steps' time (the report's step time, median): what a gain measured in the trace is a part
    of. Profiling lengthens a step (shapes, stacks, CUPTI), mostly on the host; `trace_gain` scales such a
    gain to the steady step."""
    data_ms: float | None = None
    """The trace's DataLoader fetch time per step where the trace has it (slowest rank, median over
    steps), else the step metrics' data_ms: the metric's span also holds whatever else runs before the
    forward on the host (an injected straggler sleep does), the trace's range only the fetch."""
    data_source: str = ""
    data_loader_events: float | None = None
    """Host events the profiler recorded inside the DataLoader ranges of the steps data_ms comes from (median);
    None: data_ms is not the trace's."""
    host_events: float | None = None
    """Host events the profiler recorded in the profiled steps (median; per_rank/steps.py StepTiming.host_events):
    the loader's rank's steps where data_ms is the trace's, else the slowest rank's per step."""
    comm_exposed_ms: float | None = None
    comm_buckets: float | None = None
    """DDP gradient buckets all-reduced per step (step metrics, slowest rank, median over steps)."""
    comm_mb: float | None = None
    """MiB of gradients all-reduced per step (step metrics)."""
    comm_last_bucket_mb: float | None = None
    """MiB of the bucket ready last in each step (step metrics)."""
    trace_collectives_per_step: float | None = None
    """Collectives per profiled step matched across ranks in the trace (median over steps; gradient
    all-reduces plus the trainer's own between steps)."""
    trace_allreduce_mb: float | None = None
    """Mean MiB per all-reduce in the trace, where it records sizes (NCCL; gloo spans carry none)."""
    peak_allocated_mb: float | None = None
    peak_reserved_mb: float | None = None
    alloc_retries: int = 0
    ooms: int = 0
    basis: str | None = None
    """Utilization basis of the trace report ("gpu" | "cpu")."""
    idle_pct: float | None = None
    """Mean over ranks of the report's idle share of the span."""
    exposed_comm_pct: float | None = None
    """Mean over ranks of exposed communication / span, from the trace."""
    overlap_pct: float | None = None
    launch_ms: float | None = None
    """Host time per step inside launch calls (host_stalls.py), mean over the profiled steps of every rank."""
    launches: float | None = None
    """Launch calls per step, the same mean."""
    syncs: float | None = None
    tensor_reads: float | None = None
    pageable_copies: float | None = None
    """Copies from or to pageable host memory per step (host_stalls.py), the same mean."""
    pageable_copy_ms: float | None = None
    """Host time per step inside those copy calls (the call returns when the copy is done), the same mean."""
    score_pass_ms: float = 0.0
    """Non-GEMM passes over a score matrix per step (per_rank/step_work.py score_pass_rows), mean over ranks."""
    score_shapes: list[str] = field(default_factory=list)
    score_gemm_ms: float = 0.0
    """GEMMs over a score matrix per step (step_work.score_gemm_excess), the same mean."""
    score_gemm_excess_ms: float = 0.0
    """Of that, the time beyond their math at a fused kernel's rate, the same mean."""
    score_saving_ms: float | None = None
    """What removing the passes and that excess saves at the step's end (saving_reach.py), mean over ranks; None:
    cannot tell."""
    fp32_saving_ms: float | None = None
    """Per step, what the fp32 math run TENSOR_CORE_SPEEDUP times faster saves at the step's end
    (per_rank/saving_reach.py), mean over ranks; None where no rank's trace can tell."""
    sync_dispatch_ms: float = 0.0
    """Host time per step in the data-dependent-shape ops that sync, outside the syncs (host_stalls.py)."""
    routed_gemm_weights: list[str] = field(default_factory=list)
    """Weights that GEMMs multiplied by many different numbers of rows (per_rank/step_work.py routed_gemms:
    groups of rows counted on the host and launched one group at a time), from the first rank that has them."""
    routed_gemm_launches: float = 0.0
    """Their GEMM launches per step, mean over ranks."""
    routed_loop_saving_ms: float | None = None
    """What the loop over those groups costs at the step's end beyond its reads' idle (per_rank/saving_reach.py
    routed_loop_saving_us), mean over ranks; None: cannot tell."""
    value_use_saving_ms: float | None = None
    """What no longer using the values the syncs read saves at the step's end (per_rank/saving_reach.py
    value_use_saving_us), mean over ranks; None: cannot tell."""
    pageable_copy_gpu_ms: float = 0.0
    """GPU time per step of those copies (the copy itself), the same mean."""
    pageable_copy_refill_ms: float = 0.0
    """GPU idle per step right after those copies, up to their queued waits (the refill), the same mean."""
    pageable_copy_queued_ms: float = 0.0
    """Host time per step in those copy calls while the GPU ran work queued before the copies, the same mean."""
    pageable_copy_mb: float | None = None
    """Megabytes those copies moved per step (their `bytes` args; 0 where the trace does not record them)."""
    pinned_copy_gbps: float = 0.0
    """The rate the trace's own large pinned copies reached (step_work.py), mean over ranks; 0 without them."""
    host_link: str = ""
    host_link_gbps: float = 0.0
    """The GPU's host link and what a pinned copy over it reaches (traces/device_peaks.py); "", 0 if not listed."""
    stall_frames: dict[str, list[str]] = field(default_factory=dict)
    """with_stack traces: the program's frames that hold each kind of stall ("sync", "pageable copy"),
    costliest first, over every rank (host_stalls.py frames)."""
    idle_cause_ms: dict[str, float] = field(default_factory=dict)
    """GPU idle per profiled step by cause (host_stalls.py), mean over ranks."""
    sync_op_ms: dict[str, float] = field(default_factory=dict)
    """Host time per profiled step in each op that made the host sync (host_stalls.py sync_ops: from the op's
    first launch to its sync's end), mean over ranks, costliest first."""
    launch_paced_idle_ms: float = 0.0
    """Of the "host busy elsewhere" idle per profiled step, the part in gaps paced by launch calls
    (host_stalls.py launch_paced_idle_us), mean over ranks: the host dispatching, not busy elsewhere."""
    dispatch_ops: float = 0.0
    """Ops, ranges and runtime calls recorded per profiled step inside the dispatch idle (short gaps and gaps
    paced by launch calls; host_stalls.py dispatch_ops), mean over ranks."""
    launch_idle_ms: float = 0.0
    """The host's time per profiled step inside launch calls while the GPU was idle (host_stalls.py
    launch_idle_us), mean over ranks."""
    launch_call_us: float | None = None
    """The median launch call as recorded (host_stalls.py launch_call_us), median over ranks; None without one."""
    op_held_idle_ms: dict[str, float] = field(default_factory=dict)
    """Per op, the GPU idle per profiled step while the host was inside one long call of it that handed the GPU
    work (host_stalls.py op_held_idle_us), mean over ranks, largest first."""
    stragglers: list[Any] = field(default_factory=list)
    """The report's straggler cause findings (causes.py), all windows."""
    straggler_windows: list[int | None] = field(default_factory=list)
    """The window of each of `stragglers`, in the same order."""
    job_straggler: JobStraggler | None = None
    """The rank the report's verdict names (analysis/quantities.py job_straggler)."""
    whole_run_straggler: Any = None
    """The rank the whole run shows consistently late (cross_rank/whole_run.py run_straggler: an episode over most
    of its steady steps that stands out from its own spread), or None: every steady step of the run, where the
    profiled steps may be too few to tell."""
    config: dict[str, Any] = field(default_factory=dict)
    """job.json spec.train: the trainer configuration of the run (empty for any other program)."""
    program: str = ""
    """"" for fleetscope's trainer; else what ran ("python train.py ...", or "unknown program" for a folder of
    traces): the advice is then a code change, and no trainer setting is read or suggested."""
    moe: MoeReport | None = None
    """The report's MoE section (cross_rank/moe.py): routing, per-rank MoE phase times, hot experts."""
    gemm_ms_by_precision: dict[str, float] = field(default_factory=dict)
    conv_fp32_ms: float = 0.0
    """fp32 convolution work that is no GEMM by name, per profiled step (step_work.py conv_fp32_us)."""
    """GEMM GPU time per profiled step by numeric type (per_rank/step_work.py), mean over ranks."""
    optimizer: str = ""
    """The optimizer's class from its `Optimizer.step#...` ranges; "" where the trace has none."""
    optimizer_impl: str = ""
    """"fused", "foreach" or "per-parameter" (step_work.py)."""
    optimizer_host_ms: float | None = None
    """Host wall time of the optimizer's ranges per profiled step, mean over ranks."""
    optimizer_launches: float | None = None
    optimizer_gpu_ms: float | None = None
    """GPU time of the work the optimizer's ranges launched per profiled step."""
    optimizer_foreach_calls: float | None = None
    """Calls per step of the foreach op called most in the optimizer (per_rank/step_work.py), mean over ranks."""
    allocator_calls: float | None = None
    """cudaMalloc / cudaFree calls per profiled step, mean over ranks."""
    allocator_ms: float | None = None
    """Host time inside them per profiled step."""
    allocator_idle_ms: float = 0.0
    """GPU idle while the host was inside them per profiled step (step_work.py)."""
    compile_ms: float | None = None
    """Host time inside torch.compile's ranges per profiled step (step_work.py), mean over ranks."""
    compile_ids: int = 0
    """Distinct compile ids in the profiled steps, the most over ranks."""
    host_copies: float | None = None
    """Device-to-host copies by copy ops (`.cpu()`, a saved state_dict) per profiled step, mean over ranks."""
    host_copy_ms: float | None = None
    graph_launches: float = 0.0
    """CUDA graph replays per profiled step (step_work.py), mean over ranks."""
    softmax_ms: float = 0.0
    """Softmax kernels' GPU time per profiled step (step_work.py), mean over ranks."""
    fused_attention_ms: float = 0.0
    """Fused attention kernels' GPU time per profiled step, mean over ranks."""
    recompute_ms: float = 0.0
    """GPU time of forward work the backward pass ran again per profiled step (step_work.py: activation
    checkpointing's recomputation), mean over ranks."""
    recompute_idle_ms: float = 0.0
    """GPU idle per profiled step while the backward set each recomputation up and launched it (step_work.py)."""
    gc_ms: float = 0.0
    """Host time inside garbage collections per profiled step (with_stack traces), mean over ranks."""
    gc_count: float = 0.0
    """Collections per profiled step, mean over ranks."""
    python_frames: bool = False
    """Some rank's trace holds Python frames (with_stack)."""
    rank_hosts: dict[int, str] = field(default_factory=dict)
    cpus_per_rank: int | None = None
    """CPUs each rank has on its host (evidence.py _cpus_per_rank): Slurm's cpus_per_task, or a local run's
    launching machine's CPUs over its ranks; None where job.json does not tell."""
    """rank -> host, from the trace report (which ranks share a node)."""

    @property
    def trace_step_ms(self) -> float | None:
        """The step the trace's per-step figures (idle %, ms per profiled step) were measured on: the profiled
        step where known, else the step. A share of it turned into ms is a profiled quantity, which trace_gain
        then scales to the steady step once."""
        return self.profiled_step_ms or self.step_ms

    def setting(self, section: str, name: str, default: Any = None) -> Any:
        """A recorded setting; `default` also where job.json (written by anyone) holds something of another
        type than the default's there (numbers stand for numbers; bools are not numbers)."""
        values = self.config.get(section) if isinstance(self.config, dict) else None
        value = values.get(name, default) if isinstance(values, dict) else default
        return value if default is None or _same_kind(value, default) else default


def _same_kind(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default)
    if isinstance(default, (int, float)):
        return type(value) in (int, float) and finite(value) is not None
    return isinstance(value, type(default))


@dataclass(frozen=True, kw_only=True)
class Change:
    """A change a relaunch of the same job can make (`fleetscope tune --apply`): trainer arguments and
    environment variables, applied over the run's own configuration."""

    train_args: tuple[str, ...] = ()
    """Trainer arguments, e.g. ("--set", "parallel.bucket_cap_mb=12.5") or ("--compile", "reduce-overhead")."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables of every rank, e.g. (("PYTORCH_ALLOC_CONF", "expandable_segments:True"),)."""

    def command_text(self) -> str:
        """The change as a person types it: NAME=VALUE words, then the trainer arguments, shell-quoted."""
        words = [f"{name}={shlex.quote(value)}" for name, value in self.env]
        return " ".join(words + [shlex.quote(arg) for arg in self.train_args])


def settings_change(*assignments: str) -> Change:
    """`--set section.field=value` for each assignment."""
    return Change(train_args=tuple(word for assignment in assignments for word in ("--set", assignment)))


def trainer_change(change: Change, note: str = "") -> dict[str, Any]:
    """A finding's `change` text and `apply`, both from one Change (the text never says what apply does not)."""
    text = change.command_text()
    return {"change": f"{text} ({note})" if note else text, "apply": change}


@dataclass(frozen=True, kw_only=True)
class Finding:
    rule: str
    title: str
    evidence: dict[str, float | int | str]
    """The numbers the finding rests on, units in the names."""
    expected_gain_ms: float | None
    expected_gain_pct: float | None
    confidence: str
    change: str
    """The exact change: a command-line option, an environment variable, or an action."""
    why: str
    apply: Change | None = None
    """The change as a relaunch can make it (None: an action for a person, e.g. replacing a GPU)."""
    gain_of_ms: float | None = None
    """The step time expected_gain_pct is of (analysis/quantities.py Gain)."""
    gain_basis: str = ""
    """Where gain_of_ms comes from ("step metrics, steady steps 4-9 (6), slowest rank per step")."""
    recovers: str = ""
    """The time the change recovers (Rule.recovers): findings recovering the same time overlap, not additive."""
    overlaps: list[str] = field(default_factory=list)
    """Rules of the other findings that recover the same time as this one."""
    ranks: list[int] = field(default_factory=list)
    """Ranks the finding is about (empty: every rank)."""
    windows: list[int | None] = field(default_factory=list)
    """Profiling windows its trace evidence comes from (empty: step metrics or configuration only)."""


@dataclass(frozen=True, kw_only=True)
class Advice:
    run: str
    findings: list[Finding] = field(default_factory=list)
    """Largest expected gain first (findings without an estimate last)."""
    notes: list[str] = field(default_factory=list)
    combined_gain_ms: float | None = None
    """At most this much per step from all findings together: per recovered time the largest gain, summed,
    never more than the step (overlapping findings count once)."""
    combined_gain_of_ms: float | None = None
    combined_gain_basis: str = ""
    complete: bool = True
    """Every trace it rests on could be read (False: some could not, or none was analyzed; the notes say which)."""


UserCodeChange = Callable[[Finding], "str | None"]
"""The user-code change built from a finding; None: the finding's own change stands."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One rule of a family: evidence -> a change for fleetscope's trainer (the finding's change and apply)
    -> the same change in the user's own code, for a program that is not fleetscope's trainer."""

    find: Callable[[Evidence], Finding | None]
    """The rule: a Finding when the evidence calls for a change, else None. Its name is the finding's rule."""
    recovers: str = ""
    """The time its change recovers ("": the finding names it, as the straggler's depends on its cause)."""
    in_user_code: str | UserCodeChange | None = None
    """The change in the user's own code, or a function of the finding that builds it."""
    change_is_code: str = ""
    """Why there is no in_user_code: the finding's own change already reads as code or as an action."""

    def __post_init__(self) -> None:
        if (self.in_user_code is None) == (not self.change_is_code):
            raise ValueError(f"rule {self.name}: in_user_code or change_is_code (why the finding's change is "
                             "already code), exactly one of them")

    @property
    def name(self) -> str:
        return self.find.__name__

    def change_in_user_code(self, finding: Finding) -> str:
        """The finding's change as a program other than fleetscope's trainer makes it."""
        text = self.in_user_code(finding) if callable(self.in_user_code) else self.in_user_code
        return text or finding.change


def trace_gain(evidence: Evidence, gain_ms: float | None) -> tuple[float | None, float | None]:
    """A gain measured per profiled step, scaled to the steady step the run recorded (step metrics): the time a
    change saves shrinks or grows with the step it is part of. Without step metrics the step is the profiled one
    and nothing is scaled."""
    return step_gain(evidence, None if gain_ms is None else gain_ms * profiled_scale(evidence))


def profiled_scale(evidence: Evidence) -> float:
    """steady step / profiled step where both are known, else 1. Profiling usually lengthens the host's part of a
    step (below 1); a step can also run longer unprofiled (above 1: measured on hosts whose CPU ran slower with
    nothing recorded, host-bound programs 20-40% longer than profiled, bench/planted/CORPUS.md), and then the
    host-side time a change saves is longer too."""
    steady, profiled = evidence.step_ms, evidence.profiled_step_ms
    if not steady or not profiled or evidence.step_basis.startswith("trace"):
        return 1.0
    return steady / profiled


def unprofiled_range_ms(evidence: Evidence, range_ms: float, range_events: float | None) -> float | None:
    """A profiled host range's length without the profiler: less its own events' share of what profiling added
    to the step. The profiler's cost is per recorded event (an op, a runtime call, a Python function), so a
    range of numpy or Python without ops (a loader's decoding, a sleep) is hardly lengthened while dispatch of
    thousands of ops is: (profiled step - steady step) / the step's host events is each event's cost. None where
    the steady step is unknown or no shorter than the profiled one, or the events are not counted."""
    steady, profiled, events = evidence.step_ms, evidence.profiled_step_ms, evidence.host_events
    if not steady or not profiled or evidence.step_basis.startswith("trace") or steady >= profiled \
            or not events or range_events is None:
        return None
    per_event_ms = (profiled - steady) / events
    if per_event_ms * 1000.0 > MAX_PROFILER_EVENT_US:
        return None
    return max(range_ms - range_events * per_event_ms, 0.0)


MAX_PROFILER_EVENT_US = 10.0
"""The most the profiler can add per recorded host event, averaged over a step's events (every op counted, those
a GPU trace's table leaves out too): bench/profiler_cost_results.md measured 0.3-4.7 us per event in isolation,
and the held-out programs whose profiled step only the profiler lengthened 1.5-7 us (launch_bound_tiny_layers
4.5 us over its 4,450 events). A step lengthened by more per event was lengthened by something else too (a
collection, a compile, a loader whose time varies: the R3D's took 136 ms in one profiled step and 58 in the
other, 16 us per event), which the events cannot apportion: unprofiled_range_ms then says nothing."""


def unprofiled_dispatch_ms(evidence: Evidence, dispatch_ms: float) -> float:
    """The idle a trace's dispatch gaps (short gaps, gaps paced by launch calls) would hold unprofiled, where no
    steady step tells it (a folder of traces): less the profiler's cost of the ops and runtime calls recorded in
    them, at profiler_event_us each. Where the run recorded its steady step, idle_gain scales the measured idle
    instead, and the idle is returned as it is."""
    per_event_us = profiler_event_us(evidence)
    if per_event_us is None or idle_room_ms(evidence) is not None:
        return dispatch_ms
    return max(dispatch_ms - evidence.dispatch_ops * per_event_us / 1000.0, 0.0)


def profiler_event_us(evidence: Evidence) -> float | None:
    """What the profiler adds per recorded op or runtime call on this trace's host, estimated as
    PROFILER_EVENT_PER_LAUNCH_CALL x its median launch call as recorded; None without launches."""
    if evidence.launch_call_us is None or evidence.launch_call_us <= 0.0:
        return None
    return PROFILER_EVENT_PER_LAUNCH_CALL * evidence.launch_call_us


PROFILER_EVENT_PER_LAUNCH_CALL = 0.5
"""The profiler's cost per recorded op or runtime call, as a share of the trace's median launch call: a host's
speed sets both (the launch call as recorded includes CUPTI's callbacks). bench/profiler_cost_per_launch.py:
over 18 host-bound programs of three hosts whose only cost under profiling is the profiler (launch calls of 4.2
to 8.7 us), median 0.49, quartiles 0.39-0.52; with it a trace alone predicts the unprofiled step of the
host-bound programs to a median 9% (the profiled step as it is: 28%). A fixed cost per event does not carry from
host to host (bench/profiler_cost_results.md)."""


def idle_room_ms(evidence: Evidence) -> float | None:
    """The most GPU idle a steady step can hold: the steady step less the GPU's busy time in the profiled steps
    (the profiler lengthens the host's work, not the kernels'). None where the step is the profiled one (no
    step metrics) or the profiled idle is unknown."""
    steady, profiled = evidence.step_ms, evidence.profiled_step_ms
    if not steady or not profiled or evidence.step_basis.startswith("trace") or evidence.idle_pct is None:
        return None
    return max(steady - profiled * (1.0 - evidence.idle_pct / 100.0), 0.0)


def idle_gain(evidence: Evidence, gain_ms: float | None) -> tuple[float | None, float | None]:
    """A gain that recovers time the GPU waited, measured per profiled step: scaled to the steady step as
    trace_gain does, and no more than its share of the idle the steady step can hold (idle_room_ms): a step
    that profiling lengthened keeps its kernels' time, so its idle shrinks by more than the step's ratio, and
    every cause's idle with it. Where the steady step is the shorter, that is the idle's ratio (steady idle /
    profiled idle): a launch-bound gain keeps the launches' share of the steady idle, not the host work's beside
    it too (bench/planted/CORPUS.md, "Each cause its share of the steady idle")."""
    if gain_ms is None:
        return step_gain(evidence, None)
    scaled = gain_ms * profiled_scale(evidence)
    bound = idle_room_ms(evidence)
    profiled_idle_ms = (evidence.profiled_step_ms or 0.0) * (evidence.idle_pct or 0.0) / 100.0
    if bound is not None and profiled_idle_ms > 0.0:
        # the steady step's idle shrinks for every cause the profiled idle holds, each by its share of it
        bound *= min(gain_ms / profiled_idle_ms, 1.0)
    return step_gain(evidence, scaled if bound is None else min(scaled, bound))


def step_gain(evidence: Evidence, gain_ms: float | None) -> tuple[float | None, float | None]:
    """A gain against the run's step time (step metrics), bounded by it (analysis/quantities.py)."""
    bounded = bounded_gain(gain_ms, evidence.step_ms, evidence.step_basis)
    if bounded is None:
        return (None if gain_ms is None or finite(gain_ms) is None else max(gain_ms, 0.0)), None
    return bounded.ms, bounded.pct
