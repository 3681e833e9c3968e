"""The advisor: rules that map a run's evidence to a configuration change, each with the numbers it rests on.

Evidence (`Evidence`): medians over the run's steady steps of its step metrics (compare.py: every step but
each rank's first and the profiled ones; per step the slowest rank's value), the trace report (utilization,
straggler causes, critical path) and the run's configuration (job.json). Every rule is one function; a rule
returns a `Finding` or None, and its docstring says when it fires and how it estimates the gain:
  expected_gain_ms   step time the change could save per step, estimated from the trace (an upper bound
                     unless the rule says otherwise); expected_gain_pct = of the median step time;
  confidence         "high": the evidence is direct and the change removes it; "medium": the change usually
                     helps this pattern; "low": worth a try.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from fleetscope.analysis.analyze import analyze, load_report_json
from fleetscope.analysis.compare import steady_metrics
from fleetscope.analysis.cross_rank.bandwidth import INTER_NODE, INTRA_NODE, PEAK_BUSBW_GBPS
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, CAUSE_SLOW_DEVICE, CAUSE_WORK
from fleetscope.analysis.cross_rank.moe import MoeFinding, MoeLayerReport, MoeRankLayer, MoeReport
from fleetscope.analysis.job_identity import program_text
from fleetscope.analysis.invariants import audit, auditing, check_advice
from fleetscope.traces.validate import MAX_WORLD_SIZE
from fleetscope.analysis.quantities import (
    JobStraggler,
    bounded_gain,
    job_straggler,
    metrics_basis,
    metrics_step_time_ms,
    step_ranges,
)
from fleetscope.analysis.render.advice_terminal import gain_text
from fleetscope.analysis.report.model import Report, TopFinding
from fleetscope.traces.jobfile import read_job_record
from fleetscope.traces.layout import RunLayout

DATA_SHARE = 0.10
"""Data loading above this share of the step is worth moving to worker processes."""
RECOMMENDED_WORKERS = 8
IDLE_SHARE = 0.25
"""GPU idle above this share of the span (GPU basis) points at launch overhead."""
LAUNCH_RECOVERABLE = 0.5
"""Share of the GPU idle time CUDA graphs are assumed to recover (the rest is data, syncs, Python)."""
EXPOSED_COMM_SHARE = 0.15
OVERLAP_RECOVERABLE = 0.5
"""Share of the exposed communication smaller buckets are assumed to hide behind backward."""
DEFAULT_BUCKET_MB = 25.0
"""DDP's default bucket_cap_mb: large enough that an all-reduce's fixed cost is small beside moving it."""
SMALL_BUCKET_MB = 1.0
"""Buckets below this (mean MiB per all-reduce) are latency-bound: each all-reduce costs a launch, a
rendezvous of the ranks and a few network round trips whatever it carries (NCCL and gloo reach their
bandwidth only at several MiB)."""
MANY_BUCKETS = 8
"""At least this many all-reduces per step of small buckets: the fixed costs add up."""
FEW_BUCKETS = 2
"""At most this many buckets, the last one holding LATE_BUCKET_SHARE of the gradients: nothing overlaps."""
LATE_BUCKET_SHARE = 0.5
FRAGMENTATION_RATIO = 1.3
"""Reserved / allocated peak memory above this: the caching allocator holds fragmented blocks."""
STRAGGLER_SHARE = 0.5
INPUT_WAIT_SHARE = 0.5
"""A host-side straggler whose extra DataLoader time is at least this share of its mean lateness waits for input."""


@dataclass(frozen=True, kw_only=True)
class Evidence:
    step_ms: float | None = None
    """The run's step time from step metrics (analysis/quantities.py metrics_step_time_ms)."""
    step_basis: str = ""
    """Where step_ms comes from (analysis/quantities.py metrics_basis)."""
    data_ms: float | None = None
    """The trace's DataLoader fetch time per step where the trace has it (slowest rank, median over
    steps), else the step metrics' data_ms: the metric's span also holds whatever else runs before the
    forward on the host (an injected straggler sleep does), the trace's range only the fetch."""
    data_source: str = ""
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
    idle_cause_ms: dict[str, float] = field(default_factory=dict)
    """GPU idle per profiled step by cause (host_stalls.py), mean over ranks."""
    stragglers: list[Any] = field(default_factory=list)
    """The report's straggler cause findings (causes.py), all windows."""
    straggler_windows: list[int | None] = field(default_factory=list)
    """The window of each of `stragglers`, in the same order."""
    job_straggler: JobStraggler | None = None
    """The rank the report's verdict names (analysis/quantities.py job_straggler)."""
    config: dict[str, Any] = field(default_factory=dict)
    """job.json spec.train: the trainer configuration of the run (empty for any other program)."""
    program: str = ""
    """"" for fleetscope's trainer; else what ran ("python train.py ...", or "unknown program" for a folder of
    traces): the advice is then a code change, and no trainer setting is read or suggested."""
    moe: MoeReport | None = None
    """The report's MoE section (cross_rank/moe.py): routing, per-rank MoE phase times, hot experts."""
    rank_hosts: dict[int, str] = field(default_factory=dict)
    """rank -> host, from the trace report (which ranks share a node)."""

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
        return type(value) in (int, float) and math.isfinite(value)
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


def _applied(change: Change, note: str = "") -> dict[str, Any]:
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
    """The time the change recovers (RECOVERS): findings recovering the same time overlap, not additive."""
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


RECOVERS = {
    "data_workers": "input wait", "cuda_graphs": "host-side time", "host_work": "host-side time",
    "host_syncs": "host syncs", "gradient_buckets": "exposed communication",
    "allocator": "allocator", "memory_pressure": "memory", "moe_load_balance": "expert imbalance",
    "moe_expert_placement": "expert imbalance", "moe_ep_degree": "all-to-all exchange",
}
"""The time each rule's change recovers; the straggler rule's depends on its cause (_straggler_recovers)."""


def _gain(evidence: Evidence, gain_ms: float | None) -> tuple[float | None, float | None]:
    """A gain against the run's step time (step metrics), bounded by it (analysis/quantities.py)."""
    bounded = bounded_gain(gain_ms, evidence.step_ms, evidence.step_basis)
    if bounded is None:
        return (None if gain_ms is None or not math.isfinite(gain_ms) else max(gain_ms, 0.0)), None
    return bounded.ms, bounded.pct


DATA_WORKERS_CHANGE = settings_change(f"data.num_workers={RECOMMENDED_WORKERS}", "data.persistent_workers=true")


def data_workers(e: Evidence) -> Finding | None:
    """Data loading (median data_ms of the slowest rank) over DATA_SHARE of the step with no worker
    processes: workers prefetch the next batches while the step runs, so up to data_ms per step is saved."""
    workers = e.setting("data", "num_workers", 0)
    if e.data_ms is None or not e.step_ms or workers > 0 or e.data_ms < DATA_SHARE * e.step_ms:
        return None
    gain, pct = _gain(e, e.data_ms)
    return Finding(rule="data_workers", title="data loading stalls the step",
                   evidence={"data_ms": round(e.data_ms, 3), "data_source": e.data_source,
                             "step_ms": round(e.step_ms, 3), "num_workers": workers},
                   expected_gain_ms=gain, expected_gain_pct=pct,
                   confidence="high" if e.data_ms >= 2 * DATA_SHARE * e.step_ms else "medium",
                   **_applied(DATA_WORKERS_CHANGE),
                   why=f"{e.data_ms:.1f} ms of each {e.step_ms:.1f} ms step is spent loading data in the training "
                       "process; worker processes load the next batches while the GPU computes")


