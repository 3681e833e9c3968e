"""Planning the parse fan-out of `fleetscope postprocess --slurm` (pure: text and argument lists, no Slurm
command, no file).

A Slurm array job of N tasks parses the run's traces into the parsed-trace cache, task I taking the I-th
contiguous block of ranks (`shard_blocks`, the one rule every side calls: the planner, each task, the
reduce); one reduce job, `--dependency=afterany:<array>`, then builds the report and the merged trace from
the cache. afterany, not afterok: with afterok one failed task would leave the reduce pending forever
(DependencyNeverSatisfied), and no report at all; the reduce instead reads the tasks' records, names each
task that did not complete (its ranks and log) and parses those ranks' traces itself.

Every value reaching a script is `shlex.quote`d and refused if it holds a control character
(untrusted.py); values passed to sbatch as arguments are single argv words (no shell), and paths in sbatch's
filename patterns (`--output`) have their `%` doubled; a backslash, which turns those patterns off, is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..trainer.config import ConfigError
from ..traces.fanout import is_array_job_id
from ..traces.layout import FANOUT_TASK_LOG_PATTERN, RunLayout, fanout_dir, slurm_logs_dir
from .slurm_request import POSTPROCESS_MODULE, SbatchOption, require_slurm_name, shell_join
from .untrusted import require_plain_text

ShardKey = int | str
"""What a shard is made of: a rank, or a trace's label when its rank is unknown."""
DEFAULT_RANKS_PER_TASK = 64
"""Without --array-tasks: one task per this many ranks (a task parses its ranks on its own CPUs)."""
MAX_ARRAY_TASKS = 1000
"""Slurm's default MaxArraySize is 1001 (indices 0..1000); more tasks would be refused by sbatch."""
VISIBILITY_FILE_FORMAT = ".fanout-visible-{token}"
"""Written into the cache directory before submission; every task and the reduce must see it there, or
the directory is not on storage shared with the submitting host."""
_TOKEN = re.compile(r"^[0-9a-f]{8,64}\Z")
_MEMORY = re.compile(r"^[0-9]+[KMGT]?\Z")
_NOT_EXTRA = frozenset({"array", "chdir"})
"""Options an extra must not set besides those slurm_request owns (the array is this plan's)."""


def sorted_keys(keys: Iterable[ShardKey]) -> list[ShardKey]:
    """Ranks in order, then labels of traces without a rank in order; each once."""
    unique = set(keys)
    ranks = sorted(key for key in unique if isinstance(key, int))
    labels = sorted(key for key in unique if isinstance(key, str))
    return [*ranks, *labels]


def shard_blocks(keys: Iterable[ShardKey], tasks: int) -> list[tuple[ShardKey, ...]]:
    """`tasks` contiguous blocks of the sorted keys (fewer when there are fewer keys), sizes differing by
    at most one: every key in exactly one block, the same blocks from the same keys on every node."""
    if tasks < 1:
        raise ValueError(f"tasks must be >= 1, got {tasks}")
    ordered = sorted_keys(keys)
    count = min(tasks, len(ordered))
    if count == 0:
        return []
    size, larger = divmod(len(ordered), count)
    blocks, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < larger else 0)
        blocks.append(tuple(ordered[start:end]))
        start = end
    return blocks


def default_task_count(key_count: int) -> int:
    return max(1, min(MAX_ARRAY_TASKS, math.ceil(key_count / DEFAULT_RANKS_PER_TASK)))


def describe_keys(keys: Iterable[ShardKey]) -> str:
    """`ranks 0-3, 7, 9-12` (ranks as ranges), then labels."""
    ordered = sorted_keys(keys)
    ranks = [key for key in ordered if isinstance(key, int)]
    parts, start = [], None
    for index, rank in enumerate(ranks):
        start = rank if start is None else start
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            parts.append(str(rank) if start == rank else f"{start}-{rank}")
            start = None
    if parts:
        parts[0] = f"rank{'s' if len(ranks) > 1 else ''} {parts[0]}"
    parts += [f"trace {key}" for key in ordered if isinstance(key, str)]
    return ", ".join(parts) if parts else "nothing"


