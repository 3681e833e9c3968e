"""The local scheduler: torchrun on this node. `plan_local` is pure; `run_local` runs it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..trainer.config import train_argv
from ..traces.layout import RunLayout
from .spec import JobSpec

TRAINER_MODULE = "fleetscope.trainer"


@dataclass(frozen=True, kw_only=True)
class LocalPlan:
    """The exact command the local scheduler runs, and the environment it adds."""

    argv: list[str]
    env: dict[str, str]
    run_dir: Path

    def render(self) -> str:
        """The command as one shell line (what --dry-run prints; paste-able as is)."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(self.env.items())]
        return " ".join(assignments + [shlex.quote(arg) for arg in self.argv])

    def to_json(self) -> dict:
        return {"kind": "local", "argv": self.argv, "env": self.env, "command": self.render()}


def torchrun_argv(spec: JobSpec, layout: RunLayout) -> list[str]:
    """`python -m torch.distributed.run` for one node, per-rank logs under the run directory."""
    return [
        spec.python, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.nproc_per_node),
        "--log-dir", str(layout.logs_dir), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
        "-m", TRAINER_MODULE, *train_argv(spec.train),
    ]


def plan_local(spec: JobSpec) -> LocalPlan:
    layout = RunLayout.at(spec.train.run_dir)
    return LocalPlan(argv=torchrun_argv(spec, layout), env=spec.rank_environment(), run_dir=layout.root)


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """A rank that exited with an error, from torchrun's per-rank error file and logs."""

    rank: int
    exitcode: int | None
    message: str
    timestamp: float | None = None
    """When the rank failed (Unix seconds): the earliest failure is usually the cause, the others
    are ranks that lost their peer."""
    log_path: str | None = None


@dataclass(frozen=True, kw_only=True)
class LocalResult:
    returncode: int
    failures: list[RankFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_local(plan: LocalPlan) -> LocalResult:
    """Run torchrun in the foreground; on failure, collect which ranks failed and why."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    completed = subprocess.run(plan.argv, env={**os.environ, **plan.env}, check=False)
    if completed.returncode == 0:
        return LocalResult(returncode=0)
    return LocalResult(returncode=completed.returncode, failures=collect_failures(RunLayout.at(plan.run_dir)))


def collect_failures(layout: RunLayout) -> list[RankFailure]:
    """Failed ranks from torchrun's log tree: <logs>/<run_id>/attempt_<n>/<local_rank>/error.json."""
    failures = []
    for error_file in sorted(layout.logs_dir.glob("*/attempt_*/*/error.json")):
        failures.append(_failure_from_error_file(error_file))
    return sorted(failures, key=lambda f: (f.timestamp is None, f.timestamp or 0, f.rank))


def _failure_from_error_file(error_file: Path) -> RankFailure:
    rank_dir = error_file.parent
    stderr_log = rank_dir / "stderr.log"
    try:
        message = json.loads(error_file.read_text())["message"]
        if not isinstance(message, dict):
            message = {"message": str(message)}
        extra = message.get("extraInfo", {})
        text, exitcode, timestamp = message.get("message", ""), extra.get("exitcode"), extra.get("timestamp")
    except (OSError, ValueError, KeyError, TypeError) as error:
        text, exitcode, timestamp = f"unreadable error file {error_file}: {error}", None, None
    return RankFailure(rank=int(rank_dir.name), exitcode=exitcode, message=text.strip(),
                       timestamp=_failure_time(timestamp, error_file),
                       log_path=str(stderr_log) if stderr_log.exists() else None)


def _failure_time(recorded: object, error_file: Path) -> float | None:
    """The error file's own timestamp has whole seconds; its modification time orders ranks that
    failed within the same second (the first to fail writes its file first)."""
    try:
        return error_file.stat().st_mtime_ns / 1e9
    except OSError:
        return float(recorded) if str(recorded).isdigit() else None
