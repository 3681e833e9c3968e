"""`postprocess`: gather + analyze + merge a finished run directory (here, or fanned out over Slurm with
--slurm: fanout_commands.py)."""

from __future__ import annotations

import argparse
import sys

from ..traces.layout import RunLayout
from ..traces.validate import UsageError
from . import fanout_commands
from .analysis_args import add_analysis_arguments, analyze_options_from_args, given_analysis_flags, refused_oracle
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE
from .merge_command import add_merge_selection, merge_selection
from .pipeline import postprocess
from .render import print_outputs


def register_postprocess(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("postprocess", help="gather + analyze + merge a finished run directory")
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("--timings", action="store_true", help="print each stage's wall time and CPU time (stderr)")
    analysis = parser.add_argument_group("what analyze takes (the same flags as `fleetscope analyze`; with --slurm "
                                         "only --cache-dir)")
    add_analysis_arguments(analysis, cache_dir_help=CACHE_DIR_HELP)
    stages = parser.add_argument_group("what merge takes (not with --slurm)")
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


CACHE_DIR_HELP = ("parsed-trace cache of analyze and merge (default: $FLEETSCOPE_CACHE_DIR, else "
                  "~/.cache/fleetscope/analysis; with --slurm, on shared storage: $FLEETSCOPE_CACHE_DIR if set, "
                  "else RUN/cache/parsed-traces)")


def handle_postprocess(args: argparse.Namespace) -> int:
    if args.slurm:   # the fan-out checks its run directory itself (exit 2: not a run directory)
        given = given_analysis_flags(args, besides=("cache_dir",))   # the fan-out's cache: fanout_cache_dir
        given += [flag for flag, value in (("--ranks", args.ranks), ("--budget-mb", args.budget_mb)) if value is not None]
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
    post = postprocess(args.run_dir, analyze_options_from_args(args), merge_options=merge_selection(args))
    print_outputs(post.outputs)
    if args.timings:
        for stage, seconds in post.seconds.items():
            print(f"{stage} took {seconds:.2f} s (CPU {post.cpu_seconds.get(stage, 0.0):.2f} s)", file=sys.stderr)
    if post.errors:
        return EXIT_FAILED
    return EXIT_OK if post.complete else EXIT_PARTIAL
