"""Small GPU training programs with one planted problem each, written as a user would (plain PyTorch and
torch.profiler, no fleetscope code): ground truth for the diagnosis of programs nobody here wrote.

    python bench/planted/programs.py OUT_DIR [NAME ...]       # default: every program

Each program trains a few steps, profiles steps 3-5 with torch.profiler (ProfilerStep ranges, a gzipped
Kineto trace in OUT_DIR/NAME/), and writes OUT_DIR/NAME/planted.json: the problem planted and its size per
step, timed inside the program with torch.cuda.synchronize() around the planted part in steps the profiler
does not record (so the timing costs the traces nothing).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

STEPS = 8
HIDDEN = 4096
LAYERS = 8


def _model() -> torch.nn.Module:
    layers = [torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)]
    return torch.nn.Sequential(*layers).cuda().to(torch.bfloat16)


def _train(name: str, out: Path, step: Callable[[int], None], planted: Callable[[], float], what: str, *,
           with_stack: bool = False) -> None:
    """Run STEPS steps of `step(i)` under the profiler (steps 3-5 recorded), time the planted part with
    `planted()` (ms) on steps outside the window, and record both."""
    directory = out / name
    directory.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=2, warmup=1, active=3, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(directory), worker_name="rank0", use_gzip=True),
                 record_shapes=True, with_stack=with_stack) as prof:
        for i in range(STEPS):
            step(i)
            prof.step()
    torch.cuda.synchronize()
    sizes = [planted() for _ in range(3)]
    step_ms = _timed(lambda: step(STEPS))
    (directory / "planted.json").write_text(json.dumps(
        {"program": name, "planted": what, "planted_ms_per_step": sorted(sizes)[1], "step_ms": step_ms}, indent=1))
    print(f"{name}: planted {what}: {sorted(sizes)[1]:.2f} ms per step of {step_ms:.2f} ms")


def _timed(work: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return 1000.0 * (time.perf_counter() - start)


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = model(batch).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def healthy_gemm(out: Path) -> None:
    """Large GEMMs back to back: nothing large to fix."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = torch.randn(8192, HIDDEN, device="cuda", dtype=torch.bfloat16)
    _train("healthy_gemm", out, lambda i: _optimizer_step(model, optimizer, batch), lambda: 0.0, "nothing")


def cpu_batch(out: Path) -> None:
    """The batch is built on the CPU every step (torch.randn on the host, then .cuda()): the GPU waits."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def build() -> torch.Tensor:
        return torch.randn(2048, HIDDEN).to(torch.bfloat16).cuda()

    _train("cpu_batch", out, lambda i: _optimizer_step(model, optimizer, build()), lambda: _timed(build),
           "batch built on the CPU")


def item_per_layer(out: Path) -> None:
    """A `.item()` after every layer (logging a statistic): the host waits for the GPU, then the GPU waits."""
    layers = [torch.nn.Linear(1024, 1024, bias=False).cuda().to(torch.bfloat16) for _ in range(LAYERS)]
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    batch = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    stats: list[float] = []

    def step(i: int) -> None:
        h = batch
        for layer in layers:
            h = torch.relu(layer(h))
            stats.append(h.float().abs().mean().item())
        h.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def reads() -> float:
        h = batch.detach()
        return _timed(lambda: [layer(h).float().abs().mean().item() for layer in layers])

    _train("item_per_layer", out, step, reads, f"{LAYERS} .item() per step")


def item_per_layer_frames(out: Path) -> None:
    """item_per_layer recorded with with_stack=True: the Python frame of each `.item()` is in the trace."""
    layers = [torch.nn.Linear(1024, 1024, bias=False).cuda().to(torch.bfloat16) for _ in range(LAYERS)]
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    batch = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    stats: list[float] = []

    def log_statistic(h: torch.Tensor) -> None:
        stats.append(h.float().abs().mean().item())

    def step(i: int) -> None:
        h = batch
        for layer in layers:
            h = torch.relu(layer(h))
            log_statistic(h)
        h.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def reads() -> float:
        h = batch.detach()
        return _timed(lambda: [layer(h).float().abs().mean().item() for layer in layers])

    _train("item_per_layer_frames", out, step, reads, f"{LAYERS} .item() per step, in log_statistic",
           with_stack=True)


def pageable_copy(out: Path) -> None:
    """The batch lives in ordinary (pageable) host memory and is copied with .cuda() every step: the host
    blocks in a synchronous copy, and the GPU waits for it."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    host_batch = torch.randn(16384, HIDDEN).to(torch.bfloat16)        # 128 MiB, not pinned

    def step(i: int) -> None:
        _optimizer_step(model, optimizer, host_batch.cuda()[:2048])

    _train("pageable_copy", out, step, lambda: _timed(lambda: host_batch.cuda()),
           "128 MiB host-to-device copy from pageable memory", with_stack=True)


def tiny_kernels(out: Path) -> None:
    """Thousands of tiny elementwise kernels a step (an unfused loss written op by op): launch-bound."""
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    optimizer = torch.optim.SGD([x], lr=1e-3)

    def step(i: int) -> None:
        y = x
        for _ in range(400):
            y = y * 1.0001 + 0.0001
        y.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _train("tiny_kernels", out, step, lambda: _timed(lambda: step(0)), "about 2,000 tiny kernels per step")


class _SlowDataset(torch.utils.data.Dataset):
    """Each sample costs the host 0.5 ms (decoding, say)."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.0005)
        return torch.zeros(HIDDEN, dtype=torch.bfloat16)


def slow_dataloader(out: Path) -> None:
    """A DataLoader in the training process (num_workers=0) whose samples are slow to produce."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loader = iter(torch.utils.data.DataLoader(_SlowDataset(), batch_size=32, num_workers=0))

    def step(i: int) -> None:
        batch = next(loader).cuda()
        _optimizer_step(model, optimizer, batch.repeat(64, 1))

    def fetch() -> float:
        start = time.perf_counter()
        next(loader)
        return 1000.0 * (time.perf_counter() - start)

    _train("slow_dataloader", out, step, fetch, "DataLoader fetch in the training process")


def sync_per_step(out: Path) -> None:
    """An explicit torch.cuda.synchronize() in the middle of every step, then host work: the GPU drains."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = torch.randn(8192, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step(i: int) -> None:
        loss = model(batch).float().pow(2).mean()
        torch.cuda.synchronize()
        time.sleep(0.005)                    # host bookkeeping that now cannot overlap the GPU
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _train("sync_per_step", out, step, lambda: 5.0, "synchronize + 5 ms of host work per step")


PROGRAMS = {f.__name__: f for f in (healthy_gemm, cpu_batch, item_per_layer, item_per_layer_frames, pageable_copy,
                                    tiny_kernels, slow_dataloader, sync_per_step)}


def main() -> int:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(PROGRAMS)
    for name in names:
        PROGRAMS[name](out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
