"""A regression gate over several runs per side, with a noise model: fails only on a sustained drop.

The one comparison of step metrics: `compare BASE NEW` is this gate with one run a side, `compare --base ...
--new ...` with several, `tune` and `history` call it too; compare.py shows its step metrics beside a trace
report's figures. Its exit codes (EXIT_*) are traces/exit_status.py's, imported here for its callers.

Samples: each run's steady steps (traces/formats.py is_steady: every step except each rank's first and the
profiled ones), over the ranks every run has (a rank whose metrics file is missing or unreadable in one run
would otherwise drop that run's tokens: a false regression; the ranks left out are named in the notes), one
value per step over the ranks that recorded it:
  step_time_ms       the slowest rank's step_time_ms              (lower is better)
  tokens per step    the sum over ranks of the tokens each processed (its tokens_per_s x its step_time_ms)
  peak_memory_mb     the largest max_memory_allocated_mb          (lower is better; absent on CPU)
  data_time_ms       the slowest rank's data_ms                   (lower is better)
A side's value is the median of its runs' steps pooled. tokens_per_s (higher is better) is not a median of
its own: it is the side's tokens per step over the side's step time, so it moves with the step time printed
next to it (-7.8% step time is +8.5% tokens/s at a fixed batch) and the slowest rank bounds both (a
synchronous step ends with its last rank). change_pct = (new - base) / base x 100; worse_pct is the change in
the bad direction (a rise of step time, a drop of tokens/s). A part of the step (data_time_ms) is judged by
its rise in percent of the base's step time, not of itself: an input wait going from 0.3 to 0.5 ms in a 28 ms
step costs 0.7% of the step, not 60%.

Noise: a bootstrap of change_pct (BOOTSTRAP_RESAMPLES resamples a side): each resample draws, per side, runs
with replacement and then steps with replacement within each drawn run, and takes the median of the values
drawn (the mean of the middle two for an even count); change_pct pairs the i-th base and new resamples;
interval = the 2.5th..97.5th percentiles of those changes. Seeded: a side's resamples are a function of the
seed, the side and its runs' numbers of steps alone, so the metrics recorded at the same steps (the usual case)
are judged on the same resampled steps, as a bootstrap of steps does, and history's gates of runs of one
length draw them once (BootstrapDraws). tokens_per_s takes the step time's interval and each new run's
change, converted through tokens per step (tokens per step are the job's batch, the same every step), so the
noise rule judges the two alike: one is beyond the noise exactly when the other is. A metric regresses only
when all three hold:
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

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from fleetscope.analysis.job_identity import DifferentJobs, differences_text, identity_differences, job_identity
from fleetscope.analysis.inputs.records import RunRecords, read_step_metrics_only
from fleetscope.traces.environment import FINGERPRINT_FIELDS
from fleetscope.traces.formats import StepRecord, steady
from fleetscope.traces.jobfile import read_job_record
from fleetscope.traces.layout import RunLayout
from fleetscope.traces.timeline import FLAG_FIRST, FLAG_PROFILED, last_of_each_step, read_timeline
from fleetscope.traces.validate import finite

from fleetscope.traces.exit_status import EXIT_OK, EXIT_REFUSED, EXIT_REGRESSION  # noqa: F401 (compare.py, the CLI)
DEFAULT_THRESHOLD_PCT = 5.0
BOOTSTRAP_RESAMPLES = 2000
DEFAULT_SEED = 0
MIN_STEPS = 3
INTERVAL_PERCENTILES = (2.5, 97.5)


@dataclass(frozen=True)
class GatedMetric:
    name: str
    sample: str
    """The per-step sample it is judged on (step_samples)."""
    higher_is_better: bool
    unit: str
    part_of_step: bool = False
    """A share of the step time: its rise is judged in percent of the base's step time (module docstring)."""
    per_step_time: bool = False
    """A rate: the sample (an amount per step) over the step time, judged through the step time's interval."""


STEP_TIME = "step_time_ms"
TOKENS_PER_STEP = "tokens_per_step"
GATED = (
    GatedMetric(STEP_TIME, STEP_TIME, False, "ms"),
    GatedMetric("tokens_per_s", TOKENS_PER_STEP, True, "tokens/s", per_step_time=True),
    GatedMetric("peak_memory_mb", "peak_memory_mb", False, "MB"),
    GatedMetric("data_time_ms", "data_time_ms", False, "ms", part_of_step=True),
)


