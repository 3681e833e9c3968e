"""Two runs side by side: the gate's step metrics (gate.py) beside a trace report's figures.

Each side is a run directory or a report JSON. Two sources of numbers:
  - step metrics (`metrics/rank<R>.jsonl`, the trainer's per-step lines), when both sides are run directories
    that have them: the gate's metrics (gate.py: step_time_ms, tokens_per_s, peak_memory_mb, data_time_ms),
    with its definitions, noise rule and verdict (`compare BASE NEW` on the command line is that gate);
    mfu_pct, the median over every rank's steady steps, is reported, not gated.
  - the trace report (report.json, or analyze() run without writing when a run directory has none):
    trace_step_time_ms (the report's step time: median over profiled steps of the slowest rank, quantities.py),
    busy/idle/comm/overlap percentages (changes in percentage points, not relative).
Runs of different jobs (world size, model, parallel layout, batch, sequence, precision: job_identity.py) are
refused unless allow_different_jobs.

Gates: the gate's step metrics when both sides have them; else, with no steps to bootstrap (a report JSON, a
trace folder), trace_step_time_ms, which regresses (exit code 1) when it rises by at least threshold_pct.
Every other metric is reported, not gated. Exit codes are traces/exit_status.py's (the gate's too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from fleetscope.analysis.analyze import analyze, load_report_json
from fleetscope.analysis.gate import (  # the steady-step readers are re-exported: advise imports them here
    DEFAULT_THRESHOLD_PCT,
    GateResult,
    gate_metrics,
    read_steady_metrics,
    steady_metrics,
    steady_metrics_at,
)
from fleetscope.analysis.job_identity import DifferentJobs, differences_text, identity_differences, job_identity
from fleetscope.analysis.inputs.records import RunRecords, read_run_records
from fleetscope.analysis.quantities import is_share, metrics_basis
from fleetscope.analysis.report.model import Report
from fleetscope.traces.formats import StepRecord
from fleetscope.traces.exit_status import EXIT_OK, EXIT_REGRESSION
from fleetscope.traces.layout import REPORT_DIR, RunLayout
from fleetscope.traces.validate import UsageError, finite

__all__ = ["DEFAULT_THRESHOLD_PCT", "EXIT_OK", "EXIT_REGRESSION", "Comparison", "MetricDelta", "RankDelta", "compare",
           "read_steady_metrics", "steady_metrics", "steady_metrics_at"]


@dataclass(frozen=True, kw_only=True)
class MetricDelta:
    name: str
    base: float | None
    new: float | None
    higher_is_better: bool
    gated: bool
    """Part of the exit decision."""
    delta_pct: float | None = None
    """(new - base) / base * 100; None when a side lacks the metric, or for a percentage metric."""
    delta_points: float | None = None
    """new - base in percentage points, for a percentage metric (`*_pct`, quantities.is_share)."""
    regression: bool = False
    """Gated, and worse by at least the threshold."""


@dataclass(frozen=True, kw_only=True)
class RankDelta:
    rank: int
    base_step_ms: float | None
    new_step_ms: float | None
    delta_pct: float | None


@dataclass(frozen=True, kw_only=True)
class Comparison:
    base_path: str
    new_path: str
    threshold_pct: float
    metrics: list[MetricDelta]
    ranks: list[RankDelta] = field(default_factory=list)
    """Per rank, the trace report's mean step time; only when the trace step time is what is gated."""
    notes: list[str] = field(default_factory=list)
    gate: GateResult | None = None
    """The gate of the step metrics (both sides had them): its verdict is this comparison's."""

    @property
    def regressions(self) -> list[MetricDelta]:
        return [m for m in self.metrics if m.regression]

    @property
    def exit_code(self) -> int:
        if self.gate is not None:
            return self.gate.exit_code
        return EXIT_REGRESSION if self.regressions else EXIT_OK

    @property
    def verdict(self) -> str:
        if self.gate is not None:
            return self.gate.verdict
        if not self.regressions:
            return f"no regression beyond {self.threshold_pct:g}% (trace step time, no noise model)"
        worst = ", ".join(f"{m.name} {m.delta_pct:+.1f}%" for m in self.regressions)
        return f"REGRESSION (threshold {self.threshold_pct:g}%, trace step time, no noise model): {worst}"


