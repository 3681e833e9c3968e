"""Memory, input wait and compilation of each rank, from the records the trainer writes next to the traces.

Record formats: `metrics/rank<R>.jsonl` (one step per line, trainer.metrics.StepMetrics, read by
traces.formats.read_metric_records) and `metrics/rank<R>.compile.json` (trainer/compile_record.py's
CompileRecord; read here by its field names, as the analysis does not import the trainer).

Memory, per rank over its recorded steps (MiB, the allocator's per-step peaks):
  - peak_allocated_mb / peak_reserved_mb: the largest per-step peaks;
  - fragmentation_mb: reserved - allocated in the step with the largest reserved peak (memory the caching
    allocator holds but no tensor uses), fragmentation_pct: of that reserved peak;
  - alloc_retries / ooms: summed over steps;
  - growth_mb_per_step: least-squares slope of the per-step allocated peak against the step number,
    over the steps after the first LEAK_SKIP_STEPS (which allocate optimizer state and caches);
    leak_suspected when it is at least LEAK_MIN_MB_PER_STEP over at least LEAK_MIN_STEPS steps.
Input wait: the trainer's `data_ms` (time to get the batch) per step, and its share of step_time_ms: the
mean and the share over steady steps only, without the profiled steps (the profiler's own cost is in their
step time) and the rank's first step (compilation, warm-up): traces/formats.py is_steady; `basis`
says so. recorded_steps / data_ms
keep every step.
Profiling cost: the steady steps before the first window, inside the windows and after the last, compared
(per_rank/profiling_cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fleetscope.analysis.per_rank.profiling_cost import ProfilingCost, profiling_cost
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.traces.formats import MetricRecords, StepRecord, steady

LEAK_SKIP_STEPS = 2
LEAK_MIN_STEPS = 4
LEAK_MIN_MB_PER_STEP = 1.0


@dataclass(frozen=True, kw_only=True)
class MemoryEvidence:
    steps: list[int]
    allocated_mb: list[float | None]
    """Per-step peak allocated, MiB, in `steps` order (None: not recorded, CPU)."""
    reserved_mb: list[float | None]
    peak_allocated_mb: float | None
    peak_reserved_mb: float | None
    fragmentation_mb: float | None
    fragmentation_pct: float | None
    alloc_retries: int
    ooms: int
    growth_mb_per_step: float | None
    """None with fewer than LEAK_MIN_STEPS steps past the first LEAK_SKIP_STEPS."""
    leak_suspected: bool


@dataclass(frozen=True, kw_only=True)
class InputEvidence:
    steps: int
    mean_data_ms: float
    max_data_ms: float
    data_pct: float
    """Sum of data_ms over the sum of step_time_ms, percent (steady steps: see basis)."""
    basis: str = ""
    """Which steps mean_data_ms / max_data_ms / data_pct cover."""
    recorded_steps: list[int] = field(default_factory=list)
    data_ms: list[float] = field(default_factory=list)
    """data_ms of each of recorded_steps (the steps whose record has both data_ms and step_time_ms)."""


@dataclass(frozen=True, kw_only=True)
class CompileEvidence:
    mode: str
    backend: str
    final: bool
    compile_time_s: float
    frames_compiled: int
    graphs: int
    graph_break_count: int
    graph_breaks: list[dict[str, Any]] = field(default_factory=list)
    """{reason, count} as the trainer recorded them."""
    recompiles: list[dict[str, Any]] = field(default_factory=list)
    """{compile_id, function, reason}."""
    cuda_graphs: bool = False
    cudagraph_skip_reasons: list[str] = field(default_factory=list)
    steps_with_compilations: list[int] = field(default_factory=list)
    compiled_in_timed_steps: list[int] = field(default_factory=list)
    """Steps that compiled and were profiled or traced: their times include compilation."""


@dataclass(frozen=True, kw_only=True)
class RankRecords:
    rank: int
    memory: MemoryEvidence | None = None
    input: InputEvidence | None = None
    compile: CompileEvidence | None = None
    profiling: ProfilingCost | None = None
    """What the profile windows cost this rank (None: no profiled step)."""
    problems: list[str] = field(default_factory=list)
    """Unreadable files or lines."""


def memory_evidence(records: list[StepRecord]) -> MemoryEvidence | None:
    """None when no record carries allocator statistics."""
    records = sorted(records, key=lambda r: r.step)
    allocated = [r.max_memory_allocated_mb for r in records]
    reserved = [r.max_memory_reserved_mb for r in records]
    if all(a is None for a in allocated):
        return None
    steps = [r.step for r in records]
    peak_reserved, fragmentation = _fragmentation(allocated, reserved)
    slope = growth_slope(steps, allocated)
    return MemoryEvidence(
        steps=steps, allocated_mb=allocated, reserved_mb=reserved,
        peak_allocated_mb=max(a for a in allocated if a is not None), peak_reserved_mb=peak_reserved,
        fragmentation_mb=fragmentation,
        fragmentation_pct=100.0 * fragmentation / peak_reserved if fragmentation is not None and peak_reserved else None,
        alloc_retries=sum(r.alloc_retries or 0 for r in records),
        ooms=sum(r.ooms or 0 for r in records),
        growth_mb_per_step=slope,
        leak_suspected=slope is not None and slope >= LEAK_MIN_MB_PER_STEP,
    )


def _fragmentation(allocated: list, reserved: list) -> tuple[float | None, float | None]:
    """(largest reserved peak, reserved - allocated in that step)."""
    pairs = [(r, a) for a, r in zip(allocated, reserved) if a is not None and r is not None]
    if not pairs:
        return None, None
    peak, at_peak = max(pairs)
    return peak, peak - at_peak


def growth_slope(steps: list[int], values: list[float | None]) -> float | None:
    """Least-squares slope (value per step) after the first LEAK_SKIP_STEPS steps; None when too few."""
    points = [(s, v) for s, v in list(zip(steps, values))[LEAK_SKIP_STEPS:] if v is not None]
    if len(points) < LEAK_MIN_STEPS:
        return None
    x, y = np.asarray(points, dtype=np.float64).T
    return float(np.polyfit(x, y, 1)[0])


def input_evidence(records: list[StepRecord]) -> InputEvidence | None:
    timed = [r for r in records if r.data_ms is not None and r.step_time_ms]
    kept = steady(timed)
    if not kept:
        return None
    data = np.asarray([r.data_ms for r in kept], dtype=np.float64)
    total = float(sum(r.step_time_ms for r in kept))
    left_out = len(timed) - len(kept)
    return InputEvidence(steps=len(kept), mean_data_ms=float(data.mean()), max_data_ms=float(data.max()),
                         data_pct=100.0 * float(data.sum()) / total if total > 0 else 0.0,
                         basis=f"{len(kept)} steady steps; {left_out} left out (the first step and profiled steps)",
                         recorded_steps=[r.step for r in timed], data_ms=[r.data_ms for r in timed])


def compile_evidence(record: dict[str, Any], timed_steps: set[int]) -> CompileEvidence:
    """A compile record's summary; `timed_steps`: steps profiled (metrics) or present in the traces."""
    compiled = sorted(int(s["step"]) for s in record.get("steps_with_compilations", []) if s.get("frames", 1))
    return CompileEvidence(
        mode=str(record.get("mode", "")), backend=str(record.get("backend", "")),
        final=bool(record.get("final", False)), compile_time_s=float(record.get("compile_time_s", 0.0)),
        frames_compiled=int(record.get("frames_compiled", 0)), graphs=int(record.get("graphs", 0)),
        graph_break_count=int(record.get("graph_break_count", 0)),
        graph_breaks=list(record.get("graph_breaks", [])), recompiles=list(record.get("recompiles", [])),
        cuda_graphs=bool(record.get("cuda_graphs", False)),
        cudagraph_skip_reasons=list(record.get("cudagraph_skip_reasons", [])),
        steps_with_compilations=compiled,
        compiled_in_timed_steps=[s for s in compiled if s in timed_steps],
    )


