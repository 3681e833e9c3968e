"""JobSpec: everything needed to start a training job, validated before anything runs."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Literal

from ..traces import cupti
from ..traces.launch_env import user_environment
from ..traces.validate import world_size_problem
from ..trainer.config import TrainConfig, check_degrees, check_fault_ranks, require, train_argv
from .untrusted import require_plain_fields, require_plain_text, require_plain_value

TRAINER_MODULE = "fleetscope.trainer"
"""What every rank runs unless the job names the user's own program (UserEntry)."""

Scheduler = Literal["local", "submitit", "torchx", "torchx_local"]
SCHEDULERS: tuple[str, ...] = typing.get_args(Scheduler)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Variables every rank needs to run safely on shared multi-GPU hosts (NVLink multicast off).
DEFAULT_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmOptions:
    """Options for the Slurm schedulers (submitit, torchx); ignored by the local scheduler."""

    job_name: str = "fleetscope"
    """Slurm job name (any text: it is quoted wherever it reaches a shell)."""
    partition: str = ""
    """Partition to submit to; empty: the cluster default."""
    time_minutes: int = 60
    """Wall-time limit."""
    account: str = ""
    """Account to charge."""
    qos: str = ""
    """Quality of service."""
    cpus_per_task: int = 0
    """CPUs per task; 0: the cluster default."""
    mem_per_node: str = ""
    """Memory per node, e.g. 200G; empty: the cluster default."""
    gpus_per_node: int | None = None
    """GPUs to request per node; None: one per process (nproc_per_node) when training on CUDA."""
    extra_sbatch: tuple[str, ...] = ()
    """Further `#SBATCH` options, e.g. ("--exclusive", "--constraint=h200")."""

    def __post_init__(self) -> None:
        require(self.time_minutes >= 1, "slurm.time_minutes", f"must be >= 1, got {self.time_minutes}")
        require(self.cpus_per_task >= 0, "slurm.cpus_per_task", "must be >= 0")
        require(bool(self.job_name.strip()), "slurm.job_name", "must not be empty")
        require(all(option.startswith("--") for option in self.extra_sbatch), "slurm.extra_sbatch",
                 "every option must start with --")
        require_plain_fields(self, prefix="slurm.")


@dataclass(frozen=True, kw_only=True, slots=True)
class UserEntry:
    """The user's own training program, run on every rank instead of fleetscope's trainer
    (`fleetscope launch ... -- python train.py ARGS` or `-- -m package.module ARGS`)."""

    program: str
    """An absolute script path, or a module name when `module` is set."""
    module: bool = False
    """`program` is a module (`python -m program`)."""
    args: tuple[str, ...] = ()
    """The program's own arguments, passed through unchanged (quoted wherever they reach a shell)."""
    workdir: str
    """The directory every rank starts the program in (where `launch` ran): relative paths of the
    program and of `collect_traces` mean the same on every scheduler."""
    collect_traces: str = ""
    """A glob of Kineto traces the program writes itself (e.g. torchtitan's
    `outputs/profiling/traces/iteration_*/rank*_trace.json.gz`), filed into the run directory after the job
    on each node; relative to `workdir`. Empty: none."""

    def __post_init__(self) -> None:
        require(bool(self.program.strip()), "entry.program", "must name a script or a module")
        require(not self.program.startswith("-"), "entry.program",
                f"{self.program!r} is an option, not a script or module (python options are not passed)")
        require(self.module or Path(self.program).is_absolute(), "entry.program",
                f"script paths are absolute in a job spec, got {self.program!r}")
        require(Path(self.workdir).is_absolute(), "entry.workdir", f"must be absolute, got {self.workdir!r}")
        require_plain_fields(self, prefix="entry.")

    def argv(self) -> list[str]:
        """What follows the launcher's own flags (torchrun's, or python's)."""
        return [*(["-m"] if self.module else []), self.program, *self.args]

    @property
    def collect_glob(self) -> str:
        """`collect_traces` as an absolute pattern ("" when none)."""
        if not self.collect_traces:
            return ""
        return str(Path(self.workdir) / self.collect_traces)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    train: TrainConfig
    """What every rank runs (its run_dir is the job's run directory)."""
    scheduler: Scheduler = "local"
    """local (torchrun on this node), submitit or torchx (Slurm), torchx_local (TorchX's local_cwd on this node)."""
    nodes: int = 1
    """Nodes to run on."""
    nproc_per_node: int = 2
    """Processes per node (one per GPU on GPU nodes)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment passed to every rank (NCCL_*, TORCHINDUCTOR_CACHE_DIR, ...)."""
    python: str = sys.executable
    """Python interpreter on the nodes (with fleetscope installed)."""
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    entry: UserEntry | None = None
    """The user's own program on every rank; None: fleetscope's trainer (`train` configures it)."""

    def __post_init__(self) -> None:
        require(self.scheduler in SCHEDULERS, "scheduler", f"must be one of {SCHEDULERS}, got {self.scheduler!r}")
        require(self.nodes >= 1, "nodes", f"must be >= 1, got {self.nodes}")
        require(self.nproc_per_node >= 1, "nproc_per_node", f"must be >= 1, got {self.nproc_per_node}")
        require(world_size_problem(self.world_size) is None, "nodes x nproc_per_node",
                str(world_size_problem(self.world_size)))
        require(self.scheduler not in ("local", "torchx_local") or self.nodes == 1, "nodes",
                 f"the {self.scheduler} scheduler runs on this node only; use submitit or torchx for several nodes")
        if self.entry is None:
            check_degrees(self.train.parallel, self.world_size)
            check_fault_ranks(self.train.faults, self.world_size)
        for name in self.env:
            require(isinstance(name, str) and bool(_ENV_NAME.match(name)), "env", f"{name!r} is not a valid environment variable name")
        require(bool(self.python), "python", "must not be empty")
        # Everything below reaches command lines, batch scripts, AppDefs, environments or paths.
        require_plain_fields(self.train)
        require_plain_value(self.env, "env")
        require_plain_text(self.python, "python")
        check_command_size([self.python, *self.rank_program()], self.rank_environment())

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def rank_environment(self) -> dict[str, str]:
        """Environment added for every rank: safety defaults, the allocator setting, CUPTI teardown after each
        window (traces/cupti.py), the user's (which wins)."""
        environment = dict(DEFAULT_ENV)
        if self.train.performance.alloc_conf:
            environment["PYTORCH_ALLOC_CONF"] = self.train.performance.alloc_conf
        if self.entry is not None:
            environment.update(user_environment(run_dir=self.train.run_dir, scheduler=self.scheduler,
                                                schedule=dataclasses.asdict(self.train.profiler)))
        profiler = self.train.profiler
        environment.update(cupti.launcher_environment(enabled=profiler.cupti_teardown,
                                                      windows_apart=profiler.windows_apart, user_env=self.env))
        environment.update(self.env)
        return environment

    def rank_program(self) -> list[str]:
        """What every rank runs, after the launcher's own flags: `-m fleetscope.trainer FLAGS`, or the
        user's program and its arguments."""
        if self.entry is not None:
            return self.entry.argv()
        return ["-m", TRAINER_MODULE, *train_argv(self.train)]


