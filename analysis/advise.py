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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from fleetscope.analysis.analyze import analyze, load_report_json
from fleetscope.analysis.compare import steady_metrics
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, CAUSE_SLOW_DEVICE, CAUSE_WORK
from fleetscope.analysis.report.model import Report
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
FRAGMENTATION_RATIO = 1.3
"""Reserved / allocated peak memory above this: the caching allocator holds fragmented blocks."""
STRAGGLER_SHARE = 0.5
INPUT_WAIT_SHARE = 0.5
"""A host-side straggler whose extra DataLoader time is at least this share of its mean lateness waits for input."""


@dataclass(frozen=True, kw_only=True)
class Evidence:
    step_ms: float | None = None
    data_ms: float | None = None
    """The trace's DataLoader fetch time per step where the trace has it (slowest rank, median over
    steps), else the step metrics' data_ms: the metric's span also holds whatever else runs before the
    forward on the host (an injected straggler sleep does), the trace's range only the fetch."""
    data_source: str = ""
    comm_exposed_ms: float | None = None
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
    stragglers: list[Any] = field(default_factory=list)
    """The report's straggler cause findings (causes.py), all windows."""
    config: dict[str, Any] = field(default_factory=dict)
    """job.json spec.train: the trainer configuration of the run."""

    def setting(self, section: str, name: str, default: Any = None) -> Any:
        return (self.config.get(section) or {}).get(name, default)


@dataclass(frozen=True, kw_only=True)
class Change:
    """A change a relaunch of the same job can make (`fleetscope tune --apply`): trainer arguments and
    environment variables, applied over the run's own configuration."""

    train_args: tuple[str, ...] = ()
    """Trainer arguments, e.g. ("--set", "parallel.bucket_cap_mb=12.5") or ("--compile", "reduce-overhead")."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables of every rank, e.g. (("PYTORCH_ALLOC_CONF", "expandable_segments:True"),)."""


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


@dataclass(frozen=True, kw_only=True)
class Advice:
    run: str
    findings: list[Finding] = field(default_factory=list)
    """Largest expected gain first (findings without an estimate last)."""
    notes: list[str] = field(default_factory=list)


def _gain(evidence: Evidence, gain_ms: float | None) -> tuple[float | None, float | None]:
    if gain_ms is None or not evidence.step_ms:
        return gain_ms, None
    return gain_ms, 100.0 * gain_ms / evidence.step_ms


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
                   change=f"--set data.num_workers={RECOMMENDED_WORKERS} --set data.persistent_workers=true",
                   why=f"{e.data_ms:.1f} ms of each {e.step_ms:.1f} ms step is spent loading data in the training "
                       "process; worker processes load the next batches while the GPU computes")


def cuda_graphs(e: Evidence) -> Finding | None:
    """GPU idle over IDLE_SHARE of the span (GPU basis) without compilation: the host cannot launch kernels
    fast enough. CUDA graphs (`reduce-overhead`; plain `default` under FSDP, whose parameters move) replay
    the step's launches; assumed to recover LAUNCH_RECOVERABLE of the idle time."""
    compiled = e.setting("performance", "compile", "none")
    if e.basis != "gpu" or e.idle_pct is None or e.idle_pct < 100 * IDLE_SHARE or compiled != "none":
        return None
    mode = "default" if str(e.setting("parallel", "mode", "")).startswith("fsdp") else "reduce-overhead"
    idle_ms = e.idle_pct / 100 * e.step_ms if e.step_ms else None
    gain, pct = _gain(e, LAUNCH_RECOVERABLE * idle_ms if idle_ms is not None else None)
    return Finding(rule="cuda_graphs", title="the GPU waits for the host to launch kernels",
                   evidence={"gpu_idle_pct": round(e.idle_pct, 1), "compile": compiled},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   change=f"--compile {mode}",
                   why=f"the GPU is idle {e.idle_pct:.0f}% of the profiled steps; compiling fuses kernels and "
                       + ("CUDA graphs replay the launches without the host" if mode == "reduce-overhead" else
                          "cuts launches (CUDA graphs need fixed parameter addresses, which FSDP does not keep)"))