@dataclass(frozen=True)
class _Side:
    path: str
    report: Report
    run_dir: Path | None
    """The run directory (None for a report JSON outside one)."""
    steady: dict[int, list[StepRecord]]
    """Rank -> its steady step records (empty when the run has no metrics)."""
    notes: list[str] = field(default_factory=list)
    """Metrics files with bad lines or that could not be read."""
    identity: dict[str, str] = field(default_factory=dict)
    """What job it is (job_identity.py)."""


def compare(base: str | Path, new: str | Path, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
            allow_different_jobs: bool = False) -> Comparison:
    """Compare two runs (run directories or report JSONs); `Comparison.exit_code` is the CI answer. Runs of
    different jobs (job_identity.py) raise DifferentJobs (exit 2) unless `allow_different_jobs`."""
    if not isinstance(threshold_pct, (int, float)) or finite(threshold_pct) is None or threshold_pct <= 0:
        raise UsageError(f"threshold_pct must be a finite number > 0, got {threshold_pct!r}")
    before, after = _load_side(Path(base)), _load_side(Path(new))
    differences = identity_differences([before.identity, after.identity])
    if differences and not allow_different_jobs:
        raise DifferentJobs(differences)
    gated = _step_gate(before, after, threshold_pct)
    metrics = _metric_deltas(before, after, gated, threshold_pct)
    notes = list(gated.notes) if gated is not None else before.notes + after.notes
    notes += [f"{side.path}: partial report (unusable or missing traces)" for side in (before, after)
              if not side.report.complete]
    if gated is None:
        notes.append("step metrics missing on a side: trace step time is the gate (no noise model)")
    if differences:
        notes.append(f"different jobs compared (--allow-different-jobs): {differences_text(differences)}")
    notes.append(_basis_note(before, after, gated is not None))
    ranks = [] if gated is not None else _rank_deltas(before.report, after.report)
    return Comparison(base_path=before.path, new_path=after.path, threshold_pct=threshold_pct,
                      metrics=metrics, ranks=ranks, notes=notes, gate=gated)


def _basis_note(before: _Side, after: _Side, with_metrics: bool) -> str:
    """Where each side's numbers come from (world size, the steps each figure is taken over)."""
    sizes = [side.identity.get("world size", "?") for side in (before, after)]
    steps = (f"step_time_ms: {metrics_basis(before.steady)} -> {metrics_basis(after.steady)}; tokens_per_s: "
             "every rank's tokens of a step over that step time; " if with_metrics else "")
    return (f"world size {sizes[0]} -> {sizes[1]}; {steps}trace_step_time_ms: the report's step time (median, "
            f"{before.report.step_time_basis or 'trace'} -> {after.report.step_time_basis or 'trace'})")


def _step_gate(before: _Side, after: _Side, threshold_pct: float) -> GateResult | None:
    """The gate of one run a side when both have step metrics (environments and jobs: compare's caller)."""
    if not (before.steady and after.steady and before.run_dir and after.run_dir):
        return None
    metrics, notes = gate_metrics([before.run_dir], [after.run_dir], threshold_pct=threshold_pct)
    return GateResult(base_runs=[before.path], new_runs=[after.path], threshold_pct=threshold_pct, metrics=metrics,
                      notes=notes)


