"""Slurm through submitit: one Slurm task per GPU, each running the trainer in-process.

Why one task per GPU (submitit's `TorchDistributedEnvironment`) and not one torchrun per node:
  * submitit's unit is a Python callable run in every task; wrapping torchrun would make that callable a
    process launcher whose result and exceptions say nothing about the ranks (submitit's maintainers advise
    against mixing the two). Here each rank's exception reaches submitit (and our error file) directly.
  * Slurm sees every rank: `srun --kill-on-bad-exit=1` ends the whole step as soon as one rank fails, Slurm's
    signals (preemption, requeue, time limit) reach each rank without an agent in between, and per-rank
    stdout/stderr land in `<run>/logs/slurm/<job>_<rank>_log.{out,err}`.
  * rendezvous is static: MASTER_ADDR is the first node, the port derived from the job id, ranks from
    SLURM_PROCID. Slurm starts all tasks together, so torchrun's elastic rendezvous has nothing to add.
  * all GPUs of a node stay visible to every task (`--gpus-per-node`, CUDA_VISIBLE_DEVICES not narrowed):
    the trainer picks `cuda:LOCAL_RANK`, and NCCL keeps its peer-to-peer paths between local ranks.
TorchX (schedulers/torchx.py) is the torchrun-per-node path, for users who want torchrun's agent.

`plan_submitit` is pure (the sbatch text is submitit's own `_make_sbatch_string`, so the dry run prints
exactly what `submit_submitit` hands to sbatch); only `submit_submitit` contacts the cluster.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...trainer.config import train_argv
from ...traces.layout import RunLayout, submitit_error_file
from ...traces.exit_status import EXIT_PREEMPTED
from ..slurm_request import (
    TIME_LIMIT_SIGNAL_SECONDS,
    PostprocessJob,
    SlurmResources,
    export_lines,
    plan_postprocess_job,
    render_postprocess,
    shell_join,
    slurm_logs_dir,
)
from ..spec import JobSpec
from .slurm import SlurmScheduler, SubmittedSlurmJob, requeue_job, submit_postprocess

SUBMIT_MODULE_COMMAND = "-u -m submitit.core._submit"
MASTER_PORT_LINES = [
    "# rank 0's rendezvous port, from the job id, below Linux's ephemeral ports (32768-60999) so that no",
    "# client socket of the node can hold it (submitit's own choice spans 20000-60000)",
    "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 12000))",
]


@dataclass(frozen=True, kw_only=True)
class SubmititPlan:
    """Everything submitit needs, and the exact texts the dry run prints."""

    spec: JobSpec
    folder: str
    """submitit's folder: submission script, pickles and per-rank logs."""
    python: str
    """The shell word that starts Python on the nodes (already quoted)."""
    parameters: dict[str, Any]
    """`SlurmExecutor.update_parameters(**parameters)`."""
    rank_task: "SubmititRank | SubmititUserRank"
    sbatch_script: str
    postprocess: PostprocessJob | None
    """The gather/analyze/merge job submitted after the training job; None: none (--no-post)."""
    run_dir: Path

    def render(self) -> str:
        return "\n".join([
            f"# submitit: sbatch {self.folder}/<JOB_ID>_submission.sh, whose text is:",
            self.sbatch_script,
            f"# every task runs {self.rank_task.describe()}",
            *render_postprocess(self.postprocess),
        ])

    def to_json(self) -> dict[str, Any]:
        return {"kind": "submitit", "folder": self.folder, "parameters": self.parameters,
                **self.rank_task.record(), "sbatch_script": self.sbatch_script,
                "postprocess_script": self.postprocess.script if self.postprocess else None}


MAX_NOTICE_REQUEUES = 3
"""Requeues on time-limit notices before a job is left to end (each attempt resumes, so progress is made)."""


