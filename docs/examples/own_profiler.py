"""A DDP loop that drives torch.profiler itself; fleetscope files its traces (`on_trace_ready=fs.trace_handler()`).

    fleetscope launch --nproc-per-node 2 -- python docs/examples/own_profiler.py --steps 10

Each trace the profiler hands over becomes this rank's next window in the run directory
(`traces/window<NNN>/rank<R>.<host>.pt.trace.json.gz`); fleetscope's --profile schedule does not apply:
the schedule below is the script's own.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from fleetscope.trainer import user_profiling as fs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2, repeat=2),
                 on_trace_ready=fs.trace_handler()) as prof:
        for _ in range(args.steps):
            optimizer.zero_grad()
            with record_function("forward"):
                loss = model(torch.randn(16, 32)).square().mean()
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer_step"):
                optimizer.step()
            prof.step()  # marks ProfilerStep#<n>, n counting from 0: the global step of this loop

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
