"""What the run commands print: a job's outcome, its status, its outputs."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..launcher.failures import RankFailure
from ..launcher.runs import recorded_anything
from ..analysis.cross_rank.outcome import exit_meaning
from ..analysis.quantities import step_ranges
from ..launcher.progress import MEASURE_BEHIND, MEASURE_OWN_WORK, RECENT_STEPS, RunProgress
from ..launcher.scheduler import RunStatus, Submission
from ..launcher.schedulers.local import RecordedRunStatus, duration_text
from ..launcher.schedulers.slurm import SlurmJobStatus, SlurmRunStatus
from ..traces.exit_status import EXIT_HUNG, EXIT_PREEMPTED
from ..traces.fanout import FanoutState
from ..traces.jobfile import read_job_record
from .terminal_text import escape_controls
from ..traces.layout import RunLayout, fanout_task_log


def print_failed_job(layout: RunLayout, submission: Submission, *, post_ran: bool) -> None:
    print(f"\nfleetscope: {_ending(layout, submission)} ({submission.detail})", file=sys.stderr)
    # the hang watchdog stops the hung rank and those waiting for it alike: no exit order names the culprit
    hung = any(f.exitcode == EXIT_HUNG for f in submission.failures)
    for order, failure in enumerate(submission.failures):
        first = " [failed first]" if order == 0 and len(submission.failures) > 1 and not hung else ""
        print(f"  rank {failure.rank}{first}: {failure_text(failure)}", file=sys.stderr)
        if failure.log_path:
            print(f"    log: {failure.log_path}", file=sys.stderr)
    if not submission.failures:
        print(f"  no rank left an error file; see the logs under {layout.logs_dir}", file=sys.stderr)
    if post_ran:
        print("  traces written before the failure are kept and were gathered.", file=sys.stderr)
    elif not recorded_anything(layout):
        print("  no step finished and no trace was written: nothing to gather, analyze or merge.", file=sys.stderr)


def _ending(layout: RunLayout, submission: Submission) -> str:
    """How the job ended, in the words its report and `status` use: cancelled on request, stopped by the hang
    watchdog, else failed."""
    try:
        recorded = read_job_record(layout).get("status")
    except ValueError:
        recorded = None
    if recorded == "cancelled":
        return "the job was CANCELLED"
    if submission.failures and all(f.exitcode == EXIT_PREEMPTED for f in submission.failures):
        return "the job STOPPED on request (its ranks saved a checkpoint: exit code 75)"
    if any(f.exitcode == EXIT_HUNG for f in submission.failures):
        return "the job HUNG (the hang watchdog stopped it)"
    return "the job FAILED"


def print_outputs(outputs: dict[str, Path]) -> None:
    print("\noutputs:")
    for name, path in outputs.items():
        if Path(path).exists():
            print(f"  {name:<13} {path}")
    if "merged_trace" in outputs and Path(outputs["merged_trace"]).exists():
        print("\nopen the merged trace: https://ui.perfetto.dev -> 'Open trace file' -> "
              f"{outputs['merged_trace']}")


def print_submitted(submission: Submission, layout: RunLayout, *, nodes: int, nproc_per_node: int) -> None:
    after = (f"post-processing job {submission.postprocess_job_id} runs after it" if submission.postprocess_job_id
             else "no post-processing job (--no-postprocess)")
    print(f"fleetscope: submitted Slurm job {submission.job_id} ({submission.scheduler}, {nodes} node(s) x "
          f"{nproc_per_node}); {after}")
    print(f"  run directory: {layout.root}")
    root = shlex.quote(str(layout.root))
    print(f"  follow it:     fleetscope status {root}   |   fleetscope logs {root}")


def print_state_change(label: str, status: SlurmJobStatus) -> None:
    print(f"fleetscope: {label} {status.job_id}: {status.state}", flush=True)


STATUS_LABEL_WIDTH = 14
"""`fleetscope status` prints `label:` left-aligned in this many columns, then the value: every value starts in
the same column ("failed first:" and "merged_trace:" are the longest labels)."""


def _row(label: str, value: object) -> str:
    """`label:` padded to the value column; an empty label continues the row above."""
    return f"{label + ':' if label else '':<{STATUS_LABEL_WIDTH}}{value}"


def render_status(status: RunStatus) -> str:
    if isinstance(status, SlurmRunStatus):
        lines = _slurm_status_lines(status)
    elif isinstance(status, RecordedRunStatus):
        lines = [_row("run", status.run_dir), _row("scheduler", f"{status.scheduler} (ran in the foreground)"),
                 _row("state", f"{status.recorded_status} (as recorded in job.json)")]
    else:
        raise TypeError(f"no rendering for {type(status).__name__}")
    lines += _failure_lines(status.failures)
    lines += [_row(name, path) for name, path in status.outputs.items()]
    return "\n".join(lines)


def _slurm_status_lines(status: SlurmRunStatus) -> list[str]:
    training = status.training
    lines = [_row("run", status.run_dir), _row("scheduler", f"{status.scheduler}, Slurm job {status.job_id}")]
    if training is None and status.state != "UNKNOWN":
        lines.append(_row("state", f"{status.state} (as recorded in job.json: {status.recorded_status}; Slurm no "
                                   "longer knows the job)"))
    elif training is None:
        lines.append(_row("state", "UNKNOWN (neither slurmctld nor accounting knows the job)"))
    else:
        restarts = f", requeued {training.restarts} time(s)" if training.restarts else ""
        lines.append(_row("state", f"{training.state} (exit code {training.exit_code}{restarts}; from "
                                   f"{training.source})"))
        lines += [" " * STATUS_LABEL_WIDTH + f"{c.job_id}: {c.state} exit {c.exit_code} on {c.nodes or '-'}"
                  for c in training.components if len(training.components) > 1]
    if status.postprocess is not None:
        lines.append(_row("postprocess", f"Slurm job {status.postprocess_job_id}: {status.postprocess.state}"))
    return lines


def failure_text(failure: RankFailure) -> str:
    """A rank's failure in one line: its error's first line and its exit status with what that means (86: the
    hang watchdog)."""
    lines = failure.message.strip().splitlines() if failure.message else []
    message = lines[0] if lines else "no error message"
    more = " (more in its log)" if len(lines) > 1 else ""
    meaning = exit_meaning(failure.exitcode)
    if failure.exitcode is None or f"exit code {failure.exitcode}" not in message:
        code = "" if failure.exitcode is None else f" (exit {failure.exitcode}{': ' + meaning if meaning else ''})"
    else:
        code = f": {meaning}" if meaning else ""
    return f"{message}{code}{more}"


def _stopped_row(stopped_in: dict[int, int], progress: RunProgress | None) -> str:
    """Where the hang watchdogs stopped the job, beside the records' last step (they trail it)."""
    steps = sorted(set(stopped_in.values()))
    where = (f"step {steps[0]}" if len(steps) == 1 else
             "; ".join(f"rank {rank}: step {step}" for rank, step in sorted(stopped_in.items())))
    records = f"; the step records end at step {progress.done_step}" if progress is not None else ""
    return _row("stopped in", f"{where} (the hang watchdog of rank(s) {step_ranges(stopped_in)}, as `hang` "
                              f"reads it){records}")


