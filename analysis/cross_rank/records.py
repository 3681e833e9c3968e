"""The trainer's records of every rank (per_rank/trainer_records.py) and the warnings they call for."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetscope.analysis.per_rank.profiling_cost import SLOWER_WARN_PCT, slower_after
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.analysis.per_rank.trainer_records import LEAK_SKIP_STEPS, RankRecords, read_rank_records
from fleetscope.analysis.inputs.records import RunRecords

STATUS_OK, STATUS_NONE = "ok", "not recorded"
INPUT_WARN_PCT = 10.0
"""Input wait (data_ms) above this share of step time is called out."""


@dataclass(frozen=True, kw_only=True)
class TrainerEvidence:
    status: str
    reason: str = ""
    ranks: list[RankRecords] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    """Ranks expected (world size, else the analyzed ones) with neither record file."""
    warnings: list[str] = field(default_factory=list)


def trainer_evidence(run: RunRecords | None, results: list[RankResult], world_size: int | None) -> TrainerEvidence:
    """Every rank's records (inputs/records.py); a trace directory (no run records) has none."""
    if run is None:
        return TrainerEvidence(status=STATUS_NONE, reason="not a run directory: no trainer records next to the traces")
    traced: dict[int, set[int]] = {}
    for result in results:
        traced.setdefault(result.rank, set()).update(s.step for s in result.steps)
    expected = range(world_size) if world_size else sorted(traced)
    present = run.record_ranks
    found = [records for rank in sorted(present.intersection(expected))
             if (records := read_rank_records(run, rank, traced.get(rank, set()))) is not None]
    have = {records.rank for records in found}
    missing = [rank for rank in expected if rank not in have]
    if not found:
        return TrainerEvidence(status=STATUS_NONE, missing_ranks=missing,
                               reason=f"no metrics/rank<R>.jsonl or .compile.json in {run.layout.metrics_dir}")
    return TrainerEvidence(status=STATUS_OK, ranks=found, missing_ranks=missing,
                           warnings=[w for records in found for w in record_warnings(records)])


def record_warnings(records: RankRecords) -> list[str]:
    """What a reader should act on in one rank's records."""
    rank, warnings = records.rank, [f"rank {records.rank}: {p}" for p in records.problems]
    memory, data, compiled = records.memory, records.input, records.compile
    if memory is not None and memory.leak_suspected:
        warnings.append(f"rank {rank}: allocated memory grows {memory.growth_mb_per_step:.2f} MiB/step "
                        f"(least-squares over steps {memory.steps[LEAK_SKIP_STEPS]}-{memory.steps[-1]}): "
                        "possible leak")
    if memory is not None and (memory.alloc_retries or memory.ooms):
        warnings.append(f"rank {rank}: {memory.alloc_retries} allocation retries (each flushes the cache and "
                        f"syncs), {memory.ooms} OOMs")
    if data is not None and data.data_pct >= INPUT_WARN_PCT:
        warnings.append(f"rank {rank}: waiting for input takes {data.data_pct:.0f}% of step time "
                        f"(mean {data.mean_data_ms:.2f} ms per step; {data.basis})")
    if slower_after(records.profiling):
        warnings.append(profiling_warning(records))
    if compiled is not None and compiled.compiled_in_timed_steps:
        steps = ", ".join(map(str, compiled.compiled_in_timed_steps))
        warnings.append(f"rank {rank}: torch.compile compiled during profiled/traced step(s) {steps}: their "
                        "times include compilation, not steady state")
    if compiled is not None and compiled.recompiles:
        first = compiled.recompiles[0]
        warnings.append(f"rank {rank}: {len(compiled.recompiles)} recompile(s); first: {first.get('function')}: "
                        f"{first.get('reason')}")
    return warnings


def profiling_warning(records: RankRecords) -> str:
    """Steps after the last window slower than before the first: what it is and the likely cause."""
    cost = records.profiling
    difference = cost.after_vs_before
    return (f"rank {records.rank}: steps after the last profile window (from step {cost.last_profiled_step + 1}) are "
            f"{difference.median_pct:.1f}% slower than before the first (interval {difference.low_pct:+.1f}% to "
            f"{difference.high_pct:+.1f}%, more than {SLOWER_WARN_PCT:.0f}%): likely CUPTI still subscribed after "
            "profiling (TEARDOWN_CUPTI not 1 on this rank: profiler.cupti_teardown, CUDA < 12.6, or a "
            "user's TEARDOWN_CUPTI=0)")
