"""From per-rank results to the Report: windows, straggler ranking, HTA views, summaries, verdict."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timezone
from typing import Callable

import numpy as np

from .hta_views import HtaViews, run_hta, skipped
from .rank import RankResult, TraceFailure
from .report import MissingTrace, Problem, RankReport, RankSummary, Report, WindowReport
from .steps import StepStats
from .stragglers import DEFAULT_MIN_LATENESS_US, find_stragglers

HtaRunner = Callable[[list[RankResult]], HtaViews]


def hta_for_window(results: list[RankResult]) -> HtaViews:
    """HTA on the window's GPU traces; skipped with the reason when it does not apply."""
    gpu = {r.rank: r.path for r in results if r.has_gpu}
    if not gpu:
        return skipped("CPU-only traces (no GPU kernels): HTA does not apply; fleetscope's own metrics cover them")
    return run_hta(gpu)


def no_hta(results: list[RankResult]) -> HtaViews:
    return skipped("HTA not requested")


def build_report(*, source_path: str, source_kind: str, results: list[RankResult],
                 failures: list[TraceFailure], missing: list[MissingTrace], world_size: int | None,
                 notes: list[str], hta: HtaRunner = hta_for_window,
                 clock_offsets_us: dict[int, float] | None = None,
                 min_lateness_us: float = DEFAULT_MIN_LATENESS_US) -> Report:
    """Assemble the report. `clock_offsets_us[rank]` = that rank's clock minus rank 0's (0 when unknown)."""
    windows = [
        _window_report(window, group, hta, clock_offsets_us or {}, min_lateness_us)
        for window, group in _by_window(results)
    ]
    summaries = _rank_summaries(windows)
    all_steps = [s.step_time_ms for w in windows for r in w.ranks for s in r.steps]
    return Report(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source_path=source_path,
        source_kind=source_kind,
        world_size=world_size or _world_size(results),
        complete=bool(results) and not failures and not missing,
        problems=[Problem(label=f.label, reason=f.reason, window=f.window, rank=f.rank) for f in failures],
        missing=missing,
        notes=notes,
        verdict=_overall_verdict(windows, summaries, failures, missing),
        step_time=StepStats.of(all_steps),
        ranks=summaries,
        windows=windows,
    )


def _by_window(results: list[RankResult]) -> list[tuple[int | None, list[RankResult]]]:
    groups: dict[int | None, list[RankResult]] = defaultdict(list)
    for result in results:
        groups[result.window].append(result)
    return [(w, sorted(groups[w], key=lambda r: r.rank)) for w in sorted(groups, key=lambda w: -1 if w is None else w)]


def clock_shifts_us(results: list[RankResult], offsets_us: dict[int, float]) -> dict[int, float]:
    """Per rank, what to add to its trace times to put them on rank 0's clock.

    Trace times count from each trace's own base time; the shift first brings them to a shared base (the
    earliest base in the window), then removes the rank's measured clock offset.
    """
    if not results:
        return {}
    base_ns = min(r.base_time_ns for r in results)
    return {r.rank: (r.base_time_ns - base_ns) / 1000.0 - offsets_us.get(r.rank, 0.0) for r in results}


def _window_report(window: int | None, results: list[RankResult], hta: HtaRunner,
                   offsets_us: dict[int, float], min_lateness_us: float) -> WindowReport:
    stragglers = find_stragglers(results, clock_shifts_us(results, offsets_us), min_lateness_us=min_lateness_us)
    return WindowReport(
        window=window,
        steps=sorted({s.step for r in results for s in r.steps}),
        ranks=[_rank_report(r) for r in results],
        stragglers=stragglers,
        hta=hta(results),
        notes=_window_notes(results),
    )


def _rank_report(result: RankResult) -> RankReport:
    return RankReport(
        rank=result.rank,
        host=result.host,
        label=result.label,
        rank_source=result.rank_source,
        backend=result.backend,
        world_size=result.world_size,
        event_count=result.event_count,
        dropped_events=result.dropped_events,
        step_source=result.step_source,
        steps=result.steps,
        step_time=StepStats.of([s.step_time_ms for s in result.steps]),
        utilization=result.utilization,
        collective_source=result.collectives.source,
        collective_count=len(result.collectives),
    )


