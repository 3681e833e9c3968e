"""The parse fanned out over Slurm: `postprocess RUN --slurm` (plan, submit, wait, report), `parse-shard`
(one array task: its ranks into the parsed-trace cache) and `reduce-shards` (the report and the merged
trace from the cache). Planning is launcher/fanout.py, Slurm's commands launcher/schedulers/slurm.py,
the records' format traces/fanout.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import socket
import sys
import time
from pathlib import Path

from ..launcher.fanout import (
    VISIBILITY_FILE_FORMAT,
    FanoutConfig,
    FanoutPlan,
    ShardKey,
    describe_keys,
    plan_fanout,
    shard_blocks,
)
from ..traces.fanout import (
    IncompleteTask,
    ParseCounts,
    ReduceRecord,
    TaskRecord,
    ShardTraceProblem,
    read_reduce_record,
    read_task_record,
    write_reduce_record,
    write_task_record,
)
from ..traces.layout import RunLayout, fanout_dir, fanout_task_log, parsed_trace_cache_dir, run_holding_traces
from ..traces.validate import UsageError, is_inside
from .defaults import SLURM_JOB_NAME, SLURM_TIME_MINUTES
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL
from .jobargs import slurm_minutes

_JOB_ID = re.compile(r"^[0-9]+\Z")
_TOKEN = re.compile(r"^[0-9a-f]{8,64}\Z")


# --- postprocess --slurm ------------------------------------------------------------------------


def add_fanout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("on Slurm: the per-rank parse as an array job, then one reduce job")
    group.add_argument("--slurm", action="store_true", help="fan the parse out over a Slurm array job")
    group.add_argument("--array-tasks", type=int, default=None, metavar="N",
                       help="array tasks (default: one per 64 ranks, at most 1000)")
    group.add_argument("--max-running", type=int, default=None, metavar="M",
                       help="at most M tasks at once (default: no limit)")
    group.add_argument("--partition", default="", help="partition (default: the cluster's default)")
    group.add_argument("--account", default="", help="account to charge (default: the cluster's default)")
    group.add_argument("--qos", default="", help="quality of service (default: the cluster's default)")
    group.add_argument("--time", dest="time_minutes", type=slurm_minutes, default=SLURM_TIME_MINUTES, metavar="TIME",
                       help="wall-time limit of each task and of the reduce, as sbatch takes it: minutes, "
                            f"HH:MM:SS, D-HH:MM (default: {SLURM_TIME_MINUTES} minutes)")
    group.add_argument("--cpus-per-task", type=int, default=1, metavar="N", help="CPUs per task (default: 1)")
    group.add_argument("--mem", default="", help="memory per task, e.g. 16G (default: the cluster's default)")
    group.add_argument("--job-name", default=SLURM_JOB_NAME, help=f"Slurm job name (default: {SLURM_JOB_NAME})")
    group.add_argument("--sbatch-opt", dest="extra_sbatch", action="append", default=[], metavar="--OPTION=VALUE",
                       help="a further sbatch option (repeatable; default: none)")
    group.add_argument("--python", default=sys.executable,
                       help="python with fleetscope on every node (default: this interpreter)")
    group.add_argument("--no-wait", action="store_true", help="submit and return (default: wait and report)")
    group.add_argument("--dry-run", action="store_true", help="print the plan and the scripts; run nothing")


_SLURM_ONLY = ("array_tasks", "max_running", "partition", "account", "qos", "mem", "extra_sbatch", "no_wait",
               "dry_run")


def refuse_slurm_only_flags(args: argparse.Namespace) -> None:
    """Without --slurm, flags of the fan-out would be ignored: refuse them instead."""
    given = [name for name in _SLURM_ONLY if getattr(args, name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-").replace("extra-sbatch", "sbatch-opt") for name in given)
        raise UsageError(f"{flags}: only with --slurm")


def refuse_cache_among_traces(cache_dir: Path, layout: RunLayout) -> Path:
    """`cache_dir`, unless it lies inside this run's traces/ or any run's (cache files would sit among the
    traces, and be read as some): then a UsageError."""
    if is_inside(cache_dir, layout.traces_dir) or run_holding_traces(cache_dir) is not None:
        raise UsageError(f"--cache-dir {cache_dir}: inside a run's traces/: cache files are not written among "
                         "traces (give a folder outside traces/)")
    return cache_dir


def fanout_cache_dir(explicit: Path | None, layout: RunLayout) -> tuple[Path, str]:
    """The cache the fan-out fills, and why that one. An explicit choice (--cache-dir, then
    $FLEETSCOPE_CACHE_DIR) is kept and checked from every task; otherwise not the per-user default
    (~/.cache or $XDG_CACHE_HOME: often node-local), but a folder of the run directory, whose filesystem
    every node sees already (the tasks read the traces from it)."""
    from ..analysis.per_rank.cache import CACHE_DIR_ENV

    if explicit is not None:
        return refuse_cache_among_traces(explicit.expanduser().absolute(), layout), "--cache-dir"
    if os.environ.get(CACHE_DIR_ENV):
        chosen = Path(os.environ[CACHE_DIR_ENV]).expanduser().absolute()
        return refuse_cache_among_traces(chosen, layout), f"${CACHE_DIR_ENV}"
    default = parsed_trace_cache_dir(layout)
    if not is_inside(default, layout.root):
        raise UsageError(f"{default}: resolves outside {layout.root} (a symlink in the run directory?): the "
                         "cache is not written there; give --cache-dir")
    return default, "beside the traces, on the run directory's filesystem"


def shard_keys_of(sources) -> list[ShardKey]:
    """A trace's shard key: its rank, or its label when the rank is not known before reading it."""
    return [source.rank if source.rank is not None else source.label for source in sources]


