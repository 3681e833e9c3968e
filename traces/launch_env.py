"""The environment `fleetscope launch` gives a user's own training script, and how that script reads it.

The launcher (launcher/spec.py) writes these variables for every rank of a job whose entry point is the
user's program; `trainer/user_profiling.py` reads them inside that program. Both import the names from here.

    FLEETSCOPE_RUN_DIR        the run directory (traces, clock offsets, logs land in it)
    FLEETSCOPE_PROFILE        the profiler schedule as JSON: the fields of trainer.config.ProfilerSchedule
                              (rank-independent: every rank plans the same windows from it)
    FLEETSCOPE_JOB_SCHEDULER  the scheduler that started the job (local, submitit, torchx, ...)

The rank comes from what the rank's launcher sets (RANK from torchrun, else SLURM_PROCID), or from the
process group once it exists; the attempt (a requeued or restarted job) from the restart counters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RUN_DIR_VAR = "FLEETSCOPE_RUN_DIR"
PROFILE_VAR = "FLEETSCOPE_PROFILE"
SCHEDULER_VAR = "FLEETSCOPE_JOB_SCHEDULER"
VARIABLES = (RUN_DIR_VAR, PROFILE_VAR, SCHEDULER_VAR)


def user_environment(*, run_dir: str, schedule: Mapping[str, Any], scheduler: str) -> dict[str, str]:
    """The variables the launcher sets for a user's program (values are plain text, JSON for the schedule)."""
    return {
        RUN_DIR_VAR: run_dir,
        PROFILE_VAR: json.dumps(dict(schedule), sort_keys=True, separators=(",", ":")),
        SCHEDULER_VAR: scheduler,
    }


@dataclass(frozen=True, kw_only=True)
class LaunchedBy:
    """What a user's program finds in its environment when fleetscope launched it."""

    run_dir: str
    schedule: dict[str, Any]
    """ProfilerSchedule fields (validated by whoever builds the schedule from them)."""
    scheduler: str


def read_launch_environment(environ: Mapping[str, str] | None = None) -> LaunchedBy | None:
    """The launch plan from the environment; None when fleetscope did not launch this process.
    A variable that is set but unreadable is an error that names it (a half-set plan is never guessed at)."""
    environ = os.environ if environ is None else environ
    run_dir = environ.get(RUN_DIR_VAR, "")
    if not run_dir:
        return None
    text = environ.get(PROFILE_VAR, "{}")
    try:
        schedule = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{PROFILE_VAR}: not JSON ({error}): {text!r}") from None
    if not isinstance(schedule, dict):
        raise ValueError(f"{PROFILE_VAR}: expected a JSON object of schedule fields, got {text!r}")
    return LaunchedBy(run_dir=run_dir, schedule=schedule, scheduler=environ.get(SCHEDULER_VAR, ""))


def restart_attempt(environ: Mapping[str, str] | None = None) -> int:
    """Restart count of this job (Slurm requeues plus torchrun restarts); names new trace files."""
    environ = os.environ if environ is None else environ
    return int(environ.get("SLURM_RESTART_COUNT") or 0) + int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's global rank as its launcher set it (torchrun's RANK, else Slurm's SLURM_PROCID)."""
    environ = os.environ if environ is None else environ
    for name in ("RANK", "SLURM_PROCID"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None
