"""`python -m fleetscope.trainer`: one rank of a training run (torchrun starts one per GPU)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from .config import ConfigError, parse_train_args


@record
def main(argv: list[str] | None = None) -> int:
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    try:
        config = parse_train_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as error:
        return refuse(error)
    from .entry import run  # torch-heavy imports only after the configuration is known to be valid

    try:
        return run(config)
    except ConfigError as error:
        return refuse(error)


def refuse(error: ConfigError) -> int:
    """A configuration this rank cannot run: one line on stderr and in torchrun's error file (launchers name
    the first failed rank with this line), exit status 2, no traceback."""
    print(f"fleetscope trainer: bad configuration: {error}", file=sys.stderr)
    ErrorHandler().record_exception(error)  # writes only under torchrun (TORCHELASTIC_ERROR_FILE)
    return 2


def exit_without_teardown(code: int) -> NoReturn:
    """Exit once Python's exit handlers have run, without the interpreter's teardown. With torch 2.13 a
    rank that had finished (every file written and closed, its process group destroyed) now and then died
    in that teardown, "terminate called without an active exception" then a segmentation fault (a
    profiler thread meeting destroyed C++ statics, pytorch/kineto#1051), and torchrun reported a failed
    rank: about one demo run in eight on a 2-core machine."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(code)


if __name__ == "__main__":
    code = main()
    exit_without_teardown(0 if code is None else code)  # None: what @record returns for --help (SystemExit 0)
