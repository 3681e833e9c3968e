"""The Slurm client: the only module that runs Slurm's commands (sbatch, scontrol, sacct, scancel).

A submitted job's life: submit it and its post-processing job, query state, wait, cancel, and the status
of a run (job.json + Slurm's state + which rank failed first). Planning never calls any of this.
State comes from `scontrol show job` while slurmctld still knows the job (MinJobAge after it ends), and
from accounting (`sacct`) afterwards.

`SlurmScheduler` is what the submitit and TorchX schedulers share: they differ in planning and in how the
training job is handed to sbatch, not in how it is followed.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...traces.jobfile import now_iso, read_job_record, write_job_record
from ...traces.layout import RunLayout, fanout_dir, slurm_logs_dir, submitit_rank_stderr
from ..failures import RankFailure, collect_failures, earliest_per_rank, root_causes
from ..scheduler import LaunchPlan, Submission, Verdict, existing_outputs
from ..fanout import FanoutPlan
from ..slurm_request import PostprocessJob
from ..spec import JobSpec, spec_record

SBATCH_TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "sbatch" / "fleetscope-torchrun.sbatch"
"""The plain-sbatch path: one torchrun per node, no fleetscope on the submitting side (see slurm/README.md)."""

ACTIVE_STATES = frozenset({
    "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
    "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT",
})
"""States of a job that is not over (a requeued job comes back to PENDING)."""
_JOB_ID = re.compile(r"^[0-9]+\Z")
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


@dataclass(frozen=True, kw_only=True)
class SubmittedFanout:
    array_job_id: str
    reduce_job_id: str
    array_script: Path
    reduce_script: Path


def submit_fanout(plan: FanoutPlan) -> SubmittedFanout:
    """Write the array script into <run>/logs/slurm/, submit the array, then its reduce job after it (the
    reduce script, which names the array, beside the fan-out's records). If the reduce cannot be submitted
    the array is cancelled: tasks whose results nobody would reduce are not left running."""
    layout = RunLayout.at(plan.config.run_dir)
    logs = slurm_logs_dir(layout)
    logs.mkdir(parents=True, exist_ok=True)
    array_script = logs / f"fanout-parse-{plan.token}.sh"
    array_script.write_text(plan.array_script)
    array_job_id = submit_batch_script([*plan.array_sbatch, str(array_script)])
    try:
        folder = fanout_dir(layout, array_job_id)
        folder.mkdir(parents=True, exist_ok=True)
        reduce_script = folder / "reduce.sh"
        reduce_script.write_text(plan.reduce_script(array_job_id))
        reduce_job_id = submit_batch_script([*plan.reduce_sbatch(array_job_id), str(reduce_script)])
    except (OSError, RuntimeError, ValueError):
        cancel_jobs([array_job_id])
        raise
    return SubmittedFanout(array_job_id=array_job_id, reduce_job_id=reduce_job_id, array_script=array_script,
                           reduce_script=reduce_script)


def array_task_states(array_job_id: str, tasks: int, *, timeout_s: float = 60.0,
                      poll_s: float = 1.0) -> dict[int, ComponentState]:
    """Each task of a finished array job from accounting (state, exit code, node), waiting a little for
    slurmdbd to hold every task; tasks accounting never shows are absent."""
    require_job_id(array_job_id)
    deadline = time.monotonic() + timeout_s
    while True:
        accounted = _run(["sacct", "-X", "--parsable2", "--noheader", f"--format={SACCT_FORMAT}", "-j",
                          array_job_id])
        states = {}
        if accounted.returncode == 0:
            for component in parse_sacct(accounted.stdout):
                head, _, task = component.job_id.partition("_")
                if head == array_job_id and task.isdigit():
                    states[int(task)] = component
        finished = all(c.state not in ACTIVE_STATES for c in states.values())
        if (len(states) >= tasks and finished) or time.monotonic() >= deadline:
            return states
        time.sleep(poll_s)


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


def requeue_job(job_id: str) -> None:
    """`scontrol requeue`: the job goes back to PENDING and its next attempt resumes."""
    completed = _run(["scontrol", "requeue", require_job_id(job_id)])
    if completed.returncode != 0:
        raise RuntimeError(completed.stderr.strip() or f"exit {completed.returncode}")


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


@dataclass(kw_only=True)
class SlurmRunStatus:
    """What `fleetscope status` shows for a run submitted to Slurm."""

    run_dir: Path
    scheduler: str
    job_id: str
    postprocess_job_id: str
    training: SlurmJobStatus | None
    postprocess: SlurmJobStatus | None
    recorded_status: str = ""
    """The status job.json held before this query."""
    failures: list[RankFailure] = field(default_factory=list)
    outputs: dict[str, Path] = field(default_factory=dict)

    @property
    def state(self) -> str:
        """Slurm's state of the training job; once Slurm has forgotten it, the final state job.json recorded."""
        if self.training is not None:
            return self.training.state
        return recorded_final_state(self.recorded_status) or "UNKNOWN"

    @property
    def forgotten(self) -> bool:
        """Neither slurmctld nor accounting knows the job any more."""
        return self.training is None

    @property
    def verdict(self) -> Verdict:
        ok = not self.failures and self.state in ("COMPLETED", "PENDING", "RUNNING")
        return Verdict.OK if ok else Verdict.FAILED

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler, "job_id": self.job_id, "postprocess_job_id": self.postprocess_job_id,
            "state": self.state,
            "exit_code": self.training.exit_code if self.training else None,
            "restarts": self.training.restarts if self.training else None,
            "postprocess_state": self.postprocess.state if self.postprocess else None,
            "failures": [vars(failure) for failure in self.failures],
        }


