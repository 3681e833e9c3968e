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
from . import commands, exit_codes
from .launch_commands import run_trainer
from .exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from .terminal_text import escape_controls


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetscope", description=f"{__doc__}\n{exit_codes.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in commands.REGISTRY:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["train"]:  # one rank: the trainer parses every flag after `train` itself, --help too
        args = argparse.Namespace(command="train", handler=lambda _: run_trainer(words[1:]))
    else:
        hint = torchrun_words_hint(words)
        if hint:
            print(f"fleetscope launch: {escape_controls(hint)}", file=sys.stderr)
            return EXIT_USAGE
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


TORCHRUN_ONLY_FLAGS = ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port",
                       "--standalone", "--rdzv_backend", "--rdzv_endpoint", "--rdzv-backend", "--rdzv-endpoint",
                       "--rdzv_id", "--max_restarts", "--max-restarts")
"""torchrun's own flags (fleetscope's launch spells its counterparts --nproc-per-node and --nodes, and sets the
rendezvous itself)."""


def torchrun_words_hint(words: list[str]) -> str | None:
    """What to write instead, for a launch given torchrun's flags before `--` (argparse would only print the
    usage and "unrecognized arguments"); None when there are none."""
    if words[:1] != ["launch"]:
        return None
    before = words[1:words.index("--")] if "--" in words else words[1:]
    found = [w for w in before if w.split("=", 1)[0] in TORCHRUN_ONLY_FLAGS]
    if not found:
        return None
    return (f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} torchrun's: fleetscope runs torchrun itself "
            "(rendezvous included); write `fleetscope launch --nproc-per-node N [--nodes M] -- python train.py "
            "ARGS` (fleetscope launch --help lists its flags)")


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
