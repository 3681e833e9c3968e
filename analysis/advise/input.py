"""The input family: the training process loading its own data."""

from __future__ import annotations

from ..per_rank.host_stalls import IDLE_INPUT
from .model import (TRACE_DATA_SOURCE, Change, Evidence, Finding, Rule, settings_change, step_gain, trace_gain,
                    trainer_change, unprofiled_range_ms)

DATA_SHARE = 0.10
"""Data loading above this share of the step is worth moving to worker processes."""
INPUT_WAIT_SHARE = 0.05
"""GPU idle waiting for the batch above this share of the step (the significance bar of the other idle rules):
loading that the GPU's queue did not cover stalls the step, however small a share of it the loading is."""
RECOMMENDED_WORKERS = 8
"""Workers per rank where the host has the CPUs for them: more seldom help one GPU's input pipeline."""


def recommended_workers(e: Evidence) -> int:
    """Workers per rank that fit its CPUs (Evidence.cpus_per_rank): one CPU stays with the training process, at
    least one worker, at most RECOMMENDED_WORKERS; RECOMMENDED_WORKERS where the CPUs are not known."""
    if e.cpus_per_rank is None:
        return RECOMMENDED_WORKERS
    return max(1, min(RECOMMENDED_WORKERS, e.cpus_per_rank - 1))


def data_workers_change(e: Evidence) -> Change:
    """The trainer's change; the straggler rule proposes it too where a rank's input pipeline is the delay."""
    return settings_change(f"data.num_workers={recommended_workers(e)}", "data.persistent_workers=true")


def data_workers_in_code(workers: int) -> str:
    """The same change in user code."""
    return f"DataLoader(..., num_workers={workers}, pin_memory=True, persistent_workers=True)"


def _cpus_note(e: Evidence) -> str:
    if e.cpus_per_rank is None:
        return ""
    return f" ({e.cpus_per_rank} CPU(s) per rank on its host: one stays with the training process)"


def data_workers(e: Evidence) -> Finding | None:
    """Data loading (median data_ms of the slowest rank) over DATA_SHARE of the step, or the GPU idle waiting for
    it (host_stalls.py IDLE_INPUT) over INPUT_WAIT_SHARE, with no worker processes: workers prefetch the next
    batches while the step runs, so up to data_ms per step is saved."""
    workers = e.setting("data", "num_workers", 0)
    if e.data_ms is None or not e.step_ms or workers > 0:
        return None
    waited_ms = min(e.idle_cause_ms.get(IDLE_INPUT, 0.0), e.data_ms) if e.basis == "gpu" else 0.0
    if e.data_ms < DATA_SHARE * e.step_ms and waited_ms < INPUT_WAIT_SHARE * e.step_ms:
        return None
    # the trace's DataLoader ranges are profiled host work, lengthened by the profiler's cost per event recorded in
    # them (a loader of numpy or Python records few); step metrics' data_ms is not profiled
    from_trace = e.data_source == TRACE_DATA_SOURCE
    unprofiled_ms = unprofiled_range_ms(e, e.data_ms, e.data_loader_events) if from_trace else None
    if not from_trace:
        gain, pct = step_gain(e, e.data_ms)
    elif unprofiled_ms is not None:
        gain, pct = step_gain(e, unprofiled_ms)
    else:
        gain, pct = trace_gain(e, e.data_ms)
    return Finding(rule="data_workers", title="data loading stalls the step",
                   evidence={"data_ms": round(e.data_ms, 3), "data_source": e.data_source,
                             "step_ms": round(e.step_ms, 3), "num_workers": workers,
                             "recommended_workers": recommended_workers(e),
                             **({"unprofiled_data_ms": round(unprofiled_ms, 3),
                                 "data_loader_events_per_step": round(e.data_loader_events or 0.0, 1),
                                 "host_events_per_step": round(e.host_events or 0.0, 1)}
                                if unprofiled_ms is not None else {}),
                             **({"cpus_per_rank": e.cpus_per_rank} if e.cpus_per_rank is not None else {})},
                   expected_gain_ms=gain, expected_gain_pct=pct,
                   confidence="high" if e.data_ms >= 2 * DATA_SHARE * e.step_ms else "medium",
                   **trainer_change(data_workers_change(e), note=_cpus_note(e).strip(" ()")),
                   why=f"{e.data_ms:.1f} ms of each {e.step_ms:.1f} ms step is spent loading data in the training "
                       "process; worker processes load the next batches while the GPU computes"
                       + (f" (about {unprofiled_ms:.1f} ms without the profiler: the fetches hold "
                          f"{e.data_loader_events or 0.0:.0f} of the {e.host_events or 0.0:.0f} events it recorded "
                          "per step, and its cost is per event)"
                          if unprofiled_ms is not None else ""))


RULES = (
    Rule(find=data_workers, recovers="input wait",
         in_user_code=lambda finding: f"{data_workers_in_code(_workers_of(finding))}: load the next batches in "
                                      "worker processes while the step runs"),
)


def _workers_of(finding: Finding) -> int:
    value = finding.evidence.get("recommended_workers")
    return value if isinstance(value, int) and not isinstance(value, bool) else RECOMMENDED_WORKERS
