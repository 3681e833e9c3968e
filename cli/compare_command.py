"""`compare`: the regression gate of two runs or reports (the gate itself and its printing: cause_commands.py)."""

from __future__ import annotations

import argparse

from . import cause_commands
from .argtypes import existing_input
from .exit_codes import EXIT_FAILED, EXIT_USAGE
from .terminal_text import escape_controls


def register_compare(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("compare", help="regression gate: exit 1 when NEW is slower than BASE beyond the noise")
    parser.add_argument("base", nargs="?", type=existing_input,
                        help="run directory (= --base BASE); a report.json compares trace step times")
    parser.add_argument("new", nargs="?", type=existing_input, help="run directory (= --new NEW) or report.json")
    cause_commands.add_gate_arguments(parser)
    cause_commands.add_threshold_argument(parser, "percent drop in throughput / rise in step time that fails")
    parser.set_defaults(handler=handle_compare)


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
