"""One entry for both Slurm paths: plan (pure), submit, and the job.json record of the submission."""

from __future__ import annotations

from typing import Union

from ..traces.layout import RunLayout
from .jobrecord import now_iso, spec_record, write_job_record
from .slurm_jobs import SubmittedSlurmJob
from .spec import JobSpec
from .submitit_backend import SubmititPlan, plan_submitit, submit_submitit
from .torchx_backend import TorchXPlan, app_handle, plan_torchx, submit_torchx

SlurmPlan = Union[SubmititPlan, TorchXPlan]


def plan_slurm(spec: JobSpec, *, postprocess: bool = True) -> SlurmPlan:
    """The submitit or TorchX plan of a Slurm job (with the post-processing job unless told); contacts nothing."""
    if spec.scheduler == "submitit":
        return plan_submitit(spec, postprocess=postprocess)
    if spec.scheduler == "torchx":
        return plan_torchx(spec, postprocess=postprocess)
    raise ValueError(f"scheduler {spec.scheduler!r} is not a Slurm scheduler")


def submit_slurm(spec: JobSpec, plan: SlurmPlan) -> SubmittedSlurmJob:
    """Record the plan in job.json, submit, and record the Slurm job ids."""
    layout = RunLayout.at(spec.train.run_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    write_job_record(layout, **spec_record(spec), plan=plan.to_json(), status="submitting")
    submitted = submit_submitit(plan) if isinstance(plan, SubmititPlan) else submit_torchx(plan)
    extra = {"torchx_app_handle": app_handle(submitted.job_id)} if isinstance(plan, TorchXPlan) else {}
    write_job_record(layout, status="submitted", submitted_at=now_iso(), job_id=submitted.job_id,
                     postprocess_job_id=submitted.postprocess_job_id, sbatch_script=submitted.script_path, **extra)
    return submitted