@dataclass(frozen=True)
class SubmititRank:
    """What each Slurm task runs: one trainer rank, in-process.

    Picklable (submitit stores it). Stops on the scheduler's request:
      * SIGTERM (`scontrol requeue`, preemption): the trainer saves a checkpoint on every rank and exits;
        Slurm requeues the job, and the next attempt resumes from the checkpoint;
      * the time-limit notice (USR2, `--signal=USR2@90` in submitit's script): while training, the trainer
        takes it too (its handler replaces submitit's, whose requeue would end rank 0 mid-step before any
        checkpoint): every rank saves at the same step, then rank 0 requeues the job and the others exit
        cleanly, so that no early exit ends the step before rank 0 has requeued;
      * a notice outside training (start-up, teardown) reaches submitit's own handler: `checkpoint` lets
        it requeue, and the next attempt resumes from the latest periodic checkpoint.
    """

    trainer_argv: list[str]
    run_dir: str

    def describe(self) -> str:
        return shell_join(["python", "-m", "fleetscope.trainer", *self.trainer_argv])

    def record(self) -> dict[str, Any]:
        return {"trainer_argv": self.trainer_argv}

    def __call__(self) -> int:
        import submitit

        # overwrite: MASTER_PORT comes from the batch script (and is what this object read).
        distributed = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False,
                                                                             overwrite=True)
        error_file = self.error_file(distributed.rank)
        error_file.parent.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(error_file)

        outcome = run_trainer_rank(self.trainer_argv, distributed.rank)
        code = outcome.exit_code
        if code == EXIT_PREEMPTED:
            stop = outcome.stop
            if stop is not None and stop.requeue_needed:
                if distributed.rank != 0:
                    return 0
                requeue_this_job()
            # Exit without a result so that submitit does not call the job done: the next attempt will.
            raise SystemExit(code)
        if code:
            raise RuntimeError(f"the trainer exited with code {code} on rank {distributed.rank}")
        return 0

    def error_file(self, rank: int) -> Path:
        job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID", "unknown")
        attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
        # torchrun's layout, so that the same failure collection reads local and submitit runs
        return submitit_error_file(RunLayout.at(self.run_dir), job_id, attempt, rank)

    def checkpoint(self) -> Any:
        """submitit's hook on a notice outside training: requeue the same work (it resumes)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self)


@dataclass(frozen=True)
class SubmititUserRank:
    """What each Slurm task runs for a user's own program: the program, in-process, as rank RANK.

    Like the trainer's rank (SubmititRank): the program starts in its workdir with torchrun's variables
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), under `@record` (an exception or a non-zero
    exit becomes this rank's error file, which `status` reads); exit status 75 (EXIT_PREEMPTED: stopped on
    SIGTERM after a checkpoint) ends the task without a result, so that Slurm's requeue runs the job again;
    the time-limit notice (USR2) reaches submitit's handler unless the program takes it, and `checkpoint`
    requeues the same work. After the program (any outcome) this rank's own traces matching
    `collect_glob` are filed into the run directory from the node's disk.
    """

    argv: list[str]
    """`[-m] program args...` (UserEntry.argv)."""
    workdir: str
    run_dir: str
    collect_glob: str = ""

    def describe(self) -> str:
        lines = [f"cd -- {shlex.quote(self.workdir)} && {shell_join(['python', *self.argv])}"]
        if self.collect_glob:
            lines.append(f"then this rank's traces: {shell_join(['fleetscope', 'collect-traces', self.run_dir, self.collect_glob, '--rank', 'RANK'])}")
        return "\n# ".join(lines)

    def record(self) -> dict[str, Any]:
        return {"program_argv": self.argv, "workdir": self.workdir, "collect_traces": self.collect_glob}

    def __call__(self) -> int:
        import submitit

        distributed = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False,
                                                                             overwrite=True)
        error_file = SubmititRank([], self.run_dir).error_file(distributed.rank)
        error_file.parent.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        from torch.distributed.elastic.multiprocessing.errors import record


        os.chdir(self.workdir)
        try:
            code = record(run_program_checked)(self.argv, allowed=(0, EXIT_PREEMPTED))
        finally:
            self.collect(distributed.rank)
        if code == EXIT_PREEMPTED:
            raise SystemExit(code)  # no result: the requeued job runs it again
        return 0

    def collect(self, rank: int) -> None:
        if not self.collect_glob:
            return
        from ...traces.collect import collect_traces
        from ...traces.launch_env import restart_attempt
        from .local import report_collection

        report_collection(collect_traces(self.collect_glob, RunLayout.at(self.run_dir), ranks={rank},
                                         attempt=restart_attempt()))

    def checkpoint(self) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self)


def run_program(argv: list[str]) -> int:
    """Run `[-m] program args...` in this process as `python` would (`__main__`, sys.argv); its exit status."""
    import runpy
    import sys

    module = argv[0] == "-m"
    program, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [program, *args]
    # as `python script.py` puts the script's folder first on sys.path, and `python -m` the working directory
    sys.path.insert(0, os.getcwd() if module else str(Path(program).parent))
    try:
        if module:
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program, run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def run_program_checked(argv: list[str], *, allowed: tuple[int, ...]) -> int:
    """run_program, with an exit status outside `allowed` raised (so that `@record` files it)."""
    code = run_program(argv)
    if code not in allowed:
        raise RuntimeError(f"{shell_join(argv)} exited with status {code}")
    return code


def run_trainer_rank(trainer_argv: list[str], rank: int) -> Any:
    """The trainer's rank in this process, as `python -m fleetscope.trainer` runs it (its log format, its
    error file through `@record`), returning the RankOutcome (the stop reason decides a requeue)."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import record

    from ...trainer.config import parse_train_args
    from ...trainer.entry import run_rank

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    return record(run_rank)(parse_train_args(trainer_argv))


