"""Stopping every rank at the same step when the scheduler asks (preemption, time limit, requeue).

A signal reaches ranks at slightly different moments, while a checkpoint is a collective: each
step the local "stop requested" level is max-reduced over all ranks (asynchronously, read one step
later with the metrics), so all ranks see the request at the same step and save together.

Two kinds of request:
  - SIGTERM: the scheduler is already ending or requeuing the job (`scontrol requeue`, preemption with
    PreemptMode=REQUEUE); saving is all that is left to do;
  - a notice, SIGUSR1 or SIGUSR2 (Slurm's `--signal`, sent ahead of a time limit; submitit asks for
    USR2): nobody else will requeue the job, so whoever launched the ranks must (entry.run_rank returns
    the StopReason, with `requeue_needed`).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("fleetscope.trainer")

NOTICE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (*NOTICE_SIGNALS, signal.SIGTERM)
LEVEL_NONE, LEVEL_TERMINATE, LEVEL_NOTICE = 0.0, 1.0, 2.0
"""Stop levels as max-reduced: a notice on any rank makes the whole job's stop a notice."""


@dataclass(frozen=True)
class StopReason:
    steps_done: int
    signal_name: str
    """The signal this rank received, or "another rank's signal"."""
    requeue_needed: bool
    """Some rank got a notice (not SIGTERM): the job is not being requeued by the scheduler."""


class StopRequests:
    def __init__(self, device: torch.device):
        self._device = device
        self.requested_by: str | None = None
        self.level = LEVEL_NONE
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, _frame) -> None:
        self.requested_by = signal.Signals(signum).name
        self.level = max(self.level, LEVEL_NOTICE if signum in NOTICE_SIGNALS else LEVEL_TERMINATE)

    def agreed_flag(self, extra: list[float] = ()) -> torch.Tensor:
        """A tensor that becomes the highest stop level of any rank on every rank (not read yet); `extra`
        values ride along, max-reduced too (trainer/capture.py's votes), after the level."""
        if dist.get_world_size() == 1:
            # One rank agrees with itself: no collective, no host-to-device copy (the values are read on the host).
            return torch.tensor([self.level, *extra])
        flag = torch.tensor([self.level, *extra], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
