"""The local scheduler: torchrun on this node, in the foreground. `plan_local` is pure; `run_local` runs it."""

from __future__ import annotations

import os
import re
import signal
import socket
import shlex
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ...trainer.config import ConfigError
from ...traces.collect import Collection, collect_traces
from ...traces.jobfile import now_iso, read_job_record, write_job_record
from ...traces.layout import RunLayout
from ...traces.own_traces import UNCOLLECTED_FIELD, job_span, uncollected_traces_hint
from ..failures import RankFailure, collect_failures, summary_failures
from ..scheduler import Submission, Verdict, existing_outputs
from ..spec import TRAINER_MODULE, JobSpec, spec_record  # noqa: F401  (TRAINER_MODULE: re-exported)


@dataclass(frozen=True, kw_only=True)
class LocalPlan:
    """The exact command the local scheduler runs, and the environment it adds."""

    spec: JobSpec
    argv: list[str]
    env: dict[str, str]
    run_dir: Path

    def render(self) -> str:
        """The command as one shell line (what --dry-run prints; paste-able as is)."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(self.env.items())]
        command = " ".join(assignments + [shlex.quote(arg) for arg in self.argv])
        entry = self.spec.entry
        if entry is None:
            return command
        lines = [f"cd -- {shlex.quote(entry.workdir)} && {command}"]
        if entry.collect_glob:
            lines.append("# then, whatever the exit status: " + " ".join(shlex.quote(word) for word in [
                "fleetscope", "collect-traces", str(self.run_dir), entry.collect_glob]))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"kind": "local", "argv": self.argv, "env": self.env, "command": self.render()}


def torchrun_argv(spec: JobSpec, layout: RunLayout) -> list[str]:
    """`python -m torch.distributed.run` for one node, per-rank logs under the run directory."""
    return [
        spec.python, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.nproc_per_node),
        "--log-dir", str(layout.logs_dir), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
        *spec.rank_program(),
    ]


def plan_local(spec: JobSpec) -> LocalPlan:
    layout = RunLayout.at(spec.train.run_dir)
    return LocalPlan(spec=spec, argv=torchrun_argv(spec, layout), env=spec.rank_environment(), run_dir=layout.root)


@dataclass(frozen=True, kw_only=True)
class LocalResult:
    returncode: int
    failures: list[RankFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_local(plan: LocalPlan, on_start=None) -> LocalResult:
    """Run torchrun in the foreground; on failure, collect which ranks failed and why. A user's program
    starts in its workdir, and the traces it wrote itself are collected once it is over (any outcome).
    `on_start(pid)` once torchrun runs (the record `cancel` finds it by)."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    entry = plan.spec.entry
    layout = RunLayout.at(plan.run_dir)
    try:
        with subprocess.Popen(plan.argv, env={**os.environ, **plan.env}, cwd=entry.workdir if entry is not None else None,
                              stderr=subprocess.PIPE, text=True, errors="replace") as torchrun:
            if on_start is not None:
                on_start(torchrun.pid)
            pass_stderr(torchrun.stderr, sys.stderr, layout.logs_dir / TORCHRUN_STDERR)
            returncode = torchrun.wait()
    except OSError as error:
        # the interpreter or the working directory is missing: no rank ever started
        return LocalResult(returncode=EXEC_FAILED, failures=[RankFailure(
            rank=0, exitcode=EXEC_FAILED, message=f"could not start {plan.argv[0]!r}: {error.strerror or error}")])
    report_program_traces(plan.spec, layout)
    if returncode == 0:
        return LocalResult(returncode=0)
    failures = (collect_failures(layout.logs_dir)
                or summary_failures([layout.logs_dir / TORCHRUN_STDERR]))
    return LocalResult(returncode=returncode, failures=failures)


def launcher_record(pid: int) -> dict[str, Any]:
    """What `cancel` needs to find the launch again, and to tell it from another process that got its pid."""
    return {"pid": pid, "host": socket.gethostname(), "started": _process_start(pid)}


def running_launch(layout: RunLayout, launcher: object) -> int:
    """The pid of this run's torchrun, still running on this host; ConfigError saying why not."""
    if not isinstance(launcher, dict) or not isinstance(launcher.get("pid"), int) or isinstance(launcher.get("pid"), bool):
        raise ConfigError(f"{layout.root}: job.json names no torchrun process (launched by an older fleetscope, or "
                          "the launch is still starting): stop it with Ctrl-C where it runs")
    pid, host = launcher["pid"], launcher.get("host")
    if host != socket.gethostname():
        raise ConfigError(f"{layout.root}: the run's torchrun runs on {host!r}, not on this host: cancel it there")
    started = _process_start(pid)
    if started is None or started != launcher.get("started"):
        raise ConfigError(f"{layout.root}: torchrun (pid {pid}) is no longer running (the launch ended without "
                          "recording its end, or the pid belongs to another process now): nothing to cancel")
    return pid


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, it names one
    process (a pid reused later starts later). None where the process or /proc is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


