"""Per-step MoE routing records, counted on the device: tokens per expert and the all-to-all split matrix.

Every MoE layer adds into its own row of one device tensor during forward (no host sync). At the end of a
step the row block is snapshotted on the device and zeroed; snapshots are copied to the host (one copy)
and written as `metrics/rank<R>.moe.jsonl` lines (traces/formats.py MoeRecord) when a profiler window
ends, every `observability.moe_flush_steps` steps, and at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch

from ..traces.formats import MoeRecord, metric_line


@dataclass
class LayerCounter:
    """One MoE layer's accumulators: views into the shared device tensor."""

    layer: int
    tokens_E: torch.Tensor
    """Token copies routed to each global expert (int64, device)."""
    recv_P: torch.Tensor
    """Token copies received from each ep peer (int64, device)."""
    bytes_per_token: int = 0
    """Bytes of one dispatched hidden-state row (host; set by the first forward)."""
    split_sizes_d2h_ms: float = 0.0
    """Host wall time this step spent copying all-to-all split sizes to the host (waiting for the device)."""

    def add(self, counts_E: torch.Tensor, recv_P: torch.Tensor, bytes_per_token: int) -> None:
        """Count one forward; activation-checkpointing recomputes (forwards run by the backward pass) are
        skipped, so each step counts every layer once per real forward."""
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        self.tokens_E.add_(counts_E.to(self.tokens_E.dtype))
        self.recv_P.add_(recv_P.to(self.recv_P.dtype))
        self.bytes_per_token = bytes_per_token

    def add_sync_ms(self, ms: float) -> None:
        """Count one split-size copy's host wait (recomputes included: they wait too)."""
        self.split_sizes_d2h_ms += ms


@dataclass
class MoeStats:
    """Accumulators of every MoE layer of one rank and the writer of their records."""

    layers: list[int]
    num_experts: int
    ep: int
    ep_rank: int
    ep_ranks: list[int]
    rank: int
    path: Path
    flush_steps: int
    device: torch.device
    _counts_LC: torch.Tensor = field(init=False)
    _counters: dict[int, LayerCounter] = field(init=False)
    _pending: list[tuple[int, torch.Tensor, list[float]]] = field(init=False, default_factory=list)
    _handle: IO[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        columns = self.num_experts + self.ep
        self._counts_LC = torch.zeros(len(self.layers), columns, dtype=torch.int64, device=self.device)
        self._counters = {
            layer: LayerCounter(layer, self._counts_LC[row, :self.num_experts], self._counts_LC[row, self.num_experts:])
            for row, layer in enumerate(self.layers)
        }

    def counter(self, layer: int) -> LayerCounter:
        return self._counters[layer]

    def end_step(self, step: int) -> None:
        """Snapshot this step's counts on the device and start the next step from zero (no host sync)."""
        sync_ms = [self._counters[layer].split_sizes_d2h_ms for layer in self.layers]
        for counter in self._counters.values():
            counter.split_sizes_d2h_ms = 0.0
        self._pending.append((step, self._counts_LC.clone(), sync_ms))
        self._counts_LC.zero_()
        if len(self._pending) >= self.flush_steps:
            self.flush()

    def flush(self) -> None:
        """Copy the pending steps to the host (the one sync) and append their records."""
        if not self._pending:
            return
        steps = [step for step, _, _ in self._pending]
        sync_ms_NL = [sync_ms for _, _, sync_ms in self._pending]
        host_NLC = torch.stack([counts for _, counts, _ in self._pending]).cpu()
        self._pending = []
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")
        for step, counts_LC, sync_ms_L in zip(steps, host_NLC.tolist(), sync_ms_NL):
            for layer, row, sync_ms in zip(self.layers, counts_LC, sync_ms_L):
                self._handle.write(metric_line(self.record(step, layer, row, sync_ms).to_json()))
        self._handle.flush()

    def record(self, step: int, layer: int, row: list[int], sync_ms: float = 0.0) -> MoeRecord:
        """The record of one (step, layer) from its accumulator row [tokens per expert..., recv per peer...]."""
        tokens_per_expert, recv_tokens = row[:self.num_experts], row[self.num_experts:]
        local = self.num_experts // self.ep
        send_tokens = [sum(tokens_per_expert[peer * local:(peer + 1) * local]) for peer in range(self.ep)]
        width = self._counters[layer].bytes_per_token
        return MoeRecord(step=step, layer=layer, rank=self.rank, ep=self.ep, ep_rank=self.ep_rank,
                         ep_ranks=list(self.ep_ranks), tokens_per_expert=tokens_per_expert, send_tokens=send_tokens,
                         send_bytes=[n * width for n in send_tokens], recv_tokens=recv_tokens,
                         recv_bytes=[n * width for n in recv_tokens],
                         split_sizes_d2h_ms=round(sync_ms, 4) if self.ep > 1 else None)

    def close(self) -> None:
        self.flush()
        if self._handle is not None:
            self._handle.close()
            self._handle = None
