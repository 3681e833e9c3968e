"""Run one rank end to end: runtime setup, training, orderly teardown."""

from __future__ import annotations

import torch.distributed as dist

from .config import TrainConfig
from .loop import train
from .runtime import init_runtime


def run(config: TrainConfig) -> int:
    runtime = init_runtime(config)
    try:
        train(config, runtime)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
