"""`fleetscope split FUSED_TRACE -o DIR`: one ordinary trace per rank of a file that fused several ranks."""

from __future__ import annotations

import argparse
import gzip
import shlex
import sys
from pathlib import Path

from ..traces.jsontext import strict_dumps
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from .terminal_text import escape_controls


def register_split(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("split", help="one trace per rank of a file that holds several ranks fused into one "
                                          "(args.rank on each event, or processes named by rank)")
    parser.add_argument("trace", help="the fused trace file (.json or .json.gz)")
    parser.add_argument("-o", "--output", required=True, help="a new or empty directory for rank<R>.pt.trace.json.gz")
    parser.set_defaults(handler=handle_split)


def handle_split(args: argparse.Namespace) -> int:
    from ..traces.atomic import write_bytes_atomically
    from ..traces.fused import split_fused
    from ..traces.kineto import TraceReadError, decode_trace, read_raw

    source, output = Path(args.trace), Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        print(f"fleetscope split: {escape_controls(str(output))} exists and is not an empty directory: nothing "
              "written (split never replaces files)", file=sys.stderr)
        return EXIT_USAGE
    try:
        parts = split_fused(decode_trace(read_raw(source), source))
    except TraceReadError as error:
        print(f"fleetscope split: {escape_controls(str(error))}", file=sys.stderr)
        return EXIT_FAILED
    if not parts:
        print(f"fleetscope split: {escape_controls(str(source))} holds one rank (no args.rank on its events and no "
              "processes named by rank): analyze it as it is", file=sys.stderr)
        return EXIT_USAGE
    for rank, document in parts.items():
        encoded = gzip.compress(strict_dumps(document).encode(), compresslevel=6)
        write_bytes_atomically(encoded, output / f"rank{rank}.pt.trace.json.gz")
    print(f"{len(parts)} rank(s) written to {escape_controls(str(output))}: ranks "
          f"{', '.join(str(r) for r in parts)}; next: fleetscope analyze {shlex.quote(str(output))}")
    return EXIT_OK


REGISTRY = [register_split]
