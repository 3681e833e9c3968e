"""From per-rank results to the Report: windows, straggler ranking, HTA views, summaries, verdict."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from fleetscope.traces.formats import MoeRecord
from fleetscope.analysis.cross_rank.arrivals import arrival_matrix
from fleetscope.analysis.cross_rank.bandwidth import collective_bandwidth
from fleetscope.analysis.cross_rank.causes import CAUSE_NETWORK, find_causes, shares_cpu_host
from fleetscope.analysis.cross_rank.critical_path import critical_paths
from fleetscope.analysis.cross_rank.clock_align import MeasuredOffset, align_clocks
from fleetscope.analysis.cross_rank.hta_views import HtaViews, run_hta, skipped
from fleetscope.analysis.cross_rank.matching import match_collectives
from fleetscope.analysis.cross_rank.pipeline import analyze_pipeline
from fleetscope.analysis.cross_rank.moe import (
    MoeWindow,
    moe_imbalance_hints,
    moe_report,
    moe_window,
    uneven_routing_hints,
)
from fleetscope.analysis.cross_rank.records import TrainerEvidence
from fleetscope.analysis.cross_rank.stragglers import (
    DEFAULT_MIN_LATENESS_US,
    Stragglers,
    find_stragglers,
    nothing_stands_out,
    step_time_clause,
)
from fleetscope.analysis.inputs.sources import TraceFailure
from fleetscope.analysis.per_rank.collectives import SOURCE_NCCL
from fleetscope.analysis.per_rank.gpu_time import combine_gpu_time
from fleetscope.analysis.per_rank.kernels import combine as combine_kernels
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.analysis.per_rank.steps import STEP_SOURCE_CAPTURE, STEP_SOURCE_PROFILER, StepStats
from fleetscope.analysis.quantities import (
    job_straggler,
    step_ranges,
    trace_basis,
    trace_step_times,
)
from fleetscope.analysis.whatif.ideal_steps import ideal_replay
from fleetscope.analysis.whatif.report_what_if import with_replayed_what_ifs
from fleetscope.analysis.report.model import (
    MissingTrace,
    Problem,
    RankReport,
    RankSummary,
    Report,
    WindowReport,
)

HtaRunner = Callable[[list[RankResult], Stragglers], HtaViews]
DEFAULT_HTA_MAX_RANKS = 16
"""HTA's views cost a worker's time per rank: past this many ranks per window they get a chosen subset."""
HTA_RANKS_AUTO = "auto"
HTA_RANKS_ALL = "all"


def parse_hta_ranks(text: str) -> str | list[int]:
    """`--hta-ranks`: auto, all, or a comma-separated list of ranks."""
    text = text.strip().lower()
    if text in (HTA_RANKS_AUTO, HTA_RANKS_ALL):
        return text
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--hta-ranks must be auto, all or a list like 0,3,7; got {text!r}") from None
    if not ranks or min(ranks) < 0:
        raise ValueError(f"--hta-ranks needs ranks >= 0, got {text!r}")
    return ranks


def hta_runner(max_ranks: int = DEFAULT_HTA_MAX_RANKS, ranks: str | list[int] = HTA_RANKS_AUTO,
               progress: Callable[[int, int], None] | None = None, cache_dir: Path | None = None,
               oracle: bool = False) -> HtaRunner:
    """HTA on a window's GPU traces: `ranks` auto (the ranks the report points at, at most `max_ranks`),
    all, or a list; skipped with the reason when it does not apply. Each rank's views are kept in the
    parsed-trace cache's directory `cache_dir` when given (per_rank/hta_cache.py)."""
    if max_ranks < 1:
        raise ValueError(f"hta max_ranks must be >= 1, got {max_ranks}")

    def run(results: list[RankResult], stragglers: Stragglers) -> HtaViews:
        gpu = [r for r in results if r.has_gpu]
        if not gpu:
            return skipped("CPU-only traces (no GPU kernels recorded; CUDA work launched but not recorded is named "
                           "in the notes): HTA does not apply; fleetscope's own metrics cover them")
        chosen = _chosen(gpu, stragglers, ranks, max_ranks)
        if not chosen:
            return skipped(f"none of the requested HTA ranks ({', '.join(map(str, ranks))}) has a GPU trace here")
        picked = [r for r in gpu if r.rank in chosen]
        has_comm_kernels = any(r.collectives.source == SOURCE_NCCL for r in gpu)
        views = run_hta({r.rank: r.path for r in picked}, has_comm_kernels=has_comm_kernels,
                        step_names=_profiler_step_names(picked), progress=progress, cache_dir=cache_dir,
                        oracle=oracle)
        if len(chosen) < len(gpu):
            how = ("the slowest, the one waited for, the fastest, the median, then one per host"
                   if ranks == HTA_RANKS_AUTO else "as requested")
            note = f"HTA ran on {len(chosen)} of {len(gpu)} ranks ({how}): {', '.join(map(str, chosen))}"
            views = dataclasses.replace(views, reason=f"{views.reason}; {note}" if views.reason else note)
        return views

    return run


