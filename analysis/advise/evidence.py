"""A run's evidence: its steady step metrics, its trace report and its configuration, read into one Evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from fleetscope.analysis.compare import steady_metrics
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.analysis.cross_rank.whole_run import run_straggler
from fleetscope.analysis.job_identity import program_text
from fleetscope.analysis.quantities import job_straggler, metrics_basis, metrics_step_time_ms
from fleetscope.analysis.report.model import Report
from fleetscope.traces.formats import StepRecord

from .model import TRACE_DATA_SOURCE, Evidence


def gather_evidence(records: RunRecords, report: Report | None) -> Evidence:
    """`records`: the run directory's records as read once (inputs/records.py)."""
    steady = steady_metrics(records)

    def per_step_max(key: str) -> float | None:   # the step-metrics rule of quantities.py, for every field
        return metrics_step_time_ms(steady, key)

    def total(key: str) -> int:
        return int(sum(getattr(r, key) or 0 for lines in steady.values() for r in lines))

    record = records.job   # job.json as read once (empty where the records hold none: a folder of traces)
    spec = record.get("spec")
    program = _program_of(record)
    train = spec.get("train") if isinstance(spec, dict) and not program else None
    utilization = [r.utilization for w in (report.windows if report else []) for r in w.ranks if r.utilization]

    def mean_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(np.mean(known)) if known else None

    trace_data_ms, loader_events, host_events = _trace_data_loader(report)
    windows = report.windows if report else []
    return Evidence(
        **_step_time(steady, report),
        data_ms=trace_data_ms if trace_data_ms is not None else per_step_max("data_ms"),
        data_source=TRACE_DATA_SOURCE if trace_data_ms is not None else "step metrics data_ms",
        data_loader_events=loader_events,
        host_events=host_events if host_events is not None else _trace_host_events(report),
        comm_exposed_ms=per_step_max("comm_exposed_ms"), comm_buckets=per_step_max("comm_buckets"),
        comm_mb=per_step_max("comm_mb"), comm_last_bucket_mb=per_step_max("comm_last_bucket_mb"),
        trace_collectives_per_step=_trace_collectives_per_step(report), trace_allreduce_mb=_trace_allreduce_mb(report),
        peak_allocated_mb=per_step_max("max_memory_allocated_mb"),
        peak_reserved_mb=per_step_max("max_memory_reserved_mb"), alloc_retries=total("alloc_retries"),
        ooms=total("ooms"), basis=utilization[0].basis if utilization else None,
        idle_pct=mean_of([u.idle_pct for u in utilization]),
        exposed_comm_pct=mean_of([100 * u.exposed_comm_us / u.span_us for u in utilization if u.span_us > 0]),
        overlap_pct=mean_of([u.overlap_pct for u in utilization]),
        **_host_evidence(report), **_step_work_evidence(report),
        stragglers=[f for w in windows for f in w.causes.findings],
        straggler_windows=[w.window for w in windows for _ in w.causes.findings],
        job_straggler=job_straggler(windows), whole_run_straggler=_whole_run_straggler(report),
        config=train if isinstance(train, dict) else {}, program=program,
        moe=report.moe if report else None, rank_hosts={r.rank: r.host for r in (report.ranks if report else [])},
        cpus_per_rank=_cpus_per_rank(record))


def _whole_run_straggler(report: Report | None):
    """The whole run's episode the straggler advice rests on (Evidence.whole_run_straggler)."""
    return run_straggler(report.whole_run if report is not None else None)


