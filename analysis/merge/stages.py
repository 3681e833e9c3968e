"""The cross-rank stages a merge runs itself when it has no analysis report of its traces.

They are analyze's (report/build.py: collective matching, clock alignment, arrivals, stragglers, causes,
critical path; the MoE view from the run's routing records; the hang view of a run directory), run on the
per-rank results the merge's own parse gave (MergeInputs.parsed: no trace is read twice) and the run's
records as read once (MergeInputs.records: no record file is read here), without HTA's
views, which the focus set does not read. Their report names the focus set's ranks the way a report on
disk does (report_view.report_named_ranks); each reason then says where it came from
(STAGES_NOTE). A merge whose every rank fits its budget never runs them: the focus set is every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetscope.analysis.merge.sources import MergeInputs

if TYPE_CHECKING:
    from fleetscope.analysis.report.model import Report

STAGES_NOTE = "cross-rank stages run by merge"


def merge_analysis(inputs: MergeInputs) -> "Report | None":
    """The report of `inputs`' per-rank results; None without results."""
    # imported here: the merge's worker processes, and a merge that has a report, never load these stages
    from fleetscope.analysis.cross_rank.capture import capture_section
    from fleetscope.analysis.cross_rank.moe import moe_records_noted
    from fleetscope.analysis.report.build import build_report, no_hta

    parsed = inputs.parsed
    if parsed is None or not parsed.results:
        return None
    ranks = list(range(parsed.world_size)) if parsed.world_size else sorted({r.rank for r in parsed.results})
    run = inputs.records
    moe_records = moe_records_noted(run.layout, run.moe, ranks)[0] if run is not None else []
    report = build_report(source_path=str(inputs.root), source_kind=parsed.source_kind, results=parsed.results,
                          failures=[], missing=[], world_size=parsed.world_size, notes=[], hta=no_hta,
                          measured_offsets=parsed.measured_offsets, moe_records=moe_records)
    report.capture = capture_section(run, parsed.world_size)
    return report


def noted(reason: str) -> str:
    """A focus reason found by these stages, saying so."""
    return f"{reason} ({STAGES_NOTE})"