def render_progress(progress: RunProgress | None, *, ended: bool = False, succeeded: bool = False,
                    run_dir: str = "RUN_DIR", hang_timeout_s: float | None = None,
                    stopped_in: dict[int, int] | None = None) -> list[str]:
    """The run's progress from its step records (launcher/progress.py); `ended`: the job has ended (no time left
    to estimate, no window still to come, nothing stalled); `succeeded`: it ended so (every step's record written);
    `run_dir` as the suggested commands name it; `hang_timeout_s`: the run's observability.hang_timeout_s (None: not
    recorded); `stopped_in`: rank -> the step its hang watchdog says it stopped in (the markers `hang` reads)."""
    stopped = [_stopped_row(stopped_in, progress)] if stopped_in else []
    if progress is None:
        return stopped + [_row("progress", "no step finished yet (no step records)")]
    total = f" (the run's steps: 0-{progress.total_steps - 1})" if progress.total_steps else ""
    ahead = f"; the furthest rank is at step {progress.front_step}" if progress.front_step > progress.done_step else ""
    # the trainer writes a step's record once the next step has run (no device sync): a running or failed job's
    # records may trail the steps it ran by one, which `hang` counts from its watchdogs
    trails = "" if succeeded else ("; the records may trail the steps run by one (a step's record is written once the "
                                   "next step has run)")
    lines = stopped + [_row("progress", f"step {progress.done_step} done on every rank{total}{ahead}{trails}")]
    stalled = progress.stalled and not ended
    if stalled:
        lines.append(_row("stalled", _stalled_text(progress, run_dir, hang_timeout_s)))
    lines += _slowest_lines(progress)
    if progress.pace_ms is not None:
        eta = progress.eta_s
        left = (f"; {duration_text(eta)} left at that pace" if eta is not None and eta > 0 and not ended
                and not stalled else "")
        lines.append(_row("pace", f"{1000.0 / progress.pace_ms:.2f} steps/s ({progress.pace_ms:.2f} ms a step, median "
                                  f"of the last {RECENT_STEPS} unprofiled steps, slowest rank per step){left}"))
    if progress.profiled_steps:
        lines.append(_row("profiler on", f"in steps {step_ranges(progress.profiled_steps)}{'' if ended else ' so far'}"))
    shown = ", ".join(f"{r.rank}: {r.step_time_ms:.1f} ms" for r in progress.ranks[:LISTED_TASKS]
                      if r.step_time_ms is not None)
    more = f" (+{len(progress.ranks) - LISTED_TASKS} more)" if len(progress.ranks) > LISTED_TASKS else ""
    if shown:
        lines.append(_row("last step", f"per rank {shown}{more}"))
    work = ", ".join(f"{r.rank}: {r.median(MEASURE_OWN_WORK):.1f} ms" for r in progress.ranks[:LISTED_TASKS]
                     if r.own_work_ms)
    if work and len(progress.ranks) > 1:
        lines.append(_row("own work", f"per rank {work}{more} (median a step)"))
    lines += [_row("note", note) for note in progress.notes]
    return lines