def gradient_buckets(e: Evidence) -> Finding | None:
    """DDP with exposed communication over EXPOSED_COMM_SHARE of the span and little overlap (< 50%), and no
    straggler causing most of the waiting (then the exposed time is waiting for it): smaller buckets start
    the first all-reduce earlier in backward; assumed to hide OVERLAP_RECOVERABLE of it."""
    if e.setting("parallel", "mode") != "ddp" or e.exposed_comm_pct is None:
        return None
    if any(f.wait_share >= STRAGGLER_SHARE for f in e.stragglers):
        return None             # the exposed time is then mostly waiting for that rank: buckets do not help
    if e.exposed_comm_pct < 100 * EXPOSED_COMM_SHARE or (e.overlap_pct or 0.0) >= 50.0:
        return None
    bucket = float(e.setting("parallel", "bucket_cap_mb", 25.0))
    exposed_ms = e.comm_exposed_ms if e.comm_exposed_ms is not None else (
        e.exposed_comm_pct / 100 * e.step_ms if e.step_ms else None)
    gain, pct = _gain(e, OVERLAP_RECOVERABLE * exposed_ms if exposed_ms is not None else None)
    return Finding(rule="gradient_buckets", title="gradient all-reduces are not hidden behind backward",
                   evidence={"exposed_comm_pct": round(e.exposed_comm_pct, 1),
                             "overlap_pct": round(e.overlap_pct or 0.0, 1), "bucket_cap_mb": bucket},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="low",
                   change=f"--set parallel.bucket_cap_mb={max(bucket / 2, 1):g}",
                   why=f"{e.exposed_comm_pct:.0f}% of the step is communication nothing overlaps "
                       f"({e.overlap_pct or 0:.0f}% overlap); smaller buckets are ready, and sent, earlier in backward")


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
    return Finding(rule="allocator", title="the CUDA caching allocator fragments", evidence=evidence,
                   expected_gain_ms=None, expected_gain_pct=None, confidence="high" if e.alloc_retries else "medium",
                   change="PYTORCH_ALLOC_CONF=expandable_segments:True (or --set performance.alloc_conf=expandable_segments:True)",
                   why="reserved memory well above what tensors use, or allocation retries (each one frees the cache "
                       "and synchronizes); expandable segments grow one mapping instead of caching odd-sized blocks")


def memory_pressure(e: Evidence) -> Finding | None:
    """Out-of-memory errors or allocator retries without activation checkpointing: trade recompute for memory."""
    if e.setting("performance", "activation_checkpointing", "none") != "none" or not (e.ooms or e.alloc_retries):
        return None
    return Finding(rule="memory_pressure", title="the step runs out of memory headroom",
                   evidence={"ooms": e.ooms, "alloc_retries": e.alloc_retries},
                   expected_gain_ms=None, expected_gain_pct=None, confidence="medium",
                   change="--set performance.activation_checkpointing=selective",
                   why="activations are recomputed in backward instead of kept: less peak memory (room for the "
                       "allocator, or a larger batch) for about a third more compute in the checkpointed blocks")


_STRAGGLER_CHANGES = {
    CAUSE_SLOW_DEVICE: "take the rank's GPU or node out of the pool (e.g. sbatch --exclude=HOST) and check its "
                       "clocks, power and thermals (nvidia-smi -q -d PERFORMANCE)",
    CAUSE_WORK: "balance the work: for MoE, raise the router's load-balancing loss or the expert capacity so "
                "tokens spread evenly",
    CAUSE_HOST: "find the host-side delay on that rank (its CPU threads in the merged trace: data loading, "
                "syncs, other processes on its CPUs); pin its CPUs or give it more data workers",
}


