"""`fleetscope`: launch and profile (MoE) training on every rank, then analyze its traces.

  start a job     launch, demo, train (one rank: what torchrun starts), config (every --set field)
  while it runs   status, logs, cancel, profile (record a window now), hang (why it hung)
  after it ran    gather, collect-traces, postprocess (gather + analyze + merge), analyze, merge, query
  on Slurm        postprocess --slurm: parse-shard tasks of an array job, then reduce-shards
  across runs     compare, history, advise, tune (apply a finding to a relaunch, then compare), diff (where
                  the step's time moved between two runs or traces)
  what-if         whatif (the job without its stragglers, simulated, from an op-level timeline or a run)
  other tools'    split (one trace per rank of a file that fused several ranks)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ..trainer.config import ConfigError
from ..traces.validate import UsageError
from . import (cause_commands, commands, config_command, diff_command, exit_codes, run_commands, split_command,
               tune_command, whatif_command)
from .exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetscope", description=f"{__doc__}\n{exit_codes.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in [*commands.REGISTRY, *run_commands.REGISTRY, *cause_commands.REGISTRY, *tune_command.REGISTRY,
                     *config_command.REGISTRY, *diff_command.REGISTRY, *whatif_command.REGISTRY,
                     *split_command.REGISTRY]:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["train"]:  # one rank: the trainer parses every flag after `train` itself, --help too
        args = argparse.Namespace(command="train", handler=lambda _: commands.run_trainer(words[1:]))
    else:
        args = parser.parse_args(words)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()    # a reader that left shows here, not as an error at the interpreter's exit
        return code
    except ConfigError as error:
        print(f"fleetscope {args.command}: bad configuration: {error}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as error:  # a refused request (an output over an input, a bad argument): nothing done
        print(f"fleetscope {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return _reader_gone()
    except (OSError, ValueError) as error:  # a file the command needed: no traceback, the message says which
        print(f"fleetscope {args.command}: {error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"fleetscope {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _reader_gone() -> int:
    """The reader of our output left (`| head`): nothing is wrong, and nothing more is written (Python would
    report the next flush's failure at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