def read_rank_records(run: RunRecords, rank: int, traced_steps: set[int]) -> RankRecords | None:
    """The evidence of one rank's record files (as inputs/records.py read them); None when it has neither."""
    metrics, compiled_file = run.metrics_of(rank), run.compiles.get(rank)
    metrics = metrics if metrics is not None and metrics.is_file else None
    if metrics is None and compiled_file is None:
        return None
    problems, records = [], []
    if metrics is not None:
        read = metrics.read
        if read is None:  # refused by the safe reader (a symlink out of the run)
            problems.append(f"{metrics.path.name}: not read: {metrics.reason}")
            read = MetricRecords(path=metrics.path)
        records = read.records
        if read.bad_lines:
            problems.append(f"{metrics.path.name}: {len(read.bad_lines)} line(s) skipped "
                            f"(first: line {read.bad_lines[0][0]}, {read.bad_lines[0][1]})")
    profiled = {r.step for r in records if r.profiled}
    compiled = None
    if compiled_file is not None:
        try:
            if compiled_file.error:
                raise ValueError(compiled_file.error)
            compiled = compile_evidence(compiled_file.document, profiled | traced_steps)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
            problems.append(f"{compiled_file.path.name}: unreadable ({error})")
    return RankRecords(rank=rank, memory=memory_evidence(records) if records else None,
                       input=input_evidence(records) if records else None, compile=compiled,
                       profiling=profiling_cost(records) if records else None, problems=problems)

