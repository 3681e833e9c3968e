"""Who runs a job: one module per scheduler, each behind `launcher.scheduler.Scheduler`."""

from __future__ import annotations

from ..scheduler import Scheduler
from ..spec import SCHEDULERS


def scheduler_for(name: str) -> Scheduler:
    """The scheduler called `name` (one of spec.SCHEDULERS: what `--scheduler` accepts)."""
    if name == "local":
        from .local import LocalScheduler

        return LocalScheduler()
    if name == "submitit":
        from .submitit import SubmititScheduler

        return SubmititScheduler()
    if name == "torchx":
        from .torchx import TorchXScheduler

        return TorchXScheduler()
    if name == "torchx_local":
        from .torchx import TorchXLocalScheduler

        return TorchXLocalScheduler()
    raise ValueError(f"unknown scheduler {name!r}; one of {', '.join(SCHEDULERS)}")
