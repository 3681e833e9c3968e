"""Model building: every family and preset from its config, local checkpoints, the fast paths' numerics."""

from __future__ import annotations

import copy

import pytest
import torch

from fleetscope.trainer.config import ConfigError, ModelConfig, ParallelConfig
from fleetscope.trainer.fast_moe import install_fast_experts
from fleetscope.trainer.families import FAMILIES
from fleetscope.trainer.flops import flop_model
from fleetscope.trainer.loss import causal_lm_loss
from fleetscope.trainer.models import build_config, build_model, check_model_support


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_experts_and_fused_loss_match_transformers(family):
    reference = build_model(ModelConfig(family=family), seed=0)
    reference.config._experts_implementation = "eager"  # transformers' per-expert loop
    fast = copy.deepcopy(reference)
    swapped = install_fast_experts(fast)
    assert swapped == (0 if family == "gpt_oss" else reference.config.num_hidden_layers)
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    expected = reference(input_ids=tokens, labels=tokens).loss
    expected.backward()
    hidden = fast.model(input_ids=tokens).last_hidden_state
    loss = causal_lm_loss(hidden, fast.lm_head.weight, tokens, chunk_tokens=40)  # chunks do not divide 96
    loss.backward()
    assert abs(loss.item() - expected.item()) < 1e-5
    for (name, a), b in zip(reference.named_parameters(), fast.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_presets_build_with_plausible_sizes(family):
    with torch.device("meta"):
        small = flop_model(build_model(ModelConfig(family=family, preset="small"), seed=0))
        medium = flop_model(build_model(ModelConfig(family=family, preset="medium"), seed=0))
    assert 0.35e9 < small.total_params < 0.5e9 and 2.6e9 < medium.total_params < 3.1e9
    assert small.active_params < small.total_params / 2  # only routed experts' share counts


def test_local_checkpoint_loads_its_weights(tmp_path):
    saved = build_model(ModelConfig(family="mixtral"), seed=7)
    saved.save_pretrained(tmp_path)
    loaded = build_model(ModelConfig(family="mixtral", path=str(tmp_path), load_weights=True), seed=0)
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    config_only = build_model(ModelConfig(family="mixtral", path=str(tmp_path)), seed=0)
    assert config_only.config.hidden_size == saved.config.hidden_size
    assert not torch.equal(config_only.lm_head.weight, saved.lm_head.weight)  # random init, same shape


def test_missing_local_config_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="model.path: .* has no config.json"):
        build_config(ModelConfig(path=str(tmp_path)))


def test_tensor_parallel_needs_divisible_heads():
    with pytest.raises(ConfigError, match="parallel.tp: 4 does not divide num_key_value_heads=2"):
        check_model_support(ModelConfig(family="qwen3_moe"), ParallelConfig(mode="tp", tp=4))
    check_model_support(ModelConfig(family="qwen3_moe"), ParallelConfig(mode="tp", tp=2))


def test_a_family_without_a_tensor_parallel_plan_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=512).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="parallel.tp: .* has no tensor-parallel plan"):
        check_model_support(ModelConfig(path=str(tmp_path)), ParallelConfig(mode="tp", tp=2))
