"""The sub-commands of `fleetscope`; each registers its parser and handles its arguments."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from ..launcher.checks import launch_checks
from ..launcher.runs import LaunchOutcome, launch
from ..launcher.scheduler import LaunchPlan
from ..launcher.schedulers import scheduler_for
from ..launcher.schedulers.slurm import wait_for_run, waited_verdict
from ..launcher.spec import JobSpec
from ..trainer.config import ConfigError
from ..traces.layout import RunLayout
from . import cause_commands, fanout_commands
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, exit_code
from ..traces.outputs import guard_output
from ..traces.validate import UsageError
from .jobargs import add_job_arguments, job_spec_from_args
from .pipeline import describe_manifest, postprocess
from .capture_commands import register as register_capture
from .query_command import FETCH_HINT, register as register_query
from .run_commands import int_at_least
from .render import print_failed_job, print_outputs, print_state_change, print_submitted, render_status
from .terminal_text import escape_controls


# --- launch / demo --------------------------------------------------------------------------


def register_launch(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("launch", help="start a training job (local torchrun or Slurm)",
                            description=LAUNCH_DESCRIPTION)
    add_job_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the exact command; run nothing")
    parser.add_argument("--resume", action="store_true", help="allow an existing run directory (resume)")
    parser.add_argument("--no-postprocess", dest="no_post", action="store_true",
                        help="skip gather/analyze/merge after the job")
    parser.add_argument("--no-post", dest="no_post", action="store_true", help=argparse.SUPPRESS)  # older spelling
    parser.add_argument("--wait", action="store_true",
                        help="Slurm: wait for the job and its post-processing, then print the outcome")
    parser.set_defaults(handler=handle_launch)


LAUNCH_DESCRIPTION = (
    "Start a training job: fleetscope's trainer, or your program after --. Every rank runs with NVLink "
    "multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1: NVLS and "
    "symmetric-memory multicast can fail or hang on shared multi-GPU hosts); --env NAME=VALUE overrides any of them.")


def handle_launch(args: argparse.Namespace) -> int:
    spec = job_spec_from_args(args)
    for note in launch_checks(spec, resume=args.resume):  # the same checks, dry run or not
        print(f"fleetscope: {note}", file=sys.stderr)
    scheduler = scheduler_for(spec.scheduler)
    plan = scheduler.plan(spec, postprocess=not args.no_post)
    if args.dry_run:
        print(plan.render())
        return EXIT_OK
    announce = (lambda: print(f"fleetscope: running {spec.world_size} rank(s) into {plan.run_dir}", flush=True)
                if spec.scheduler == "local" else None)
    outcome = launch(scheduler, plan, resume=args.resume, postprocess=None if args.no_post else postprocess,
                     on_start=announce)
    if outcome.submission.finished:
        print_foreground_outcome(plan, outcome)
        return exit_code(outcome.verdict)
    return report_submission(spec, plan, outcome, wait=args.wait)


def print_foreground_outcome(plan: LaunchPlan, outcome: LaunchOutcome) -> None:
    if not outcome.submission.succeeded:
        print_failed_job(RunLayout.at(plan.run_dir), outcome.submission, post_ran=outcome.post is not None)
    if outcome.post is not None:
        print_outputs(outcome.post.outputs)


def report_submission(spec: JobSpec, plan: LaunchPlan, outcome: LaunchOutcome, *, wait: bool) -> int:
    """A queued job: say where to follow it; with --wait, follow it to the end."""
    layout = RunLayout.at(plan.run_dir)
    print_submitted(outcome.submission, layout, nodes=spec.nodes, nproc_per_node=spec.nproc_per_node)
    if not wait:
        return EXIT_OK
    status = wait_for_run(layout, on_change=print_state_change)
    print(escape_controls(render_status(status)))
    return exit_code(waited_verdict(status))


def register_demo(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="2-rank CPU run of the tiny MoE, profiled, analyzed, merged")
    parser.add_argument("--runs-root", default="runs", help="where the run directory is created (default: runs)")
    parser.add_argument("--model", default="qwen3_moe",
                        help="model family: mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, gpt_oss "
                             "(default: qwen3_moe)")
    parser.add_argument("--parallel", default="fsdp", help="parallel mode: ddp, fsdp, tp, fsdp_tp (default: fsdp)")
    parser.add_argument("--steps", type=int_at_least(1), default=10, metavar="N",
                        help="how many training steps to run (a count; default: 10)")
    parser.set_defaults(handler=handle_demo)


def handle_demo(args: argparse.Namespace) -> int:
    launch_args = build_launch_parser().parse_args([
        "--runs-root", args.runs_root, "--model", args.model, "--preset", "tiny", "--parallel", args.parallel,
        "--steps", str(args.steps), "--nproc-per-node", "2", "--device", "cpu",
        "--profile", "wait=1,warmup=1,active=2,repeat=2",
    ])
    return handle_launch(launch_args)


def build_launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetscope launch")
    sub = parser.add_subparsers()
    register_launch(sub)
    return sub.choices["launch"]


# --- train / gather / postprocess -------------------------------------------------------------


def register_train(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="one rank of a run (what torchrun/srun start on every GPU)",
                            add_help=False)
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER,
                        help="the trainer's flags (`fleetscope train --help` lists them)")
    parser.set_defaults(handler=lambda args: run_trainer(args.trainer_args))


def run_trainer(argv: list[str]) -> int:
    from ..trainer.__main__ import main as trainer_main

    code = trainer_main(argv)
    return 0 if code is None else code  # None: torch's @record returns it for --help (SystemExit 0)


def register_gather(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("gather", help="verify a run's traces and write manifest.json")
    parser.add_argument("run_dir", help="the run directory")
    parser.set_defaults(handler=handle_gather)


def handle_gather(args: argparse.Namespace) -> int:
    from ..traces.gather import gather

    manifest = gather(args.run_dir)
    print(describe_manifest(manifest))
    print(f"manifest: {RunLayout.at(args.run_dir).manifest_file}")
    return EXIT_OK if manifest.complete else EXIT_PARTIAL


def register_collect(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("collect-traces", help="file traces a program wrote itself into a run directory "
                                                   "(what --collect-traces runs on every node after the job)")
    parser.add_argument("run_dir", help="the run directory the traces are filed into")
    parser.add_argument("pattern", metavar="GLOB",
                        help="e.g. torchtitan's 'outputs/profiling/traces/iteration_*/rank*_trace.json.gz'")
    parser.add_argument("--ranks", "--rank", dest="ranks", type=_int_list, action="extend", default=None,
                        metavar="R[,R...]", help="collect only these ranks' traces (repeatable; default: every rank)")
    parser.set_defaults(handler=handle_collect)


def handle_collect(args: argparse.Namespace) -> int:
    from ..launcher.schedulers.local import report_collection
    from ..traces.collect import collect_traces
    from ..traces.launch_env import restart_attempt

    if not RunLayout.at(args.run_dir).root.is_dir():
        raise UsageError(f"{RunLayout.at(args.run_dir).root}: no such run directory (collect-traces files traces "
                         "into a run that exists; it creates none)")
    collection = collect_traces(str(Path(args.pattern).expanduser().absolute()), RunLayout.at(args.run_dir),
                                ranks=set(args.ranks) if args.ranks is not None else None,
                                attempt=restart_attempt())
    report_collection(collection)
    return EXIT_PARTIAL if collection.incomplete else EXIT_OK


def register_postprocess(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("postprocess", help="gather + analyze + merge a finished run directory")
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("--timings", action="store_true", help="print each stage's wall time and CPU time (stderr)")
    stages = parser.add_argument_group("what analyze and merge take (not with --slurm)")
    stages.add_argument("--no-cache", action="store_true", help="analyze, merge: parse every trace again")
    stages.add_argument("--no-hta", action="store_true", help="analyze: skip Holistic Trace Analysis (GPU traces)")
    stages.add_argument("--hta-oracle", action="store_true",
                        help="analyze: also run stock HTA's analyzers and record per table the difference (needs HTA)")
    stages.add_argument("--link-peak", type=positive_number, default=None, metavar="GBPS",
                        help="analyze: peak bus bandwidth of the links in GB/s (default: the table of known links)")
    add_merge_selection(stages)
    fanout_commands.add_fanout_arguments(parser)
    parser.set_defaults(handler=handle_postprocess)


def postprocess_refusal(run_dir: str) -> int | None:
    """Before postprocess writes anything into `run_dir` (manifest.json, report/): EXIT_USAGE for a path that
    is missing or not a directory, EXIT_FAILED for a directory with no traces/ folder of traces (not a run:
    $HOME, /, an empty folder), after saying so; None to go on."""
    import os
    import stat

    from ..traces.kineto import find_trace_like_entries

    layout = RunLayout.at(run_dir)
    try:
        is_dir = stat.S_ISDIR(os.stat(layout.root).st_mode)
    except OSError as error:
        print(f"fleetscope postprocess: {layout.root}: {error.strerror or error}", file=sys.stderr)
        return EXIT_USAGE
    if not is_dir:
        print(f"fleetscope postprocess: {layout.root}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    traces = layout.traces_dir
    if traces.is_symlink() or not traces.is_dir() or not find_trace_like_entries(traces):
        print(f"fleetscope postprocess: {layout.root}: no traces under {traces.name}/ (not a run directory, or "
              "a run that recorded none): nothing written", file=sys.stderr)
        return EXIT_FAILED
    return None


_STAGE_FLAGS = ("no_cache", "no_hta", "hta_oracle", "link_peak", "ranks", "budget_mb")


def handle_postprocess(args: argparse.Namespace) -> int:
    if args.slurm:   # the fan-out checks its run directory itself (exit 2: not a run directory)
        given = [f"--{name.replace('_', '-')}" for name in _STAGE_FLAGS if getattr(args, name) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)}: not with --slurm (the fanned-out parse and its reduce take "
                             "the defaults)")
        return fanout_commands.handle_fanout_postprocess(args)
    refused = postprocess_refusal(args.run_dir)
    if refused is not None:
        return refused
    fanout_commands.refuse_slurm_only_flags(args)
    if refused_oracle(args, "postprocess"):
        return EXIT_USAGE
    post = postprocess(args.run_dir, cache_dir=args.cache_dir, use_cache=not args.no_cache, use_hta=not args.no_hta,
                       link_peak_gbps=args.link_peak, merge_options=merge_selection(args),
                       hta_oracle=args.hta_oracle)
    print_outputs(post.outputs)
    if args.timings:
        for stage, seconds in post.seconds.items():
            print(f"{stage} took {seconds:.2f} s (CPU {post.cpu_seconds.get(stage, 0.0):.2f} s)", file=sys.stderr)
    if post.errors:
        return EXIT_FAILED
    return EXIT_OK if post.complete else EXIT_PARTIAL


# --- analyze / merge / compare -----------------------------------------------------------------


def register_analyze(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("analyze", help="report on a run directory or any directory of Kineto traces")
    parser.add_argument("path", type=existing_input,
                        help="run directory, or a directory of *.json / *.json.gz traces")
    parser.add_argument("--json", dest="json_out", default=None, help="write the report JSON here")
    parser.add_argument("--html", dest="html_out", default=None, help="write the HTML report here")
    parser.add_argument("--no-hta", action="store_true", help="skip Holistic Trace Analysis (GPU traces)")
    parser.add_argument("--hta-ranks", default="auto", metavar="auto|all|LIST",
                        help="ranks HTA's views cover: auto (slowest, waited for, fastest, median, one per host; "
                             "at most 16 per window), all, or a list like 0,3,7 (default: auto)")
    parser.add_argument("--hta-oracle", action="store_true",
                        help="also run stock HTA's analyzers on the same ranks and record, per table, the largest "
                             "difference from fleetscope's own computation (report.json: hta.oracle; needs HTA)")
    parser.add_argument("--no-cache", action="store_true",
                        help="parse every trace again instead of reusing results of identical trace files")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="parsed-trace cache (default: $FLEETSCOPE_CACHE_DIR, else ~/.cache/fleetscope/analysis)")
    parser.add_argument("--link-peak", type=positive_number, default=None, metavar="GBPS",
                        help="peak bus bandwidth of the links (GB/s), instead of the table of known links")
    parser.add_argument("--check", action="store_true",
                        help="also check the report's invariants (analysis/invariants.py: no negative times, shares "
                             "that sum, what-ifs within their step, the verdict's rank); exit 1 when one breaks")
    parser.add_argument("--comm-kernel-pattern", default=None, metavar="REGEX", help="kernels matching it communicate too (e.g. DeepEP dispatch/combine kernels), besides NCCL's")
    parser.set_defaults(handler=handle_analyze)


def refused_oracle(args: argparse.Namespace, command: str) -> bool:
    """--hta-oracle without HTA installed: say so in one line (True: the command stops)."""
    from ..analysis.per_rank.hta_rank_views import hta_installed

    if args.hta_oracle and not args.no_hta and not hta_installed():
        print(f"fleetscope {command}: --hta-oracle runs stock HTA, which is not installed "
              "(pip install 'fleetscope[hta]')", file=sys.stderr)
        return True
    return False


def handle_analyze(args: argparse.Namespace) -> int:
    from ..analysis import analyze
    from ..analysis.advise import top_findings
    from ..analysis.render.terminal import render_terminal
    from ..analysis.report.build import parse_hta_ranks

    if refused_oracle(args, "analyze"):
        return EXIT_USAGE
    layout = RunLayout.at(args.path)
    json_out, html_out = args.json_out, args.html_out
    if layout.is_run_dir():
        json_out = json_out or layout.report_json
        html_out = html_out or layout.report_html
    report = analyze(layout.root, json_out=json_out, html_out=html_out, use_hta=not args.no_hta,
                     hta_ranks=parse_hta_ranks(args.hta_ranks), hta_oracle=args.hta_oracle,
                     progress=progress_printer("analyze"),
                     hta_progress=progress_printer("HTA"), use_cache=not args.no_cache, cache_dir=args.cache_dir,
                     link_peak_gbps=args.link_peak, comm_kernel_pattern=args.comm_kernel_pattern,
                     advisor=top_findings)
    print(escape_controls(render_terminal(report)))   # names from traces are untrusted text
    for label, path in (("json", json_out), ("html", html_out)):
        if path:
            print(f"{label}: {path}")
    if not report.ranks:
        return EXIT_FAILED  # nothing analyzed is a failure, not a partial result
    if args.check and not _invariants_hold(report):
        return EXIT_FAILED
    return EXIT_OK if report.complete else EXIT_PARTIAL


def _invariants_hold(report) -> bool:
    from ..analysis.invariants import check_report

    problems = check_report(report)
    print(f"check: {len(problems)} invariant violation(s)" if problems else "check: every invariant holds")
    for problem in problems[:50]:
        print(f"  {problem}")
    return not problems


def register_merge(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("merge", help="one Perfetto trace of all ranks")
    parser.add_argument("path", type=existing_input,
                        help="run directory, or a directory of *.json / *.json.gz traces")
    parser.add_argument("-o", "--output", default=None,
                        help="output .perfetto-trace (default: <run>/report/merged.perfetto-trace)")
    add_merge_selection(parser)
    parser.add_argument("--shard-ranks", type=int_at_least(1), default=None, metavar="N",
                        help="every rank in full, N ranks per file (the same clock), plus a summary file")
    parser.add_argument("--steps", type=_int_set, default=None, metavar="STEP[,STEP...]",
                        help="a list of step numbers, e.g. 4,5: only these training steps (default: every step)")
    parser.add_argument("--time-range", dest="time_range", type=_time_range, default=None, metavar="START:END",
                        help="only events in this time range, in seconds after the first event (default: all)")
    parser.add_argument("--window", dest="time_range", type=_time_range, default=None,
                        help=argparse.SUPPRESS)  # older spelling of --time-range ("window" is a profiling window)
    parser.add_argument("--no-python", action="store_true", help="drop python_function events")
    parser.add_argument("--no-flows", action="store_true", help="no launch->kernel or cross-rank arrows")
    parser.add_argument("--no-overlays", action="store_true", help="no 'fleetscope analysis' tracks")
    parser.add_argument("--args", action="store_true", help="keep each event's args (larger output)")
    parser.add_argument("--json-trace", dest="json_trace", nargs="?", const="", default=None, metavar="PATH",
                        help="also write the merged trace as Chrome JSON (a trace, not a report; default: none; "
                             "PATH omitted: beside -o as NAME.trace.json.gz, or <run>/report/merged.trace.json.gz)")
    parser.add_argument("--json", dest="json_trace", nargs="?", const="", default=None,
                        help=argparse.SUPPRESS)  # older spelling of --json-trace (--json writes a report elsewhere)
    parser.add_argument("--workers", type=int, default=None,
                        help="ranks merged at once (default: one per core, at most 8)")
    parser.add_argument("--verify", action="store_true", help="read the output back and check it")
    parser.add_argument("--trace-processor", default=None, metavar="PATH",
                        help="--verify with this trace_processor_shell (default: $FLEETSCOPE_TRACE_PROCESSOR, else "
                             "trace_processor_shell on PATH; without one only the read-back runs; "
                             f"{FETCH_HINT})")
    parser.set_defaults(handler=handle_merge)


def add_merge_selection(parser) -> None:
    """--ranks and --budget-mb: which ranks the merged trace draws (merge, postprocess)."""
    parser.add_argument("--ranks", type=_rank_choice, default=None, metavar="all|0,3,8",
                        help="merge: all: every rank in full (no summary); a list: only these ranks. Default: the "
                             "ranks the report names, their group peers, the median rank and one per host, within "
                             "--budget-mb (every rank when all fit: a smaller budget merges faster), plus a summary "
                             "track of every rank")
    parser.add_argument("--budget-mb", type=positive_number, default=None, metavar="MB",
                        help=f"merge: size budget of the default output in MB, 10^6 bytes (default {DEFAULT_BUDGET_MB} MB)")


def merge_selection(args: argparse.Namespace, *, shard_ranks: int | None = None):
    """The MergeOptions that --ranks, --budget-mb and --shard-ranks select (the rest at their defaults)."""
    from ..analysis.merge.focus import FocusConfig
    from ..analysis.merge.options import MergeOptions

    if args.budget_mb is not None and (args.ranks is not None or shard_ranks is not None):
        raise UsageError("--budget-mb sizes the default focus set: it cannot be combined with --ranks or --shard-ranks")
    budget = FocusConfig(budget_bytes=round(args.budget_mb * 1e6)) if args.budget_mb is not None else FocusConfig()
    return MergeOptions(ranks=args.ranks if args.ranks != RANKS_ALL else None,
                        focus=None if args.ranks == RANKS_ALL else budget, shard_ranks=shard_ranks)


def _int_list(text: str) -> list[int]:
    return sorted(_int_set(text))


def _rank_choice(text: str) -> frozenset[int] | str:
    return RANKS_ALL if text.strip() == RANKS_ALL else _int_set(text)



RANKS_ALL = "all"
DEFAULT_BUDGET_MB = 400
"""analysis/merge/focus.py DEFAULT_BUDGET_BYTES in MB, for the help text (the CLI imports the analysis lazily)."""


def _int_set(text: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _time_range(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        window = float(start), float(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not all(math.isfinite(v) for v in window) or window[0] >= window[1]:
        raise argparse.ArgumentTypeError(f"expected finite START < END in seconds, got {text!r}")
    return window


def existing_input(text: str) -> str:
    """An input path of a read command: a missing one is bad usage (exit 2), found before any work."""
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return text


def _json_beside(output: str | None, layout: RunLayout) -> Path:
    """Where --json-trace without a path writes: beside -o's trace when -o is given (never into the run behind the
    user's back), else the run's report/merged.trace.json.gz."""
    if output is None:
        return layout.merged_json
    out = Path(output)
    return out.with_name(out.name.removesuffix(".perfetto-trace").removesuffix(".pftrace") + ".trace.json.gz")


def handle_merge(args: argparse.Namespace) -> int:
    from ..analysis.merge.run import merge
    from ..analysis.merge.perfetto.sql import find_trace_processor
    from ..analysis.merge.verify import verify_outputs
    from .merge_messages import describe_merge, describe_problems

    layout = RunLayout.at(args.path)
    if args.output is None and not layout.is_run_dir():
        raise UsageError("-o OUT.perfetto-trace is required for a directory that is not a run directory")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    output = guard_output(args.output or layout.merged_trace, analyzed=layout.root)
    chrome_json = None if args.json_trace is None else guard_output(
        args.json_trace or _json_beside(args.output, layout), analyzed=layout.root)
    if args.shard_ranks is not None and (args.ranks is not None or chrome_json is not None):
        raise UsageError("--shard-ranks draws every rank: it cannot be combined with --ranks or --json-trace")
    options = dataclasses.replace(merge_selection(args, shard_ranks=args.shard_ranks), steps=args.steps,
                                  time_window_s=args.time_range, drop_python_functions=args.no_python,
                                  flows=not args.no_flows, collective_flows=not args.no_flows,
                                  overlays=not args.no_overlays, event_args=args.args, chrome_json=chrome_json,
                                  workers=args.workers)
    result = merge(layout.root, output, options=options, progress=_merge_progress())
    for line in describe_merge(result):
        print(line)
    for line in describe_problems(result.problems):
        print(f"  {escape_controls(line)}", file=sys.stderr)
    failures = verify_outputs(result, trace_processor=args.trace_processor, engine=True) if (
        (args.verify or args.trace_processor) and result.ranks) else []
    for failure in failures:
        print(f"  verification failed: {failure}", file=sys.stderr)
    if (args.verify or args.trace_processor) and result.ranks and not failures:
        engine = find_trace_processor(args.trace_processor)
        print(f"verified: read back{f', and loaded in {engine}' if engine else ' (no trace processor found)'}")
    if result.ranks:
        print(f"open it at https://ui.perfetto.dev -> 'Open trace file' -> {result.outputs[0]}")
    if chrome_json is not None and Path(chrome_json).is_file():
        print(f"the same as Chrome JSON: {chrome_json}")
    if failures or not result.ranks:
        return EXIT_FAILED
    return EXIT_OK if not result.problems else EXIT_PARTIAL


def register_compare(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("compare", help="regression gate: exit 1 when NEW is slower than BASE beyond the noise")
    parser.add_argument("base", nargs="?", type=existing_input,
                        help="run directory (= --base BASE); a report.json compares trace step times")
    parser.add_argument("new", nargs="?", type=existing_input, help="run directory (= --new NEW) or report.json")
    cause_commands.add_gate_arguments(parser)
    cause_commands.add_threshold_argument(parser, "percent drop in throughput / rise in step time that fails")
    parser.set_defaults(handler=handle_compare)


def positive_number(text: str) -> float:
    """A finite number > 0: a threshold in percent (nan, inf, 0 or a negative one would disable the gate), or a
    link's peak bandwidth."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def handle_compare(args: argparse.Namespace) -> int:
    """Both forms, one rule: the gate (cause_commands.wants_gate), else one report or trace a side compared
    on the trace step time."""
    from ..analysis import compare
    from ..analysis.render.terminal import render_comparison

    sides = cause_commands.compared_runs(args)
    if sides is None:
        return EXIT_USAGE
    if cause_commands.wants_gate(*sides):
        return cause_commands.handle_gate(args, *sides)
    (base,), (new,) = sides
    refused = cause_commands.environment_refusal(args, [base, new])
    if refused is not None:
        return refused
    comparison = compare(base, new, threshold_pct=args.threshold, allow_different_jobs=args.allow_different_jobs)
    print(escape_controls(render_comparison(comparison)))
    if comparison.exit_code == EXIT_FAILED:     # a regression: where the time went, from the traces
        cause_commands.print_where_time_moved(str(base), str(new))
    return comparison.exit_code


def _merge_progress():
    from .progress import counting, progress_callback

    return counting(progress_callback("merge", "ranks"))


def progress_printer(label: str):
    """Progress on stderr: a bar on a terminal, a status line every 10 s otherwise (cli/progress.py)."""
    from .progress import progress_callback

    return progress_callback(label)


REGISTRY = [
    register_launch, register_train, register_collect, register_gather, register_analyze, register_merge,
    register_postprocess, register_demo, register_compare, register_query, register_capture,
    *fanout_commands.REGISTRY,
]
