"""What the Slurm schedulers (submitit, TorchX) share: validated options, quoting, the
environment every rank gets, and the post-processing job that runs after the training job.

Everything here is pure: it builds text and argument lists, it never runs a Slurm command.

Quoting rules (every user string is untrusted):
  * values in `#SBATCH` lines are `shlex.quote`d (sbatch honours shell quoting there);
  * no value may contain a control character (launcher/untrusted.py, checked when the JobSpec is built):
    a newline would end the `#SBATCH` comment and turn the rest of the value into a shell command;
  * names Slurm itself interprets without quoting (partition, account, qos, TorchX's job names) must match
    a conservative alphabet; anything else is refused with a message that names the field.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from ..trainer.config import ConfigError
from ..traces.layout import RunLayout
from ..traces.layout import slurm_logs_dir as layout_slurm_logs_dir
from .spec import JobSpec
from .untrusted import require_plain_text

POSTPROCESS_MODULE = "fleetscope.cli.main"
"""`python -m fleetscope.cli.main postprocess RUN_DIR`: gather + analyze + merge."""
TIME_LIMIT_SIGNAL_SECONDS = 90
"""submitit asks Slurm for USR2 this long before the time limit (`--signal=USR2@90`); it then requeues."""

_NAME_ALPHABET = re.compile(r"^[A-Za-z0-9_.+:-]+\Z")
_SBATCH_OPTION = re.compile(r"^--(?P<key>[a-z][a-z0-9-]*)(?:=(?P<value>.*))?$", re.DOTALL)
_MEMORY = re.compile(r"^[0-9]+[KMGT]?\Z")
# Options the plan sets itself: an extra option must not silently contradict it.
_OWNED_SBATCH_OPTIONS = frozenset({
    "nodes", "ntasks-per-node", "ntasks", "output", "error", "job-name", "partition", "time", "account", "qos",
    "cpus-per-task", "mem", "gpus-per-node", "dependency", "requeue", "no-requeue", "signal", "open-mode",
})


def require_slurm_name(value: str, field_name: str) -> str:
    """A partition/account/qos-like name: letters, digits and _ . + : - only."""
    if not _NAME_ALPHABET.match(value):
        raise ConfigError(f"{field_name}: {value!r} is not a Slurm name (letters, digits, _ . + : - only)")
    return value


def safe_job_label(job_name: str) -> str:
    """The job name reduced to the name alphabet, for places that do not quote (TorchX role names)."""
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", job_name).strip("_.-")
    return label or "fleetscope"


@dataclass(frozen=True)
class SbatchOption:
    """One extra `--key[=value]` sbatch option, split and validated."""

    key: str
    value: str | None

    @classmethod
    def parse(cls, text: str) -> "SbatchOption":
        require_plain_text(text, "slurm.extra_sbatch")
        match = _SBATCH_OPTION.match(text)
        if match is None:
            raise ConfigError(f"slurm.extra_sbatch: {text!r} is not of the form --name or --name=value")
        if match["key"] in _OWNED_SBATCH_OPTIONS:
            raise ConfigError(f"slurm.extra_sbatch: --{match['key']} is set by its own flag or by the launcher")
        return cls(key=match["key"], value=match["value"])

    def argument(self) -> str:
        """`--key=value` with the value shell-quoted (for `#SBATCH` lines and sbatch command lines)."""
        if self.value is None:
            return f"--{self.key}"
        return f"--{self.key}={shlex.quote(self.value)}"


@dataclass(frozen=True, kw_only=True)
class SlurmResources:
    """The scheduler-independent part of a Slurm request, validated from a JobSpec."""

    job_name: str
    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    mem_per_node: str
    time_minutes: int
    partition: str
    account: str
    qos: str
    extra: tuple[SbatchOption, ...]

    @classmethod
    def from_spec(cls, spec: JobSpec) -> "SlurmResources":
        options = spec.slurm
        for field_name in ("partition", "account", "qos"):
            value = getattr(options, field_name)
            if value:
                require_slurm_name(value, f"slurm.{field_name}")
        if options.mem_per_node and not _MEMORY.match(options.mem_per_node):
            raise ConfigError(f"slurm.mem_per_node: {options.mem_per_node!r} is not like 200G, 4096M or 8000")
        return cls(
            job_name=options.job_name,
            nodes=spec.nodes,
            nproc_per_node=spec.nproc_per_node,
            gpus_per_node=gpus_per_node(spec),
            cpus_per_task=options.cpus_per_task,
            mem_per_node=options.mem_per_node,
            time_minutes=options.time_minutes,
            partition=options.partition,
            account=options.account,
            qos=options.qos,
            extra=tuple(SbatchOption.parse(text) for text in options.extra_sbatch),
        )


def gpus_per_node(spec: JobSpec) -> int:
    """GPUs to request per node: as given, else one per process unless the job trains on CPU."""
    if spec.slurm.gpus_per_node is not None:
        if spec.slurm.gpus_per_node < 0:
            raise ConfigError(f"slurm.gpus_per_node: must be >= 0, got {spec.slurm.gpus_per_node}")
        return spec.slurm.gpus_per_node
    return 0 if spec.train.performance.device == "cpu" else spec.nproc_per_node


def export_lines(environment: dict[str, str]) -> list[str]:
    """`export NAME=value` lines, values shell-quoted, in a stable order."""
    return [f"export {name}={shlex.quote(value)}" for name, value in sorted(environment.items())]


def slurm_logs_dir(spec: JobSpec) -> str:
    """Scheduler logs go to <run>/logs/slurm/ (per-rank logs of the trainer sit beside them)."""
    return str(layout_slurm_logs_dir(RunLayout.at(spec.train.run_dir)))


def shell_join(argv: list[str]) -> str:
    return " ".join(shlex.quote(arg) for arg in argv)


@dataclass(frozen=True, kw_only=True)
class PostprocessJob:
    """A one-task job that gathers, analyzes and merges the run once the training job has ended
    (`--dependency=afterany:<training job>`: after success, failure, cancellation or time-out; a requeued
    training job is not over, so it waits for the last attempt)."""

    script: str
    sbatch_argv: list[str]
    """`sbatch ...` without the dependency (added at submission) and without the script path."""

    def render(self, training_job_id: str = "<TRAINING_JOB_ID>", script_path: str = "<POSTPROCESS_SCRIPT>") -> str:
        return shell_join(self._argv(training_job_id, script_path))

    def argv(self, training_job_id: str, script_path: str) -> list[str]:
        if not re.fullmatch(r"[0-9]+", training_job_id):
            raise ValueError(f"not a Slurm job id: {training_job_id!r}")
        return self._argv(training_job_id, script_path)

    def _argv(self, training_job_id: str, script_path: str) -> list[str]:
        return [*self.sbatch_argv, f"--dependency=afterany:{training_job_id}", script_path]


def plan_postprocess_job(spec: JobSpec, resources: SlurmResources) -> PostprocessJob:
    run_dir = str(RunLayout.at(spec.train.run_dir).root)
    logs = slurm_logs_dir(spec)
    script = "\n".join([
        "#!/bin/bash",
        "# Written by fleetscope: gather + analyze + merge the run once its training job has ended.",
        f"exec {shell_join([spec.python, '-m', POSTPROCESS_MODULE, 'postprocess', run_dir])}",
        "",
    ])
    argv = ["sbatch", "--parsable", f"--job-name={resources.job_name}-postprocess", "--nodes=1", "--ntasks=1",
            f"--time={resources.time_minutes}", f"--output={logs}/postprocess-%j.out"]
    named = (("partition", resources.partition), ("account", resources.account), ("qos", resources.qos),
             ("mem", resources.mem_per_node))
    argv += [f"--{name}={value}" for name, value in named if value]
    return PostprocessJob(script=script, sbatch_argv=argv)


def render_postprocess(postprocess: PostprocessJob | None) -> list[str]:
    """The dry-run lines of the post-processing job (or of its absence)."""
    if postprocess is None:
        return ["# no post-processing job (--no-post): run `fleetscope postprocess RUN_DIR` after the job"]
    return ["# then, after the training job has ended (any outcome):", postprocess.render(), "# with the script:",
            postprocess.script]
