"""The environment fingerprint job.json records at launch: what must match for two runs to be compared.

Fields (None where not applicable or not found): gpu_model, gpu_count, driver, cuda, torch, nccl,
transformers, fleetscope, python. Taken on the machine that launches the job: for a local run, the machine
that runs it; for a job submitted to a cluster, the submitting host (the compute nodes may differ).
Beside them, not compared: cpus (the CPUs this process may run on: what a local run's ranks share).
torch and transformers are imported only when the fingerprint is taken.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from typing import Any

FINGERPRINT_FIELDS = ("gpu_model", "gpu_count", "driver", "cuda", "torch", "nccl", "transformers", "fleetscope",
                      "python")
DRIVER_QUERY_TIMEOUT_S = 10


def environment_fingerprint() -> dict[str, Any]:
    """The fingerprint of this machine and Python environment (module docstring)."""
    found: dict[str, Any] = dict.fromkeys(FINGERPRINT_FIELDS)
    found.update(python=platform.python_version(), fleetscope=_distribution_version("fleetscope"),
                 transformers=_distribution_version("transformers"), cpus=usable_cpus())
    try:
        import torch
    except ImportError:
        return found
    found.update(torch=torch.__version__, cuda=torch.version.cuda, gpu_count=0)
    if torch.cuda.is_available():
        found.update(gpu_count=torch.cuda.device_count(), gpu_model=torch.cuda.get_device_name(0),
                     nccl=".".join(map(str, torch.cuda.nccl.version())), driver=_driver_version())
    return found


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fingerprint_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Field -> (a's value, b's value) for every field that differs."""
    return {name: (a.get(name), b.get(name)) for name in FINGERPRINT_FIELDS if a.get(name) != b.get(name)}


def _distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        completed = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=DRIVER_QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = completed.stdout.strip().splitlines()
    return lines[0].strip() if completed.returncode == 0 and lines else None
