"""The engine: every family's rules over a run's evidence, each change in the terms of the program that ran,
the findings that recover the same time marked, and what they gain together bounded by the step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from fleetscope.analysis.cross_rank.outcome import OUTCOME_PROBLEM_LABEL
from fleetscope.analysis.analyze import analyze, load_report_json
from fleetscope.analysis.inputs.records import RunRecords, read_run_records
from fleetscope.analysis.invariants import audit, auditing, check_advice
from fleetscope.analysis.quantities import bounded_gain
from fleetscope.analysis.render.advice_terminal import gain_text
from fleetscope.analysis.report.model import Report, TopFinding
from fleetscope.traces.layout import RunLayout

# the families as modules (`from . import host` would import this package, which imports this module)
import fleetscope.analysis.advise.communication as communication
import fleetscope.analysis.advise.gpu_work as gpu_work
import fleetscope.analysis.advise.host as host
import fleetscope.analysis.advise.input as data_input  # the alias leaves the builtin input() alone
import fleetscope.analysis.advise.memory as memory
import fleetscope.analysis.advise.moe as moe
import fleetscope.analysis.advise.parallelism as parallelism

from .evidence import gather_evidence
from .model import Advice, Evidence, Finding, Rule, profiled_scale

FAMILIES = (parallelism, data_input, host, gpu_work, communication, memory, moe)
"""The rule families, in the order their rules run (findings of equal gain keep it)."""
REGISTRY: tuple[Rule, ...] = tuple(rule for family in FAMILIES for rule in family.RULES)
RULES: tuple[Callable[[Evidence], Finding | None], ...] = tuple(rule.find for rule in REGISTRY)
"""Every rule the engine runs, in that order."""
TRAINER_SETTINGS_IN_EVIDENCE = ("compile", "num_workers", "bucket_cap_mb")
"""Evidence that names a setting of fleetscope's trainer: left out where another program ran."""
TOP_FINDINGS = 3


def advise_evidence(evidence: Evidence, run: str = "") -> Advice:
    found = ((rule, rule.find(evidence)) for rule in REGISTRY)
    findings = [_in_program_terms(_with_basis(f, rule, evidence), rule, evidence) for rule, f in found if f is not None]
    findings = _mark_overlaps(findings)
    findings.sort(key=lambda f: -(f.expected_gain_ms if f.expected_gain_ms is not None else -1.0))
    combined = _combined_gain(findings, evidence)
    return Advice(run=run, findings=findings, combined_gain_ms=combined.ms if combined else None,
                  combined_gain_of_ms=combined.of_ms if combined else None,
                  combined_gain_basis=combined.basis if combined else "")


def _in_program_terms(finding: Finding, rule: Rule, e: Evidence) -> Finding:
    """For a program other than fleetscope's trainer: the rule's change in user code, nothing `tune` could apply."""
    if not e.program:
        return finding
    evidence = {k: v for k, v in finding.evidence.items() if k not in TRAINER_SETTINGS_IN_EVIDENCE}
    return dataclasses.replace(finding, change=rule.change_in_user_code(finding), apply=None,
                               evidence={**evidence, "program": e.program})


def _with_basis(finding: Finding, rule: Rule, e: Evidence) -> Finding:
    """The time the change recovers, and the denominator of a rule's percentage where the rule took it from
    the run's step time (model.step_gain)."""
    changes: dict[str, Any] = {}
    if not finding.recovers:
        changes["recovers"] = rule.recovers or finding.rule
    if finding.expected_gain_pct is not None and finding.gain_of_ms is None:
        changes.update(gain_of_ms=e.step_ms, gain_basis=e.step_basis)
    return dataclasses.replace(finding, **changes) if changes else finding


