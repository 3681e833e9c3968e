"""The routers' load-balancing loss (model.router_aux_loss_coef): the formula on hand-computed routings, the
term inside a real model's loss and its gradient reaching only the routers, nothing computed when off, the
refusals before any process group, and (slow) real gloo runs in which a skewed router evens out with the
loss on and stays skewed with it off, with the same trajectory with and without expert parallelism."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import REPO, mean_losses, torchrun

from fleetscope.traces.formats import read_moe_records
from fleetscope.trainer.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from fleetscope.trainer.expert_parallel import install_moe_layers, moe_blocks
from fleetscope.trainer.config import FaultConfig
from fleetscope.trainer.load_balance import RouterBalance, bias_step, load_balancing_loss, router_term
from fleetscope.trainer.loss import CausalLMTrainingModule, causal_lm_loss
from fleetscope.trainer.models import build_model

PROBS = [0.5, 0.25, 0.125, 0.125]
"""Dyadic probabilities: every product and sum below is exact in fp32."""


def _probs(tokens: int) -> torch.Tensor:
    return torch.tensor([PROBS] * tokens)


# --- the formula -----------------------------------------------------------------------------------


def test_top1_routing_gives_the_hand_computed_value():
    # experts 0,0,0,1 -> f = [3/4, 1/4, 0, 0]; P = PROBS; 4 * (3/4 * 1/2 + 1/4 * 1/4) = 1.75
    loss = load_balancing_loss(_probs(4), torch.tensor([[0], [0], [0], [1]]), 4)
    assert loss.item() == 1.75


def test_top2_routing_counts_token_copies():
    # copies 0,1,0,1,0,2,0,3 -> f = [4/8, 2/8, 1/8, 1/8]; 4 * (1/4 + 1/16 + 1/64 + 1/64) = 1.375
    loss = load_balancing_loss(_probs(4), torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]]), 4)
    assert loss.item() == 1.375


def test_balanced_routing_gives_one_and_collapse_gives_the_expert_count():
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([[0, 1], [2, 3]] * 4), 4).item() == 1.0
    collapsed = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 8)
    assert load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), 4).item() == 4.0


def test_router_term_takes_softmax_or_normalised_sigmoid_scores():
    logits = torch.log(torch.tensor(PROBS)).repeat(4, 1)
    term = router_term(logits, torch.tensor([[0], [0], [0], [1]]), 4, sigmoid_scores=False)
    assert term.item() == pytest.approx(1.75, rel=1e-6)
    # equal sigmoid scores normalise to 1/E whatever the routing: exactly balanced probabilities
    flat = router_term(torch.zeros(4, 4), torch.tensor([[0], [0], [0], [1]]), 4, sigmoid_scores=True)
    assert flat.item() == pytest.approx(4 * 0.25, rel=1e-6)


def test_the_collector_averages_layers_and_starts_over():
    balance = RouterBalance(0.5)
    balance.record(1, torch.tensor(3.0))
    balance.record(0, torch.tensor(1.0))
    assert balance.added_to(torch.tensor(10.0)).item() == 10.0 + 0.5 * 2.0
    assert balance.take() is None  # taken: the next micro-batch starts from nothing
    assert balance.added_to(torch.tensor(10.0)).item() == 10.0


# --- inside a real model ---------------------------------------------------------------------------


def _module(family: str, balance: RouterBalance | None, *, fused: bool = True) -> CausalLMTrainingModule:
    causal_lm = build_model(ModelConfig(family=family), seed=0)
    install_moe_layers(causal_lm, faults=FaultConfig(expert_skew=1.0), stats=None, grouped=True,
                       device=torch.device("cpu"), expert_parallel=False, balance=balance)
    return CausalLMTrainingModule(causal_lm, fused_loss=fused, chunk_tokens=64, balance=balance)


def _tokens() -> torch.Tensor:
    return torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def _router_outputs(module: CausalLMTrainingModule) -> list:
    """Forward hooks on every router: what each returned (logits, weights, chosen experts)."""
    outputs = []
    for _, block in moe_blocks(module.causal_lm):
        router = getattr(block, "gate", None) or block.router
        router.register_forward_hook(lambda _m, _args, out: outputs.append(out))
    return outputs


def _hand_term(logits: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e P_e written out with one-hot counts (independent of load_balance.py's scatter)."""
    chosen = chosen.reshape(logits.shape[0], -1)
    f_E = torch.nn.functional.one_hot(chosen, num_experts).float().sum(dim=(0, 1)) / chosen.numel()
    return num_experts * (f_E * torch.softmax(logits.float(), dim=-1).mean(dim=0)).sum()


