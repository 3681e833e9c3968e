"""Run under torchrun (gloo): for every family, shard the model with the tensor-parallel plan fleetscope
applies and record, per rank, what each part holds and how one forward/backward compares with the unsharded
model on the same tokens. Writes <out>/rank<R>.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fleetscope.trainer.config import ModelConfig
from fleetscope.trainer.families import FAMILIES
from fleetscope.trainer.models import build_model
from fleetscope.trainer.parallel import apply_tensor_parallel


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    grads = {name: local(param.grad) for name, param in model.named_parameters() if param.grad is not None}
    return float(out.loss.detach()), grads


def expert_slice_error(full: torch.Tensor, shard: torch.Tensor, rank: int, world: int, packed: bool) -> float:
    """Largest difference between the sharded gradient and the matching slice of the unsharded one."""
    if packed:  # [E, 2I, D]: gate and up halves each split along I
        gate, up = full.chunk(2, dim=1)
        expected = torch.cat([gate.chunk(world, dim=1)[rank], up.chunk(world, dim=1)[rank]], dim=1)
    else:  # [E, D, I]
        expected = full.chunk(world, dim=-1)[rank]
    return float((expected - shard).abs().max())


def family_record(family: str, mesh, rank: int, world: int) -> dict:
    torch.manual_seed(1)
    tokens = torch.randint(3, 500, (2, 16))
    reference = build_model(ModelConfig(family=family), seed=0)
    reference_loss, reference_grads = loss_and_grads(reference, tokens)
    sharded = build_model(ModelConfig(family=family), seed=0)
    apply_tensor_parallel(sharded, mesh)
    loss, grads = loss_and_grads(sharded, tokens)
    experts = sharded.model.layers[-1].mlp.experts
    name = f"model.layers.{len(sharded.model.layers) - 1}.mlp.experts"
    errors = {}
    if tuple(local(experts.gate_up_proj).shape) != tuple(reference.model.layers[-1].mlp.experts.gate_up_proj.shape):
        errors = {param: expert_slice_error(reference_grads[f"{name}.{param}"], grads[f"{name}.{param}"], rank, world,
                                            packed=param == "gate_up_proj")
                  for param in ("gate_up_proj", "down_proj")}
    return {
        "loss": loss, "reference_loss": reference_loss,
        "experts_gate_up": list(local(experts.gate_up_proj).shape),
        "full_experts_gate_up": list(reference.model.layers[-1].mlp.experts.gate_up_proj.shape),
        "embedding": list(local(sharded.model.embed_tokens.weight).shape),
        "full_embedding": list(reference.model.embed_tokens.weight.shape),
        "expert_grad_errors": errors,
        "whole_grad_error": whole_grad_error(reference_grads, grads),
    }


def whole_grad_error(reference: dict[str, torch.Tensor], sharded: dict[str, torch.Tensor]) -> float:
    """Largest gradient difference over the parameters every rank holds whole (routers, norms, ...): their
    gradients need the partial sums of the sharded parts, summed across ranks."""
    whole = [name for name, grad in sharded.items() if name in reference and grad.shape == reference[name].shape]
    return max(float((reference[name] - sharded[name]).abs().max()) for name in whole)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    try:
        records = {family: family_record(family, mesh, rank, world) for family in FAMILIES}
    finally:
        dist.destroy_process_group()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
