"""`merge`: one Perfetto trace of all ranks (the focus set within a size budget, every rank, or shards), and the
rank selection `postprocess` offers too."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..traces.layout import RunLayout
from ..traces.outputs import guard_output
from ..traces.validate import UsageError
from .argtypes import RANKS_ALL, existing_input, int_set, positive_number, rank_choice, time_range
from .defaults import DEFAULT_BUDGET_MB
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL
from .query_command import FETCH_HINT
from .run_commands import int_at_least
from .terminal_text import escape_controls


def register_merge(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("merge", help="one Perfetto trace of all ranks")
    parser.add_argument("path", type=existing_input,
                        help="run directory, or a directory of *.json / *.json.gz traces")
    parser.add_argument("-o", "--output", default=None,
                        help="output .perfetto-trace (default: <run>/report/merged.perfetto-trace)")
    add_merge_selection(parser)
    parser.add_argument("--shard-ranks", type=int_at_least(1), default=None, metavar="N",
                        help="every rank in full, N ranks per file (the same clock), plus a summary file")
    parser.add_argument("--steps", type=int_set, default=None, metavar="STEP[,STEP...]",
                        help="a list of step numbers, e.g. 4,5: only these training steps (default: every step)")
    parser.add_argument("--time-range", dest="time_range", type=time_range, default=None, metavar="START:END",
                        help="only events in this time range, in seconds after the first event (default: all)")
    parser.add_argument("--window", dest="time_range", type=time_range, default=None,
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
    parser.add_argument("--ranks", type=rank_choice, default=None, metavar="all|0,3,8",
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


def _merge_progress():
    from .progress import counting, progress_callback

    return counting(progress_callback("merge", "ranks"))