LAUNCH_EVIDENCE_SHARE = 0.3
"""The host is launch-bound when its time inside launch calls is at least this share of the GPU's idle time,
or when short gaps between back-to-back kernels are most of that idle time."""
HOST_WORK_SHARE = 0.5
"""GPU idle "host busy elsewhere" above this share of the idle time: the host is busy with other work."""
SYNC_SHARE = 0.10
"""GPU idle after host syncs above this share of the step: the step drains the GPU at syncs."""


DISPATCH_RATE_PER_MS = 10.0
"""At least this many launches per millisecond of GPU idle time: the host does little between launches but
dispatch them (eager PyTorch's per-op overhead, 20-50 launches per idle ms on the H200 fixtures): what
compilation and CUDA graphs remove. A host busy with its own work launches far less often."""


def _launch_bound(e: Evidence, idle_ms: float) -> bool:
    """The GPU's idle time is launch overhead: the host inside launch calls, short gaps between back-to-back
    kernels, or launches dense enough that dispatching them is all the host does."""
    short = e.idle_cause_ms.get("short gaps", 0.0)
    inside = e.launch_ms is not None and e.launch_ms >= LAUNCH_EVIDENCE_SHARE * idle_ms
    dense = e.launches is not None and idle_ms > 0 and e.launches / idle_ms >= DISPATCH_RATE_PER_MS
    return inside or dense or short >= 0.5 * idle_ms


def _syncs_block_graphs(e: Evidence) -> bool:
    """A step that syncs with the host (a tensor read or synchronize in every step) and drains the GPU there
    cannot be captured as one CUDA graph: host_syncs comes first."""
    per_step = (e.syncs or 0.0) + (e.tensor_reads or 0.0)
    return per_step >= 1.0 and host_syncs(e) is not None


def cuda_graphs(e: Evidence) -> Finding | None:
    """GPU idle over IDLE_SHARE of the span (GPU basis) without compilation, and the evidence is launches
    (_launch_bound: the host's time inside launch calls, or short gaps between back-to-back kernels): the host
    cannot launch kernels fast enough. CUDA graphs (`reduce-overhead`; plain `default` under FSDP, whose
    parameters move) replay the step's launches; assumed to recover LAUNCH_RECOVERABLE of the idle time.
    A GPU waiting for other host work is host_work's, not this rule's; a step that drains the GPU at host
    syncs cannot be captured as a graph (host_syncs first)."""
    compiled = e.setting("performance", "compile", "none")
    if e.basis != "gpu" or e.idle_pct is None or e.idle_pct < 100 * IDLE_SHARE or compiled != "none" or not e.step_ms:
        return None
    idle_ms = e.idle_pct / 100 * e.step_ms
    if not _launch_bound(e, idle_ms) or _syncs_block_graphs(e):
        return None
    mode = "default" if str(e.setting("parallel", "mode", "")).startswith("fsdp") else "reduce-overhead"
    gain, pct = _gain(e, LAUNCH_RECOVERABLE * idle_ms)
    evidence = {"gpu_idle_pct": round(e.idle_pct, 1), "launch_ms_per_step": round(e.launch_ms or 0.0, 3),
                "launches_per_step": round(e.launches or 0.0, 1), "compile": compiled}
    return Finding(rule="cuda_graphs", title="the GPU waits for the host to launch kernels",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   **_applied(Change(train_args=("--compile", mode))),
                   why=f"the GPU is idle {e.idle_pct:.0f}% of the profiled steps while the host makes "
                       f"{e.launches or 0.0:.0f} launch calls per step ({(e.launches or 0.0) / idle_ms:.0f} per ms of "
                       f"GPU idle, {e.launch_ms or 0.0:.2f} ms inside them): it does little but dispatch; compiling fuses "
                       "kernels and " + ("CUDA graphs replay the launches without the host" if mode == "reduce-overhead"
                                         else "cuts launches (CUDA graphs need fixed parameter addresses, which FSDP "
                                              "does not keep)"))


def host_work(e: Evidence) -> Finding | None:
    """GPU idle over IDLE_SHARE, most of it (HOST_WORK_SHARE) "host busy elsewhere", and not launch-bound: the
    host is busy with work that launches nothing (tensors built on the CPU, Python, copies from pageable
    memory, I/O). Gain, an upper bound: that idle time per step. No setting fixes it: the change is in code."""
    if e.basis != "gpu" or e.idle_pct is None or e.idle_pct < 100 * IDLE_SHARE or not e.step_ms:
        return None
    idle_ms = e.idle_pct / 100 * e.step_ms
    busy_ms = e.idle_cause_ms.get("host busy elsewhere", 0.0)
    if busy_ms < HOST_WORK_SHARE * idle_ms or _launch_bound(e, idle_ms):
        return None
    gain, pct = _gain(e, busy_ms)
    return Finding(rule="host_work", title="the GPU waits for host work that launches nothing",
                   evidence={"gpu_idle_pct": round(e.idle_pct, 1), "host_busy_idle_ms_per_step": round(busy_ms, 3),
                             "launch_ms_per_step": round(e.launch_ms or 0.0, 3)},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   change="move the host work between launches off the step: build batches and tensors on the device "
                          "(torch.randn(..., device='cuda')), copy with non_blocking=True from pinned memory, keep "
                          "Python bookkeeping out of the loop; its CPU threads in the merged trace (profile with "
                          "with_stack for the frames) show which code it is",
                   why=f"the GPU is idle {e.idle_pct:.0f}% of the step, {busy_ms:.2f} ms per step while the host "
                       f"was busy elsewhere, but only {e.launch_ms or 0.0:.2f} ms per step inside "
                       f"{e.launches or 0.0:.0f} launch calls ({(e.launches or 0.0) / idle_ms:.1f} per ms of idle): "
                       "CUDA graphs would not help; the host's own work holds the GPU back")


def host_syncs(e: Evidence) -> Finding | None:
    """GPU idle right after host syncs and tensor reads (idle cause "host sync") over SYNC_SHARE of the step:
    each sync drains the GPU queue. Gain: that idle time per step."""
    sync_ms = e.idle_cause_ms.get("host sync", 0.0)
    if e.basis != "gpu" or not e.step_ms or sync_ms < SYNC_SHARE * e.step_ms:
        return None
    gain, pct = _gain(e, sync_ms)
    return Finding(rule="host_syncs", title="the step drains the GPU at host syncs",
                   evidence={"sync_idle_ms_per_step": round(sync_ms, 3), "syncs_per_step": round(e.syncs or 0.0, 1),
                             "tensor_reads_per_step": round(e.tensor_reads or 0.0, 1)},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   change="remove the .item() / torch.cuda.synchronize() calls from the step (keep values on the GPU "
                          "and read them every N steps); with_stack traces name the frames",
                   why=f"the GPU waits {sync_ms:.2f} ms per step after host syncs ({e.syncs or 0.0:.1f} syncs and "
                       f"{e.tensor_reads or 0.0:.1f} tensor reads per step): each one empties the GPU's queue, and "
                       "no CUDA graph can capture a step that syncs")


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """Which way the DDP bucket size should move, and the evidence that says so."""

    direction: str
    """"raise" (many small, latency-bound all-reduces), "lower" (one large bucket ready at the end of
    backward, nothing to overlap it with) or "split" (exposed with several buckets: start earlier)."""
    bucket_mb: float
    """The proposed bucket_cap_mb."""
    buckets: float | None
    mean_bucket_mb: float | None
    new_buckets: float | None
    """Buckets per step expected at the proposed size."""


