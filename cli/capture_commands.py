"""`fleetscope profile` (record a window of a running job now) and `fleetscope hang` (why a job hung)."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import asdict

from ..analysis.cross_rank.hang import analyze_hang
from ..analysis.cross_rank.outcome import STATE_FAILED, job_outcome
from ..analysis.render.capture_text import FAILURE_TITLE, HANG_TITLE, render_hang
from ..analysis.inputs.records import read_run_records
from ..traces.atomic import write_bytes_atomically
from ..traces.capture import (
    MAX_REQUEST_RANKS,
    MAX_REQUEST_STEPS,
    CaptureRequest,
    RequestError,
    RequestStatus,
    read_status,
    submit_request,
)
from ..traces.jobfile import FINAL_STATUSES, read_job_record
from ..traces.jsontext import strict_dumps
from ..traces.layout import RunLayout
from ..traces.outputs import guard_output
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from .run_commands import int_at_least
from .terminal_text import escape_controls

WAIT_POLL_S = 0.5
ENDED_GRACE_S = 10.0
"""After job.json says the job ended, how long `--wait` still waits for rank 0's last status."""
QUIET_NOTE_S = 120.0
"""`--wait` says so once when rank 0 has recorded no step for this long (a job without job.json may be gone)."""


def register(sub: argparse._SubParsersAction) -> None:
    profile = sub.add_parser("profile", help="ask a running job to record one profiling window now")
    profile.add_argument("run_dir", help="the run directory of a running job")
    profile.add_argument("--steps", type=int_at_least(1, MAX_REQUEST_STEPS), default=2,
                         metavar="N",
                         help=f"how many steps to record (a count; default 2, at most {MAX_REQUEST_STEPS})")
    profile.add_argument("--warmup", type=int_at_least(0, MAX_REQUEST_STEPS), default=1,
                         help="profiled steps discarded first (default 1)")
    profile.add_argument("--ranks", type=_ranks, default=None, metavar="0,3,8", help="only these ranks (default all)")
    profile.add_argument("--wait", action="store_true", help="wait until the window's traces are published")
    profile.add_argument("--timeout", type=_seconds, default=0.0, help="--wait at most this many seconds (default 0: no limit)")
    profile.set_defaults(handler=handle_profile)
    hang = sub.add_parser("hang", help="why a job hung, from its ranks' Flight Recorder dumps")
    hang.add_argument("run_dir", help="the run directory")
    hang.add_argument("--json", dest="json_out", default=None, help="also write the hang report as JSON here")
    hang.set_defaults(handler=handle_hang)


def _ranks(text: str) -> list[int]:
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks, got {text!r}") from None
    if not ranks or ranks[0] < 0:
        raise argparse.ArgumentTypeError(f"expected ranks >= 0, got {text!r}")
    return ranks


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _ranks_problem(layout: RunLayout, ranks: list[int] | None) -> str | None:
    """Ranks the job does not have (from job.json's world size), or too many of them."""
    if ranks is None:
        return None
    if len(ranks) > MAX_REQUEST_RANKS:
        return f"--ranks: at most {MAX_REQUEST_RANKS} ranks"
    try:
        world = read_job_record(layout).get("world_size")
    except ValueError:
        world = None
    limit = world if type(world) is int and world > 0 else MAX_REQUEST_RANKS
    beyond = [r for r in ranks if r >= limit]
    if beyond:
        return f"--ranks: rank {beyond[0]} is not a rank of this job (world size {limit})"
    return None