@dataclass(frozen=True, kw_only=True)
class MetricGate:
    name: str
    higher_is_better: bool
    base_median: float | None
    """The base side's value (module docstring: a median, or for tokens_per_s tokens per step / step time)."""
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
        if self.metrics and not any(m.gated for m in self.metrics):
            return f"nothing gated: fewer than {MIN_STEPS} steady steps of step metrics on a side"
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


# -- reading the steady steps -------------------------------------------------------------------------


def steady_metrics(records: RunRecords) -> dict[int, list[StepRecord]]:
    """Rank -> its steady step records (the one rule of which steps count: traces/formats.py is_steady)."""
    return read_steady_metrics(records)[0]


def read_steady_metrics(records: RunRecords) -> tuple[dict[int, list[StepRecord]], list[str]]:
    """(rank -> its steady step records, notes naming every metrics file with bad lines or not read), from a
    run's records as read once (inputs/records.py)."""
    layout, steady_by_rank, notes = records.layout, {}, []
    for metrics in records.step_metrics:   # the file name, not its lines, says whose metrics they are
        read = metrics.read
        if read is None:  # the safe reader's refusal (a FIFO, a symlink out, too large)
            notes.append(f"{layout.relative(metrics.path)}: not read: {metrics.reason}")
            continue
        if read.bad_line_count:
            first = "; ".join(f"line {n}: {why}" for n, why in read.bad_lines[:3])
            notes.append(f"{layout.relative(metrics.path)}: {read.bad_line_count} bad line(s) skipped ({first})")
        kept = steady(read.records)
        if kept:
            steady_by_rank[metrics.rank] = kept
    for rank in layout.timeline_ranks():
        if rank not in steady_by_rank:   # a user's program (fs.windows()) records timelines, no step metrics
            kept = steady(_timeline_step_records(layout, rank, notes))
            if kept:
                steady_by_rank[rank] = kept
    return steady_by_rank, notes


def steady_metrics_at(run_dir: str | Path) -> tuple[dict[int, list[StepRecord]], list[str]]:
    """read_steady_metrics of a run directory named by path (compare, history, the gate): its step metrics
    alone are read, the rest of its records are not needed."""
    return read_steady_metrics(read_step_metrics_only(RunLayout.at(run_dir)))


def _timeline_step_records(layout: RunLayout, rank: int, notes: list[str]) -> list[StepRecord]:
    """A rank's timeline as step records (step, rank, step_time_ms, data_ms where known, profiled, first of its
    process): the fields the trainer's step metrics carry, so one rule of steadiness and one step time apply."""
    path = layout.timeline_file(rank)
    try:
        timeline = read_timeline(path, within=layout.root, expected_rank=rank, memmap=False)
    except (ValueError, OSError) as error:
        notes.append(f"{layout.relative(path)}: not read: {str(error)[:200]}")
        return []
    records = timeline.records
    records = records[last_of_each_step(np.asarray(records["step"], dtype=np.int64))]   # a resumed run: the last
    return [StepRecord(step=int(step), rank=rank, step_time_ms=finite(ms), data_ms=finite(data),
                       profiled=bool(flags & FLAG_PROFILED), first_of_process=bool(flags & FLAG_FIRST))
            for step, ms, data, flags in zip(records["step"].tolist(), records["step_ms"].tolist(),
                                             records["data_ms"].tolist(), records["flags"].tolist())]


def has_step_metrics(path: str | Path) -> bool:
    """A run directory with steady step metrics (what the gate measures); False for a report JSON."""
    return Path(path).is_dir() and bool(steady_metrics_at(path)[0])


def shared_ranks(steady: list[dict[int, list[StepRecord]]], names: list[str]) -> tuple[list[dict[int, list[StepRecord]]],
                                                                                 list[str]]:
    """Every run's steady steps over the ranks all runs with step metrics have, and notes naming those left
    out (a rank one run lacks would drop that run's tokens per step: a false regression)."""
    recorded = [set(s) for s in steady if s]
    shared = set.intersection(*recorded) if recorded else set()
    if all(ranks == shared for ranks in recorded):
        return steady, []
    notes = [f"{name}: step metrics of rank(s) {_ranks_text(sorted(set(s) - shared))} have no counterpart in "
             "every other run: not compared" for s, name in zip(steady, names) if set(s) - shared]
    notes.append(f"step metrics compared over the {len(shared)} rank(s) every run has")
    return [{r: v for r, v in s.items() if r in shared} for s in steady], notes


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")