def _mark_overlaps(findings: list[Finding]) -> list[Finding]:
    """Findings that recover the same time name each other: their gains are not additive."""
    by_time: dict[str, list[str]] = {}
    for f in findings:
        by_time.setdefault(f.recovers, []).append(f.rule)
    return [dataclasses.replace(f, overlaps=[r for r in by_time[f.recovers] if r != f.rule]) for f in findings]


def _combined_gain(findings: list[Finding], e: Evidence):
    """Per recovered time the largest gain (as a share of its own step), summed, against the run's step time;
    never more than the step."""
    best: dict[str, float] = {}
    for f in findings:
        if f.expected_gain_pct is not None:
            best[f.recovers] = max(best.get(f.recovers, 0.0), f.expected_gain_pct)
    if not best or not e.step_ms:
        return None
    return bounded_gain(e.step_ms * sum(best.values()) / 100.0, e.step_ms, e.step_basis)


def advise(path: str | Path) -> Advice:
    """The advice for a run directory (its report.json, else an analysis of its traces), a directory of traces
    or one trace file (what `analyze` accepts: every trace-based rule applies; step metrics and settings
    only where a run directory has them)."""
    source = Path(path)
    layout = RunLayout.at(source if source.is_dir() else source.parent)
    if not source.exists():
        raise FileNotFoundError(f"{path}: no such run directory, trace directory or trace file")
    records = read_run_records(layout)   # once: the analysis (where there is no report) and the step metrics
    notes = []
    report = None
    if source.is_dir() and layout.report_json.is_file():
        report = load_report_json(layout.report_json, within=layout.root)
    else:
        try:
            report = analyze(source, write_default_outputs=False, use_hta=False,
                             records=records if source.is_dir() else None)
        except (FileNotFoundError, ValueError) as error:
            notes.append(f"no traces analyzed ({error}): advice from step metrics and configuration only")
    unread = [p for p in report.problems if p.label != OUTCOME_PROBLEM_LABEL] if report is not None else []
    if report is not None and report.outcome is not None and not report.outcome.completed:
        notes.append(f"{report.outcome.sentence} The advice rests on the profiled steps before it.")
    if unread:
        notes.append(f"{len(unread)} trace(s) could not be used, so the advice rests on the rest"
                     + ("" if report.analyzed_ranks else " (none was: there is nothing to advise from the traces)")
                     + ": " + "; ".join(f"{p.label}: {p.reason}" for p in unread[:3])
                     + (" ..." if len(unread) > 3 else ""))
    evidence = gather_evidence(records, report)
    if evidence.step_ms is None:
        notes.append("no step time (no steady step metrics, no profiled steps in the traces): gains are not "
                     "estimated as a share of the step")
    elif evidence.step_basis.startswith("trace"):
        notes.append(f"no steady step metrics: step time from the traces ({evidence.step_basis})")
    elif (scale := profiled_scale(evidence)) != 1.0:
        notes.append(f"gains measured in the trace are scaled to the steady step: the profiled steps take "
                     f"{evidence.profiled_step_ms:.2f} ms, the steady ones {evidence.step_ms:.2f} ms "
                     f"({evidence.step_basis}; " + ("profiling lengthens a step)" if scale < 1.0
                                                     else "the steps ran longer unprofiled)"))
    advice = dataclasses.replace(advise_evidence(evidence, str(path)), notes=notes,
                                 complete=report is None or not report.problems)
    if auditing():
        audit("advice", path, check_advice(advice, report))
    return advice


def top_findings(records: RunRecords, report: Report) -> list[TopFinding]:
    """The advice the report shows next to its verdict: the same findings `advise` gives, largest gain first, from
    the records the analysis read (nothing is read again)."""
    advice = advise_evidence(gather_evidence(records, report), str(records.layout.root))
    return [TopFinding(rule=f.rule, title=f.title, gain=gain_text(f), change=f.change, confidence=f.confidence,
                       ranks=list(f.ranks), windows=list(f.windows), overlaps=list(f.overlaps))
            for f in advice.findings[:TOP_FINDINGS]]
