"""Injected faults with known sizes: ground truth for the report (see config.FaultConfig).

The router faults (hot_expert, expert_skew) bias the router logits of every MoE layer
(trainer/expert_parallel.py wraps the routers); their effect is read in metrics/rank<R>.moe.jsonl.

Each other fault marks itself in the trace with a `record_function` range named `fleetscope_injected_<what>`.
Inside a compiled region Dynamo drops record_function ranges, so the faults that run inside decoder
blocks are functions excluded from compilation (`torch._dynamo.disable`): they always run eagerly and
stay visible in the trace. Excluding a function is itself a graph break, which is exactly the
`graph_break` fault; for `sync_per_layer` the break is no extra cost, since a host sync inside a
compiled region breaks the graph anyway.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils.data import default_collate

from ..traces.formats import INJECTED_DATA_DELAY as DATA_DELAY
from ..traces.formats import INJECTED_GRAPH_BREAK as GRAPH_BREAK
from ..traces.formats import INJECTED_HANG as HANG
from ..traces.formats import INJECTED_LEAK as LEAK
from ..traces.formats import INJECTED_SLOW_PHASE as SLOW_PHASE
from ..traces.formats import INJECTED_SYNC as SYNC
from .config import FaultConfig
from .models import decoder_layers


def install_layer_faults(model: torch.nn.Module, faults: FaultConfig) -> None:
    """Forward hooks on every decoder block; call before compiling, so the hooks run inside the compiled
    blocks (torch.compile of a module traces its hooks too)."""
    for layer in decoder_layers(model):
        if faults.graph_break:
            layer.register_forward_hook(_graph_break_hook)
        if faults.sync_per_layer:
            layer.register_forward_hook(_sync_hook)


def _graph_break_hook(_module, _args, _output) -> None:
    injected_graph_break()


def _sync_hook(_module, _args, output) -> None:
    hidden = output[0] if isinstance(output, tuple) else output
    injected_sync(hidden)


@torch._dynamo.disable(reason=GRAPH_BREAK)
def injected_graph_break() -> None:
    """A graph break whose Dynamo reason names this fault (the range marks where it ran, eagerly)."""
    with record_function(GRAPH_BREAK):
        pass


@torch._dynamo.disable(reason=SYNC)
def injected_sync(hidden: torch.Tensor) -> float:
    """One host sync on a value of the layer's output: `.item()` waits for the layer's device work."""
    local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    with record_function(SYNC):
        return local.detach().reshape(-1)[0].item()


def router_logit_bias(faults: FaultConfig, num_experts: int) -> torch.Tensor | None:
    """The bias over experts the hot_expert / expert_skew faults add to every router's logits (None: off).

    expert_skew S: -S * ln(e + 1) for expert e, so softmax probabilities scale like (e + 1)^-S (Zipf-like);
    hot_expert E: +hot_expert_bias on expert E."""
    if not faults.biases_router:
        return None
    bias_E = -faults.expert_skew * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))
    if faults.hot_expert >= 0:
        bias_E[faults.hot_expert] += faults.hot_expert_bias
    return bias_E


class DelayedCollate:
    """The DataLoader's collate function plus a sleep: the delay lands inside the loader's own fetch of
    each batch (its `enumerate(DataLoader)#...__next__` range with num_workers=0; in a worker otherwise).
    A class, not a closure, so that DataLoader workers can unpickle it."""

    def __init__(self, delay_ms: float):
        self.delay_ms = delay_ms

    def __call__(self, samples: list) -> torch.Tensor:
        with record_function(DATA_DELAY):
            time.sleep(self.delay_ms / 1e3)
        return default_collate(samples)


def slow_phase(phase: str, faults: FaultConfig, rank: int) -> None:
    """Sleep inside `phase`'s range when the slow_phase fault targets it on this rank. On CUDA a host
    sleep shows in the phase's event time only when the GPU runs out of queued work meanwhile."""
    delay_ms = faults.slow_phase_delay(phase, rank)
    if delay_ms > 0:
        with record_function(SLOW_PHASE):
            time.sleep(delay_ms / 1e3)


class MemoryLeak:
    """Keeps `mb_per_step` MiB of new, filled tensors alive per step (filled, so that host pages are really
    touched on CPU too); `kept_mb` is what it holds."""

    def __init__(self, mb_per_step: float, device: torch.device):
        self._bytes_per_step = int(mb_per_step * 2**20)
        self._device = device
        self._kept: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        return self._bytes_per_step > 0

    def step(self) -> None:
        if not self.active:
            return
        with record_function(LEAK):
            self._kept.append(torch.ones(self._bytes_per_step, dtype=torch.uint8, device=self._device))

    @property
    def kept_mb(self) -> float | None:
        """MiB held so far; None when the fault is off."""
        if not self.active:
            return None
        return sum(t.numel() for t in self._kept) / 2**20


def injected_hang(rank: int, step: int) -> None:
    """Block forever before the step's collectives (faults.hang_rank / hang_step): the others wait in one."""
    logging.getLogger("fleetscope.trainer").warning("rank %d blocks forever at step %d (faults.hang_rank)",
                                                    rank, step)
    with record_function(HANG):
        while True:
            time.sleep(3600)
