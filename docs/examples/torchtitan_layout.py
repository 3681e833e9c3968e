"""A DDP loop that saves its traces the way torchtitan does, for `launch --collect-traces` (zero lines of fleetscope).

torchtitan (`torchtitan/tools/profiler.py`, 0.3.0) profiles with torch.profiler's schedule and its
`on_trace_ready` writes `<dump_folder>/profiling/traces/iteration_<step>/rank<R>_trace.json.gz`, with the
profiler's step count set to the global step. This script does the same, so:

    fleetscope launch --nproc-per-node 2 --collect-traces 'outputs/profiling/traces/iteration_*/rank*_trace.json.gz' \
        -- python docs/examples/torchtitan_layout.py --dump-folder outputs --steps 10
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

PROFILE_DIR = "profiling/traces"
PROFILE_ITER_DIR = "iteration_{step}"
PROFILE_FILE = "rank{rank}_trace.json.gz"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dump-folder", default="outputs")
    parser.add_argument("--profile-freq", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trace_dir = os.path.join(args.dump_folder, PROFILE_DIR)

    def trace_handler(prof):
        directory = os.path.join(trace_dir, PROFILE_ITER_DIR.format(step=prof.step_num))
        os.makedirs(directory, exist_ok=True)
        prof.export_chrome_trace(os.path.join(directory, PROFILE_FILE.format(rank=rank)))

    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    warmup, active = 1, 1
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=args.profile_freq - (active + warmup), warmup=warmup, active=active),
        on_trace_ready=trace_handler,
    )
    with profiler as prof:
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            model(torch.randn(16, 32)).square().mean().backward()
            optimizer.step()
            prof.step()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
