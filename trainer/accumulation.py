"""Gradient accumulation: several micro-batches per optimizer step, gradients synchronized on the last.

On the inner micro-batches DDP skips its all-reduce (`no_sync`) and FSDP2 its reduce-scatter
(`set_requires_gradient_sync(False)` on the root module: gradients stay unsharded and accumulate locally).
Each micro-batch's loss is scaled by 1 / accumulation_steps, so the summed gradient is the mean over the
whole accumulated batch, as one large-batch step would compute it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.profiler import record_function

from ..traces.formats import microbatch_range


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, *, enabled: bool) -> Iterator[None]:
    """Synchronize gradients in this micro-batch's backward only if `enabled` (the last micro-batch)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield


def micro_step(index: int, count: int) -> contextlib.AbstractContextManager:
    """The `microbatch[<i>]` range of an accumulated micro-batch (none without accumulation)."""
    return record_function(microbatch_range(index)) if count > 1 else contextlib.nullcontext()


def take_micro_batches(batches: Iterator[torch.Tensor], count: int) -> list[torch.Tensor]:
    """The next `count` batches of this rank's shard: one optimizer step's micro-batches."""
    return [next(batches) for _ in range(count)]
