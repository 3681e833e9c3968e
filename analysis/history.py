"""The gated metrics of every run under a directory, by date, each run gated against the ones before it.

A run is a directory with a job.json or step metrics, found at any depth below the root (its subfolders
are not searched further). Its date: job.json `started_at`, else `created_at`, else the newest metrics file's
modification time. Each run's values are the gate's for a side of that one run (gate.py: medians of its
steady steps, tokens/s over the step time). A run is marked as a regression of a metric when gate.py, with
the up to BASELINE_RUNS runs of the same job before it as base (job_identity.py: world size, model, parallel
layout, batch, sequence, precision), finds one; a run whose job differs from every earlier one is gated
against nothing and says so (`job_note`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from fleetscope.analysis.gate import (DEFAULT_SEED, DEFAULT_THRESHOLD_PCT, GATED, gate, read_run_metrics, run_values,
                                     step_samples)
from fleetscope.analysis.job_identity import differences_text, identity_differences, job_identity
from fleetscope.traces.jobfile import read_job_record
from fleetscope.traces.layout import RunLayout

BASELINE_RUNS = 3
"""A run is gated against up to this many runs before it."""


@dataclass(frozen=True, kw_only=True)
class HistoryRun:
    path: str
    date: str
    """ISO 8601 UTC."""
    medians: dict[str, float] = field(default_factory=dict)
    """Gated metric -> median over the run's steady steps."""
    regressions: list[str] = field(default_factory=list)
    """Gated metrics where this run regresses against the runs of its job before it."""
    job_note: str = ""
    """Set when no earlier run is the same job: what differs from the run before it."""


@dataclass(frozen=True, kw_only=True)
class History:
    root: str
    threshold_pct: float
    runs: list[HistoryRun] = field(default_factory=list)
    """Oldest first."""
    metrics: list[str] = field(default_factory=lambda: [m.name for m in GATED])
    units: dict[str, str] = field(default_factory=lambda: {m.name: m.unit for m in GATED})
    higher_is_better: dict[str, bool] = field(default_factory=lambda: {m.name: m.higher_is_better for m in GATED})


def find_runs(root: Path) -> list[Path]:
    """Run directories at any depth under `root` (module docstring)."""
    if _is_run(root):
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        found += [child] if _is_run(child) else find_runs(child)
    return found


def _is_run(path: Path) -> bool:
    layout = RunLayout.at(path)
    return layout.job_file.is_file() or any(layout.metrics_dir.glob("rank*.jsonl"))


def run_date(run: Path) -> str:
    record = read_job_record(RunLayout.at(run))
    for key in ("started_at", "created_at"):
        if isinstance(record.get(key), str):
            return record[key]
    files = list(RunLayout.at(run).metrics_dir.glob("rank*.jsonl")) or [RunLayout.at(run).job_file]
    newest = max((f.stat().st_mtime for f in files if f.exists()), default=0.0)
    return datetime.fromtimestamp(newest, timezone.utc).isoformat(timespec="seconds")


def history(root: str | Path, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT, seed: int = DEFAULT_SEED) -> History:
    runs = sorted(find_runs(Path(root)), key=lambda r: (run_date(r), str(r)))
    entries = []
    identities = [job_identity(run) for run in runs]
    read = functools.lru_cache(maxsize=None)(read_run_metrics)   # each run's records once, for every gate it is in

    @functools.lru_cache(maxsize=None)
    def samples(run: Path, ranks: tuple[int, ...]) -> dict:   # each run's step samples once, for every gate
        steady = read(run)[0]
        return step_samples(run, {rank: steady[rank] for rank in ranks})

    for index, run in enumerate(runs):
        steady = read(Path(run))[0]   # the gate's values of a side of one run (tokens/s over its step time)
        medians = run_values(run, steady, samples(run, tuple(sorted(steady))))
        regressions, note = [], ""
        same = [runs[i] for i in range(index) if not identity_differences([identities[i], identities[index]])]
        if same:
            result = gate(same[-BASELINE_RUNS:], [run], threshold_pct=threshold_pct, allow_env_change=True, seed=seed,
                          read=read, samples=samples)
            regressions = [m.name for m in result.regressions]
        elif index:
            note = ("a different job from the runs before it, not gated: "
                    + differences_text(identity_differences([identities[index - 1], identities[index]])))
        entries.append(HistoryRun(path=str(run), date=run_date(run), medians=medians, regressions=regressions,
                                  job_note=note))
    return History(root=str(root), threshold_pct=threshold_pct, runs=entries)
