"""Which files a merge writes and which ranks each draws in full (pure planning, no I/O).

  * default: ONE file, the focus set in full (focus.py) and, when it leaves ranks out, a summary of
    every rank (summary.py); when every rank fits the budget, the file is that of `--ranks all`;
  * `MergeOptions.ranks`: one file of those ranks in full, no summary;
  * `MergeOptions.focus=None` (`--ranks all`): one file of every rank in full, no summary;
  * `MergeOptions.shard_ranks=N`: every rank in full, N ranks per file named
    `<stem>.ranks<first>-<last>.perfetto-trace` (first and last rank of the shard), plus
    `<stem>.summary.perfetto-trace` with the summary of every rank; all on the same clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from fleetscope.analysis.merge.focus import (
    FULL_BYTES_PER_EVENT,
    FocusConfig,
    FocusPlan,
    NamedRank,
    RankFacts,
    all_fit,
    fallback_named,
    plan_focus,
    rank_median_step_ms,
)
from fleetscope.analysis.merge.report_view import report_groups, report_named_ranks
from fleetscope.analysis.merge.sources import MergeInputs, RankSource
from fleetscope.analysis.merge.stages import noted
from fleetscope.analysis.merge.summary import estimated_summary_bytes

if TYPE_CHECKING:
    from fleetscope.analysis.report.model import Report

PERFETTO_SUFFIX = ".perfetto-trace"
SUMMARY_ONLY_NOTE = "summary only: not in the focus set (fleetscope merge --ranks all or --shard-ranks N draws it)"


@dataclass(frozen=True, kw_only=True)
class PlannedOutput:
    path: Path
    sources: list[RankSource]
    """Ranks drawn in full, in rank order."""
    summary_of: list[RankSource] = field(default_factory=list)
    """Ranks summarized (every rank, or none)."""
    notes: dict[int, str] = field(default_factory=dict)
    """rank -> where it is drawn in full and why (the description of its summary group)."""


def planned_outputs(inputs: MergeInputs, destination: Path, options, focus: FocusPlan | None) -> list[PlannedOutput]:
    """The files of one merge, in writing order (the module docstring); `options` is a MergeOptions."""
    if options.ranks is not None:
        return [PlannedOutput(path=destination, sources=select_ranks(inputs, options.ranks))]
    if options.shard_ranks is not None:
        return _sharded(inputs.ranks, destination, options.shard_ranks)
    if focus is None or not focus.left_out:
        return [PlannedOutput(path=destination, sources=list(inputs.ranks))]
    reasons = {choice.rank: choice.reasons for choice in focus.chosen}
    notes = {s.rank: f"drawn in full in this file: {'; '.join(reasons[s.rank])}" if s.rank in reasons
             else SUMMARY_ONLY_NOTE for s in inputs.ranks}
    return [PlannedOutput(path=destination, sources=[s for s in inputs.ranks if s.rank in reasons],
                          summary_of=list(inputs.ranks), notes=notes)]


def select_ranks(inputs: MergeInputs, ranks: frozenset[int]) -> list[RankSource]:
    available = {source.rank for source in inputs.ranks}
    unknown = sorted(set(ranks) - available)
    if unknown:
        raise ValueError(f"ranks {unknown} not found under {inputs.root} (available: {sorted(available)})")
    return [source for source in inputs.ranks if source.rank in ranks]


def shard_path(destination: Path, first: int, last: int) -> Path:
    return destination.with_name(f"{_stem(destination)}.ranks{first}-{last}{PERFETTO_SUFFIX}")


def summary_path(destination: Path) -> Path:
    return destination.with_name(f"{_stem(destination)}.summary{PERFETTO_SUFFIX}")


def _stem(destination: Path) -> str:
    name = destination.name
    return name[:-len(PERFETTO_SUFFIX)] if name.endswith(PERFETTO_SUFFIX) and len(name) > len(PERFETTO_SUFFIX) \
        else destination.stem


def _sharded(sources: list[RankSource], destination: Path, per_file: int) -> list[PlannedOutput]:
    shards = [sources[i:i + per_file] for i in range(0, len(sources), per_file)]
    outputs = [PlannedOutput(path=shard_path(destination, chunk[0].rank, chunk[-1].rank), sources=chunk)
               for chunk in shards]
    notes = {s.rank: f"drawn in full in {out.path.name}" for out in outputs for s in out.sources}
    return outputs + [PlannedOutput(path=summary_path(destination), sources=[], summary_of=list(sources), notes=notes)]


def plan_merge_focus(inputs: MergeInputs, report: "Report | None", config: FocusConfig,
                     analysis: "Callable[[], Report | None] | None" = None) -> FocusPlan:
    """The focus set of `inputs`, from the report's findings and the per-rank parse. Without a report,
    from `analysis()`'s (the cross-rank stages run by the merge, stages.py; called only when not every rank
    fits the budget), each reason saying so; without either, the rank with the slowest median step."""
    facts = [rank_facts(source) for source in inputs.ranks]
    summary_bytes = sum(estimated_summary_bytes(f.model for f in s.files) for s in inputs.ranks)
    if report is not None:
        named = [NamedRank(rank=rank, reason=reason) for rank, reason in report_named_ranks(report)]
    else:
        own = analysis() if analysis is not None and not all_fit(facts, summary_bytes, config) else None
        named = [NamedRank(rank=rank, reason=noted(reason)) for rank, reason in report_named_ranks(own)]
        named = named or fallback_named(facts)
        report = own
    return plan_focus(facts, named, groups=merge_groups(inputs.ranks, report), config=config,
                      summary_bytes=summary_bytes)


def rank_facts(source: RankSource) -> RankFacts:
    models = [f.model for f in source.files]
    return RankFacts(rank=source.rank, host=source.host,
                     estimated_bytes=FULL_BYTES_PER_EVENT * sum(m.event_count for m in models),
                     median_step_ms=rank_median_step_ms((end - start) / 1000.0 for m in models
                                                        for _, start, end in m.steps))


def merge_groups(sources: list[RankSource], report: "Report | None") -> dict[str, list[int]]:
    """Process group label -> members: the groups the ranks' collectives name, and the report's."""
    groups: dict[str, set[int]] = {}
    for source in sources:
        for model in (f.model for f in source.files):
            for label in model.groups:
                groups.setdefault(label, set()).add(source.rank)
    for label, members in report_groups(report).items():
        groups.setdefault(f"{label} (hang view)", set()).update(members)
    return {label: sorted(members) for label, members in groups.items()}