@pytest.mark.parametrize("fused", [True, False])
def test_the_loss_adds_coef_times_the_mean_layer_term(fused):
    coef = 0.25
    on = _module("qwen3_moe", RouterBalance(coef), fused=fused)
    outputs = _router_outputs(on)
    with torch.no_grad():
        loss_on = on(_tokens())
        loss_off = _module("qwen3_moe", None, fused=fused)(_tokens())
    assert len(outputs) == 2  # tiny preset: 2 MoE layers
    expected = torch.stack([_hand_term(logits, chosen, 4) for logits, _, chosen in outputs]).mean()
    assert expected.item() > 1.2  # the skew fault makes the routing visibly uneven
    assert loss_on.item() == pytest.approx(loss_off.item() + coef * expected.item(), abs=1e-5)


def test_off_computes_nothing_and_the_loss_is_the_language_model_loss_to_the_bit():
    module = _module("qwen3_moe", None)
    assert all(getattr(block.experts, "_fleetscope_moe_layer").balance is None
               for _, block in moe_blocks(module.causal_lm))
    with torch.no_grad():
        loss = module(_tokens())
        hidden = module.causal_lm.model(input_ids=_tokens(), use_cache=False).last_hidden_state
        reference = causal_lm_loss(hidden, module.causal_lm.lm_head.weight, _tokens(), chunk_tokens=64)
    assert torch.equal(loss, reference)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_term_reaches_the_routers(family):
    """Every layer's router gets a gradient; what runs after the last router (its experts, the LM head) none:
    the term depends on the routing probabilities only (earlier layers feed later routers' inputs)."""
    balance = RouterBalance(1.0)
    module = _module(family, balance)
    module.causal_lm.model(input_ids=_tokens(), use_cache=False)
    balance.take().backward()
    blocks = moe_blocks(module.causal_lm)
    for _, block in blocks:
        router = getattr(block, "gate", None) or block.router
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in blocks[-1][1].experts.parameters())
    assert module.causal_lm.lm_head.weight.grad is None


# --- the router-bias update (DeepSeek-V3's auxiliary-loss-free balancing) ---------------------------