def plan_buckets(e: Evidence) -> BucketPlan | None:
    """The direction from the buckets themselves (step metrics: count and MiB per step; else the trace's
    collectives per step and, on NCCL, its all-reduce sizes). None: no change that would differ."""
    bucket = float(e.setting("parallel", "bucket_cap_mb", DEFAULT_BUCKET_MB))
    buckets = e.comm_buckets if e.comm_buckets is not None else e.trace_collectives_per_step
    mean_mb = (e.comm_mb / e.comm_buckets if e.comm_mb is not None and e.comm_buckets else e.trace_allreduce_mb)
    small = mean_mb < SMALL_BUCKET_MB if mean_mb is not None else bucket < SMALL_BUCKET_MB
    if buckets is not None and buckets >= MANY_BUCKETS and small:
        target = DEFAULT_BUCKET_MB if bucket < DEFAULT_BUCKET_MB else 4 * bucket
        return BucketPlan(direction="raise", bucket_mb=target, buckets=buckets, mean_bucket_mb=mean_mb,
                          new_buckets=_buckets_at(e, target, buckets, bucket))
    late_share = (e.comm_last_bucket_mb / e.comm_mb if e.comm_last_bucket_mb is not None and e.comm_mb else None)
    if buckets is not None and buckets <= FEW_BUCKETS and (late_share is None or late_share >= LATE_BUCKET_SHARE):
        target = max(SMALL_BUCKET_MB, min(bucket / 2, (e.comm_mb or 2 * bucket) / 4))
        new_buckets = _buckets_at(e, target, buckets, bucket)
        if target >= bucket or (new_buckets is not None and new_buckets <= buckets):
            return None                     # the gradients fit one small bucket: splitting cannot overlap
        return BucketPlan(direction="lower", bucket_mb=target, buckets=buckets, mean_bucket_mb=mean_mb,
                          new_buckets=new_buckets)
    if bucket / 2 < SMALL_BUCKET_MB:
        return None
    return BucketPlan(direction="split", bucket_mb=bucket / 2, buckets=buckets, mean_bucket_mb=mean_mb,
                      new_buckets=_buckets_at(e, bucket / 2, buckets, bucket))


def _buckets_at(e: Evidence, target_mb: float, buckets: float, bucket_mb: float) -> float | None:
    """Buckets per step at `target_mb`: the gradient MiB over it (at least 1), else scaled from now."""
    if e.comm_mb is not None:
        return float(max(1, math.ceil(e.comm_mb / target_mb)))
    return max(1.0, buckets * bucket_mb / target_mb) if buckets else None


def gradient_buckets(e: Evidence) -> Finding | None:
    """DDP with exposed communication over EXPOSED_COMM_SHARE of the span; the direction comes from the
    buckets (plan_buckets):
      raise  MANY_BUCKETS or more per step, SMALL_BUCKET_MB or less each: every all-reduce pays a fixed
             cost; larger buckets (DEFAULT_BUCKET_MB) pay it fewer times. Gain: the exposed time in
             proportion to the all-reduces removed (exposed x (1 - new/old buckets)); confidence medium.
             A straggler does not silence it: fewer all-reduces also means fewer rendezvous to wait at.
      lower  FEW_BUCKETS or fewer, the last holding LATE_BUCKET_SHARE of the gradients, overlap < 50%:
             that bucket is ready only when backward ends; smaller ones start during backward.
      split  exposed with several buckets and overlap < 50%: halve the bucket to start earlier.
    lower and split are assumed to hide OVERLAP_RECOVERABLE of the exposed time (confidence low), and stay
    silent when a straggler causes most of the waiting (then the exposed time is waiting for it)."""
    if e.setting("parallel", "mode") != "ddp" or e.exposed_comm_pct is None:
        return None
    if e.exposed_comm_pct < 100 * EXPOSED_COMM_SHARE:
        return None
    plan = plan_buckets(e)
    if plan is None:
        return None
    if plan.direction != "raise":
        if any(f.wait_share >= STRAGGLER_SHARE for f in e.stragglers) or (e.overlap_pct or 0.0) >= 50.0:
            return None             # the exposed time is then mostly waiting for that rank: buckets do not help
    bucket = float(e.setting("parallel", "bucket_cap_mb", DEFAULT_BUCKET_MB))
    exposed_ms = e.comm_exposed_ms if e.comm_exposed_ms is not None else (
        e.exposed_comm_pct / 100 * e.step_ms if e.step_ms else None)
    if plan.direction == "raise":
        kept = plan.new_buckets / plan.buckets if plan.new_buckets is not None and plan.buckets else 1.0
        gain_ms = exposed_ms * (1.0 - kept) if exposed_ms is not None else None
    else:
        gain_ms = OVERLAP_RECOVERABLE * exposed_ms if exposed_ms is not None else None
    gain, pct = _gain(e, gain_ms)
    return Finding(rule="gradient_buckets", title=_BUCKET_TITLES[plan.direction],
                   evidence=_bucket_evidence(e, plan, bucket), expected_gain_ms=gain, expected_gain_pct=pct,
                   confidence="medium" if plan.direction == "raise" else "low",
                   **_applied(settings_change(f"parallel.bucket_cap_mb={plan.bucket_mb:g}")),
                   why=_bucket_why(e, plan, bucket))


_BUCKET_TITLES = {
    "raise": "many small gradient all-reduces: each pays a fixed cost",
    "lower": "the gradients all-reduce in one bucket after backward",
    "split": "gradient all-reduces are not hidden behind backward",
}


def _bucket_evidence(e: Evidence, plan: BucketPlan, bucket: float) -> dict[str, float | int | str]:
    evidence: dict[str, float | int | str] = {"exposed_comm_pct": round(e.exposed_comm_pct or 0.0, 1),
                                              "overlap_pct": round(e.overlap_pct or 0.0, 1), "bucket_cap_mb": bucket}
    known = {"buckets_per_step": plan.buckets, "mean_bucket_mb": plan.mean_bucket_mb,
             "grad_mb_per_step": e.comm_mb, "last_bucket_mb": e.comm_last_bucket_mb,
             "trace_collectives_per_step": e.trace_collectives_per_step, "expected_buckets": plan.new_buckets}
    evidence.update({k: round(v, 4) for k, v in known.items() if v is not None})
    return evidence


def _bucket_why(e: Evidence, plan: BucketPlan, bucket: float) -> str:
    exposed = f"{e.exposed_comm_pct:.0f}% of the step is communication nothing overlaps ({e.overlap_pct or 0:.0f}% overlap)"
    count = f"{plan.buckets:.0f} all-reduces per step" if plan.buckets is not None else "the all-reduces"
    size = f" of {plan.mean_bucket_mb:.3g} MiB on average" if plan.mean_bucket_mb is not None else ""
    if plan.direction == "raise":
        return (f"{exposed}; {count}{size} (bucket_cap_mb={bucket:g}): each pays a launch, a rendezvous of the "
                f"ranks and network round trips whatever it carries; {plan.bucket_mb:g} MiB buckets need "
                f"{plan.new_buckets or 1:.0f}")
    if plan.direction == "lower":
        return (f"{exposed}; {count}{size}, the last ready only when backward ends; {plan.bucket_mb:g} MiB "
                "buckets are ready, and sent, while backward still runs")
    return f"{exposed}; smaller buckets are ready, and sent, earlier in backward"


EXPANDABLE = "expandable_segments:True"


