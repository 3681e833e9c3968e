"""Training batches from synthetic tokens, a local text file or a token file, sharded per
data-parallel rank.

Every source is a sequence-indexed dataset (sequence i is fixed by the source alone), and
data-parallel rank r of d reads sequences r, r + d, r + 2d, ...: the global batch of a step is
the same for every parallel layout with the same global batch size, which is what makes losses
comparable across DDP / FSDP / TP, and a resumed run reads exactly what it would have read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .config import ConfigError, DataConfig
from .faults import DelayedCollate

log = logging.getLogger("fleetscope.trainer")
BYTE_OFFSET = 3
"""Byte tokenizer: ids 0-2 are reserved (pad, bos, eos), byte b is id b + 3 (the ByT5 convention)."""


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


class TokenSequences(Dataset):
    """Consecutive, non-overlapping `seq_len` windows of a flat token array; indices wrap (epochs)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, length: int, source: str):
        self.tokens = tokens
        self.source = source
        self.seq_len = seq_len
        self.sequences = len(tokens) // seq_len
        if self.sequences == 0:
            raise ConfigError(f"data.path: {source} holds {len(tokens)} tokens, fewer than one sequence of {seq_len}")
        self.length = length
        if length > self.sequences:
            log.info("%s: %d sequences of %d tokens; training reads %d (%.1f epochs)", source, self.sequences,
                     seq_len, length, length / self.sequences)

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict:
        # DataLoader workers re-open a memory map instead of receiving a copy of the whole file.
        state = dict(self.__dict__)
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (self.tokens.filename, self.tokens.dtype.str)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["tokens"], tuple):
            filename, dtype = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r")
        self.__dict__.update(state)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = (index % self.sequences) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len].astype(np.int64))


def read_token_file(path: Path, dtype: str, vocab_size: int) -> np.ndarray:
    """Memory-map a flat file of token ids (e.g. written with numpy.ndarray.tofile)."""
    if not path.is_file():
        raise ConfigError(f"data.path: {path} does not exist")
    itemsize = np.dtype(dtype).itemsize
    if path.stat().st_size % itemsize:
        raise ConfigError(f"data.path: {path} is {path.stat().st_size} bytes, not a whole number of {dtype} ids")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    largest = int(tokens.max()) if len(tokens) else 0
    if largest >= vocab_size:
        raise ConfigError(f"data.path: {path} holds token id {largest}, beyond the model's vocabulary ({vocab_size})")
    return tokens


def tokenize_text_file(path: Path, tokenizer: str, vocab_size: int) -> np.ndarray:
    """Token ids of a UTF-8 text file with an offline tokenizer (no hub access)."""
    if not path.is_file():
        raise ConfigError(f"data.path: {path} does not exist")
    data = path.read_bytes()
    if tokenizer == "bytes":
        if vocab_size < 256 + BYTE_OFFSET:
            raise ConfigError(f"data.tokenizer: bytes needs a vocabulary of >= 259 ids, the model has {vocab_size}")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
    return _bpe_ids(data.decode("utf-8", errors="replace"), vocab_size)


def _bpe_ids(text: str, vocab_size: int) -> np.ndarray:
    """A byte-level BPE trained on the text itself to `vocab_size` ids (deterministic, in memory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(text.splitlines(keepends=True) or [text], trainer=trainer)
    return np.asarray(bpe.encode(text).ids, dtype=np.int32)


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


def build_loader(config: DataConfig, *, plan: DataPlan, start_step: int, use_cuda: bool,
                 delay_ms: float = 0.0) -> DataLoader:
    """A DataLoader over this rank's shard, resuming after `start_step` steps' worth of batches;
    `delay_ms` > 0 slows the fetch of every batch (the faults.data_delay_* fault)."""
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
        collate_fn=DelayedCollate(delay_ms) if delay_ms > 0 else None,
    )


def data_plan(config: DataConfig, *, vocab_size: int, seed: int, steps: int, dp_rank: int,
              dp_size: int) -> DataPlan:
    """The dataset of the configured source, long enough for `steps` steps of every dp rank."""
    length = steps * config.batch_size * dp_size
    if config.source == "synthetic":
        dataset = SyntheticTokens(vocab_size=vocab_size, seq_len=config.seq_len, seed=seed, length=length)
    elif config.source == "tokens":
        tokens = read_token_file(Path(config.path), config.token_dtype, vocab_size)
        dataset = TokenSequences(tokens, seq_len=config.seq_len, length=length, source=config.path)
    else:
        tokens = tokenize_text_file(Path(config.path), config.tokenizer, vocab_size)
        dataset = TokenSequences(tokens, seq_len=config.seq_len, length=length, source=config.path)
    return DataPlan(dataset, dp_rank, dp_size)
