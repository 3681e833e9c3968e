"""The analysis' flags, offered alike by `analyze` and `postprocess`, and the one function that turns them into
AnalyzeOptions (analysis/options.py) for every command that analyzes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .argtypes import positive_number
from .defaults import HTA_RANKS_DEFAULT

CACHE_DIR_HELP = "parsed-trace cache (default: $FLEETSCOPE_CACHE_DIR, else ~/.cache/fleetscope/analysis)"

ANALYSIS_DESTS = ("no_hta", "hta_ranks", "hta_oracle", "no_cache", "cache_dir", "link_peak", "comm_kernel_pattern")
"""The attributes add_analysis_arguments sets (the test of analyze's and postprocess' help reads their flags)."""


def add_analysis_arguments(parser, *, cache_dir_help: str = CACHE_DIR_HELP) -> None:
    """The flags of ANALYSIS_DESTS on `parser` (a parser or an argument group)."""
    parser.add_argument("--no-hta", action="store_true", help="skip Holistic Trace Analysis (GPU traces)")
    parser.add_argument("--hta-ranks", default=HTA_RANKS_DEFAULT, metavar="auto|all|LIST",
                        help="ranks HTA's views cover: auto (slowest, waited for, fastest, median, one per host; "
                             f"at most 16 per window), all, or a list like 0,3,7 (default: {HTA_RANKS_DEFAULT})")
    parser.add_argument("--hta-oracle", action="store_true",
                        help="also run stock HTA's analyzers on the same ranks and record, per table, the largest "
                             "difference from fleetscope's own computation (report.json: hta.oracle; needs HTA)")
    parser.add_argument("--no-cache", action="store_true",
                        help="parse every trace again instead of reusing results of identical trace files")
    parser.add_argument("--cache-dir", type=Path, default=None, help=cache_dir_help)
    parser.add_argument("--link-peak", type=positive_number, default=None, metavar="GBPS",
                        help="peak bus bandwidth of the links (GB/s), instead of the table of known links")
    parser.add_argument("--comm-kernel-pattern", default=None, metavar="REGEX",
                        help="kernels matching it communicate too (e.g. DeepEP dispatch/combine kernels), besides "
                             "NCCL's")


def given_analysis_flags(args: argparse.Namespace, *, besides: tuple[str, ...] = ()) -> list[str]:
    """The analysis flags given other than at their defaults (`besides`: attributes not to count)."""
    defaults = {"hta_ranks": HTA_RANKS_DEFAULT}
    return [f"--{dest.replace('_', '-')}" for dest in ANALYSIS_DESTS
            if dest not in besides and getattr(args, dest, None) not in (None, False, defaults.get(dest))]


def analyze_options_from_args(args: argparse.Namespace):
    """AnalyzeOptions from a command's parsed flags; a flag the command does not offer keeps its default (the
    reduce of a fanned-out parse offers only --cache-dir). A bad --hta-ranks is a ValueError naming it."""
    from ..analysis.options import AnalyzeOptions
    from ..analysis.report.build import parse_hta_ranks

    return AnalyzeOptions(
        use_hta=not getattr(args, "no_hta", False),
        hta_ranks=parse_hta_ranks(getattr(args, "hta_ranks", HTA_RANKS_DEFAULT)),
        hta_oracle=getattr(args, "hta_oracle", False),
        use_cache=not getattr(args, "no_cache", False),
        cache_dir=getattr(args, "cache_dir", None),
        link_peak_gbps=getattr(args, "link_peak", None),
        comm_kernel_pattern=getattr(args, "comm_kernel_pattern", None),
    )


def refused_oracle(args: argparse.Namespace, command: str) -> bool:
    """--hta-oracle without HTA installed: say so in one line (True: the command stops)."""
    from ..analysis.per_rank.hta_rank_views import hta_installed

    if args.hta_oracle and not args.no_hta and not hta_installed():
        print(f"fleetscope {command}: --hta-oracle runs stock HTA, which is not installed "
              "(pip install 'fleetscope[hta]')", file=sys.stderr)
        return True
    return False


def progress_printer(label: str):
    """Progress on stderr: a bar on a terminal, a status line every 10 s otherwise (cli/progress.py)."""
    from .progress import progress_callback

    return progress_callback(label)