def slurm_job_ids(record: dict[str, Any], layout: RunLayout) -> tuple[str, str]:
    job_id = str(record.get("job_id") or "")
    if not job_id:
        raise ValueError(f"{layout.job_file}: no Slurm job id recorded (was this run submitted to Slurm?)")
    return job_id, str(record.get("postprocess_job_id") or "")


def run_status(run_dir: str | Path) -> SlurmRunStatus:
    """Query Slurm for the run's jobs and read its failure files (nothing is written)."""
    layout = RunLayout.at(run_dir)
    record = read_job_record(layout)
    job_id, postprocess_job_id = slurm_job_ids(record, layout)
    return SlurmRunStatus(
        run_dir=layout.root,
        scheduler=str(record.get("scheduler", "")),
        job_id=job_id,
        postprocess_job_id=postprocess_job_id,
        training=query_job(job_id),
        postprocess=query_job(postprocess_job_id) if postprocess_job_id else None,
        recorded_status=str(record.get("status", "")),
        failures=rank_failures(layout, job_id),
        outputs=existing_outputs(layout),
    )


def recorded_final_state(recorded: str) -> str | None:
    """The Slurm state of a final status job.json recorded ("cancelled", "completed", "timeout", ...);
    None for a status that may still change (submitted, running, unknown, ...)."""
    state = {"succeeded": "COMPLETED"}.get(recorded, recorded.upper())
    if not state or state in ACTIVE_STATES or state in ("SUBMITTING", "SUBMITTED", "UNKNOWN"):
        return None
    return state


def record_status(layout: RunLayout, status: SlurmRunStatus) -> None:
    """Record what Slurm said; a job Slurm has forgotten keeps its recorded status (never "unknown" over
    a final one)."""
    if status.forgotten and recorded_final_state(status.recorded_status):
        write_job_record(layout, checked_at=now_iso(), slurm_knows_job=False)
        return
    write_job_record(layout, status=status.state.lower(), slurm=status.to_json(), checked_at=now_iso(),
                     slurm_knows_job=not status.forgotten)


def rank_failures(layout: RunLayout, job_id: str) -> list[RankFailure]:
    """Every failed rank (submitit's error files, TorchX nodes' torchrun summaries), the earliest first."""
    submitit = [with_submitit_log(failure, layout, job_id) for failure in collect_failures(layout.logs_dir)]
    return earliest_per_rank([*submitit, *torchrun_root_causes(layout)])


