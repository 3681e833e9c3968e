"""`analyze`: the report of a run directory or of any directory of Kineto traces."""

from __future__ import annotations

import argparse

from ..traces.layout import RunLayout
from .analysis_args import add_analysis_arguments, analyze_options_from_args, progress_printer, refused_oracle
from .argtypes import existing_input
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE
from .terminal_text import escape_controls


def register_analyze(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("analyze", help="report on a run directory or any directory of Kineto traces")
    parser.add_argument("path", type=existing_input,
                        help="run directory, or a directory of *.json / *.json.gz traces")
    parser.add_argument("--json", dest="json_out", default=None, help="write the report JSON here")
    parser.add_argument("--html", dest="html_out", default=None, help="write the HTML report here")
    add_analysis_arguments(parser)
    parser.add_argument("--check", action="store_true",
                        help="also check the report's invariants (analysis/invariants.py: no negative times, shares "
                             "that sum, what-ifs within their step, the verdict's rank); exit 1 when one breaks")
    parser.set_defaults(handler=handle_analyze)


def handle_analyze(args: argparse.Namespace) -> int:
    from ..analysis import analyze
    from ..analysis.advise import top_findings
    from ..analysis.render.terminal import render_terminal

    if refused_oracle(args, "analyze"):
        return EXIT_USAGE
    layout = RunLayout.at(args.path)
    json_out, html_out = args.json_out, args.html_out
    if layout.is_run_dir():
        json_out = json_out or layout.report_json
        html_out = html_out or layout.report_html
    report = analyze(layout.root, analyze_options_from_args(args), json_out=json_out, html_out=html_out,
                     progress=progress_printer("analyze"), hta_progress=progress_printer("HTA"), advisor=top_findings)
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
