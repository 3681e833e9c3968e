"""`fleetscope query MERGED_TRACE "SQL"` (or `--named NAME`): Perfetto SQL over a merged trace."""

from __future__ import annotations

import argparse
import csv
import sys
import shlex
from pathlib import Path

from ..traces.layout import RunLayout
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from .terminal_text import escape_controls

FETCH_HINT = ("to get one, the perfetto package fleetscope depends on downloads the build it pins (SHA-256 "
              "checked, kept in ~/.local/share/perfetto) and prints its path: python -c 'from "
              "perfetto.prebuilts.perfetto_prebuilts import get_perfetto_prebuilt as get; from "
              "perfetto.prebuilts.manifests.trace_processor_shell import TRACE_PROCESSOR_SHELL_MANIFEST as tp; "
              "print(get(tp))'")
"""Where a trace_processor_shell comes from, for help texts and the message when none is found."""


def register(sub: argparse._SubParsersAction) -> None:
    from ..analysis.merge.perfetto.queries import NAMED_QUERIES

    parser = sub.add_parser("query", help="SQL over a merged trace, in Perfetto's trace processor")
    parser.add_argument("trace", help="a merged .perfetto-trace, or a run directory (its report/merged.perfetto-trace)")
    parser.add_argument("sql", nargs="?", default=None, help="one SQL statement (the last one's rows are printed)")
    parser.add_argument("--named", choices=sorted(NAMED_QUERIES), default=None, help="a query shipped with fleetscope")
    parser.add_argument("--trace-processor", default=None, metavar="PATH",
                        help="trace_processor_shell (default: $FLEETSCOPE_TRACE_PROCESSOR, else "
                             f"trace_processor_shell on PATH; {FETCH_HINT})")
    parser.set_defaults(handler=handle_query)


def handle_query(args: argparse.Namespace) -> int:
    from ..analysis.merge.perfetto.queries import NAMED_QUERIES, NO_ROWS
    from ..analysis.merge.perfetto.sql import TraceProcessorError, find_trace_processor, run_query_table

    if (args.sql is None) == (args.named is None):
        print("give either SQL or --named NAME", file=sys.stderr)
        return EXIT_USAGE
    try:
        binary = find_trace_processor(args.trace_processor)
    except FileNotFoundError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    if binary is None:
        print("no trace_processor_shell found: pass --trace-processor PATH, set FLEETSCOPE_TRACE_PROCESSOR or put "
              f"one on PATH; {FETCH_HINT}", file=sys.stderr)
        return EXIT_USAGE
    trace = merged_trace_of(Path(args.trace))
    if trace is None:
        quoted = shlex.quote(str(args.trace))
        print(f"{escape_controls(str(args.trace))}: no merged trace there (report/merged.perfetto-trace): fleetscope "
              f"postprocess {quoted} writes one for a run, fleetscope merge {quoted} -o OUT for any folder of traces",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        columns, rows = run_query_table(trace, NAMED_QUERIES[args.named] if args.named else args.sql, binary)
    except TraceProcessorError as error:
        print(error, file=sys.stderr)
        return EXIT_FAILED
    write_rows(rows, sys.stdout, columns=columns)
    if not rows:
        print(f"no rows: {NO_ROWS[args.named] if args.named else 'the statement selected nothing'}", file=sys.stderr)
    return EXIT_OK


def merged_trace_of(path: Path) -> Path | None:
    """The trace to query: `path` itself, or a run directory's merged trace (None where it has none)."""
    if not path.is_dir():
        return path
    merged = RunLayout.at(path).merged_trace
    return merged if merged.is_file() else None


def write_rows(rows: list[dict[str, str]], out, *, columns: list[str] | None = None) -> None:
    """CSV with a header line, the header alone for no rows (nothing without columns either)."""
    fieldnames = columns or (list(rows[0]) if rows else [])
    if fieldnames:
        writer = csv.DictWriter(out, fieldnames=[escape_controls(str(f)) for f in fieldnames], lineterminator="\n")
        writer.writeheader()
        # names in a trace are the run's files' text: a terminal never gets their control sequences
        writer.writerows({escape_controls(str(k)): escape_controls(str(v)) if isinstance(v, str) else v
                          for k, v in row.items()} for row in rows)
