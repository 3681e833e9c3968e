"""`fleetscope status`, `logs`, `cancel` of a run directory (its scheduler comes from its job.json)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..launcher.runs import cancel_run, log_files, run_status, scheduler_of_run
from ..traces.fanout import fanout_states
from ..traces.layout import RunLayout
from ..traces.flight_recorder import read_dumps
from .exit_codes import EXIT_FAILED, EXIT_OK, exit_code
from .terminal_text import escape_controls
from ..launcher.progress import run_progress
from ..traces.jobfile import FINAL_STATUSES, read_job_record
from .render import render_fanouts, render_progress, render_status


def register_status(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("status", help="state of a run (Slurm: asked live), which rank failed first, and "
                            "what each parse fan-out has done")
    parser.add_argument("run_dir", help="the run directory")
    parser.set_defaults(handler=handle_status)


def handle_status(args: argparse.Namespace) -> int:
    status = run_status(args.run_dir)
    print(escape_controls(render_status(status)))
    layout = RunLayout.at(args.run_dir)
    recorded = read_job_record(layout).get("status")
    for line in render_progress(run_progress(layout, recorded_steps(layout)), ended=recorded in FINAL_STATUSES,
                                succeeded=recorded == "succeeded", run_dir=args.run_dir,
                                hang_timeout_s=recorded_hang_timeout(layout),
                                stopped_in={m.rank: m.step for m in read_dumps(layout).markers}):
        print(line)
    for line in render_fanouts(layout, fanout_states(layout)):
        print(line)
    return exit_code(status.verdict)


def recorded_steps(layout: RunLayout) -> int | None:
    """The steps the run was launched for (job.json spec.train.steps); None where the record does not say."""
    spec = read_job_record(layout).get("spec")
    train = spec.get("train") if isinstance(spec, dict) else None
    steps = train.get("steps") if isinstance(train, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def recorded_hang_timeout(layout: RunLayout) -> float | None:
    """The run's observability.hang_timeout_s (job.json spec.train); None where the record does not say."""
    spec = read_job_record(layout).get("spec")
    train = spec.get("train") if isinstance(spec, dict) else None
    observability = train.get("observability") if isinstance(train, dict) else None
    value = observability.get("hang_timeout_s") if isinstance(observability, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def register_logs(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("logs", help="the scheduler's and the ranks' logs of a run")
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("--tail", type=non_negative_int, default=20,
                        help="last lines of each log (0: list the files only; default: 20)")
    parser.set_defaults(handler=handle_logs)


def int_at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an integer of at least `minimum` (and at most `maximum` when given), or a usage
    error saying so."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {value}")
        return value

    return parse


non_negative_int = int_at_least(0)


def handle_logs(args: argparse.Namespace) -> int:
    scheduler_of_run(RunLayout.at(args.run_dir))  # a directory that is not a run is a usage error
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
    parser = sub.add_parser("cancel", help="cancel a run: its Slurm jobs (training and post-processing), or a "
                                           "local run's torchrun")
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("--no-postprocess", action="store_true",
                        help="cancel the post-processing job too (by default it still gathers, analyzes and "
                             "merges whatever the cancelled job wrote)")
    parser.set_defaults(handler=handle_cancel)


def handle_cancel(args: argparse.Namespace) -> int:
    cancelled = cancel_run(args.run_dir, postprocess_too=args.no_postprocess)
    if scheduler_of_run(RunLayout.at(args.run_dir)).name == "local":
        print(f"fleetscope: stopping the local run: SIGTERM sent to {' '.join(cancelled)}; its launch records "
              "'cancelled' once its ranks have stopped")
    else:
        print(f"fleetscope: cancelled Slurm job(s) {' '.join(cancelled)}")
    return EXIT_OK


REGISTRY = [register_status, register_logs, register_cancel]
