"""Who runs a job: one module per scheduler, each behind `launcher.scheduler.Scheduler`."""

from __future__ import annotations

import importlib.util

from ...trainer.config import ConfigError
from ..scheduler import Scheduler
from ..spec import SCHEDULERS


EXTRA_PACKAGES = {"submitit": ("submitit",), "torchx": ("torchx",), "torchx_local": ("torchx",)}
"""Schedulers that need the `[slurm]` extra, and the packages they import."""


def require_scheduler_packages(name: str) -> None:
    """A ConfigError naming the extra to install when a scheduler's package is missing."""
    missing = [package for package in EXTRA_PACKAGES.get(name, ()) if importlib.util.find_spec(package) is None]
    if missing:
        raise ConfigError(f"scheduler: {name} needs {', '.join(missing)}, which is not installed: "
                          f"pip install 'fleetscope[slurm]' (or pip install -e '.[slurm]' in a checkout)")


def scheduler_for(name: str) -> Scheduler:
    """The scheduler called `name` (one of spec.SCHEDULERS: what `--scheduler` accepts)."""
    require_scheduler_packages(name)
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