def allocator(e: Evidence) -> Finding | None:
    """Reserved over FRAGMENTATION_RATIO x allocated peak memory, or allocator retries, without expandable
    segments: the caching allocator fragments (retries free its cache and synchronize). No time estimate."""
    if "expandable_segments" in str(e.setting("performance", "alloc_conf", "")):
        return None
    ratio = (e.peak_reserved_mb / e.peak_allocated_mb) if e.peak_reserved_mb and e.peak_allocated_mb else None
    if not e.alloc_retries and (ratio is None or ratio < FRAGMENTATION_RATIO):
        return None
    evidence = {"alloc_retries": e.alloc_retries}
    if ratio is not None:
        evidence.update(peak_reserved_mb=round(e.peak_reserved_mb, 1), peak_allocated_mb=round(e.peak_allocated_mb, 1))
    current = str(e.setting("performance", "alloc_conf", "") or "")
    conf = f"{current},{EXPANDABLE}" if current else EXPANDABLE
    return Finding(rule="allocator", title="the CUDA caching allocator fragments", evidence=evidence,
                   expected_gain_ms=None, expected_gain_pct=None, confidence="high" if e.alloc_retries else "medium",
                   **_applied(settings_change(f"performance.alloc_conf={conf}"),
                              note=f"PYTORCH_ALLOC_CONF={conf} for other programs"),
                   why="reserved memory well above what tensors use, or allocation retries (each one frees the cache "
                       "and synchronizes); expandable segments grow one mapping instead of caching odd-sized blocks")


def memory_pressure(e: Evidence) -> Finding | None:
    """Out-of-memory errors or allocator retries without activation checkpointing: trade recompute for memory."""
    if e.setting("performance", "activation_checkpointing", "none") != "none" or not (e.ooms or e.alloc_retries):
        return None
    return Finding(rule="memory_pressure", title="the step runs out of memory headroom",
                   evidence={"ooms": e.ooms, "alloc_retries": e.alloc_retries},
                   expected_gain_ms=None, expected_gain_pct=None, confidence="medium",
                   **_applied(settings_change("performance.activation_checkpointing=selective")),
                   why="activations are recomputed in backward instead of kept: less peak memory (room for the "
                       "allocator, or a larger batch) for about a third more compute in the checkpointed blocks")


_STRAGGLER_CHANGES = {
    CAUSE_SLOW_DEVICE: "take the rank's GPU or node out of the pool (e.g. sbatch --exclude=HOST) and check its "
                       "clocks, power and thermals (nvidia-smi -q -d PERFORMANCE)",
    CAUSE_WORK: "balance the work: for MoE, raise the router's load-balancing loss or the expert capacity so "
                "tokens spread evenly",
    CAUSE_HOST: "find the host-side delay on that rank (its CPU threads in the merged trace: syncs, Python, "
                "other processes on its CPUs) and pin its CPUs",
}


def straggler(e: Evidence) -> Finding | None:
    """The rank the verdict names the straggler (analysis/quantities.py job_straggler: most waiting caused over
    all windows, consistently) when it causes >= STRAGGLER_SHARE of the waiting for a cause with a remedy. Its cause: its cause finding
    in the window where it causes the largest share. Gain: the mean what-if saving over its steps in every
    window (causes.py, clamped to the step's compute floor), as a share of those steps' mean time. A host-side
    delay that is its DataLoader (INPUT_WAIT_SHARE of its lateness) gets data workers as the change; data
    workers are never suggested when its DataLoader takes no longer than its peers'."""
    job = e.job_straggler
    if job is None or not job.consistent or job.share < STRAGGLER_SHARE:
        return None             # the verdict names no straggler (no single rank the others wait for): neither does advise
    own = [(f, w) for f, w in zip(e.stragglers, _padded(e.straggler_windows, len(e.stragglers))) if f.rank == job.rank]
    top, _ = max(own, key=lambda fw: fw[0].wait_share, default=(None, None))
    if top is None or top.cause not in _STRAGGLER_CHANGES:
        return None
    what_if = [(w, step) for f, w in own for step in f.what_if]
    saved = [step.step_time_ms - step.projected_step_ms for _, step in what_if]
    of_ms = float(np.mean([step.step_time_ms for _, step in what_if])) if what_if else None
    bounded = bounded_gain(float(np.mean(saved)) if saved else None, of_ms, _what_if_basis(what_if))
    windows = sorted({w for _, w in own}, key=lambda w: -1 if w is None else w)
    evidence = {"rank": job.rank, "wait_share": round(job.share, 3), "windows": _windows_text(windows),
                "mean_lateness_ms": round(top.mean_lateness_us / 1000, 3)}
    change, kind = {"change": _STRAGGLER_CHANGES[top.cause]}, top.cause
    excess = top.data_loader_excess_ms
    if top.cause == CAUSE_HOST and excess is not None and excess > 0 and excess >= INPUT_WAIT_SHARE * top.mean_lateness_us / 1000:
        evidence["data_loader_excess_ms"] = round(excess, 3)
        if e.setting("data", "num_workers", 0) < RECOMMENDED_WORKERS:
            change = _applied(DATA_WORKERS_CHANGE, note="its input pipeline is the delay")
        else:
            change = {"change": "its input pipeline is the delay although it has workers: more workers, or a faster "
                                "source (local copy, pre-tokenized data)"}
        kind = "input wait"
    return Finding(rule="straggler", title=f"rank {job.rank} holds the others back ({kind})", evidence=evidence,
                   expected_gain_ms=bounded.ms if bounded else None, expected_gain_pct=bounded.pct if bounded else None,
                   gain_of_ms=bounded.of_ms if bounded else None, gain_basis=bounded.basis if bounded else "",
                   confidence="high" if top.explained_share >= 0.8 else "medium",
                   **change, why=top.explanation, recovers=_straggler_recovers(kind), ranks=[job.rank],
                   windows=windows)


def _padded(windows: list, count: int) -> list:
    return list(windows) + [None] * (count - len(windows))


def _windows_text(windows: list[int | None]) -> str:
    return ", ".join("-" if w is None else str(w) for w in windows) or "-"


def _what_if_basis(what_if: list) -> str:
    by_window: dict = {}
    for window, step in what_if:
        by_window.setdefault(window, []).append(step.step)
    parts = [f"window {'-' if w is None else w} steps {step_ranges(steps)}" for w, steps in by_window.items()]
    return f"trace, the steps it was late in ({'; '.join(parts)}), slowest rank per step"


def _straggler_recovers(kind: str) -> str:
    return {"input wait": "input wait", CAUSE_HOST: "host-side time"}.get(kind, f"straggler ({kind})")


MOE_RULES_SOURCE = "the report's MoE section"
RANK_OVERLOAD_RATIO = 1.25
"""An ep rank whose experts receive at least this many times its ep group's mean tokens (MoE section
rank_max_over_mean) holds too much of the load: expert placement can move some of it."""
ALL_TO_ALL_VS_EXPERTS = 1.0
"""The MoE all-to-alls' transfer time at least this many times the experts' compute: the exchange, not
the experts, sets the MoE layers' time."""
ALL_TO_ALL_STEP_SHARE = 0.25
"""... and at least this share of the step (both are needed: a cheap exchange is not worth a new EP degree)."""
AUX_LOSS_COEF = 0.01
"""The load-balancing loss coefficient suggested (Switch Transformer's; transformers' defaults are 0.001-0.01)."""
AUX_LOSS_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss")
"""Families whose transformers config has router_aux_loss_coef / output_router_logits."""
BIAS_BALANCED_FAMILIES = ("deepseek_v3",)
"""Families whose router adds a per-expert bias for balancing (e_score_correction_bias) instead of a loss."""
BIAS_UPDATE_RATE = 0.001
"""The bias update rate suggested (DeepSeek-V3's gamma)."""


def _router_fault(e: Evidence) -> str | None:
    """The trainer fault that biases the router in this run (its configuration), as a --set to undo it."""
    if int(e.setting("faults", "hot_expert", -1)) >= 0:
        return "faults.hot_expert=-1"
    if float(e.setting("faults", "expert_skew", 0.0)) > 0:
        return "faults.expert_skew=0"
    return None


