"""The input family: the training process loading its own data."""

from __future__ import annotations

from .model import Evidence, Finding, Rule, settings_change, step_gain, trainer_change

DATA_SHARE = 0.10
"""Data loading above this share of the step is worth moving to worker processes."""
RECOMMENDED_WORKERS = 8
DATA_WORKERS_CHANGE = settings_change(f"data.num_workers={RECOMMENDED_WORKERS}", "data.persistent_workers=true")
"""The trainer's change; the straggler rule proposes it too where a rank's input pipeline is the delay."""
DATA_WORKERS_IN_CODE = f"DataLoader(..., num_workers={RECOMMENDED_WORKERS}, pin_memory=True, persistent_workers=True)"
"""The same change in user code."""


def data_workers(e: Evidence) -> Finding | None:
    """Data loading (median data_ms of the slowest rank) over DATA_SHARE of the step with no worker
    processes: workers prefetch the next batches while the step runs, so up to data_ms per step is saved."""
    workers = e.setting("data", "num_workers", 0)
    if e.data_ms is None or not e.step_ms or workers > 0 or e.data_ms < DATA_SHARE * e.step_ms:
        return None
    gain, pct = step_gain(e, e.data_ms)
    return Finding(rule="data_workers", title="data loading stalls the step",
                   evidence={"data_ms": round(e.data_ms, 3), "data_source": e.data_source,
                             "step_ms": round(e.step_ms, 3), "num_workers": workers},
                   expected_gain_ms=gain, expected_gain_pct=pct,
                   confidence="high" if e.data_ms >= 2 * DATA_SHARE * e.step_ms else "medium",
                   **trainer_change(DATA_WORKERS_CHANGE),
                   why=f"{e.data_ms:.1f} ms of each {e.step_ms:.1f} ms step is spent loading data in the training "
                       "process; worker processes load the next batches while the GPU computes")


RULES = (
    Rule(find=data_workers, recovers="input wait",
         in_user_code=f"{DATA_WORKERS_IN_CODE}: load the next batches in worker processes while the step runs"),
)
