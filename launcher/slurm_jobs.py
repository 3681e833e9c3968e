"""A submitted Slurm job's life: submit the post-processing job, query state, wait, cancel.

These functions run Slurm's client commands (sbatch, scontrol, sacct, scancel); planning never calls them.
State comes from `scontrol show job` while slurmctld still knows the job (MinJobAge after it ends), and
from accounting (`sacct`) afterwards.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .slurm_common import PostprocessJob

ACTIVE_STATES = frozenset({
    "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
    "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT",
})
"""States of a job that is not over (a requeued job comes back to PENDING)."""
_JOB_ID = re.compile(r"^[0-9]+$")
COMMAND_TIMEOUT_S = 60


@dataclass(frozen=True, kw_only=True)
class SubmittedSlurmJob:
    job_id: str
    """The training job."""
    postprocess_job_id: str
    """The job that gathers, analyzes and merges after the training job ended."""
    script_path: str
    """The batch script sbatch received (in the run's logs)."""


@dataclass(frozen=True, kw_only=True)
class ComponentState:
    """One Slurm job, or one component of a heterogeneous job (TorchX: one per node)."""

    job_id: str
    state: str
    exit_code: str
    nodes: str = ""
    reason: str = ""
    restarts: int | None = None


@dataclass(frozen=True, kw_only=True)
class SlurmJobStatus:
    job_id: str
    components: list[ComponentState] = field(default_factory=list)
    source: str = "scontrol"
    """Where the state came from: scontrol (live) or sacct (accounting)."""

    @property
    def state(self) -> str:
        """The job's state: an active component's, else the first that did not complete, else COMPLETED."""
        states = [component.state for component in self.components]
        for state in states:
            if state in ACTIVE_STATES:
                return state
        for state in states:
            if state != "COMPLETED":
                return state
        return "COMPLETED" if states else "UNKNOWN"

    @property
    def finished(self) -> bool:
        return bool(self.components) and all(c.state not in ACTIVE_STATES for c in self.components)

    @property
    def succeeded(self) -> bool:
        return self.finished and self.state == "COMPLETED"

    @property
    def restarts(self) -> int | None:
        counts = [c.restarts for c in self.components if c.restarts is not None]
        return max(counts) if counts else None

    @property
    def exit_code(self) -> str:
        for component in self.components:
            if component.exit_code not in ("", "0:0"):
                return component.exit_code
        return self.components[0].exit_code if self.components else ""


def require_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id):
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    return job_id


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=COMMAND_TIMEOUT_S)


def submit_batch_script(argv: list[str]) -> str:
    """Run `sbatch --parsable ...`; return the job id."""
    completed = _run(argv)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:1])} failed (exit {completed.returncode}): {completed.stderr.strip()}")
    return require_job_id(completed.stdout.strip().split(";")[0])


def submit_postprocess(postprocess: PostprocessJob, training_job_id: str, folder: Path) -> str:
    """Write the post-processing script beside the job's logs and submit it after the training job."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / f"postprocess-after-{require_job_id(training_job_id)}.sh"
    script.write_text(postprocess.script)
    return submit_batch_script(postprocess.argv(training_job_id, str(script)))


def parse_scontrol_job(text: str) -> list[ComponentState]:
    """`scontrol show job --oneliner` output: one line per job (per component of a heterogeneous job)."""
    components = []
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" not in fields:
            continue
        component_id = fields["JobId"]
        if fields.get("HetJobOffset"):
            component_id = f"{fields.get('HetJobId', component_id)}+{fields['HetJobOffset']}"
        restarts = fields.get("Restarts", "")
        components.append(ComponentState(
            job_id=component_id, state=fields.get("JobState", "UNKNOWN"), exit_code=fields.get("ExitCode", ""),
            nodes=fields.get("NodeList", ""), reason=fields.get("Reason", ""),
            restarts=int(restarts) if restarts.isdigit() else None,
        ))
    return components


SACCT_FORMAT = "JobID,State,ExitCode,NodeList,Reason"


def parse_sacct(text: str) -> list[ComponentState]:
    """`sacct -X --parsable2 --noheader --format=JobID,State,ExitCode,NodeList,Reason` output."""
    components = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 5 or not parts[0]:
            continue
        components.append(ComponentState(job_id=parts[0], state=parts[1].split(" ")[0] or "UNKNOWN",
                                         exit_code=parts[2], nodes=parts[3], reason=parts[4]))
    return components


def query_job(job_id: str) -> SlurmJobStatus | None:
    """The job's state from slurmctld, else from accounting; None when neither knows the job."""
    require_job_id(job_id)
    live = _run(["scontrol", "show", "job", "--oneliner", job_id])
    if live.returncode == 0:
        components = parse_scontrol_job(live.stdout)
        if components:
            return SlurmJobStatus(job_id=job_id, components=components, source="scontrol")
    accounted = _run(["sacct", "-X", "--parsable2", "--noheader", f"--format={SACCT_FORMAT}", "-j", job_id])
    if accounted.returncode == 0:
        components = parse_sacct(accounted.stdout)
        if components:
            return SlurmJobStatus(job_id=job_id, components=components, source="sacct")
    return None


def cancel_jobs(job_ids: list[str]) -> None:
    """scancel the given jobs (those already over are left alone by Slurm)."""
    ids = [require_job_id(job_id) for job_id in job_ids if job_id]
    if not ids:
        return
    completed = _run(["scancel", *ids])
    if completed.returncode != 0:
        raise RuntimeError(f"scancel {' '.join(ids)} failed: {completed.stderr.strip()}")


def wait_for_job(job_id: str, *, poll_s: float = 2.0, timeout_s: float | None = None,
                 on_change=None) -> SlurmJobStatus:
    """Poll until the job is over (a requeued job is not); `on_change(status)` on every new state."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last_state = None
    while True:
        status = query_job(job_id)
        if status is not None:
            if on_change is not None and status.state != last_state:
                on_change(status)
            last_state = status.state
            if status.finished:
                return status
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"Slurm job {job_id} still {last_state or 'unknown'} after {timeout_s:.0f}s")
        time.sleep(poll_s)
