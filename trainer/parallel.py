"""Parallel degrees, the device mesh, and the one function that parallelizes a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ConfigError, ParallelConfig, PerformanceConfig, check_degrees, check_expert_degree
from .expert_parallel import apply_expert_parallel, average_over_replicas, expert_parameter_names
from .models import decoder_layers
from .tp_plan import register_experts_style, tensor_parallel_plan, without_modules


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """The one owner of parallel degrees: pipeline x data-parallel x tensor-parallel = world size, where
    data-parallel = dp_replicate x dp_shard (HSDP; plain DDP/FSDP have dp_replicate 1); expert parallelism
    splits the data-parallel ranks into ep groups (ep fastest) x expert-data-parallel replicas (edp). Under
    tensor parallelism each TP lane (the ranks of one tp index) holds its own ep groups, so every rank of a TP
    group holds the same expert slice."""

    world_size: int
    dp: int
    tp: int
    mode: str
    ep: int = 1
    """Expert-parallel degree (ranks that split one copy of the routed experts)."""
    pp: int = 1
    """Pipeline stages (the outermost, slowest-varying mesh axis)."""
    dp_replicate: int = 1
    """HSDP replicas (dp = dp_replicate x dp_shard)."""

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int, *, num_experts: int | None = None,
                    model_type: str = "", name: str = "model") -> "ParallelDims":
        """Validate every degree (and, given the model's expert count and type, expert parallelism against
        the model) before any process group exists."""
        check_degrees(config, world_size)
        if num_experts is not None:
            check_expert_degree(config, num_experts=num_experts, model_type=model_type, name=name)
        return cls(world_size=world_size, dp=world_size // (config.tp * config.pp), tp=config.tp, mode=config.mode,
                   ep=config.ep, pp=config.pp, dp_replicate=config.dp_replicate)

    @property
    def edp(self) -> int:
        """Replicas of each expert slice: the data-parallel ranks that hold the same experts."""
        return self.dp // self.ep

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def hybrid(self) -> bool:
        """A mesh with pipeline or HSDP axes (else the plain (dp, tp) mesh; expert parallelism needs that one)."""
        return self.pp > 1 or self.dp_replicate > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.ep > 1:
            return (self.edp, self.ep, self.tp)
        if self.hybrid:
            return (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        return (self.dp, self.tp)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        if self.ep > 1:
            return ("edp", "ep", "tp")
        if self.hybrid:
            return ("pp", "dp_replicate", "dp_shard", "tp")
        return ("dp", "tp")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh; every data-parallel reader (data loading, DDP, FSDP of the non-expert parameters, the comm
        timer) sees one flat `dp` axis: (edp, ep) or (dp_replicate, dp_shard) flattened."""
        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_names)
        if self.ep > 1:
            mesh[("edp", "ep")]._flatten("dp")
        elif self.hybrid:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards over: 2-D (dp_replicate, dp_shard) for HSDP, else the flat dp axis."""
        return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp"]

    def expert_fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 keeps expert-parallel experts on: the edp replicas of a slice; with TP, whose ranks
        hold the same slice but dispatch different tokens, 2-D (edp replicate, tp shard): the gradient
        average then runs over both."""
        return mesh["edp", "tp"] if self.tp > 1 else mesh["edp"]

    def dp_rank(self, global_rank: int) -> int:
        """Data-parallel rank of a global rank (tp is the fastest-varying mesh axis, pp the slowest)."""
        return (global_rank // self.tp) % self.dp

    def pp_rank(self, global_rank: int) -> int:
        """Pipeline rank (the stage group position) of a global rank."""
        return global_rank // (self.dp * self.tp)

    def ep_rank(self, global_rank: int) -> int:
        """Rank inside the expert-parallel group: which slice of the experts this rank holds."""
        return self.dp_rank(global_rank) % self.ep

    def ep_group_ranks(self, global_rank: int) -> list[int]:
        """Global ranks of `global_rank`'s expert-parallel group, by ep rank."""
        first = global_rank - self.ep_rank(global_rank) * self.tp
        return [first + peer * self.tp for peer in range(self.ep)]


def parallelize(
    model: torch.nn.Module,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    parallel: ParallelConfig,
    performance: PerformanceConfig,
    device: torch.device,
) -> torch.nn.Module:
    """Apply, in this fixed order: expert parallel -> tensor parallel -> activation checkpointing -> compile ->
    FSDP2 or DDP.

    Every rank holds the same seeded weights when this runs, so sharding slices them locally. Expert
    parallelism needs the MoE layers installed (expert_parallel.install_moe_layers) beforehand.
    """
    experts = apply_expert_parallel(model, mesh["ep"], mesh["tp"]) if dims.ep > 1 else []
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], keep_whole=experts)
    apply_activation_checkpointing(model, performance.activation_checkpointing)
    apply_regional_compile(model, performance.compile, backend=performance.compile_backend)
    if dims.mode in ("fsdp", "fsdp_tp"):
        expert_mesh = dims.expert_fsdp_mesh(mesh) if experts else None
        return _apply_fsdp(model, dims.fsdp_mesh(mesh), parallel=parallel, performance=performance, device=device,
                           experts=experts, expert_mesh=expert_mesh)
    if experts and dims.edp > 1:
        average_over_replicas([p for module in experts for p in module.parameters()], mesh["edp"].get_group(),
                              dims.edp)
    if dims.dp == 1:
        return model  # one replica: nothing to synchronize
    return _apply_ddp(model, mesh["dp"], parallel=parallel, device=device, ignored=expert_parameter_names(model),
                      pipelined=dims.pp > 1)


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, *,
                          keep_whole: list[torch.nn.Module] = ()) -> None:
    """Shard with the plan of `tp_plan.tensor_parallel_plan` (the family's attention, dense-MLP and embedding
    entries from transformers, fleetscope's routed-expert entries), less every entry on or inside the
    `keep_whole` modules (expert-parallel experts: whole experts, on plain replicated inputs)."""
    causal_lm = getattr(model, "causal_lm", model)
    plan = without_modules(tensor_parallel_plan(causal_lm), causal_lm, keep_whole)
    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        import transformers

        raise ConfigError(f"parallel.mode: tensor parallel needs transformers >= 5.24 (its "
                          f"transformers.distributed.tensor_parallel API); this environment has "
                          f"{transformers.__version__}") from None
    register_experts_style()
    apply_tensor_parallelism(causal_lm, tp_mesh, plan)


