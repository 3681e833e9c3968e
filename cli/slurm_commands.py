"""`fleetscope launch --scheduler submitit|torchx`, and `status`, `logs`, `cancel` of a Slurm run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launcher.jobrecord import now_iso, read_job_record, write_job_record
from ..launcher.slurm_jobs import SlurmJobStatus, cancel_jobs, wait_for_job
from ..launcher.slurm_launch import plan_slurm, submit_slurm
from ..launcher.slurm_status import SlurmRunStatus, log_files, run_status
from ..launcher.spec import JobSpec
from ..traces.layout import RunLayout

EXIT_OK, EXIT_FAILED, EXIT_PARTIAL = 0, 1, 3


def launch_on_slurm(spec: JobSpec, args: argparse.Namespace) -> int:
    from .commands import refuse_existing_run

    plan = plan_slurm(spec, postprocess=not args.no_post)
    if args.dry_run:
        print(plan.render())
        return EXIT_OK
    layout = RunLayout.at(spec.train.run_dir)
    refuse_existing_run(layout, resume=args.resume)
    submitted = submit_slurm(spec, plan)
    after = (f"post-processing job {submitted.postprocess_job_id} runs after it" if submitted.postprocess_job_id
             else "no post-processing job (--no-post)")
    print(f"fleetscope: submitted Slurm job {submitted.job_id} ({spec.scheduler}, {spec.nodes} node(s) x "
          f"{spec.nproc_per_node}); {after}")
    print(f"  run directory: {layout.root}")
    print(f"  follow it:     fleetscope status {layout.root}   |   fleetscope logs {layout.root}")
    if not getattr(args, "wait", False):
        return EXIT_OK
    return wait_and_report(layout)


def wait_and_report(layout: RunLayout) -> int:
    """Wait for the training job and then its post-processing job; print the outcome."""
    record = read_job_record(layout)
    training = wait_for_job(record["job_id"], on_change=_print_state("job"))
    postprocess_id = record.get("postprocess_job_id")
    if postprocess_id:
        wait_for_job(postprocess_id, on_change=_print_state("post-processing"))
    status = run_status(layout.root)
    record_status(layout, status)
    print(render_status(status))
    if not training.succeeded:
        return EXIT_FAILED
    return EXIT_OK if "merged_trace" in status.outputs else EXIT_PARTIAL


def _print_state(label: str):
    def show(status: SlurmJobStatus) -> None:
        print(f"fleetscope: {label} {status.job_id}: {status.state}", flush=True)
    return show


def record_status(layout: RunLayout, status: SlurmRunStatus) -> None:
    write_job_record(layout, status=status.state.lower(), slurm=status.to_json(), checked_at=now_iso())


def render_status(status: SlurmRunStatus) -> str:
    training = status.training
    lines = [f"run:       {status.run_dir}", f"scheduler: {status.scheduler}, Slurm job {status.job_id}"]
    if training is None:
        lines.append("state:     UNKNOWN (neither slurmctld nor accounting knows the job)")
    else:
        restarts = f", requeued {training.restarts} time(s)" if training.restarts else ""
        lines.append(f"state:     {training.state} (exit code {training.exit_code}{restarts}; from {training.source})")
        lines += [f"  {c.job_id}: {c.state} exit {c.exit_code} on {c.nodes or '-'}" for c in training.components
                  if len(training.components) > 1]
    if status.postprocess is not None:
        lines.append(f"post-processing job {status.postprocess_job_id}: {status.postprocess.state}")
    lines += _failure_lines(status)
    lines += [f"{name + ':':<14}{path}" for name, path in status.outputs.items()]
    return "\n".join(lines)


def _failure_lines(status: SlurmRunStatus) -> list[str]:
    if not status.failures:
        return []
    first, *others = status.failures
    exit_code = f" (exit {first.exitcode})" if first.exitcode is not None else ""
    message = first.message.splitlines()[0] if first.message else "no error message"
    lines = [f"failed first: rank {first.rank}{exit_code}: {message}"]
    if first.log_path:
        lines.append(f"  log: {first.log_path}")
    if others:
        lines.append("then failed: " + ", ".join(f"rank {f.rank}" for f in others))
    return lines


def register_status(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("status", help="state of a run submitted to Slurm, and which rank failed first")
    parser.add_argument("run_dir")
    parser.set_defaults(handler=handle_status)


def handle_status(args: argparse.Namespace) -> int:
    layout = RunLayout.at(args.run_dir)
    status = run_status(layout.root)
    record_status(layout, status)
    print(render_status(status))
    return EXIT_FAILED if status.failures or status.state not in ("COMPLETED", "PENDING", "RUNNING") else EXIT_OK


def register_logs(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("logs", help="the scheduler's and the ranks' logs of a Slurm run")
    parser.add_argument("run_dir")
    parser.add_argument("--tail", type=int, default=20, help="last lines of each log (0: list the files only)")
    parser.set_defaults(handler=handle_logs)


def handle_logs(args: argparse.Namespace) -> int:
    files = log_files(RunLayout.at(args.run_dir))
    if not files:
        print(f"no logs yet under {RunLayout.at(args.run_dir).logs_dir}", file=sys.stderr)
        return EXIT_FAILED
    for path in files:
        print(f"==> {path} <==")
        if args.tail > 0:
            print("\n".join(Path(path).read_text(errors="replace").splitlines()[-args.tail:]))
    return EXIT_OK


def register_cancel(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("cancel", help="cancel a run's Slurm jobs (training and post-processing)")
    parser.add_argument("run_dir")
    parser.add_argument("--no-postprocess", action="store_true",
                        help="cancel the post-processing job too (by default it still gathers, analyzes and "
                             "merges whatever the cancelled job wrote)")
    parser.set_defaults(handler=handle_cancel)


def handle_cancel(args: argparse.Namespace) -> int:
    layout = RunLayout.at(args.run_dir)
    record = read_job_record(layout)
    job_ids = [str(record.get("job_id") or "")]
    if args.no_postprocess:
        job_ids.append(str(record.get("postprocess_job_id") or ""))
    if not job_ids[0]:
        raise ValueError(f"{layout.job_file}: no Slurm job id recorded")
    cancel_jobs(job_ids)
    write_job_record(layout, status="cancelled", cancelled_at=now_iso())
    print(f"fleetscope: cancelled Slurm job(s) {' '.join(j for j in job_ids if j)}")
    return EXIT_OK


REGISTRY = [register_status, register_logs, register_cancel]
