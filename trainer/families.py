"""MoE model families and size presets, as transformers config keyword arguments.

Torch-free (only names and numbers), so configuration can be validated without importing
transformers. `trainer.models` turns a family + preset into a real model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeDims:
    """The shape of an MoE decoder, in one vocabulary for every family."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_ffn: int
    """Hidden size of one routed expert's MLP."""
    dense_ffn: int
    """Hidden size of a dense MLP / shared expert where the family has one."""
    max_positions: int = 4096


def tiny(base: MoeDims | None = None) -> MoeDims:
    """Runs a step on 2 CPU cores in tens of milliseconds."""
    return MoeDims(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   num_experts=4, top_k=2, expert_ffn=64, dense_ffn=128, max_positions=1024)


def small(base: MoeDims | None = None) -> MoeDims:
    """~0.39B parameters: hidden 1024, 8 layers, 16 experts top-2 (the trainer benchmark's shape)."""
    return MoeDims(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
                   num_experts=16, top_k=2, expert_ffn=768, dense_ffn=2048)


def medium(base: MoeDims | None = None) -> MoeDims:
    """~2.6B parameters: hidden 2048, 12 layers, 32 experts top-4; fits one H200 with room."""
    return dataclasses.replace(small(), hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=128,
                               num_experts=32, top_k=4, expert_ffn=1024, dense_ffn=4096)


PRESETS: dict[str, Callable[[MoeDims | None], MoeDims]] = {"tiny": tiny, "small": small, "medium": medium}


def _attention(d: MoeDims) -> dict[str, Any]:
    return dict(vocab_size=d.vocab_size, hidden_size=d.hidden_size, num_hidden_layers=d.num_layers,
                num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads,
                max_position_embeddings=d.max_positions, tie_word_embeddings=False,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _mixtral(d: MoeDims) -> dict[str, Any]:
    return _attention(d) | dict(head_dim=d.head_dim, intermediate_size=d.expert_ffn,
                                num_local_experts=d.num_experts, num_experts_per_tok=d.top_k)


def _qwen3_moe(d: MoeDims) -> dict[str, Any]:
    return _attention(d) | dict(head_dim=d.head_dim, intermediate_size=d.dense_ffn, moe_intermediate_size=d.expert_ffn,
                                num_experts=d.num_experts, num_experts_per_tok=d.top_k, norm_topk_prob=True)


def _qwen2_moe(d: MoeDims) -> dict[str, Any]:
    return _attention(d) | dict(intermediate_size=d.dense_ffn, moe_intermediate_size=d.expert_ffn,
                                shared_expert_intermediate_size=d.dense_ffn, num_experts=d.num_experts,
                                num_experts_per_tok=d.top_k)


def _olmoe(d: MoeDims) -> dict[str, Any]:
    return _attention(d) | dict(intermediate_size=d.expert_ffn, num_experts=d.num_experts, num_experts_per_tok=d.top_k)


def _deepseek_v3(d: MoeDims) -> dict[str, Any]:
    # Multi-head latent attention has one K/V head per query head; low-rank sizes scale with width.
    return _attention(d) | dict(
        num_key_value_heads=d.num_heads, intermediate_size=d.dense_ffn, moe_intermediate_size=d.expert_ffn,
        n_routed_experts=d.num_experts, n_shared_experts=1, num_experts_per_tok=d.top_k, first_k_dense_replace=0,
        n_group=1, topk_group=1, q_lora_rank=d.hidden_size // 2, kv_lora_rank=d.hidden_size // 4,
        qk_nope_head_dim=d.head_dim, qk_rope_head_dim=d.head_dim // 2, v_head_dim=d.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _gpt_oss(d: MoeDims) -> dict[str, Any]:
    return _attention(d) | dict(head_dim=d.head_dim, intermediate_size=d.expert_ffn, num_local_experts=d.num_experts,
                                num_experts_per_tok=d.top_k, sliding_window=min(128, d.max_positions),
                                rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


@dataclass(frozen=True, slots=True)
class Family:
    config_class: str
    """Name of the transformers config class."""
    config_kwargs: Callable[[MoeDims], dict[str, Any]]
    attention: str = "sdpa"
    """transformers attention implementation the family supports."""


EP_MODEL_TYPES: tuple[str, ...] = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
"""transformers model types whose MoE block expert parallelism splits (trainer/expert_parallel.py): each
block calls `experts(hidden, top_k_index, top_k_weights)` on routing decided beforehand, with every expert's
weights stacked on dim 0 of 3-D parameters. Shared experts (qwen2_moe, deepseek_v3) stay replicated."""
BIAS_ROUTER_FAMILIES: tuple[str, ...] = ("deepseek_v3",)
"""Families whose router adds a per-expert `e_score_correction_bias` to its scores before top-k (what
model.router_bias_update_rate updates)."""
NUM_EXPERTS_ATTRIBUTES: tuple[str, ...] = ("num_local_experts", "num_experts", "n_routed_experts")
"""Config attributes that hold the routed-expert count, by family naming."""


FAMILIES: dict[str, Family] = {
    "mixtral": Family("MixtralConfig", _mixtral),
    "qwen3_moe": Family("Qwen3MoeConfig", _qwen3_moe),
    "qwen2_moe": Family("Qwen2MoeConfig", _qwen2_moe),
    "olmoe": Family("OlmoeConfig", _olmoe),
    "deepseek_v3": Family("DeepseekV3Config", _deepseek_v3),
    "gpt_oss": Family("GptOssConfig", _gpt_oss, attention="eager"),  # sinks: no SDPA path
}