def sbatch_path(path: Path, field_name: str) -> str:
    """A path for an sbatch filename pattern: `%` doubled; a backslash (which disables the patterns) refused."""
    text = require_plain_text(str(path), field_name)
    if "\\" in text:
        raise ConfigError(f"{field_name}: {text!r} holds a backslash, which turns off sbatch's %A/%a log names")
    return text.replace("%", "%%")


@dataclass(frozen=True, kw_only=True)
class FanoutConfig:
    """What `fleetscope postprocess --slurm` asks Slurm for."""

    run_dir: Path
    """The run directory (absolute; on storage every node sees)."""
    cache_dir: Path
    """The parsed-trace cache every task fills and the reduce reads (absolute; shared storage)."""
    python: str
    """The interpreter with fleetscope installed, on every node."""
    array_tasks: int | None = None
    """Tasks of the array; None: one per DEFAULT_RANKS_PER_TASK ranks."""
    max_running: int | None = None
    """At most this many tasks at once (`--array=0-N%M`); None: as many as Slurm starts."""
    job_name: str = "fleetscope"
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_minutes: int = 60
    """Time limit of each task and of the reduce."""
    cpus_per_task: int = 1
    """CPUs of each task (its parse workers) and of the reduce."""
    mem: str = ""
    extra_sbatch: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("run_dir", "cache_dir"):
            path = getattr(self, name)
            if not Path(path).is_absolute():
                raise ConfigError(f"{name}: must be an absolute path (every node resolves it), got {path}")
            sbatch_path(path, name)
        for name in ("python", "job_name"):
            require_plain_text(getattr(self, name), name)
        for name in ("partition", "account", "qos"):
            if getattr(self, name):
                require_slurm_name(getattr(self, name), name)
        if self.mem and not _MEMORY.match(self.mem):
            raise ConfigError(f"mem: {self.mem!r} is not like 200G, 4096M or 8000")
        if self.array_tasks is not None and not 1 <= self.array_tasks <= MAX_ARRAY_TASKS:
            raise ConfigError(f"array_tasks: must be in 1..{MAX_ARRAY_TASKS}, got {self.array_tasks}")
        for name in ("max_running", "time_minutes", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}: must be >= 1, got {value}")
        for option in self.extra_options():
            if option.key in _NOT_EXTRA:
                raise ConfigError(f"slurm.extra_sbatch: --{option.key} is set by the fan-out itself")

    def extra_options(self) -> list[SbatchOption]:
        return [SbatchOption.parse(text) for text in self.extra_sbatch]


@dataclass(frozen=True, kw_only=True)
class FanoutPlan:
    """The array job and the reduce job, ready for sbatch."""

    config: FanoutConfig
    shards: list[tuple[ShardKey, ...]]
    """Task I parses the traces of shards[I]."""
    token: str
    """Names the visibility file in the cache directory (VISIBILITY_FILE_FORMAT)."""
    array_script: str
    array_sbatch: list[str]
    """`sbatch ...` of the array job, without the script path."""

    @property
    def tasks(self) -> int:
        return len(self.shards)

    def reduce_script(self, array_job_id: str) -> str:
        command = [*self._cli("reduce-shards"), "--array-job", _job_id(array_job_id), "--of", str(self.tasks)]
        return _script("reduce the parse fan-out: the report and the merged trace from the cache", command)

    def reduce_sbatch(self, array_job_id: str) -> list[str]:
        """`sbatch ...` of the reduce job, without the script path."""
        job = _job_id(array_job_id)
        logs = sbatch_path(fanout_dir(RunLayout.at(self.config.run_dir), job), "run_dir")
        return ["sbatch", "--parsable", f"--job-name={self.config.job_name}-reduce", "--nodes=1", "--ntasks=1",
                *_resources(self.config), f"--output={logs}/reduce-%j.out", f"--dependency=afterany:{job}"]

    def render(self) -> str:
        """The dry-run text: who parses what, and the exact commands and scripts."""
        lines = [f"# parse fan-out of {self.config.run_dir}: {self.tasks} array task(s), parsed-trace cache "
                 f"{self.config.cache_dir}"]
        lines += [f"#   task {index}: {describe_keys(keys)}" for index, keys in enumerate(self.shards)]
        lines += [shell_join([*self.array_sbatch, "<ARRAY_SCRIPT>"]), "# with the script:", self.array_script,
                  "# then, once every array task has ended (any outcome):",
                  shell_join([*self.reduce_sbatch("<ARRAY_JOB_ID>"), "<REDUCE_SCRIPT>"]), "# with the script:",
                  self.reduce_script("<ARRAY_JOB_ID>")]
        return "\n".join(lines)

    def _cli(self, command: str) -> list[str]:
        config = self.config
        return [config.python, "-m", POSTPROCESS_MODULE, command, str(config.run_dir),
                "--cache-dir", str(config.cache_dir), "--visible", self.token]