def _layer(moe: MoeReport, index: int) -> MoeLayerReport | None:
    return next((layer for layer in moe.layers if layer.layer == index), None)


def _expert_ms(rank: MoeRankLayer) -> float | None:
    """One rank's expert compute in one layer, ms per step: the GPU `moe/experts` range, else its GEMMs,
    else the host range (CPU traces)."""
    if "experts" in rank.gpu_ms:
        return rank.gpu_ms["experts"]
    if rank.grouped_gemm_ms is not None:
        return rank.grouped_gemm_ms
    return rank.host_ms.get("experts")


def _holder_extra_ms(moe: MoeReport, finding: MoeFinding) -> float | None:
    """How much longer the hot expert's ranks compute their experts than the median other rank, in the
    finding's layer (ms per step): what the others wait for at the combine. None: no range times."""
    layer = _layer(moe, finding.layer)
    if layer is None or not finding.ranks:
        return None
    times = {r.rank: _expert_ms(r) for r in layer.ranks}
    holders = [times[r] for r in finding.ranks if times.get(r) is not None]
    others = [v for r, v in times.items() if r not in finding.ranks and v is not None]
    if not holders or not others:
        return None
    return max(max(holders) - float(np.median(others)), 0.0)


def _hot_cost(moe: MoeReport, findings: list[MoeFinding]) -> tuple[float | None, float | None]:
    """(extra expert compute of the hot ranks, the measured combine waiting they cause), ms per step,
    summed over the findings' layers; None where unknown."""
    extra = [x for x in (_holder_extra_ms(moe, f) for f in findings) if x is not None]
    waited = [f.cost_ms_per_step for f in findings if f.cost_ms_per_step is not None]
    return (float(sum(extra)) if extra else None), (float(sum(waited)) if waited else None)


def _hottest(findings: list[MoeFinding]) -> MoeFinding:
    """The finding with the most tokens over the mean (to 1%), then the most observed waiting."""
    return max(findings, key=lambda f: (round(f.tokens_vs_mean, 2), f.holder_last_pct or 0.0, f.cost_ms_per_step or 0.0))


def _balance_change(e: Evidence) -> tuple[str, Change | None]:
    fault = _router_fault(e)
    if fault is not None:
        return (f"--set {fault} (this run's router fault is the imbalance; in a real job: the load-balancing "
                "loss or router bias below)", Change(train_args=("--set", fault)))
    family = str(e.setting("model", "family", ""))
    capacity = "; or cap each expert at 1.25x the mean tokens per expert (capacity factor 1.25: overflow tokens skip the layer)"
    if family in AUX_LOSS_FAMILIES:
        change = _raised_setting(e, "router_aux_loss_coef", AUX_LOSS_COEF)
        if change is not None:
            applied = _applied(change, "the trainer's router load-balancing loss" + capacity)
            return applied["change"], applied["apply"]
        return (f"train with the router's load-balancing loss (router_aux_loss_coef={AUX_LOSS_COEF:g}; the trainer's "
                "model.router_aux_loss_coef needs its MoE layers: no pipeline, no tensor parallelism without "
                "expert parallelism)" + capacity, None)
    if family in BIAS_BALANCED_FAMILIES:
        change = _raised_setting(e, "router_bias_update_rate", BIAS_UPDATE_RATE)
        if change is not None:
            applied = _applied(change, "the trainer's auxiliary-loss-free router bias update" + capacity)
            return applied["change"], applied["apply"]
        return ("update the router's e_score_correction_bias after every step (auxiliary-loss-free balancing: "
                "bias[e] -= 1e-3 * sign(tokens[e] - mean tokens); the trainer's model.router_bias_update_rate "
                "needs its MoE layers: no pipeline, no tensor parallelism without expert parallelism)" + capacity,
                None)
    return ("raise the router's load-balancing loss coefficient (or update a per-expert router bias towards "
            "the mean load)" + capacity, None)


def _raised_setting(e: Evidence, name: str, suggested: float) -> Change | None:
    """`--set model.<name>=...` (router_aux_loss_coef, router_bias_update_rate) for a run the trainer can
    balance (trainer/load_balance.py: its MoE layers wrap every router unless the run is pipelined or
    tensor-parallel without expert parallelism, which its configuration refuses); `suggested`, or twice the
    run's own value where it already has one. None: the layout cannot take it."""
    parallel = {key: e.setting("parallel", key, 1) for key in ("pp", "tp", "ep")}
    if int(parallel["pp"]) > 1 or (int(parallel["tp"]) > 1 and int(parallel["ep"]) <= 1):
        return None
    current = float(e.setting("model", name, 0.0) or 0.0)
    value = suggested if current < suggested else 2 * current
    return settings_change(f"model.{name}={value:g}")


def moe_load_balance(e: Evidence) -> Finding | None:
    """Fires when the MoE section names a hot expert (an expert with >= its hot_expert_min_ratio times the
    mean expert's tokens in a layer). Gain, with expert parallelism: the hot experts' ranks' extra expert
    compute over the median other rank, summed over the layers (what the others wait for at each combine;
    balanced routing removes it: an upper bound); none without expert parallelism (every rank runs every
    expert: the imbalance only makes some GEMMs larger). Confidence high when the waiting is also observed
    (the holders arrived last at the combine in at least half of the instances), medium with ep > 1
    otherwise, low with ep 1. The change: undo this run's router fault (faults.hot_expert / expert_skew)
    where one is set, else the family's balancing mechanism or a capacity factor: the trainer's load-balancing
    loss (--set model.router_aux_loss_coef) for the softmax-routed families, DeepSeek-V3's router bias update
    (--set model.router_bias_update_rate), applied where the run's layout lets the trainer do it."""
    moe = e.moe
    if moe is None or not moe.findings:
        return None
    top = _hottest(moe.findings)
    extra_ms, waited_ms = _hot_cost(moe, moe.findings)
    gain, pct = _gain(e, extra_ms if moe.ep > 1 else None)
    observed = [f for f in moe.findings if (f.holder_last_pct or 0.0) >= 50.0]
    confidence = "low" if moe.ep <= 1 else ("high" if observed else "medium")
    evidence: dict[str, float | int | str] = {
        "source": MOE_RULES_SOURCE, "expert": top.expert, "layer": top.layer,
        "tokens_vs_mean": round(top.tokens_vs_mean, 3), "layers_with_hot_expert": len(moe.findings),
        "ep": moe.ep, "ranks": ", ".join(map(str, top.ranks)) or "all"}
    layer = _layer(moe, top.layer)
    if layer is not None and layer.rank_max_over_mean is not None:
        evidence["rank_max_over_mean"] = round(layer.rank_max_over_mean, 3)
    if extra_ms is not None:
        evidence["hot_rank_extra_expert_ms"] = round(extra_ms, 3)
    if waited_ms is not None:
        evidence["combine_wait_caused_ms"] = round(waited_ms, 3)
    change, apply = _balance_change(e)
    where = f" on rank{'s' if len(top.ranks) > 1 else ''} {', '.join(map(str, top.ranks))}" if top.ranks else ""
    return Finding(rule="moe_load_balance",
                   title=f"uneven routing: expert {top.expert} (layer {top.layer}){where} gets "
                         f"{top.tokens_vs_mean:.1f}x the mean tokens",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct, confidence=confidence,
                   change=change, apply=apply,
                   why=top.sentence + ("" if extra_ms is None else
                                       f"; its ranks compute their experts {extra_ms:.2f} ms per step longer than the others"))