def handle_fanout_postprocess(args: argparse.Namespace) -> int:
    from ..analysis.inputs.resolve import resolve_input
    from .pipeline import describe_manifest

    layout = RunLayout.at(args.run_dir)
    if not layout.is_run_dir():
        raise UsageError(f"{layout.root}: not a run directory (no job.json, manifest.json or traces/)")
    cache_dir, why = fanout_cache_dir(args.cache_dir, layout)
    config = FanoutConfig(
        run_dir=layout.root, cache_dir=cache_dir, python=args.python, array_tasks=args.array_tasks,
        max_running=args.max_running, job_name=args.job_name, partition=args.partition, account=args.account,
        qos=args.qos, time_minutes=args.time_minutes, cpus_per_task=args.cpus_per_task, mem=args.mem,
        extra_sbatch=tuple(args.extra_sbatch))
    if not args.dry_run:
        from ..traces.gather import gather

        print(describe_manifest(gather(layout.root)))  # the tasks key their cache entries by this manifest
    plan = plan_fanout(config, shard_keys_of(resolve_input(layout.root).sources), secrets.token_hex(8))
    if args.dry_run:
        print(plan.render())
        return EXIT_OK
    prepare_cache(plan)
    print(f"parsed-trace cache: {cache_dir} ({why})")
    return submit_and_follow(plan, wait=not args.no_wait)


def prepare_cache(plan: FanoutPlan) -> None:
    """Create the cache (the cache's own checks: ours, private, a directory) and its visibility file."""
    from ..analysis.per_rank.cache import open_cache

    cache, why_not = open_cache(plan.config.cache_dir)
    if cache is None:
        raise UsageError(f"{why_not}; nothing was submitted")
    marker = cache.directory / VISIBILITY_FILE_FORMAT.format(token=plan.token)
    descriptor = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(f"written by the submitting host {socket.gethostname()}\n")


