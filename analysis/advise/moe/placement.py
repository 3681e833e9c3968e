"""The MoE expert-placement rule: an overloaded ep rank, and where its hot expert could live instead."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from fleetscope.analysis.cross_rank.moe import MoeFinding, MoeLayerReport, MoeReport

from ..model import Evidence, Finding, step_gain
from .section import MOE_RULES_SOURCE, holder_extra_ms, layer_report, ranks_text

RANK_OVERLOAD_RATIO = 1.25
"""An ep rank whose experts receive at least this many times its ep group's mean tokens (MoE section
rank_max_over_mean) holds too much of the load: expert placement can move some of it."""


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """A change of where experts live, and how much of the hottest ep rank's excess load it leaves."""

    action: str
    """"swap" (exchange the hot expert with the expert of the coldest ep rank that balances best) or "replicate"
    (a second copy of the hot expert on the coldest ep rank takes half its tokens)."""
    expert: int
    to_ep_rank: int
    swap_with: int | None
    remaining_excess: float
    """The heaviest ep rank's load over the mean after the change, as a share of today's (0: balanced)."""


def plan_placement(tokens_per_expert: list[float], ep: int, expert: int) -> PlacementPlan | None:
    """The better of swapping and replicating the hot `expert` (pure: loads in, plan out); None when the
    hot expert's ep rank is not the heaviest or nothing improves."""
    # numbers read back from report.json: a degree or an expert outside the layer's experts plans nothing
    if type(ep) is not int or type(expert) is not int or not 1 < ep <= len(tokens_per_expert) \
            or not 0 <= expert < len(tokens_per_expert):
        return None
    per = len(tokens_per_expert) // ep
    loads = [float(sum(tokens_per_expert[k * per:(k + 1) * per])) for k in range(ep)]
    mean, hot = float(np.mean(loads)), expert // per
    excess = max(loads) - mean
    if excess <= 0 or loads[hot] < max(loads):
        return None
    cold = min((k for k in range(ep) if k != hot), key=lambda k: loads[k])
    tokens = float(tokens_per_expert[expert])
    plans = []
    for partner in range(cold * per, (cold + 1) * per) if per > 1 else ():
        moved = tokens - float(tokens_per_expert[partner])
        after = list(loads)
        after[hot], after[cold] = loads[hot] - moved, loads[cold] + moved
        plans.append(PlacementPlan(action="swap", expert=expert, to_ep_rank=cold, swap_with=partner,
                                   remaining_excess=max(max(after) - mean, 0.0) / excess))
    after = list(loads)
    after[hot], after[cold] = loads[hot] - tokens / 2, loads[cold] + tokens / 2
    plans.append(PlacementPlan(action="replicate", expert=expert, to_ep_rank=cold, swap_with=None,
                               remaining_excess=max(max(after) - mean, 0.0) / excess))
    best = min(plans, key=lambda p: p.remaining_excess)
    return best if best.remaining_excess < 1.0 else None


def moe_expert_placement(e: Evidence) -> Finding | None:
    """Fires with expert parallelism when a hot expert's ep rank is overloaded: its layer's
    rank_max_over_mean >= RANK_OVERLOAD_RATIO and that rank is the heaviest. The change moves load off it
    (plan_placement: swap the hot expert with the coldest rank's expert that balances best, or replicate it there).
    Gain: the holders' extra expert compute over the median other rank (what the others wait for at the
    combine), times the share of the excess load the plan removes, summed over the layers with that hot
    expert. Confidence medium when the holders were observed arriving last at the combine in at least half
    of the instances, else low. No trainer option places experts: the change is an action."""
    moe = e.moe
    candidates = _placement_candidates(moe) if moe is not None and moe.ep > 1 else []
    if not candidates:
        return None
    finding, layer, plan = max(candidates, key=lambda c: (round(c[1].rank_max_over_mean, 2), c[0].holder_last_pct or 0.0))
    same = [(f, p) for f, _, p in candidates if f.expert == finding.expert]
    extra = [(holder_extra_ms(moe, f), p) for f, p in same]
    known = [x * (1.0 - p.remaining_excess) for x, p in extra if x is not None]
    gain, pct = step_gain(e, float(sum(known)) if known else None)
    holders = ", ".join(map(str, finding.ranks))
    observed = [f for f, _ in same if (f.holder_last_pct or 0.0) >= 50.0]
    evidence: dict[str, float | int | str] = {
        "source": MOE_RULES_SOURCE, "expert": finding.expert, "layer": finding.layer, "ranks": holders,
        "tokens_vs_mean": round(finding.tokens_vs_mean, 3), "rank_max_over_mean": round(layer.rank_max_over_mean, 3),
        "ep": moe.ep, "plan": plan.action, "remaining_excess_share": round(plan.remaining_excess, 3)}
    if finding.holder_last_pct is not None:
        evidence["holder_last_pct"] = round(finding.holder_last_pct, 1)
    if finding.cost_ms_per_step is not None:
        evidence["combine_wait_caused_ms"] = round(finding.cost_ms_per_step, 3)
    return Finding(rule="moe_expert_placement",
                   title=f"{ranks_text(finding.ranks)} {'holds' if len(finding.ranks) == 1 else 'hold'} hot expert "
                         f"{finding.expert} (layer {finding.layer}): {layer.rank_max_over_mean:.1f}x its ep group's "
                         "mean tokens",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct,
                   confidence="medium" if observed else "low", change=_placement_change(moe, finding, plan), apply=None,
                   why=(f"{finding.sentence}; moving load off it leaves {100 * plan.remaining_excess:.0f}% of its "
                        "excess (same waiting as moe_load_balance: fix the routing or the placement)"))


def _placement_candidates(moe: MoeReport) -> list[tuple[MoeFinding, MoeLayerReport, PlacementPlan]]:
    """The hot-expert findings whose ep rank is overloaded, with the placement that relieves it."""
    candidates = []
    for finding in moe.findings:
        layer = layer_report(moe, finding.layer)
        if layer is None or not finding.ranks or (layer.rank_max_over_mean or 0.0) < RANK_OVERLOAD_RATIO:
            continue
        plan = plan_placement(layer.tokens_per_expert, moe.ep, finding.expert)
        if plan is not None:
            candidates.append((finding, layer, plan))
    return candidates


def _placement_change(moe: MoeReport, finding: MoeFinding, plan: PlacementPlan) -> str:
    target = [group[plan.to_ep_rank] for group in moe.ep_groups if plan.to_ep_rank < len(group)]
    where = ranks_text(target) if target else f"ep rank {plan.to_ep_rank}"
    if plan.action == "swap":
        return (f"place expert {finding.expert} on {where} and expert {plan.swap_with} on {ranks_text(finding.ranks)} "
                f"(swap them) in layer {finding.layer}, and alike in each layer where it is as hot")
    return (f"replicate expert {finding.expert} on {where} (a second copy takes half its tokens; its gradients "
            "are averaged over both)")
