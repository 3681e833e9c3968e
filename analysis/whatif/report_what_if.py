"""The report's what-if: each straggler finding's steps replayed through the trace model (trace_model.py) as
recorded and with the finding's rank's compute at its peers' lower median; the measured step less what the
second replay saves (analysis/quantities.py "what-if"), from the window's
results the report already parsed, placed and matched. A step the model cannot hold keeps the arithmetic
what-if of causes.py, labelled with why."""

from __future__ import annotations

import dataclasses

from fleetscope.analysis.cross_rank.causes import CauseAnalysis, StepWhatIf, StragglerCause, explain
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.analysis.quantities import (WHAT_IF_ARITHMETIC, WHAT_IF_REPLAYED, bounded_what_if_ms,
                                           replayed_what_if_ms)

from .trace_model import StepModel, model_window
from .trace_whatif import rank_saving_ms

NOT_IN_EVERY_RANK = "not every rank of the window profiled the step"


def with_replayed_what_ifs(causes: CauseAnalysis, window: int | None, results: list[RankResult]) -> CauseAnalysis:
    """`causes` with each finding's per-step what-if replayed where the model holds the step (module docstring);
    `results`: the window's, their collectives matched across ranks."""
    wanted = {w.step for f in causes.findings for w in f.what_if}
    if not wanted:
        return causes
    models, why_not = _step_models(window, results, wanted)
    findings = [_replayed(finding, models, why_not) for finding in causes.findings]
    return dataclasses.replace(causes, findings=findings)


def _step_models(window: int | None, results: list[RankResult],
                 wanted: set[int]) -> tuple[dict[int, StepModel], dict[int, str]]:
    """step -> its model, and step -> why it has none."""
    modeled, skipped = model_window(window, results, wanted)
    models = {model.step: model for model in modeled}
    return models, {step: skipped.get(step, NOT_IN_EVERY_RANK) for step in wanted if step not in models}


def _replayed(finding: StragglerCause, models: dict[int, StepModel], why_not: dict[int, str]) -> StragglerCause:
    what_if = [_replayed_step(finding.rank, step, models.get(step.step), why_not.get(step.step, ""))
               for step in finding.what_if]
    replaced = dataclasses.replace(finding, what_if=what_if)
    return dataclasses.replace(replaced, explanation=explain(replaced))


def _replayed_step(rank: int, step: StepWhatIf, model: StepModel | None, why_not: str) -> StepWhatIf:
    if model is None or rank not in model.ranks:
        return dataclasses.replace(step, basis=WHAT_IF_ARITHMETIC, not_replayed=why_not or NOT_IN_EVERY_RANK)
    projected = bounded_what_if_ms(replayed_what_if_ms(step.step_time_ms, rank_saving_ms(model, rank)),
                                   step.step_time_ms, step.floor_ms)
    return dataclasses.replace(step, basis=WHAT_IF_REPLAYED, not_replayed="", projected_step_ms=projected)
