"""Distributed checkpoints (torch.distributed.checkpoint): save every N steps / at exit, resume.

Each checkpoint is a directory `checkpoints/step<N>` holding model and optimizer state for any
parallel layout (DDP, FSDP2, TP, 2-D: DCP reshards on load). It is written under a temporary
name and renamed by rank 0 after every rank finished, so a crash mid-save never leaves a
directory that looks complete; resume picks the newest complete one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..traces.layout import RunLayout

log = logging.getLogger("fleetscope.trainer")
_COMPLETE = re.compile(r"^step(?P<step>\d{8})$")


def checkpoint_dir(layout: RunLayout, step: int) -> Path:
    """`checkpoints/step00000042`: the state after `step` steps."""
    return layout.checkpoints_dir / f"step{step:08d}"


def latest_checkpoint(layout: RunLayout) -> tuple[int, Path] | None:
    """The newest complete checkpoint (step count, directory), if any."""
    if not layout.checkpoints_dir.is_dir():
        return None
    found = [(int(m["step"]), p) for p in layout.checkpoints_dir.iterdir()
             if p.is_dir() and (m := _COMPLETE.match(p.name))]
    return max(found) if found else None


def save_checkpoint(layout: RunLayout, *, steps_done: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> Path:
    """Collective: every rank calls it at the same step."""
    final = checkpoint_dir(layout, steps_done)
    staging = final.with_name(f".{final.name}.partial")
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "progress": {"steps_done": torch.tensor(steps_done)},
    }
    dcp.save(state, checkpoint_id=str(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():  # the same step saved by an earlier attempt: keep that one
            log.warning("checkpoint %s exists; keeping it", final)
            shutil.rmtree(staging, ignore_errors=True)
        else:
            os.replace(staging, final)
    dist.barrier()
    log.info("checkpoint after step %d saved: %s", steps_done - 1, final)
    return final


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer in place; returns the number of steps already done."""
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "progress": {"steps_done": torch.tensor(0)},
    }
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    steps_done = int(state["progress"]["steps_done"])
    log.info("resumed from %s: %d steps done", path, steps_done)
    return steps_done
