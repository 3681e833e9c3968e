"""The one interface every scheduler implements, and the plain data it hands back.

    plan(spec)             pure: the exact commands/scripts the job would run (what --dry-run prints)
    submit(plan, layout)   runs or submits the plan, recording it in job.json
    status(layout)         what the job is doing now (reads job.json and asks the scheduler)
    cancel(layout)         stops the job

A scheduler that runs in the foreground (local torchrun, TorchX local_cwd) returns from `submit` when the
job is over; a batch scheduler (Slurm through submitit or TorchX) as soon as the job is queued.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..traces.layout import RunLayout
from .failures import RankFailure
from .spec import JobSpec


class Verdict(enum.Enum):
    """How a command's result reads to a script (the CLI maps it onto exit codes)."""

    OK = "ok"
    FAILED = "failed"
    PARTIAL = "partial"
    """The job succeeded but some of its outputs (traces, report, merged trace) are missing."""


class LaunchPlan(Protocol):
    spec: JobSpec
    run_dir: Path

    def render(self) -> str:
        """The exact text that would run (--dry-run)."""

    def to_json(self) -> dict[str, Any]:
        """The plan as job.json records it."""


@dataclass(frozen=True, kw_only=True)
class Submission:
    """What `submit` did."""

    scheduler: str
    finished: bool
    """The job ran in the foreground and is over (else it is queued)."""
    succeeded: bool = False
    """For a finished job: every rank exited 0."""
    detail: str = ""
    """For a failed job: the scheduler's own words (exit code, TorchX state)."""
    failures: list[RankFailure] = field(default_factory=list)
    job_id: str = ""
    """The batch scheduler's job id."""
    postprocess_job_id: str = ""
    """The batch job that gathers, analyzes and merges after the training job ("": none)."""


class RunStatus(Protocol):
    run_dir: Path
    failures: list[RankFailure]
    outputs: dict[str, Path]

    @property
    def verdict(self) -> Verdict:
        """FAILED when the job failed (or a rank did); OK otherwise, also while it runs."""

    def to_json(self) -> dict[str, Any]:
        """The status as job.json records it."""


class Scheduler(Protocol):
    name: str

    def plan(self, spec: JobSpec, *, postprocess: bool = True) -> LaunchPlan:
        """Pure: contacts no cluster, writes nothing. `postprocess`: batch schedulers add a post-processing job."""

    def submit(self, plan: LaunchPlan, layout: RunLayout) -> Submission: ...

    def status(self, layout: RunLayout) -> RunStatus: ...

    def cancel(self, layout: RunLayout, *, postprocess_too: bool = False) -> list[str]:
        """Cancel the run's jobs (and its post-processing job if asked); returns the ids cancelled."""


def existing_outputs(layout: RunLayout) -> dict[str, Path]:
    """The post-processing outputs a run directory holds now."""
    candidates = {"manifest": layout.manifest_file, "report_json": layout.report_json,
                  "report_html": layout.report_html, "merged_trace": layout.merged_trace}
    return {name: path for name, path in candidates.items() if path.exists()}