def _ep_loads(layer: MoeLayerReport, ep: int) -> list[float]:
    """Tokens per ep rank of one layer (all groups summed): expert e lives on ep rank e // (E / ep)."""
    per = len(layer.tokens_per_expert) // ep
    return [float(sum(layer.tokens_per_expert[k * per:(k + 1) * per])) for k in range(ep)]


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """A change of where experts live, and how much of the hottest ep rank's excess load it leaves."""

    action: str
    """"swap" (exchange the hot expert with the expert of the coldest ep rank that balances best) or "replicate"
    (a second copy of the hot expert on the coldest ep rank takes half its tokens)."""
    expert: int
    to_ep_rank: int
    swap_with: int | None
    remaining_excess: float
    """The heaviest ep rank's load over the mean after the change, as a share of today's (0: balanced)."""


def plan_placement(tokens_per_expert: list[float], ep: int, expert: int) -> PlacementPlan | None:
    """The better of swapping and replicating the hot `expert` (pure: loads in, plan out); None when the
    hot expert's ep rank is not the heaviest or nothing improves."""
    # numbers read back from report.json: a degree or an expert outside the layer's experts plans nothing
    if type(ep) is not int or type(expert) is not int or not 1 < ep <= len(tokens_per_expert) \
            or not 0 <= expert < len(tokens_per_expert):
        return None
    per = len(tokens_per_expert) // ep
    loads = [float(sum(tokens_per_expert[k * per:(k + 1) * per])) for k in range(ep)]
    mean, hot = float(np.mean(loads)), expert // per
    excess = max(loads) - mean
    if excess <= 0 or loads[hot] < max(loads):
        return None
    cold = min((k for k in range(ep) if k != hot), key=lambda k: loads[k])
    tokens = float(tokens_per_expert[expert])
    plans = []
    for partner in range(cold * per, (cold + 1) * per) if per > 1 else ():
        moved = tokens - float(tokens_per_expert[partner])
        after = list(loads)
        after[hot], after[cold] = loads[hot] - moved, loads[cold] + moved
        plans.append(PlacementPlan(action="swap", expert=expert, to_ep_rank=cold, swap_with=partner,
                                   remaining_excess=max(max(after) - mean, 0.0) / excess))
    after = list(loads)
    after[hot], after[cold] = loads[hot] - tokens / 2, loads[cold] + tokens / 2
    plans.append(PlacementPlan(action="replicate", expert=expert, to_ep_rank=cold, swap_with=None,
                               remaining_excess=max(max(after) - mean, 0.0) / excess))
    best = min(plans, key=lambda p: p.remaining_excess)
    return best if best.remaining_excess < 1.0 else None


def moe_expert_placement(e: Evidence) -> Finding | None:
    """Fires with expert parallelism when a hot expert's ep rank is overloaded: its layer's
    rank_max_over_mean >= RANK_OVERLOAD_RATIO and that rank is the heaviest. The change moves load off it
    (plan_placement: swap the hot expert with the coldest rank's expert that balances best, or replicate it there).
    Gain: the holders' extra expert compute over the median other rank (what the others wait for at the
    combine), times the share of the excess load the plan removes, summed over the layers with that hot
    expert. Confidence medium when the holders were observed arriving last at the combine in at least half
    of the instances, else low. No trainer option places experts: the change is an action."""
    moe = e.moe
    candidates = _placement_candidates(moe) if moe is not None and moe.ep > 1 else []
    if not candidates:
        return None
    finding, layer, plan = max(candidates, key=lambda c: (round(c[1].rank_max_over_mean, 2), c[0].holder_last_pct or 0.0))
    same = [(f, p) for f, _, p in candidates if f.expert == finding.expert]
    extra = [(_holder_extra_ms(moe, f), p) for f, p in same]
    known = [x * (1.0 - p.remaining_excess) for x, p in extra if x is not None]
    gain, pct = _gain(e, float(sum(known)) if known else None)
    holders = ", ".join(map(str, finding.ranks))
    observed = [f for f, _ in same if (f.holder_last_pct or 0.0) >= 50.0]
    evidence: dict[str, float | int | str] = {
        "source": MOE_RULES_SOURCE, "expert": finding.expert, "layer": finding.layer, "ranks": holders,
        "tokens_vs_mean": round(finding.tokens_vs_mean, 3), "rank_max_over_mean": round(layer.rank_max_over_mean, 3),
        "ep": moe.ep, "plan": plan.action, "remaining_excess_share": round(plan.remaining_excess, 3)}
    if finding.holder_last_pct is not None:
        evidence["holder_last_pct"] = round(finding.holder_last_pct, 1)
    if finding.cost_ms_per_step is not None:
        evidence["combine_wait_caused_ms"] = round(finding.cost_ms_per_step, 3)
    return Finding(rule="moe_expert_placement",
                   title=f"{_ranks_text(finding.ranks)} {'holds' if len(finding.ranks) == 1 else 'hold'} hot expert "
                         f"{finding.expert} (layer {finding.layer}): {layer.rank_max_over_mean:.1f}x its ep group's "
                         "mean tokens",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct,
                   confidence="medium" if observed else "low", change=_placement_change(moe, finding, plan), apply=None,
                   why=(f"{finding.sentence}; moving load off it leaves {100 * plan.remaining_excess:.0f}% of its "
                        "excess (same waiting as moe_load_balance: fix the routing or the placement)"))


def _placement_candidates(moe: MoeReport) -> list[tuple[MoeFinding, MoeLayerReport, PlacementPlan]]:
    """The hot-expert findings whose ep rank is overloaded, with the placement that relieves it."""
    candidates = []
    for finding in moe.findings:
        layer = _layer(moe, finding.layer)
        if layer is None or not finding.ranks or (layer.rank_max_over_mean or 0.0) < RANK_OVERLOAD_RATIO:
            continue
        plan = plan_placement(layer.tokens_per_expert, moe.ep, finding.expert)
        if plan is not None:
            candidates.append((finding, layer, plan))
    return candidates


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _placement_change(moe: MoeReport, finding: MoeFinding, plan: PlacementPlan) -> str:
    target = [group[plan.to_ep_rank] for group in moe.ep_groups if plan.to_ep_rank < len(group)]
    where = _ranks_text(target) if target else f"ep rank {plan.to_ep_rank}"
    if plan.action == "swap":
        return (f"place expert {finding.expert} on {where} and expert {plan.swap_with} on {_ranks_text(finding.ranks)} "
                f"(swap them) in layer {finding.layer}, and alike in each layer where it is as hot")
    return (f"replicate expert {finding.expert} on {where} (a second copy takes half its tokens; its gradients "
            "are averaged over both)")


def _a2a_and_experts_ms(moe: MoeReport) -> tuple[float, float] | None:
    """(forward dispatch + combine transfer, expert compute), ms per step: mean over ranks, summed over
    layers. None when no layer has both."""
    a2a, experts = 0.0, 0.0
    for layer in moe.layers:
        transfer = [r.dispatch_transfer_ms + r.combine_transfer_ms for r in layer.ranks
                    if r.dispatch_transfer_ms is not None and r.combine_transfer_ms is not None]
        compute = [x for x in (_expert_ms(r) for r in layer.ranks) if x is not None]
        if transfer and compute:
            a2a += float(np.mean(transfer))
            experts += float(np.mean(compute))
    return (a2a, experts) if experts > 0 else None


def _ep_spans_nodes(e: Evidence) -> bool:
    groups = e.moe.ep_groups if e.moe else []
    return any(len({e.rank_hosts.get(r) for r in group if r in e.rank_hosts}) > 1 for group in groups)


def _ranks_per_node(e: Evidence) -> int:
    counts: dict[str, int] = {}
    for host in e.rank_hosts.values():
        counts[host] = counts.get(host, 0) + 1
    return min(counts.values()) if counts else 0