USER_PROGRAM_TRAIN_FIELDS = ("run_dir", "profiler")
"""What of the trainer's configuration a user program's run uses: where it writes, the profiler schedule its
ranks follow (trainer/user_profiling.py), and of `performance` the device (Slurm's GPU request) and the
allocator setting (its ranks' environment). The rest configures fleetscope's trainer, which did not run."""


def spec_record(spec: JobSpec) -> dict[str, Any]:
    """The resolved spec as job.json records it, with the world size readers (gather) rely on. A user
    program's record holds the program, its arguments, the environment contract of its ranks and the
    profiler settings, never a trainer configuration that did not run."""
    fields = dataclasses.asdict(spec)
    record: dict[str, Any] = {"spec": fields, "world_size": spec.world_size, "scheduler": spec.scheduler}
    if spec.entry is not None:
        train = fields["train"]
        fields["train"] = {name: train[name] for name in USER_PROGRAM_TRAIN_FIELDS}
        fields["train"]["performance"] = {"device": spec.train.performance.device,
                                          "alloc_conf": spec.train.performance.alloc_conf}
        record["program"] = {"argv": spec.rank_program(), "environment": spec.rank_environment()}
    return record


MAX_ARGUMENT_BYTES = 131072 - 1
"""Linux's limit on one argument or one NAME=VALUE environment string (MAX_ARG_STRLEN, 32 pages): a longer
one makes exec fail with "Argument list too long"."""
MAX_COMMAND_BYTES = 1 << 20
"""The whole argument list plus environment a rank's command may take: well under Linux's usual ARG_MAX
(2 MiB and up), with room for the scheduler's own variables."""


def check_command_size(argv: list[str], env: dict[str, str]) -> None:
    """Refuse, at plan time, a command that exec would refuse after the run was recorded as started."""
    for word in argv:
        size = len(word.encode("utf-8", "surrogateescape"))
        if size > MAX_ARGUMENT_BYTES:
            require(False, "command", f"an argument of the rank command is {size:,} bytes (starts {word[:40]!r}); "
                           f"exec refuses one over {MAX_ARGUMENT_BYTES + 1:,}")
    for name, value in env.items():
        size = len(f"{name}={value}".encode("utf-8", "surrogateescape"))
        if size > MAX_ARGUMENT_BYTES:
            require(False, "environment", f"environment variable {name} is {size:,} bytes; exec refuses one over "
                           f"{MAX_ARGUMENT_BYTES + 1:,}")
    total = sum(len(w.encode("utf-8", "surrogateescape")) + 1 for w in argv) + sum(
        len(n.encode("utf-8", "surrogateescape")) + len(v.encode("utf-8", "surrogateescape")) + 2 for n, v in env.items())
    require(total <= MAX_COMMAND_BYTES, "command", f"the rank command and its environment take {total:,} bytes; "
                                         f"at most {MAX_COMMAND_BYTES:,} are allowed")