def step_samples(run_dir: Path, steady: dict[int, list[StepRecord]] | None = None) -> dict[str, np.ndarray]:
    """Sample name -> one value per steady step of the run, in step order (module docstring): per step the
    slowest rank's step time and data time and the largest peak memory, and the tokens every rank processed
    (a step where some rank records none is left out of tokens: it would lower the step's); a sample no rank
    recorded in a step is left out for that step. `steady`: the run's steady records when already read (gate()
    passes them restricted to the shared ranks)."""
    if steady is None:
        steady = steady_metrics_at(run_dir)[0]
    lines = [line for rank_lines in steady.values() for line in rank_lines]
    if not lines:
        return {}
    steps, slot = np.unique(np.fromiter((line.step for line in lines), dtype=np.int64, count=len(lines)),
                            return_inverse=True)
    samples = {}
    for sample, record_field in ((STEP_TIME, "step_time_ms"), ("peak_memory_mb", "max_memory_allocated_mb"),
                                 ("data_time_ms", "data_ms")):
        values = _column(lines, record_field)
        known = ~np.isnan(values)
        if known.any():
            largest = np.full(steps.size, -np.inf)
            np.maximum.at(largest, slot[known], values[known])
            samples[sample] = largest[np.bincount(slot[known], minlength=steps.size) > 0]
    tokens = _column(lines, "tokens_per_s") * _column(lines, "step_time_ms") / 1e3
    known = ~np.isnan(tokens)
    whole = np.bincount(slot[known], minlength=steps.size) == np.bincount(slot, minlength=steps.size)
    if known.any() and whole.any():
        samples[TOKENS_PER_STEP] = np.bincount(slot[known], weights=tokens[known], minlength=steps.size)[whole]
    return samples


def _column(lines: list[StepRecord], record_field: str) -> np.ndarray:
    """One field of every record as floats, NaN where it is unknown (StepRecord holds finite numbers or None)."""
    values = (getattr(line, record_field) for line in lines)
    return np.fromiter((math.nan if value is None else value for value in values), dtype=np.float64,
                       count=len(lines))


def run_values(run_dir: str | Path, steady: dict[int, list[StepRecord]] | None = None,
               samples: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Gated metric -> the run's value on its own (a side of one run; what `history` prints); `steady`: its
    steady records where the caller has read them, `samples` their step_samples where it has figured them."""
    samples = step_samples(Path(run_dir), steady) if samples is None else samples
    step = _pooled_median([samples[STEP_TIME]] if STEP_TIME in samples else [])
    values = {}
    for metric in GATED:
        median = _pooled_median([samples[metric.sample]] if metric.sample in samples else [])
        value = _rate(median, step) if metric.per_step_time else median
        if value is not None:
            values[metric.name] = value
    return values


def _rate(per_step: float | None, step_ms: float | None) -> float | None:
    """An amount per step over the step time, per second."""
    return per_step / step_ms * 1e3 if per_step is not None and step_ms else None


# -- the gate -------------------------------------------------------------------------------------------


def gate(base_runs: list[str | Path], new_runs: list[str | Path], *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
         allow_env_change: bool = False, seed: int = DEFAULT_SEED, allow_different_jobs: bool = False,
         read: SteadyReader | None = None, samples: "SamplesOf | None" = None) -> GateResult:
    """Gate NEW against BASE (each a list of run directories); `GateResult.exit_code` is the CI answer. Runs of
    different jobs (job_identity.py) raise DifferentJobs (exit 2) unless `allow_different_jobs`. `read(run)`
    gives a run's steady records (read_steady_metrics; a caller gating the same runs many times, as history
    does, passes one that reads each run once); `samples(run, ranks)` its step samples over those ranks (the same
    caller passes one that figures each run's once)."""
    if not isinstance(threshold_pct, (int, float)) or finite(threshold_pct) is None or threshold_pct <= 0:
        raise ValueError(f"threshold_pct must be a finite number > 0, got {threshold_pct!r}")
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
    metrics, measured = gate_metrics(base_runs, new_runs, threshold_pct=threshold_pct, seed=seed, read=read,
                                     samples=samples)
    return GateResult(base_runs=names[0], new_runs=names[1], threshold_pct=threshold_pct, metrics=metrics,
                      environment_differences=differences, notes=notes + measured)


def gate_metrics(base_runs: list[str | Path], new_runs: list[str | Path], *, threshold_pct: float,
                 seed: int = DEFAULT_SEED, read: SteadyReader | None = None,
                 samples: "SamplesOf | None" = None) -> tuple[list[MetricGate], list[str]]:
    """Every gated metric of NEW against BASE, and notes (bad metrics files, ranks left out, metrics not
    gated); what gate() measures once the jobs and environments are checked."""
    base, new, notes = _samples_of_runs(base_runs, new_runs, read or read_run_metrics, samples)
    metrics = _metric_gates(base, new, threshold_pct, seed)
    return metrics, notes + [f"{m.name}: not gated ({m.reason})" for m in metrics if not m.gated and m.reason]


SteadyReader = Callable[[Path], tuple[dict[int, list[StepRecord]], list[str]]]
"""A run directory -> its steady records and notes (read_run_metrics)."""
SamplesOf = Callable[[Path, tuple[int, ...]], dict[str, np.ndarray]]
"""A run directory and the ranks gated -> its step samples over those ranks (step_samples)."""


def read_run_metrics(run: Path) -> tuple[dict[int, list[StepRecord]], list[str]]:
    return steady_metrics_at(run)


def _samples_of_runs(base_runs: list[str | Path], new_runs: list[str | Path], reader: SteadyReader,
                     samples_of: SamplesOf | None = None) -> tuple[
        list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], list[str]]:
    """Each side's per-run samples over the shared ranks, and notes on bad metrics files and ranks left out."""
    runs = [*base_runs, *new_runs]
    read = [reader(Path(r)) for r in runs]
    steady, rank_notes = shared_ranks([s for s, _ in read], [str(r) for r in runs])
    samples = [samples_of(Path(r), tuple(sorted(s))) if samples_of is not None else step_samples(Path(r), s)
               for r, s in zip(runs, steady)]
    read_notes = [f"{run}: {note}" for run, (_, notes) in zip(runs, read) for note in notes]
    return samples[:len(base_runs)], samples[len(base_runs):], read_notes + rank_notes