def apply_activation_checkpointing(model: torch.nn.Module, policy: str) -> None:
    """Recompute block activations in backward: every block (full) or every other one (selective)."""
    if policy == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        if policy == "full" or index % 2 == 0:
            layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_regional_compile(model: torch.nn.Module, mode: str, *, backend: str = "inductor") -> None:
    """torch.compile each decoder block on its own: one graph per block, compiled once, reused.

    The mode is an Inductor setting; other backends (eager, aot_eager: Dynamo capture only) get none."""
    if mode == "none":
        return
    inductor_mode = None if mode == "default" or backend != "inductor" else mode
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        layers[index] = torch.compile(layer, mode=inductor_mode, backend=backend)


def _apply_fsdp(model, dp_mesh: DeviceMesh, *, parallel: ParallelConfig, performance: PerformanceConfig,
                device: torch.device, experts: list[torch.nn.Module] = (),
                expert_mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """fully_shard per decoder block and the root over `dp_mesh`; expert-parallel experts first, over the
    expert-data-parallel replicas (`expert_mesh`), as their own FSDP units inside their blocks."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {}
    policy = mixed_precision(parallel.reduce_dtype, bf16_compute=device.type == "cuda" and performance.precision == "bf16")
    if policy is not None:
        options["mp_policy"] = MixedPrecisionPolicy(**policy)
    if parallel.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for module in experts:
        fully_shard(module, mesh=expert_mesh, reshard_after_forward=parallel.reshard_after_forward, **options)
    layers = list(decoder_layers(model))
    for index, layer in enumerate(layers):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_block(parallel, index), **options)
    # The root keeps embeddings, final norm and LM head; no reshard: backward needs them first.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **options)
    set_prefetch(layers, forward=parallel.forward_prefetch, backward=parallel.backward_prefetch)
    return model


def mixed_precision(reduce_dtype: str, *, bf16_compute: bool) -> dict[str, torch.dtype] | None:
    """MixedPrecisionPolicy arguments: bf16 compute and all-gathers under bf16 on CUDA, gradient reduction in
    `reduce_dtype` (auto: fp32 under bf16 compute, else the parameters' own dtype); None: no policy."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16_compute else {}
    if reduce_dtype != "auto":
        policy["reduce_dtype"] = dtypes[reduce_dtype]
    return policy or None


def reshard_block(parallel: ParallelConfig, index: int) -> bool | int:
    """reshard_after_forward of block `index`: every `reshard_every`-th block reshards after forward, to all
    dp_shard ranks (True) or to `reshard_to` ranks (FSDP2's int form); the others keep their parameters."""
    if not parallel.reshard_after_forward or index % parallel.reshard_every:
        return False
    return parallel.reshard_to or True


def set_prefetch(layers: list[torch.nn.Module], *, forward: int, backward: int) -> None:
    """Explicit FSDP2 prefetching: each block issues the all-gathers of the next `forward` blocks in forward
    and of the previous `backward` blocks in backward (0: FSDP's implicit one-block prefetch)."""
    for index, layer in enumerate(layers):
        if forward:
            following = layers[index + 1:index + 1 + forward]
            if following:
                layer.set_modules_to_forward_prefetch(following)
        if backward:
            preceding = layers[max(0, index - backward):index][::-1]
            if preceding:
                layer.set_modules_to_backward_prefetch(preceding)


def _apply_ddp(model, dp_mesh: DeviceMesh, *, parallel: ParallelConfig, device: torch.device,
               ignored: list[str] = (), pipelined: bool = False) -> torch.nn.Module:
    """DDP over the dp axis; `ignored` parameters (expert-parallel experts) are left to their own reduction.
    A pipeline stage runs several backwards per step (one per micro-batch, the last one synchronized): DDP's
    first-iteration bucket rebuild would count every parameter once per micro-batch and fail, and
    `find_unused_parameters` is what turns that rebuild off."""
    from torch.nn.parallel import DistributedDataParallel

    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignored))
    device_ids = [device.index] if device.type == "cuda" else None
    # broadcast_buffers=False: the models' buffers (rotary frequencies) are computed, not learned, and the same on
    # every rank; broadcasting them is a collective at every forward's start, where a late rank's delay would
    # land in its peers' forward instead of in their wait for its gradients
    return DistributedDataParallel(
        model, device_ids=device_ids, process_group=dp_mesh.get_group(), bucket_cap_mb=parallel.bucket_cap_mb,
        find_unused_parameters=pipelined, broadcast_buffers=False,
    )
