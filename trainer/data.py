"""Training batches: synthetic tokens (default), sharded per data-parallel rank.

Sequence i is a pure function of (seed, i), and data-parallel rank r of d reads sequences
r, r + d, r + 2d, ...: the global batch of a step is the same for every parallel layout with the
same global batch size, which is what makes losses comparable across DDP / FSDP / TP.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .config import DataConfig


class SyntheticTokens(Dataset):
    """Uniform random token ids; sequence i is generated from seed and i alone."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, length: int):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator)


class StridedShard(Sampler[int]):
    """Data-parallel rank r of d reads items r, r+d, ..., starting after `skip` of its own items."""

    def __init__(self, *, length: int, dp_rank: int, dp_size: int, skip: int = 0):
        self.indices = range(dp_rank + skip * dp_size, length, dp_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@dataclass(frozen=True, slots=True)
class DataPlan:
    dataset: Dataset
    dp_rank: int
    dp_size: int


def build_loader(config: DataConfig, *, plan: DataPlan, start_step: int, use_cuda: bool) -> DataLoader:
    """A DataLoader over this rank's shard, resuming after `start_step` steps' worth of batches."""
    sampler = StridedShard(length=len(plan.dataset), dp_rank=plan.dp_rank, dp_size=plan.dp_size,
                           skip=start_step * config.batch_size)
    workers = config.num_workers
    return DataLoader(
        plan.dataset,
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=config.pin_memory and use_cuda,
        persistent_workers=config.persistent_workers and workers > 0,
        prefetch_factor=config.prefetch_factor if workers > 0 else None,
        drop_last=config.drop_last,
    )


def synthetic_plan(config: DataConfig, *, vocab_size: int, seed: int, steps: int, dp_rank: int,
                   dp_size: int) -> DataPlan:
    length = steps * config.batch_size * dp_size
    dataset = SyntheticTokens(vocab_size=vocab_size, seq_len=config.seq_len, seed=seed, length=length)
    return DataPlan(dataset, dp_rank, dp_size)
