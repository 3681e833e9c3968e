"""Command-line flags of `fleetscope launch` / `demo` and their mapping onto JobSpec."""

from __future__ import annotations

import argparse
import re
from datetime import datetime
from pathlib import Path

from ..launcher.spec import SCHEDULERS, JobSpec, SlurmOptions
from ..launcher.untrusted import require_plain_text
from ..trainer.config import ConfigError, TrainConfig, add_train_arguments, apply_overrides, train_assignments

_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job")
    job.add_argument("--scheduler", choices=SCHEDULERS, default="local")
    job.add_argument("--nodes", type=int, default=1)
    job.add_argument("--nproc-per-node", type=int, default=2, help="processes (GPUs) per node")
    job.add_argument("--run-dir", default=None, help="run directory (default: RUNS_ROOT/<model>-<mode>-<time>)")
    job.add_argument("--runs-root", default="runs", help="where new run directories are created")
    job.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="environment for every rank (repeatable)")
    job.add_argument("--python", default=None, help="python on the nodes (default: this interpreter)")
    add_train_arguments(parser.add_argument_group("training (any field: --set section.field=value)"))
    slurm = parser.add_argument_group("slurm (submitit, torchx)")
    slurm.add_argument("--job-name", default=None)
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", dest="time_minutes", type=int, default=None, help="minutes")
    slurm.add_argument("--account", default=None)
    slurm.add_argument("--qos", default=None)
    slurm.add_argument("--cpus-per-task", type=int, default=None)
    slurm.add_argument("--mem", dest="mem_per_node", default=None, help="memory per node, e.g. 200G")
    slurm.add_argument("--gpus-per-node", type=int, default=None)
    slurm.add_argument("--sbatch-opt", dest="extra_sbatch", action="append", default=[], metavar="--OPTION=VALUE")


def default_run_dir(runs_root: str, train: TrainConfig) -> Path:
    require_plain_text(runs_root, "runs_root")  # named as the flag: the run_dir it makes would be refused
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id = _RUN_ID_UNSAFE.sub("_", f"{train.model.family}-{train.parallel.mode}-{stamp}")
    return Path(runs_root).expanduser().absolute() / run_id


def train_config_from_args(args: argparse.Namespace, run_dir: str) -> TrainConfig:
    return apply_overrides(TrainConfig(run_dir=run_dir), train_assignments(args))


def job_spec_from_args(args: argparse.Namespace) -> JobSpec:
    """The JobSpec the flags describe; a ConfigError names the first bad field."""
    provisional = train_config_from_args(args, run_dir=args.run_dir or "pending")
    run_dir = Path(args.run_dir).expanduser().absolute() if args.run_dir else default_run_dir(args.runs_root,
                                                                                             provisional)
    train = train_config_from_args(args, run_dir=str(run_dir))
    return JobSpec(
        train=train, scheduler=args.scheduler, nodes=args.nodes, nproc_per_node=args.nproc_per_node,
        env=_parse_env(args.env), slurm=_slurm_options(args),
        **({"python": args.python} if args.python else {}),
    )


def _parse_env(assignments: list[str]) -> dict[str, str]:
    env = {}
    for assignment in assignments:
        name, sep, value = assignment.partition("=")
        if not sep:
            raise ConfigError(f"env: expected NAME=VALUE, got {assignment!r}")
        env[name] = value
    return env


def _slurm_options(args: argparse.Namespace) -> SlurmOptions:
    names = ("job_name", "partition", "time_minutes", "account", "qos", "cpus_per_task", "mem_per_node",
             "gpus_per_node")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return SlurmOptions(**given, extra_sbatch=tuple(args.extra_sbatch))
