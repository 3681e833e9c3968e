"""`fleetscope`: launch, train, gather, analyze, merge, compare, demo.

Exit codes scripts can trust:
  0  success (analysis: every expected rank analyzed)
  1  the job or the command failed
  2  bad usage or configuration (nothing was started)
  3  partial result: some ranks or traces were missing or unreadable (the rest was processed)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..trainer.config import ConfigError
from ..traces.validate import UsageError
from . import commands
from .commands import EXIT_FAILED, EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetscope", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in commands.REGISTRY:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ConfigError as error:
        print(f"fleetscope {args.command}: bad configuration: {error}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as error:  # a refused request (an output over an input, a bad argument): nothing done
        print(f"fleetscope {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, NotADirectoryError, ValueError) as error:
        print(f"fleetscope {args.command}: {error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"fleetscope {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