def _stalled_text(progress: RunProgress, run_dir: str, hang_timeout_s: float | None) -> str:
    """A running job without a step record for many steps' time: what happens next, and the command to run then."""
    age = progress.last_record_age_s
    text = (f"no step recorded for {duration_text(age)}, where a step took about {progress.recent_step_ms:.0f} ms: "
            "a rank may hang")
    hang = f"`fleetscope hang {shlex.quote(run_dir)}` names the rank"
    if hang_timeout_s is None:
        return f"{text}; once its ranks dump their Flight Recorder, {hang}"
    if hang_timeout_s == 0:
        return (f"{text}; its hang watchdog is off (observability.hang_timeout_s=0): nothing will stop it; "
                f"`fleetscope cancel {shlex.quote(run_dir)}` does")
    left = hang_timeout_s - age
    when = f", in about {duration_text(left)}" if left > 0 else ""
    return (f"{text}; its hang watchdog stops the job after {duration_text(hang_timeout_s)} without a step "
            f"(observability.hang_timeout_s){when}, then {hang}")


def _slowest_lines(progress: RunProgress) -> list[str]:
    """Which rank the others wait for, with the measure that names it (launcher/progress.py)."""
    slowest = progress.slowest
    if slowest is None:
        return []
    rank = next(r for r in progress.ranks if r.rank == slowest.rank)
    if slowest.measure == MEASURE_BEHIND:
        return [_row("slowest rank", f"rank {rank.rank}, behind: at step {rank.step}, {slowest.steps_behind} "
                                     f"steps behind the furthest rank (step {progress.front_step}); ranks in step "
                                     "finish each step together, so it is stalled or not in step")]
    count = len(rank.series(slowest.measure))
    steps = f"last {count} unprofiled step(s)" if rank.steady else f"{count} recorded step(s), none unprofiled yet"
    over = (f"{slowest.ms:.2f} ms a step against {slowest.others_ms:.2f} ms on the other ranks (median of each "
            f"rank's {steps}), more than the other ranks' in {slowest.steps_over} of {slowest.steps_compared} "
            "step(s)")
    who = (f"rank {rank.rank}, the one the others wait for," if slowest.consistent
           else f"no rank is consistently the one waited for; rank {rank.rank}")
    if slowest.measure == MEASURE_OWN_WORK:
        return [_row("slowest rank", f"{who} has the most own work: {over}"),
                _row("", "own work: step time less the gradient communication the rank waited for (a synchronous "
                         "job's ranks take about equal step times: the others' include their waiting for it)")]
    return [_row("slowest rank", f"{who} has the longest step time: {over}; no rank recorded its gradient "
                                 "communication, so a rank that waits for another is not told apart")]


