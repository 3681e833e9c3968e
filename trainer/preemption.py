"""Stopping every rank at the same step when the scheduler asks (preemption, time limit, requeue).

A signal reaches ranks at slightly different moments, while a checkpoint is a collective: each
step the local "stop requested" flag is max-reduced over all ranks (asynchronously, read one step
later with the metrics), so all ranks see the request at the same step and save together.
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

log = logging.getLogger("fleetscope.trainer")

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
EXIT_PREEMPTED = 75
"""Exit status of a rank that stopped on request after saving a checkpoint (EX_TEMPFAIL)."""


class StopRequests:
    def __init__(self, device: torch.device):
        self._device = device
        self.requested_by: str | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, _frame) -> None:
        self.requested_by = signal.Signals(signum).name

    def agreed_flag(self) -> torch.Tensor:
        """A tensor that becomes 1 on every rank once any rank was asked to stop (not read yet)."""
        flag = torch.tensor([1.0 if self.requested_by else 0.0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
