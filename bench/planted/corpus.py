"""A ground-truth corpus of small single-GPU training programs with planted performance problems.

    python bench/planted/corpus.py OUT_DIR [NAME ...]          # every program (or the named ones), on CUDA
    python bench/planted/corpus.py OUT_DIR --device cpu        # smoke mode: tiny sizes, CPU profiler only
    python bench/planted/corpus.py --list                      # names and their causes

Each program is written the way a user would write it (plain PyTorch and torch.profiler, no fleetscope code),
with zero, one or two planted problems named by the labels in CAUSES. A program is one function
`build(dev, fixes) -> Program` whose `step()` runs one training step; every planted problem sits behind
`if LABEL not in fixes`, so the same code runs as written (no fixes) and with a problem removed by the fix a user
would make. For each program the harness writes OUT_DIR/NAME/:

  rank0.*.pt.trace.json.gz  a Kineto trace with ProfilerStep#2 and #3 (warm-up and compilation happen first)
  planted.json              causes (largest first), the cost of each in ms per step, step_ms (as written) and
                            fixed_step_ms (every problem removed): medians of >= 7 steps, each between two
                            synchronizes, after warm-up, profiler off. One problem: cost = step_ms - fixed_step_ms;
                            two: cost of each = step_ms - the step with only that one removed.

Every timed step starts and ends with a synchronize, so host work at the start of a step cannot hide behind the
previous step's GPU work in the timing. The programs whose problem is host-side read their loss with `.item()`
at the end of the step, as a loop that logs every step does, so their traces serialise the same way.
On an error the traceback goes to OUT_DIR/NAME/error.txt and the run goes on; once TIME_GUARD_S have passed the
remaining programs are skipped (skipped.txt). Programs that use torch.compile run last: Inductor leaves a large
Python heap behind, which would inflate every later gc.collect(). Inductor and Triton caches go to
OUT_DIR/.compile_cache, removed at the end, so every run compiles cold. CORPUS.md lists the programs.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import random
import shutil
import socket
import statistics
import string
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
from torch.utils.checkpoint import checkpoint

HOST_SYNCS, HOST_WORK, LAUNCH_BOUND, PRECISION = "host_syncs", "host_work", "launch_bound", "precision"
OPTIMIZER_IMPL, ALLOCATOR_CHURN, RECOMPILATION = "optimizer_impl", "allocator_churn", "recompilation"
CHECKPOINT_IN_STEP, DATA_LOADER, PAGEABLE_COPY = "checkpoint_in_step", "data_loader", "pageable_copy"
GC_PAUSES, EAGER_ATTENTION, ACTIVATION_CHECKPOINTING = "gc_pauses", "eager_attention", "activation_checkpointing"
DDP_UNUSED_PARAMS, TINY_BATCH = "ddp_unused_params", "tiny_batch"
CAUSES = (HOST_SYNCS, HOST_WORK, LAUNCH_BOUND, PRECISION, OPTIMIZER_IMPL, ALLOCATOR_CHURN, RECOMPILATION,
          CHECKPOINT_IN_STEP, DATA_LOADER, PAGEABLE_COPY, GC_PAUSES, EAGER_ATTENTION, ACTIVATION_CHECKPOINTING,
          DDP_UNUSED_PARAMS, TINY_BATCH)

WARMUP_STEPS = 3
TIMED_STEPS = 9
TIME_GUARD_S = 8 * 60
BF16 = torch.bfloat16
Fixes = frozenset


# ----------------------------------------------------------------------------------------------- the harness

@dataclass(frozen=True)
class Dev:
    """Where a program runs: the device, and a scratch folder (OUT_DIR/NAME/tmp) for programs that write files."""

    device: torch.device
    scratch: Path

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, gpu: int, cpu: int) -> int:
        """A size: `gpu` on CUDA, the tiny `cpu` in smoke mode."""
        return gpu if self.gpu else cpu

    def sync(self) -> None:
        """torch.cuda.synchronize() (on the CPU there is nothing to wait for)."""
        if self.gpu:
            torch.cuda.synchronize()

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=BF16)


@dataclass
class Program:
    """What a builder returns: `step()` runs one training step, `close()` releases what setup made, and `scale`
    multiplies the timed step (tiny_batch: steps per 256 samples, so both variants time the same samples)."""

    step: Callable[[], object]
    close: Callable[[], None] = lambda: None
    scale: int = 1


Build = Callable[[Dev, Fixes], Program]


@dataclass(frozen=True)
class Spec:
    """A registered program: its builder, its planted causes, and the words CORPUS.md and planted.json use."""

    name: str
    build: Build
    causes: tuple[str, ...]
    planted: str
    fix: str
    shape: str
    with_stack: bool
    warmup: int
    timed: int
    compiles: bool

    @property
    def description(self) -> str:
        return f"{self.planted}; fix: {self.fix}." if self.causes else f"Healthy: {self.planted}."


PROGRAMS: dict[str, Spec] = {}


def program(*causes: str, planted: str, fix: str = "nothing to fix", shape: str, with_stack: bool = False,
            warmup: int = WARMUP_STEPS, timed: int = TIMED_STEPS, compiles: bool = False) -> Callable[[Build], Build]:
    """Register a builder under its function name with the causes it plants (none: a healthy program)."""
    assert all(cause in CAUSES for cause in causes) and timed >= 7, (causes, timed)

    def register(build: Build) -> Build:
        PROGRAMS[build.__name__] = Spec(build.__name__, build, causes, planted, fix, shape, with_stack, warmup,
                                        timed, compiles)
        return build

    return register


@contextmanager
def isolated(dev: Dev) -> Iterator[None]:
    """Run one variant of a program, then restore the process-wide state programs change (TF32 flags, matmul
    precision, gc, the dynamo cache limit, a process group) and free what it left on the device."""
    import torch._dynamo
    import torch.distributed as dist
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision, thresholds, gc_on = torch.get_float32_matmul_precision(), gc.get_threshold(), gc.isenabled()
    cache_limit = torch._dynamo.config.cache_size_limit
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
        torch.set_float32_matmul_precision(precision)
        torch._dynamo.config.cache_size_limit = cache_limit
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        (gc.enable if gc_on else gc.disable)()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if dev.gpu:
            torch.cuda.empty_cache()


def median_step_ms(prog: Program, dev: Dev, steps: int) -> float:
    """Median of `steps` steps, each between two synchronizes, times the program's scale."""
    times = []
    for _ in range(steps):
        dev.sync()
        start = time.perf_counter()
        prog.step()
        dev.sync()
        times.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times) * prog.scale


def record_trace(prog: Program, dev: Dev, directory: Path, with_stack: bool) -> None:
    """Four steps under the profiler: wait, warm-up, then two recorded steps (ProfilerStep#2 and #3). With
    stacks, the profiler also records garbage collections (`record_python_gc_info`, where torch has it), as
    one profiling to find where Python time goes would."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.gpu else [])
    extra = {}
    if with_stack:
        try:
            extra["experimental_config"] = torch.profiler._ExperimentalConfig(record_python_gc_info=True)
        except (TypeError, AttributeError):
            pass
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(directory), worker_name="rank0", use_gzip=True),
                 record_shapes=True, with_stack=with_stack, **extra) as prof:
        for _ in range(4):
            prog.step()
            prof.step()
    dev.sync()


def measure(spec: Spec, dev: Dev, fixes: Fixes, trace_dir: Path | None = None) -> float:
    """Build the program with `fixes`, warm it up, record the trace (as written only), and time it."""
    with isolated(dev):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        prog = spec.build(dev, fixes)
        try:
            for _ in range(spec.warmup):
                prog.step()
            if trace_dir is not None:
                record_trace(prog, dev, trace_dir, spec.with_stack)
            return median_step_ms(prog, dev, spec.timed)
        finally:
            prog.close()
            del prog


def run_one(spec: Spec, dev: Dev, directory: Path) -> dict:
    """Everything for one program: the trace, the timings with and without its problems, planted.json."""
    step_ms = measure(spec, dev, Fixes(), trace_dir=directory)
    fixed_ms = measure(spec, dev, Fixes(spec.causes)) if spec.causes else step_ms
    if len(spec.causes) == 1:
        planted = {spec.causes[0]: step_ms - fixed_ms}
    else:
        planted = {cause: step_ms - measure(spec, dev, Fixes({cause})) for cause in spec.causes}
    causes = sorted(planted, key=planted.__getitem__, reverse=True)
    record = {"program": spec.name, "causes": causes,
              "planted_ms_per_step": {cause: round(planted[cause], 3) for cause in causes},
              "step_ms": round(step_ms, 3), "fixed_step_ms": round(fixed_ms, 3), "healthy": not spec.causes,
              "description": spec.description, "device": torch.cuda.get_device_name() if dev.gpu else "cpu",
              "torch": torch.__version__}
    (directory / "planted.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def prepare(directory: Path) -> None:
    """An empty result folder for a program (traces and results of an earlier run removed)."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in [*directory.glob("*.pt.trace.json*"), *(directory / n for n in ("planted.json", "error.txt",
                                                                               "skipped.txt"))]:
        old.unlink(missing_ok=True)
    shutil.rmtree(directory / "tmp", ignore_errors=True)


