"""A regression gate over several runs per side, with a noise model: fails only on a sustained drop.

Samples: each run's steady steps (compare.py: every step except each rank's first and the profiled ones),
one value per step over the ranks that recorded it:
  step_time_ms       the slowest rank's step_time_ms              (lower is better)
  tokens_per_s       the sum over ranks of tokens_per_s           (higher is better)
  peak_memory_mb     the largest max_memory_allocated_mb          (lower is better; absent on CPU)
  data_time_ms       the slowest rank's data_ms                   (lower is better)
A side's value is the median of its runs' steps pooled. change_pct = (new - base) / base x 100; worse_pct is
the change in the bad direction (a rise of step time, a drop of tokens/s). A part of the step (data_time_ms)
is judged by its rise in percent of the base's step time, not of itself: an input wait going from 0.3 to 0.5 ms
in a 28 ms step costs 0.7% of the step, not 60%.

Noise: a bootstrap of change_pct (BOOTSTRAP_RESAMPLES, seeded): each resample draws, per side, runs with
replacement and then steps with replacement within each drawn run, and takes the pooled medians;
interval = its 2.5th..97.5th percentiles. A metric regresses only when all three hold:
  - worse_pct >= threshold_pct (the drop is large enough to matter);
  - the interval excludes 0 on the worse side (it is not noise: the steps of one side do not explain it);
  - every new run's own median is worse than the base median by at least threshold_pct (sustained, not one
    slow run).
A side with fewer than MIN_STEPS steady steps for a metric leaves it ungated (said in a note).

Environments: every run's job.json `environment` (traces/environment.py) must agree on every field; when
they do not, the comparison is refused (exit 2) and the differing fields are listed, unless
allow_env_change. A run without a fingerprint is compared, with a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fleetscope.analysis.compare import DEFAULT_THRESHOLD_PCT, steady_metrics
from fleetscope.analysis.job_identity import DifferentJobs, differences_text, identity_differences, job_identity
from fleetscope.traces.environment import FINGERPRINT_FIELDS
from fleetscope.traces.jobfile import read_job_record
from fleetscope.traces.layout import RunLayout

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_REFUSED = 2
BOOTSTRAP_RESAMPLES = 2000
DEFAULT_SEED = 0
MIN_STEPS = 3
INTERVAL_PERCENTILES = (2.5, 97.5)


@dataclass(frozen=True)
class GatedMetric:
    name: str
    record_field: str
    higher_is_better: bool
    combine: str
    """How ranks' values of one step become the step's: "max" or "sum"."""
    unit: str
    part_of_step: bool = False
    """A share of the step time: its rise is judged in percent of the base's step time (module docstring)."""


STEP_TIME = "step_time_ms"
GATED = (
    GatedMetric(STEP_TIME, "step_time_ms", False, "max", "ms"),
    GatedMetric("tokens_per_s", "tokens_per_s", True, "sum", "tokens/s"),
    GatedMetric("peak_memory_mb", "max_memory_allocated_mb", False, "max", "MB"),
    GatedMetric("data_time_ms", "data_ms", False, "max", "ms", part_of_step=True),
)


@dataclass(frozen=True, kw_only=True)
class MetricGate:
    name: str
    higher_is_better: bool
    base_median: float | None
    new_median: float | None
    base_steps: int
    new_steps: int
    change_pct: float | None = None
    interval_pct: tuple[float, float] | None = None
    """Bootstrap interval of change_pct (module docstring)."""
    new_run_changes_pct: list[float] = field(default_factory=list)
    """Each new run's median against the base median."""
    step_cost_pct: float | None = None
    """A part of the step: its change in percent of the base's step time (what the threshold judges)."""
    gated: bool = False
    """Both sides had MIN_STEPS steady steps."""
    regression: bool = False
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class GateResult:
    base_runs: list[str]
    new_runs: list[str]
    threshold_pct: float
    metrics: list[MetricGate] = field(default_factory=list)
    environment_differences: dict[str, list[Any]] = field(default_factory=dict)
    """Field -> the distinct values the runs recorded, for every fingerprint field they disagree on."""
    refused: bool = False
    """Environments differ and allow_env_change was not given: nothing was compared."""
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[MetricGate]:
        return [m for m in self.metrics if m.regression]

    @property
    def exit_code(self) -> int:
        if self.refused:
            return EXIT_REFUSED
        return EXIT_REGRESSION if self.regressions else EXIT_OK

    @property
    def verdict(self) -> str:
        if self.refused:
            fields = ", ".join(f"{k} ({' vs '.join(map(str, v))})" for k, v in self.environment_differences.items())
            return f"REFUSED: the runs' environments differ: {fields} (--allow-env-change compares anyway)"
        if not self.regressions:
            return f"no sustained regression beyond {self.threshold_pct:g}%"
        worst = ", ".join(f"{m.name} {m.change_pct:+.1f}%" + (
            f" ({m.step_cost_pct:+.1f}% of the step time)" if m.step_cost_pct is not None else "")
            for m in self.regressions)
        return f"REGRESSION (threshold {self.threshold_pct:g}%, every new run worse): {worst}"


