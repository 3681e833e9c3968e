"""The MoE family: routing that overloads an expert, where the experts live, and how many ranks share them."""

from __future__ import annotations

from ..model import Rule
from .balance import moe_load_balance
from .ep_degree import ALL_TO_ALL_STEP_SHARE, moe_ep_degree
from .placement import RANK_OVERLOAD_RATIO, PlacementPlan, moe_expert_placement, plan_placement

RULES = (
    Rule(find=moe_load_balance, recovers="expert imbalance",
         in_user_code="a load-balancing loss on the router (or a capacity factor) so tokens spread evenly"),
    Rule(find=moe_expert_placement, recovers="expert imbalance",
         change_is_code="no trainer option places experts: the finding's change is already an action"),
    Rule(find=moe_ep_degree, recovers="all-to-all exchange",
         in_user_code="a smaller expert-parallel degree, or expert groups inside one node"),
)

__all__ = ["ALL_TO_ALL_STEP_SHARE", "RANK_OVERLOAD_RATIO", "RULES", "PlacementPlan", "moe_ep_degree",
           "moe_expert_placement", "moe_load_balance", "plan_placement"]