def straggler(e: Evidence) -> Finding | None:
    """The rank causing most of the waiting (>= STRAGGLER_SHARE) for a cause with a remedy; gain: the mean
    what-if saving over its steps (causes.py). A host-side delay that is its DataLoader (INPUT_WAIT_SHARE)
    gets data workers as the change."""
    top = max((f for f in e.stragglers if f.wait_share >= STRAGGLER_SHARE and f.cause in _STRAGGLER_CHANGES),
              key=lambda f: f.wait_share, default=None)
    if top is None:
        return None
    saved = [w.step_time_ms - w.projected_step_ms for w in top.what_if]
    gain, pct = _gain(e, float(np.mean(saved)) if saved else None)
    evidence = {"rank": top.rank, "wait_share": round(top.wait_share, 3),
                "mean_lateness_ms": round(top.mean_lateness_us / 1000, 3)}
    change, kind = _STRAGGLER_CHANGES[top.cause], top.cause
    if top.cause == CAUSE_HOST and (top.data_loader_excess_ms or 0.0) >= INPUT_WAIT_SHARE * top.mean_lateness_us / 1000:
        evidence["data_loader_excess_ms"] = round(top.data_loader_excess_ms, 3)
        change, kind = f"--set data.num_workers={RECOMMENDED_WORKERS} (its input pipeline is the delay)", "input wait"
    return Finding(rule="straggler", title=f"rank {top.rank} holds the others back ({kind})", evidence=evidence,
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="high" if top.explained_share >= 0.8 else "medium",
                   change=change, why=top.explanation)


RULES: tuple[Callable[[Evidence], Finding | None], ...] = (
    straggler, data_workers, cuda_graphs, gradient_buckets, allocator, memory_pressure)


def advise_evidence(evidence: Evidence, run: str = "") -> Advice:
    findings = [f for f in (rule(evidence) for rule in RULES) if f is not None]
    findings.sort(key=lambda f: -(f.expected_gain_ms if f.expected_gain_ms is not None else -1.0))
    return Advice(run=run, findings=findings)


def advise(run_dir: str | Path) -> Advice:
    """The advice for one run directory (its report.json, else an analysis of its traces)."""
    layout = RunLayout.at(run_dir)
    if not layout.root.is_dir():
        raise FileNotFoundError(f"{run_dir}: not a run directory")
    notes = []
    report = None
    if layout.report_json.is_file():
        report = load_report_json(layout.report_json)
    elif layout.traces_dir.is_dir():
        report = analyze(layout.root, write_default_outputs=False, use_hta=False)
    else:
        notes.append("no traces: advice from step metrics and configuration only")
    evidence = gather_evidence(layout, report)
    if evidence.step_ms is None:
        notes.append("no steady step metrics: no time estimates")
    advice = advise_evidence(evidence, str(run_dir))
    return Advice(run=advice.run, findings=advice.findings, notes=notes)


def gather_evidence(layout: RunLayout, report: Report | None) -> Evidence:
    by_step: dict[int, list[dict]] = {}
    for lines in steady_metrics(layout).values():
        for line in lines:
            by_step.setdefault(int(line["step"]), []).append(line)

    def per_step_max(key: str) -> float | None:
        values = [max(v) for v in ([r[key] for r in rows if isinstance(r.get(key), (int, float))]
                                   for rows in by_step.values()) if v]
        return float(np.median(values)) if values else None

    def total(key: str) -> int:
        return int(sum(r.get(key) or 0 for rows in by_step.values() for r in rows if isinstance(r.get(key), int)))

    spec = read_job_record(layout).get("spec") or {}
    utilization = [r.utilization for w in (report.windows if report else []) for r in w.ranks if r.utilization]

    def mean_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(np.mean(known)) if known else None

    trace_data_ms = _trace_data_loader_ms(report)
    return Evidence(
        step_ms=per_step_max("step_time_ms"),
        data_ms=trace_data_ms if trace_data_ms is not None else per_step_max("data_ms"),
        data_source="trace DataLoader ranges" if trace_data_ms is not None else "step metrics data_ms",
        comm_exposed_ms=per_step_max("comm_exposed_ms"), peak_allocated_mb=per_step_max("max_memory_allocated_mb"),
        peak_reserved_mb=per_step_max("max_memory_reserved_mb"), alloc_retries=total("alloc_retries"),
        ooms=total("ooms"), basis=utilization[0].basis if utilization else None,
        idle_pct=mean_of([u.idle_pct for u in utilization]),
        exposed_comm_pct=mean_of([100 * u.exposed_comm_us / u.span_us for u in utilization if u.span_us > 0]),
        overlap_pct=mean_of([u.overlap_pct for u in utilization]),
        stragglers=[f for w in (report.windows if report else []) for f in w.causes.findings],
        config=spec.get("train") or {})


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