def summary(record: dict, seconds: float) -> str:
    costs = " ".join(f"{c}={ms:.2f}" for c, ms in record["planted_ms_per_step"].items()) or "-"
    return (f"{record['program']:38s} {'+'.join(record['causes']) or 'healthy':40s} cost {costs} ms; "
            f"step {record['step_ms']:.2f} ms, fixed {record['fixed_step_ms']:.2f} ms ({seconds:.1f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="OUT_DIR")
    parser.add_argument("names", nargs="*", help="programs to run (default: all)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--list", action="store_true", help="print the programs and their causes")
    args = parser.parse_intermixed_args(argv)
    if args.list:
        for spec in PROGRAMS.values():
            print(f"{spec.name:38s} {'+'.join(spec.causes) or 'healthy'}")
        return 0
    if args.out is None:
        parser.error("OUT_DIR is required")
    if unknown := [name for name in args.names if name not in PROGRAMS]:
        parser.error(f"unknown programs: {', '.join(unknown)} (see --list)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; --device cpu runs the smoke mode")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    names = sorted(args.names or PROGRAMS, key=lambda name: PROGRAMS[name].compiles)
    cache = args.out / ".compile_cache"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")   # no compile caches outside OUT_DIR
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    started, failed, skipped = time.monotonic(), [], []
    for name in names:
        directory = args.out / name
        prepare(directory)
        if time.monotonic() - started > TIME_GUARD_S:
            (directory / "skipped.txt").write_text(f"skipped: the run had used more than {TIME_GUARD_S} s\n")
            skipped.append(name)
            print(f"{name:38s} skipped (time guard)", flush=True)
            continue
        begin = time.monotonic()
        try:
            print(summary(run_one(PROGRAMS[name], Dev(device, directory / "tmp"), directory),
                          time.monotonic() - begin), flush=True)
        except Exception as error:  # one program's failure must not stop the corpus
            (directory / "error.txt").write_text(traceback.format_exc())
            failed.append(name)
            print(f"{name:38s} ERROR {type(error).__name__}: {error} ({time.monotonic() - begin:.1f} s)", flush=True)
        finally:
            shutil.rmtree(directory / "tmp", ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    print(f"done in {time.monotonic() - started:.1f} s: {len(names) - len(failed) - len(skipped)} ran, "
          f"{len(failed)} failed {failed}, {len(skipped)} skipped", flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------ shared building blocks

def mlp(width: int, depth: int, *, norm: bool = False, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """depth x (Linear(width, width) [+ LayerNorm] + activation)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), *([nn.LayerNorm(width)] if norm else []), act()]
    return nn.Sequential(*layers)


def classifier(d_in: int, width: int, depth: int, classes: int = 100) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), mlp(width, depth), nn.Linear(width, classes))


class FeedForward(nn.Module):
    """Pre-norm residual MLP block: x + W2 gelu(W1 norm(x))."""

    def __init__(self, width: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 4 * width
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + mask) V written out, materialising [B, H, S, S] scores and probabilities.
    A bool mask is True where attention is not allowed; a float mask is added."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1) @ v


def causal_attention(dev: Dev, seq: int, eager: bool) -> Attend:
    """The hand-written attention with a materialised [S, S] causal mask, or SDPA with is_causal."""
    if not eager:
        return sdpa_causal
    return partial(eager_attention, mask=torch.ones(seq, seq, dtype=torch.bool, device=dev.device).triu(1))


class Block(nn.Module):
    """Pre-norm transformer block; `attend(q, k, v)` on [B, H, S, D] tensors is its attention."""

    def __init__(self, width: int, heads: int, attend: Attend = sdpa_causal) -> None:
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ff = FeedForward(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, s, w))
        return self.ff(x)


def transformer(dev: Dev, width: int, depth: int, attend: Attend = sdpa_causal, heads: int = 16) -> nn.Sequential:
    """depth transformer blocks (4 heads in smoke mode, where widths are tiny)."""
    return nn.Sequential(*(Block(width, heads if dev.gpu else 4, attend) for _ in range(depth)))


class Checkpointed(nn.Module):
    """Runs each block through torch.utils.checkpoint when `enabled`, plainly otherwise."""

    def __init__(self, blocks: Sequence[nn.Module], enabled: bool) -> None:
        super().__init__()
        self.blocks, self.enabled = nn.ModuleList(blocks), enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.enabled else block(x)
        return x


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


def conv_net(widths: Sequence[int], per_stage: int = 2, classes: int = 10) -> nn.Sequential:
    """Stages of `per_stage` conv blocks, max-pooled between stages; global average pool and a linear head."""
    layers: list[nn.Module] = []
    c = 3
    for i, w in enumerate(widths):
        layers += [nn.MaxPool2d(2)] if i else []
        for _ in range(per_stage):
            layers.append(conv_block(c, w))
            c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


def images(dev: Dev, batch: int, size: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(batch, 3, size, size, device=dev.device),
            torch.randint(0, classes, (batch,), device=dev.device))


def fit(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor | None = None,
        amp: Dev | None = None) -> torch.Tensor:
    """One optimizer step on cross-entropy against y (or the mean square of the output); the forward under bf16
    autocast when `amp` is given."""
    with amp.autocast() if amp is not None else nullcontext():
        out = model(x)
    loss = F.cross_entropy(out.float(), y) if y is not None else out.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def fused_adamw(model: nn.Module | list, lr: float = 1e-4) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters() if isinstance(model, nn.Module) else model, lr=lr, fused=True)


def adamw(params: object, fixed: bool) -> torch.optim.AdamW:
    """AdamW as written (foreach=False: the per-parameter loop) or fixed (fused=True)."""
    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fixed else {"foreach": False}))


def graphed(dev: Dev, train: Callable[[], object]) -> Callable[[], None]:
    """Capture `train` (which starts with zero_grad(set_to_none=True) and uses static tensors only) in a CUDA
    graph after three warm-up runs on a side stream; the returned callable replays it. Without a GPU (smoke
    mode) there are no graphs: `train` itself."""
    if not dev.gpu:
        return train
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            train()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train()
    return graph.replay


def reset_dynamo() -> None:
    import torch._dynamo
    torch._dynamo.reset()


def pinned(dev: Dev, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in page-locked host memory (nothing to pin without a GPU)."""
    return tensor.pin_memory() if dev.gpu else tensor


def host_batch(rows: int, width: int) -> torch.Tensor:
    """A large bf16 batch in ordinary (pageable) host memory, made quickly from a repeated random tile."""
    return torch.randn(rows // 16, width).to(BF16).repeat(16, 1)


def saver(dev: Dev, every: int) -> Callable[[dict], None]:
    """torch.save(state, scratch/checkpoint.pt) on every `every`-th call."""
    dev.scratch.mkdir(parents=True, exist_ok=True)
    calls = itertools.count(1)

    def save(state: dict) -> None:
        if next(calls) % every == 0:
            torch.save(state, dev.scratch / "checkpoint.pt")

    return save


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PUNCT = ".,;:!?"


@dataclass
class Corpus:
    """Synthetic text: a vocabulary of words and 3-letter pieces, and documents of those words (some unknown,
    capitalised or punctuated)."""

    vocab: dict[str, int]
    texts: list[str]


def make_corpus(docs: int, words_per_doc: int) -> Corpus:
    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9))) for _ in range(4000)]
    vocab = {w: i + 3 for i, w in enumerate(words[:3000])}
    for w in words:
        for i in range(0, len(w), 3):
            vocab.setdefault(w[i:i + 3], len(vocab) + 3)

    def word() -> str:
        w = rng.choice(words)
        return (w.capitalize() if rng.random() < 0.1 else w) + (rng.choice(PUNCT) if rng.random() < 0.1 else "")

    return Corpus(vocab, [" ".join(word() for _ in range(rng.randint(words_per_doc * 2 // 3, words_per_doc)))
                          for _ in range(docs)])


def tokenize(text: str, vocab: dict[str, int], length: int) -> list[int]:
    """A word-level tokenizer in Python: lowercase, strip punctuation, look words up, split unknown words into
    3-letter pieces, truncate and pad (BOS 1, UNK 2, PAD 0)."""
    ids = [1]
    for word in text.lower().split():
        word = word.strip(PUNCT)
        if word in vocab:
            ids.append(vocab[word])
        else:
            ids.extend(vocab.get(word[i:i + 3], 2) for i in range(0, len(word), 3))
    ids = ids[:length]
    return ids + [0] * (length - len(ids))


def tokenized(texts: Sequence[str], vocab: dict[str, int], length: int) -> torch.Tensor:
    return torch.tensor([tokenize(t, vocab, length) for t in texts])


class SpectrumDataset(torch.utils.data.Dataset):
    """Each sample is made on the host with numpy: a seeded random signal cut into `frames` windows, Hann window,
    FFT, log magnitude of `bins` bins, normalised (a tenth of a millisecond or so of CPU per sample)."""

    def __init__(self, frames: int, bins: int, classes: int = 100) -> None:
        self.frames, self.bins, self.classes = frames, bins, classes
        self.window = np.hanning(2 * bins).astype(np.float32)

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        signal = rng.standard_normal((self.frames, 2 * self.bins)).astype(np.float32)
        spectrum = np.log1p(np.abs(np.fft.rfft(signal * self.window, axis=-1)))[:, :self.bins]
        spectrum = (spectrum - spectrum.mean()) / (spectrum.std() + 1e-6)
        return torch.from_numpy(spectrum.astype(np.float32)), index % self.classes


class RecordDataset(torch.utils.data.Dataset):
    """Records 'read from storage': a 0.2 ms wait (I/O latency) per sample, then bytes decoded into an image."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.raw = np.random.default_rng(0).integers(0, 256, 3 * size * size, dtype=np.uint8).tobytes()

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.0002)
        image = torch.frombuffer(bytearray(self.raw), dtype=torch.uint8).view(3, self.size, self.size)
        return image.float().div_(255.0), index % 10


def loader(dataset: torch.utils.data.Dataset, batch: int, fixed: bool) -> Iterator:
    """The DataLoader as written (samples made in the training process) or fixed (four persistent workers)."""
    if fixed:
        return iter(torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=4, persistent_workers=True,
                                                prefetch_factor=4))
    return iter(torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=0))


# ---------------------------------------------------------------------------------------------- host_syncs

def logged(h: torch.Tensor, stats: list, on_device: bool) -> None:
    """Log an activation's mean, max and dead (zero) fraction: as Python floats (.item(), a sync each) or as
    device tensors."""
    a = h.detach().abs()
    values = (a.mean(), a.amax(), (a == 0).float().mean())
    stats.append(values if on_device else tuple(v.item() for v in values))


@program(HOST_SYNCS, with_stack=True,
         planted="three .item() reads per layer (activation mean, max and dead fraction, for logging)",
         fix="keep the statistics as device tensors and read them once per epoch",
         shape="24 x Linear(2048)+ReLU, bf16, 4096 rows, fused AdamW")
def host_syncs_item_per_layer(dev: Dev, fixes: Fixes) -> Program:
    """Each .item() is aten::item -> aten::_local_scalar_dense: a device-to-host copy and a stream synchronize.
    The host waits for the layer to finish, then the GPU idles until the host has launched the next one: 72 GPU
    gaps a step, each behind a synchronizing copy under the Python frame `logged`."""
    width, rows = dev.pick(2048, 64), dev.pick(4096, 32)
    layers = nn.ModuleList(nn.Linear(width, width) for _ in range(24)).to(dev.device, BF16)
    opt = fused_adamw(layers)
    x = torch.randn(rows, width, device=dev.device, dtype=BF16)
    stats: list[tuple] = []

    def step() -> None:
        stats.clear()
        h = x
        for layer in layers:
            h = torch.relu(layer(h))
            logged(h, stats, HOST_SYNCS in fixes)
        h.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program(step)


@program(HOST_SYNCS, with_stack=True,
         planted="a per-block activation penalty over the non-padding tokens, selected with h[valid] (a bool mask)",
         fix="weight by the mask instead of indexing with it (no nonzero)",
         shape="24 FeedForward blocks (768, ffn 3072), bf16, 4 x 1024 tokens (90% valid), fused AdamW")
def host_syncs_bool_mask(dev: Dev, fixes: Fixes) -> Program:
    """h[valid] is aten::index -> aten::nonzero, whose output size depends on the data: the host copies the count
    back and synchronizes before it can allocate the result, so the GPU drains 24 times a step."""
    seq, width = dev.pick(1024, 32), dev.pick(768, 64)
    blocks = nn.Sequential(*(FeedForward(width) for _ in range(24))).to(dev.device, BF16)
    opt = fused_adamw(blocks)
    x = torch.randn(4, seq, width, device=dev.device, dtype=BF16)
    lengths = torch.tensor([seq, seq * 9 // 10, seq * 85 // 100, seq * 95 // 100], device=dev.device)
    valid = torch.arange(seq, device=dev.device) < lengths[:, None]
    weight, count = valid.float(), valid.sum()

    def penalty(h: torch.Tensor) -> torch.Tensor:
        if HOST_SYNCS in fixes:
            return (h.float().pow(2).mean(-1) * weight).sum() / count
        return h[valid].float().pow(2).mean()

    def step() -> None:
        h, total = x, 0.0
        for block in blocks:
            h = block(h)
            total = total + penalty(h)
        (h.float().mean() + 1e-3 * total).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program(step)


@program(HOST_SYNCS, planted="predictions read with .tolist() after every micro-batch, for a running accuracy",
         fix="count correct predictions on the device (correct += (pred == y).sum()) and read it once per epoch",
         shape="8 micro-batches x 2048 rows, 2048 -> 4 x Linear(2048) bf16 classifier, fused AdamW")
def host_syncs_tolist_metric(dev: Dev, fixes: Fixes) -> Program:
    """Gradient accumulation over 8 micro-batches. `.tolist()` copies the predictions to the host (a synchronizing
    device-to-host copy): the host waits for each micro-batch's forward, and the GPU idles while Python compares
    them with the labels and launches the backward."""
    width, rows, micro = dev.pick(2048, 64), dev.pick(2048, 32), 8
    model = classifier(width, width, 3).to(dev.device, BF16)
    opt = fused_adamw(model)
    xs = torch.randn(micro, rows, width, device=dev.device, dtype=BF16)
    ys = torch.randint(0, 100, (micro, rows), device=dev.device)
    labels = ys.cpu().tolist()
    correct, seen = torch.zeros((), dtype=torch.long, device=dev.device), [0]

    def step() -> None:
        for x, y, y_host in zip(xs, ys, labels):
            logits = model(x)
            if HOST_SYNCS in fixes:
                correct.add_((logits.argmax(-1) == y).sum())
            else:
                seen[0] += sum(p == t for p, t in zip(logits.argmax(-1).tolist(), y_host))
            (F.cross_entropy(logits.float(), y) / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program(step)


@program(HOST_SYNCS, planted="per-block timing hooks that call torch.cuda.synchronize() before and after each block",
         fix="record CUDA events in the hooks and read the timings after the epoch",
         shape="16 conv blocks (128 channels, 32x32), batch 64, bf16 autocast, fused AdamW")
def host_syncs_timing_hooks(dev: Dev, fixes: Fixes) -> Program:
    """32 cudaDeviceSynchronize calls a step in the forward: the host stops launching until the GPU has drained,
    so the GPU idles at each one for as long as the host takes to launch the next block."""
    width, size = dev.pick(128, 8), dev.pick(32, 8)
    blocks = [conv_block(3, width), *(conv_block(width, width) for _ in range(15))]
    model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)).to(dev.device)
    opt = fused_adamw(model)
    x, y = images(dev, 64, size)
    marks: list = []

    def mark(*_: object) -> None:
        if HOST_SYNCS not in fixes:
            dev.sync()
            marks.append(time.perf_counter())
        elif dev.gpu:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()

    for block in blocks:
        block.register_forward_pre_hook(mark)
        block.register_forward_hook(mark)

    def step() -> None:
        marks.clear()
        fit(model, opt, x, y, amp=dev)

    return Program(step)


# ----------------------------------------------------------------------------------------------- host_work

@program(HOST_WORK, planted="each batch of 128 raw documents is tokenized in Python inside the step",
         fix="tokenize once before training and keep the token ids on the device",
         shape="Embedding(8.9k, 512) + 4 FeedForward blocks, 128 x 128 tokens, bf16, fused AdamW")
def host_work_tokenize(dev: Dev, fixes: Fixes) -> Program:
    """Milliseconds of Python (word lookups, sub-word splitting, padding) with no launches, then torch.tensor of
    the id lists and a copy: a GPU gap at the start of every step with only aten::tensor / aten::to at its end."""
    length, width = dev.pick(128, 32), dev.pick(512, 32)
    corpus = make_corpus(docs=512, words_per_doc=dev.pick(128, 32))
    model = nn.Sequential(nn.Embedding(len(corpus.vocab) + 3, width), *(FeedForward(width) for _ in range(4)))
    head = nn.Linear(width, 10)
    model, head = model.to(dev.device, BF16), head.to(dev.device, BF16)
    opt = fused_adamw([*model.parameters(), *head.parameters()])
    batches = [corpus.texts[i:i + 128] for i in range(0, len(corpus.texts), 128)]
    ready = [tokenized(b, corpus.vocab, length).to(dev.device) for b in batches] if HOST_WORK in fixes else []
    labels = torch.randint(0, 10, (128,), device=dev.device)
    counter, losses = itertools.count(), []

    def step() -> None:
        i = next(counter) % len(batches)
        ids = ready[i] if HOST_WORK in fixes else tokenized(batches[i], corpus.vocab, length).to(dev.device)
        loss = F.cross_entropy(head(model(ids).mean(1)).float(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return Program(step)


MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)


def augment(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Pad-and-crop, horizontal flip, contrast and brightness jitter, normalise: HWC uint8 -> CHW float32."""
    size = img.shape[0]
    top, left = rng.integers(0, 9, size=2)
    out = np.pad(img, ((4, 4), (4, 4), (0, 0)), mode="reflect")[top:top + size, left:left + size]
    out = out.astype(np.float32) / 255.0
    if rng.random() < 0.5:
        out = out[:, ::-1]
    mean = out.mean()
    out = (out - mean) * rng.uniform(0.8, 1.2) + mean * rng.uniform(0.8, 1.2)
    return np.ascontiguousarray(((out - MEAN) / STD).transpose(2, 0, 1))


def augment_on_device(batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The same augmentation on the device for a [B, 3, H, W] uint8 batch (one crop offset per batch)."""
    b, size, device = batch.shape[0], batch.shape[-1], batch.device
    top, left = torch.randint(0, 9, (2,), generator=gen).tolist()   # a CPU generator: no device sync
    x = F.pad(batch.float() / 255.0, (4, 4, 4, 4), mode="reflect")[..., top:top + size, left:left + size]
    x = torch.where(torch.rand(b, 1, 1, 1, device=device) < 0.5, x.flip(-1), x)
    mean, jitter = x.mean((1, 2, 3), keepdim=True), torch.empty(2, b, 1, 1, 1, device=device).uniform_(0.8, 1.2)
    x = (x - mean) * jitter[0] + mean * jitter[1]
    return (x - torch.from_numpy(MEAN).to(device)[:, None, None]) / torch.from_numpy(STD).to(device)[:, None, None]


@program(HOST_WORK, planted="per-image numpy augmentation (crop, flip, jitter, normalise) of each batch on the host",
         fix="keep the uint8 images on the device and augment the batch there with torch ops",
         shape="conv net (32-64-128 channels), batch 128 of 96x96 images, bf16 autocast, fused AdamW")
def host_work_numpy_augment(dev: Dev, fixes: Fixes) -> Program:
    """A Python loop of numpy work per image, then np.stack, from_numpy and a copy: the GPU idles while the CPU
    timeline shows no operator until the batch's aten::to."""
    size, batch = dev.pick(96, 16), dev.pick(128, 8)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, (256, size, size, 3), dtype=np.uint8)
    pool_dev = torch.from_numpy(pool).permute(0, 3, 1, 2).contiguous().to(dev.device)
    gen = torch.Generator().manual_seed(0)
    model = conv_net((32, 64, 128)).to(dev.device)
    opt = fused_adamw(model)
    y = torch.randint(0, 10, (batch,), device=dev.device)
    losses: list[float] = []

    def step() -> None:
        if HOST_WORK in fixes:
            x = augment_on_device(pool_dev[torch.randint(0, len(pool), (batch,), device=dev.device)], gen)
        else:
            x = torch.from_numpy(np.stack([augment(pool[i], rng) for i in rng.integers(0, len(pool), batch)]))
        losses.append(fit(model, opt, x.to(dev.device), y, amp=dev).item())

    return Program(step)


def curriculum_weights(ages: list[float], t: float) -> list[float]:
    """w_i = exp(-age_i / 30) * (1 + 0.5 sin(0.01 i + t)), one sample at a time, in Python."""
    return [math.exp(-a / 30.0) * (1.0 + 0.5 * math.sin(0.01 * i + t)) for i, a in enumerate(ages)]


@program(HOST_WORK, planted="the batch is drawn with torch.randn on the CPU every step, then moved with .to(device)",
         fix="draw the batch on the device (torch.randn(..., device=...))",
         shape="2048 x 2048 batch, 2048 -> 6 x Linear(4096) bf16 MLP, fused AdamW")
def host_work_cpu_batch(dev: Dev, fixes: Fixes) -> Program:
    """A 4M-element aten::normal_ on the host (no kernel) and a host-to-device copy before any launch."""
    rows, d_in, width = dev.pick(2048, 256), dev.pick(2048, 64), dev.pick(4096, 64)
    model = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), mlp(width, 6)).to(dev.device, BF16)
    opt = fused_adamw(model)
    losses: list[float] = []

    def step() -> None:
        if HOST_WORK in fixes:
            x = torch.randn(rows, d_in, device=dev.device, dtype=BF16)
        else:
            x = torch.randn(rows, d_in).to(dev.device, BF16)
        losses.append(fit(model, opt, x).item())

    return Program(step)


# -------------------------------------------------------------------------------------------- launch_bound

@program(LAUNCH_BOUND, planted="64 tiny Linear(256)+LayerNorm+GELU layers at batch 8: ~600 small kernels a step",
         fix="capture the whole training step in a CUDA graph and replay it",
         shape="64 x (Linear(256), LayerNorm, GELU), batch 8, fp32, SGD momentum")
def launch_bound_tiny_layers(dev: Dev, fixes: Fixes) -> Program:
    """Each kernel runs for a few microseconds, less than the host needs to launch it: the GPU timeline is mostly
    gaps, every kernel starting right after its cudaLaunchKernel."""
    width = dev.pick(256, 32)
    model = mlp(width, 64, norm=True, act=nn.GELU).to(dev.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(8, width, device=dev.device), torch.randn(8, width, device=dev.device)

    def train() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return Program(graphed(dev, train) if LAUNCH_BOUND in fixes else train)


def smooth_activation(x: torch.Tensor) -> torch.Tensor:
    """A hand-written activation: ten gated updates of six elementwise ops each (60 launches unfused)."""
    for a in (0.5, 0.7, 0.9, 1.1, 1.3, 1.5, 1.7, 1.9, 2.1, 2.3):
        x = x + 0.1 * torch.tanh(a * x) * torch.sigmoid(x)
    return x


class SmoothMLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = smooth_activation(layer(x))
        return x


@program(LAUNCH_BOUND, warmup=5, compiles=True,
         planted="an unfused 60-op elementwise activation after each of 4 small layers: ~750 tiny kernels a step",
         fix="torch.compile(model, mode='reduce-overhead') (fusion and CUDA graphs)",
         shape="4 x (Linear(512) + 60-op activation), batch 64, fp32, SGD")
def launch_bound_elementwise(dev: Dev, fixes: Fixes) -> Program:
    """Every activation op is its own kernel on a 32k-element tensor, forward and backward (~2 us on the GPU,
    several to launch): a comb of elementwise kernels separated by launch gaps."""
    width = dev.pick(512, 32)
    model = SmoothMLP(width, 4).to(dev.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run = torch.compile(model, mode="reduce-overhead") if LAUNCH_BOUND in fixes else model
    x = torch.randn(64, width, device=dev.device)

    def step() -> None:
        run(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program(step, close=reset_dynamo)


# ----------------------------------------------------------------------------------------------- precision

def full_fp32_matmuls() -> None:
    """What the program as written does first: TF32 off for matrix multiplies."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


@program(PRECISION, planted="fp32 GEMMs with TF32 off (allow_tf32=False, float32 matmul precision 'highest')",
         fix="bf16 autocast for the forward", shape="3 x Linear(4096), 8192 rows, fp32 weights, fused AdamW")
def precision_fp32_mlp(dev: Dev, fixes: Fixes) -> Program:
    """Full-precision fp32 GEMMs run on the CUDA cores (sgemm / simt kernels) at about a tenth of the bf16
    tensor-core rate: the GPU is busy all step, in a few very long GEMM kernels."""
    if PRECISION not in fixes:
        full_fp32_matmuls()
    width, rows = dev.pick(4096, 64), dev.pick(8192, 64)
    model = mlp(width, 3).to(dev.device)
    opt = fused_adamw(model)
    x = torch.randn(rows, width, device=dev.device)
    return Program(lambda: fit(model, opt, x, amp=dev if PRECISION in fixes else None))


@program(PRECISION, planted="fp32 convolutions with cuDNN TF32 off (torch.backends.cudnn.allow_tf32 = False)",
         fix="TF32 on (cudnn.allow_tf32 and matmul.allow_tf32 True)",
         shape="conv net (3 x 64, 3 x 128, 3 x 256 channels), batch 64 of 128x128 images, fp32, fused AdamW")
def precision_fp32_conv(dev: Dev, fixes: Fixes) -> Program:
    """cuDNN picks full-fp32 convolution kernels (no tensor cores): long conv kernels, the GPU busy, several
    times slower than the same convolutions in TF32."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = PRECISION in fixes
    model = conv_net((64, 128, 256), per_stage=3).to(dev.device)
    opt = fused_adamw(model)
    x, y = images(dev, dev.pick(64, 4), dev.pick(128, 16))
    return Program(lambda: fit(model, opt, x, y))


# ------------------------------------------------------------------------------------------ optimizer_impl

@program(OPTIMIZER_IMPL, planted="AdamW(foreach=False) over 300 parameter tensors: ~10 kernels per tensor",
         fix="AdamW(fused=True): a few multi-tensor kernels for all parameters",
         shape="75 x (Linear(512), LayerNorm, ReLU), 1024 rows, fp32")
def optimizer_impl_foreach_mlp(dev: Dev, fixes: Fixes) -> Program:
    """The single-tensor AdamW loops over the parameters in Python, launching mul_/lerp_/addcdiv_/sqrt... for
    each: thousands of tiny kernels after the backward, host-bound, under Optimizer.step#AdamW.step."""
    width = dev.pick(512, 32)
    model = mlp(width, 75, norm=True).to(dev.device)
    opt = adamw(model.parameters(), OPTIMIZER_IMPL in fixes)
    x = torch.randn(dev.pick(1024, 16), width, device=dev.device)
    return Program(lambda: fit(model, opt, x))


# ----------------------------------------------------------------------------------------- allocator_churn

@program(ALLOCATOR_CHURN, planted="torch.cuda.empty_cache() at the end of every step",
         fix="remove the call (let the caching allocator reuse its blocks)",
         shape="8 FeedForward blocks (1024, ffn 4096), 8192 rows, bf16, fused AdamW")
def allocator_churn_mlp(dev: Dev, fixes: Fixes) -> Program:
    """empty_cache() returns every cached block to the driver (cudaFree, which synchronizes), so the next step
    cudaMallocs its ~3 GB of activations and gradients again, block by block: cudaFree / cudaMalloc calls on the
    CPU timeline with the GPU waiting behind them."""
    width, rows = dev.pick(1024, 32), dev.pick(8192, 64)
    model = nn.Sequential(*(FeedForward(width) for _ in range(8))).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(rows, width, device=dev.device, dtype=BF16)

    def step() -> None:
        fit(model, opt, x)
        if ALLOCATOR_CHURN not in fixes:
            torch.cuda.empty_cache()

    return Program(step)


@program(ALLOCATOR_CHURN, planted="torch.cuda.empty_cache() between the backward and the optimizer step",
         fix="remove the call",
         shape="conv net (64-128-256 channels), batch 128 of 64x64 images, bf16 autocast, fused AdamW")
def allocator_churn_conv(dev: Dev, fixes: Fixes) -> Program:
    """The activations freed by the backward go back to the driver every step and the next forward allocates
    them again (a cudaMalloc per block, cuDNN workspaces included); cudaFree blocks the host until the GPU idles."""
    model = conv_net((64, 128, 256)).to(dev.device)
    opt = fused_adamw(model)
    x, y = images(dev, dev.pick(128, 4), dev.pick(64, 16))

    def step() -> None:
        with dev.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        if ALLOCATOR_CHURN not in fixes:
            torch.cuda.empty_cache()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program(step)


# ------------------------------------------------------------------------------------------- recompilation

@program(RECOMPILATION, warmup=1, timed=7, compiles=True,
         planted="torch.compile(dynamic=False) fed a new sequence length every step: a recompile per step",
         fix="pad every batch to one fixed length (padding ignored by the loss)",
         shape="Embedding(1000, 256) + Linear/GELU/Linear LM head, batch 16, lengths 64, 72, 80, ...")
def recompilation_varlen(dev: Dev, fixes: Fixes) -> Program:
    """Shapes are specialised, so each new length fails the guards and Dynamo, AOTAutograd and Inductor compile
    forward and backward again inside the step: a long CPU range under Torch-Compiled Region with the GPU idle.
    cache_size_limit is raised so it keeps recompiling instead of falling back to eager."""
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 64
    vocab, width, longest = 1000, dev.pick(256, 32), 64 + 8 * 40
    model = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, vocab))
    model = model.to(dev.device)
    compiled = torch.compile(model, dynamic=False)
    opt = fused_adamw(model)
    data = torch.randint(1, vocab, (16, longest + 1), device=dev.device)
    lengths = itertools.cycle(range(64, longest, 8))

    def step() -> None:
        n = next(lengths)
        tokens, targets = data[:, :n], data[:, 1:n + 1]
        if RECOMPILATION in fixes:
            tokens, targets = F.pad(tokens, (0, longest - n)), F.pad(targets, (0, longest - n), value=-100)
        loss = F.cross_entropy(compiled(tokens).flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program(step, close=reset_dynamo)


# -------------------------------------------------------------------------------------- checkpoint_in_step

@program(CHECKPOINT_IN_STEP, with_stack=True, planted="torch.save(model.state_dict()) every step (134 MB of fp32)",
         fix="save every 1000 steps (not in these steps)",
         shape="8 x Linear(2048) fp32 weights, bf16 autocast, 16384 rows, fused AdamW")
def checkpoint_in_step_mlp(dev: Dev, fixes: Fixes) -> Program:
    """torch.save copies every parameter to the host (synchronous device-to-host Memcpy under aten::copy_) and
    writes the file with the GPU idle: a long host range (torch.save frames) with a row of D2H copies."""
    width, rows = dev.pick(2048, 64), dev.pick(16384, 64)
    model = mlp(width, 8).to(dev.device)
    opt = fused_adamw(model)
    x = torch.randn(rows, width, device=dev.device)
    save = saver(dev, 1000 if CHECKPOINT_IN_STEP in fixes else 1)

    def step() -> None:
        fit(model, opt, x, amp=dev)
        save(model.state_dict())

    return Program(step)


@program(CHECKPOINT_IN_STEP, planted="torch.save of model and optimizer state every step (56 MB with the Adam moments)",
         fix="save every 1000 steps",
         shape="conv net (64-128-256-512 channels), batch 64 of 64x64 images, bf16 autocast, fused AdamW")
def checkpoint_in_step_conv(dev: Dev, fixes: Fixes) -> Program:
    """Saving the optimizer too triples the bytes: every exp_avg / exp_avg_sq is copied to the host (synchronous
    D2H copies) and pickled, with the GPU idle until the next step's launches."""
    model = conv_net((64, 128, 256, 512)).to(dev.device)
    opt = fused_adamw(model)
    x, y = images(dev, dev.pick(64, 4), dev.pick(64, 16))
    save = saver(dev, 1000 if CHECKPOINT_IN_STEP in fixes else 1)

    def step() -> None:
        fit(model, opt, x, y, amp=dev)
        save({"model": model.state_dict(), "optimizer": opt.state_dict()})

    return Program(step)


# --------------------------------------------------------------------------------------------- data_loader

@program(DATA_LOADER, planted="DataLoader(num_workers=0) whose __getitem__ makes each sample with numpy (FFT features)",
         fix="num_workers=4, persistent_workers=True (samples made in worker processes, ahead of the step)",
         shape="batch 256 spectra (4 x 256 bins), 1024 -> 4 x Linear(2048) bf16 classifier, fused AdamW")
def data_loader_numpy_getitem(dev: Dev, fixes: Fixes) -> Program:
    """next() on the loader runs __getitem__ 256 times in the training process (enumerate(DataLoader)#
    _SingleProcessDataLoaderIter.__next__ in the trace) before anything is launched: a long GPU gap a step."""
    frames, bins = 4, dev.pick(256, 16)
    batches = loader(SpectrumDataset(frames, bins), dev.pick(256, 16), DATA_LOADER in fixes)
    model = classifier(frames * bins, dev.pick(2048, 32), 3).to(dev.device, BF16)
    opt = fused_adamw(model)
    losses: list[float] = []

    def step() -> None:
        x, y = next(batches)
        losses.append(fit(model, opt, x.flatten(1).to(dev.device, BF16), y.to(dev.device)).item())

    return Program(step)


@program(DATA_LOADER, with_stack=True,
         planted="DataLoader(num_workers=0) whose __getitem__ waits 0.2 ms per record (storage latency)",
         fix="num_workers=4, persistent_workers=True",
         shape="batch 64 of 64x64 images, conv net (32-64-128 channels), bf16 autocast, fused AdamW")
def data_loader_sleep(dev: Dev, fixes: Fixes) -> Program:
    """Sample reads wait in the training process: the loader's __next__ range (with the __getitem__ and
    time.sleep frames) on the host, the GPU idle for its whole length."""
    batches = loader(RecordDataset(dev.pick(64, 16)), dev.pick(64, 8), DATA_LOADER in fixes)
    model = conv_net((32, 64, 128)).to(dev.device)
    opt = fused_adamw(model)
    losses: list[float] = []

    def step() -> None:
        x, y = next(batches)
        losses.append(fit(model, opt, x.to(dev.device), y.to(dev.device), amp=dev).item())

    return Program(step)


# ------------------------------------------------------------------------------------------- pageable_copy

@program(PAGEABLE_COPY, planted="a 256 MB batch copied host-to-device from pageable memory every step",
         fix="pin the host buffer once (pin_memory()) and copy with non_blocking=True",
         shape="16384 x 8192 bf16 batch, Linear(8192, 1024) + 3 x Linear(1024), fused AdamW")
def pageable_copy_batch(dev: Dev, fixes: Fixes) -> Program:
    """A copy from pageable memory is staged through a driver bounce buffer at a fraction of the link's rate and
    blocks the host: a long Memcpy HtoD (Pageable) under a long aten::copy_, nothing else running."""
    rows, d_in, width = dev.pick(16384, 64), dev.pick(8192, 64), dev.pick(1024, 32)
    host = pinned(dev, host_batch(rows, d_in)) if PAGEABLE_COPY in fixes else host_batch(rows, d_in)
    model = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), mlp(width, 3)).to(dev.device, BF16)
    opt = fused_adamw(model)
    return Program(lambda: fit(model, opt, host.to(dev.device, non_blocking=PAGEABLE_COPY in fixes)))


@program(PAGEABLE_COPY, planted="32 feature tensors (8 MB each) moved to the device one by one from pageable memory",
         fix="pinned host tensors and non_blocking=True copies",
         shape="32 x [4096, 1024] bf16 features, averaged, 4 x Linear(1024) MLP, fused AdamW")
def pageable_copy_many_tensors(dev: Dev, fixes: Fixes) -> Program:
    """Each .to(device) from pageable memory is a synchronous, staged copy: 32 Memcpy HtoD (Pageable) a step,
    each blocking the host, which launches nothing meanwhile."""
    rows, width = dev.pick(4096, 32), dev.pick(1024, 32)
    tile = torch.randn(rows, width).to(BF16)
    features = {f"field{i}": tile.roll(i, 0) for i in range(32)}
    features = {k: pinned(dev, t) for k, t in features.items()} if PAGEABLE_COPY in fixes else features
    model = mlp(width, 4).to(dev.device, BF16)
    opt = fused_adamw(model)

    def step() -> None:
        batch = {k: t.to(dev.device, non_blocking=PAGEABLE_COPY in fixes) for k, t in features.items()}
        fit(model, opt, torch.stack(list(batch.values()), 1).mean(1))

    return Program(step)


# ----------------------------------------------------------------------------------------------- gc_pauses

@program(GC_PAUSES, with_stack=True, planted="gc.collect() at the end of every step, in a process with a large Python heap",
         fix="gc.freeze() after setup (the long-lived heap is no longer scanned) and no per-step collect",
         shape="torch's heap + a 50k-entry dataset index, 5k records a step, 6 x Linear(2048) bf16 at 8192 rows")
def gc_pauses_collect(dev: Dev, fixes: Fixes) -> Program:
    """A full collection traverses every tracked object (torch's own modules, the dataset index): tens of
    milliseconds of host time with no operator and no launch, an empty stretch on both timelines."""
    width, rows = dev.pick(2048, 64), dev.pick(8192, 64)
    index = [[i, f"sample-{i}", [i % 13]] for i in range(50_000)]   # a dataset index, kept for the whole run
    model = mlp(width, 6).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(rows, width, device=dev.device, dtype=BF16)
    counter, losses = itertools.count(), []
    if GC_PAUSES in fixes:
        gc.freeze()

    def step() -> None:
        n = next(counter)
        records = [{"sample": i, "step": n, "tags": [i % 7, i % 11]} for i in range(5000)]
        losses.append(fit(model, opt, x).item())
        del records
        if GC_PAUSES not in fixes:
            gc.collect()

    return Program(step, close=index.clear)


@program(GC_PAUSES, with_stack=True, planted="gc.collect() after each of 2 micro-batches ('to release memory')",
         fix="gc.disable() during the step (collect between epochs)",
         shape="2 micro-batches x 2048 rows, 2 FeedForward blocks (2048, ffn 8192), bf16, fused AdamW")
def gc_pauses_microbatch(dev: Dev, fixes: Fixes) -> Program:
    """Two full collections a step between a micro-batch's backward and the next forward: the GPU finishes the
    queued work and idles while the host walks the heap."""
    width, rows = dev.pick(2048, 64), dev.pick(2048, 32)
    model = nn.Sequential(*(FeedForward(width) for _ in range(2))).to(dev.device, BF16)
    opt = fused_adamw(model)
    xs = torch.randn(2, rows, width, device=dev.device, dtype=BF16)

    def step() -> None:
        if GC_PAUSES in fixes:
            gc.disable()
        for x in xs:
            (model(x).float().pow(2).mean() / len(xs)).backward()
            if GC_PAUSES not in fixes:
                gc.collect()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if GC_PAUSES in fixes:
            gc.enable()

    return Program(step)


# ----------------------------------------------------------------------------------------- eager_attention

@program(EAGER_ATTENTION, planted="attention written by hand with a materialised [S, S] causal mask at seq 2048",
         fix="F.scaled_dot_product_attention(q, k, v, is_causal=True) (flash attention)",
         shape="4 transformer blocks (1024, 16 heads), 4 x 2048 tokens, bf16, fused AdamW")
def eager_attention_causal(dev: Dev, fixes: Fixes) -> Program:
    """QK^T, masked_fill, softmax and PV as separate kernels over [4, 16, 2048, 2048] score tensors (512 MB each,
    read and written several times forward and backward): memory-bound softmax / masked_fill kernels and batched
    GEMMs where one flash kernel would do."""
    width, seq = dev.pick(1024, 64), dev.pick(2048, 64)
    model = transformer(dev, width, 4, causal_attention(dev, seq, EAGER_ATTENTION not in fixes)).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(4, seq, width, device=dev.device, dtype=BF16)
    return Program(lambda: fit(model, opt, x))


@program(EAGER_ATTENTION, planted="hand-written encoder attention with a materialised additive [B, 1, S, S] mask",
         fix="F.scaled_dot_product_attention(q, k, v, attn_mask=mask) (memory-efficient attention)",
         shape="4 encoder blocks (768, 12 heads), 4 x 2048 tokens with padding, bf16, fused AdamW")
def eager_attention_padding_mask(dev: Dev, fixes: Fixes) -> Program:
    """Bidirectional attention over padded sequences: the float mask is added to the full score tensor, then
    softmax and PV, an unfused chain of large memory-bound kernels per layer, forward and backward."""
    width, seq = dev.pick(768, 48), dev.pick(2048, 64)
    lengths = torch.tensor([seq, seq * 3 // 4, seq // 2, seq * 7 // 8], device=dev.device)
    pad = torch.arange(seq, device=dev.device)[None, :] >= lengths[:, None]
    mask = torch.zeros(4, 1, seq, seq, device=dev.device, dtype=BF16).masked_fill(pad[:, None, None, :], -math.inf)

    def sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    attend = sdpa_masked if EAGER_ATTENTION in fixes else partial(eager_attention, mask=mask)
    model = transformer(dev, width, 4, attend, heads=12).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(4, seq, width, device=dev.device, dtype=BF16)
    return Program(lambda: fit(model, opt, x))


# -------------------------------------------------------------------------------- activation_checkpointing

@program(ACTIVATION_CHECKPOINTING, planted="torch.utils.checkpoint on every block of a model that fits easily",
         fix="no checkpointing (the activations fit in memory)",
         shape="12 FeedForward blocks (2048, ffn 8192), 8192 rows, bf16, fused AdamW")
def activation_checkpointing_mlp(dev: Dev, fixes: Fixes) -> Program:
    """Every block's forward runs twice, the second time inside the backward: the forward GEMMs appear again in
    the backward (about a third more GEMM time) to save memory the GPU does not need."""
    width, rows = dev.pick(2048, 64), dev.pick(8192, 64)
    blocks = [FeedForward(width) for _ in range(12)]
    model = Checkpointed(blocks, ACTIVATION_CHECKPOINTING not in fixes).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(rows, width, device=dev.device, dtype=BF16)
    return Program(lambda: fit(model, opt, x))


# --------------------------------------------------------------------------------------- ddp_unused_params

@program(DDP_UNUSED_PARAMS,
         planted="DistributedDataParallel(find_unused_parameters=True) on a deep model of 256 small parameters",
         fix="find_unused_parameters=False (every parameter gets a gradient)",
         shape="1-process NCCL group, 64 x (Linear(256), LayerNorm, ReLU), 64 rows, fused AdamW")
def ddp_unused_params(dev: Dev, fixes: Fixes) -> Program:
    """With find_unused_parameters DDP walks the whole autograd graph after every forward looking for parameters
    that will get no gradient (reducer::search_unused_parameters, inside DistributedDataParallel.forward), and
    all-reduces a used-parameter bitmap: host time between forward and backward, an extra all-reduce a step.
    The cost is a per-graph-node walk, so it is a modest share even of this launch-bound step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("nccl" if dev.gpu else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    width = dev.pick(256, 16)
    model = DistributedDataParallel(mlp(width, 64, norm=True).to(dev.device),
                                    device_ids=[dev.device.index] if dev.gpu else None,
                                    find_unused_parameters=DDP_UNUSED_PARAMS not in fixes)
    opt = fused_adamw(model)
    x = torch.randn(64, width, device=dev.device)
    return Program(lambda: fit(model, opt, x), close=dist.destroy_process_group)


# ---------------------------------------------------------------------------------------------- tiny_batch

@program(TINY_BATCH, planted="batch 4 on an MLP that takes 256; step_ms is the time for 256 samples (64 steps)",
         fix="batch 256 (one step for the same 256 samples)", shape="1024 -> 8 x Linear(1024) bf16 MLP, fused AdamW")
def tiny_batch_mlp(dev: Dev, fixes: Fixes) -> Program:
    """At batch 4 every kernel is tiny and the step is mostly launch gaps; 64 such steps do the work of one
    batch-256 step that takes about as long as one of them. Timings are per 256 samples (Program.scale)."""
    width, batch = dev.pick(1024, 32), 256 if TINY_BATCH in fixes else 4
    model = classifier(width, width, 7).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(batch, width, device=dev.device, dtype=BF16)
    y = torch.randint(0, 100, (batch,), device=dev.device)
    return Program(lambda: fit(model, opt, x, y), scale=256 // batch)


@program(TINY_BATCH, planted="batch 4 on a conv net that takes 256; step_ms is the time for 256 samples",
         fix="batch 256", shape="conv net (32-64-128 channels) on 32x32 images, bf16 autocast, fused AdamW")
def tiny_batch_conv(dev: Dev, fixes: Fixes) -> Program:
    """Small convolutions at batch 4 leave most SMs idle and the GPU waiting for launches; timings per 256
    samples."""
    batch = 256 if TINY_BATCH in fixes else 4
    model = conv_net((32, 64, 128)).to(dev.device)
    opt = fused_adamw(model)
    x, y = images(dev, batch, dev.pick(32, 16))
    return Program(lambda: fit(model, opt, x, y, amp=dev), scale=256 // batch)


# ---------------------------------------------------------------------------------------- two problems each

@program(OPTIMIZER_IMPL, HOST_SYNCS, planted="AdamW(foreach=False) over 144 tensors, and three .item() logs per layer",
         fix="AdamW(fused=True); keep the statistics on the device",
         shape="48 x (Linear(2048, bias=False), LayerNorm, ReLU), bf16, 4096 rows")
def syncs_and_foreach_optimizer(dev: Dev, fixes: Fixes) -> Program:
    """A per-parameter optimizer loop (about 1,500 tiny kernels after the backward) and 144 synchronizing
    .item() reads in the forward (GPU gaps behind aten::_local_scalar_dense)."""
    width, rows = dev.pick(2048, 32), dev.pick(4096, 32)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width, bias=False), nn.LayerNorm(width))
                           for _ in range(48))
    blocks = blocks.to(dev.device, BF16)
    opt = adamw(blocks.parameters(), OPTIMIZER_IMPL in fixes)
    x = torch.randn(rows, width, device=dev.device, dtype=BF16)
    stats: list[tuple] = []

    def step() -> None:
        stats.clear()
        h = x
        for block in blocks:
            h = torch.relu(block(h))
            logged(h, stats, HOST_SYNCS in fixes)
        h.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program(step)


@program(PRECISION, DATA_LOADER, planted="fp32 GEMMs with TF32 off, and a numpy DataLoader with num_workers=0",
         fix="bf16 autocast; num_workers=4 with persistent workers",
         shape="batch 128 spectra (8 x 512 bins) -> 1024 rows, 512 -> 5 x Linear(4096) fp32 MLP, fused AdamW")
def fp32_and_slow_loader(dev: Dev, fixes: Fixes) -> Program:
    """Long fp32 GEMM kernels on the GPU, and a GPU gap at the start of every step while the loader makes 128
    samples with numpy in the training process."""
    if PRECISION not in fixes:
        full_fp32_matmuls()
    frames, bins, width = 8, dev.pick(512, 16), dev.pick(4096, 64)
    batches = loader(SpectrumDataset(frames, bins), dev.pick(128, 8), DATA_LOADER in fixes)
    model = nn.Sequential(nn.Linear(bins, width), nn.ReLU(), mlp(width, 4), nn.Linear(width, 100)).to(dev.device)
    opt = fused_adamw(model)
    losses: list[float] = []

    def step() -> None:
        x, y = next(batches)
        x, y = x.to(dev.device).flatten(0, 1), y.to(dev.device).repeat_interleave(frames)
        losses.append(fit(model, opt, x, y, amp=dev if PRECISION in fixes else None).item())

    return Program(step)


@program(ALLOCATOR_CHURN, HOST_WORK, planted="empty_cache() every step, and per-sample loss weights in a Python loop",
         fix="remove empty_cache(); compute the weights with torch ops on the device",
         shape="6 FeedForward blocks (1024, ffn 4096), 8192 rows, bf16, fused AdamW")
def churn_and_python_weights(dev: Dev, fixes: Fixes) -> Program:
    """cudaFree / cudaMalloc of every activation block each step, and milliseconds of Python before the first
    launch of each step."""
    width, rows = dev.pick(1024, 32), dev.pick(8192, 1024)
    model = nn.Sequential(*(FeedForward(width) for _ in range(6))).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(rows, width, device=dev.device, dtype=BF16)
    ages = np.random.default_rng(0).uniform(0, 100, rows).tolist()
    ages_dev, index = torch.tensor(ages, device=dev.device), torch.arange(rows, device=dev.device)
    losses: list[float] = []

    def step() -> None:
        if HOST_WORK in fixes:
            w = torch.exp(-ages_dev / 30.0) * (1.0 + 0.5 * torch.sin(0.01 * index))
        else:
            w = torch.tensor(curriculum_weights(ages, 0.0), device=dev.device)
        loss = (model(x).float().pow(2).mean(-1) * w).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if ALLOCATOR_CHURN not in fixes:
            torch.cuda.empty_cache()

    return Program(step)


@program(LAUNCH_BOUND, HOST_WORK, planted="48 tiny layers at batch 8, and Python tokenization of the batch every step",
         fix="CUDA-graph the training step (static input); tokenize once before training",
         shape="bag of words (8.9k buckets) -> 48 x (Linear(256), LayerNorm, GELU), batch 8 documents of ~1000 words")
def tiny_layers_and_tokenizer(dev: Dev, fixes: Fixes) -> Program:
    """Python tokenization with no launches (a GPU gap), then a comb of tiny kernels with launch gaps."""
    length = dev.pick(1024, 64)
    corpus = make_corpus(docs=64, words_per_doc=length)
    width, vocab = dev.pick(256, 32), len(corpus.vocab) + 3
    model = nn.Sequential(nn.Linear(vocab, width), mlp(width, 48, norm=True, act=nn.GELU)).to(dev.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batches = [corpus.texts[i:i + 8] for i in range(0, len(corpus.texts), 8)]
    ready = [tokenized(b, corpus.vocab, length).to(dev.device) for b in batches] if HOST_WORK in fixes else []
    ids = torch.zeros(8, length, dtype=torch.long, device=dev.device)
    target = torch.randn(8, width, device=dev.device)
    counter = itertools.count()

    def train() -> None:
        opt.zero_grad(set_to_none=True)
        bag = torch.zeros(8, vocab, device=dev.device).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float))
        F.mse_loss(model(bag), target).backward()
        opt.step()

    run = graphed(dev, train) if LAUNCH_BOUND in fixes else train

    def step() -> None:
        i = next(counter) % len(batches)
        ids.copy_(ready[i] if HOST_WORK in fixes else tokenized(batches[i], corpus.vocab, length))
        run()

    return Program(step)


@program(EAGER_ATTENTION, CHECKPOINT_IN_STEP,
         planted="hand-written causal attention at seq 2048, and torch.save(state_dict) every step",
         fix="F.scaled_dot_product_attention; save every 1000 steps",
         shape="6 transformer blocks (256, 4 heads), 8 x 2048 tokens, fp32 weights, bf16 autocast, fused AdamW")
def attention_and_checkpoint(dev: Dev, fixes: Fixes) -> Program:
    """Unfused [8, 4, 2048, 2048] attention kernels on the GPU, then a host range of synchronous D2H copies and a
    file write with the GPU idle."""
    width, seq = dev.pick(256, 32), dev.pick(2048, 64)
    model = transformer(dev, width, 6, causal_attention(dev, seq, EAGER_ATTENTION not in fixes), heads=4)
    model = model.to(dev.device)
    opt = fused_adamw(model)
    x = torch.randn(8, seq, width, device=dev.device)
    save = saver(dev, 1000 if CHECKPOINT_IN_STEP in fixes else 1)

    def step() -> None:
        fit(model, opt, x, amp=dev)
        save(model.state_dict())

    return Program(step)


@program(GC_PAUSES, PAGEABLE_COPY, with_stack=True, planted="gc.collect() every step, and a 512 MB pageable host-to-device batch copy",
         fix="gc.freeze() after setup and no per-step collect; pinned memory with non_blocking=True",
         shape="16384 x 16384 bf16 batch, Linear(16384, 1024) + 4 x Linear(1024), fused AdamW")
def gc_and_pageable_copy(dev: Dev, fixes: Fixes) -> Program:
    """A staged, blocking Memcpy HtoD (Pageable) at the start of the step and a full garbage collection at its
    end: two stretches of host time with the GPU idle."""
    rows, d_in, width = dev.pick(16384, 64), dev.pick(16384, 64), dev.pick(1024, 32)
    host = pinned(dev, host_batch(rows, d_in)) if PAGEABLE_COPY in fixes else host_batch(rows, d_in)
    model = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), mlp(width, 4)).to(dev.device, BF16)
    opt = fused_adamw(model)
    losses: list[float] = []
    if GC_PAUSES in fixes:
        gc.freeze()

    def step() -> None:
        losses.append(fit(model, opt, host.to(dev.device, non_blocking=PAGEABLE_COPY in fixes)).item())
        if GC_PAUSES not in fixes:
            gc.collect()

    return Program(step)


@program(EAGER_ATTENTION, ACTIVATION_CHECKPOINTING,
         planted="hand-written causal attention at seq 2048 inside blocks wrapped in torch.utils.checkpoint",
         fix="F.scaled_dot_product_attention; no checkpointing",
         shape="6 transformer blocks (1024, 16 heads), 2 x 2048 tokens, bf16, fused AdamW")
def attention_and_recompute(dev: Dev, fixes: Fixes) -> Program:
    """Unfused attention kernels over [2, 16, 2048, 2048] scores, and every block's forward (eager attention
    included) recomputed inside the backward."""
    width, seq = dev.pick(1024, 64), dev.pick(2048, 64)
    blocks = transformer(dev, width, 6, causal_attention(dev, seq, EAGER_ATTENTION not in fixes))
    model = Checkpointed(blocks, ACTIVATION_CHECKPOINTING not in fixes).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(2, seq, width, device=dev.device, dtype=BF16)
    return Program(lambda: fit(model, opt, x))


# ------------------------------------------------------------------------------------------------- healthy

@program(planted="a bf16 GEMM-bound MLP with fused AdamW: large GEMMs back to back",
         shape="6 x Linear(4096) bf16, 8192 rows, fused AdamW")
def healthy_bf16_mlp(dev: Dev, fixes: Fixes) -> Program:
    """Nothing to fix: tensor-core GEMMs fill the step and the host stays far ahead."""
    width, rows = dev.pick(4096, 64), dev.pick(8192, 64)
    model = mlp(width, 6).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(rows, width, device=dev.device, dtype=BF16)
    return Program(lambda: fit(model, opt, x))


@program(LAUNCH_BOUND, warmup=5, compiles=True,
         planted="a torch.compile'd (default mode) transformer stack whose host launches slower than the GPU runs",
         fix="torch.compile(model, mode='reduce-overhead') (CUDA graphs replay the compiled kernels' launches)",
         shape="4 transformer blocks (1024, 16 heads), 8 x 1024 tokens, fp32 weights, bf16 autocast, fused AdamW")
def launch_bound_compiled_default(dev: Dev, fixes: Fixes) -> Program:
    """Compiled once at one fixed shape, fused Triton kernels and GEMMs, no recompiles; but Inductor's Python
    wrapper launches each of ~230 kernels a step at tens of us, longer than the kernels take: the GPU waits for
    the host about half the step. Measured (the corpus's first recording): the unprofiled step takes as long as
    the profiled one, so the wait is the program's, not the profiler's."""
    width, seq = dev.pick(1024, 32), dev.pick(1024, 32)
    model = transformer(dev, width, 4).to(dev.device)
    compiled = torch.compile(model, mode="reduce-overhead" if LAUNCH_BOUND in fixes else "default")
    opt = fused_adamw(model)
    x = torch.randn(8, seq, width, device=dev.device)
    return Program(lambda: fit(compiled, opt, x, amp=dev), close=reset_dynamo)


@program(compiles=True, planted="a torch.compile'd (default mode) transformer stack at a batch that fills the GPU",
         shape="4 transformer blocks (1024, 16 heads), 16 x 2048 tokens, fp32 weights, bf16 autocast, fused AdamW")
def healthy_compiled_transformer(dev: Dev, fixes: Fixes) -> Program:
    """Compiled once during warm-up at one fixed shape: fused Triton kernels and GEMMs, no recompiles, and each
    kernel long enough (4x the tokens of launch_bound_compiled_default) that the host stays ahead."""
    width, seq = dev.pick(1024, 32), dev.pick(2048, 32)
    model = transformer(dev, width, 4).to(dev.device)
    compiled = torch.compile(model)
    opt = fused_adamw(model)
    x = torch.randn(16, seq, width, device=dev.device)
    return Program(lambda: fit(compiled, opt, x, amp=dev), close=reset_dynamo)


@program(planted="an eager transformer with F.scaled_dot_product_attention (flash) in bf16",
         shape="6 transformer blocks (1024, 16 heads), 4 x 2048 tokens, bf16, fused AdamW")
def healthy_sdpa_bf16(dev: Dev, fixes: Fixes) -> Program:
    """Flash attention and bf16 GEMMs; the host launches far ahead of the GPU."""
    width, seq = dev.pick(1024, 64), dev.pick(2048, 64)
    model = transformer(dev, width, 6).to(dev.device, BF16)
    opt = fused_adamw(model)
    x = torch.randn(4, seq, width, device=dev.device, dtype=BF16)
    return Program(lambda: fit(model, opt, x))


@program(planted="a large-batch conv net in channels_last with bf16 autocast",
         shape="conv net (64-128-256-512 channels), batch 256 of 128x128 images, channels_last, fused AdamW")
def healthy_conv_channels_last(dev: Dev, fixes: Fixes) -> Program:
    """NHWC tensor-core convolutions at a batch that fills the GPU. (At 64x64 images the corpus's first
    recording measured the GPU busy 6.7 of the 8.1 ms step: the host bounded it, no healthy program.)"""
    model = conv_net((64, 128, 256, 512)).to(dev.device, memory_format=torch.channels_last)
    opt = fused_adamw(model)
    x, y = images(dev, dev.pick(256, 4), dev.pick(128, 16))
    return Program(lambda: fit(model, opt, x.contiguous(memory_format=torch.channels_last), y, amp=dev))


@program(planted="an MLP whose whole training step is captured in one CUDA graph",
         shape="64 x (Linear(1024), GELU), batch 1024, bf16, SGD momentum, one graph replay a step")
def healthy_cuda_graph(dev: Dev, fixes: Fixes) -> Program:
    """One cudaGraphLaunch a step: the kernels run back to back with no launch gaps."""
    width = dev.pick(1024, 32)
    model = mlp(width, 64, act=nn.GELU).to(dev.device, BF16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = (torch.randn(1024, width, device=dev.device, dtype=BF16) for _ in range(2))

    def train() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return Program(graphed(dev, train))


if __name__ == "__main__":
    sys.exit(main())