def _chosen(gpu: list[RankResult], stragglers: Stragglers, ranks: str | list[int], max_ranks: int) -> list[int]:
    if ranks == HTA_RANKS_ALL:
        return sorted(r.rank for r in gpu)
    if ranks == HTA_RANKS_AUTO:
        return hta_ranks(gpu, stragglers, max_ranks)
    return sorted(set(ranks) & {r.rank for r in gpu})


def hta_ranks(results: list[RankResult], stragglers: Stragglers, max_ranks: int) -> list[int]:
    """All ranks when few; else, in this order until `max_ranks`: the slowest rank, the one the others
    wait for, the fastest and the median (by mean step time), then the first rank of each host."""
    ranks = sorted(r.rank for r in results)
    if len(ranks) <= max_ranks:
        return ranks
    timed = sorted((StepStats.of([s.step_time_ms for s in r.steps]).mean_ms, r.rank)
                   for r in results if r.steps)
    wanted = [stragglers.slowest_rank, stragglers.waited_for_rank]
    if timed:
        wanted += [timed[0][1], timed[len(timed) // 2][1]]
    hosts: dict[str, int] = {}
    for result in sorted(results, key=lambda r: r.rank):
        hosts.setdefault(result.host, result.rank)
    wanted += list(hosts.values())
    chosen: list[int] = []
    for rank in wanted:
        if rank is not None and rank in ranks and rank not in chosen and len(chosen) < max_ranks:
            chosen.append(rank)
    return sorted(chosen)


def _profiler_step_names(results: list[RankResult]) -> tuple[str, ...]:
    return tuple(sorted({f"ProfilerStep#{s.step}" for r in results if r.step_source == STEP_SOURCE_PROFILER
                         for s in r.steps}))


def no_hta(results: list[RankResult], stragglers: Stragglers) -> HtaViews:
    return skipped("HTA not requested")


def build_report(*, source_path: str, source_kind: str, results: list[RankResult],
                 failures: list[TraceFailure], missing: list[MissingTrace], world_size: int | None,
                 notes: list[str], hta: HtaRunner | None = None,
                 measured_offsets: dict[int, MeasuredOffset] | None = None,
                 min_lateness_us: float = DEFAULT_MIN_LATENESS_US,
                 link_peak_gbps: float | None = None, trainer: TrainerEvidence | None = None,
                 moe_records: list[MoeRecord] | None = None, missing_total: int = 0) -> Report:
    """Assemble the report. `measured_offsets[rank]`: that rank's clock minus rank 0's, from its clock file;
    `link_peak_gbps`: peak bus bandwidth of every link, instead of bandwidth.py's table; `trainer`: the
    run's trainer records (cross_rank/records.py); `moe_records`: its MoE routing records (cross_rank/moe.py)."""
    hta = hta or hta_runner()
    built = [
        _window_report(window, group, hta, measured_offsets or {}, min_lateness_us, link_peak_gbps, moe_records or [])
        for window, group in _by_window(results)
    ]
    windows = [window for window, _ in built]
    summaries = _rank_summaries(windows)
    job_steps = list(trace_step_times(windows).values())
    unrecorded = sorted({r.rank for r in results if r.launch_audit is not None and r.launch_audit.nothing_recorded})
    return Report(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source_path=source_path,
        source_kind=source_kind,
        world_size=world_size or _world_size(results),
        complete=bool(results) and not failures and not missing and not unrecorded,
        problems=[Problem(label=f.label, reason=f.reason, window=f.window, rank=f.rank) for f in failures],
        missing=missing,
        notes=notes,
        missing_total=max(missing_total, len(missing)),
        verdict=_overall_verdict(windows, summaries, failures, max(missing_total, len(missing)), unrecorded),
        step_time=StepStats.of(job_steps),
        step_time_basis=trace_basis(windows),
        ranks=summaries,
        windows=windows,
        trainer=trainer,
        moe=moe_report(moe_records or [], [moe for _, moe in built]),
    )


def _by_window(results: list[RankResult]) -> list[tuple[int | None, list[RankResult]]]:
    groups: dict[int | None, list[RankResult]] = defaultdict(list)
    for result in results:
        groups[result.window].append(result)
    return [(w, sorted(groups[w], key=lambda r: r.rank)) for w in sorted(groups, key=lambda w: -1 if w is None else w)]


def _window_report(window: int | None, results: list[RankResult], hta: HtaRunner,
                   measured: dict[int, MeasuredOffset], min_lateness_us: float,
                   link_peak_gbps: float | None = None,
                   moe_records: list[MoeRecord] = ()) -> tuple[WindowReport, MoeWindow | None]:
    results, matching = match_collectives(results)
    matrix = arrival_matrix(results)
    clock = align_clocks(matrix, _ranks_by_host(results), measured)
    aligned = matrix.shifted(clock.offsets_us()) if matrix is not None else None
    stragglers = find_stragglers(results, aligned, min_lateness_us=min_lateness_us,
                                 cause_hints=moe_imbalance_hints(list(moe_records)))
    paths = critical_paths(results, aligned, clock.offsets_us())
    report = WindowReport(
        window=window,
        steps=sorted({s.step for r in results for s in r.steps}),
        ranks=[_rank_report(r) for r in results],
        clock=clock,
        stragglers=stragglers,
        top_kernels=combine_kernels([r.top_kernels for r in results]),
        hta=hta(results, stragglers),
        gpu_time=combine_gpu_time([r.gpu_time for r in results]),
        bandwidth=collective_bandwidth(results, aligned, link_peak_gbps, list(moe_records)),
        pipeline=analyze_pipeline(results),
        notes=_window_notes(results),
        causes=with_replayed_what_ifs(
            find_causes(results, aligned, stragglers, clock, routing=uneven_routing_hints(list(moe_records))),
            window, results),
        critical_path=paths,
        collective_matching=matching,
        ideal_replay=ideal_replay(window, results, paths),
    )
    return report, moe_window(results, aligned, list(moe_records))


def _ranks_by_host(results: list[RankResult]) -> dict[str, list[int]]:
    hosts: dict[str, list[int]] = defaultdict(list)
    for result in results:
        hosts[result.host].append(result.rank)
    return dict(hosts)


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
        gpu_time=result.gpu_time,
        host_stalls=result.host_stalls,
        step_work=result.step_work,
    )


def _rank_remarks(results: list[RankResult]) -> list[str]:
    """Each rank's remarks, one note per distinct remark naming every rank that has it ("ranks 0-7: ...")."""
    ranks_of: dict[str, list[int]] = {}
    for result in results:
        for remark in result.remarks:
            ranks_of.setdefault(remark, []).append(result.rank)
    return [f"{'rank' if len(ranks) == 1 else 'ranks'} {step_ranges(sorted(set(ranks)))}: {remark}"
            for remark, ranks in ranks_of.items()]


def _window_notes(results: list[RankResult]) -> list[str]:
    notes = []
    step_sets = {r.rank: tuple(s.step for s in r.steps) for r in results}
    if len(set(step_sets.values())) > 1:
        detail = ", ".join(f"rank {rank}: {_step_range(steps)}" for rank, steps in sorted(step_sets.items()))
        notes.append(f"ranks recorded different steps ({detail}); collectives are matched by step")
    notes += _rank_remarks(results)
    for result in results:
        if not result.steps:
            notes.append(f"rank {result.rank}: no ProfilerStep#N or train_step annotations: no step times")
        elif result.step_source == STEP_SOURCE_CAPTURE:
            notes.append(f"rank {result.rank}: no ProfilerStep#N or train_step annotations: the whole capture "
                         f"({result.steps[0].step_time_ms:.2f} ms) is taken as one step (step 0)")
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
                     failures: list[TraceFailure], missing_total: int, unrecorded: list[int] = ()) -> str:
    parts = []
    if unrecorded:
        # said first: every figure after it is the host's side only (rank.py LaunchAudit)
        parts.append(f"CUDA work was launched but not recorded on {'rank' if len(unrecorded) == 1 else 'ranks'} "
                     f"{step_ranges(unrecorded)} (CUPTI off, failed or out of buffers): what follows is the host's "
                     "side only")
    if not summaries:
        parts.append("no trace could be analyzed")
    timed = [s for s in summaries if s.step_time is not None]
    named = job_straggler(windows) is not None       # the collectives' sentence names a rank: the step times none
    parts.append(step_time_clause({s.rank: s.step_time.mean_ms for s in timed}, named))
    one_rank = len(summaries) == 1 and not sum(w.stragglers.matched_collectives for w in windows)
    parts += ([_one_rank_sentence(windows, summaries[0])] if one_rank else
              _pipeline_sentences(windows) or [_waited_for_sentence(windows)])
    if failures or missing_total:
        parts.append(f"partial: {len(failures)} unusable trace(s), {missing_total} missing rank trace(s)")
    elif unrecorded:
        parts.append("partial: GPU activity not recorded")
    return "; ".join(p for p in parts if p) + "."


