"""Shared by the tests: running real processes and reading what a run leaves behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(nproc: int, *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """A real `torchrun --standalone`-like launch (fixed free port: tests may run side by side)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def fleetscope(*args: str, timeout: int = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetscope.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def metrics(run_dir: Path, rank: int) -> list[dict]:
    path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean_losses(run_dir: Path, world_size: int) -> list[float]:
    """Per step, the mean of every rank's loss (equal batches: the global batch's mean loss)."""
    per_rank = [[row["loss"] for row in metrics(run_dir, rank)] for rank in range(world_size)]
    return [sum(step) / world_size for step in zip(*per_rank)]
