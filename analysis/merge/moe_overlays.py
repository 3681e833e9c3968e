"""The MoE part of the merge's overlays (pure planning data): per rank, counters of the tokens each of
its local experts received per step, and hot-expert marks on the `fleetscope analysis` track.

  * counters `tokens: expert <E>` (one per local expert, global ids): token copies that expert received
    in the step, every MoE layer summed, from the MoE records of the rank's whole ep group
    (metrics/rank<R>.moe.jsonl: each rank records what its router sent to every expert); one sample at
    each step's start; with ep = 1 every expert is local;
  * marks `hot expert <E> (layer L)`: the analysis report's MoE findings (report.moe.findings) that name
    this rank among the expert's holders, or every rank without expert parallelism; annotated with the
    finding's sentence, tokens_vs_mean and cost_ms_per_step, at the rank's first step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetscope.traces.formats import MoeRecord

from fleetscope.analysis.cross_rank.moe import MoeFinding, moe_records_noted
from fleetscope.analysis.inputs.records import RunRecords

if TYPE_CHECKING:
    from fleetscope.analysis.report.model import Report

MOE_CATEGORY = "fleetscope.moe"
EXPERT_COUNTER_PREFIX = "tokens: expert "


@dataclass(kw_only=True)
class MoeMergeView:
    """What the merge draws for one rank."""

    expert_tokens: dict[int, dict[int, float]] = field(default_factory=dict)
    """step -> local expert (global id) -> token copies it received in that step."""
    findings: list[MoeFinding] = field(default_factory=list)
    """The report's MoE findings about this rank."""

    def counters(self, ranges: list[tuple[int, int, int]]) -> list[tuple[tuple, str, list[tuple[int, float]]]]:
        """(counter track key, unit, samples at step starts) per local expert, for the drawn steps."""
        samples: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for step, start_ns, _ in ranges:
            for expert, tokens in sorted(self.expert_tokens.get(step, {}).items()):
                samples[expert].append((start_ns, tokens))
        return [(("counter", "fleetscope", f"{EXPERT_COUNTER_PREFIX}{expert}"), "tokens", values)
                for expert, values in sorted(samples.items())]

    def marks(self, anchor_ns: int | None) -> list[tuple[int, str, dict]]:
        if anchor_ns is None:
            return []
        return [(anchor_ns, f"hot expert {f.expert} (layer {f.layer})", _finding_notes(f)) for f in self.findings]


def _finding_notes(finding: MoeFinding) -> dict:
    """A hot-expert mark's annotations: the finding's sentence and figures that it has."""
    figures = {"sentence": finding.sentence, "tokens_vs_mean": finding.tokens_vs_mean,
               "cost_ms_per_step": finding.cost_ms_per_step, "holder_last_pct": finding.holder_last_pct}
    return {name: value for name, value in figures.items() if value is not None}


def moe_merge_views(run: RunRecords | None, report: "Report | None", ranks: list[int]) -> dict[int, MoeMergeView]:
    """rank -> its MoE overlay data; empty for runs without MoE records or findings (`run` None: a folder of
    traces). The files' notes are the report's (analyze names them), not the merge's."""
    records = moe_records_noted(run.layout, run.moe, ranks)[0] if run is not None else []
    findings = _findings(report)
    views = {}
    for rank in ranks:
        view = MoeMergeView(expert_tokens=_local_expert_tokens(records, rank), findings=_rank_findings(findings, rank))
        if view.expert_tokens or view.findings:
            views[rank] = view
    return views


def _local_expert_tokens(records: list[MoeRecord], rank: int) -> dict[int, dict[int, float]]:
    mine = [r for r in records if r.rank == rank]
    if not mine:
        return {}
    own = mine[0]
    experts = len(own.tokens_per_expert)
    local = experts // max(own.ep, 1)
    slice_ = range(own.ep_rank * local, (own.ep_rank + 1) * local) if own.ep > 1 else range(experts)
    group = set(own.ep_ranks) if own.ep > 1 else {rank}
    tokens: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for record in records:
        if record.rank in group:
            for expert in slice_:
                tokens[record.step][expert] += record.tokens_per_expert[expert]
    return {step: dict(per_expert) for step, per_expert in tokens.items()}


def _findings(report: "Report | None") -> tuple[int, list[MoeFinding]]:
    if report is None or report.moe is None:
        return 1, []
    return report.moe.ep, report.moe.findings


def _rank_findings(findings: tuple[int, list[MoeFinding]], rank: int) -> list[MoeFinding]:
    ep, found = findings
    return [f for f in found if ep <= 1 or rank in f.ranks]