def plan_fanout(config: FanoutConfig, keys: Iterable[ShardKey], token: str) -> FanoutPlan:
    """The array job over `keys` (the ranks of the run's traces) and its reduce job."""
    if not _TOKEN.match(token):
        raise ValueError(f"not a visibility token: {token!r}")
    ordered = sorted_keys(keys)
    if not ordered:
        raise ConfigError(f"{config.run_dir}: no traces to parse")
    shards = shard_blocks(ordered, config.array_tasks or default_task_count(len(ordered)))
    plan = FanoutPlan(config=config, shards=shards, token=token, array_script="", array_sbatch=[])
    task_command = [*plan._cli("parse-shard"), "--of", str(len(shards))]
    script = _script("one task of the parse fan-out: its share of the ranks into the parsed-trace cache",
                     task_command, '--shard "$SLURM_ARRAY_TASK_ID" --array-job "$SLURM_ARRAY_JOB_ID"')
    logs = sbatch_path(slurm_logs_dir(RunLayout.at(config.run_dir)), "run_dir")
    throttle = f"%{config.max_running}" if config.max_running else ""
    argv = ["sbatch", "--parsable", f"--job-name={config.job_name}-parse", f"--array=0-{len(shards) - 1}{throttle}",
            "--nodes=1", "--ntasks=1", *_resources(config), f"--output={logs}/{FANOUT_TASK_LOG_PATTERN}"]
    return FanoutPlan(config=config, shards=shards, token=token, array_script=script, array_sbatch=argv)


def _resources(config: FanoutConfig) -> list[str]:
    named = (("partition", config.partition), ("account", config.account), ("qos", config.qos),
             ("mem", config.mem))
    return [f"--cpus-per-task={config.cpus_per_task}", f"--time={config.time_minutes}",
            *(f"--{name}={value}" for name, value in named if value),
            *(_argv_word(option) for option in config.extra_options())]


def _argv_word(option: SbatchOption) -> str:
    """`--key=value` as one argv word (sbatch gets it without a shell, so nothing is quoted here)."""
    return f"--{option.key}" if option.value is None else f"--{option.key}={option.value}"


def _script(purpose: str, argv: list[str], slurm_arguments: str = "") -> str:
    """A batch script that runs one quoted command; `slurm_arguments` is fixed text of this module only."""
    command = shell_join(argv) + (f" {slurm_arguments}" if slurm_arguments else "")
    return "\n".join(["#!/bin/bash", f"# Written by fleetscope: {purpose}.", "set -eu", f"exec {command}", ""])


def _job_id(job_id: str) -> str:
    if job_id == "<ARRAY_JOB_ID>" or is_array_job_id(job_id):
        return job_id
    raise ValueError(f"not a Slurm job id: {job_id!r}")
