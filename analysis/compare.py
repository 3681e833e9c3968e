"""Regression check between two runs: per-metric deltas and an exit decision for CI.

Each side is a run directory or a report JSON. Two sources of numbers:
  - step metrics (`metrics/rank<R>.jsonl`, the trainer's per-step lines), over steady steps: every step
    except each rank's first (start-up) and those recorded inside a profiler window (profiler overhead).
    throughput_tokens_per_s = the sum over ranks of each rank's median tokens/s;
    step_time_ms = the median over steady steps of the slowest rank's step time (quantities.py).
  - the trace report (report.json, or analyze() run without writing when a run directory has none):
    trace_step_time_ms (the report's step time: median over profiled steps of the slowest rank, quantities.py),
    busy/idle/comm/overlap percentages (changes in percentage points, not relative).
Runs of different jobs (world size, model, parallel layout, batch, sequence, precision: job_identity.py) are
refused unless allow_different_jobs.

The run regresses (exit code 1) when throughput drops, or step time rises, by at least threshold_pct.
Gates: throughput_tokens_per_s and step_time_ms when both sides have step metrics, else
trace_step_time_ms. Every other metric is reported, not gated.

Step metrics are compared over the ranks both sides have (a rank whose file is unreadable, or whose lines
are all bad, would otherwise lower one side's summed throughput: a false regression); every metrics file
with bad lines, and every rank left out, is named in the notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from fleetscope.analysis.analyze import analyze, load_report_json
from fleetscope.analysis.job_identity import DifferentJobs, differences_text, identity_differences, job_identity
from fleetscope.analysis.quantities import is_share, metrics_basis, metrics_step_time_ms, steady_step_records
from fleetscope.analysis.report.model import Report
from fleetscope.traces.formats import read_metric_records
from fleetscope.traces.layout import REPORT_DIR, STEP_METRICS_RE, RunLayout
from fleetscope.traces.validate import UsageError

DEFAULT_THRESHOLD_PCT = 5.0
EXIT_OK = 0
EXIT_REGRESSION = 1


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
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[MetricDelta]:
        return [m for m in self.metrics if m.regression]

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSION if self.regressions else EXIT_OK

    @property
    def verdict(self) -> str:
        if not self.regressions:
            return f"no regression beyond {self.threshold_pct:g}%"
        worst = ", ".join(f"{m.name} {m.delta_pct:+.1f}%" for m in self.regressions)
        return f"REGRESSION (threshold {self.threshold_pct:g}%): {worst}"


@dataclass(frozen=True)
class _Side:
    path: str
    report: Report
    steady: dict[int, list[dict]]
    """Rank -> its steady step-metric lines (empty when the run has no metrics)."""
    notes: list[str] = field(default_factory=list)
    """Metrics files with bad lines or that could not be read."""
    identity: dict[str, str] = field(default_factory=dict)
    """What job it is (job_identity.py)."""


def compare(base: str | Path, new: str | Path, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
            allow_different_jobs: bool = False) -> Comparison:
    """Compare two runs (run directories or report JSONs); `Comparison.exit_code` is the CI answer. Runs of
    different jobs (job_identity.py) raise DifferentJobs (exit 2) unless `allow_different_jobs`."""
    if not isinstance(threshold_pct, (int, float)) or not math.isfinite(threshold_pct) or threshold_pct <= 0:
        raise UsageError(f"threshold_pct must be a finite number > 0, got {threshold_pct!r}")
    before, after = _load_side(Path(base)), _load_side(Path(new))
    differences = identity_differences([before.identity, after.identity])
    if differences and not allow_different_jobs:
        raise DifferentJobs(differences)
    before, after, rank_notes = _common_ranks(before, after)
    with_metrics = bool(before.steady) and bool(after.steady)
    metrics = _metric_deltas(before, after, with_metrics, threshold_pct)
    notes = before.notes + after.notes + rank_notes
    notes += [f"{side.path}: partial report (unusable or missing traces)" for side in (before, after)
              if not side.report.complete]
    if not with_metrics:
        notes.append("step metrics missing on a side: trace step time is the gate")
    if differences:
        notes.append(f"different jobs compared (--allow-different-jobs): {differences_text(differences)}")
    sizes = [side.identity.get("world size", "?") for side in (before, after)]
    notes.append(f"world size {sizes[0]} -> {sizes[1]}; step_time_ms: {metrics_basis(before.steady)} -> "
                 f"{metrics_basis(after.steady)}; trace_step_time_ms: the report's step time (median, "
                 f"{before.report.step_time_basis or 'trace'} -> {after.report.step_time_basis or 'trace'})")
    return Comparison(base_path=before.path, new_path=after.path, threshold_pct=threshold_pct,
                      metrics=metrics, ranks=_rank_deltas(before.report, after.report), notes=notes)


def _common_ranks(before: _Side, after: _Side) -> tuple[_Side, _Side, list[str]]:
    """Both sides' step metrics over the ranks they share, and a note naming the ranks left out."""
    if not before.steady or not after.steady or set(before.steady) == set(after.steady):
        return before, after, []
    shared = set(before.steady) & set(after.steady)
    notes = [f"{side.path}: step metrics of rank(s) {_ranks_text(sorted(set(side.steady) - shared))} have no "
             "counterpart on the other side: not compared" for side in (before, after) if set(side.steady) - shared]
    notes.append(f"step metrics compared over the {len(shared)} rank(s) both sides have")
    return (replace(before, steady={r: v for r, v in before.steady.items() if r in shared}),
            replace(after, steady={r: v for r, v in after.steady.items() if r in shared}), notes)


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")


