"""Run under torchrun: one backward of an expert-parallel model against the unsharded model's on the whole
batch, parameter by parameter (every rank builds the reference itself). AdamW is almost blind to a gradient's
scale, so loss trajectories alone would miss a wrong expert-gradient factor; this compares the gradients,
and the global gradient norm the trainer clips with against the unsharded model's.
Prints `grads match` on rank 0 or raises."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fleetscope.trainer.config import TrainConfig, apply_overrides
from fleetscope.trainer.loop import build_state, clip_grad_norm
from fleetscope.trainer.loss import CausalLMTrainingModule
from fleetscope.trainer.models import build_model
from fleetscope.trainer.runtime import init_runtime



def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mode fsdp_tp)")
    parser.add_argument("--sequences", type=int, default=8, help="global batch, split over the data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    config = apply_overrides(TrainConfig(run_dir=args.out), [
        f"model.family={args.family}", f"parallel.mode={args.mode}", f"parallel.ep={args.ep}",
        f"parallel.tp={args.tp}", "performance.device=cpu", "profiler.enabled=false", "observability.clock_round_trips=0",
    ])
    runtime = init_runtime(config)
    try:
        compare(config, runtime, sequences=args.sequences, seq_len=args.seq_len)
    finally:
        dist.destroy_process_group()
    return 0


def compare(config: TrainConfig, runtime, *, sequences: int, seq_len: int) -> None:
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(3, 512, (sequences, seq_len), generator=generator)
    reference = CausalLMTrainingModule(build_model(config.model, seed=config.seed), fused_loss=True, chunk_tokens=4096)
    reference(batch).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    state = build_state(config, runtime)
    per_rank = sequences // runtime.dims.dp
    state.model(batch[runtime.dp_rank * per_rank:(runtime.dp_rank + 1) * per_rank]).backward()
    expert_names = {id(p) for p in state.expert_params}
    ep_rank = runtime.dims.ep_rank(runtime.rank)
    worst = 0.0
    for name, parameter in state.model.named_parameters():
        grad = parameter.grad.full_tensor() if isinstance(parameter.grad, DTensor) else parameter.grad
        want = expected[name.removeprefix("module.")]
        if id(parameter) in expert_names:
            local = grad.shape[0]
            want = want[ep_rank * local:(ep_rank + 1) * local]
        error = (grad - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
        if error > 1e-4:
            raise AssertionError(f"rank {runtime.rank}: gradient of {name} differs by {error:.2e} (relative)")
        worst = max(worst, error)
    if not state.expert_params:
        raise AssertionError("no expert-parallel parameters found")
    check_grad_norm(state, torch.stack([g.norm() for g in expected.values()]).norm().item(), runtime.rank)
    if runtime.rank == 0:
        print(f"grads match (worst relative difference {worst:.2e})", flush=True)


def check_grad_norm(state, want: float, rank: int) -> None:
    """The norm clip_grad_norm computes (no clipping at this threshold) is the unsharded model's."""
    total = clip_grad_norm(list(state.model.parameters()), 1e9, expert_params=state.expert_params,
                           ep_group=state.ep_group).item()
    if abs(total - want) > 1e-4 * want:
        raise AssertionError(f"rank {rank}: gradient norm {total:.6g}, unsharded model's {want:.6g}")


if __name__ == "__main__":
    sys.exit(main())
