"""`python -m fleetscope.trainer`: one rank of a training run (torchrun starts one per GPU)."""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from .config import ConfigError, parse_train_args


@record
def main(argv: list[str] | None = None) -> int:
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    try:
        config = parse_train_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as error:
        print(f"fleetscope trainer: bad configuration: {error}", file=sys.stderr)
        return 2
    from .entry import run  # torch-heavy imports only after the configuration is known to be valid

    try:
        return run(config)
    except ConfigError as error:
        print(f"fleetscope trainer: bad configuration: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