def handle_profile(args: argparse.Namespace) -> int:
    layout = RunLayout.at(args.run_dir)
    if not layout.root.is_dir() or not (layout.is_run_dir() or layout.metrics_dir.is_dir()):
        print(f"fleetscope profile: {layout.root} is not a run directory", file=sys.stderr)
        return EXIT_USAGE
    ended = _job_ended(layout)
    if ended:
        print(f"fleetscope profile: the job already ended ({ended}); nothing to profile", file=sys.stderr)
        return EXIT_FAILED
    program = _user_program(layout)
    if program:
        print(f"fleetscope profile: this run is your own program ({program}), whose ranks profile the windows of "
              "the schedule given at launch and read no on-demand request; launch it again with `--profile` "
              "covering the steps you want (e.g. --profile wait=100,warmup=2,active=3,repeat=1)", file=sys.stderr)
        return EXIT_USAGE
    problem = _ranks_problem(layout, args.ranks)
    if problem:
        print(f"fleetscope profile: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        request = submit_request(layout, steps=args.steps, warmup=args.warmup, ranks=args.ranks)
    except RequestError as error:
        print(f"fleetscope profile: {error}", file=sys.stderr)
        return EXIT_USAGE
    ranks = "all ranks" if request.ranks is None else f"ranks {request.ranks}"
    print(f"fleetscope: request {request.number} written ({layout.relative(layout.request_file(request.number))}): "
          f"{request.warmup} warmup + {request.steps} recorded step(s) on {ranks}", flush=True)
    if not args.wait:
        print(f"status: {layout.request_status_file(request.number)}")
        return EXIT_OK
    return wait_for_request(layout, request, timeout_s=args.timeout)


def wait_for_request(layout: RunLayout, request: CaptureRequest, *, timeout_s: float) -> int:
    """Print each state the request reaches; EXIT_OK once its traces are published."""
    started, shown, ended_at, quiet_noted = time.monotonic(), None, None, False
    while True:
        status = read_status(layout, request.number)
        if not quiet_noted and shown is None and _seconds_since_last_step(layout) > QUIET_NOTE_S:
            quiet_noted = True
            print(f"note: no rank 0 step recorded for over {QUIET_NOTE_S:.0f} s; the job may have stopped "
                  "(still waiting: Ctrl-C or --timeout)", flush=True)
        if status is not None and status.state != shown:
            shown = status.state
            print(describe_status(status), flush=True)
            if status.final:
                return EXIT_OK if status.state == "published" else EXIT_FAILED
        ended = _job_ended(layout)
        if ended and ended_at is None:
            ended_at = time.monotonic()
        if ended_at is not None and time.monotonic() - ended_at > ENDED_GRACE_S:
            print(f"the job ended ({ended}) before request {request.number} was "
                  f"{'recorded' if shown == 'accepted' else 'served'}", flush=True)
            return EXIT_FAILED
        if timeout_s and time.monotonic() - started > timeout_s:
            print(f"gave up after {timeout_s:g} s; the request stays in place "
                  f"(state: {shown or 'not seen yet'})", flush=True)
            return EXIT_FAILED
        time.sleep(WAIT_POLL_S)


def describe_status(status: RequestStatus) -> str:
    ranks = f"ranks {status.ranks}"
    if status.state == "accepted":
        return (f"accepted: window {status.window}, warmup from step {status.warmup_start}, records steps "
                f"{status.active_start}-{status.end - 1} on {ranks}")
    if status.state == "published":
        return f"published: window {status.window} ({len(status.traces)} trace(s)):\n" + "\n".join(
            f"  {t}" for t in status.traces)
    return f"{status.state.replace('_', ' ')}: {status.reason}"


def _seconds_since_last_step(layout: RunLayout) -> float:
    """Seconds since rank 0 last wrote a step record (0 when it never did: the job may be starting)."""
    try:
        return time.time() - layout.metrics_file(0).stat().st_mtime
    except OSError:
        return 0.0


def _user_program(layout: RunLayout) -> str | None:
    """The user program a run launched (job.json's `program`), shortened for a message; None for the trainer."""
    try:
        program = read_job_record(layout).get("program")
    except ValueError:
        return None
    if not isinstance(program, dict):
        return None
    argv = program.get("argv")
    words = [str(word) for word in argv] if isinstance(argv, list) else []
    return escape_controls(shlex.join(words)[:120]) if words else "a user program"


def _job_ended(layout: RunLayout) -> str | None:
    """The final status job.json records (None: still running, or no job.json)."""
    try:
        status = read_job_record(layout).get("status")
    except ValueError:
        return None
    return status if status in FINAL_STATUSES else None


def no_hang_text(layout: RunLayout) -> str:
    """What `hang` says of a run without a Flight Recorder dump: no rank's watchdog found a collective stuck."""
    ended = _job_ended(layout)
    state = f"the job {ended}" if ended else "the job is running or its end was not recorded"
    return (f"no hang: no rank wrote a Flight Recorder dump under {layout.relative(layout.flight_recorder_dir)} "
            f"({state}; a rank dumps when its watchdog finds a collective stuck)")


def handle_hang(args: argparse.Namespace) -> int:
    layout = RunLayout.at(args.run_dir)
    json_out = guard_output(args.json_out, analyzed=layout.root) if args.json_out else None
    records = read_run_records(layout)
    report = analyze_hang(records)
    if report is None and layout.is_run_dir():  # a healthy run: nothing hung, nothing failed
        print(no_hang_text(layout))
        return EXIT_OK
    if report is None:
        print(f"fleetscope hang: {layout.root} is not a run directory and holds no Flight Recorder dump under "
              f"{layout.flight_recorder_dir}", file=sys.stderr)
        return EXIT_FAILED
    outcome = job_outcome(records, report) if layout.is_run_dir() else None
    failed = outcome is not None and outcome.state == STATE_FAILED   # its peers waited when it died: no hang
    print(escape_controls(render_hang(report, title=FAILURE_TITLE if failed else HANG_TITLE)))
    if json_out:
        write_bytes_atomically((strict_dumps(asdict(report), indent=1) + "\n").encode(), json_out)
        print(f"json: {json_out}")
    return EXIT_OK