def _metric_gates(base: list[dict[str, np.ndarray]], new: list[dict[str, np.ndarray]], threshold_pct: float,
                  seed: int) -> list[MetricGate]:
    """Every GATED metric; the step time first, as the rate and the part of the step are judged against it."""
    draws = BootstrapDraws(seed)    # one set of resamples a side for all the metrics (module docstring, Noise)
    step_metric = GATED[0]
    step = _metric_gate(step_metric, base, new, threshold_pct, draws)
    step_ms = step.base_median
    gates = {step_metric.name: step}
    for metric in GATED[1:]:
        gates[metric.name] = (_rate_gate(metric, base, new, step, threshold_pct) if metric.per_step_time else
                              _metric_gate(metric, base, new, threshold_pct, draws,
                                           step_ms if metric.part_of_step else None))
    return [gates[m.name] for m in GATED]


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
                 threshold_pct: float, draws: "BootstrapDraws", base_step_ms: float | None = None) -> MetricGate:
    """`base_step_ms`: the base's step time, for a part of the step (GatedMetric.part_of_step)."""
    base_runs = [s[metric.sample] for s in base if metric.sample in s]
    new_runs = [s[metric.sample] for s in new if metric.sample in s]
    summary = dict(name=metric.name, higher_is_better=metric.higher_is_better,
                   base_median=_pooled_median(base_runs), new_median=_pooled_median(new_runs),
                   base_steps=sum(r.size for r in base_runs), new_steps=sum(r.size for r in new_runs))
    unmeasured = _unmeasured(summary)
    if unmeasured:
        return MetricGate(**summary, reason=unmeasured)
    base_median = summary["base_median"]
    change = _change_pct(base_median, summary["new_median"])
    interval = _bootstrap_interval(base_runs, new_runs, draws)
    per_run = [_change_pct(base_median, float(np.median(run))) for run in new_runs]
    # what a change costs: of the metric itself, or of the step for a part of it
    scale = base_median / base_step_ms if base_step_ms is not None and base_step_ms > 0 else None
    return _judged(summary, change, interval, per_run, threshold_pct, scale)


def _unmeasured(summary: dict) -> str:
    """Why a metric cannot be gated ("" when it can)."""
    if not summary["base_steps"] and not summary["new_steps"]:
        return "no steady steps record it"
    if min(summary["base_steps"], summary["new_steps"]) < MIN_STEPS or not summary["base_median"]:
        return f"fewer than {MIN_STEPS} steady steps on a side"
    return ""


