"""Run under torchrun: train several parallel layouts ("cases") in one process group, each with its own
device mesh, each model family into <out>/<case>/<family>.

    --case NAME=override,override,...          (repeatable; overrides are `section.field=value`)
    --case NAME@family+family=override,...     (only these families for this case)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch.distributed as dist

from fleetscope.trainer.config import TrainConfig, apply_overrides
from fleetscope.trainer.loop import train
from fleetscope.trainer.parallel import ParallelDims
from fleetscope.trainer.runtime import init_runtime

COMMON = ["data.seq_len=32", "performance.device=cpu", "profiler.enabled=false", "observability.clock_round_trips=0"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True)
    parser.add_argument("--families", default="qwen3_moe,mixtral")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--common", action="append", default=[])
    args = parser.parse_args()
    cases = []
    for case in args.case:
        name, _, overrides = case.partition("=")
        name, _, only = name.partition("@")
        for family in only.split("+") if only else args.families.split(","):
            cases.append(apply_overrides(TrainConfig(run_dir=f"{args.out}/{name}/{family}"), [
                *COMMON, *args.common, f"model.family={family}", f"steps={args.steps}",
                *[o for o in overrides.split(",") if o]]))
    runtime = init_runtime(cases[0])
    try:
        for config in cases:
            dims = ParallelDims.from_config(config.parallel, runtime.world_size)
            case_runtime = dataclasses.replace(runtime, dims=dims, mesh=dims.build_mesh(runtime.device.type))
            train(config, case_runtime)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