def _failure_lines(failures: list[RankFailure]) -> list[str]:
    if not failures:
        return []
    first, *others = failures
    if any(f.exitcode == EXIT_HUNG for f in failures):
        # the hang watchdog stopped them all: which exited first says nothing of which hung (`fleetscope hang`)
        return [_row("hung", f"the hang watchdog stopped rank(s) {', '.join(str(f.rank) for f in failures)} "
                             f"({failure_text(first)}); which rank hung: fleetscope hang RUN_DIR")]
    lines = [_row("failed first", f"rank {first.rank}: {failure_text(first)}")]
    if first.log_path:
        lines.append(_row("its log", first.log_path))
    if others:
        lines.append(_row("then failed", ", ".join(f"rank {f.rank}" for f in others)))
    return lines


LISTED_TASKS = 10
"""Tasks named one per line in `fleetscope status`; the rest are counted."""


def render_fanouts(layout: RunLayout, states: list[FanoutState]) -> list[str]:
    """What each parse fan-out of the run has done, from its records (traces/fanout.py)."""
    lines = []
    for state in states:
        lines += _fanout_lines(layout, state)
    return lines


def _fanout_lines(layout: RunLayout, state: FanoutState) -> list[str]:
    planned = "?" if state.planned_tasks is None else str(state.planned_tasks)
    traces = sum(record.counts.traces for record in state.finished)
    parsed = sum(record.counts.parsed for record in state.finished)
    unreadable_traces = sum(len(record.counts.failed) for record in state.finished)
    lines = [f"parse fan-out, array job {state.array_job_id}: {len(state.finished)} of {planned} task(s) done "
             f"({traces} trace(s): {parsed} parsed, {traces - parsed - unreadable_traces} already cached, "
             f"{unreadable_traces} unreadable); records: {state.directory}"]
    if state.planned_tasks is None:
        lines.append("  no task has finished yet (pending or running: sacct -j "
                     f"{state.array_job_id})")
    missing = state.missing_tasks
    for task in missing[:LISTED_TASKS]:
        lines.append(f"  task {task}: no record (pending, running, or it died; the reduce parses its traces): "
                     f"log {fanout_task_log(layout, state.array_job_id, task)}")
    if len(missing) > LISTED_TASKS:
        lines.append(f"  ... and {len(missing) - LISTED_TASKS} more task(s) without a record")
    lines += [f"  {escape_controls(why, keep_newlines=False)}" for why in state.unreadable[:LISTED_TASKS]]
    if len(state.unreadable) > LISTED_TASKS:
        lines.append(f"  ... and {len(state.unreadable) - LISTED_TASKS} more unreadable task record(s)")
    if state.reduce is None:
        lines.append(f"  reduce: {state.reduce_problem}")
    else:
        counts = state.reduce.counts
        verdict = "complete" if state.reduce.complete and not state.reduce.errors else "partial"
        lines.append(f"  reduce: done, {verdict}: {counts.traces} trace(s): {counts.hits} from the cache, "
                     f"{counts.parsed} parsed by the reduce, {len(counts.failed)} unreadable; "
                     f"{len(state.reduce.incomplete)} task(s) it found incomplete")
        lines += [f"    failed: {escape_controls(error, keep_newlines=False)}" for error in state.reduce.errors[:LISTED_TASKS]]
        if len(state.reduce.errors) > LISTED_TASKS:
            lines.append(f"    ... and {len(state.reduce.errors) - LISTED_TASKS} more failure(s)")
    return lines