def _one_rank_sentence(windows: list[WindowReport], rank: RankSummary) -> str:
    """One rank: no one waits for anyone, so the verdict is where its step goes (busy and idle on its basis, the
    idle's largest cause per profiled step)."""
    if rank.busy_pct is None or rank.idle_pct is None:
        return f"one rank (rank {rank.rank}): nobody waits at collectives; no utilization to say where its step goes"
    basis = "GPU" if rank.basis == "gpu" else "CPU"
    causes: dict[str, float] = {}
    steps = 0
    for window in windows:
        for result in window.ranks:
            stalls = result.host_stalls
            if stalls is not None and stalls.steps:
                steps += len(stalls.steps)
                for cause, us in stalls.idle_by_cause_us.items():
                    causes[cause] = causes.get(cause, 0.0) + us
    top = max(causes.items(), key=lambda item: item[1], default=None)
    cause = (f", most of the idle {top[0]} ({top[1] / 1000 / steps:.2f} ms per profiled step)"
             if top is not None and steps and top[1] > 0 else "")
    return (f"one rank (rank {rank.rank}), so nobody waits for anyone: its {basis} is busy {rank.busy_pct:.0f}% and "
            f"idle {rank.idle_pct:.0f}% of its profiled steps{cause}")


def _pipeline_sentences(windows: list[WindowReport]) -> list[str]:
    """A pipeline job's verdict comes from its stages (cross_rank/pipeline.py): its ranks finish the schedule
    at different times by design, so who arrives last at the collectives around it names no straggler.
    Sends and receives without a known schedule add their sentence next to the collectives' one."""
    pipelines = [w.pipeline for w in windows if w.pipeline is not None]
    if not pipelines:
        return []
    chosen = next((p for p in pipelines if p.slowest_rank is not None), pipelines[0])
    if chosen.schedule is None:
        return [_waited_for_sentence(windows), chosen.verdict]
    return [chosen.verdict, "waits at collectives in a pipeline job follow the schedule and are not taken "
                            "for a straggler (see the Stragglers section for them)"]


