"""What a launch checks before anything starts: one list, run by `launch` and by `launch --dry-run` alike.

    launch_checks(spec, resume=...)   every check in LAUNCH_CHECKS; a ConfigError names the first that fails,
                                      the notes (what may still work, e.g. a path the Slurm nodes may see) return

Each check only reads (the spec, the file system): nothing is created, submitted or contacted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..traces.layout import RunLayout
from ..trainer.config import ConfigError, ProfilerSchedule
from .runs import refuse_existing_run, refuse_unusable_run_dir
from .spec import JobSpec

LOCAL_SCHEDULERS = ("local", "torchx_local")
"""Schedulers whose ranks see this host's files."""
TORCHRUN_NAMES = frozenset({"torchrun"})
TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})


@dataclass(frozen=True, kw_only=True)
class FirstWindow:
    """The first window a profiler schedule plans, in global steps (0-based; `end` exclusive)."""

    warmup_start: int
    active_start: int
    end: int


def first_window(schedule: ProfilerSchedule) -> FirstWindow:
    """Where the schedule's first cycle puts its window (trainer/profiling.py plan_windows, cycle 0)."""
    warmup_start = schedule.skip_first + schedule.wait
    active_start = warmup_start + schedule.warmup
    return FirstWindow(warmup_start=warmup_start, active_start=active_start, end=active_start + schedule.active)


def schedule_problem(schedule: ProfilerSchedule, steps: int) -> str | None:
    """Why a schedule records no window in a run of `steps` steps (its first window does not fit), or None.
    Pure: what plan_windows(schedule, steps) == [] means, said with the numbers."""
    if not schedule.enabled:
        return None
    window = first_window(schedule)
    if window.end <= steps:
        return None
    last = steps - 1
    steps_of = f"warmup from step {window.warmup_start}, recording steps {window.active_start}-{window.end - 1}"
    where = (f"starts at step {window.warmup_start} ({steps_of})" if window.warmup_start > last
             else f"ends at step {window.end - 1} ({steps_of})")
    return (f"the first window {where}, after the run's last step {last} (--steps {steps} runs steps 0-{last}): "
            f"no trace would be recorded; raise --steps to at least {window.end} or start the window earlier "
            f"(profiler.skip_first={schedule.skip_first}, profiler.wait={schedule.wait}), or --profile off")


SCHEDULE_FIELDS = ("skip_first", "wait", "warmup", "active", "repeat")


def is_default_schedule(schedule: ProfilerSchedule) -> bool:
    """The schedule nobody asked for (every SCHEDULE_FIELDS value the default's)."""
    default = ProfilerSchedule()
    return all(getattr(schedule, name) == getattr(default, name) for name in SCHEDULE_FIELDS)


def check_profile_schedule(spec: JobSpec, *, resume: bool) -> list[str]:
    """fleetscope's trainer runs `train.steps` steps: a schedule whose first window does not fit records
    nothing. One the user set is refused; the default one (a short smoke run) is only noted. (A program
    after -- counts its own steps, and triggered windows need no schedule: neither is judged.)"""
    profiler = spec.train.profiler
    if spec.entry is not None or profiler.trigger:
        return []
    problem = schedule_problem(profiler, spec.train.steps)
    if problem is None:
        return []
    if is_default_schedule(profiler):
        return [f"note: the default --profile schedule: {problem}"]
    raise ConfigError(f"profiler: {problem} (nothing was started)")


def check_program(spec: JobSpec, *, resume: bool) -> list[str]:
    """The user's program is a script that exists (or a module), and not torchrun: fleetscope runs that itself."""
    entry = spec.entry
    if entry is None:
        return []
    name = entry.program if entry.module else Path(entry.program).name
    if name in (TORCHRUN_MODULES if entry.module else TORCHRUN_NAMES):
        raise ConfigError(f"entry.program: fleetscope runs torchrun itself: use `-- python train.py ARGS` with "
                          f"--nproc-per-node N (and --nodes N), not `-- {'-m ' if entry.module else ''}{name} ...` "
                          f"(nothing was started)")
    if not entry.module and not Path(entry.program).is_file():
        raise ConfigError(f"entry.program: {entry.program}: no such file (nothing was started)")
    return []


def check_input_files(spec: JobSpec, *, resume: bool) -> list[str]:
    """The trainer's input files, where this host sees what the ranks will (local, torchx_local): a missing
    one fails every rank after start-up, so it is refused here, naming the field. On Slurm the nodes may
    see paths this host does not: a missing one is only noted."""
    if spec.entry is not None:
        return []
    train = spec.train
    inputs = [("data.path", Path(train.data.path).expanduser())] if train.data.source != "synthetic" else []
    if train.model.path:
        inputs.append(("model.path", Path(train.model.path).expanduser() / "config.json"))
    notes = []
    for field_name, path in inputs:
        if path.is_file():
            continue
        if spec.scheduler in LOCAL_SCHEDULERS:
            raise ConfigError(f"{field_name}: {path}: no such file (nothing was started)")
        notes.append(f"note: {field_name} {path} is not on this host; the nodes must see it")
    return notes


def check_run_dir(spec: JobSpec, *, resume: bool) -> list[str]:
    """The run directory can be created, and holds no earlier run unless resuming (launch checks it again
    right before it starts, against a run started in between)."""
    layout = RunLayout.at(spec.train.run_dir)
    refuse_unusable_run_dir(layout.root)
    refuse_existing_run(layout, resume=resume)
    return []


LAUNCH_CHECKS: tuple[Callable[..., list[str]], ...] = (
    check_run_dir, check_program, check_input_files, check_profile_schedule,
)


def launch_checks(spec: JobSpec, *, resume: bool) -> list[str]:
    """Run every check of LAUNCH_CHECKS in order (a ConfigError: the first that fails); the notes of all."""
    notes: list[str] = []
    for check in LAUNCH_CHECKS:
        notes += check(spec, resume=resume)
    return notes