EXEC_FAILED = 127
"""The shell's status for a command that could not be run: the launch's own when torchrun never started."""


TORCHRUN_STDERR = "torchrun.stderr.log"
"""torchrun's own traceback and failure summary of a failed local job, under <run>/logs/."""


_PROFILER_NOISE = re.compile(r"(\[[^\]\n]*\]:)?(USDT|STAGE):\d{4}-\d\d-\d\d ")
"""Kineto's probe and stage lines (`USDT:2026-12-02 13:52:14 ... profiler_start`, `STAGE:2024-05-01 10:00:00
... Completed Stage: Warm Up`), after torchrun's `[default<R>]:` prefix when it adds one; the date keeps a
program's own line that starts with "STAGE:" passing through."""


def is_profiler_noise(line: str) -> bool:
    """A line the profiler itself prints on every window of every rank: kept in the rank's log, not passed on."""
    return _PROFILER_NOISE.match(line) is not None


def pass_stderr(lines: Iterable[str], out: TextIO, summary_path: Path) -> None:
    """torchrun's stderr, line by line, less its own traceback and ChildFailedError summary (the launch then
    names the failed ranks and their messages, from the error files): that block goes to `summary_path`,
    with a line saying so. The ranks' lines (prefixed `[default<R>]:`) pass, less the profiler's own
    (`is_profiler_noise`: they stay in each rank's log); a block that never reaches the summary's closing rule
    is passed on whole."""
    held: list[str] = []
    for line in lines:
        if is_profiler_noise(line):
            continue
        if not held and line.rstrip("\n") != "Traceback (most recent call last):":
            out.write(line)
            out.flush()
            continue
        held.append(line)
        if line.startswith("=" * 20) and any(seen.startswith("Root Cause") for seen in held):
            summary_path.parent.mkdir(parents=True, exist_ok=True)
            with summary_path.open("a") as summary:
                summary.writelines(held)
            out.write(f"fleetscope: torchrun's traceback and failure summary: {summary_path}\n")
            held = []
    out.writelines(held)


def report_program_traces(spec: JobSpec, layout: RunLayout) -> None:
    """After a user's program ran on this node: collect what --collect-traces names, or else name the Kineto
    traces it left under its working directory, with the flag that would have filed them."""
    entry = spec.entry
    if entry is None:
        return
    if entry.collect_glob:
        report_collection(collect_traces(entry.collect_glob, layout))
        return
    hint = uncollected_traces_hint(Path(entry.workdir), layout.root, job_span(layout))
    for line in hint:
        print(line, flush=True)
    if hint:  # the run's report names them too, not only this terminal
        write_job_record(layout, **{UNCOLLECTED_FIELD: hint[0].removeprefix("fleetscope: ")})


def report_collection(collection: Collection) -> None:
    """One line per collection on stdout (the job's log): what was filed (or why nothing matched), one line
    for the files left from outside the job's span, each refused pair, every skipped file with its reason."""
    for line in collection_lines(collection):
        print(line, flush=True)


def collection_lines(collection: Collection) -> list[str]:
    published = sum(1 for trace in collection.collected if trace.published is not None)
    before = len(collection.collected) - published
    if collection.matched == 0:
        lines = [f"fleetscope: collected 0 trace(s): nothing matches {collection.pattern} ({collection.hint})"]
    else:
        lines = [f"fleetscope: collected {published} trace(s) matching {collection.pattern}"
                 f"{f' ({before} collected before)' if before else ''}"]
    if collection.span.started is None and collection.matched:
        lines.append("fleetscope:   note: the run records no start time (no job.json): every matched file was "
                     "taken as this job's, whatever its age")
    lines += [line for where in ("before", "after") if (line := _outside_line(collection, where))]
    for path, other, steps in collection.conflicts:
        lines.append(f"fleetscope:   refused {path} and {other}: both are one rank's traces of step(s) "
                     f"{_steps_text(steps)}, so which is this job's cannot be told; neither collected (move the "
                     f"other run's away, then `fleetscope collect-traces RUN_DIR GLOB`; a program that counts "
                     f"each window's steps from 0: write each window into its own iteration_<N>/ folder)")
    lines += [f"fleetscope:   skipped {path}: {why}" for path, why in collection.skipped]
    return lines