def torchrun_root_causes(layout: RunLayout) -> list[RankFailure]:
    """The first failure of each TorchX node, from the torchrun summary in the node's Slurm stderr."""
    return root_causes(sorted(slurm_logs_dir(layout).glob("slurm-*.err")))


def with_submitit_log(failure: RankFailure, layout: RunLayout, job_id: str) -> RankFailure:
    """Point a submitit rank's failure at its stderr: <run>/logs/slurm/<job>_<rank>_log.err."""
    stderr = submitit_rank_stderr(layout, job_id, failure.rank)
    if failure.log_path is None and stderr.exists():
        return dataclasses.replace(failure, log_path=str(stderr))
    return failure


def wait_for_run(layout: RunLayout, on_change: Callable[[str, SlurmJobStatus], None]) -> SlurmRunStatus:
    """Wait for the training job, then its post-processing job; record and return the run's status.
    `on_change(label, status)` on every new state ("job" or "post-processing")."""
    record = read_job_record(layout)
    wait_for_job(record["job_id"], on_change=lambda status: on_change("job", status))
    postprocess_id = record.get("postprocess_job_id")
    if postprocess_id:
        wait_for_job(postprocess_id, on_change=lambda status: on_change("post-processing", status))
    status = run_status(layout.root)
    record_status(layout, status)
    return status


def waited_verdict(status: SlurmRunStatus) -> Verdict:
    """After waiting: FAILED unless the training job completed; PARTIAL without a merged trace."""
    if status.training is None or not status.training.succeeded:
        return Verdict.FAILED
    return Verdict.OK if "merged_trace" in status.outputs else Verdict.PARTIAL


class SlurmScheduler(abc.ABC):
    """Following, recording and cancelling a Slurm run; subclasses plan it and hand it to sbatch."""

    name: str

    @abc.abstractmethod
    def plan(self, spec: JobSpec, *, postprocess: bool = True) -> LaunchPlan:
        """Pure: the batch script(s) and sbatch command lines."""

    @abc.abstractmethod
    def submit_training(self, plan: Any) -> SubmittedSlurmJob:
        """Hand the training job (and its post-processing job) to sbatch."""

    def app_fields(self, submitted: SubmittedSlurmJob) -> dict[str, Any]:
        """Scheduler-specific fields job.json records after submission."""
        return {}

    def submit(self, plan: LaunchPlan, layout: RunLayout) -> Submission:
        """Record the plan in job.json, submit, and record the Slurm job ids."""
        layout.root.mkdir(parents=True, exist_ok=True)
        write_job_record(layout, **spec_record(plan.spec), plan=plan.to_json(), status="submitting")
        submitted = self.submit_training(plan)
        write_job_record(layout, status="submitted", submitted_at=now_iso(), job_id=submitted.job_id,
                         postprocess_job_id=submitted.postprocess_job_id, sbatch_script=submitted.script_path,
                         **self.app_fields(submitted))
        return Submission(scheduler=self.name, finished=False, job_id=submitted.job_id,
                          postprocess_job_id=submitted.postprocess_job_id)

    def status(self, layout: RunLayout) -> SlurmRunStatus:
        status = run_status(layout.root)
        record_status(layout, status)
        return status

    def cancel(self, layout: RunLayout, *, postprocess_too: bool = False) -> list[str]:
        record = read_job_record(layout)
        job_id, postprocess_id = str(record.get("job_id") or ""), str(record.get("postprocess_job_id") or "")
        if not job_id:
            raise ValueError(f"{layout.job_file}: no Slurm job id recorded")
        job_ids = [job_id, postprocess_id] if postprocess_too and postprocess_id else [job_id]
        cancel_jobs(job_ids)
        write_job_record(layout, status="cancelled", cancelled_at=now_iso())
        return job_ids
