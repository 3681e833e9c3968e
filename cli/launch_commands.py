"""`launch` (a training job, local torchrun or Slurm), `demo` (a small profiled CPU run of it) and `train` (one
rank: what torchrun and srun start on every GPU)."""

from __future__ import annotations

import argparse
import sys

from ..launcher.checks import launch_checks
from ..launcher.runs import LaunchOutcome, launch
from ..launcher.scheduler import LaunchPlan
from ..launcher.schedulers import scheduler_for
from ..launcher.schedulers.slurm import wait_for_run, waited_verdict
from ..launcher.spec import JobSpec
from ..traces.layout import RunLayout
from .exit_codes import EXIT_OK, exit_code
from .jobargs import add_job_arguments, job_spec_from_args
from .pipeline import postprocess
from .render import print_failed_job, print_outputs, print_state_change, print_submitted, render_status
from .run_commands import int_at_least
from .terminal_text import escape_controls


def register_launch(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("launch", help="start a training job (local torchrun or Slurm)",
                            description=LAUNCH_DESCRIPTION)
    add_job_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the exact command; run nothing")
    parser.add_argument("--resume", action="store_true", help="allow an existing run directory (resume)")
    parser.add_argument("--no-postprocess", dest="no_post", action="store_true",
                        help="skip gather/analyze/merge after the job")
    parser.add_argument("--no-post", dest="no_post", action="store_true", help=argparse.SUPPRESS)  # older spelling
    parser.add_argument("--wait", action="store_true",
                        help="Slurm: wait for the job and its post-processing, then print the outcome")
    parser.set_defaults(handler=handle_launch)


LAUNCH_DESCRIPTION = (
    "Start a training job: fleetscope's trainer, or your program after --. Every rank runs with NVLink "
    "multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1: NVLS and "
    "symmetric-memory multicast can fail or hang on shared multi-GPU hosts); --env NAME=VALUE overrides any of them.")


def handle_launch(args: argparse.Namespace) -> int:
    spec = job_spec_from_args(args)
    for note in launch_checks(spec, resume=args.resume):  # the same checks, dry run or not
        print(f"fleetscope: {note}", file=sys.stderr)
    scheduler = scheduler_for(spec.scheduler)
    plan = scheduler.plan(spec, postprocess=not args.no_post)
    if args.dry_run:
        print(plan.render())
        return EXIT_OK
    announce = (lambda: print(f"fleetscope: running {spec.world_size} rank(s) into {plan.run_dir}", flush=True)
                if spec.scheduler == "local" else None)
    outcome = launch(scheduler, plan, resume=args.resume, postprocess=None if args.no_post else postprocess,
                     on_start=announce)
    if outcome.submission.finished:
        print_foreground_outcome(plan, outcome)
        return exit_code(outcome.verdict)
    return report_submission(spec, plan, outcome, wait=args.wait)


def print_foreground_outcome(plan: LaunchPlan, outcome: LaunchOutcome) -> None:
    if not outcome.submission.succeeded:
        print_failed_job(RunLayout.at(plan.run_dir), outcome.submission, post_ran=outcome.post is not None)
    if outcome.post is not None:
        print_outputs(outcome.post.outputs)


def report_submission(spec: JobSpec, plan: LaunchPlan, outcome: LaunchOutcome, *, wait: bool) -> int:
    """A queued job: say where to follow it; with --wait, follow it to the end."""
    layout = RunLayout.at(plan.run_dir)
    print_submitted(outcome.submission, layout, nodes=spec.nodes, nproc_per_node=spec.nproc_per_node)
    if not wait:
        return EXIT_OK
    status = wait_for_run(layout, on_change=print_state_change)
    print(escape_controls(render_status(status)))
    return exit_code(waited_verdict(status))


def register_demo(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="2-rank CPU run of the tiny MoE, profiled, analyzed, merged")
    parser.add_argument("--runs-root", default="runs", help="where the run directory is created (default: runs)")
    parser.add_argument("--model", default="qwen3_moe",
                        help="model family: mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, gpt_oss "
                             "(default: qwen3_moe)")
    parser.add_argument("--parallel", default="fsdp", help="parallel mode: ddp, fsdp, tp, fsdp_tp (default: fsdp)")
    parser.add_argument("--steps", type=int_at_least(1), default=10, metavar="N",
                        help="how many training steps to run (a count; default: 10)")
    parser.set_defaults(handler=handle_demo)


def handle_demo(args: argparse.Namespace) -> int:
    launch_args = build_launch_parser().parse_args([
        "--runs-root", args.runs_root, "--model", args.model, "--preset", "tiny", "--parallel", args.parallel,
        "--steps", str(args.steps), "--nproc-per-node", "2", "--device", "cpu",
        "--profile", "wait=1,warmup=1,active=2,repeat=2",
    ])
    return handle_launch(launch_args)


def build_launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetscope launch")
    sub = parser.add_subparsers()
    register_launch(sub)
    return sub.choices["launch"]


def register_train(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="one rank of a run (what torchrun/srun start on every GPU)",
                            add_help=False)
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER,
                        help="the trainer's flags (`fleetscope train --help` lists them)")
    parser.set_defaults(handler=lambda args: run_trainer(args.trainer_args))


def run_trainer(argv: list[str]) -> int:
    from ..trainer.__main__ import main as trainer_main

    code = trainer_main(argv)
    return EXIT_OK if code is None else code  # None: torch's @record returns it for --help (SystemExit 0)
