"""The PyTorch DDP tutorial's toy model, profiled by fleetscope with one changed line (and its import).

    fleetscope launch --nproc-per-node 2 --profile wait=1,warmup=1,active=2,repeat=2 \
        -- python docs/examples/ddp_windows.py --steps 10

Outside `fleetscope launch` (plain torchrun) it trains the same, unprofiled, after a one-line notice.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

from fleetscope.trainer import user_profiling as fs


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.001)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
    model = ToyModel().to(device)
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=args.lr)

    for step in fs.windows().steps(range(args.steps)):  # the fleetscope line (was: range(args.steps))
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, device=device))
        labels = torch.randn(20, 5, device=device)
        loss_fn(outputs, labels).backward()
        optimizer.step()

    print(f"rank {rank}: trained {args.steps} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
