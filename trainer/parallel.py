"""Parallel degrees, the device mesh, and the one function that parallelizes a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ConfigError, ParallelConfig, PerformanceConfig, check_degrees
from .models import decoder_layers


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """The one owner of parallel degrees: data-parallel x tensor-parallel = world size."""

    world_size: int
    dp: int
    tp: int
    mode: str

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> "ParallelDims":
        check_degrees(config, world_size)
        return cls(world_size=world_size, dp=world_size // config.tp, tp=config.tp, mode=config.mode)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp, self.tp)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return ("dp", "tp")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_names)

    def dp_rank(self, global_rank: int) -> int:
        """Data-parallel rank of a global rank (tp is the fastest-varying mesh axis)."""
        return global_rank // self.tp


def parallelize(
    model: torch.nn.Module,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    parallel: ParallelConfig,
    performance: PerformanceConfig,
    device: torch.device,
) -> torch.nn.Module:
    """Apply, in this fixed order: tensor parallel -> activation checkpointing -> compile -> FSDP2 or DDP.

    Every rank holds the same seeded weights when this runs, so sharding slices them locally.
    """
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, performance.activation_checkpointing)
    apply_regional_compile(model, performance.compile, backend=performance.compile_backend)
    if dims.mode in ("fsdp", "fsdp_tp"):
        return _apply_fsdp(model, mesh["dp"], parallel=parallel, performance=performance, device=device)
    if dims.dp == 1:
        return model  # one replica: nothing to synchronize
    return _apply_ddp(model, mesh["dp"], parallel=parallel, device=device)


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard with the family's own tensor-parallel plan (its transformers config's `base_model_tp_plan`:
    attention heads colwise/rowwise, experts' FFN packed-colwise/rowwise with an output all-reduce,
    vocabulary-sharded embedding and LM head where the family plans them)."""
    causal_lm = getattr(model, "causal_lm", model)
    plan = tensor_parallel_plan(causal_lm)
    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        import transformers

        raise ConfigError(f"parallel.mode: tensor parallel needs transformers >= 5.24 (its "
                          f"transformers.distributed.tensor_parallel API); this environment has "
                          f"{transformers.__version__}") from None
    apply_tensor_parallelism(causal_lm, tp_mesh, plan)


def tensor_parallel_plan(causal_lm: torch.nn.Module) -> dict[str, str]:
    """The family's plan with `*` expanded to concrete module and parameter names."""
    plan = dict(getattr(causal_lm, "tp_plan", None) or {})
    expand = getattr(causal_lm, "_expand_parallel_plan", None)
    if not plan or expand is None:
        import transformers

        raise ConfigError(
            f"parallel.mode: {type(causal_lm).__name__} has no tensor-parallel plan in this transformers "
            f"version (tensor parallel needs transformers >= 5.24; this environment has {transformers.__version__})"
        )
    return expand(plan)


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
                device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {}
    if device.type == "cuda" and performance.precision == "bf16":
        # bf16 compute and all-gathers, fp32 gradient reduction (and fp32 master weights in the optimizer).
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if parallel.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=parallel.reshard_after_forward, **options)
    # The root keeps embeddings, final norm and LM head; no reshard: backward needs them first.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **options)
    return model


def _apply_ddp(model, dp_mesh: DeviceMesh, *, parallel: ParallelConfig, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(
        model, device_ids=device_ids, process_group=dp_mesh.get_group(), bucket_cap_mb=parallel.bucket_cap_mb
    )
