"""Run under torchrun: train every model family for a few steps with the real trainer, one process
group for all of them, each family into its own run directory under --out."""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from fleetscope.trainer.config import TrainConfig, apply_overrides
from fleetscope.trainer.families import FAMILIES
from fleetscope.trainer.loop import train
from fleetscope.trainer.runtime import init_runtime


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    configs = [
        apply_overrides(TrainConfig(run_dir=f"{args.out}/{family}"), [
            f"model.family={family}", f"parallel.mode={args.mode}", f"parallel.tp={args.tp}",
            f"data.batch_size={args.batch}", "data.seq_len=32", f"steps={args.steps}", "performance.device=cpu",
            "profiler.enabled=false", "observability.clock_round_trips=0", f"parallel.ep={args.ep}",
            *args.overrides,
        ])
        for family in args.families.split(",")
    ]
    runtime = init_runtime(configs[0])
    try:
        for config in configs:
            train(config, runtime)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
