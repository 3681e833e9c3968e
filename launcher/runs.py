"""A job's life as the command line drives it: launch into a run directory, follow, cancel.

The scheduler of an existing run comes from its job.json, so `status` and `cancel` need only the directory.
Post-processing (gather + analyze + merge) is passed in by the caller: it composes analysis, which the
launcher does not depend on.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from ..trainer.config import ConfigError
from ..traces.environment import environment_fingerprint
from ..traces.jobfile import read_job_record, write_job_record
from ..traces.layout import RunLayout, slurm_logs_dir
from .scheduler import LaunchPlan, RunStatus, Scheduler, Submission, Verdict
from .schedulers import scheduler_for


class PostprocessOutcome(Protocol):
    complete: bool


Postprocess = Callable[[Path], PostprocessOutcome]


@dataclass(frozen=True, kw_only=True)
class LaunchOutcome:
    submission: Submission
    post: Any | None
    """The post-processing result of a foreground job (None: not run)."""

    @property
    def verdict(self) -> Verdict:
        """A foreground job: FAILED if it failed, PARTIAL if post-processing was incomplete. A queued job: OK."""
        if self.submission.finished and not self.submission.succeeded:
            return Verdict.FAILED
        if self.post is not None and not self.post.complete:
            return Verdict.PARTIAL
        return Verdict.OK


def refuse_unusable_run_dir(run_dir: Path) -> None:
    """A run directory must be creatable: every part of its path that exists is a directory, reached through
    no broken symlink and no symlink loop (a ConfigError naming the part, before anything is planned)."""
    path = Path(run_dir).absolute()
    for part in (*reversed(path.parents), path):
        try:
            mode = part.lstat().st_mode
        except FileNotFoundError:
            return   # from here on nothing exists: the launch creates it
        except OSError as error:
            raise ConfigError(f"run_dir: {part}: {error.strerror}") from None
        if stat.S_ISLNK(mode):
            try:
                mode = os.stat(part).st_mode
            except OSError as error:
                what = "a symlink loop" if error.errno == errno.ELOOP else "a broken symlink"
                raise ConfigError(f"run_dir: {part} is {what}") from None
        if not stat.S_ISDIR(mode):
            raise ConfigError(f"run_dir: {part} exists and is not a directory")


def refuse_existing_run(layout: RunLayout, *, resume: bool) -> None:
    """Nothing of an earlier run is reused or overwritten unless the user asks to resume it, and nothing
    fleetscope did not record (no job.json) is ever written over, --resume or not."""
    if layout.root.exists() and not layout.root.is_dir():
        raise ConfigError(f"run_dir: {layout.root} exists and is not a directory")
    if layout.job_file.exists():
        if not resume:
            raise ConfigError(f"run_dir: {layout.root} already holds a run; pass --resume to continue it or "
                              f"choose another --run-dir")
        return
    found = unrecorded_run_files(layout)
    if found:
        raise ConfigError(f"run_dir: {layout.root} holds {', '.join(found)} but no {layout.job_file.name} (not a "
                          f"run fleetscope recorded): nothing there is overwritten; choose another --run-dir")


def unrecorded_run_files(layout: RunLayout) -> list[str]:
    """The names a run writes that already exist in its directory (for a directory without job.json)."""
    paths = [layout.manifest_file, layout.metrics_dir, layout.traces_dir, layout.clock_dir, layout.logs_dir,
             layout.report_dir, layout.checkpoints_dir, layout.memory_dir]
    return [path.name + ("/" if path.is_dir() else "") for path in paths if path.exists()]


def launch(scheduler: Scheduler, plan: LaunchPlan, *, resume: bool, postprocess: Postprocess | None,
           on_start: Callable[[], None] | None = None) -> LaunchOutcome:
    """Run or submit `plan` into its run directory; post-process a foreground job once it is over.
    `on_start()` runs once the run directory is known to be free, before anything starts."""
    layout = RunLayout.at(plan.run_dir)
    refuse_unusable_run_dir(layout.root)
    refuse_existing_run(layout, resume=resume)
    if on_start is not None:
        on_start()
    submission = scheduler.submit(plan, layout)
    write_job_record(layout, environment=environment_fingerprint())   # what `compare` checks runs share
    post = None
    if postprocess is not None and submission.finished and (submission.succeeded or recorded_anything(layout)):
        post = postprocess(layout.root)  # a failed job that recorded nothing leaves nothing to gather
    return LaunchOutcome(submission=submission, post=post)


def recorded_anything(layout: RunLayout) -> bool:
    """Whether a run wrote a trace or finished a step (a step-metrics line), e.g. before it failed."""
    traced = layout.traces_dir.is_dir() and any(path.is_file() for path in layout.traces_dir.rglob("*"))
    return traced or any(path.stat().st_size > 0 for path in layout.step_metrics_files())


def scheduler_of_run(layout: RunLayout) -> Scheduler:
    """The scheduler job.json names; a directory without job.json is not a run (a usage error)."""
    record = read_job_record(layout)
    if not record:
        raise ConfigError(f"run_dir: {layout.root} has no {layout.job_file.name}: not a run directory "
                          f"fleetscope launched")
    return scheduler_for(str(record.get("scheduler", "")))


def run_status(run_dir: str | Path) -> RunStatus:
    layout = RunLayout.at(run_dir)
    return scheduler_of_run(layout).status(layout)


def log_files(layout: RunLayout) -> list[Path]:
    """The scheduler's and the ranks' logs of a run, in a stable order: Slurm's, then torchrun's per-rank
    logs (TorchX: one tree per node; local: one tree for the run)."""
    slurm_logs = sorted(slurm_logs_dir(layout).glob("*.out")) + sorted(slurm_logs_dir(layout).glob("*.err"))
    rank_logs = sorted(layout.logs_dir.glob("torchx-node*/*/attempt_*/*/std*.log"))
    local_rank_logs = sorted(layout.logs_dir.glob("*/attempt_*/*/std*.log"))
    return slurm_logs + rank_logs + local_rank_logs


def cancel_run(run_dir: str | Path, *, postprocess_too: bool) -> list[str]:
    layout = RunLayout.at(run_dir)
    return scheduler_of_run(layout).cancel(layout, postprocess_too=postprocess_too)
