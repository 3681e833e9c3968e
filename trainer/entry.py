"""Run one rank end to end: runtime setup, training, orderly teardown."""

from __future__ import annotations

import logging

import torch.distributed as dist

from .config import TrainConfig
from ..traces.layout import RunLayout
from .loop import Preempted, train
from .models import check_model_support
from .observability import measure_clock
from .preemption import EXIT_PREEMPTED, record_stop
from .runtime import init_runtime

log = logging.getLogger("fleetscope.trainer")


def run(config: TrainConfig) -> int:
    check_model_support(config.model, config.parallel, config.faults)
    record_stop(None)
    runtime = init_runtime(config)
    try:
        measure_clock(config.observability, RunLayout.at(config.run_dir))
        train(config, runtime)
        dist.barrier()
    except Preempted as stop:
        log.warning("%s; exiting with status %d", stop, EXIT_PREEMPTED)
        record_stop(stop.reason)
        return EXIT_PREEMPTED
    finally:
        dist.destroy_process_group()
    return 0