def _window_notes(results: list[RankResult]) -> list[str]:
    notes = []
    step_sets = {r.rank: tuple(s.step for s in r.steps) for r in results}
    if len(set(step_sets.values())) > 1:
        detail = ", ".join(f"rank {rank}: {_step_range(steps)}" for rank, steps in sorted(step_sets.items()))
        notes.append(f"ranks recorded different steps ({detail}); collectives are matched by step")
    for result in results:
        notes += [f"rank {result.rank}: {remark}" for remark in result.remarks]
        if not result.steps:
            notes.append(f"rank {result.rank}: no ProfilerStep#N or train_step annotations: no step times")
        if result.dropped_events:
            detail = ", ".join(f"{count} {reason}" for reason, count in sorted(result.dropped_events.items()))
            notes.append(f"rank {result.rank}: events left out ({detail})")
        if result.utilization is None:
            notes.append(f"rank {result.rank}: no ops or kernels inside its steps: no busy/idle figures")
    return notes


def _step_range(steps: tuple[int, ...]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def _rank_summaries(windows: list[WindowReport]) -> list[RankSummary]:
    by_rank: dict[int, list[RankReport]] = defaultdict(list)
    for window in windows:
        for rank in window.ranks:
            by_rank[rank.rank].append(rank)
    return [_rank_summary(rank, reports) for rank, reports in sorted(by_rank.items())]


def _rank_summary(rank: int, reports: list[RankReport]) -> RankSummary:
    measured = [r.utilization for r in reports if r.utilization is not None]
    span_us = sum(u.span_us for u in measured)
    comm_us = sum(u.comm_us for u in measured)

    def share(total: float) -> float | None:
        return 100.0 * total / span_us if span_us > 0 else None

    return RankSummary(
        rank=rank,
        host=reports[0].host,
        windows=len(reports),
        step_time=StepStats.of([s.step_time_ms for r in reports for s in r.steps]),
        basis=measured[0].basis if measured else None,
        span_us=span_us,
        busy_pct=share(sum(u.busy_us for u in measured)),
        idle_pct=share(sum(u.idle_us for u in measured)),
        comm_pct=share(comm_us),
        overlap_pct=100.0 * sum(u.overlap_us for u in measured) / comm_us if comm_us > 0 else None,
    )


def _overall_verdict(windows: list[WindowReport], summaries: list[RankSummary],
                     failures: list[TraceFailure], missing: list[MissingTrace]) -> str:
    parts = []
    if not summaries:
        parts.append("no trace could be analyzed")
    timed = [s for s in summaries if s.step_time is not None]
    if len(timed) > 1:
        slowest = max(timed, key=lambda s: s.step_time.mean_ms)
        median = float(np.median([s.step_time.mean_ms for s in timed]))
        excess = 100.0 * (slowest.step_time.mean_ms - median) / median if median > 0 else 0.0
        parts.append(f"slowest rank: {slowest.rank} ({slowest.step_time.mean_ms:.2f} ms mean step, "
                     f"{excess:+.1f}% vs the median rank)")
    parts.append(_waited_for_sentence(windows))
    if failures or missing:
        parts.append(f"partial: {len(failures)} unusable trace(s), {len(missing)} missing rank trace(s)")
    return "; ".join(p for p in parts if p) + "."


def _waited_for_sentence(windows: list[WindowReport]) -> str:
    caused: dict[int, float] = defaultdict(float)
    last: dict[int, int] = defaultdict(int)
    matched = sum(w.stragglers.matched_collectives for w in windows)
    for window in windows:
        for wait in window.stragglers.by_wait:
            caused[wait.rank] += wait.caused_wait_us
            last[wait.rank] += wait.times_last
    if not matched:
        return "no collectives matched across ranks"
    top = max(caused, key=lambda r: (caused[r], -r), default=None)
    if top is None or last[top] == 0:
        return f"no rank keeps the others waiting at {matched} matched collectives"
    return (f"the others wait for rank {top}: last to arrive at {last[top]} of {matched} collectives, "
            f"{caused[top] / 1000:.2f} ms of waiting caused")


def _world_size(results: list[RankResult]) -> int | None:
    sizes = [r.world_size for r in results if r.world_size]
    return max(sizes) if sizes else None
