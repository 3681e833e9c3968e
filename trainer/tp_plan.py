"""The tensor-parallel plan fleetscope applies: the family's own plan from transformers for attention,
dense MLPs and embeddings, and fleetscope's own plan for the routed experts.

transformers 5.24 planned the routed experts (`mlp.experts.gate_up_proj` packed-colwise, `down_proj`
rowwise, an all-reduce of the experts' output); 5.25 dropped those entries from every family's plan and
deprecated the `moe_tp_experts` style (removal announced for 5.28) in favour of expert parallelism. A plan
that follows the installed transformers would silently leave every routed expert whole on every TP rank.
So the routed experts' entries are fleetscope's, whatever transformers ships: the same sharding on every
version, with an experts style of its own that does not depend on the deprecated one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError
from .fast_moe import supports_fast_experts

EXPERTS_STYLE = "fleetscope_routed_experts"
"""The style on each routed-experts module: replicated inputs in, this rank's partial output all-reduced."""
PACKED_EXPERT_PARAMS = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
"""[E, 2I, D] gate/up halves sharded along I together (strided), [E, D, I] along I: each rank runs its slice of
every expert's hidden width."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanCoverage:
    """What a tensor-parallel plan shards, in the words the README's parallelism table uses."""

    attention: bool
    """Some attention projection (q, k, v, o, or DeepSeek's MLA projections) is sharded."""
    routed_experts: bool
    """Every MoE layer's routed experts are sharded."""
    embedding: bool
    lm_head: bool

    def parts(self) -> list[str]:
        names = {"attention": "attention heads", "routed_experts": "routed experts", "embedding": "embedding",
                 "lm_head": "LM head"}
        return [label for field, label in names.items() if getattr(self, field)]


def tensor_parallel_plan(causal_lm: torch.nn.Module) -> dict[str, str]:
    """The plan applied to `causal_lm` with every `*` expanded: transformers' entries less any on the routed
    experts, plus fleetscope's routed-expert entries where the experts have the packed layout (all families
    but GPT-OSS, whose transposed, biased experts stay whole on every TP rank)."""
    experts = routed_expert_modules(causal_lm)
    plan = without_names(transformers_plan(causal_lm), list(experts))
    for name, module in experts.items():
        if supports_fast_experts(module):
            plan.update(routed_experts_plan(name))
    return plan


def transformers_plan(causal_lm: torch.nn.Module) -> dict[str, str]:
    """The installed transformers' plan of this model, `*` expanded (ConfigError: this version has none)."""
    plan = dict(getattr(causal_lm, "tp_plan", None) or {})
    expand = getattr(causal_lm, "_expand_parallel_plan", None)
    if not plan or expand is None:
        import transformers

        raise ConfigError(
            f"parallel.mode: {type(causal_lm).__name__} has no tensor-parallel plan in this transformers "
            f"version (tensor parallel needs transformers >= 5.24; this environment has {transformers.__version__})"
        )
    return expand(plan)


def routed_expert_modules(causal_lm: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Qualified name -> the routed-experts module of each decoder block (`<block>.mlp.experts`)."""
    return {name: module for name, module in causal_lm.named_modules()
            if name.endswith(".mlp.experts") and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)}


def routed_experts_plan(name: str) -> dict[str, str]:
    """fleetscope's entries for the routed-experts module `name`."""
    return {f"{name}.{param}": style for param, style in PACKED_EXPERT_PARAMS.items()} | {name: EXPERTS_STYLE}


def without_names(plan: dict[str, str], names: list[str]) -> dict[str, str]:
    """The plan less the entries naming one of `names` or anything inside one."""
    return {key: style for key, style in plan.items()
            if not any(key == name or key.startswith(name + ".") for name in names)}


def without_modules(plan: dict[str, str], root: torch.nn.Module, modules: list[torch.nn.Module]) -> dict[str, str]:
    """The plan less the entries naming one of `modules` (qualified names under `root`) or anything inside one."""
    wanted = {id(module) for module in modules}
    return without_names(plan, [name for name, module in root.named_modules() if id(module) in wanted])


def plan_coverage(causal_lm: torch.nn.Module, plan: dict[str, str]) -> PlanCoverage:
    """Which parts of `causal_lm` the (expanded) `plan` shards."""
    experts = routed_expert_modules(causal_lm)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj", "qkv_proj")
    return PlanCoverage(
        attention=any(".self_attn." in key and key.rsplit(".", 1)[-1] in attention for key in plan),
        routed_experts=bool(experts) and all(f"{name}.gate_up_proj" in plan for name in experts),
        embedding=any(key.endswith("embed_tokens") for key in plan),
        lm_head="lm_head" in plan,
    )


def register_experts_style() -> None:
    """Register EXPERTS_STYLE with the installed transformers' parallel styles (idempotent)."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    if EXPERTS_STYLE in ALL_PARALLEL_STYLES.valid_keys():
        return

    class RoutedExpertsParallel(TensorParallelLayer):
        """Each rank holds a slice of every expert's hidden width: the hidden states and routing weights come in
        replicated (their gradients are partial per rank: summed in backward), the output is partial (summed in
        forward)."""

        def should_use_local_tensors(self, module):
            return True

        def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
            group = _tp_group(mesh)
            hidden_states, *routing = (_local(value) for value in args)
            hidden_states = SumInBackward.apply(hidden_states, group)
            if len(routing) >= 2:
                routing[1] = SumInBackward.apply(routing[1], group)  # top_k_weights
            return (hidden_states, *routing), kwargs

        def transform_output_post_forward(self, module, output, mesh, config=None):
            return None if output is None else SumInForward.apply(output, _tp_group(mesh))

    ALL_PARALLEL_STYLES.register(EXPERTS_STYLE, RoutedExpertsParallel())


def _tp_group(mesh):
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


def _local(value):
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


class SumInForward(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: the experts' partial outputs."""

    @staticmethod
    def forward(ctx, tensor, group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SumInBackward(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) of the gradient in backward: a replicated input whose gradient each
    rank computes only for its slice of the experts."""

    @classmethod
    def apply(cls, tensor, group):
        if torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            return super().apply(tensor, group)
        return tensor

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None
