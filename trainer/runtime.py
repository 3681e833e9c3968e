"""Process-level setup of one rank: environment, device, process group, mesh."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..traces.launch_env import restart_attempt
from .config import ConfigError, TrainConfig
from .parallel import ParallelDims


@dataclass(frozen=True, kw_only=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh
    attempt: int
    """Restart count of this job (torchrun restarts or Slurm requeues); names new trace files."""

    @property
    def use_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)


def launch_environment() -> dict[str, int]:
    """Rank variables set by torchrun (or an srun wrapper that mimics it)."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: run the trainer under torchrun or `fleetscope launch`"
        )
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
    }




def select_device(config: TrainConfig, local_rank: int) -> torch.device:
    wanted = config.performance.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("performance.device: cuda requested but no CUDA device is visible")
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_runtime(config: TrainConfig) -> Runtime:
    """Validate degrees against the world size BEFORE creating any process group, then create it."""
    env = launch_environment()
    dims = ParallelDims.from_config(config.parallel, env["world_size"])
    device = select_device(config, env["local_rank"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 tensor cores for the fp32 matmuls autocast leaves in fp32 (and for fp32 runs).
        torch.set_float32_matmul_precision("high" if config.performance.tf32 else "highest")
    else:
        # Ranks sharing a host share its cores: oversubscribed BLAS threads make every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env["local_world_size"]))
    backend = config.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend: nccl needs CUDA devices (performance.device is cpu)")
    dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    mesh = dims.build_mesh(device.type)
    return Runtime(device=device, dims=dims, mesh=mesh, attempt=restart_attempt(), **env)
