"""Command-line flags of `fleetscope launch` / `demo` and their mapping onto JobSpec."""

from __future__ import annotations

import argparse
import os
import re
from datetime import datetime
from pathlib import Path

from ..launcher.spec import SCHEDULERS, JobSpec, SlurmOptions, UserEntry
from ..launcher.untrusted import require_plain_text
from ..traces import cupti
from ..trainer.config import ConfigError, TrainConfig, add_train_arguments, apply_overrides, train_assignments
from .defaults import SLURM_JOB_NAME, SLURM_TIME_MINUTES
from .run_commands import int_at_least

_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_PYTHON_NAME = re.compile(r"^python[0-9.]*$")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job")
    job.add_argument("--scheduler", choices=SCHEDULERS, default="local",
                     help="where the ranks run: local (torchrun on this node), submitit or torchx (Slurm), "
                          "torchx_local (TorchX's local_cwd on this node) (default: local)")
    job.add_argument("--nodes", "--nnodes", dest="nodes", type=int_at_least(1), default=1,
                     help="nodes (torchrun's --nnodes; more than 1 needs submitit or torchx) (default: 1)")
    job.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int_at_least(1),
                     default=None, metavar="N",
                     help="processes per node, one per GPU (default: 1 with local and torchx_local, as torchrun; "
                          "on Slurm it must be given: fleetscope does not guess a node's GPUs)")
    job.add_argument("--run-dir", default=None, help="run directory (default: RUNS_ROOT/<model>-<mode>-<time>)")
    job.add_argument("--runs-root", default="runs", help="where new run directories are created (default: runs)")
    job.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="environment for every rank (repeatable; default: none besides multicast off, above)")
    job.add_argument("--python", default=None, help="python on the nodes (default: this interpreter)")
    add_train_arguments(parser.add_argument_group("training (any field: --set section.field=value)"))
    slurm = parser.add_argument_group("slurm (submitit, torchx)")
    slurm.add_argument("--job-name", default=None, help=f"Slurm job name (default: {SLURM_JOB_NAME})")
    slurm.add_argument("--partition", default=None, help="partition (default: the cluster's default)")
    slurm.add_argument("--time", dest="time_minutes", type=slurm_minutes, default=None, metavar="TIME",
                       help="wall-time limit as sbatch takes it: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                            f"D-HH:MM:SS (seconds round up to a minute) (default: {SLURM_TIME_MINUTES} minutes)")
    slurm.add_argument("--account", default=None, help="account to charge (default: the cluster's default)")
    slurm.add_argument("--qos", default=None, help="quality of service (default: the cluster's default)")
    slurm.add_argument("--cpus-per-task", type=int_at_least(1), default=None, metavar="N",
                       help="CPUs per rank (default: the cluster's default)")
    slurm.add_argument("--mem", dest="mem_per_node", default=None,
                       help="memory per node, e.g. 200G, 4096M (default: the cluster's default)")
    slurm.add_argument("--gpus-per-node", type=int_at_least(0), default=None, metavar="N",
                       help="GPUs to request per node (default: one per process, 0 with --device cpu)")
    slurm.add_argument("--sbatch-opt", dest="extra_sbatch", action="append", default=[], metavar="--OPTION=VALUE",
                       help="a further sbatch option, e.g. --sbatch-opt=--exclusive (repeatable; default: none)")
    own = parser.add_argument_group("your own training program (after --)")
    own.add_argument("--collect-traces", default=None, metavar="GLOB",
                     help="after the job, file the Kineto traces the program wrote itself (torchtitan: "
                          "'outputs/profiling/traces/iteration_*/rank*_trace.json.gz', relative to this directory) "
                          "into the run directory, on every node; files modified before the job started are another run's: "
                          "skipped and counted (default: none)")
    own.add_argument("program", nargs=argparse.REMAINDER, metavar="-- python train.py ARGS | -- -m MODULE ARGS",
                     help="run this on every rank instead of fleetscope's trainer; it gets FLEETSCOPE_RUN_DIR "
                          "and the --profile schedule (fleetscope.trainer.user_profiling reads them)")


def default_run_dir(runs_root: str, train: TrainConfig, entry: UserEntry | None = None) -> Path:
    require_plain_text(runs_root, "runs_root")  # named as the flag: the run_dir it makes would be refused
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = (entry.program.rsplit("/", 1)[-1].removesuffix(".py") if entry is not None
             else f"{train.model.family}-{train.parallel.mode}")
    run_id = _RUN_ID_UNSAFE.sub("_", f"{label}-{stamp}")
    return Path(runs_root).expanduser().absolute() / run_id


def train_config_from_args(args: argparse.Namespace, run_dir: str) -> TrainConfig:
    return apply_overrides(TrainConfig(run_dir=run_dir), train_assignments(args))


def job_spec_from_args(args: argparse.Namespace) -> JobSpec:
    """The JobSpec the flags describe; a ConfigError names the first bad field."""
    provisional = train_config_from_args(args, run_dir=args.run_dir or "pending")
    python, entry = user_entry_from_args(args)
    if entry is not None:
        refuse_trainer_settings(train_assignments(args))
    run_dir = Path(args.run_dir).expanduser().absolute() if args.run_dir else default_run_dir(args.runs_root,
                                                                                             provisional, entry)
    train = train_config_from_args(args, run_dir=str(run_dir))
    return JobSpec(
        train=train, scheduler=args.scheduler, nodes=args.nodes, nproc_per_node=nproc_per_node(args),
        env={**cupti.inherited_setting(os.environ), **_parse_env(args.env)}, slurm=_slurm_options(args), entry=entry,
        **({"python": python} if python else {}),
    )


SLURM_SCHEDULERS = ("submitit", "torchx")


def nproc_per_node(args: argparse.Namespace) -> int:
    """--nproc-per-node as given; else 1 on this node (torchrun's default) and a refusal on Slurm, where a
    guess would silently become a GPU request per node."""
    if args.nproc_per_node is not None:
        return args.nproc_per_node
    if args.scheduler in SLURM_SCHEDULERS:
        raise ConfigError(f"nproc_per_node: --scheduler {args.scheduler} needs --nproc-per-node N (processes per "
                          "node, one per GPU; it also sets the GPUs requested unless --gpus-per-node is given)")
    return 1


_SLURM_TIME = re.compile(r"(?:(?P<days>[0-9]+)-)?(?P<clock>[0-9]+(?::[0-9]+){0,2})")


def slurm_minutes(text: str) -> int:
    """An argparse type: sbatch's --time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) as whole minutes,
    seconds rounded up."""
    match = _SLURM_TIME.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected minutes, HH:MM:SS or D-HH:MM (as sbatch --time), got {text!r}")
    parts = [int(part) for part in match["clock"].split(":")]
    if match["days"] is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
        hours += 24 * int(match["days"])
    elif len(parts) == 3:  # H:M:S
        hours, minutes, seconds = parts
    else:  # M, M:S
        hours, minutes, seconds = 0, parts[0], parts[1] if len(parts) == 2 else 0
    return hours * 60 + minutes + (1 if seconds else 0)


USER_PROGRAM_SETTINGS = ("profiler.", "performance.device=")
"""What applies to a user's program: the profiling schedule, and the device (whether Slurm gets GPUs)."""


def refuse_trainer_settings(assignments: list[str]) -> None:
    """Training flags configure fleetscope's trainer; with a user's program they would silently do nothing."""
    ignored = [a for a in assignments if not a.startswith(USER_PROGRAM_SETTINGS)]
    if ignored:
        raise ConfigError(f"entry: {', '.join(ignored)} configure fleetscope's own trainer, not your program "
                          f"(with a program after --, only --profile / profiler.* and --device apply)")


def user_entry_from_args(args: argparse.Namespace) -> tuple[str | None, UserEntry | None]:
    """(python for the nodes, the user's program) from `-- [python] SCRIPT|-m MODULE ARGS`; a leading
    interpreter word is the nodes' python (`python`/`python3`: --python or this interpreter)."""
    words = list(getattr(args, "program", None) or [])
    python = args.python
    if not words:
        if getattr(args, "collect_traces", None):
            raise ConfigError("entry.collect_traces: --collect-traces needs your program after --")
        return python, None
    if words[0] != "--":
        raise ConfigError(f"entry.program: put your program after `--` (got {words[0]!r})")
    words = [require_plain_text(word, "entry.args") for word in words[1:]]
    if words and _PYTHON_NAME.match(Path(words[0]).name):
        interpreter = words.pop(0)
        if "/" in interpreter:
            if python and python != interpreter:
                raise ConfigError(f"python: --python {python} and the program's interpreter {interpreter} differ")
            python = interpreter
    if not words:
        raise ConfigError("entry.program: nothing to run after `--` (expected SCRIPT ARGS or -m MODULE ARGS)")
    module = words[0] == "-m"
    if module:
        words.pop(0)
        if not words:
            raise ConfigError("entry.program: -m needs a module name")
    if words[0].startswith("-"):
        raise ConfigError(f"entry.program: {words[0]!r} is an option, not a script or module (python options "
                          f"are not passed)")
    program = words[0] if module else str(Path(words[0]).expanduser().absolute())
    entry = UserEntry(program=program, module=module, args=tuple(words[1:]), workdir=str(Path.cwd()),
                      collect_traces=args.collect_traces or "")
    return python, entry


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
