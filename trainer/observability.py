"""Per-rank records besides traces: clock offset, CUDA memory snapshots, MLPerf-style log lines."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import torch

from ..traces.clock import record_clock_offset
from ..traces.formats import mllog_line as format_mllog_line
from ..traces.layout import RunLayout
from .config import ObservabilityConfig
from .metrics import StepMetrics

log = logging.getLogger("fleetscope.trainer")


def measure_clock(config: ObservabilityConfig, layout: RunLayout) -> None:
    """Collective: every rank measures its offset to rank 0 and writes clock/rank<R>.json."""
    if config.clock_round_trips > 0:
        offset = record_clock_offset(layout, round_trips=config.clock_round_trips)
        log.info("clock offset to rank 0: %.1f us +/- %.1f us", offset.offset_us, offset.uncertainty_us)


class MemorySnapshots:
    """CUDA allocator history, dumped after a chosen step and/or when a step runs out of memory."""

    def __init__(self, config: ObservabilityConfig, layout: RunLayout, rank: int, use_cuda: bool):
        self._config, self._layout, self._rank = config, layout, rank
        self._active = use_cuda and config.records_memory
        if self._active:
            torch.cuda.memory._record_memory_history(max_entries=config.memory_history_entries)

    def after_step(self, step: int) -> None:
        if self._active and step == self._config.memory_snapshot_step:
            self._dump(f"step{step}")

    def on_out_of_memory(self) -> None:
        if self._active and self._config.memory_snapshot_on_oom:
            self._dump("oom")

    def _dump(self, when: str) -> None:
        path = self._layout.memory_snapshot(self._rank, when)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        log.info("memory snapshot written: %s (open at https://pytorch.org/memory_viz)", path)


def mllog_line(metrics: StepMetrics) -> str:
    """`:::MLLOG {...}`: the MLPerf logging format, one POINT_IN_TIME event per step per rank.

    Besides every `*_ms` field, the metadata splits the step into parts that add up to step_time_ms:
    `fwd_ms` (forward), `bwd_ms` (backward minus exposed gradient all-reduce), `allreduce_ms` (the exposed
    DDP gradient all-reduce, comm_exposed_ms; 0 where it is not measured) and `other_ms` (the rest: data
    loading and the optimizer step)."""
    breakdown = {k: round(v, 3) for k, v in asdict(metrics).items() if k.endswith("_ms") and v is not None}
    allreduce = min(metrics.comm_exposed_ms or 0.0, metrics.backward_ms)
    parts = {"fwd_ms": metrics.forward_ms, "bwd_ms": metrics.backward_ms - allreduce, "allreduce_ms": allreduce,
             "other_ms": metrics.step_time_ms - metrics.forward_ms - metrics.backward_ms}
    event = {
        "namespace": "fleetscope", "time_ms": int(time.time() * 1e3), "event_type": "POINT_IN_TIME",
        "key": "train_step", "value": round(metrics.step_time_ms, 3),
        "metadata": {"step": metrics.step, "rank": metrics.rank, "tokens_per_s": round(metrics.tokens_per_s),
                     **breakdown, **{k: round(v, 3) for k, v in parts.items()}},
    }
    return format_mllog_line(event)
