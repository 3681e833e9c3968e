"""`gather` (verify a run's traces, write manifest.json) and `collect-traces` (file the traces a program wrote
itself into a run directory)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..traces.layout import RunLayout
from ..traces.validate import UsageError
from .argtypes import int_list
from .exit_codes import EXIT_OK, EXIT_PARTIAL
from .pipeline import describe_manifest


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
    parser.add_argument("--ranks", "--rank", dest="ranks", type=int_list, action="extend", default=None,
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