def _outside_line(collection: Collection, where: str) -> str:
    """One line for the matched files modified before the job started (or after it ended): how many, the
    newest (the oldest) of them, and why they were left in place."""
    files = sorted((mtime, path) for path, mtime, side in collection.outside_job if side == where)
    if not files:
        return ""
    mtime, path = files[-1] if where == "before" else files[0]
    bound = collection.span.started if where == "before" else collection.span.ended
    which, event = ("newest", "started") if where == "before" else ("oldest", "ended")
    gap = abs((bound or mtime) - mtime)
    return (f"fleetscope:   skipped {len(files)} matched file(s) modified {where} this job {event} (another run's; "
            f"left in place); {which}: {path}, modified {duration_text(gap)} {where} the job {event}")


def _steps_text(steps: list[int]) -> str:
    return ", ".join(str(step) for step in steps[:5]) + (f" ... ({len(steps)} in all)" if len(steps) > 5 else "")


def duration_text(seconds: float) -> str:
    """A duration as a person reads it: seconds, minutes or hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(kw_only=True)
class RecordedRunStatus:
    """The status of a foreground run: what job.json recorded (the run is over when its command is)."""

    run_dir: Path
    scheduler: str
    recorded_status: str
    failures: list[RankFailure] = field(default_factory=list)
    outputs: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def read(cls, layout: RunLayout, *, failures: list[RankFailure]) -> "RecordedRunStatus":
        record = read_job_record(layout)
        if not record:
            raise ConfigError(f"run_dir: {layout.root} has no {layout.job_file.name}: not a run directory")
        return cls(run_dir=layout.root, scheduler=str(record.get("scheduler", "")),
                   recorded_status=str(record.get("status", "unknown")), failures=failures,
                   outputs=existing_outputs(layout))

    @property
    def verdict(self) -> Verdict:
        return Verdict.FAILED if self.failures or self.recorded_status == "failed" else Verdict.OK

    def to_json(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler, "status": self.recorded_status,
                "failures": [vars(failure) for failure in self.failures]}


class LocalScheduler:
    name = "local"

    def plan(self, spec: JobSpec, *, postprocess: bool = True) -> LocalPlan:
        return plan_local(spec)

    def submit(self, plan: LocalPlan, layout: RunLayout) -> Submission:
        """Run torchrun in the foreground, recording the start and the outcome in job.json."""
        layout.root.mkdir(parents=True, exist_ok=True)
        write_job_record(layout, **spec_record(plan.spec), plan=plan.to_json(), status="running",
                         started_at=now_iso())
        try:
            result = run_local(plan, on_start=lambda pid: write_job_record(layout, launcher=launcher_record(pid)))
        except BaseException:
            # Ctrl-C or a crash of the launch itself: the record must not say "running" forever
            write_job_record(layout, status="failed", returncode=None, finished_at=now_iso(),
                             failures=[{"rank": 0, "exitcode": None, "message": "the launch was interrupted"}])
            raise
        cancelled = "cancel_requested_at" in read_job_record(layout)
        write_job_record(layout, status="succeeded" if result.ok else ("cancelled" if cancelled else "failed"),
                         returncode=result.returncode, failures=[vars(f) for f in result.failures],
                         finished_at=now_iso())
        return Submission(scheduler=self.name, finished=True, succeeded=result.ok, failures=result.failures,
                          detail=f"torchrun exit code {result.returncode}")

    def status(self, layout: RunLayout) -> RecordedRunStatus:
        return RecordedRunStatus.read(layout, failures=collect_failures(layout.logs_dir)
                                      or summary_failures([layout.logs_dir / TORCHRUN_STDERR]))

    def cancel(self, layout: RunLayout, *, postprocess_too: bool = False) -> list[str]:
        """Stop a running local job: SIGTERM to the torchrun its launch recorded (torchrun stops its ranks,
        which dump their Flight Recorder and keep their traces), once that process is shown to be this run's."""
        record = read_job_record(layout)
        if record.get("status") != "running":
            raise ConfigError(f"{layout.root}: the run is not running (job.json status "
                              f"{record.get('status', 'unknown')!r}): nothing to cancel")
        pid = running_launch(layout, record.get("launcher"))
        write_job_record(layout, cancel_requested_at=now_iso())
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            raise ConfigError(f"{layout.root}: torchrun (pid {pid}) ended before it could be stopped") from None
        return [f"torchrun (pid {pid})"]