PRACTICAL_CHANGE_PCT = 1.0
"""A change smaller than this (in percent) is "within the noise" whatever its interval: step times of one
job move by that much from run to run on a quiet machine."""


def direction(metric: MetricGate) -> str:
    """"gain" when the bootstrap interval lies wholly on the better side of no change, "loss" when wholly on
    the worse side, else "unclear" (also for an ungated metric, and for a change below PRACTICAL_CHANGE_PCT).
    Says which way a deliberate change moved a metric; the threshold decides only regressions."""
    if not metric.gated or metric.interval_pct is None or metric.change_pct is None:
        return "unclear"
    if abs(metric.change_pct) < PRACTICAL_CHANGE_PCT:
        return "unclear"
    low, high = metric.interval_pct
    better_up = metric.higher_is_better
    if (low > 0 and better_up) or (high < 0 and not better_up):
        return "gain"
    if (high < 0 and better_up) or (low > 0 and not better_up):
        return "loss"
    return "unclear"


def step_samples(run_dir: Path) -> dict[str, np.ndarray]:
    """Metric name -> one value per steady step of the run (module docstring)."""
    by_step: dict[int, list[dict]] = {}
    for lines in steady_metrics(RunLayout.at(run_dir)).values():
        for line in lines:
            by_step.setdefault(int(line["step"]), []).append(line)
    samples = {}
    for metric in GATED:
        values = []
        for step in sorted(by_step):
            found = [r[metric.record_field] for r in by_step[step] if _is_number(r.get(metric.record_field))]
            if found:
                values.append(max(found) if metric.combine == "max" else sum(found))
        if values:
            samples[metric.name] = np.asarray(values, dtype=np.float64)
    return samples


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def gate(base_runs: list[str | Path], new_runs: list[str | Path], *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
         allow_env_change: bool = False, seed: int = DEFAULT_SEED, allow_different_jobs: bool = False) -> GateResult:
    """Gate NEW against BASE (each a list of run directories); `GateResult.exit_code` is the CI answer. Runs of
    different jobs (job_identity.py) raise DifferentJobs (exit 2) unless `allow_different_jobs`."""
    if not threshold_pct > 0:
        raise ValueError(f"threshold_pct must be > 0, got {threshold_pct}")
    if not base_runs or not new_runs:
        raise ValueError("gate: at least one base and one new run are needed")
    for run in [*base_runs, *new_runs]:
        if not Path(run).is_dir():
            raise FileNotFoundError(f"{run}: not a run directory")
    names = ([str(r) for r in base_runs], [str(r) for r in new_runs])
    jobs = identity_differences([job_identity(r) for r in [*base_runs, *new_runs]])
    if jobs and not allow_different_jobs:
        raise DifferentJobs(jobs)
    differences, notes = environment_check([*base_runs, *new_runs])
    if jobs:
        notes.append(f"different jobs gated (--allow-different-jobs): {differences_text(jobs)}")
    if differences and not allow_env_change:
        return GateResult(base_runs=names[0], new_runs=names[1], threshold_pct=threshold_pct,
                          environment_differences=differences, refused=True, notes=notes)
    if differences:
        notes.append("environments differ (compared anyway, --allow-env-change): " + ", ".join(differences))
    base = [step_samples(Path(r)) for r in base_runs]
    new = [step_samples(Path(r)) for r in new_runs]
    rng = np.random.default_rng(seed)
    step_time = _pooled_median([s[STEP_TIME] for s in base if STEP_TIME in s])
    metrics = [_metric_gate(m, base, new, threshold_pct, rng, step_time if m.part_of_step else None) for m in GATED]
    notes += [f"{m.name}: not gated ({m.reason})" for m in metrics if not m.gated and m.reason]
    return GateResult(base_runs=names[0], new_runs=names[1], threshold_pct=threshold_pct, metrics=metrics,
                      environment_differences=differences, notes=notes)