def _rate_gate(metric: GatedMetric, base: list[dict[str, np.ndarray]], new: list[dict[str, np.ndarray]],
               step: MetricGate, threshold_pct: float) -> MetricGate:
    """A rate (tokens/s): each side's amount per step over its step time; the step time's interval and each
    new run's step time give the rate's, so the noise rule judges both alike (module docstring)."""
    base_amount = _pooled_median([s[metric.sample] for s in base if metric.sample in s])
    new_amount = _pooled_median([s[metric.sample] for s in new if metric.sample in s])
    summary = dict(name=metric.name, higher_is_better=metric.higher_is_better,
                   base_median=_rate(base_amount, step.base_median), new_median=_rate(new_amount, step.new_median),
                   base_steps=step.base_steps if base_amount else 0, new_steps=step.new_steps if new_amount else 0)
    unmeasured = _unmeasured(summary) or ("" if step.gated else step.reason)
    if unmeasured:
        return MetricGate(**summary, reason=unmeasured)
    amounts = new_amount / base_amount

    def rate_change(step_change_pct: float, amount_ratio: float = amounts) -> float:
        return 100.0 * (amount_ratio / (1.0 + step_change_pct / 100.0) - 1.0)

    change = _change_pct(summary["base_median"], summary["new_median"])
    low, high = step.interval_pct
    per_run = [rate_change(_change_pct(step.base_median, float(np.median(s[STEP_TIME]))),
                           float(np.median(s[metric.sample])) / base_amount)
               for s in new if STEP_TIME in s and metric.sample in s]
    return _judged(summary, change, (rate_change(high), rate_change(low)), per_run, threshold_pct)


def _judged(summary: dict, change: float, interval: tuple[float, float], per_run: list[float],
            threshold_pct: float, scale: float | None = None) -> MetricGate:
    """The one noise rule (module docstring): large, beyond the noise and in every new run. `scale`: a part
    of the step's value over the base's step time (its change is judged in percent of the step)."""
    sign = -1.0 if summary["higher_is_better"] else 1.0
    factor = 1.0 if scale is None else scale
    large = sign * change * factor >= threshold_pct
    beyond_noise = (interval[0] > 0) if sign > 0 else (interval[1] < 0)
    sustained = all(sign * c * factor >= threshold_pct for c in per_run)
    of_what = "" if scale is None else "of the step time"
    if sign * change < 0:
        # "better" only beyond the noise, as `direction` says "gain": a -0.2% inside -24..+119% is no finding
        better_beyond = (interval[1] < 0) if sign > 0 else (interval[0] > 0)
        reason = "better" if better_beyond and abs(change) >= PRACTICAL_CHANGE_PCT else "within the noise"
    else:
        reason = _reason(large, beyond_noise, sustained, threshold_pct, of_what, change * factor)
    return MetricGate(**summary, change_pct=change, interval_pct=interval, new_run_changes_pct=per_run, gated=True,
                      regression=large and beyond_noise and sustained,
                      step_cost_pct=None if scale is None else change * factor, reason=reason)


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
                        draws: BootstrapDraws) -> tuple[float, float]:
    base = _resampled_medians(base_runs, draws, "base")
    new = _resampled_medians(new_runs, draws, "new")
    with np.errstate(divide="ignore", invalid="ignore"):
        changes = np.where(base != 0, 100.0 * (new - base) / np.abs(base), 0.0)
    low, high = np.percentile(changes, INTERVAL_PERCENTILES)
    return float(low), float(high)


RESAMPLED_VALUES_PER_CHUNK = 2_000_000
"""Values drawn at once for one side's resamples (bounds their memory on runs of many steps: 16 MB of picks)."""
SIDES = ("base", "new")