def _waited_for_sentence(windows: list[WindowReport]) -> str:
    matched = sum(w.stragglers.matched_collectives for w in windows)
    if not matched:
        return "no collectives matched across ranks"
    top = job_straggler(windows)
    if top is None:
        return f"no rank keeps the others waiting at {matched} matched collectives"
    tests = [w.stragglers.significance for w in windows
             if w.stragglers.significance is not None and w.stragglers.significance.rank == top.rank]
    if top.consistent:
        shown = max(tests, key=lambda t: t.steps, default=None)
        evidence = f" (stands out: {shown.evidence()})" if shown is not None else ""
        return (f"rank {top.rank} is the straggler: the others wait for it, last at {top.times_last} of the "
                f"{top.collectives} collectives it took part in, {100 * top.share:.0f}% of all waiting "
                f"({top.caused_us / 1000:.2f} ms){evidence}{_cause_clause(windows, top.rank)}")
    if tests and not any(t.stands_out for t in tests):
        return nothing_stands_out(top.rank, max(tests, key=lambda t: t.steps))
    named = [w.stragglers.waited_for_rank for w in windows if w.stragglers.consistent]
    return (f"no single straggler at collectives: rank {top.rank} causes the most waiting "
            f"({100 * top.share:.0f}%, last at {top.times_last} of its {top.collectives}), but stands out as the "
            f"straggler in {named.count(top.rank)} of {len(windows)} window(s)")


def _cause_clause(windows: list[WindowReport], rank: int) -> str:
    """", cause: X" when every window that classified the rank agrees on its cause (causes.py)."""
    found = [f for w in windows for f in w.causes.findings if f.rank == rank]
    causes = {f.cause for f in found}
    if len(causes) != 1:
        return ""
    cause = causes.pop()
    if not all(shares_cpu_host(f) for f in found):
        return f"; cause: {cause}"
    # ranks on one host exchange through its memory: "network" there is the collective's progress on its CPU
    named = "late out of the previous collective" if cause == CAUSE_NETWORK else cause
    return f"; cause: {named} (its peers share its host's CPU cores: this can be that host's contention)"


def _world_size(results: list[RankResult]) -> int | None:
    sizes = [r.world_size for r in results if r.world_size]
    return max(sizes) if sizes else None
