"""A plain user DDP script with two gradient buckets (gloo, CPU), profiled with torch.profiler's own
tensorboard_trace_handler; rank SLOW_RANK sleeps SLEEP_MS before every SLEEP_EVERY-th step (a host-side delay;
every other step, 2, leaves quiet steps in the same window to measure the slow-down against).

    SLOW_RANK=1 SLEEP_MS=30 SLEEP_EVERY=2 TRACE_DIR=tb python two_bucket_ddp.py     (under fleetscope launch --)
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 19


def main() -> None:
    dist.init_process_group("gloo")
    slow, sleep_s = int(os.environ.get("SLOW_RANK", "-1")), float(os.environ.get("SLEEP_MS", "30")) / 1000
    every = int(os.environ.get("SLEEP_EVERY", "1"))
    torch.set_num_threads(1)    # two ranks on a small shared machine: no intra-op threads competing for its cores
    torch.manual_seed(0)
    # 4 MB buckets: the second layer's gradients fill one, the first layer's another, both in flight together
    model = DDP(nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)), bucket_cap_mb=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(64, 512)
    schedule = torch.profiler.schedule(wait=2, warmup=1, active=16, repeat=1)
    handler = torch.profiler.tensorboard_trace_handler(os.environ.get("TRACE_DIR", "tb"))
    with torch.profiler.profile(schedule=schedule, on_trace_ready=handler) as profiler:
        for step in range(STEPS):
            if dist.get_rank() == slow and step % every == 0:
                time.sleep(sleep_s)
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()
            profiler.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
