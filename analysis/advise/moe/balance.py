"""The MoE load-balance rule: a hot expert, and the routing change that spreads its tokens."""

from __future__ import annotations

from fleetscope.analysis.cross_rank.moe import MoeFinding, MoeReport

from ..model import Change, Evidence, Finding, settings_change, step_gain, trainer_change
from .section import MOE_RULES_SOURCE, holder_extra_ms, layer_report, ranks_text

AUX_LOSS_COEF = 0.01
"""The load-balancing loss coefficient suggested (Switch Transformer's; transformers' defaults are 0.001-0.01)."""
AUX_LOSS_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss")
"""Families whose transformers config has router_aux_loss_coef / output_router_logits."""
BIAS_BALANCED_FAMILIES = ("deepseek_v3",)
"""Families whose router adds a per-expert bias for balancing (e_score_correction_bias) instead of a loss."""
BIAS_UPDATE_RATE = 0.001
"""The bias update rate suggested (DeepSeek-V3's gamma)."""


def _router_fault(e: Evidence) -> str | None:
    """The trainer fault that biases the router in this run (its configuration), as a --set to undo it."""
    if int(e.setting("faults", "hot_expert", -1)) >= 0:
        return "faults.hot_expert=-1"
    if float(e.setting("faults", "expert_skew", 0.0)) > 0:
        return "faults.expert_skew=0"
    return None


def _hot_cost(moe: MoeReport, findings: list[MoeFinding]) -> tuple[float | None, float | None]:
    """(extra expert compute of the hot ranks, the measured combine waiting they cause), ms per step,
    summed over the findings' layers; None where unknown."""
    extra = [x for x in (holder_extra_ms(moe, f) for f in findings) if x is not None]
    waited = [f.cost_ms_per_step for f in findings if f.cost_ms_per_step is not None]
    return (float(sum(extra)) if extra else None), (float(sum(waited)) if waited else None)


def _hottest(findings: list[MoeFinding]) -> MoeFinding:
    """The finding with the most tokens over the mean (to 1%), then the most observed waiting."""
    return max(findings, key=lambda f: (round(f.tokens_vs_mean, 2), f.holder_last_pct or 0.0, f.cost_ms_per_step or 0.0))


def balance_change(e: Evidence) -> tuple[str, Change | None]:
    """The routing change that spreads a hot expert's tokens (moe_load_balance; the straggler rule's where a
    rank's extra work is a hot expert it holds): its text, and the trainer setting that applies it, if any."""
    fault = _router_fault(e)
    if fault is not None:
        return (f"--set {fault} (this run's router fault is the imbalance; in a real job: the load-balancing "
                "loss or router bias below)", Change(train_args=("--set", fault)))
    family = str(e.setting("model", "family", ""))
    capacity = "; or cap each expert at 1.25x the mean tokens per expert (capacity factor 1.25: overflow tokens skip the layer)"
    if family in AUX_LOSS_FAMILIES:
        change = _raised_setting(e, "router_aux_loss_coef", AUX_LOSS_COEF)
        if change is not None:
            applied = trainer_change(change, "the trainer's router load-balancing loss" + capacity)
            return applied["change"], applied["apply"]
        return (f"train with the router's load-balancing loss (router_aux_loss_coef={AUX_LOSS_COEF:g}; the trainer's "
                "model.router_aux_loss_coef needs its MoE layers: no pipeline, no tensor parallelism without "
                "expert parallelism)" + capacity, None)
    if family in BIAS_BALANCED_FAMILIES:
        change = _raised_setting(e, "router_bias_update_rate", BIAS_UPDATE_RATE)
        if change is not None:
            applied = trainer_change(change, "the trainer's auxiliary-loss-free router bias update" + capacity)
            return applied["change"], applied["apply"]
        return ("update the router's e_score_correction_bias after every step (auxiliary-loss-free balancing: "
                "bias[e] -= 1e-3 * sign(tokens[e] - mean tokens); the trainer's model.router_bias_update_rate "
                "needs its MoE layers: no pipeline, no tensor parallelism without expert parallelism)" + capacity,
                None)
    return ("raise the router's load-balancing loss coefficient (or update a per-expert router bias towards "
            "the mean load)" + capacity, None)