def _smaller_ep(ep: int, experts: int, fit: int) -> int:
    """The largest divisor of ep (so it still divides the data-parallel ranks) that divides the experts
    and is at most `fit` (< ep)."""
    # bounded by `fit` (never by ep, which a forged report.json may make 10**15)
    return max((d for d in range(1, min(ep, fit + 1)) if ep % d == 0 and experts % d == 0), default=1)


def moe_ep_degree(e: Evidence) -> Finding | None:
    """GPU basis, ep > 1: the MoE all-to-alls' transfer (dispatch + combine, mean over ranks, summed over
    layers; backward runs the reverse exchanges, counted as much again) at least ALL_TO_ALL_VS_EXPERTS
    times the experts' compute and ALL_TO_ALL_STEP_SHARE of the step. The change: an EP degree that fits
    one node where the ep groups span nodes, else half the degree. Gain: exchange time scales with the
    share of tokens that leave the rank ((ep - 1) / ep) over the link's bus bandwidth (bandwidth.py
    PEAK_BUSBW_GBPS: NVLink inside a node, the NIC across nodes): saved = exchange x (1 - new/old). CPU
    traces are left out: gloo's exchange time there is the processes' scheduling, not a link. Confidence
    low: fewer ranks per group also hold more experts (memory) and the grouped GEMMs grow."""
    moe = e.moe
    if moe is None or type(moe.ep) is not int or not 1 < moe.ep <= MAX_WORLD_SIZE or e.basis != "gpu" or not e.step_ms:
        return None
    if type(moe.num_experts) is not int or moe.num_experts < 1:
        return None
    times = _a2a_and_experts_ms(moe)
    if times is None:
        return None
    forward_ms, experts_ms = times
    exchange_ms = 2.0 * forward_ms
    if forward_ms < ALL_TO_ALL_VS_EXPERTS * experts_ms or exchange_ms < ALL_TO_ALL_STEP_SHARE * e.step_ms:
        return None
    spans = _ep_spans_nodes(e)
    per_node = _ranks_per_node(e)
    fit = per_node if spans and 1 <= per_node < moe.ep else moe.ep // 2
    new_ep = _smaller_ep(moe.ep, moe.num_experts, fit)
    old_cost = (moe.ep - 1) / moe.ep / PEAK_BUSBW_GBPS[INTER_NODE if spans else INTRA_NODE]
    new_cost = (new_ep - 1) / new_ep / PEAK_BUSBW_GBPS[INTRA_NODE if new_ep <= per_node or not spans else INTER_NODE]
    gain, pct = _gain(e, exchange_ms * (1.0 - new_cost / old_cost))
    where = "across nodes" if spans else "inside a node"
    return Finding(rule="moe_ep_degree", title=f"the MoE all-to-alls cost more than the experts (ep {moe.ep}, {where})",
                   evidence={"source": MOE_RULES_SOURCE, "ep": moe.ep, "num_experts": moe.num_experts,
                             "all_to_all_forward_ms": round(forward_ms, 3), "expert_compute_ms": round(experts_ms, 3),
                             "all_to_all_step_pct": round(100 * exchange_ms / e.step_ms, 1),
                             "ep_spans_nodes": str(spans), "ranks_per_node": per_node},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="low",
                   change=f"--set parallel.ep={new_ep}", apply=Change(train_args=("--set", f"parallel.ep={new_ep}")),
                   why=(f"the dispatch and combine all-to-alls move tokens for {forward_ms:.2f} ms per step in forward "
                        f"(about as much again in backward) while the experts compute for {experts_ms:.2f} ms; "
                        + (f"ep {new_ep} keeps every exchange on one node's links" if spans and new_ep <= per_node
                           else f"ep {new_ep} keeps {100 / new_ep:.0f}% of the tokens on their rank instead of "
                                f"{100 / moe.ep:.0f}%")
                        + (" (ep 1: every rank holds every expert)" if new_ep == 1 else "")))


RULES: tuple[Callable[[Evidence], Finding | None], ...] = (
    straggler, data_workers, cuda_graphs, host_work, host_syncs, gradient_buckets, allocator, memory_pressure,
    moe_load_balance, moe_expert_placement, moe_ep_degree)


USER_CODE_CHANGES = {
    "data_workers": f"DataLoader(..., num_workers={RECOMMENDED_WORKERS}, pin_memory=True, persistent_workers=True): "
                    "load the next batches in worker processes while the step runs",
    "cuda_graphs": "torch.compile(model, mode='reduce-overhead') (CUDA graphs replay the step's launches; "
                   "mode='default' where parameters move, as under FSDP)",
    "gradient_buckets": "DistributedDataParallel(model, bucket_cap_mb=...) as the finding's evidence suggests",
    "allocator": f"PYTORCH_ALLOC_CONF={EXPANDABLE} in every rank's environment",
    "memory_pressure": "activation checkpointing (torch.utils.checkpoint) in the largest blocks, or a smaller batch",
    "moe_load_balance": "a load-balancing loss on the router (or a capacity factor) so tokens spread evenly",
    "moe_ep_degree": "a smaller expert-parallel degree, or expert groups inside one node",
    "host_work": None,
    "host_syncs": None,
}
"""A rule's change in the user's own code, for any program that is not fleetscope's trainer."""
_USER_STRAGGLER_INPUT = (f"DataLoader(..., num_workers={RECOMMENDED_WORKERS}, pin_memory=True, "
                         "persistent_workers=True) on that rank: its input pipeline is the delay")


def _in_program_terms(finding: Finding, e: Evidence) -> Finding:
    """For a program other than fleetscope's trainer: the code change, nothing `tune` could apply."""
    if not e.program:
        return finding
    if finding.rule == "straggler":
        change = _USER_STRAGGLER_INPUT if "input wait" in finding.title else finding.change
    else:
        change = USER_CODE_CHANGES.get(finding.rule) or finding.change
    evidence = {k: v for k, v in finding.evidence.items() if k not in ("compile", "num_workers", "bucket_cap_mb")}
    return dataclasses.replace(finding, change=change, apply=None, evidence={**evidence, "program": e.program})


def advise_evidence(evidence: Evidence, run: str = "") -> Advice:
    findings = [_in_program_terms(_with_basis(f, evidence), evidence)
                for f in (rule(evidence) for rule in RULES) if f is not None]
    findings = _mark_overlaps(findings)
    findings.sort(key=lambda f: -(f.expected_gain_ms if f.expected_gain_ms is not None else -1.0))
    combined = _combined_gain(findings, evidence)
    return Advice(run=run, findings=findings, combined_gain_ms=combined.ms if combined else None,
                  combined_gain_of_ms=combined.of_ms if combined else None,
                  combined_gain_basis=combined.basis if combined else "")


def _with_basis(finding: Finding, e: Evidence) -> Finding:
    """The denominator of a rule's percentage, where the rule took it from the run's step time (_gain)."""
    changes: dict[str, Any] = {}
    if not finding.recovers:
        changes["recovers"] = RECOVERS.get(finding.rule, finding.rule)
    if finding.expected_gain_pct is not None and finding.gain_of_ms is None:
        changes.update(gain_of_ms=e.step_ms, gain_basis=e.step_basis)
    return dataclasses.replace(finding, **changes) if changes else finding


def _mark_overlaps(findings: list[Finding]) -> list[Finding]:
    """Findings that recover the same time name each other: their gains are not additive."""
    by_time: dict[str, list[str]] = {}
    for f in findings:
        by_time.setdefault(f.recovers, []).append(f.rule)
    return [dataclasses.replace(f, overlaps=[r for r in by_time[f.recovers] if r != f.rule]) for f in findings]