def submit_and_follow(plan: FanoutPlan, *, wait: bool) -> int:
    from ..launcher.schedulers.slurm import submit_fanout

    submitted = submit_fanout(plan)
    layout = RunLayout.at(plan.config.run_dir)
    print(f"submitted array job {submitted.array_job_id} ({plan.tasks} task(s), logs "
          f"{fanout_task_log(layout, submitted.array_job_id, 0).parent}/fanout-{submitted.array_job_id}_<task>.out)"
          f"; reduce job {submitted.reduce_job_id} runs after it")
    if not wait:
        print(f"follow: sacct -j {submitted.array_job_id},{submitted.reduce_job_id}")
        return EXIT_OK
    return follow(plan, submitted.array_job_id, submitted.reduce_job_id)


def follow(plan: FanoutPlan, array_job_id: str, reduce_job_id: str) -> int:
    """Wait for the array and the reduce; print each task's outcome and the reduce's; the exit code."""
    from ..launcher.schedulers.slurm import array_task_states, wait_for_job
    from .render import print_outputs

    layout = RunLayout.at(plan.config.run_dir)
    wait_for_job(array_job_id, on_change=lambda status: _announce(f"array job {array_job_id}", status))
    reduce = wait_for_job(reduce_job_id, on_change=lambda status: _announce(f"reduce job {reduce_job_id}", status))
    # by then accounting holds every task that ran
    states = array_task_states(array_job_id, plan.tasks, timeout_s=10.0)
    failed_tasks = print_task_outcomes(plan, layout, array_job_id, states)
    record = read_reduce_record(layout, array_job_id)
    if record is None:
        print(f"reduce job {reduce_job_id}: {reduce.state} ({reduce.exit_code}) and left no record; log: "
              f"{fanout_dir(layout, array_job_id) / f'reduce-{reduce_job_id}.out'}", file=sys.stderr)
        return EXIT_FAILED
    print_reduce(record, reduce_job_id, reduce.state)
    print_outputs({name: Path(path) for name, path in record.outputs.items()})
    if record.errors:
        return EXIT_FAILED
    clean = record.complete and not failed_tasks and not record.incomplete and not record.counts.failed
    return EXIT_OK if clean else EXIT_PARTIAL


def _announce(label: str, status) -> None:
    print(f"{label}: {status.state}", flush=True)


def print_task_outcomes(plan: FanoutPlan, layout: RunLayout, array_job_id: str, states: dict) -> int:
    """One line per task; a failed one names its ranks, Slurm's state and its log. Returns the failures."""
    failures = 0
    for task, keys in enumerate(plan.shards):
        state = states.get(task)
        record, why = read_task_record(layout, array_job_id, task)
        where = f" on {state.nodes}" if state is not None and state.nodes else ""
        slurm_state = state.state if state is not None else "NEVER RAN (no accounting record: cancelled before it started?)"
        if record is not None and (state is None or state.state == "COMPLETED"):
            counts = record.counts
            print(f"  task {task}: COMPLETED{where}, {describe_keys(keys)}: {counts.traces} trace(s), "
                  f"{counts.parsed} parsed, {counts.hits} already cached, {len(counts.failed)} unreadable, "
                  f"{record.seconds:.1f} s")
            continue
        failures += 1
        exit_code = f" (exit {state.exit_code})" if state is not None and state.exit_code else ""
        print(f"  task {task}: {slurm_state}{exit_code}{where}, {describe_keys(keys)}: {why or 'no result'}; "
              f"log: {fanout_task_log(layout, array_job_id, task)}", file=sys.stderr)
    return failures


def print_reduce(record: ReduceRecord, reduce_job_id: str, state: str) -> None:
    counts = record.counts
    print(f"reduce job {reduce_job_id}: {state}: {counts.traces} trace(s): {counts.hits} from the cache, "
          f"{counts.parsed} parsed by the reduce, {len(counts.failed)} unreadable")
    for task in record.incomplete:
        print(f"  task {task.task} did not complete ({describe_keys(task.ranks)}): {task.reason}; "
              f"log: {task.log_path}; the reduce parsed its traces itself", file=sys.stderr)
    for problem in counts.failed:
        print(f"  unreadable: {problem.label}: {problem.reason}", file=sys.stderr)
    for error in record.errors:
        print(f"  failed: {error}", file=sys.stderr)