def _load_side(path: Path) -> _Side:
    records: RunRecords | None = None
    if path.is_file():
        report = load_report_json(path)
        run_dir = path.parent.parent if path.parent.name == REPORT_DIR else None
    elif path.is_dir():
        layout = RunLayout.at(path)
        records = read_run_records(layout)   # once: the analysis (where there is no report) and the steady steps
        report = (load_report_json(layout.report_json, within=layout.root) if layout.report_json.is_file()
                  else analyze(path, write_default_outputs=False, records=records))
        run_dir = path
    else:
        raise FileNotFoundError(f"{path}: no such run directory or report")
    steady, notes = (read_steady_metrics(records) if records is not None
                     else steady_metrics_at(run_dir) if run_dir is not None else ({}, []))
    return _Side(str(path), report, run_dir, steady, notes, job_identity(run_dir, report.world_size))


def _median_of(lines: list[StepRecord], key: str) -> float | None:
    values = [getattr(m, key) for m in lines if getattr(m, key) is not None]
    return float(np.median(values)) if values else None


def _rank_mean(report: Report, attribute: str) -> float | None:
    values = [getattr(r, attribute) for r in report.ranks if getattr(r, attribute) is not None]
    return float(np.mean(values)) if values else None


def _metric_deltas(before: _Side, after: _Side, gated: GateResult | None, threshold_pct: float) -> list[MetricDelta]:
    deltas = []
    if gated is not None:
        deltas += [_from_gate(m) for m in gated.metrics]  # every one the gate judges: its exit code is ours
        deltas.append(_delta("mfu_pct", _median_all(before, "mfu_pct"), _median_all(after, "mfu_pct"), True, False,
                             threshold_pct))
    trace_step = [s.report.step_time.median_ms if s.report.step_time else None for s in (before, after)]
    rows = [("trace_step_time_ms", *trace_step, False, gated is None)]
    for attribute, higher_is_better in (("busy_pct", True), ("idle_pct", False), ("comm_pct", False),
                                        ("overlap_pct", True)):
        rows.append((attribute, _rank_mean(before.report, attribute), _rank_mean(after.report, attribute),
                     higher_is_better, False))
    return deltas + [_delta(name, b, n, better_up, is_gated, threshold_pct) for name, b, n, better_up, is_gated in rows]


def _from_gate(metric) -> MetricDelta:
    """A gate's metric as a row: its values, change and verdict unchanged."""
    return MetricDelta(name=metric.name, base=metric.base_median, new=metric.new_median,
                       higher_is_better=metric.higher_is_better, gated=metric.gated, delta_pct=metric.change_pct,
                       regression=metric.regression)


def _median_all(side: _Side, key: str) -> float | None:
    return _median_of([m for lines in side.steady.values() for m in lines], key)


def _delta(name: str, base: float | None, new: float | None, higher_is_better: bool, gated: bool,
           threshold_pct: float) -> MetricDelta:
    if base is not None and new is not None and is_share(name):
        return MetricDelta(name=name, base=base, new=new, higher_is_better=higher_is_better, gated=gated,
                           delta_points=new - base)
    if base is None or new is None or base == 0:
        return MetricDelta(name=name, base=base, new=new, higher_is_better=higher_is_better, gated=gated)
    change_pct = 100.0 * (new - base) / abs(base)
    worse_pct = -change_pct if higher_is_better else change_pct
    return MetricDelta(name=name, base=base, new=new, higher_is_better=higher_is_better, gated=gated,
                       delta_pct=change_pct, regression=gated and worse_pct >= threshold_pct)


def _rank_deltas(before: Report, after: Report) -> list[RankDelta]:
    base = {r.rank: r.step_time.mean_ms for r in before.ranks if r.step_time}
    new = {r.rank: r.step_time.mean_ms for r in after.ranks if r.step_time}
    deltas = []
    for rank in sorted(set(base) | set(new)):
        b, n = base.get(rank), new.get(rank)
        pct = 100.0 * (n - b) / b if b and n is not None else None
        deltas.append(RankDelta(rank=rank, base_step_ms=b, new_step_ms=n, delta_pct=pct))
    return deltas