def test_the_bias_step_moves_towards_the_mean_load():
    # mean load 1: expert 0 over it (-rate), expert 1 at it (0), experts 2 and 3 under it (+rate); per layer
    loads = torch.tensor([[3.0, 1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert torch.equal(bias_step(loads, 0.01), 0.01 * torch.tensor([[-1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))


def test_the_bias_update_counts_the_step_and_moves_every_router_bias():
    causal_lm = build_model(ModelConfig(family="deepseek_v3"), seed=0)
    _, update = install_moe_layers(causal_lm, faults=FaultConfig(expert_skew=1.0), stats=None, grouped=True,
                                   device=torch.device("cpu"), expert_parallel=False, bias_rate=0.25)
    routers = [block.gate for _, block in moe_blocks(causal_lm)]
    chosen = []
    for router in routers:
        router.register_forward_hook(lambda _m, _args, out: chosen.append(out[2].reshape(-1)))
    with torch.no_grad():
        causal_lm.model(input_ids=_tokens(), use_cache=False)
    update.update()
    for router, experts in zip(routers, chosen):
        loads = torch.bincount(experts, minlength=4).float()
        assert loads.sum() == 2 * 16 * 2  # sequences x tokens x top-2
        expected = 0.25 * torch.sign(loads.mean() - loads)
        assert torch.equal(router.e_score_correction_bias, expected), (loads, router.e_score_correction_bias)
    assert update.loads_of(0).sum() == 0  # the next step counts from zero


def test_the_bias_update_needs_a_router_with_a_bias():
    with pytest.raises(ConfigError, match=r"^model\.router_bias_update_rate: the qwen3_moe router has no "
                                          r"e_score_correction_bias"):
        ModelConfig(family="qwen3_moe", router_bias_update_rate=0.001)
    with pytest.raises(ConfigError, match=r"^model\.router_bias_update_rate: must be a finite number >= 0"):
        ModelConfig(family="deepseek_v3", router_bias_update_rate=-1.0)
    with pytest.raises(ConfigError, match=r"^model\.router_bias_update_rate: .*pipeline parallelism"):
        TrainConfig(run_dir="r", model=ModelConfig(family="deepseek_v3", router_bias_update_rate=0.001),
                    parallel=ParallelConfig(pp=2))
    # a model read from a path is checked when it is built: its routers, not its family name, decide
    causal_lm = build_model(ModelConfig(family="mixtral"), seed=0)
    with pytest.raises(ConfigError, match=r"^model\.router_bias_update_rate: the routers of layers \[0, 1\] have "
                                          r"no e_score_correction_bias"):
        install_moe_layers(causal_lm, faults=FaultConfig(), stats=None, grouped=True, device=torch.device("cpu"),
                           expert_parallel=False, bias_rate=0.001)


# --- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.01, math.nan, math.inf])
def test_the_coefficient_must_be_finite_and_not_negative(bad):
    with pytest.raises(ConfigError, match=r"^model\.router_aux_loss_coef: must be a finite number >= 0"):
        ModelConfig(router_aux_loss_coef=bad)


def test_the_loss_is_refused_where_the_trainer_has_no_router_to_balance():
    with pytest.raises(ConfigError, match=r"^model\.router_aux_loss_coef: .*pipeline parallelism"):
        TrainConfig(run_dir="r", model=ModelConfig(router_aux_loss_coef=0.01), parallel=ParallelConfig(pp=2))
    with pytest.raises(ConfigError, match=r"^model\.router_aux_loss_coef: .*tensor-parallel runs without expert"):
        TrainConfig(run_dir="r", model=ModelConfig(router_aux_loss_coef=0.01),
                    parallel=ParallelConfig(mode="fsdp_tp", tp=2))
    TrainConfig(run_dir="r", model=ModelConfig(router_aux_loss_coef=0.01),
                parallel=ParallelConfig(mode="fsdp_tp", tp=2, ep=2))
    TrainConfig(run_dir="r", parallel=ParallelConfig(pp=2))  # off: nothing to refuse


# --- real runs ------------------------------------------------------------------------------------

SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_families.py")
SKEWED_RUN_STEPS = 16
COEF = 0.1
SKEWED = ("--set", "faults.expert_skew=1.0", "--set", "optim.lr=3e-3")
"""expert_skew 1 puts nearly every token's top-2 on experts 0 and 1 (of 4); a learning rate high enough for
the router to move its logits by ~ln 4 within the run."""


def _skewed_run(out, *, ep: int, coef: float) -> None:
    completed = torchrun(2, SCRIPT, "--out", str(out), "--mode", "ddp", "--ep", str(ep), "--batch", "4",
                         "--steps", str(SKEWED_RUN_STEPS), "--families", "qwen3_moe", *SKEWED,
                         "--set", f"model.router_aux_loss_coef={coef}", timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]


def _imbalance_per_step(run_dir) -> list[float]:
    """Per step: the coefficient of variation of the tokens per expert (std / mean), averaged over layers and
    ranks: 0 balanced, 1 for top-2 of 4 on the same two experts. (The hottest expert's share saturates at
    2x the mean under top-2 of 4 and jumps when the router overshoots to another expert: too coarse.)"""
    by_step: dict[int, list[float]] = {}
    for rank in range(2):
        for record in read_moe_records(run_dir / "metrics" / f"rank{rank}.moe.jsonl"):
            counts = torch.tensor(record.tokens_per_expert, dtype=torch.float64)
            by_step.setdefault(record.step, []).append((counts.std(unbiased=False) / counts.mean()).item())
    return [sum(values) / len(values) for _, values in sorted(by_step.items())]


@pytest.mark.slow
def test_the_loss_evens_out_a_skewed_router_with_and_without_expert_parallelism(tmp_path):
    _skewed_run(tmp_path / "off", ep=1, coef=0.0)
    _skewed_run(tmp_path / "on", ep=1, coef=COEF)
    _skewed_run(tmp_path / "on_ep2", ep=2, coef=COEF)
    off = _imbalance_per_step(tmp_path / "off" / "qwen3_moe")
    on = _imbalance_per_step(tmp_path / "on" / "qwen3_moe")
    assert len(off) == len(on) == SKEWED_RUN_STEPS
    late = slice(SKEWED_RUN_STEPS - 4, None)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert min(off[late]) > 0.85, off                    # off: the skew holds (experts 0 and 1 take ~all copies)
    assert on[0] > 0.85 and mean(on[late]) < 0.7, on     # on: the same start, then the router evens out
    # f_e counts the tokens each rank routes, whatever the ep degree: the same loss with ep 2 as with ep 1
    reference = mean_losses(tmp_path / "on" / "qwen3_moe", 2)
    sharded = mean_losses(tmp_path / "on_ep2" / "qwen3_moe", 2)
    assert abs(sharded[0] - reference[0]) < 1e-5, (sharded, reference)
    assert max(abs(a - b) for a, b in zip(sharded, reference)) < 5e-4, (sharded, reference)


@pytest.mark.slow
def test_the_loss_is_the_same_under_ep_x_tp(tmp_path):
    """tp 2 x ep 2 (4 ranks, dp 2) against plain DDP on 2 ranks, the loss on: the router runs on the TP group's
    replicated tokens, so each TP rank adds the same term; softmax (qwen3_moe) and sigmoid (deepseek_v3) routers."""
    families = "qwen3_moe,deepseek_v3"
    common = ("--batch", "4", "--steps", "6", "--families", families, *SKEWED,
              "--set", f"model.router_aux_loss_coef={COEF}")
    for name, nproc, layout in (("ddp", 2, ("--mode", "ddp")), ("ep_tp", 4, ("--mode", "fsdp_tp", "--tp", "2",
                                                                             "--ep", "2"))):
        completed = torchrun(nproc, SCRIPT, "--out", str(tmp_path / name), *layout, *common, timeout=900)
        assert completed.returncode == 0, completed.stderr[-4000:]
    for family in families.split(","):
        reference = mean_losses(tmp_path / "ddp" / family, 2)
        sharded = mean_losses(tmp_path / "ep_tp" / family, 4)
        assert len(reference) == len(sharded) == 6
        assert abs(sharded[0] - reference[0]) < 1e-5, (family, sharded, reference)
        assert max(abs(a - b) for a, b in zip(sharded, reference)) < 5e-4, (family, sharded, reference)


@pytest.mark.slow
def test_the_bias_update_evens_out_a_skewed_deepseek_router(tmp_path):
    """deepseek_v3, 2 ranks, the default learning rate: with the bias update the tokens per expert even out
    (the bias does it, not the weights); without it the skew holds. Under FSDP2 x ep 2 (no buffer broadcast:
    the all-reduced loads alone keep the ranks' biases equal) the run follows DDP's."""
    runs = {"off": ("ddp", 1, 0.0), "on": ("ddp", 1, 0.01), "on_fsdp_ep2": ("fsdp", 2, 0.01)}
    cv = {}
    for name, (mode, ep, rate) in runs.items():
        completed = torchrun(2, SCRIPT, "--out", str(tmp_path / name), "--mode", mode, "--ep", str(ep), "--batch", "4",
                             "--steps", "16", "--families", "deepseek_v3", "--set", "faults.expert_skew=1.0",
                             "--set", f"model.router_bias_update_rate={rate}", timeout=600)
        assert completed.returncode == 0, completed.stderr[-4000:]
        cv[name] = _imbalance_per_step(tmp_path / name / "deepseek_v3")
    late = slice(12, None)
    assert min(cv["off"][late]) > 0.85, cv["off"]
    assert cv["on"][0] > 0.85 and max(cv["on"][late]) < 0.7, cv["on"]
    reference = mean_losses(tmp_path / "on" / "deepseek_v3", 2)
    sharded = mean_losses(tmp_path / "on_fsdp_ep2" / "deepseek_v3", 2)
    assert max(abs(a - b) for a, b in zip(sharded, reference)) < 5e-4, (sharded, reference)
    assert max(abs(a - b) for a, b in zip(cv["on_fsdp_ep2"], cv["on"])) < 0.05, (cv["on_fsdp_ep2"], cv["on"])
