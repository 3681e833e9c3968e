"""`fleetscope diff A B`: where the step's time moved between two runs, trace directories or trace files."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..traces.jsontext import strict_dumps
from ..traces.outputs import guard_output
from .exit_codes import EXIT_OK, EXIT_PARTIAL
from .terminal_text import escape_controls


def register_diff(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("diff", help="where the step's time moved from A to B: each kernel, copy and fill, the "
                                         "GPU idle and the overlap, per step, largest change first")
    parser.add_argument("a", help="run directory, directory of traces or trace file (the before)")
    parser.add_argument("b", help="the same for the after")
    parser.add_argument("--json", dest="json_out", help="write the diff as JSON here")
    parser.add_argument("--html", dest="html_out", help="write the diff as a self-contained HTML page here")
    parser.set_defaults(handler=handle_diff)


def handle_diff(args: argparse.Namespace) -> int:
    from ..analysis.diff import diff
    from ..analysis.render.diff_html import render_diff_html
    from ..analysis.render.diff_terminal import render_diff
    from ..traces.atomic import write_bytes_atomically

    json_out = guard_output(args.json_out, analyzed=Path(args.a)) if args.json_out else None
    html_out = guard_output(args.html_out, analyzed=Path(args.a)) if args.html_out else None
    result = diff(args.a, args.b)
    if not (result.a.ranks and result.b.ranks):
        empty = [side.label for side in (result.a, result.b) if not side.ranks]
        print(f"fleetscope diff: {escape_controls(' and '.join(empty))}: no GPU trace with profiled steps to "
              "partition (diff partitions the GPU's time; for CPU runs, compare their steps with `fleetscope "
              "compare`)", file=sys.stderr)
        for side, name in ((result.a, "A"), (result.b, "B")):
            for problem in side.problems:
                print(f"  problem ({name}): {escape_controls(problem)}", file=sys.stderr)
        return EXIT_PARTIAL
    print(escape_controls(render_diff(result)), end="")
    if json_out:
        write_bytes_atomically((strict_dumps(diff_document(result), indent=2) + "\n").encode(), json_out)
    if html_out:
        write_bytes_atomically(render_diff_html(result).encode(), html_out)
    return EXIT_PARTIAL if result.a.problems or result.b.problems else EXIT_OK


def diff_document(result) -> dict:
    """The diff as JSON: every field, with each item's change, status and the derived totals."""
    def items(listed):
        return [{**dataclasses.asdict(item), "change_ms": item.change_ms, "status": item.status} for item in listed]

    return {**dataclasses.asdict(result), "span_change_ms": result.span_change_ms,
            "span_noise_ms": result.span_noise_ms, "report_change_ms": result.report_change_ms,
            "unexplained_ms": result.unexplained_ms, "items": items(result.items),
            "host_calls": items(result.host_calls), "phases": items(result.phases), "ops": items(result.ops),
            "collectives": items(result.collectives)}


REGISTRY = [register_diff]
