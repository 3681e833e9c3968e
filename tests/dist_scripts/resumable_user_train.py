"""A user's own DDP loop that checkpoints on SIGTERM and exits 75, resumable, profiled with fleetscope's windows.

    python resumable_user_train.py CHECKPOINT_DIR STEPS [SECONDS_PER_STEP]

On SIGTERM (Slurm's requeue or a preemption) every rank stops at the same step (the stop flag is
max-reduced each step), rank 0 writes the next step into CHECKPOINT_DIR/step.txt, and every rank exits 75;
the next attempt starts at that step.
"""

import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fleetscope.trainer import user_profiling as fs

EXIT_PREEMPTED = 75


def main() -> int:
    checkpoint_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    stop = torch.zeros(1)
    signal.signal(signal.SIGTERM, lambda *_: stop.fill_(1))
    dist.init_process_group("gloo")
    checkpoint = checkpoint_dir / "step.txt"
    start = int(checkpoint.read_text()) if checkpoint.exists() else 0
    model = DDP(nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    windows = fs.windows()
    for step in range(start, steps):
        with windows.step(step):
            optimizer.zero_grad()
            model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
            time.sleep(seconds)
        flag = stop.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            if dist.get_rank() == 0:
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
                checkpoint.write_text(str(step + 1))
            dist.barrier()
            print(f"rank {dist.get_rank()}: checkpoint at step {step + 1}, exiting {EXIT_PREEMPTED}", flush=True)
            return EXIT_PREEMPTED
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