def environment_check(runs: list[str | Path]) -> tuple[dict[str, list[Any]], list[str]]:
    """(field -> distinct values where the runs' fingerprints disagree, notes on runs without one)."""
    prints, notes = [], []
    for run in runs:
        fingerprint = read_job_record(RunLayout.at(run)).get("environment")
        if isinstance(fingerprint, dict):
            prints.append(fingerprint)
        else:
            notes.append(f"{run}: no environment fingerprint in job.json (compared without checking it)")
    differences = {}
    for name in FINGERPRINT_FIELDS:
        values = list(dict.fromkeys(str(p.get(name)) for p in prints))
        if len(values) > 1:
            differences[name] = values
    return differences, notes


def _pooled_median(runs: list[np.ndarray]) -> float | None:
    pooled = np.concatenate(runs) if runs else np.empty(0)
    return float(np.median(pooled)) if pooled.size else None


def _metric_gate(metric: GatedMetric, base: list[dict[str, np.ndarray]], new: list[dict[str, np.ndarray]],
                 threshold_pct: float, rng: np.random.Generator, base_step_ms: float | None = None) -> MetricGate:
    """`base_step_ms`: the base's step time, for a part of the step (GatedMetric.part_of_step)."""
    base_runs = [s[metric.name] for s in base if metric.name in s]
    new_runs = [s[metric.name] for s in new if metric.name in s]
    base_all = np.concatenate(base_runs) if base_runs else np.empty(0)
    new_all = np.concatenate(new_runs) if new_runs else np.empty(0)
    summary = dict(name=metric.name, higher_is_better=metric.higher_is_better,
                   base_median=_pooled_median(base_runs), new_median=_pooled_median(new_runs),
                   base_steps=int(base_all.size), new_steps=int(new_all.size))
    if base_all.size < MIN_STEPS or new_all.size < MIN_STEPS or summary["base_median"] == 0:
        missing = "no steady steps record it" if not base_all.size and not new_all.size else \
            f"fewer than {MIN_STEPS} steady steps on a side"
        return MetricGate(**summary, reason=missing)
    base_median = summary["base_median"]
    sign = -1.0 if metric.higher_is_better else 1.0
    change = _change_pct(base_median, summary["new_median"])
    interval = _bootstrap_interval(base_runs, new_runs, rng)
    per_run = [_change_pct(base_median, float(np.median(run))) for run in new_runs]
    # what a change costs: of the metric itself, or of the step for a part of it
    part_of_step = base_step_ms is not None and base_step_ms > 0
    scale = base_median / base_step_ms if part_of_step else 1.0
    of_what = "of the step time" if part_of_step else ""
    large = sign * change * scale >= threshold_pct
    beyond_noise = (interval[0] > 0) if sign > 0 else (interval[1] < 0)
    sustained = all(sign * c * scale >= threshold_pct for c in per_run)
    regression = large and beyond_noise and sustained
    return MetricGate(**summary, change_pct=change, interval_pct=interval, new_run_changes_pct=per_run, gated=True,
                      regression=regression, step_cost_pct=change * scale if of_what else None,
                      reason="better" if sign * change < 0 else _reason(large, beyond_noise, sustained, threshold_pct,
                                                                        of_what, change * scale))


def _change_pct(base: float, new: float) -> float:
    return 100.0 * (new - base) / abs(base)


def _reason(large: bool, beyond_noise: bool, sustained: bool, threshold_pct: float, of_what: str = "",
            cost_pct: float = 0.0) -> str:
    if not large:
        return f"within {threshold_pct:g}% {of_what} ({cost_pct:+.1f}%)" if of_what else f"within {threshold_pct:g}%"
    if beyond_noise and sustained:
        return "sustained regression"
    missing = [text for text, held in (("within the noise of the runs and steps", beyond_noise),
                                       ("not in every new run", sustained)) if not held]
    return "worse, but " + " and ".join(missing)


def _bootstrap_interval(base_runs: list[np.ndarray], new_runs: list[np.ndarray],
                        rng: np.random.Generator) -> tuple[float, float]:
    changes = np.empty(BOOTSTRAP_RESAMPLES)
    for index in range(BOOTSTRAP_RESAMPLES):
        base = np.median(_resample(base_runs, rng))
        changes[index] = _change_pct(float(base), float(np.median(_resample(new_runs, rng)))) if base else 0.0
    low, high = np.percentile(changes, INTERVAL_PERCENTILES)
    return float(low), float(high)


def _resample(runs: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    chosen = rng.integers(0, len(runs), size=len(runs))
    return np.concatenate([rng.choice(runs[i], size=runs[i].size, replace=True) for i in chosen])