def _combined_gain(findings: list[Finding], e: Evidence):
    """Per recovered time the largest gain (as a share of its own step), summed, against the run's step time;
    never more than the step."""
    best: dict[str, float] = {}
    for f in findings:
        if f.expected_gain_pct is not None:
            best[f.recovers] = max(best.get(f.recovers, 0.0), f.expected_gain_pct)
    if not best or not e.step_ms:
        return None
    return bounded_gain(e.step_ms * sum(best.values()) / 100.0, e.step_ms, e.step_basis)


def advise(path: str | Path) -> Advice:
    """The advice for a run directory (its report.json, else an analysis of its traces), a directory of traces
    or one trace file (what `analyze` accepts: every trace-based rule applies; step metrics and settings
    only where a run directory has them)."""
    source = Path(path)
    layout = RunLayout.at(source if source.is_dir() else source.parent)
    if not source.exists():
        raise FileNotFoundError(f"{path}: no such run directory, trace directory or trace file")
    notes = []
    report = None
    if source.is_dir() and layout.report_json.is_file():
        report = load_report_json(layout.report_json, within=layout.root)
    else:
        try:
            report = analyze(source, write_default_outputs=False, use_hta=False)
        except (FileNotFoundError, ValueError) as error:
            notes.append(f"no traces analyzed ({error}): advice from step metrics and configuration only")
    evidence = gather_evidence(layout, report)
    if evidence.step_ms is None:
        notes.append("no step time (no steady step metrics, no profiled steps in the traces): gains are not "
                     "estimated as a share of the step")
    elif evidence.step_basis.startswith("trace"):
        notes.append(f"no steady step metrics: step time from the traces ({evidence.step_basis})")
    advice = dataclasses.replace(advise_evidence(evidence, str(path)), notes=notes)
    if auditing():
        audit("advice", path, check_advice(advice, report))
    return advice


TOP_FINDINGS = 3


def top_findings(root: Path, report: Report) -> list[TopFinding]:
    """The advice the report shows next to its verdict: the same findings `advise` gives, largest gain first."""
    advice = advise_evidence(gather_evidence(RunLayout.at(root), report), str(root))
    return [TopFinding(rule=f.rule, title=f.title, gain=gain_text(f), change=f.change, confidence=f.confidence,
                       ranks=list(f.ranks), windows=list(f.windows), overlaps=list(f.overlaps))
            for f in advice.findings[:TOP_FINDINGS]]


def gather_evidence(layout: RunLayout, report: Report | None) -> Evidence:
    steady = steady_metrics(layout)

    def per_step_max(key: str) -> float | None:   # the step-metrics rule of quantities.py, for every field
        return metrics_step_time_ms(steady, key)

    def total(key: str) -> int:
        return int(sum(r.get(key) or 0 for lines in steady.values() for r in lines if isinstance(r.get(key), int)))

    record = read_job_record(layout)
    spec = record.get("spec")
    program = _program_of(record)
    train = spec.get("train") if isinstance(spec, dict) and not program else None
    utilization = [r.utilization for w in (report.windows if report else []) for r in w.ranks if r.utilization]

    def mean_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(np.mean(known)) if known else None

    trace_data_ms = _trace_data_loader_ms(report)
    windows = report.windows if report else []
    return Evidence(
        **_step_time(steady, report),
        data_ms=trace_data_ms if trace_data_ms is not None else per_step_max("data_ms"),
        data_source="trace DataLoader ranges" if trace_data_ms is not None else "step metrics data_ms",
        comm_exposed_ms=per_step_max("comm_exposed_ms"), comm_buckets=per_step_max("comm_buckets"),
        comm_mb=per_step_max("comm_mb"), comm_last_bucket_mb=per_step_max("comm_last_bucket_mb"),
        trace_collectives_per_step=_trace_collectives_per_step(report), trace_allreduce_mb=_trace_allreduce_mb(report),
        peak_allocated_mb=per_step_max("max_memory_allocated_mb"),
        peak_reserved_mb=per_step_max("max_memory_reserved_mb"), alloc_retries=total("alloc_retries"),
        ooms=total("ooms"), basis=utilization[0].basis if utilization else None,
        idle_pct=mean_of([u.idle_pct for u in utilization]),
        exposed_comm_pct=mean_of([100 * u.exposed_comm_us / u.span_us for u in utilization if u.span_us > 0]),
        overlap_pct=mean_of([u.overlap_pct for u in utilization]),
        **_host_evidence(report),
        stragglers=[f for w in windows for f in w.causes.findings],
        straggler_windows=[w.window for w in windows for _ in w.causes.findings],
        job_straggler=job_straggler(windows),
        config=train if isinstance(train, dict) else {}, program=program,
        moe=report.moe if report else None, rank_hosts={r.rank: r.host for r in (report.ranks if report else [])})


def _step_time(steady: dict, report: Report | None) -> dict[str, Any]:
    """The run's step time from step metrics; without them (a folder of traces, a program that records none)
    the trace's (quantities.py), named as such."""
    step_ms = metrics_step_time_ms(steady)
    if step_ms is None and report is not None and report.step_time is not None:
        return {"step_ms": report.step_time.median_ms, "step_basis": report.step_time_basis}
    return {"step_ms": step_ms, "step_basis": metrics_basis(steady)}


def _host_evidence(report: Report | None) -> dict[str, Any]:
    """Launch, sync and idle-by-cause figures per profiled step, mean over every rank's steps (GPU traces)."""
    stalls = [r.host_stalls for w in (report.windows if report else []) for r in w.ranks
              if r.host_stalls is not None and r.host_stalls.steps and r.utilization is not None
              and r.utilization.basis == "gpu"]
    if not stalls:
        return {}
    steps = [s for h in stalls for s in h.steps]

    def per_step(key: str) -> float:
        return float(np.mean([getattr(s, key) for s in steps]))

    causes: dict[str, float] = {}
    for h in stalls:
        for cause, us in h.idle_by_cause_us.items():
            causes[cause] = causes.get(cause, 0.0) + us / 1000.0 / len(h.steps) / len(stalls)
    return {"launch_ms": per_step("launch_us") / 1000.0, "launches": per_step("launch_count"),
            "syncs": per_step("sync_count"), "tensor_reads": per_step("tensor_reads"), "idle_cause_ms": causes}


def _program_of(record: dict) -> str:
    """"" when job.json says fleetscope's trainer ran; else the user's program, or "unknown program"."""
    spec = record.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("train"), dict):
        return "unknown program (no fleetscope run record)"
    entry = spec.get("entry")
    return program_text(entry) if isinstance(entry, dict) else ""


def _trace_data_loader_ms(report: Report | None) -> float | None:
    """Median over profiled steps of the slowest rank's DataLoader fetch time; None: the trace has none."""
    by_step: dict[tuple[int | None, int], float] = {}
    for window in report.windows if report else []:
        for rank in window.ranks:
            for step in rank.steps:
                if step.data_loader_ms is not None:
                    key = (window.window, step.step)
                    by_step[key] = max(by_step.get(key, 0.0), step.data_loader_ms)
    return float(np.median(list(by_step.values()))) if by_step else None


def _trace_collectives_per_step(report: Report | None) -> float | None:
    """Median over profiled steps of the collectives matched across ranks in the step (stragglers.by_step)."""
    counts = [s.collectives for w in (report.windows if report else []) if w.stragglers for s in w.stragglers.by_step]
    return float(np.median(counts)) if counts else None


def _trace_allreduce_mb(report: Report | None) -> float | None:
    """Mean MiB per all-reduce over the trace's sized all-reduces (bandwidth rows); None: no sizes."""
    rows = [r for w in (report.windows if report else []) if w.bandwidth for r in w.bandwidth.rows
            if r.collective == "all_reduce" and r.instances]
    instances = sum(r.instances for r in rows)
    return sum(r.total_bytes for r in rows) / instances / 2**20 if instances else None