@dataclass(frozen=True)
class Resamples:
    """Some of a side's bootstrap resamples, as matrices of picks (indexes into the side's runs' values laid end
    to end), a resample a row; the rows of one matrix hold as many values."""
    blocks: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class BootstrapDraws:
    """The resamples of a gate (module docstring, Noise). A side's are a function of the seed, the side and its
    runs' numbers of steps alone: every metric with those steps, and every gate with runs of those lengths
    (history's, one run against those before it), gets the same ones, drawn once while _drawn_chunk keeps them."""
    seed: int
    count: int = BOOTSTRAP_RESAMPLES

    def of(self, side: str, sizes: tuple[int, ...]) -> Iterator[Resamples]:
        per_chunk = max(1, RESAMPLED_VALUES_PER_CHUNK // max(max(sizes) * len(sizes), 1))
        for index, done in enumerate(range(0, self.count, per_chunk)):
            yield _drawn_chunk(self.seed, side, sizes, index, min(per_chunk, self.count - done))


@functools.lru_cache(maxsize=4)     # 4 chunks of RESAMPLED_VALUES_PER_CHUNK picks: 64 MB at most
def _drawn_chunk(seed: int, side: str, sizes: tuple[int, ...], index: int, count: int) -> Resamples:
    """Chunk `index` of a side's resamples, from its own seeded stream (read-only: it is shared)."""
    rng = np.random.default_rng([seed, SIDES.index(side), index, len(sizes), *sizes])
    lengths = np.array(sizes)
    drawn = _draw_chunk(lengths, np.concatenate([[0], np.cumsum(lengths)[:-1]]), rng, count)
    blocks = tuple(block.astype(np.intp, copy=False) for block in drawn.blocks)   # what take() indexes with
    for block in blocks:
        block.flags.writeable = False
    return Resamples(blocks)


def _draw_chunk(sizes: np.ndarray, offsets: np.ndarray, rng: np.random.Generator, count: int) -> Resamples:
    chosen = rng.integers(0, sizes.size, size=(count, sizes.size))     # the runs each resample draws
    if np.all(sizes == sizes[0]):       # runs of one length (the usual case): every resample has as many values
        length = int(sizes[0])
        steps = rng.integers(0, length, size=(count, sizes.size, length), dtype=_step_dtype(length))
        return Resamples(((offsets[chosen][:, :, None] + steps).reshape(count, -1),))
    # runs of different lengths: the resamples that drew the same runs (in any order) hold as many values, and
    # their steps are drawn as one matrix
    times_drawn = (chosen[:, :, None] == np.arange(sizes.size)).sum(axis=1)
    compositions, group = np.unique(times_drawn, axis=0, return_inverse=True)
    rows = np.bincount(group.ravel(), minlength=len(compositions))
    return Resamples(tuple(_same_runs_block(composition, int(count_of), sizes, offsets, rng)
                           for composition, count_of in zip(compositions, rows)))


def _same_runs_block(times_drawn: np.ndarray, rows: int, sizes: np.ndarray, offsets: np.ndarray,
                     rng: np.random.Generator) -> np.ndarray:
    """`rows` resamples that each drew run r times_drawn[r] times: run by run, as many steps from it."""
    return np.concatenate([offsets[run] + rng.integers(0, sizes[run], size=(rows, times * sizes[run]),
                                                       dtype=_step_dtype(int(sizes[run])))
                           for run, times in enumerate(times_drawn) if times], axis=1)


def _step_dtype(length: int) -> type:
    """16-bit step draws where they fit: ~3x faster than int64 ones, and the draws are most of a gate's time."""
    return np.uint16 if length <= 1 << 16 else np.int64


def _resampled_medians(runs: list[np.ndarray], draws: BootstrapDraws, side: str) -> np.ndarray:
    """The side's bootstrap medians (module docstring: runs with replacement, then steps with replacement
    within each drawn run, pooled). Medians are taken over the values' ranks (small integers partition faster
    than floats) and turned back into values: the same medians as of the values."""
    values, ranks = np.unique(np.concatenate(runs), return_inverse=True)
    if values.size == 1:                # every step the same (peak memory often is): so is every resample's median
        return np.full(draws.count, float(values[0]))
    ranks = ranks.astype(np.uint16 if values.size <= 1 << 16 else np.int64)
    middles = [_middle_ranks(ranks.take(block)) for chunk in draws.of(side, tuple(run.size for run in runs))
               for block in chunk.blocks]
    lower, upper = (np.concatenate(ends) for ends in zip(*middles))
    return (values[lower] + values[upper]) / 2.0


def _middle_ranks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's lower and upper middle rank (the same for an odd count)."""
    lower = (rows.shape[1] - 1) // 2
    parted = np.partition(rows, lower, axis=1)      # one kth: numpy partitions at two ~10x slower
    upper = parted[:, lower] if rows.shape[1] % 2 else parted[:, lower + 1:].min(axis=1)
    return parted[:, lower], upper