def _cpus_per_rank(record: dict) -> int | None:
    """Slurm's cpus_per_task where the spec asks for it; for a local run, the launching machine's CPUs
    (job.json environment.cpus: the machine the ranks run on) over its ranks; None otherwise."""
    spec = record.get("spec") if isinstance(record.get("spec"), dict) else {}
    slurm = spec.get("slurm") if isinstance(spec.get("slurm"), dict) else {}
    asked = slurm.get("cpus_per_task")
    if spec.get("scheduler") != "local" and _positive_int(asked):
        return asked
    environment = record.get("environment") if isinstance(record.get("environment"), dict) else {}
    cpus, ranks = environment.get("cpus"), spec.get("nproc_per_node")
    if spec.get("scheduler") == "local" and _positive_int(cpus) and _positive_int(ranks):
        return max(1, cpus // ranks)
    return None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _step_time(steady: dict[int, list[StepRecord]], report: Report | None) -> dict[str, Any]:
    """The run's step time from step metrics; without them (a folder of traces, a program that records none)
    the trace's (quantities.py), named as such."""
    step_ms = metrics_step_time_ms(steady)
    profiled = report.step_time.median_ms if report is not None and report.step_time is not None else None
    if step_ms is None and profiled is not None:
        return {"step_ms": profiled, "step_basis": report.step_time_basis, "profiled_step_ms": profiled}
    return {"step_ms": step_ms, "step_basis": metrics_basis(steady), "profiled_step_ms": profiled}


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
            "syncs": per_step("sync_count"), "tensor_reads": per_step("tensor_reads"),
            "pageable_copies": per_step("pageable_copy_count"), "pageable_copy_ms": per_step("pageable_copy_us") / 1000.0,
            "pageable_copy_mb": per_step("pageable_copy_bytes") / 1e6,
            "pageable_copy_gpu_ms": per_step("pageable_copy_gpu_us") / 1000.0,
            "pageable_copy_queued_ms": per_step("pageable_copy_queued_us") / 1000.0,
            "pageable_copy_refill_ms": per_step("pageable_copy_refill_us") / 1000.0,
            "sync_dispatch_ms": per_step("sync_dispatch_us") / 1000.0,
            "stall_frames": _stall_frames(stalls), "idle_cause_ms": causes,
            "launch_paced_idle_ms": float(np.mean([h.launch_paced_idle_us / len(h.steps) for h in stalls])) / 1000.0,
            "dispatch_ops": float(np.mean([h.dispatch_ops / len(h.steps) for h in stalls])),
            "launch_idle_ms": float(np.mean([h.launch_idle_us / len(h.steps) for h in stalls])) / 1000.0,
            # the GPU's idle inside each op's long calls (host_stalls.py op_held_idle_us)
            "op_held_idle_ms": _per_op_ms(stalls, lambda h: h.op_held_idle_us.items()),
            "launch_call_us": _median_launch_call_us(stalls),
            # each syncing op's host time (host_stalls.py sync_ops)
            "sync_op_ms": _per_op_ms(stalls, lambda h: ((op.op, op.us) for op in h.sync_ops))}


def _median_launch_call_us(stalls: list) -> float | None:
    """The ranks' median launch calls as recorded, their median; None where no rank launches."""
    recorded = [h.launch_call_us for h in stalls if h.launch_call_us is not None]
    return float(np.median(recorded)) if recorded else None


def _per_op_ms(stalls: list, us_by_op: Callable[[Any], Iterable[tuple[str, float]]]) -> dict[str, float]:
    """Per op, its microseconds over a rank's profiled steps (us_by_op of its stalls) as milliseconds per step,
    mean over ranks, largest first."""
    totals: dict[str, float] = {}
    for h in stalls:
        for op, us in us_by_op(h):
            totals[op] = totals.get(op, 0.0) + us / 1000.0 / len(h.steps) / len(stalls)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _step_work_evidence(report: Report | None) -> dict[str, Any]:
    """GEMM precision, optimizer and allocator figures per profiled step, mean over every rank (GPU traces)."""
    works = [r.step_work for w in (report.windows if report else []) for r in w.ranks if r.step_work is not None]
    if not works:
        return {}

    def mean(key: str, scale: float = 1000.0) -> float:
        return float(np.mean([getattr(w, key) for w in works])) / scale

    precision: dict[str, float] = {}
    for work in works:
        for kind, us in work.gemm_us_by_precision.items():
            precision[kind] = precision.get(kind, 0.0) + us / 1000.0 / len(works)
    with_optimizer = [w for w in works if w.optimizer_impl]
    optimizer = {}
    if with_optimizer:
        optimizer = {"optimizer": with_optimizer[0].optimizer, "optimizer_impl": with_optimizer[0].optimizer_impl,
                     "optimizer_host_ms": float(np.mean([w.optimizer_host_us for w in with_optimizer])) / 1000.0,
                     "optimizer_launches": float(np.mean([w.optimizer_launches for w in with_optimizer])),
                     "optimizer_gpu_ms": float(np.mean([w.optimizer_gpu_us for w in with_optimizer])) / 1000.0,
                     "optimizer_foreach_calls": float(np.mean([w.optimizer_foreach_calls for w in with_optimizer]))}
    return {"gemm_ms_by_precision": precision, "conv_fp32_ms": mean("conv_fp32_us"), **optimizer, "allocator_calls": mean("allocator_calls", 1.0),
            "allocator_ms": mean("allocator_us"), "allocator_idle_ms": mean("allocator_idle_us"), "compile_ms": mean("compile_us"),
            "compile_ids": max(w.compile_ids for w in works), "host_copies": mean("host_copies", 1.0),
            "host_copy_ms": mean("host_copy_us"), "graph_launches": mean("graph_launches", 1.0),
            "softmax_ms": mean("softmax_us"), "fused_attention_ms": mean("fused_attention_us"),
            "recompute_ms": mean("recompute_us"), "recompute_idle_ms": mean("recompute_idle_us"), "gc_ms": mean("gc_us"), "gc_count": mean("gc_count", 1.0),
            "python_frames": any(w.python_frames for w in works), **_host_link_evidence(works),
            "fp32_saving_ms": _mean_known([w.fp32_saving_us for w in works]),
            "score_pass_ms": mean("score_pass_us"), "score_saving_ms": _mean_known([w.score_saving_us for w in works]),
            "score_gemm_ms": mean("score_gemm_us"), "score_gemm_excess_ms": mean("score_gemm_excess_us"),
            "value_use_saving_ms": _mean_known([w.value_use_saving_us for w in works]),
            "score_shapes": next((w.score_shapes for w in works if w.score_shapes), []),
            "routed_gemm_weights": next((w.routed_gemm_weights for w in works if w.routed_gemm_weights), []),
            "routed_gemm_launches": mean("routed_gemm_launches", 1.0),
            "routed_loop_saving_ms": _mean_known([w.routed_loop_saving_us for w in works])}


