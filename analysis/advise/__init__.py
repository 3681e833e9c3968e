"""The advisor: rules that map a run's evidence to a configuration change, each with the numbers it rests on.

Evidence (`Evidence`): medians over the run's steady steps of its step metrics (compare.py: every step but
each rank's first and the profiled ones; per step the slowest rank's value), the trace report (utilization,
straggler causes, critical path) and the run's configuration (job.json). Every rule is one function; a rule
returns a `Finding` or None, and its docstring says when it fires and how it estimates the gain:
  expected_gain_ms   step time the change could save per step, estimated from the trace (an upper bound
                     unless the rule says otherwise); expected_gain_pct = of the median step time;
  confidence         "high": the evidence is direct and the change removes it; "medium": the change usually
                     helps this pattern; "low": worth a try.

Each rule belongs to one family module, which registers it as a `Rule`: evidence -> a change for fleetscope's
trainer (the finding's change and apply) -> the same change in user code (for any other program):
  parallelism    straggler
  input          data_workers
  host           cuda_graphs, host_work, host_syncs
  communication  gradient_buckets
  memory         allocator, memory_pressure
  moe            moe_load_balance, moe_expert_placement, moe_ep_degree
model.py holds what they share, evidence.py reads a run into an Evidence, engine.py runs the families.
"""

from __future__ import annotations

from .communication import BucketPlan, plan_buckets
from .engine import FAMILIES, REGISTRY, RULES, advise, advise_evidence, top_findings
from .evidence import gather_evidence
from .model import Advice, Change, Evidence, Finding, Rule, settings_change
from .moe import ALL_TO_ALL_STEP_SHARE, RANK_OVERLOAD_RATIO, PlacementPlan, plan_placement

__all__ = [
    "ALL_TO_ALL_STEP_SHARE", "FAMILIES", "RANK_OVERLOAD_RATIO", "REGISTRY", "RULES", "Advice", "BucketPlan",
    "Change", "Evidence", "Finding", "PlacementPlan", "Rule", "advise", "advise_evidence", "gather_evidence",
    "plan_buckets", "plan_placement", "settings_change", "top_findings",
]
