"""Two ranks on one GPU with one planted straggler, written as a user would (plain PyTorch, gloo, torch.profiler):
ground truth for telling a slow device from more work by kernel identity.

    torchrun --nproc-per-node 2 bench/planted/pairs.py OUT_DIR CASE

CASE:
  slow_device   rank 1 runs the same model on the same batch, with its kernels confined to a third of the
                GPU's SMs (a CUDA green context): the same kernels (names, grids, counts), each longer.
  more_tokens   rank 1's batch has twice the rows (uneven routing, say): the same kernel names on bigger
                grids, or other kernels.

Both ranks share one GPU (NCCL refuses two ranks on one device), so each step ends with a gloo all-reduce of a
host tensor after a synchronize: rank 0 waits there for rank 1. Steps 3-5 are profiled (ProfilerStep ranges,
gzipped Kineto traces OUT_DIR/CASE/rank{0,1}...). Rank 0 writes OUT_DIR/CASE/planted.json: each rank's
compute per step, timed with synchronize() on steps the profiler does not record, and their ratio.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

STEPS = 8
HIDDEN = 4096
LAYERS = 6
ROWS = 4096
SLOW_SM_SHARE = 3


def _slow_stream() -> tuple[object, torch.cuda.Stream | None, str]:
    """A stream confined to 1/SLOW_SM_SHARE of the SMs, with the API this torch has; (None, None, why) when
    green contexts are not available."""
    try:
        from torch.cuda import green_contexts
    except ImportError as error:
        return None, None, f"no torch.cuda.green_contexts: {error}"
    sms = torch.cuda.get_device_properties(0).multi_processor_count // SLOW_SM_SHARE
    cls = green_contexts.GreenContext
    try:
        try:
            context = cls(num_sms=sms)
        except TypeError:
            context = cls.create(sms, 0)
        if hasattr(context, "Stream"):
            return context, context.Stream(), f"green context of {sms} SMs (stream)"
        context.set_context()
        return context, None, f"green context of {sms} SMs (current context)"
    except Exception as error:  # a driver or build without them: the case is not recorded
        return None, None, f"green context unavailable: {type(error).__name__}: {error}"


def main() -> int:
    out, case = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)]
    model = torch.nn.Sequential(*layers).cuda().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    rows = ROWS * 2 if case == "more_tokens" and rank == 1 else ROWS
    batch = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream, how = None, "full device"
    if case == "slow_device" and rank == 1:
        _context, stream, how = _slow_stream()
    exchange = torch.ones(1 << 18)

    def compute() -> None:
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            loss = model(batch).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if stream is not None:
            stream.synchronize()
        torch.cuda.synchronize()

    def step() -> None:
        compute()
        dist.all_reduce(exchange)

    directory = out / case
    directory.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=2, warmup=1, active=3, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(directory), worker_name=f"rank{rank}", use_gzip=True),
                 record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
            prof.step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        compute()
        times.append(1000.0 * (time.perf_counter() - start))
    compute_ms = sorted(times)[2]
    gathered: list[object] = [None, None]
    dist.all_gather_object(gathered, {"rank": rank, "compute_ms": compute_ms, "rows": rows, "how": how})
    if rank == 0:
        by_rank = {g["rank"]: g for g in gathered}
        record = {"case": case, "ranks": by_rank, "late_rank": 1,
                  "compute_ratio": by_rank[1]["compute_ms"] / by_rank[0]["compute_ms"],
                  "late_ms_per_step": by_rank[1]["compute_ms"] - by_rank[0]["compute_ms"]}
        (directory / "planted.json").write_text(json.dumps(record, indent=1))
        print(f"{case}: rank 1 computes {record['compute_ratio']:.2f}x as long as rank 0 "
              f"({by_rank[1]['compute_ms']:.2f} vs {by_rank[0]['compute_ms']:.2f} ms; {by_rank[1]['how']})")
    dist.barrier()
    dist.destroy_process_group()
    return 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