def _raised_setting(e: Evidence, name: str, suggested: float) -> Change | None:
    """`--set model.<name>=...` (router_aux_loss_coef, router_bias_update_rate) for a run the trainer can
    balance (trainer/load_balance.py: its MoE layers wrap every router unless the run is pipelined or
    tensor-parallel without expert parallelism, which its configuration refuses); `suggested`, or twice the
    run's own value where it already has one. None: the layout cannot take it."""
    parallel = {key: e.setting("parallel", key, 1) for key in ("pp", "tp", "ep")}
    if int(parallel["pp"]) > 1 or (int(parallel["tp"]) > 1 and int(parallel["ep"]) <= 1):
        return None
    current = float(e.setting("model", name, 0.0) or 0.0)
    value = suggested if current < suggested else 2 * current
    return settings_change(f"model.{name}={value:g}")


def moe_load_balance(e: Evidence) -> Finding | None:
    """Fires when the MoE section names a hot expert (an expert with >= its hot_expert_min_ratio times the
    mean expert's tokens in a layer). Gain, with expert parallelism: the hot experts' ranks' extra expert
    compute over the median other rank, summed over the layers (what the others wait for at each combine;
    balanced routing removes it: an upper bound); none without expert parallelism (every rank runs every
    expert: the imbalance only makes some GEMMs larger). Confidence high when the waiting is also observed
    (the holders arrived last at the combine in at least half of the instances), medium with ep > 1
    otherwise, low with ep 1. The change: undo this run's router fault (faults.hot_expert / expert_skew)
    where one is set, else the family's balancing mechanism or a capacity factor: the trainer's load-balancing
    loss (--set model.router_aux_loss_coef) for the softmax-routed families, DeepSeek-V3's router bias update
    (--set model.router_bias_update_rate), applied where the run's layout lets the trainer do it."""
    moe = e.moe
    if moe is None or not moe.findings:
        return None
    top = _hottest(moe.findings)
    extra_ms, waited_ms = _hot_cost(moe, moe.findings)
    gain, pct = step_gain(e, extra_ms if moe.ep > 1 else None)
    observed = [f for f in moe.findings if (f.holder_last_pct or 0.0) >= 50.0]
    confidence = "low" if moe.ep <= 1 else ("high" if observed else "medium")
    evidence: dict[str, float | int | str] = {
        "source": MOE_RULES_SOURCE, "expert": top.expert, "layer": top.layer,
        "tokens_vs_mean": round(top.tokens_vs_mean, 3), "layers_with_hot_expert": len(moe.findings),
        "ep": moe.ep, "ranks": ", ".join(map(str, top.ranks)) or "all"}
    layer = layer_report(moe, top.layer)
    if layer is not None and layer.rank_max_over_mean is not None:
        evidence["rank_max_over_mean"] = round(layer.rank_max_over_mean, 3)
    if extra_ms is not None:
        evidence["hot_rank_extra_expert_ms"] = round(extra_ms, 3)
    if waited_ms is not None:
        evidence["combine_wait_caused_ms"] = round(waited_ms, 3)
    change, apply = balance_change(e)
    where = f" on {ranks_text(top.ranks)}" if top.ranks else ""
    return Finding(rule="moe_load_balance",
                   title=f"uneven routing: expert {top.expert} (layer {top.layer}){where} gets "
                         f"{top.tokens_vs_mean:.1f}x the mean tokens",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct, confidence=confidence,
                   change=change, apply=apply,
                   why=top.sentence + ("" if extra_ms is None else
                                       f"; its ranks compute their experts {extra_ms:.2f} ms per step longer than the others"))