# --- parse-shard / reduce-shards ----------------------------------------------------------------


def register_parse_shard(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("parse-shard", help="one task of a fanned-out parse: its ranks' traces into the "
                                                "parsed-trace cache (what `postprocess --slurm` runs per task)")
    _add_shard_arguments(parser)
    parser.add_argument("--shard", type=int, required=True, metavar="I", help="this task's index, 0..N-1")
    parser.add_argument("--array-job", default=None, help="record the task under this array job id")
    parser.set_defaults(handler=handle_parse_shard)


def register_reduce_shards(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("reduce-shards", help="after the tasks of a fanned-out parse: analyze + merge the "
                                                  "run from the parsed-trace cache")
    _add_shard_arguments(parser)
    parser.add_argument("--array-job", required=True, help="the array job whose task records to read")
    parser.set_defaults(handler=handle_reduce_shards)


def _add_shard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("--of", type=int, required=True, metavar="N", help="tasks of the fan-out")
    parser.add_argument("--cache-dir", type=Path, required=True, help="the shared parsed-trace cache")
    parser.add_argument("--visible", default=None, metavar="TOKEN",
                        help="refuse to run unless the cache holds the submitting host's visibility file")


def handle_parse_shard(args: argparse.Namespace) -> int:
    from ..analysis.inputs.resolve import resolve_input
    from ..analysis.per_rank.parse import parse_traces

    started = time.perf_counter()
    layout, cache = _checked_shard_inputs(args)
    if not 0 <= args.shard < args.of:
        raise UsageError(f"--shard must be in 0..{args.of - 1}, got {args.shard}")
    sources = resolve_input(layout.root).sources
    blocks = shard_blocks(shard_keys_of(sources), args.of)
    mine = set(blocks[args.shard]) if args.shard < len(blocks) else set()
    chosen = [source for source, key in zip(sources, shard_keys_of(sources)) if key in mine]
    outcomes = parse_traces(chosen, workers=_usable_cpus(), cache=cache)
    counts = count_outcomes(outcomes)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"parse-shard {args.shard}/{args.of} on {node}: {describe_keys(mine)}: {counts.traces} trace(s), "
          f"{counts.parsed} parsed into {cache.directory}, {counts.hits} already cached, "
          f"{len(counts.failed)} unreadable")
    for problem in counts.failed:
        print(f"  unreadable: {problem.label}: {problem.reason}", file=sys.stderr)
    if args.array_job is not None:
        record = TaskRecord(array_job_id=_job_id(args.array_job), task=args.shard, tasks=args.of, node=node,
                            ranks=[*blocks[args.shard]] if args.shard < len(blocks) else [], counts=counts,
                            cache_dir=str(cache.directory), seconds=round(time.perf_counter() - started, 3))
        print(f"record: {write_task_record(layout, record)}")
    return EXIT_OK  # unreadable traces are results (named above and again by the reduce), not a failed task


def handle_reduce_shards(args: argparse.Namespace) -> int:
    from ..analysis.inputs.resolve import resolve_input
    from .analysis_args import analyze_options_from_args
    from .pipeline import postprocess

    layout, cache = _checked_shard_inputs(args)
    array_job_id = _job_id(args.array_job)
    blocks = shard_blocks(shard_keys_of(resolve_input(layout.root).sources), args.of)
    incomplete = incomplete_tasks(layout, array_job_id, blocks)
    for task in incomplete:
        print(f"task {task.task} did not complete ({describe_keys(task.ranks)}): {task.reason}; log: "
              f"{task.log_path}; its traces are parsed here", file=sys.stderr)
    outcomes: list = []
    options = dataclasses.replace(analyze_options_from_args(args), cache_dir=cache.directory)  # the checked cache
    post = postprocess(layout.root, options, gather_traces=False, on_parsed=outcomes.extend)
    counts = count_outcomes(outcomes)
    record = ReduceRecord(array_job_id=array_job_id, tasks=args.of, incomplete=incomplete, counts=counts,
                          outputs={name: str(path) for name, path in post.outputs.items()}, errors=post.errors,
                          seconds={name: round(s, 3) for name, s in post.seconds.items()}, complete=post.complete)
    print(f"reduce: {counts.traces} trace(s): {counts.hits} from the cache, {counts.parsed} parsed here, "
          f"{len(counts.failed)} unreadable; record: {write_reduce_record(layout, record)}")
    if args.visible:
        (cache.directory / VISIBILITY_FILE_FORMAT.format(token=args.visible)).unlink(missing_ok=True)
    if post.errors:
        return EXIT_FAILED
    return EXIT_OK if post.complete and not incomplete else EXIT_PARTIAL


def incomplete_tasks(layout: RunLayout, array_job_id: str, blocks: list[tuple[ShardKey, ...]]) -> list[IncompleteTask]:
    """Every task without a valid record of exactly its planned ranks."""
    incomplete = []
    for task, keys in enumerate(blocks):
        record, why = read_task_record(layout, array_job_id, task)
        if record is not None and list(record.ranks) != list(keys):
            why = f"it took {describe_keys(record.ranks)}, not its planned {describe_keys(keys)}"
        elif record is not None:
            continue
        incomplete.append(IncompleteTask(task=task, ranks=list(keys), reason=why,
                                         log_path=str(fanout_task_log(layout, array_job_id, task))))
    return incomplete


def count_outcomes(outcomes: list) -> ParseCounts:
    from ..analysis.inputs.sources import TraceFailure

    failed = [ShardTraceProblem(label=o.label, reason=o.reason) for o in outcomes if isinstance(o, TraceFailure)]
    hits = sum(1 for o in outcomes if not isinstance(o, TraceFailure) and o.from_cache)
    return ParseCounts(traces=len(outcomes), hits=hits, parsed=len(outcomes) - hits - len(failed), failed=failed)


def _checked_shard_inputs(args: argparse.Namespace):
    """The run and the cache of a task or of the reduce, or a UsageError that says what is wrong: the cache
    must pass its own checks and (with --visible) be the directory the submitting host prepared."""
    from ..analysis.per_rank.cache import open_cache

    if args.of < 1:
        raise UsageError(f"--of must be >= 1, got {args.of}")
    layout = RunLayout.at(args.run_dir)
    if not layout.manifest_file.is_file():
        raise UsageError(f"{layout.manifest_file}: no manifest (the submitting host gathers before the fan-out)")
    cache_dir = args.cache_dir.expanduser().absolute()
    refuse_cache_among_traces(cache_dir, layout)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if args.visible is not None:
        if not _TOKEN.match(args.visible):
            raise UsageError(f"--visible: not a token: {args.visible!r}")
        marker = cache_dir / VISIBILITY_FILE_FORMAT.format(token=args.visible)
        if not marker.is_file() or marker.is_symlink():
            raise UsageError(f"{cache_dir} on {node} does not hold {marker.name}, which the submitting host "
                             "wrote there: the cache directory is not on storage shared with it (give "
                             "--cache-dir on shared storage)")
    cache, why_not = open_cache(cache_dir)
    if cache is None:
        raise UsageError(f"on {node}: {why_not}")
    return layout, cache


def _usable_cpus() -> int:
    """The CPUs Slurm gave this task (os.cpu_count() counts the whole node)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id):
        raise UsageError(f"not a Slurm job id: {job_id!r}")
    return job_id


REGISTRY = [register_parse_shard, register_reduce_shards]
