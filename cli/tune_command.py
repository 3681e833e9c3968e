"""`fleetscope tune RUN --apply N`: relaunch RUN's job with advisor finding N applied into a new run
directory, wait for it, then gate RUN against the new run.

Planning (launcher/relaunch.py: job.json spec + the finding's Change -> new JobSpec) is pure; this module
only reads the finding, launches the plan and prints the comparison. Exit codes are the gate's: 0 no
regression, 1 regression (or the new job failed), 2 refused or bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from ..trainer.config import ConfigError
from ..traces.jobfile import now_iso, read_job_record, write_job_record
from ..traces.layout import RunLayout
from ..traces.validate import UsageError
from .cause_commands import add_threshold_argument
from .exit_codes import EXIT_FAILED, EXIT_OK
from .terminal_text import escape_controls

_RULE_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_FINDING_NUMBER = re.compile(r"[0-9]{1,9}")
"""ASCII digits only: str.isdigit() also takes superscripts and other scripts' digits, which int() refuses."""


def register_tune(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tune", help="relaunch a run with one `advise` finding applied, then compare the two")
    parser.add_argument("run", help="run directory fleetscope launched (its job.json holds the launch spec)")
    parser.add_argument("--apply", required=True, metavar="N|RULE",
                        help="the finding to apply: its number in `fleetscope advise RUN`, or its rule name")
    parser.add_argument("--run-dir", dest="new_run_dir", default=None,
                        help="the new run directory (must not exist or be empty; default: RUN-tune-RULE next to RUN)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a further trainer setting, applied after the finding's (repeatable; later wins)")
    parser.add_argument("--dry-run", action="store_true", help="print the exact command and spec; launch nothing")
    add_threshold_argument(parser, "percent worse that the comparison calls a regression")
    parser.add_argument("--allow-env-change", action="store_true",
                        help="compare even if the environment fingerprints of the two runs differ")
    parser.set_defaults(handler=handle_tune)


def handle_tune(args: argparse.Namespace) -> int:
    from ..analysis.advise import advise
    from ..launcher.checks import launch_checks
    from ..launcher.relaunch import plan_relaunch
    from ..launcher.schedulers import scheduler_for

    source = RunLayout.at(Path(args.run).expanduser().absolute())
    spec_fields = recorded_spec(source)
    validated_spec(spec_fields, source)   # a damaged record is named before any finding is picked from it
    index, finding = pick_finding(advise(source.root).findings, args.apply, source.root)
    new_dir = Path(args.new_run_dir).expanduser().absolute() if args.new_run_dir else default_tune_dir(source.root, finding.rule)
    relaunch = plan_relaunch(spec_fields, source_run=source.root, new_run_dir=new_dir,
                             train_args=finding.apply.train_args, env=finding.apply.env, overrides=args.overrides)
    refuse_nonempty(new_dir)
    for note in launch_checks(relaunch.spec, resume=False):   # what `launch` refuses, the relaunch refuses too
        print(f"note: {note}")
    scheduler = scheduler_for(relaunch.spec.scheduler)
    plan = scheduler.plan(relaunch.spec, postprocess=True)
    tuned_from = relaunch.record(finding=index, rule=finding.rule, title=finding.title, change=finding.change)
    print(describe_relaunch(relaunch, tuned_from))
    if args.dry_run:
        print(plan.render())
        return EXIT_OK
    if not launch_and_wait(scheduler, plan, tuned_from):
        return EXIT_FAILED
    return print_comparison(source.root, new_dir, threshold_pct=args.threshold,
                            allow_env_change=args.allow_env_change, finding=finding)


def recorded_spec(layout: RunLayout) -> dict:
    """job.json's launch spec; a UsageError when the directory holds no run fleetscope launched."""
    if not layout.root.is_dir():
        raise UsageError(f"{layout.root}: no such run directory")
    try:
        record = read_job_record(layout)
    except ValueError as error:  # damaged or planted: the relaunch is refused, as for a bad spec
        raise UsageError(str(error)) from error
    spec = record.get("spec")
    if not isinstance(spec, dict):
        why = "has no job.json" if not record else "records no launch spec (spec)"
        raise UsageError(f"{layout.job_file}: {layout.root} {why}: tune relaunches runs `fleetscope launch` "
                         "started (traces of another trainer can be advised, not relaunched)")
    return spec


def validated_spec(spec_fields: dict, layout: RunLayout):
    """The JobSpec job.json records; a ConfigError naming the file and the field when it is damaged."""
    from ..launcher.relaunch import job_spec_from_record
    from ..trainer.config import ConfigError

    try:
        return job_spec_from_record(spec_fields)
    except ConfigError as error:
        raise ConfigError(f"{layout.job_file}: {error}") from error


def pick_finding(findings: list, wanted: str, run: Path) -> tuple[int, object]:
    """(number, finding) for `wanted`: a 1-based number as `advise` prints it, or a rule name."""
    listing = "; ".join(f"{i}. {f.rule}" for i, f in enumerate(findings, 1)) or "none"
    if _FINDING_NUMBER.fullmatch(wanted):
        index = int(wanted)
        if not 1 <= index <= len(findings):
            raise UsageError(f"--apply {wanted}: no such finding for {run} (findings: {listing})")
    elif _RULE_NAME.fullmatch(wanted):
        matches = [i for i, f in enumerate(findings, 1) if f.rule == wanted]
        if not matches:
            raise UsageError(f"--apply {wanted}: no finding of that rule for {run} (findings: {listing})")
        index = matches[0]
    else:
        raise UsageError(f"--apply: expected a finding number or a rule name, got {wanted[:40]!r}")
    finding = findings[index - 1]
    if finding.apply is None:
        raise UsageError(f"--apply {wanted}: finding {index} ({finding.rule}) is not a setting a relaunch can "
                         f"change; do it by hand: {finding.change}")
    return index, finding


def default_tune_dir(run: Path, rule: str) -> Path:
    """RUN-tune-RULE next to RUN, numbered -2, -3, ... past directories already there."""
    base = run.parent / f"{run.name}-tune-{rule}"
    candidate, number = base, 1
    while candidate.exists():
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate


def refuse_nonempty(new_dir: Path) -> None:
    """Nothing already in the new run directory is written over, and a run directory that cannot be made
    is refused before anything starts (--dry-run says so too)."""
    if os.path.islink(new_dir) and not new_dir.exists():
        raise ConfigError(f"run_dir: {new_dir} is a broken symlink (to {os.readlink(new_dir)}); tune does not "
                          "create directories through it (choose another --run-dir)")
    if new_dir.exists() and (not new_dir.is_dir() or any(new_dir.iterdir())):
        raise ConfigError(f"run_dir: {new_dir} exists and is not an empty directory; tune writes a new run only "
                          "into a new or empty directory (choose another --run-dir)")
    blocking = next((parent for parent in new_dir.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"run_dir: {new_dir} cannot be created: {blocking} is not a directory")


def describe_relaunch(relaunch, tuned_from: dict) -> str:
    settings = ", ".join(relaunch.assignments) or "none"
    env = ", ".join(f"{k}={v}" for k, v in relaunch.env.items()) or "none"
    return "\n".join([f"tune: finding {tuned_from['finding']} ({tuned_from['rule']}): {tuned_from['change']}",
                      f"  from {relaunch.source_run} into {relaunch.spec.train.run_dir}",
                      f"  settings applied: {settings}; environment: {env}"])


def launch_and_wait(scheduler, plan, tuned_from: dict) -> bool:
    """Launch the plan (recording `tuned_from` in its job.json before it starts); a batch job is followed to
    its end. True when the new job succeeded."""
    from ..launcher.runs import launch
    from ..launcher.schedulers.slurm import wait_for_run, waited_verdict
    from ..launcher.scheduler import Verdict
    from .pipeline import postprocess
    from .render import print_failed_job, print_state_change, render_status

    layout = RunLayout.at(plan.run_dir)

    def record_origin() -> None:
        layout.root.mkdir(parents=True, exist_ok=True)
        write_job_record(layout, tuned_from={**tuned_from, "at": now_iso()})

    outcome = launch(scheduler, plan, resume=False, postprocess=postprocess, on_start=record_origin)
    if outcome.submission.finished:
        if not outcome.submission.succeeded:
            print_failed_job(layout, outcome.submission, post_ran=outcome.post is not None)
        return outcome.submission.succeeded
    status = wait_for_run(layout, on_change=print_state_change)
    print(escape_controls(render_status(status)))
    return waited_verdict(status) != Verdict.FAILED


def print_comparison(base: Path, new: Path, *, threshold_pct: float, allow_env_change: bool,
                     finding=None) -> int:
    from ..analysis.gate import direction, gate
    from ..analysis.render.gate_terminal import render_directions, render_gate

    # the relaunch changes the job on purpose (an EP degree, say): it is gated against its source all the same
    result = gate([base], [new], threshold_pct=threshold_pct, allow_env_change=allow_env_change,
                  allow_different_jobs=True)
    print(escape_controls(render_gate(result)), end="")
    if result.metrics:
        print("direction (new vs base):")
        print(render_directions(result, {m.name: direction(m) for m in result.metrics}), end="")
    if finding is not None:
        print(prediction_line(finding, result))
    return result.exit_code


def prediction_line(finding, result) -> str:
    """The finding's expected gain against the step time the gate measured on both sides (its own basis: the
    runs' steady steps), so each applied prediction is checked."""
    from ..analysis.gate import STEP_TIME

    step = next((m for m in result.metrics if m.name == STEP_TIME), None)
    predicted = (f"expected up to {finding.expected_gain_ms:.2f} ms/step"
                 if finding.expected_gain_ms is not None else "no gain estimated")
    if step is None or step.base_median is None or step.new_median is None:
        return f"prediction: finding {finding.rule} {predicted}; measured: no step time on both sides"
    saved = step.base_median - step.new_median
    share = (f", {100.0 * saved / finding.expected_gain_ms:.0f}% of the prediction"
             if finding.expected_gain_ms else "")
    return (f"prediction: finding {finding.rule} {predicted}; measured: step time {step.base_median:.2f} -> "
            f"{step.new_median:.2f} ms ({'saved' if saved >= 0 else 'lost'} {abs(saved):.2f} ms/step{share}; "
            "steady steps, slowest rank per step, as the gate above)")


REGISTRY = [register_tune]
