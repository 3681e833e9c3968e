"""`compare` (the noise-aware gate; `BASE NEW` is one run a side) and `history`: argument parsing and printing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..traces.jsontext import strict_dumps
from ..traces.outputs import guard_output
from .argtypes import positive_number
from .defaults import THRESHOLD_DEFAULT_PCT
from .exit_codes import EXIT_OK, EXIT_PARTIAL, EXIT_REFUSED, EXIT_USAGE
from .terminal_text import escape_controls


def add_threshold_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--threshold PCT` of compare, tune and history: `what` says what the percent measures."""
    parser.add_argument("--threshold", type=positive_number, default=THRESHOLD_DEFAULT_PCT, metavar="PCT",
                        help=f"{what} (default {THRESHOLD_DEFAULT_PCT:g})")


def add_gate_arguments(parser: argparse.ArgumentParser) -> None:
    """The gate's options of `compare`: `--base A --base B --new C --new D`; `BASE NEW` is `--base BASE --new NEW`."""
    parser.add_argument("--base", dest="base_runs", action="append", default=[], metavar="RUN",
                        help="a baseline run directory (repeat for several): gates with a noise model")
    parser.add_argument("--new", dest="new_runs", action="append", default=[], metavar="RUN",
                        help="a new run directory (repeat for several)")
    parser.add_argument("--allow-env-change", action="store_true",
                        help="compare runs whose environment fingerprints (job.json) differ")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap (default 0)")
    parser.add_argument("--allow-different-jobs", action="store_true",
                        help="compare runs of different jobs (world size, model, parallel layout, batch, sequence, "
                             "precision differ); refused with exit 2 by default")


def compared_runs(args: argparse.Namespace) -> tuple[list[str], list[str]] | None:
    """(base runs, new runs) of either form (`BASE NEW` is one run a side); None, after saying why, when the
    forms are mixed or a side is missing."""
    positional = [p for p in (args.base, args.new) if p is not None]
    if positional and (args.base_runs or args.new_runs):
        print("fleetscope compare: give BASE NEW or --base/--new, not both", file=sys.stderr)
        return None
    if positional:
        if len(positional) < 2:
            print("fleetscope compare: give BASE NEW, or --base RUN ... --new RUN ...", file=sys.stderr)
            return None
        return [args.base], [args.new]
    if not args.base_runs or not args.new_runs:
        print("fleetscope compare: --base and --new each need at least one run directory", file=sys.stderr)
        return None
    return args.base_runs, args.new_runs


def wants_gate(base_runs: list[str], new_runs: list[str]) -> bool:
    """The gate compares them, unless one report or run a side lacks step metrics: then only the trace step
    time can be compared (analysis/compare.py). The same rule for both forms of `compare`."""
    from ..analysis.gate import has_step_metrics

    return len(base_runs) > 1 or len(new_runs) > 1 or all(map(has_step_metrics, [*base_runs, *new_runs]))


def handle_gate(args: argparse.Namespace, base_runs: list[str], new_runs: list[str]) -> int:
    """The gate: exit 0 ok, 1 sustained regression, 2 refused (the refusal on stderr)."""
    from ..analysis.gate import gate
    from ..analysis.render.gate_terminal import render_gate

    result = gate(base_runs, new_runs, threshold_pct=args.threshold, allow_env_change=args.allow_env_change,
                  seed=args.seed, allow_different_jobs=args.allow_different_jobs)
    print(escape_controls(render_gate(result)), end="", file=sys.stderr if result.refused else sys.stdout)
    if result.regressions:
        print_where_time_moved(base_runs[-1], new_runs[0])
    return result.exit_code


WHERE_MOVED_ITEMS = 5


def print_where_time_moved(base: str, new: str) -> None:
    """After a regression: the largest changes of `fleetscope diff` between a base run and a new one, where both
    hold GPU traces with profiled steps (nothing is said otherwise)."""
    from ..analysis.diff import diff

    try:
        result = diff(base, new)
    except (OSError, ValueError):
        return
    if not (result.a.ranks and result.b.ranks):
        return
    print(f"where the step's time moved ({base} -> {new}, traces; `fleetscope diff` for all of it):")
    for item in result.items[:WHERE_MOVED_ITEMS]:
        status = f" [{item.status}]" if item.status else ""
        print(escape_controls(f"  {item.change_ms:+9.3f} ms  {item.name[:90]}{status}"))


def environment_refusal(args: argparse.Namespace, runs: list[str]) -> int | None:
    """For a trace comparison of two run directories: EXIT_REFUSED (after saying what differs) when their
    environment fingerprints differ and --allow-env-change is absent; None to go on."""
    from ..analysis.gate import environment_check

    runs = [p for p in runs if Path(p).is_dir()]
    if len(runs) < 2:
        return None
    differences, notes = environment_check(runs)
    for note in notes:
        print(f"note: {note}")
    if not differences or args.allow_env_change:
        return None
    fields = ", ".join(f"{k} ({' vs '.join(v)})" for k, v in differences.items())
    print(f"fleetscope compare: REFUSED: the runs' environments differ: {fields} "
          "(--allow-env-change compares anyway)", file=sys.stderr)
    return EXIT_REFUSED


def register_history(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("history", help="gated metrics of every run under a directory, by date, "
                                            "regressions marked")
    parser.add_argument("root", help="directory holding run directories (any depth)")
    parser.add_argument("--html", dest="html_out", help="write the trend page here (default ROOT/history.html)")
    add_threshold_argument(parser, "percent that counts as a regression")
    parser.set_defaults(handler=handle_history)


def handle_history(args: argparse.Namespace) -> int:
    from ..analysis.history import history
    from ..analysis.render.gate_terminal import render_history
    from ..analysis.render.history_html import render_history_html
    from ..traces.atomic import write_bytes_atomically

    if not Path(args.root).is_dir():
        print(f"fleetscope history: {args.root}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    out = guard_output(args.html_out or Path(args.root) / "history.html", analyzed=Path(args.root))
    result = history(args.root, threshold_pct=args.threshold)
    print(escape_controls(render_history(result)), end="")
    write_bytes_atomically(render_history_html(result).encode(), out)
    print(f"trend page: {out}")
    return EXIT_OK


def register_advise(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("advise", help="configuration changes the run's evidence points to, with expected gains")
    parser.add_argument("run", help="run directory")
    parser.add_argument("--json", dest="json_out", help="write the findings as JSON here")
    parser.set_defaults(handler=handle_advise)


def handle_advise(args: argparse.Namespace) -> int:
    import dataclasses

    from ..analysis.advise import advise
    from ..analysis.render.advice_terminal import render_advice
    from ..traces.atomic import write_bytes_atomically

    json_out = guard_output(args.json_out, analyzed=Path(args.run)) if args.json_out else None
    advice = advise(args.run)
    print(escape_controls(render_advice(advice)), end="")
    if json_out:
        write_bytes_atomically((strict_dumps(dataclasses.asdict(advice), indent=2) + "\n").encode(), json_out)
    return EXIT_OK if advice.complete else EXIT_PARTIAL


REGISTRY = [register_history, register_advise]