def _mean_known(values_us: list) -> float | None:
    known = [v for v in values_us if v is not None]
    return float(np.mean(known)) / 1000.0 if known else None


def _host_link_evidence(works: list) -> dict[str, Any]:
    measured = [w.pinned_copy_gbps for w in works if w.pinned_copy_gbps > 0]
    listed = next((w for w in works if w.host_link), None)
    return {"pinned_copy_gbps": float(np.mean(measured)) if measured else 0.0,
            "host_link": listed.host_link if listed else "", "host_link_gbps": listed.host_link_gbps if listed else 0.0}


def _stall_frames(stalls: list) -> dict[str, list[str]]:
    """Per kind of stall, the program's frames that hold it, costliest (host time over all ranks) first."""
    cost: dict[str, dict[str, float]] = {}
    for h in stalls:
        for frame in h.frames:
            by_frame = cost.setdefault(frame.what, {})
            by_frame[frame.frame] = by_frame.get(frame.frame, 0.0) + frame.us
    return {what: sorted(frames, key=lambda f: -frames[f]) for what, frames in cost.items()}


def _program_of(record: dict) -> str:
    """"" when job.json says fleetscope's trainer ran; else the user's program, or "unknown program"."""
    spec = record.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("train"), dict):
        return "unknown program (no fleetscope run record)"
    entry = spec.get("entry")
    return program_text(entry) if isinstance(entry, dict) else ""


def _trace_data_loader(report: Report | None) -> tuple[float | None, float | None, float | None]:
    """Median over profiled steps of the slowest rank's DataLoader fetch time, and of the host events the profiler
    recorded inside those fetches and in that rank's step (None where not counted); (None, None, None): the trace
    has no DataLoader ranges."""
    by_step: dict[tuple[int | None, int], tuple[float, int | None, int | None]] = {}
    for window in report.windows if report else []:
        for rank in window.ranks:
            for step in rank.steps:
                key = (window.window, step.step)
                if step.data_loader_ms is not None and step.data_loader_ms >= by_step.get(key, (-1.0,))[0]:
                    by_step[key] = (step.data_loader_ms, step.data_loader_events, step.host_events)
    if not by_step:
        return None, None, None

    def median(values: list) -> float | None:
        return float(np.median(values)) if values and all(v is not None for v in values) else None

    chosen = list(by_step.values())
    return median([c[0] for c in chosen]), median([c[1] for c in chosen]), median([c[2] for c in chosen])


def _trace_host_events(report: Report | None) -> float | None:
    """Median over profiled steps of the host events the profiler recorded in the slowest rank's step
    (StepTiming.host_events); None where not counted. A trace with DataLoader ranges takes its loader's rank's
    (_trace_data_loader), whose events its fetches' share is of."""
    by_step: dict[tuple[int | None, int], tuple[float, int | None]] = {}
    for window in report.windows if report else []:
        for rank in window.ranks:
            for step in rank.steps:
                key = (window.window, step.step)
                if step.step_time_ms >= by_step.get(key, (-1.0,))[0]:
                    by_step[key] = (step.step_time_ms, step.host_events)
    counts = [events for _, events in by_step.values()]
    return float(np.median(counts)) if counts and all(c is not None for c in counts) else None


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