def requeue_this_job() -> None:
    """Requeue the running Slurm job (after a notice, with the checkpoint saved), within MAX_NOTICE_REQUEUES."""
    job_id = os.environ["SLURM_JOB_ID"]  # an array task's own id, too
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restarts >= MAX_NOTICE_REQUEUES:
        raise RuntimeError(f"job {job_id} stopped on a time-limit notice after {restarts} requeues; not requeued "
                           f"again (checkpoint saved: resubmit to go on)")
    try:
        requeue_job(job_id)
    except RuntimeError as error:
        raise RuntimeError(f"job {job_id}: `scontrol requeue` failed after a time-limit notice (checkpoint saved: "
                           f"resubmit to go on): {error}") from None


def executor_parameters(spec: JobSpec, resources: SlurmResources) -> dict[str, Any]:
    """`SlurmExecutor.update_parameters` keywords (submitit quotes every value in `#SBATCH` lines)."""
    parameters: dict[str, Any] = {
        "job_name": resources.job_name,
        "nodes": resources.nodes,
        "ntasks_per_node": resources.nproc_per_node,
        "time": resources.time_minutes,
        "signal_delay_s": TIME_LIMIT_SIGNAL_SECONDS,
        "setup": [*MASTER_PORT_LINES, "# environment of every rank", *export_lines(spec.rank_environment())],
        "srun_args": ["--kill-on-bad-exit=1"],
        "additional_parameters": {"requeue": True, **{option.key: option.value if option.value is not None
                                                      else True for option in resources.extra}},
    }
    optional = {"gpus_per_node": resources.gpus_per_node, "cpus_per_task": resources.cpus_per_task,
                "mem": resources.mem_per_node, "partition": resources.partition, "account": resources.account,
                "qos": resources.qos}
    parameters.update({name: value for name, value in optional.items() if value})
    return parameters


def submitit_command(python: str, folder: str) -> str:
    """The command submitit puts after srun (its `_submitit_command_str`)."""
    return " ".join([python, SUBMIT_MODULE_COMMAND, shlex.quote(folder)])


def plan_submitit(spec: JobSpec, *, postprocess: bool = True) -> SubmititPlan:
    from submitit.slurm.slurm import _make_sbatch_string

    resources = SlurmResources.from_spec(spec)
    folder = slurm_logs_dir(spec)
    python = shlex.quote(spec.python)
    parameters = executor_parameters(spec, resources)
    script = _make_sbatch_string(command=submitit_command(python, folder), folder=folder, **parameters)
    run_dir = str(RunLayout.at(spec.train.run_dir).root)
    rank_task: SubmititRank | SubmititUserRank
    if spec.entry is not None:
        rank_task = SubmititUserRank(argv=spec.entry.argv(), workdir=spec.entry.workdir, run_dir=run_dir,
                                     collect_glob=spec.entry.collect_glob)
    else:
        rank_task = SubmititRank(trainer_argv=train_argv(spec.train), run_dir=run_dir)
    return SubmititPlan(spec=spec, folder=folder, python=python, parameters=parameters, rank_task=rank_task,
                        sbatch_script=script,
                        postprocess=plan_postprocess_job(spec, resources) if postprocess else None,
                        run_dir=RunLayout.at(spec.train.run_dir).root)


def submit_submitit(plan: SubmititPlan) -> SubmittedSlurmJob:
    """Submit the training job (through submitit) and its post-processing job."""
    import submitit

    Path(plan.folder).mkdir(parents=True, exist_ok=True)
    executor = submitit.SlurmExecutor(folder=plan.folder, python=plan.python, max_num_timeout=MAX_NOTICE_REQUEUES)
    executor.update_parameters(**plan.parameters)
    job = executor.submit(plan.rank_task)
    postprocess_id = (submit_postprocess(plan.postprocess, str(job.job_id), Path(plan.folder))
                      if plan.postprocess else "")
    return SubmittedSlurmJob(job_id=str(job.job_id), postprocess_job_id=postprocess_id,
                             script_path=str(job.paths.submission_file))


class SubmititScheduler(SlurmScheduler):
    name = "submitit"

    def plan(self, spec: JobSpec, *, postprocess: bool = True) -> SubmititPlan:
        return plan_submitit(spec, postprocess=postprocess)

    def submit_training(self, plan: SubmititPlan) -> SubmittedSlurmJob:
        return submit_submitit(plan)