def _load_side(path: Path) -> _Side:
    if path.is_file():
        report = load_report_json(path)
        run_dir = path.parent.parent if path.parent.name == REPORT_DIR else None
    elif path.is_dir():
        layout = RunLayout.at(path)
        report = (load_report_json(layout.report_json, within=layout.root) if layout.report_json.is_file()
                  else analyze(path, write_default_outputs=False))
        run_dir = path
    else:
        raise FileNotFoundError(f"{path}: no such run directory or report")
    steady, notes = read_steady_metrics(RunLayout.at(run_dir)) if run_dir is not None else ({}, [])
    return _Side(str(path), report, steady, notes, job_identity(run_dir, report.world_size))




def steady_metrics(layout: RunLayout) -> dict[int, list[dict]]:
    """Rank -> its steady step records (the one rule of which steps count: module docstring)."""
    return read_steady_metrics(layout)[0]


def read_steady_metrics(layout: RunLayout) -> tuple[dict[int, list[dict]], list[str]]:
    steady, notes = {}, []
    for path in layout.step_metrics_files():
        match = STEP_METRICS_RE.match(path.name)  # the file name, not its lines, says whose metrics they are
        try:
            read = read_metric_records(path, within=layout.root)
        except ValueError as error:  # the safe reader's refusal (a FIFO, a symlink out, too large)
            notes.append(f"{layout.relative(path)}: not read: {getattr(error, 'reason', error)}")
            continue
        if read.bad_line_count:
            first = "; ".join(f"line {n}: {why}" for n, why in read.bad_lines[:3])
            notes.append(f"{layout.relative(path)}: {read.bad_line_count} bad line(s) skipped ({first})")
        lines = read.records
        if not lines:
            continue
        kept = steady_step_records(lines)
        if kept:
            steady[int(match.group(1))] = kept
    return steady, notes


def _median_of(lines: list[dict], key: str) -> float | None:
    values = [m[key] for m in lines if type(m.get(key)) in (int, float) and math.isfinite(m[key])]
    return float(np.median(values)) if values else None


def _throughput(side: _Side) -> float | None:
    per_rank = [_median_of(lines, "tokens_per_s") for lines in side.steady.values()]
    return float(sum(per_rank)) if per_rank and None not in per_rank else None


def _step_time(side: _Side) -> float | None:
    """The run's step time from step metrics (quantities.py): median over steady steps of the slowest rank."""
    return metrics_step_time_ms(side.steady)


def _rank_mean(report: Report, attribute: str) -> float | None:
    values = [getattr(r, attribute) for r in report.ranks if getattr(r, attribute) is not None]
    return float(np.mean(values)) if values else None


def _metric_deltas(before: _Side, after: _Side, with_metrics: bool, threshold_pct: float) -> list[MetricDelta]:
    rows = []
    if with_metrics:
        rows += [
            ("throughput_tokens_per_s", _throughput(before), _throughput(after), True, True),
            ("step_time_ms", _step_time(before), _step_time(after), False, True),
            ("mfu_pct", _median_all(before, "mfu_pct"), _median_all(after, "mfu_pct"), True, False),
        ]
    trace_step = [s.report.step_time.median_ms if s.report.step_time else None for s in (before, after)]
    rows.append(("trace_step_time_ms", *trace_step, False, not with_metrics))
    for attribute, higher_is_better in (("busy_pct", True), ("idle_pct", False), ("comm_pct", False),
                                        ("overlap_pct", True)):
        rows.append((attribute, _rank_mean(before.report, attribute), _rank_mean(after.report, attribute),
                     higher_is_better, False))
    return [_delta(name, b, n, better_up, gated, threshold_pct) for name, b, n, better_up, gated in rows]


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
