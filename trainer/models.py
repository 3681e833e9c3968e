"""Building the MoE causal LM: from a family preset (random weights) or a local checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from .config import ConfigError, FaultConfig, ModelConfig, ParallelConfig, check_expert_degree
from .families import FAMILIES, NUM_EXPERTS_ATTRIBUTES, PRESETS


def build_config(model: ModelConfig) -> transformers.PretrainedConfig:
    """The transformers config: read from `model.path` when given, else the family's preset."""
    if model.path:
        return _local_config(Path(model.path))
    family = FAMILIES[model.family]
    config_class = getattr(transformers, family.config_class)
    return config_class(**family.config_kwargs(PRESETS[model.preset]()))


def build_model(model: ModelConfig, *, seed: int) -> torch.nn.Module:
    """Random-initialised model from the config (same seed -> same weights on every rank)."""
    attention = FAMILIES[model.family].attention if not model.path else None
    if model.load_weights:
        return transformers.AutoModelForCausalLM.from_pretrained(
            model.path, local_files_only=True, attn_implementation=attention, dtype=torch.float32
        )
    config = build_config(model)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def num_routed_experts(config: transformers.PretrainedConfig) -> int:
    """Routed experts per MoE layer of a transformers config (0: no attribute names them)."""
    for attribute in NUM_EXPERTS_ATTRIBUTES:
        if getattr(config, attribute, None):
            return int(getattr(config, attribute))
    return 0


def check_model_support(model: ModelConfig, parallel: ParallelConfig, faults: FaultConfig | None = None) -> None:
    """What the model's config decides about the parallel layout, checked before any process group:
    a tensor-parallel plan must exist and the attention heads must divide evenly; expert parallelism needs a
    supported MoE block and whole experts per rank; a hot expert must exist."""
    if parallel.tp == 1 and parallel.ep == 1 and (faults is None or faults.hot_expert < 0):
        return
    config = build_config(model)
    name = model.path or model.family
    experts = num_routed_experts(config)
    check_expert_degree(parallel, num_experts=experts, model_type=getattr(config, "model_type", ""), name=name)
    if faults is not None and faults.hot_expert >= experts:
        raise ConfigError(f"faults.hot_expert: {faults.hot_expert} is not an expert of {name} ({experts} experts)")
    if parallel.tp == 1:
        return
    if not getattr(config, "base_model_tp_plan", None):
        raise ConfigError(f"parallel.tp: {name} ({type(config).__name__}) has no tensor-parallel plan; use ddp or fsdp")
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attribute, None)
        if heads and heads % parallel.tp:
            raise ConfigError(f"parallel.tp: {parallel.tp} does not divide {attribute}={heads} of {name}")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated decoder blocks (the unit of FSDP sharding, compilation and checkpointing)."""
    model = getattr(model, "causal_lm", model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"model: {type(model).__name__} has no model.layers ModuleList of decoder blocks")
    return layers


def _local_config(path: Path) -> transformers.PretrainedConfig:
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {path} has no config.json")
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.path: cannot read {path / 'config.json'}: {error}") from error
