"""Run one rank end to end: runtime setup, training, orderly teardown."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from .config import TrainConfig
from ..traces.layout import RunLayout
from .loop import JobHung, Preempted, train
from .models import check_model_support
from ..traces.exit_status import EXIT_HUNG, EXIT_PREEMPTED
from .hang import enable_flight_recorder
from .observability import measure_clock
from .preemption import StopReason
from .runtime import init_runtime

log = logging.getLogger("fleetscope.trainer")


@dataclass(frozen=True)
class RankOutcome:
    exit_code: int
    stop: StopReason | None = None
    """Why the rank stopped on request (None: it did not); a launcher that runs the trainer in-process
    (submitit) requeues the job when `stop.requeue_needed`."""


def run(config: TrainConfig) -> int:
    return run_rank(config).exit_code


def run_rank(config: TrainConfig) -> RankOutcome:
    check_model_support(config.model, config.parallel, config.faults)
    enable_flight_recorder(config.observability, RunLayout.at(config.run_dir))
    runtime = init_runtime(config)
    try:
        measure_clock(config.observability, RunLayout.at(config.run_dir))
        train(config, runtime)
        dist.barrier()
    except Preempted as stop:
        log.warning("%s; exiting with status %d", stop, EXIT_PREEMPTED)
        dist.destroy_process_group()
        return RankOutcome(exit_code=EXIT_PREEMPTED, stop=stop.reason)
    except JobHung as hung:
        # No teardown: the group lost a member, and destroying a broken NCCL communicator can block.
        log.error("%s; exiting with status %d", hung, EXIT_HUNG)
        return RankOutcome(exit_code=EXIT_HUNG)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    return RankOutcome(exit_code=0)
